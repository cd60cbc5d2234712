"""Masks as the op sees them: padding to whole blocks, the static / traced split, head
groups, the XLA path's block lists and the visited-vs-dense block counts.

A mask reaches a backend in two halves: a hashable static half (the mask itself, or for a
`DocumentMask` of traced `cu_seqlens` / segment ids its shape, window and row orders) that
rides in the op's static options, and a tuple of int arrays (the traced document's
per-token arrays; empty for a static mask) that is an ordinary, non-differentiable
argument of the custom_vjp. `join_mask` puts them back together on the other side.

Padding: the backends cut both sequences into whole blocks. `pad_mask` extends a
(q_len, kv_len) mask to the padded shape so that padded rows attend nothing and padded
columns are attended by nothing; on the real rectangle it equals the mask.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.numerics import cdiv
from pallas_tpu.splash.mask_info import classify_blocks
from pallas_tpu.splash.masks import DocumentMask, Mask, MultiHeadMask
from pallas_tpu.splash.masks import DocumentTokens as _DocumentTokens

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_XLA_BLOCK = 128
# Mask elements evaluated at once while building the partial blocks of a static mask.
_EVALUATE_CHUNK = 1 << 22


# ------------------------------------------------------------------------------ padding


class PaddedMask(Mask):
    """`inner` (q_len, kv_len) extended to `shape` >= it: rows and columns past the inner
    shape are all False. Row intervals (hence O(tokens + blocks) classification) are kept
    when the inner mask has them over plain kv positions."""

    def __init__(self, inner: Mask, shape: tuple[int, int]):
        self.inner, self._shape = inner, (int(shape[0]), int(shape[1]))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def evaluate(self, rows, cols):
        rows, cols = np.asarray(rows), np.asarray(cols)
        q_len, kv_len = self.inner.shape
        inside = (rows < q_len) & (cols < kv_len)
        if q_len == 0 or kv_len == 0:
            return np.zeros(inside.shape, np.bool_)
        values = self.inner.evaluate(np.minimum(rows, q_len - 1), np.minimum(cols, kv_len - 1))
        return inside & np.asarray(values, np.bool_)

    def row_intervals(self):
        intervals = self.inner.row_intervals()
        if intervals is None or self.inner.kv_positions() is not None:
            return None  # classified densely (still exact)
        lo, hi = (np.asarray(x, np.int32) for x in intervals)
        q_len, kv_len = self.inner.shape
        hi = np.minimum(hi, kv_len - 1)  # never a padded column
        extra = self._shape[0] - q_len
        lo = np.concatenate([lo, np.ones((extra, lo.shape[1]), np.int32)])
        hi = np.concatenate([hi, np.zeros((extra, hi.shape[1]), np.int32)])  # empty rows
        return lo, hi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PaddedMask) and (self.inner, self._shape) == (
            other.inner,
            other._shape,
        )

    def __hash__(self) -> int:
        return hash((PaddedMask, self.inner, self._shape))


def _pad_document(mask: DocumentMask, shape: tuple[int, int]) -> DocumentMask:
    """The same documents in a longer (q, kv) frame: padded tokens belong to no document
    (q id -1, kv id -2 never match), so the mask keeps its in-kernel element rule."""
    xp = jnp if mask.traced else np
    q_len, kv_len = mask.shape
    extra_q, extra_kv = shape[0] - q_len, shape[1] - kv_len
    t = mask.tokens

    def pad(x, extra, value):
        return xp.concatenate([xp.asarray(x, np.int32), xp.full((extra,), value, np.int32)])

    tokens = _DocumentTokens(
        pad(t.q_document, extra_q, -1),
        pad(t.kv_document, extra_kv, -2),
        pad(t.q_relative, extra_q, 0),
        pad(t.kv_relative, extra_kv, 0),
        pad(t.q_kv_start, extra_q, 0),
        pad(t.q_kv_end, extra_q, 0),
    )
    # Padded rows are padded tokens: positions past the real ones.
    q_sequence = np.concatenate([mask.q_sequence, np.arange(q_len, shape[0], dtype=np.int32)])
    kv_sequence = mask.kv_sequence
    if kv_sequence is not None:
        kv_sequence = np.concatenate([kv_sequence, np.arange(kv_len, shape[1], dtype=np.int32)])
    return _document(tokens, shape, mask.window, q_sequence, kv_sequence)


def _document(tokens, shape, window, q_sequence, kv_sequence) -> DocumentMask:
    # The document-id arrays stand in for cu_seqlens: they only tell the mask whether it
    # is traced; `_tokens` carries the per-token view itself.
    return DocumentMask(
        tokens.q_document,
        tokens.kv_document,
        shape=shape,
        window=window,
        q_sequence=q_sequence,
        kv_sequence=kv_sequence,
        _tokens=tokens,
    )


def pad_mask(mask: Mask, shape: tuple[int, int]) -> Mask:
    """A 2-D `mask` extended to `shape` (see the module docstring); itself when equal."""
    if tuple(mask.shape) == tuple(shape):
        return mask
    if isinstance(mask, DocumentMask):
        return _pad_document(mask, shape)
    return PaddedMask(mask, shape)


# -------------------------------------------------------------- static / traced halves


@dataclasses.dataclass(frozen=True, eq=False)
class TracedDocument:
    """The static half of a DocumentMask built from traced arrays (hashable)."""

    shape: tuple[int, int]
    window: tuple[int | None, int | None]
    q_sequence: np.ndarray
    kv_sequence: np.ndarray | None

    def _key(self):
        kv = None if self.kv_sequence is None else self.kv_sequence.tobytes()
        return (self.shape, self.window, self.q_sequence.tobytes(), kv)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TracedDocument) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def is_traced_document(mask: Any) -> bool:
    return isinstance(mask, DocumentMask) and mask.traced


def split_mask(mask: Mask) -> tuple[Mask | TracedDocument, tuple[jax.Array, ...]]:
    """(static half, int arrays): see the module docstring."""
    if not is_traced_document(mask):
        return mask, ()
    t = mask.tokens
    arrays = tuple(getattr(t, f.name) for f in dataclasses.fields(t))
    static = TracedDocument(tuple(mask.shape), mask.window, mask.q_sequence, mask.kv_sequence)
    return static, arrays


def join_mask(static: Mask | TracedDocument, arrays: Sequence[jax.Array]) -> Mask:
    """The mask `split_mask` took apart (a traced DocumentMask is rebuilt from its arrays)."""
    if not isinstance(static, TracedDocument):
        return static
    tokens = _DocumentTokens(*arrays)
    return _document(tokens, static.shape, static.window, static.q_sequence, static.kv_sequence)


def head_groups(mask: Mask, num_q_heads: int) -> tuple[tuple[tuple[int, ...], Mask], ...]:
    """((query heads, 2-D mask), ...): one group per distinct head mask, in first-seen
    order. A 2-D mask is one group of every head."""
    if not isinstance(mask, MultiHeadMask):
        return ((tuple(range(num_q_heads)), mask),)
    groups: dict[Mask, list[int]] = {}
    for head, head_mask in enumerate(mask.masks):
        groups.setdefault(head_mask, []).append(head)
    return tuple((tuple(heads), m) for m, heads in groups.items())


def has_traced_member(mask: Mask) -> bool:
    """Whether `mask` is a MultiHeadMask with a DocumentMask of traced arrays among its
    heads (the op then runs one call per such member: `traced_head_groups`)."""
    return isinstance(mask, MultiHeadMask) and any(is_traced_document(m) for m in mask.masks)


def traced_head_groups(mask: MultiHeadMask) -> tuple[tuple[np.ndarray, Mask], ...]:
    """((query heads int32 [n], mask), ...) of a MultiHeadMask with traced members: each
    distinct traced DocumentMask (one object) with its heads, then every other head with
    the static masks (one 2-D mask when they are all one, else a MultiHeadMask)."""
    traced: dict[int, list[int]] = {}
    static: list[int] = []
    for head, member in enumerate(mask.masks):
        if is_traced_document(member):
            traced.setdefault(id(member), []).append(head)
        else:
            static.append(head)
    groups = [(np.asarray(h, np.int32), mask.masks[h[0]]) for h in traced.values()]
    if static:
        members = [mask.masks[h] for h in static]
        one = all(m == members[0] for m in members)
        groups.append((np.asarray(static, np.int32), members[0] if one else MultiHeadMask(members)))
    return tuple(groups)


def kv_heads_of(heads: np.ndarray, group_size: int) -> np.ndarray:
    """The kv heads (int32) a call on query heads `heads` (ascending) reads, GQA kept:
    when `heads` are whole GQA groups, each group's kv head once (the call keeps the
    group size); otherwise each query head's kv head (the call has group size 1)."""
    groups = heads.reshape(-1, group_size) if len(heads) % group_size == 0 else None
    whole = groups is not None and np.all(groups == groups[:, :1] + np.arange(group_size))
    if whole and np.all(groups[:, 0] % group_size == 0):
        return (groups[:, 0] // group_size).astype(np.int32)
    return (heads // group_size).astype(np.int32)


# ---------------------------------------------------------------- the XLA block lists


def xla_block_shape(q_len: int, kv_len: int, block_sizes: Any) -> tuple[int, int]:
    """(block_q, block_kv) of the XLA path: the given `BlockSizes` fields, else 128 capped
    at the length rounded up to 8 (small problems do not pay for 128-row tiles)."""
    given_q = None if block_sizes is None else block_sizes.block_q
    given_kv = None if block_sizes is None else block_sizes.block_kv
    default = lambda n: min(DEFAULT_XLA_BLOCK, 8 * max(cdiv(n, 8), 1))
    return (given_q or default(q_len), given_kv or default(kv_len))


def padded_shape(q_len: int, kv_len: int, block_shape: tuple[int, int]) -> tuple[int, int]:
    """Both lengths rounded up to whole blocks (at least one block each)."""
    bq, bk = block_shape
    return bq * max(cdiv(q_len, bq), 1), bk * max(cdiv(kv_len, bk), 1)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockList:
    """The non-empty blocks of one static mask, row-major (host numpy arrays).

    q_block, kv_block: int32 [V] block coordinates; kind: int8 [V], PARTIAL or FULL;
    partial_id: int32 [V], the element mask of a partial block in `partial_blocks`
    (0, unused, for full blocks); partial_blocks: bool [max(P, 1), block_q, block_kv],
    the P distinct partial blocks (one all-False block when P = 0).
    """

    q_block: np.ndarray
    kv_block: np.ndarray
    kind: np.ndarray
    partial_id: np.ndarray
    partial_blocks: np.ndarray

    @property
    def visited(self) -> int:
        return len(self.kind)


def _partial_values(mask: Mask, q_block, kv_block, block_shape) -> np.ndarray:
    """bool [n, block_q, block_kv]: the dense values of the given blocks, in chunks."""
    bq, bk = block_shape
    step = max(_EVALUATE_CHUNK // (bq * bk), 1)
    parts = [np.zeros((0, bq, bk), np.bool_)]
    for start in range(0, len(q_block), step):
        q, k = q_block[start : start + step], kv_block[start : start + step]
        rows = q[:, None, None] * bq + np.arange(bq)[None, :, None]
        cols = k[:, None, None] * bk + np.arange(bk)[None, None, :]
        parts.append(np.asarray(mask.evaluate(rows, cols), np.bool_))
    return np.concatenate(parts)


@functools.lru_cache(maxsize=64)
def static_block_list(mask: Mask, block_shape: tuple[int, int]) -> BlockList:
    """The `BlockList` of a padded static 2-D mask (its shape a multiple of the blocks).

    Classification is `classify_blocks` (O(tokens + blocks) for masks with row intervals);
    only partial blocks are evaluated densely, and equal ones are stored once.
    """
    classes = np.asarray(classify_blocks(mask, block_shape))
    q_block, kv_block = (x.astype(np.int32) for x in np.nonzero(classes != EMPTY))
    kind = classes[q_block, kv_block].astype(np.int8)
    partial = kind == PARTIAL
    values = _partial_values(mask, q_block[partial], kv_block[partial], block_shape)
    partial_id = np.zeros(len(kind), np.int32)
    if len(values):
        packed = np.packbits(values.reshape(len(values), -1), axis=1)
        unique, inverse = np.unique(packed, axis=0, return_inverse=True)
        size = block_shape[0] * block_shape[1]
        blocks = np.unpackbits(unique, axis=1, count=size).astype(np.bool_)
        partial_blocks = blocks.reshape(-1, *block_shape)
        partial_id[partial] = inverse.ravel()
    else:
        partial_blocks = np.zeros((1, *block_shape), np.bool_)
    return BlockList(q_block, kv_block, kind, partial_id, partial_blocks)


# --------------------------------------------------------------------- block counts


@dataclasses.dataclass(frozen=True)
class BlockCounts:
    """Work of the XLA path for one static mask, in (query head, q block, kv block) units.

    dense: heads * q_blocks * kv_blocks (the whole grid); visited: the non-empty blocks,
    partial + full; gathered: the blocks the XLA path computes (equal to visited: it
    gathers exactly the non-empty blocks); block_shape: (block_q, block_kv).
    """

    dense: int
    visited: int
    partial: int
    full: int
    gathered: int
    block_shape: tuple[int, int]

    @property
    def density(self) -> float:
        return self.visited / max(self.dense, 1)


def block_counts(mask: Mask, *, num_q_heads: int | None = None, block_sizes=None) -> BlockCounts:
    """Visited vs dense blocks of the XLA path for a static `mask` (a 2-D mask shared by
    `num_q_heads` heads, default 1, or a MultiHeadMask), with `block_sizes` as the op
    takes them. For the bench sweep and the tests."""
    if is_traced_document(mask):
        raise ValueError("block_counts: a DocumentMask of traced arrays has no static counts")
    heads = len(mask.masks) if isinstance(mask, MultiHeadMask) else (num_q_heads or 1)
    q_len, kv_len = mask.shape[-2:]
    block_shape = xla_block_shape(q_len, kv_len, block_sizes)
    shape = padded_shape(q_len, kv_len, block_shape)
    dense = heads * (shape[0] // block_shape[0]) * (shape[1] // block_shape[1])
    visited = partial = gathered = 0
    for group, head_mask in head_groups(mask, heads):
        blocks = static_block_list(pad_mask(head_mask, shape), block_shape)
        visited += len(group) * int(np.count_nonzero(blocks.kind != EMPTY))
        partial += len(group) * int(np.count_nonzero(blocks.kind == PARTIAL))
        gathered += len(group) * blocks.visited  # one gathered block per list entry
    return BlockCounts(dense, visited, partial, visited - partial, gathered, block_shape)
