"""A small mask algebra for splash attention: masks described by their rule, not an array.

mask[i, j] is True where q row i may attend kv row j. Computable masks (`CausalMask`,
`LocalMask`, `ChunkedCausalMask`, `PrefixLMMask`, `DocumentMask`) evaluate a rule on
positions: row i has position `q_sequence[i]` and kv row j position `kv_sequence[j]`
(both the identity unless given, e.g. the load-balanced order of `reorder_sequence`).
`PredicateMask` evaluates a user's `predicate(q, kv)` the same way (FlexAttention's
`mask_mod`). `NumpyMask` holds an array; `FullMask` allows everything; `|` and `&`
combine masks of one shape; `MultiHeadMask` gives every head its mask.

Every mask except `NumpyMask` and `PredicateMask` also states, for each q row, the kv
positions it allows as a few closed intervals (`row_intervals`): that is what lets
`process_mask` classify every block in O(q + blocks) work without a dense [q, kv] array.
The other two are classified from their dense values a few block rows at a time.
`CausalMask` and `LocalMask` keep JAX splash's conventions (q + offset >= kv) so code
written for those masks ports by changing the import; `PrefixLMMask` follows them;
`DocumentMask` aligns each document bottom-right, like `jax_bridge.varlen_attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CausalMask",
    "ChunkedCausalMask",
    "DocumentMask",
    "FullMask",
    "LocalMask",
    "LogicalAnd",
    "LogicalOr",
    "Mask",
    "MultiHeadMask",
    "NumpyMask",
    "PredicateMask",
    "PrefixLMMask",
    "make_causal_mask",
    "make_chunk_attention_mask",
    "make_local_attention_mask",
    "make_random_mask",
]

Array = Any  # np.ndarray, or jax.Array for a DocumentMask built under jax.jit
# Interval bounds that mean "no limit"; positions stay far below, and bounds computed from
# them never overflow int32.
UNBOUNDED = 2**30
# bool(mask) is almost always `or`/`and` written for `|`/`&`.
_BOOL_MESSAGE = "a Mask has no truth value: combine masks with | and &, not `or` and `and`"


def _as_positions(values: Array | None, length: int, name: str) -> np.ndarray | None:
    if values is None:
        return None
    if isinstance(values, jax.core.Tracer):
        raise TypeError(
            f"splash mask: {name} must be concrete (numpy, or an array outside jax.jit): it "
            "decides which blocks the kernels visit when the mask is built; only a "
            "DocumentMask's cu_seqlens may be traced"
        )
    positions = np.asarray(values)
    if positions.shape != (length,) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(
            f"splash mask: {name} must be integer [{length}], got {positions.dtype}"
            f"{list(positions.shape)}"
        )
    if length and (positions.min() < 0 or positions.max() >= UNBOUNDED):
        raise ValueError(f"splash mask: {name} must hold positions in [0, 2**30)")
    return positions.astype(np.int32)


def _check_shape(shape: Sequence[int], name: str) -> tuple[int, int]:
    if len(shape) != 2 or any(int(s) < 0 for s in shape):
        raise ValueError(f"{name}: shape must be (q_len, kv_len), got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


class Mask:
    """Base class: shape (q_len, kv_len), slicing to a dense block, `|` and `&`."""

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        """bool [rows, cols]: the dense values of a rectangle (slices only)."""
        if not isinstance(index, tuple) or len(index) != 2:
            raise NotImplementedError(f"{type(self).__name__}: index with two slices")
        rows, cols = (
            np.arange(n)[s] if isinstance(s, slice) else None
            for s, n in zip(index, self.shape, strict=True)
        )
        if rows is None or cols is None:
            raise NotImplementedError(f"{type(self).__name__}: index with two slices")
        return self.evaluate(rows[:, None], cols[None, :])

    def evaluate(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """bool, broadcast shape of rows and cols: mask[rows, cols] elementwise."""
        raise NotImplementedError

    def row_intervals(self) -> tuple[Array, Array] | None:
        """(lo, hi) int32 [q_len, m]: row i allows kv positions in the union of the
        closed intervals [lo[i, t], hi[i, t]] (empty where lo > hi); None when the mask
        has no such form (a NumpyMask). Positions are those of `kv_positions()`."""
        return None

    def kv_positions(self) -> Array | None:
        """int32 [kv_len] positions of the kv rows (None: kv row j has position j)."""
        return None

    def __or__(self, other: Mask) -> Mask:
        return LogicalOr(self, other)

    def __and__(self, other: Mask) -> Mask:
        return LogicalAnd(self, other)

    def __bool__(self) -> bool:
        raise TypeError(_BOOL_MESSAGE)


def _merge_sorted(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row's intervals and merge overlapping or adjacent ones.

    After this a row's non-empty intervals are disjoint and not adjacent, so a block of
    consecutive positions is covered by the union only if one interval covers it.
    """
    lo, hi = np.array(lo, np.int64), np.array(hi, np.int64)
    empty = lo > hi
    lo[empty], hi[empty] = UNBOUNDED, -UNBOUNDED  # empties sort last and merge with nothing
    order = np.argsort(lo, axis=1, kind="stable")
    lo, hi = np.take_along_axis(lo, order, 1), np.take_along_axis(hi, order, 1)
    rows = np.arange(len(lo))
    current = np.zeros(len(lo), np.int64)  # the interval the next one may merge into
    for t in range(1, lo.shape[1]):
        joins = (lo[:, t] <= hi[:, t]) & (lo[:, t] <= hi[rows, current] + 1)
        hi[rows[joins], current[joins]] = np.maximum(hi[rows, current], hi[:, t])[joins]
        lo[joins, t], hi[joins, t] = UNBOUNDED, -UNBOUNDED
        current = np.where(~joins & (lo[:, t] <= hi[:, t]), t, current)
    return lo.astype(np.int32), hi.astype(np.int32)


