"""Finds, in an interpreted launch, memory that two programs of the launch touch in an
order-dependent way: what the interpreter cannot show by running them one after another.

On a GPU the programs (CTAs) of one launch run in no fixed order and see each other's
stores at no fixed time. Triton's interpreter runs them one after another, in grid order,
so a kernel whose result depends on that order (two programs storing to one element, one
program reading what another stores) passes on the CPU and fails, sometimes, on the
device. Within `checked_launch` every memory access of the launch is logged by program
and, when the launch ends, each byte of the launch's output buffers is checked to be:

* stored to (plain stores) by at most one program,
* read by no program other than the one that stores to it, and
* if updated by atomics (any number of programs may), neither stored to nor read by a
  plain access from another program.

A store or an atomic anywhere but the output buffers (an input, or past an allocation's
end) is an error too, and so is a load outside every input and output (past an end): the
interpreter reads or writes whatever host memory lies there, where a GPU reads another
allocation or stops at an illegal address. A violation raises `ProgramConflictError`
naming the kernel, the buffer, the element and two programs (or the stray address).

Accesses are logged as byte addresses (an element of k bytes is its k bytes), so two
programs storing to neighbouring bfloat16 elements of one 4-byte word do not conflict,
as they do not on a GPU.

Within one program, a load or a store of bytes the program stored to since its last
`tl.debug_barrier()` is an error as well: its threads run in no fixed order either, and
Triton orders global memory between them only at a barrier. Which thread holds which
element is the compiler's layout, which the interpreter does not have, so a kernel whose
store and later access share one layout (the same thread each time) is reported too: a
barrier costs little, and states the order the kernel relies on.
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


def _element_starts(pointers: np.ndarray, lanes: np.ndarray | None) -> np.ndarray:
    """The addresses a memory access's live lanes (`lanes` true; None: all) point at."""
    addresses = np.asarray(pointers, dtype=np.uint64).ravel()
    if lanes is None:
        return addresses
    return addresses[np.broadcast_to(np.asarray(lanes, bool), pointers.shape).ravel()]


def _bytes_of(starts: np.ndarray, width: int) -> np.ndarray:
    """Every byte of the `width`-byte elements at `starts`."""
    if width == 1:
        return starts
    return (starts[:, None] + np.arange(width, dtype=np.uint64)).ravel()


