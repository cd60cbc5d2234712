"""Finds, in an interpreted launch, memory that two programs of the launch touch in an
order-dependent way: what the interpreter cannot show by running them one after another.

On a GPU the programs (CTAs) of one launch run in no fixed order and see each other's
stores at no fixed time. Triton's interpreter runs them one after another, in grid order,
so a kernel whose result depends on that order (two programs storing to one element, one
program reading what another stores) passes on the CPU and fails, sometimes, on the
device. Within `checked_launch` every memory access of the launch is logged by program
and, when the launch ends, each byte of the launch's output buffers is checked to be:

* stored to by at most one program,
* read by no program other than the one that stores to it, and
* if updated by atomics that commute (add, max, min, and, or, xor; any number of
  programs may), updated by one such operation only, and neither stored to nor read by
  another program.

Stores here include the atomics whose result depends on their order (exchange,
compare-and-swap, `tl.atomic_store`) and atomics of `scope="cta"`, atomic only among the
threads of one program; reads include atomic loads and polls. So a launch whose programs
synchronise through memory (a lock, a flag one sets and another polls) is reported too:
whether its result is order-independent is beyond what an access log can tell.

A store or an atomic anywhere but the output buffers (an input, or past an allocation's
end) is an error too, and so is a load outside every input and output (past an end):
raised before the access runs, since the interpreter would read or write whatever host
memory lies there (or crash), where a GPU reads another allocation or stops at an illegal
address. A violation raises `ProgramConflictError` naming the kernel, the buffer, the
element and two programs (or the stray address).

Accesses are logged as byte addresses (an element of k bytes is its k bytes), so two
programs storing to neighbouring bfloat16 elements of one 4-byte word do not conflict,
as they do not on a GPU.

Within one program, a load or a store of bytes the program stored to or updated
atomically since its last `tl.debug_barrier()`, and an atomic on bytes it stored to, are
errors as well, and so is one store whose lanes put different values in one element: its
threads run in no fixed order either, and Triton orders global memory between them only
at a barrier. Which thread holds which element is the compiler's layout, which the
interpreter does not have, so a kernel whose store and later access share one layout
(the same thread each time) is reported too: a barrier costs little, and states the order
the kernel relies on. A store after a load of the same bytes is not checked: reading an
element and storing what was computed from it is the common, safe case, and the log does
not know what a value was computed from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from triton.runtime import interpreter as triton_interpreter

from jax_bridge.launch.builder_patches import builder_patched


class ProgramConflictError(RuntimeError):
    """Two programs of one launch touch the same memory in an order-dependent way, or a
    program touches memory outside the launch's buffers."""


# Process-wide, not a context variable: JAX runs the interpreter's callbacks on threads of
# its own, which a context set in the caller's thread would not reach.
_checking = [False]


def set_checking(enabled: bool) -> bool:
    """Turns the check on or off for every interpreted launch in this process (off by
    default: it costs a log of every access); returns the previous setting."""
    previous, _checking[0] = _checking[0], bool(enabled)
    return previous


def checking() -> bool:
    """Whether interpreted launches are checked (`set_checking`)."""
    return _checking[0]