class _Binary(Mask):
    """`left op right` on masks of one shape."""

    def __init__(self, left: Mask, right: Mask):
        for side in (left, right):
            if not isinstance(side, Mask) or isinstance(side, MultiHeadMask):
                raise TypeError(
                    f"{type(self).__name__}: operands must be 2-D masks, got {type(side).__name__}"
                )
        if left.shape != right.shape:
            raise ValueError(
                f"{type(self).__name__}: mask shapes differ: {left.shape} vs {right.shape}"
            )
        if any(getattr(side, "traced", False) for side in (left, right)):
            # Its blocks are classified in the graph, for the document mask alone.
            raise TypeError(
                f"{type(self).__name__}: a DocumentMask of traced arrays (built under "
                "jax.jit) cannot be combined with & or |: pass it alone (causal and a "
                "window are its own options) or build it from static arrays."
            )
        self.left, self.right = left, right

    @property
    def shape(self) -> tuple[int, ...]:
        return self.left.shape

    def _operand_intervals(self):
        both = (self.left.row_intervals(), self.right.row_intervals())
        kv = (self.left.kv_positions(), self.right.kv_positions())
        same_kv = (kv[0] is None and kv[1] is None) or (
            kv[0] is not None and kv[1] is not None and np.array_equal(kv[0], kv[1])
        )
        if None in both or not same_kv:
            return None
        return both

    def kv_positions(self) -> Array | None:
        return self.left.kv_positions()

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and (self.left, self.right) == (other.left, other.right)

    def __hash__(self) -> int:
        return hash((type(self), self.left, self.right))


class LogicalOr(_Binary):
    def evaluate(self, rows, cols):
        return self.left.evaluate(rows, cols) | self.right.evaluate(rows, cols)

    def row_intervals(self):
        both = self._operand_intervals()
        if both is None:
            return None
        (lo_a, hi_a), (lo_b, hi_b) = both
        lo, hi = np.concatenate([lo_a, lo_b], 1), np.concatenate([hi_a, hi_b], 1)
        return _merge_sorted(np.asarray(lo), np.asarray(hi))


class LogicalAnd(_Binary):
    def evaluate(self, rows, cols):
        return self.left.evaluate(rows, cols) & self.right.evaluate(rows, cols)

    def row_intervals(self):
        both = self._operand_intervals()
        if both is None:
            return None
        (lo_a, hi_a), (lo_b, hi_b) = both
        # Pairwise intersections of two disjoint families are disjoint.
        lo = np.maximum(lo_a[:, :, None], lo_b[:, None, :]).reshape(len(lo_a), -1)
        hi = np.minimum(hi_a[:, :, None], hi_b[:, None, :]).reshape(len(lo_a), -1)
        return _merge_sorted(lo, hi)


@dataclasses.dataclass(frozen=True)
class MultiHeadMask(Mask):
    """One 2-D mask per head: shape (num_heads, q_len, kv_len)."""

    masks: tuple[Mask, ...]

    def __init__(self, masks: Sequence[Mask]):
        masks = tuple(masks)
        if not masks:
            raise ValueError("MultiHeadMask: needs at least one head mask")
        for m in masks:
            if isinstance(m, MultiHeadMask):
                raise ValueError("MultiHeadMask: head masks must be 2-D masks, not nested")
            if not isinstance(m, Mask):
                raise TypeError(f"MultiHeadMask: head masks must be Masks, got {type(m)}")
            if m.shape != masks[0].shape:
                raise ValueError(
                    f"MultiHeadMask: head mask shapes differ: {masks[0].shape} vs {m.shape}"
                )
        object.__setattr__(self, "masks", masks)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.masks), *self.masks[0].shape)

    def __getitem__(self, index):
        if not isinstance(index, tuple) or len(index) != 3:
            raise NotImplementedError("MultiHeadMask: index with (head, slice, slice)")
        head, *rest = index
        if isinstance(head, slice):
            return np.stack([m[tuple(rest)] for m in self.masks[head]])
        return self.masks[head][tuple(rest)]