def _width(pointers: Any) -> int:
    """Bytes an element of this pointer tensor's element type spans (int1: one byte)."""
    return max(1, pointers.get_element_ty().primitive_bitwidth // 8)


class _AccessLog:
    """Every access of one launch, kept per program as sorted unique byte addresses."""

    KINDS = ("read", "store", "atomic")

    def __init__(self, buffers: Sequence[Buffer], inputs: Sequence[Buffer] = ()):
        self.buffers = list(buffers)
        self.outputs = _Intervals(self.buffers)
        self.readable = _Intervals([*self.buffers, *inputs])
        self.programs: list[tuple[int, int, int]] = []
        self.done: dict[str, list[np.ndarray]] = {kind: [] for kind in self.KINDS}
        # The first read outside every buffer, inputs included: (address, program index).
        self.stray_read: tuple[int, int] | None = None
        # The first access of a program to what it stored since its last barrier:
        # (kind, address, program index).
        self.unfenced: tuple[str, int, int] | None = None
        self._current: tuple[int, int, int] | None = None
        self._pending: dict[str, list[np.ndarray]] = {kind: [] for kind in self.KINDS}
        # Sorted unique bytes the current program stored to since its last barrier.
        self._stored_since_barrier = np.empty(0, np.uint64)

    def record(
        self, kind: str, program: tuple[int, int, int], starts: np.ndarray, width: int = 1
    ) -> None:
        """Program `program`'s `kind` access to the `width`-byte elements at `starts`."""
        if program != self._current:
            self._close_program()
            self._current = program
            self.programs.append(program)
        if kind == "read":  # only reads of what a launch may write can conflict
            writable = self.outputs.hold(starts, width)
            if self.stray_read is None and not writable.all():
                stray = starts[~(writable | self.readable.hold(starts, width))]
                if stray.size:
                    self.stray_read = int(stray[0]), len(self.programs) - 1
            starts = starts[writable]
        addresses = _bytes_of(starts, width)
        if not addresses.size:
            return
        if kind != "atomic":
            self._note_unfenced(kind, addresses)
        self._pending[kind].append(addresses)

    def _note_unfenced(self, kind: str, addresses: np.ndarray) -> None:
        """Notes the first read or store of bytes this program stored since its last
        barrier; a store joins the bytes later accesses are compared with."""
        if self.unfenced is not None:
            return
        stored = self._stored_since_barrier
        if stored.size:
            at = np.minimum(np.searchsorted(stored, addresses), stored.size - 1)
            again = addresses[stored[at] == addresses]
        else:
            again = stored
        if again.size:
            self.unfenced = kind, int(again[0]), len(self.programs) - 1
        elif kind == "store":
            self._stored_since_barrier = np.union1d(stored, addresses)

    def barrier(self) -> None:
        """A `tl.debug_barrier()` in the current program: its earlier stores are seen by
        all its threads from here on."""
        self._stored_since_barrier = np.empty(0, np.uint64)

    def _close_program(self) -> None:
        self.barrier()  # the next program's stores start afresh
        if self._current is None:
            return
        for kind in self.KINDS:
            pending = self._pending[kind]
            self.done[kind].append(
                np.unique(np.concatenate(pending)) if pending else np.empty(0, np.uint64)
            )
            pending.clear()

    def labelled(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, program index) of every program's `kind` accesses, sorted by
        address: each program's addresses are unique, so a repeated address is touched by
        two programs."""
        self._close_program()
        self._current = None
        per_program = self.done[kind]
        if not per_program:
            return np.empty(0, np.uint64), np.empty(0, np.int64)
        addresses = np.concatenate(per_program)
        owners = np.repeat(np.arange(len(per_program)), [a.size for a in per_program])
        order = np.argsort(addresses, kind="stable")
        return addresses[order], owners[order]


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
    def __init__(self, kernel_name: str, log: _AccessLog):
        self.kernel_name = kernel_name
        self.log = log

    def check(self) -> None:
        stores = self.log.labelled("store")
        atomics = self.log.labelled("atomic")
        reads = self.log.labelled("read")
        if self.log.stray_read is not None:
            address, program = self.log.stray_read
            raise ProgramConflictError(
                f"{self.kernel_name}: program {self.log.programs[program]} reads address "
                f"{address:#x}, outside every input and output of the launch (past an end): "
                "on a GPU another allocation's bytes, or an illegal address"
            )
        for addresses, kind in ((stores[0], "stores to"), (atomics[0], "atomically updates")):
            outside = addresses[~self.log.outputs.hold(addresses)]
            if outside.size:
                raise ProgramConflictError(
                    f"{self.kernel_name}: a program {kind} address {int(outside[0]):#x}, "
                    "outside every output buffer of the launch (an input, or past an end)"
                )
        if self.log.unfenced is not None:
            kind, address, program = self.log.unfenced
            raise ProgramConflictError(
                f"{self.kernel_name}: program {self.log.programs[program]} "
                f"{'reads' if kind == 'read' else 'stores to'} {self._element(address)}, "
                "which it stored to earlier with no barrier between (tl.debug_barrier()): on "
                "a GPU another of its threads may hold that store, not yet visible or landing "
                "later"
            )
        for (a, b), what in (
            ((stores, stores), "store to"),
            ((stores, atomics), "store to / atomically update"),
            ((reads, stores), "read / store to"),
            ((reads, atomics), "read / atomically update"),
        ):
            found = _first_cross_conflict(a, b)
            if found is not None:
                self._raise(what, *found)

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
    Their signatures differ between Triton 3.6 and 3.9 past the arguments read here."""
    builder = triton_interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
    atomic_depth = [0]  # 3.9's atomic loads and stores go through the masked ones

    def logged(self, kind: str, pointers: Any, lanes: Any) -> None:
        kind = "atomic" if atomic_depth[0] else kind
        starts = _element_starts(pointers.data, lanes)
        log.record(kind, self.grid_idx, starts, _width(pointers))

    def masked_load(self, ptrs, mask, *rest, **named):
        logged(self, "read", ptrs, mask.data)
        return load(self, ptrs, mask, *rest, **named)

    def masked_store(self, ptrs, value, mask, *rest, **named):
        logged(self, "store", ptrs, mask.data)
        return store(self, ptrs, value, mask, *rest, **named)

    def atomic_rmw(self, op, ptr, val, mask, *rest, **named):
        logged(self, "atomic", ptr, mask.data)
        return rmw(self, op, ptr, val, mask, *rest, **named)

    def atomic_cas(self, ptr, *rest, **named):
        logged(self, "atomic", ptr, None)
        return cas(self, ptr, *rest, **named)

    def barrier(self, *rest, **named):
        log.barrier()
        return fence(self, *rest, **named)

    fence = builder.create_barrier
    patches = {
        "create_barrier": barrier,
        "create_masked_load": masked_load,
        "create_masked_store": masked_store,
        "create_atomic_rmw": atomic_rmw,
        "create_atomic_cas": atomic_cas,
    }
    for name in ("create_atomic_load", "create_atomic_store"):
        if name in vars(builder):
            patches[name] = _counting(vars(builder)[name], atomic_depth)
    return patches


def _counting(method: Callable[..., Any], depth: list[int]) -> Callable[..., Any]:
    def counted(self, *args, **named):
        depth[0] += 1
        try:
            return method(self, *args, **named)
        finally:
            depth[0] -= 1

    return counted


@contextlib.contextmanager
def checked_launch(
    kernel_name: str, buffers: Sequence[Buffer], inputs: Sequence[Buffer] = ()
) -> Iterator[None]:
    """Within: one interpreted launch (the caller holds the interpreter's launch lock)
    whose programs may write `buffers` and nothing else, and read those and `inputs`; on a
    normal exit, its accesses are checked (module docstring) and a conflict raises
    `ProgramConflictError`."""
    log = _AccessLog(buffers, inputs)
    with builder_patched(_patched_accesses(log)):
        yield
    _Checker(kernel_name, log).check()