@contextlib.contextmanager
def program_conflicts_checked() -> Iterator[None]:
    """Within: every interpreted launch in this process is checked (the test suite checks
    every launch unless `--no-conflict-check`)."""
    previous = set_checking(True)
    try:
        yield
    finally:
        set_checking(previous)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An array a launch reads or writes: its parameter name and the host array."""

    name: str
    array: np.ndarray

    @functools.cached_property
    def start(self) -> int:
        return self.array.ctypes.data

    @functools.cached_property
    def end(self) -> int:
        return self.start + self.array.nbytes


class _Intervals:
    """The bytes of some buffers, as sorted disjoint [start, end) intervals."""

    def __init__(self, buffers: Sequence[Buffer]):
        merged: list[list[int]] = []
        for start, end in sorted((b.start, b.end) for b in buffers if b.end > b.start):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        bounds = np.asarray(merged, np.uint64).reshape(-1, 2)
        self.starts, self.ends = bounds[:, 0], bounds[:, 1]

    def hold(self, addresses: np.ndarray, width: int = 1) -> np.ndarray:
        """Which `width`-byte elements starting at `addresses` lie wholly inside."""
        if not self.starts.size:
            return np.zeros(addresses.shape, bool)
        at = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        inside = self.ends[np.maximum(at, 0)] >= addresses + np.uint64(width)
        return (at >= 0) & inside


def _bytes_of(starts: np.ndarray, width: int) -> np.ndarray:
    """Every byte of the `width`-byte elements at `starts`."""
    if width == 1:
        return starts
    return (starts[:, None] + np.arange(width, dtype=np.uint64)).ravel()


def _width(pointers: Any) -> int:
    """Bytes an element of this pointer tensor's element type spans (int1: one byte)."""
    return max(1, pointers.get_element_ty().primitive_bitwidth // 8)


# Atomic read-modify-writes whose result is the same in any order (up to rounding, for
# floats): programs may all apply one of them to a byte. (XCHG is not among them.)
_COMMUTING = frozenset({"ADD", "FADD", "MAX", "MIN", "UMAX", "UMIN", "AND", "OR", "XOR"})
_ATOMIC = "atomic "  # the prefix of a commuting atomic's kind: "atomic ADD", ...

# Why a program's own accesses are order-dependent (`_AccessLog.unfenced`).
_NO_BARRIER = (
    "which it stored to or updated earlier with no barrier between (tl.debug_barrier()): "
    "on a GPU another of its threads may hold that access, not yet visible or landing later"
)
_ONE_STORE = "in one store: which of its lanes lands last is not fixed on a GPU"


class _AccessLog:
    """Every access of one launch, kept per program as sorted unique byte addresses, by
    kind: "read", "store" and "atomic <OP>" for each commuting operation (`_atomic_kind`)."""

    def __init__(self, kernel_name: str, buffers: Sequence[Buffer], inputs: Sequence[Buffer] = ()):
        self.kernel_name = kernel_name
        self.buffers = list(buffers)
        self.outputs = _Intervals(self.buffers)
        self.readable = _Intervals([*self.buffers, *inputs])
        self.programs: list[tuple[int, int, int]] = []
        # kind -> (program index, its sorted unique bytes) of every program that has some.
        self.done: dict[str, list[tuple[int, np.ndarray]]] = {}
        # The first access of a program its threads may see in no fixed order:
        # (what it did, address, program index, why that is order-dependent).
        self.unfenced: tuple[str, int, int, str] | None = None
        self._current: tuple[int, int, int] | None = None
        self._pending: dict[str, list[np.ndarray]] = {}
        # Sorted unique bytes the current program stored to (updated atomically) since its
        # last barrier.
        self._stored = self._updated = np.empty(0, np.uint64)

    def record(
        self,
        kind: str,
        program: tuple[int, int, int],
        starts: np.ndarray,
        width: int = 1,
        values: np.ndarray | None = None,
    ) -> None:
        """Program `program`'s `kind` access to the `width`-byte elements at `starts`
        (a store: of `values`, one per element, if given). An access outside the launch's
        buffers raises here, before it runs."""
        if program != self._current:
            self._close_program()
            self._current = program
            self.programs.append(program)
        writable = self.outputs.hold(starts, width)
        if kind == "read":  # only reads of what a launch may write can conflict
            stray = starts[~writable]
            stray = stray[~self.readable.hold(stray, width)]
            if stray.size:
                self._raise_stray(stray[0], "reads", "every input and output of the launch "
                                  "(past an end)")  # fmt: skip
            starts = starts[writable]
        elif not writable.all():
            verb = "stores to" if kind == "store" else "atomically updates"
            self._raise_stray(starts[~writable][0], verb, "every output buffer of the launch "
                              "(an input, or past an end)")  # fmt: skip
        if values is not None:
            self._note_lanes_disagree(starts, values)
        addresses = _bytes_of(starts, width)
        if addresses.size:
            self._note_unfenced(kind, addresses)
            self._pending.setdefault(kind, []).append(addresses)

    def _raise_stray(self, address: int, verb: str, outside: str) -> None:
        raise ProgramConflictError(
            f"{self.kernel_name}: program {self._current} {verb} address {int(address):#x}, "
            f"outside {outside}: on a GPU another allocation's bytes, or an illegal address"
        )

    def _note_lanes_disagree(self, starts: np.ndarray, values: np.ndarray) -> None:
        """Notes one store whose lanes put different values in one element (which lane
        lands last is not fixed on a GPU); equal values are harmless."""
        if self.unfenced is not None or starts.size < 2:
            return
        order = np.argsort(starts, kind="stable")
        ordered = starts[order]
        twice = np.flatnonzero(ordered[1:] == ordered[:-1])
        if not twice.size:
            return
        bits = np.ascontiguousarray(values[order]).view(np.uint8).reshape(starts.size, -1)
        differ = twice[np.any(bits[twice] != bits[twice + 1], axis=1)]
        if differ.size:
            address = int(ordered[differ[0]])
            self.unfenced = "stores two values to", address, len(self.programs) - 1, _ONE_STORE

    def _note_unfenced(self, kind: str, addresses: np.ndarray) -> None:
        """Notes the first access of bytes this program stored to (or, for a read or a
        store, updated atomically) since its last barrier; the access joins the bytes
        later ones are compared with."""
        if self.unfenced is not None:
            return
        atomic = kind not in ("read", "store")
        again = _among(addresses, self._stored)
        if not atomic and not again.size:
            again = _among(addresses, self._updated)
        if again.size:
            what = {"read": "reads", "store": "stores to"}.get(kind, "atomically updates")
            self.unfenced = what, int(again[0]), len(self.programs) - 1, _NO_BARRIER
        elif kind == "store":
            self._stored = np.union1d(self._stored, addresses)
        elif atomic:
            self._updated = np.union1d(self._updated, addresses)

    def barrier(self) -> None:
        """A `tl.debug_barrier()` in the current program: its earlier stores are seen by
        all its threads from here on."""
        self._stored = self._updated = np.empty(0, np.uint64)

    def _close_program(self) -> None:
        self.barrier()  # the next program's stores start afresh
        if self._current is None:
            return
        for kind, pending in self._pending.items():
            if pending:
                bytes_ = np.unique(np.concatenate(pending))
                self.done.setdefault(kind, []).append((len(self.programs) - 1, bytes_))
                pending.clear()

    def kinds(self) -> list[str]:
        """Every kind logged so far (closing the current program)."""
        self._close_program()
        self._current = None
        return list(self.done)

    def labelled(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, program index) of every program's `kind` accesses, sorted by
        address: each program's addresses are unique, so a repeated address is touched by
        two programs."""
        self._close_program()
        self._current = None
        per_program = self.done.get(kind, [])
        if not per_program:
            return np.empty(0, np.uint64), np.empty(0, np.int64)
        addresses = np.concatenate([a for _, a in per_program])
        owners = np.repeat([p for p, _ in per_program], [a.size for _, a in per_program])
        order = np.argsort(addresses, kind="stable")
        return addresses[order], owners[order]


def _among(addresses: np.ndarray, held: np.ndarray) -> np.ndarray:
    """The `addresses` found in `held` (sorted, unique)."""
    if not held.size:
        return held
    at = np.minimum(np.searchsorted(held, addresses), held.size - 1)
    return addresses[held[at] == addresses]


def _owner_range(addresses: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, ...]:
    """(unique addresses, lowest owner, highest owner) of address-sorted accesses."""
    unique, starts = np.unique(addresses, return_index=True)
    return unique, np.minimum.reduceat(owners, starts), np.maximum.reduceat(owners, starts)


def _first_cross_conflict(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[int, int, int] | None:
    """(address, owner in a, owner in b) of the lowest address accessed in `a` by one
    program and in `b` by another, or None. Both are (addresses, owners), address-sorted;
    `a` may be `b` (an address two programs touch the same way)."""
    if not (a[0].size and b[0].size):
        return None
    addr_a, low_a, high_a = _owner_range(*a)
    addr_b, low_b, high_b = _owner_range(*b)
    common, ia, ib = np.intersect1d(addr_a, addr_b, assume_unique=True, return_indices=True)
    low_a, high_a, low_b, high_b = low_a[ia], high_a[ia], low_b[ib], high_b[ib]
    # No conflict only where both sides hold the same single owner.
    alone = (low_a == high_a) & (low_b == high_b) & (low_a == low_b)
    hits = np.flatnonzero(~alone)
    if not hits.size:
        return None
    i = hits[0]
    pairs = ((low_a[i], low_b[i]), (low_a[i], high_b[i]), (high_a[i], low_b[i]))
    first, second = next((x, y) for x, y in pairs if x != y)
    return int(common[i]), int(first), int(second)


class _Checker:
    def __init__(self, log: _AccessLog):
        self.kernel_name = log.kernel_name
        self.log = log

    def check(self) -> None:
        """Raises for the first unfenced access within a program, then for the first pair
        of programs touching one byte in an order-dependent way (module docstring)."""
        kinds = self.log.kinds()
        if self.log.unfenced is not None:
            self._raise_unfenced(*self.log.unfenced)
        labelled = {kind: self.log.labelled(kind) for kind in ("read", "store", *kinds)}
        atomics = sorted(kind for kind in labelled if kind.startswith(_ATOMIC))
        pairs = [(("store", "store"), "store to")]
        pairs += [(("store", a), "store to / atomically update") for a in atomics]
        pairs += [(("read", "store"), "read / store to")]
        pairs += [(("read", a), "read / atomically update") for a in atomics]
        pairs += [
            ((a, b), f"atomically update ({a.removeprefix(_ATOMIC)} / {b.removeprefix(_ATOMIC)})")
            for a in atomics
            for b in atomics
            if a < b
        ]
        for (a, b), what in pairs:
            found = _first_cross_conflict(labelled[a], labelled[b])
            if found is not None:
                self._raise(what, *found)

    def _raise_unfenced(self, what: str, address: int, program: int, why: str) -> None:
        where = f"{self.kernel_name}: program {self.log.programs[program]} {what}"
        raise ProgramConflictError(f"{where} {self._element(address)}, {why}")

    def _element(self, address: int) -> str:
        """The output element holding byte `address`: `name[index] (shape ..., dtype)`."""
        buffer = next(b for b in self.log.buffers if b.start <= address < b.end)
        flat = (address - buffer.start) // buffer.array.itemsize
        index = np.unravel_index(flat, buffer.array.shape) if buffer.array.ndim else ()
        shape = buffer.array.shape
        return f"{buffer.name}{list(map(int, index))} (shape {shape}, {buffer.array.dtype})"

    def _raise(self, what: str, address: int, first: int, second: int) -> None:
        programs = self.log.programs
        raise ProgramConflictError(
            f"{self.kernel_name}: programs {programs[first]} and {programs[second]} "
            f"{what} {self._element(address)} in one launch: the result depends on their "
            "order, which a GPU does not fix"
        )


def _patched_accesses(log: _AccessLog) -> dict[str, Callable[..., Any]]:
    """Replacements for the interpreter builder's memory accesses that log them first.
    Their signatures differ between Triton 3.6 and 3.9 past the arguments read here.
    Triton 3.9's atomic loads, stores and polls run through the masked load and store
    (and its polls through `create_load`): logged as the reads and stores they are."""
    builder = triton_interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas, fence = builder.create_atomic_rmw, builder.create_atomic_cas, builder.create_barrier

    def logged(self, kind: str, pointers: Any, lanes: Any, values: Any = None) -> None:
        """Logs the elements the live lanes (`lanes` true; None: all) point at, and for a
        store the values they put there."""
        starts = np.asarray(pointers.data, dtype=np.uint64)
        live = np.ones(starts.shape, bool) if lanes is None else np.asarray(lanes, bool)
        live = np.broadcast_to(live, starts.shape)
        if values is not None:
            values = np.broadcast_to(values, starts.shape)[live]
        log.record(kind, self.grid_idx, starts[live], _width(pointers), values)

    def masked_load(self, ptrs, mask, *rest, **named):
        logged(self, "read", ptrs, mask.data)
        return load(self, ptrs, mask, *rest, **named)

    def masked_store(self, ptrs, value, mask, *rest, **named):
        logged(self, "store", ptrs, mask.data, value.data)
        return store(self, ptrs, value, mask, *rest, **named)

    def atomic_rmw(self, op, ptr, val, mask, sem, scope, *rest, **named):
        logged(self, _atomic_kind(op, scope), ptr, mask.data)
        return rmw(self, op, ptr, val, mask, sem, scope, *rest, **named)

    def atomic_cas(self, ptr, *rest, **named):
        logged(self, "store", ptr, None)  # the value left depends on the order
        return cas(self, ptr, *rest, **named)

    def barrier(self, *rest, **named):
        log.barrier()
        return fence(self, *rest, **named)

    return {
        "create_barrier": barrier,
        "create_masked_load": masked_load,
        "create_masked_store": masked_store,
        "create_atomic_rmw": atomic_rmw,
        "create_atomic_cas": atomic_cas,
    }


def _atomic_kind(op: Any, scope: Any) -> str:
    """The log's kind of an atomic read-modify-write: a store where its order matters (an
    exchange) or where it is atomic within one program only (`scope="cta"`)."""
    if op.name not in _COMMUTING or scope.name == "CTA":
        return "store"
    return _ATOMIC + op.name


@contextlib.contextmanager
def checked_launch(
    kernel_name: str, buffers: Sequence[Buffer], inputs: Sequence[Buffer] = ()
) -> Iterator[None]:
    """Within: one interpreted launch (the caller holds the interpreter's launch lock)
    whose programs may write `buffers` and nothing else, and read those and `inputs`; on a
    normal exit, its accesses are checked (module docstring) and a conflict raises
    `ProgramConflictError`."""
    log = _AccessLog(kernel_name, buffers, inputs)
    with builder_patched(_patched_accesses(log)):
        try:
            yield
        except Exception as error:  # the interpreter wraps what a program raised
            conflict = _conflict_behind(error)
            if conflict is None or conflict is error:
                raise
            raise conflict from None
    _Checker(log).check()


def _conflict_behind(error: BaseException | None) -> ProgramConflictError | None:
    """The `ProgramConflictError` `error` is, or was raised from, if any."""
    while error is not None and not isinstance(error, ProgramConflictError):
        error = error.__cause__
    return error