@dataclasses.dataclass(frozen=True, eq=False)
class NumpyMask(Mask):
    """A mask held as a dense bool array [q_len, kv_len]."""

    array: np.ndarray

    def __post_init__(self):
        array = np.asarray(self.array)
        if array.ndim != 2:
            raise ValueError(f"NumpyMask: array must be 2-D, got shape {array.shape}")
        if array.dtype != np.bool_:
            raise ValueError(f"NumpyMask: array must be bool, got {array.dtype}")
        object.__setattr__(self, "array", array)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    def __getitem__(self, index: Any) -> np.ndarray:
        """The array indexed as numpy indexes it (any index, as JAX's NumpyMask)."""
        return self.array[index]

    def evaluate(self, rows, cols):
        return self.array[rows, cols]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NumpyMask) and np.array_equal(self.array, other.array)

    def __hash__(self) -> int:
        return hash((self.array.shape, self.array.tobytes()))


@dataclasses.dataclass(frozen=True)
class FullMask(Mask):
    """Every pair attends."""

    _shape: tuple[int, int]

    def __init__(self, shape: Sequence[int] | None = None, *, _shape: Sequence[int] | None = None):
        """`FullMask(shape)`; `_shape=` is JAX's keyword for the same (give one)."""
        if (shape is None) == (_shape is None):
            raise TypeError("FullMask: give the shape once, as FullMask(shape) or _shape=")
        shape = _shape if shape is None else shape
        object.__setattr__(self, "_shape", _check_shape(shape, "FullMask"))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def evaluate(self, rows, cols):
        return np.ones(np.broadcast_shapes(np.shape(rows), np.shape(cols)), np.bool_)

    def row_intervals(self):
        full = np.full((self._shape[0], 1), UNBOUNDED, np.int32)
        return -full, full


# ---- rules: hashable, and written so they run on numpy arrays and inside a kernel.


@dataclasses.dataclass(frozen=True)
class CausalRule:
    """q + offset >= kv."""

    offset: int = 0

    def __call__(self, q, kv):
        return q + self.offset >= kv


@dataclasses.dataclass(frozen=True)
class LocalRule:
    """q + offset - left <= kv <= q + offset + right (None: that side unbounded)."""

    left: int | None
    right: int | None
    offset: int = 0

    def __call__(self, q, kv):
        shifted = q + self.offset
        allowed = (shifted == shifted) | (kv == kv)  # all True, shaped like the pair
        if self.left is not None:
            allowed = allowed & (shifted - self.left <= kv)
        if self.right is not None:
            allowed = allowed & (shifted + self.right >= kv)
        return allowed


@dataclasses.dataclass(frozen=True)
class ChunkedCausalRule:
    """Causal inside chunks of `chunk_size` positions: q // c == kv // c and q >= kv."""

    chunk_size: int

    def __call__(self, q, kv):
        return (q // self.chunk_size == kv // self.chunk_size) & (q >= kv)


@dataclasses.dataclass(frozen=True)
class PrefixLMRule:
    """kv < prefix_length or q + offset >= kv: a bidirectional prefix, causal after it."""

    prefix_length: int
    offset: int = 0

    def __call__(self, q, kv):
        return (q + self.offset >= kv) | (kv < self.prefix_length)


class _ComputableMask(Mask):
    """mask[i, j] = rule(q_sequence[i], kv_sequence[j])."""

    rule: Callable[[Array, Array], Array]

    def __init__(self, shape, rule, q_sequence=None, kv_sequence=None, shard_count: int = 1):
        name = type(self).__name__
        self._shape = _check_shape(shape, name)
        if shard_count < 1 or self._shape[0] % (shard_count * shard_count):
            raise ValueError(f"{name}: shard_count**2 must divide q_len {self._shape[0]}")
        self.rule = rule
        q = _as_positions(q_sequence, self._shape[0], f"{name}: q_sequence")
        self.q_sequence = np.arange(self._shape[0], dtype=np.int32) if q is None else q
        self.kv_sequence = _as_positions(kv_sequence, self._shape[1], f"{name}: kv_sequence")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def mask_function(self) -> Callable[[Array, Array], Array]:
        """The rule on positions (JAX splash's name for it)."""
        return self.rule

    def kv_positions(self):
        return self.kv_sequence

    def evaluate(self, rows, cols):
        kv = cols if self.kv_sequence is None else self.kv_sequence[cols]
        return np.asarray(self.rule(self.q_sequence[rows], kv), np.bool_)

    def _key(self):
        kv = None if self.kv_sequence is None else self.kv_sequence.tobytes()
        return (type(self), self._shape, self.rule, self.q_sequence.tobytes(), kv)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ComputableMask) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _clip(values: np.ndarray) -> np.ndarray:
    return np.clip(values, -UNBOUNDED, UNBOUNDED).astype(np.int32)[:, None]


class CausalMask(_ComputableMask):
    """q_sequence[i] + offset >= kv_sequence[j] (JAX splash's CausalMask)."""

    def __init__(
        self, shape, offset: int = 0, shard_count: int = 1, *, q_sequence=None, kv_sequence=None
    ):
        self.offset = int(offset)
        super().__init__(shape, CausalRule(self.offset), q_sequence, kv_sequence, shard_count)

    def row_intervals(self):
        q = self.q_sequence.astype(np.int64)
        return _clip(np.full_like(q, -UNBOUNDED)), _clip(q + self.offset)


class LocalMask(_ComputableMask):
    """q + offset - left <= kv <= q + offset + right; `window_size=(left, right)`, a side
    None is unbounded (JAX splash's LocalMask; `window=` is accepted as an alias)."""

    def __init__(
        self,
        shape,
        window_size=None,
        offset: int = 0,
        shard_count: int = 1,
        *,
        window=None,
        q_sequence=None,
        kv_sequence=None,
    ):
        if (window_size is None) == (window is None):
            raise ValueError("LocalMask: give window_size=(left, right) (or window=)")
        sides = window_size if window is None else window
        if isinstance(sides, str) or np.ndim(sides) != 1 or len(sides) != 2:
            raise TypeError(f"LocalMask: window_size must be (left, right), got {sides!r}")
        left, right = sides
        for side in (left, right):
            if side is not None and int(side) < 0:
                raise ValueError(f"LocalMask: window sides must be >= 0 or None, got {side}")
        self.window_size = (
            None if left is None else int(left),
            None if right is None else int(right),
        )
        self.offset = int(offset)
        rule = LocalRule(*self.window_size, self.offset)
        super().__init__(shape, rule, q_sequence, kv_sequence, shard_count)

    def row_intervals(self):
        q = self.q_sequence.astype(np.int64) + self.offset
        left, right = self.window_size
        lo = q - left if left is not None else np.full_like(q, -UNBOUNDED)
        hi = q + right if right is not None else np.full_like(q, UNBOUNDED)
        return _clip(lo), _clip(hi)


class ChunkedCausalMask(_ComputableMask):
    """Causal attention inside consecutive chunks of `chunk_size` positions."""

    def __init__(
        self, shape, chunk_size: int, shard_count: int = 1, *, q_sequence=None, kv_sequence=None
    ):
        if int(chunk_size) <= 0:
            raise ValueError(f"ChunkedCausalMask: chunk_size must be positive, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        rule = ChunkedCausalRule(self.chunk_size)
        super().__init__(shape, rule, q_sequence, kv_sequence, shard_count)

    def row_intervals(self):
        q = self.q_sequence.astype(np.int64)
        return _clip(q // self.chunk_size * self.chunk_size), _clip(q)


def _check_integer(value: Any, mask: str, argument: str) -> int:
    """int(value) for a Python or numpy integer (bools and floats rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{mask}: {argument} must be an integer, got {type(value).__name__}")
    return int(value)


class PrefixLMMask(_ComputableMask):
    """Prefix-LM attention: a bidirectional prefix (the prompt), causal after it.

        mask[i, j] = kv_sequence[j] < prefix_length  or  q_sequence[i] + offset >= kv_sequence[j]

    i.e. `CausalMask(shape, offset) | (kv < prefix_length)`. Conventions follow
    `CausalMask` (top-left aligned positions, `offset` shifts the q side): the prefix is
    counted in kv positions and does not move with `offset`, so keys at positions
    [0, prefix_length) are visible to every query whatever q_len, kv_len or offset are.
    A query inside the prefix therefore sees the whole prefix (and, with offset > 0, the
    causal keys past it); prefix_length=0 is `CausalMask(shape, offset)`, and
    prefix_length >= kv_len allows every pair. For a decode step over a kv cache
    (q_len < kv_len, offset = kv_len - q_len) the prompt stays visible as it should.

    Args:
      shape: (q_len, kv_len).
      prefix_length: int in [0, 2**30]: the number of leading kv positions every query sees.
      offset: added to q positions in the causal term (as `CausalMask.offset`).
      shard_count, q_sequence, kv_sequence: as `CausalMask`.
    """

    def __init__(
        self,
        shape,
        prefix_length: int,
        offset: int = 0,
        shard_count: int = 1,
        *,
        q_sequence=None,
        kv_sequence=None,
    ):
        prefix_length = _check_integer(prefix_length, "PrefixLMMask", "prefix_length")
        if not 0 <= prefix_length <= UNBOUNDED:
            # The upper bound keeps `kv < prefix_length` an int32 comparison in the kernel.
            raise ValueError(
                f"PrefixLMMask: prefix_length must be in [0, 2**30], got {prefix_length}"
            )
        self.prefix_length = prefix_length
        self.offset = _check_integer(offset, "PrefixLMMask", "offset")
        rule = PrefixLMRule(self.prefix_length, self.offset)
        super().__init__(shape, rule, q_sequence, kv_sequence, shard_count)

    def row_intervals(self):
        # The union of [-inf, prefix_length - 1] and [-inf, q + offset] is one interval.
        q = self.q_sequence.astype(np.int64)
        hi = np.maximum(q + self.offset, self.prefix_length - 1)
        return _clip(np.full_like(q, -UNBOUNDED)), _clip(hi)


class PredicateMask(Mask):
    """A mask written once as a function: mask[i, j] = predicate(q_sequence[i], kv_sequence[j]).

    FlexAttention's `mask_mod` for splash: `predicate(q_index, kv_index)` gets two int32
    arrays that broadcast against each other (e.g. [n, 1] and [1, m], or 3-D stacks of
    blocks) and returns a bool array of their broadcast shape, or one that broadcasts to
    it (`lambda q, kv: kv < 10` is fine). Write it with numpy or jax.numpy operators
    (`&`, `|`, comparisons, `//`, `%`, `np.where`); it runs on the host only.

    `process_mask` classifies its blocks from dense values computed a few block rows at
    a time (never the whole [q_len, kv_len] at once) and hands the kernels its partial
    blocks, deduplicated, exactly as for a `NumpyMask`: the TPU kernels never call the
    predicate. It composes with `|` and `&` like any mask.

    Args:
      shape: (q_len, kv_len).
      predicate: (q_index, kv_index) -> bool array, as above. Masks compare equal when
        their predicates do (functions: the same object), so reuse one function to share
        `process_mask`'s cache.
      name: a label for errors and repr (default the predicate's __name__).
      triton_predicate: optional `@triton.jit` function (q_index, kv_index) -> bool
        computing the same predicate on Triton tensors: the hook a GPU block-sparse kernel
        will call in its partial blocks. Stored as an opaque object (pallas_tpu never
        imports triton) and unused on TPU.
      q_sequence, kv_sequence: positions of the q / kv rows, as for `CausalMask`.
    """

    def __init__(
        self,
        shape,
        predicate: Callable[[Array, Array], Array],
        *,
        name: str | None = None,
        triton_predicate: Any = None,
        q_sequence=None,
        kv_sequence=None,
    ):
        if not callable(predicate):
            raise TypeError(f"PredicateMask: predicate must be callable, got {type(predicate)}")
        if triton_predicate is not None and not callable(triton_predicate):
            raise TypeError(
                "PredicateMask: triton_predicate must be a @triton.jit function or None, "
                f"got {type(triton_predicate).__name__}"
            )
        self.name = str(name or getattr(predicate, "__name__", type(predicate).__name__))
        self._shape = _check_shape(shape, f"PredicateMask {self.name!r}")
        self.predicate, self.triton_predicate = predicate, triton_predicate
        label = f"PredicateMask {self.name!r}"
        q = _as_positions(q_sequence, self._shape[0], f"{label}: q_sequence")
        self.q_sequence = np.arange(self._shape[0], dtype=np.int32) if q is None else q
        self.kv_sequence = _as_positions(kv_sequence, self._shape[1], f"{label}: kv_sequence")
        # Fail at construction, not deep inside process_mask: probe a 2 x 2 corner.
        corner = np.arange(min(2, self._shape[0])), np.arange(min(2, self._shape[1]))
        self.evaluate(corner[0][:, None], corner[1][None, :])

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def kv_positions(self):
        return self.kv_sequence

    def evaluate(self, rows, cols):
        q = self.q_sequence[rows]
        kv = np.asarray(cols) if self.kv_sequence is None else self.kv_sequence[cols]
        return self._call(q.astype(np.int32), kv.astype(np.int32))

    def _call(self, q: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """predicate(q, kv) as a bool numpy array of the pair's broadcast shape."""
        result = self.predicate(q, kv)
        dtype = getattr(result, "dtype", None)
        if dtype is None and isinstance(result, (bool, np.bool_)):
            dtype = np.dtype(np.bool_)
        if dtype is None or np.dtype(dtype) != np.bool_:
            got = type(result).__name__ if dtype is None else str(dtype)
            raise TypeError(f"PredicateMask {self.name!r}: predicate must return bool, got {got}")
        expected = np.broadcast_shapes(q.shape, kv.shape)
        result = np.asarray(result)
        try:
            return np.broadcast_to(result, expected)
        except ValueError:
            raise ValueError(
                f"PredicateMask {self.name!r}: predicate returned shape {result.shape} for "
                f"indices of shapes {q.shape} and {kv.shape}; expected {expected} "
                "(or a shape that broadcasts to it)"
            ) from None

    def _key(self):
        def identity(f):  # unhashable callables (e.g. mutable dataclasses) by identity
            try:
                hash(f)
            except TypeError:
                return ("id", id(f))
            return f

        kv = None if self.kv_sequence is None else self.kv_sequence.tobytes()
        sequences = (self.q_sequence.tobytes(), kv)
        return (self._shape, identity(self.predicate), identity(self.triton_predicate), sequences)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PredicateMask) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"PredicateMask({self._shape}, {self.name!r})"


def _is_traced(*values: Any) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in values if v is not None)


@dataclasses.dataclass(frozen=True)
class DocumentTokens:
    """Per-token view of a document mask (numpy arrays, or jax arrays under jit).

    q_document: int32 [q_len] document id (-1: padding); kv_document: int32 [kv_len]
    (-2: padding); q_relative / kv_relative: int32 position minus the document's end
    (bottom-right alignment: the last token of every document is -1); q_kv_start /
    q_kv_end: int32 [q_len] the kv token range [start, end) of each q token's document.
    """

    q_document: Array
    kv_document: Array
    q_relative: Array
    kv_relative: Array
    q_kv_start: Array
    q_kv_end: Array


def searchsorted(xp, sorted_values: Array, values: Array, side: str = "left") -> Array:
    """numpy's searchsorted for numpy, and for jnp arrays one without a `while` loop.

    jnp's default method is a loop whose every iteration, on a GPU, waits on the host;
    `method="sort"` is one sort of both arrays, O((n + m) log(n + m)), loop-free.
    """
    if xp is np:
        return np.searchsorted(sorted_values, values, side=side)
    return jnp.searchsorted(sorted_values, values, side=side, method="sort")


def _tokens_of_cu_seqlens(xp, cu_q, cu_kv, q_len: int, kv_len: int) -> DocumentTokens:
    def side(cu, length, padding):
        token = xp.arange(length, dtype=np.int32)
        doc = searchsorted(xp, cu, token, side="right").astype(np.int32) - 1
        inside = (doc >= 0) & (doc < cu.shape[0] - 1)
        safe = xp.clip(doc, 0, max(cu.shape[0] - 2, 0))
        end = cu[safe + 1] if cu.shape[0] > 1 else xp.zeros_like(token)
        return xp.where(inside, doc, padding), xp.where(inside, token - end, 0), safe

    q_doc, q_rel, q_safe = side(cu_q, q_len, -1)
    kv_doc, kv_rel, _ = side(cu_kv, kv_len, -2)
    if cu_kv.shape[0] > 1:
        start, end = cu_kv[q_safe], cu_kv[q_safe + 1]
    else:
        start = end = xp.zeros_like(q_doc)
    return DocumentTokens(q_doc, kv_doc, q_rel, kv_rel, start, end)


def _tokens_of_segment_ids(xp, q_ids, kv_ids) -> DocumentTokens:
    """Documents are runs of one positive id, ids ascending; ids <= 0 are padding."""

    def side(ids, padding):
        token = xp.arange(ids.shape[0], dtype=np.int32)
        valid = ids > 0
        # Sorted keys (padding last) make each document's range one searchsorted away.
        key = xp.where(valid, ids, UNBOUNDED).astype(np.int32)
        end = searchsorted(xp, key, key, side="right").astype(np.int32)
        return xp.where(valid, ids, padding).astype(np.int32), xp.where(valid, token - end, 0), key

    q_doc, q_rel, q_key = side(q_ids, -1)
    kv_doc, kv_rel, kv_key = side(kv_ids, -2)
    # Out-of-order ids (only reachable traced: concrete ones are refused) would make the
    # searches below garbage; every q row becomes padding instead, so the whole mask is
    # empty (out 0, lse -inf): a visible failure, never attention across documents.
    ordered = xp.all(q_key[1:] >= q_key[:-1]) & xp.all(kv_key[1:] >= kv_key[:-1])
    q_doc = xp.where(ordered, q_doc, -1).astype(np.int32)
    start = searchsorted(xp, kv_key, q_doc, side="left").astype(np.int32)
    end = searchsorted(xp, kv_key, q_doc, side="right").astype(np.int32)
    return DocumentTokens(q_doc, kv_doc, q_rel, kv_rel, start, end)


def _check_cu_seqlens_form(cu, name: str) -> None:
    """ValueError unless `cu` (concrete or traced) is [num_docs + 1]; TypeError unless its
    dtype is an integer one (bool is not; any width or sign, as varlen_attention takes)."""
    shape = np.shape(cu)
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"DocumentMask: {name} must have shape [num_docs + 1], got {shape}")
    dtype = cu.dtype if hasattr(cu, "dtype") else np.asarray(cu).dtype
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"DocumentMask: {name} must have an integer dtype, got {dtype}")


def _check_cu_seqlens(cu: np.ndarray, length: int, name: str) -> None:
    cu = cu.astype(np.int64)  # unsigned differences would wrap past a decrease
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > length:
        raise ValueError(
            f"DocumentMask: {name} must start at 0, never decrease and end at most at "
            f"{length}; got {cu.tolist()[:8]}..."
        )


def _check_segment_ids(ids: np.ndarray, name: str) -> None:
    valid = ids[ids > 0]
    padding_inside = np.any((ids[:-1] <= 0) & (ids[1:] > 0)) if ids.size > 1 else False
    if np.any(np.diff(valid) < 0) or padding_inside:
        raise ValueError(
            f"DocumentMask.from_segment_ids: {name} must hold ascending positive document "
            "ids (one contiguous run each) followed by padding ids <= 0"
        )


class DocumentMask(Mask):
    """Attention inside documents only, optionally causal / windowed within each document.

    Documents come from `cu_seqlens` (document d holds q tokens cu_seqlens_q[d] :
    cu_seqlens_q[d + 1] and the kv tokens of the same range in cu_seqlens_kv) or from
    segment ids (`from_segment_ids`). Inside a document the alignment is bottom-right,
    as in `varlen_attention`: q token i and kv token j of one document may attend when
        j_rel >= i_rel - left   and   j_rel <= i_rel + right,
    with rel = position - document end (`causal=True` means right = 0). Tokens past the
    last document are padding: they attend nothing and nobody attends them.

    The inputs may be traced (under `jax.jit`): then `shape` is required, the mask has no
    dense values, and `process_mask` builds a dynamic `MaskInfo` in O(tokens + blocks).

    Args:
      cu_seqlens_q: int [num_docs + 1]; cu_seqlens_kv: int [num_docs + 1] (default: q's).
      shape: (q_len, kv_len); default (cu_seqlens_q[-1], cu_seqlens_kv[-1]).
      causal: bottom-right causal inside each document.
      window: (left, right) sliding window inside documents, a side None = unbounded.
      q_sequence, kv_sequence: token of every q / kv row (a permutation, e.g. from
        `reorder_sequence`); default the identity.
    """

    def __init__(
        self,
        cu_seqlens_q,
        cu_seqlens_kv=None,
        *,
        shape=None,
        causal=False,
        window=None,
        q_sequence=None,
        kv_sequence=None,
        _tokens=None,
    ):
        cu_seqlens_kv = cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv
        self.traced = _is_traced(cu_seqlens_q, cu_seqlens_kv)
        if _tokens is None:
            cu_q, cu_kv, shape = self._cu_seqlens(cu_seqlens_q, cu_seqlens_kv, shape)
            _tokens = _tokens_of_cu_seqlens(
                jnp if self.traced else np, cu_q, cu_kv, shape[0], shape[1]
            )
        self._shape = _check_shape(shape, "DocumentMask")
        self.tokens = _tokens
        self.window = self._window(causal, window)
        self.rule = None if self.window == (None, None) else LocalRule(*self.window)
        self.q_sequence = _as_positions(q_sequence, self._shape[0], "DocumentMask: q_sequence")
        self.kv_sequence = _as_positions(kv_sequence, self._shape[1], "DocumentMask: kv_sequence")
        if self.q_sequence is None:
            self.q_sequence = np.arange(self._shape[0], dtype=np.int32)

    def _cu_seqlens(self, cu_q, cu_kv, shape):
        _check_cu_seqlens_form(cu_q, "cu_seqlens_q")
        _check_cu_seqlens_form(cu_kv, "cu_seqlens_kv")
        if self.traced:
            if shape is None:
                raise ValueError("DocumentMask: traced cu_seqlens need shape=(q_len, kv_len)")
            cu_q, cu_kv = jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_kv, jnp.int32)
            if cu_q.shape != cu_kv.shape:
                raise ValueError(
                    "DocumentMask: cu_seqlens_q and cu_seqlens_kv must be "
                    f"[num_docs + 1] of one length, got {cu_q.shape}, {cu_kv.shape}"
                )
            return cu_q, cu_kv, shape
        cu_q, cu_kv = np.asarray(cu_q), np.asarray(cu_kv)
        if cu_q.shape != cu_kv.shape:
            raise ValueError(
                "DocumentMask: cu_seqlens_q and cu_seqlens_kv must have one "
                f"length (one entry per document), got {cu_q.shape}, {cu_kv.shape}"
            )
        shape = (int(cu_q[-1]), int(cu_kv[-1])) if shape is None else shape
        _check_cu_seqlens(cu_q, int(shape[0]), "cu_seqlens_q")
        _check_cu_seqlens(cu_kv, int(shape[1]), "cu_seqlens_kv")
        return cu_q.astype(np.int32), cu_kv.astype(np.int32), shape

    @staticmethod
    def _window(causal: bool, window) -> tuple[int | None, int | None]:
        left, right = (None, None) if window is None else window
        for side in (left, right):
            if side is not None and int(side) < 0:
                raise ValueError(f"DocumentMask: window sides must be >= 0 or None, got {side}")
        if causal:
            right = 0
        return (None if left is None else int(left), None if right is None else int(right))

    @classmethod
    def from_segment_ids(
        cls,
        q_segment_ids,
        kv_segment_ids=None,
        *,
        causal=False,
        window=None,
        q_sequence=None,
        kv_sequence=None,
    ) -> DocumentMask:
        """Documents from segment ids: int [q_len] / [kv_len], ascending positive ids,
        each document one contiguous run, padding ids <= 0 after the last document.
        Checked when concrete (ValueError); traced ids (under `jax.jit`) cannot raise, so
        ids out of order there make the whole mask empty (every row: out 0, lse -inf).
        Document d of q attends the kv run with the same id."""
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        traced = _is_traced(q_segment_ids, kv_segment_ids)
        xp = jnp if traced else np
        q_ids, kv_ids = xp.asarray(q_segment_ids), xp.asarray(kv_segment_ids)
        if q_ids.ndim != 1 or kv_ids.ndim != 1:
            raise ValueError("DocumentMask.from_segment_ids: segment ids must be 1-D")
        for name, ids in (("q_segment_ids", q_ids), ("kv_segment_ids", kv_ids)):
            # Checked traced too (a dtype is static): a float id would be truncated.
            if not np.issubdtype(ids.dtype, np.integer):
                raise TypeError(
                    f"DocumentMask.from_segment_ids: {name} must be integer ids, got {ids.dtype}"
                )
        if not traced:
            _check_segment_ids(q_ids, "q_segment_ids")
            _check_segment_ids(kv_ids, "kv_segment_ids")
        tokens = _tokens_of_segment_ids(xp, q_ids.astype(np.int32), kv_ids.astype(np.int32))
        return cls(
            q_ids,
            kv_ids,
            shape=(q_ids.shape[0], kv_ids.shape[0]),
            causal=causal,
            window=window,
            q_sequence=q_sequence,
            kv_sequence=kv_sequence,
            _tokens=tokens,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def kv_positions(self):
        return self.kv_sequence

    def _kv_rows(self, cols):
        return cols if self.kv_sequence is None else self.kv_sequence[cols]

    def evaluate(self, rows, cols):
        if self.traced:
            raise TypeError("DocumentMask: a mask built from traced arrays has no dense values")
        t, q, kv = self.tokens, self.q_sequence[rows], self._kv_rows(cols)
        allowed = t.q_document[q] == t.kv_document[kv]
        if self.rule is not None:
            allowed &= self.rule(t.q_relative[q], t.kv_relative[kv])
        return allowed

    def row_intervals(self):
        xp = jnp if self.traced else np
        t = self.tokens
        q = self.q_sequence
        start, end, rel = t.q_kv_start[q], t.q_kv_end[q], t.q_relative[q]
        left, right = self.window
        lo = start if left is None else xp.maximum(start, end + rel - left)
        hi = end - 1 if right is None else xp.minimum(end - 1, end + rel + right)
        empty = t.q_document[q] < 0
        lo, hi = xp.where(empty, 1, lo), xp.where(empty, 0, hi)
        return lo.astype(np.int32)[:, None], hi.astype(np.int32)[:, None]

    def element_arrays(self) -> tuple[Array, Array, Array, Array]:
        """(q_relative, kv_relative, q_document, kv_document) per q / kv row, in row order."""
        t = self.tokens
        kv = slice(None) if self.kv_sequence is None else self.kv_sequence
        return (
            t.q_relative[self.q_sequence],
            t.kv_relative[kv],
            t.q_document[self.q_sequence],
            t.kv_document[kv],
        )

    def _key(self):
        if self.traced:
            return id(self)
        arrays = (*dataclasses.astuple(self.tokens), self.q_sequence, self.kv_sequence)
        return (self._shape, self.window, tuple(None if a is None else a.tobytes() for a in arrays))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DocumentMask) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# ---- dense bool [q_len, kv_len] arrays, JAX splash's helpers (same rules, same values).


def _dense_indices(shape: Sequence[int], name: str) -> tuple[np.ndarray, np.ndarray]:
    q_len, kv_len = _check_shape(shape, name)
    return np.arange(q_len)[:, None], np.arange(kv_len)[None, :]


def make_causal_mask(shape: Sequence[int], offset: int = 0) -> np.ndarray:
    """bool [q_len, kv_len]: q + offset >= kv (`CausalMask`'s rule, dense)."""
    q, kv = _dense_indices(shape, "make_causal_mask")
    return q + offset >= kv


def make_local_attention_mask(
    shape: Sequence[int], window_size: tuple[int | None, int | None], *, offset: int = 0
) -> np.ndarray:
    """bool [q_len, kv_len]: q + offset - left <= kv <= q + offset + right, a side None
    unbounded (`LocalMask`'s rule, dense)."""
    q, kv = _dense_indices(shape, "make_local_attention_mask")
    left, right = window_size
    allowed = np.ones(np.broadcast_shapes(q.shape, kv.shape), np.bool_)
    if left is not None:
        allowed &= q + offset - left <= kv
    if right is not None:
        allowed &= q + offset + right >= kv
    return allowed


def make_chunk_attention_mask(shape: Sequence[int], chunk_size: int) -> np.ndarray:
    """bool [q_len, kv_len]: causal inside chunks of `chunk_size` (`ChunkedCausalMask`)."""
    if not chunk_size > 0:
        raise ValueError(
            f"make_chunk_attention_mask: chunk_size must be positive, got {chunk_size}"
        )
    q, kv = _dense_indices(shape, "make_chunk_attention_mask")
    return (q // chunk_size == kv // chunk_size) & (q >= kv)


def make_random_mask(shape: Sequence[int], sparsity: float, seed: int) -> np.ndarray:
    """bool [q_len, kv_len], each pair allowed with probability 1 - sparsity. The stream of
    `np.random.seed(seed)` (JAX's, so the same seed gives the same mask), drawn from a
    private `RandomState`: numpy's global generator is left alone."""
    q_len, kv_len = _check_shape(shape, "make_random_mask")
    draws = np.random.RandomState(seed).binomial(n=1, p=1.0 - sparsity, size=(q_len, kv_len))
    return draws.astype(np.bool_)
