"""`MaskInfo`: the compact, per-block description of a mask that drives the splash kernels.

`process_mask` classifies every (q block, kv block) pair as empty, partial or full from
each mask's row intervals (`Mask.row_intervals`): one scatter of the rows' first and last
touched / covered blocks and a prefix sum, O(q_len + blocks) work, vectorised, never a
dense [q, kv] array for a computable mask. Masks without row intervals (`NumpyMask`,
`PredicateMask` and compositions with them) are classified from dense values a few block
rows at a time (`DENSE_CHUNK_ELEMENTS`). Only partial blocks are ever materialised, and
only when the kernel cannot evaluate the mask itself (several distinct head masks, `|`,
`&`, `NumpyMask`, `PredicateMask`). The traversal arrays (`data_next`, `mask_next`) and
the shrunk grid follow JAX splash's layout, so the two agree on every non-empty block.

A `DocumentMask` built from traced `cu_seqlens` or segment ids is processed under
`jax.jit` in the same O(q_len + blocks) work with static output shapes: the grid is not
shrunk (its width would depend on the data) and no partial block is materialised: the
kernels evaluate partial blocks from per-token document ids and positions
(`ElementMask`), so the bound on materialised partial blocks is zero.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tpu.splash import masks as mask_lib

Array = Any  # np.ndarray or jax.Array


class MaskInfo(NamedTuple):
    """Per-block mask metadata, read by the kernels from scalar memory.

    The first axis of the three int arrays is 1 (one mask shared by every head of the
    shard) or num_heads (local heads). Indices are [h, qi, ki] in block units for every
    traversal; for the dK/dV traversal the grid walks (ki, h, compacted qi) and
    `data_next` holds q block indices.

    Attributes:
      data_next: int [heads, q_blocks, kv_blocks'] - the block the kernel loads at that
        grid step (kv block for forward/dQ, q block for dK/dV). With `shrink_grid` the
        compacted axis (kv for forward/dQ, q for dK/dV) holds only non-empty blocks.
      mask_next: int, same shape, or None - index into `partial_mask_blocks` for partial
        blocks; None when partial blocks are evaluated in the kernel (`ElementMask`).
      block_mask: int, same shape - 0 empty (skipped), 1 partial, 2 full.
      partial_mask_blocks: bool [num_partial, block_q, block_kv] (forward/dQ) or
        [num_partial, block_kv, block_q] (dK/dV), deduplicated; or None.
      q_sequence: int32 [q_len] - the position of every q row the mask rule sees; None
        when the mask is not computable.
      is_dynamic_mask: True when built under `jax.jit` from a traced mask.
    """

    data_next: Array
    mask_next: Array | None
    block_mask: Array
    partial_mask_blocks: Array | None
    q_sequence: Array | None
    is_dynamic_mask: bool | None = None


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class ElementMask:
    """How a kernel evaluates a partial block's element mask instead of loading it.

    mask[i, j] = rule(q_sequence[i], kv_sequence[j])
                 & (q_document[i] == kv_document[j])     (when documents are given)

    Attributes:
      rule: a static, hashable callable on broadcastable int32 arrays returning bool,
        or None (the document term alone).
      q_sequence: int32 [q_len] - positions fed to `rule` for every q row.
      kv_sequence: int32 [kv_len] or None (kv row j has position j).
      q_document, kv_document: int32 [q_len] / [kv_len] or None - document ids; a pair
        attends only inside one document. Padding tokens carry ids that match nothing
        (q: -1, kv: -2).
    """

    rule: Callable[[Array, Array], Array] | None
    q_sequence: Array
    kv_sequence: Array | None = None
    q_document: Array | None = None
    kv_document: Array | None = None

    def __call__(self, q_ids: Array, kv_ids: Array) -> Array:
        """The rule alone, on positions (JAX splash's `mask_function` convention)."""
        if self.rule is None:
            return np.ones(np.broadcast_shapes(np.shape(q_ids), np.shape(kv_ids)), bool)
        return self.rule(q_ids, kv_ids)

    def tree_flatten(self):
        children = (self.q_sequence, self.kv_sequence, self.q_document, self.kv_document)
        return children, self.rule

    @classmethod
    def tree_unflatten(cls, rule, children):
        return cls(rule, *children)


__all__ = [
    "ElementMask",
    "MaskInfo",
    "classify_blocks",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _Grid:
    """Block counts and shard sizes of one processing call (validated)."""

    heads: int
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    head_shards: int
    q_seq_shards: int

    @property
    def q_blocks(self) -> int:
        return self.q_len // self.block_q

    @property
    def kv_blocks(self) -> int:
        return self.kv_len // self.block_kv

    @classmethod
    def make(cls, name, shape, block_shape, head_shards, q_seq_shards) -> _Grid:
        if len(shape) != 3:
            raise ValueError(f"{name}: expected a [heads, q_len, kv_len] mask, got {shape}")
        heads, q_len, kv_len = (int(s) for s in shape)
        if len(block_shape) != 2:
            raise ValueError(f"{name}: block_shape must be (block_q, block_kv), got {block_shape}")
        block_q, block_kv = (int(b) for b in block_shape)
        for label, block, length in (("block_q", block_q, q_len), ("block_kv", block_kv, kv_len)):
            if block <= 0 or length % block:
                raise ValueError(f"{name}: {label}={block} must divide the length {length}")
        for label, shards, size in (
            ("head_shards", head_shards, heads),
            ("q_seq_shards", q_seq_shards, q_len // block_q),
        ):
            if shards <= 0 or size % shards:
                raise ValueError(f"{name}: {label}={shards} must divide {size}")
        return cls(heads, q_len, kv_len, block_q, block_kv, head_shards, q_seq_shards)


# ---- block classification


def _kv_block_ranges(kv_positions, kv_len: int, block_kv: int):
    """(first, last) position of every kv block, or None when a block's positions are
    not consecutive ascending integers or blocks overlap (then only a dense pass is exact)."""
    num = kv_len // block_kv
    if kv_positions is None:
        first = np.arange(num, dtype=np.int64) * block_kv
        return first, first + block_kv - 1
    blocks = np.asarray(kv_positions, np.int64).reshape(num, block_kv)
    if block_kv > 1 and np.any(np.diff(blocks, axis=1) != 1):
        return None
    first, last = blocks[:, 0], blocks[:, -1]
    order = np.argsort(first)
    if num > 1 and np.any(first[order][1:] <= last[order][:-1]):
        return None
    return first, last


def _scatter_ranges(xp, block_row, begin, end, valid, rows: int, cols: int):
    """int32 [rows, cols]: how many of the ranges [begin, end] (per entry) hold each column."""
    width = cols + 1
    starts = xp.where(valid, block_row * width + begin, rows * width)
    stops = xp.where(valid, block_row * width + end + 1, rows * width)
    size = rows * width + 1  # the last slot takes the invalid entries
    if xp is np:
        diff = np.bincount(starts.ravel(), minlength=size) - np.bincount(
            stops.ravel(), minlength=size
        )
    else:
        diff = jnp.zeros(size, jnp.int32).at[starts.ravel()].add(1).at[stops.ravel()].add(-1)
    return xp.cumsum(diff[:-1].reshape(rows, width), axis=1)[:, :cols]


def _classify_intervals(xp, lo, hi, block_q: int, ranges) -> Array:
    """int8 [q_blocks, kv_blocks] from row intervals lo, hi [q_len, m] (disjoint per row)."""
    first, last = ranges
    order = np.argsort(first)
    first_sorted, last_sorted = first[order], last[order]
    rows, cols = lo.shape[0] // block_q, len(first)
    block_row = (xp.arange(lo.shape[0]) // block_q)[:, None]
    nonempty = lo <= hi
    # Sorted disjoint blocks: those meeting [lo, hi] and those inside it are index ranges.
    touch_begin = mask_lib.searchsorted(xp, last_sorted, lo, side="left")
    touch_end = mask_lib.searchsorted(xp, first_sorted, hi, side="right") - 1
    cover_begin = mask_lib.searchsorted(xp, first_sorted, lo, side="left")
    cover_end = mask_lib.searchsorted(xp, last_sorted, hi, side="right") - 1
    touched = _scatter_ranges(
        xp, block_row, touch_begin, touch_end, nonempty & (touch_begin <= touch_end), rows, cols
    )
    covered = _scatter_ranges(
        xp, block_row, cover_begin, cover_end, nonempty & (cover_begin <= cover_end), rows, cols
    )
    # A row's intervals are disjoint and not adjacent: at most one covers a block, so the
    # block is full exactly when every one of its rows covers it.
    classes = xp.where(covered == block_q, FULL, xp.where(touched > 0, PARTIAL, EMPTY))
    classes = classes.astype(np.int8)
    inverse = np.argsort(order)
    return classes[:, inverse]


# Mask elements evaluated at once on the dense paths (16 MiB of bools): a mask without row
# intervals (PredicateMask, NumpyMask, compositions with them) is classified and its
# partial blocks built in pieces of about this size, never as one [q_len, kv_len] array.
DENSE_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(q_len: int, kv_len: int, block_q: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of whole block rows, each about DENSE_CHUNK_ELEMENTS
    elements (at least one block row)."""
    rows = max(DENSE_CHUNK_ELEMENTS // max(kv_len * block_q, 1), 1) * block_q
    return [(start, min(start + rows, q_len)) for start in range(0, q_len, rows)]


def _classify_dense(mask: mask_lib.Mask, block_q: int, block_kv: int) -> np.ndarray:
    """int8 [q_blocks, kv_blocks] from the mask's dense values, a few block rows at a time."""
    q_len, kv_len = mask.shape
    parts = [np.zeros((0, kv_len // block_kv), np.int8)]
    for start, stop in _row_chunks(q_len, kv_len, block_q):
        dense = np.asarray(mask[start:stop, :], np.bool_)
        blocks = dense.reshape((stop - start) // block_q, block_q, kv_len // block_kv, block_kv)
        any_, all_ = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
        parts.append(np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8))
    return np.concatenate(parts)


def classify_blocks(mask: mask_lib.Mask, block_shape: tuple[int, int]) -> Array:
    """int8 [q_blocks, kv_blocks]: 0 empty, 1 partial, 2 full, for a 2-D mask.

    O(q_len + blocks) from the mask's row intervals; a mask without them (NumpyMask,
    PredicateMask, or masks over non-contiguous kv blocks) is classified densely in
    O(q_len * kv_len) time, a few block rows at a time (memory O(DENSE_CHUNK_ELEMENTS)).
    """
    block_q, block_kv = block_shape
    kv_len = mask.shape[1]
    intervals = mask.row_intervals()
    ranges = _kv_block_ranges(mask.kv_positions(), kv_len, block_kv)
    if intervals is not None and ranges is not None:
        traced = isinstance(intervals[0], jax.core.Tracer) or isinstance(intervals[0], jax.Array)
        return _classify_intervals(jnp if traced else np, *intervals, block_q, ranges)
    if getattr(mask, "traced", False):
        raise ValueError(
            f"a DocumentMask built from traced arrays needs a kv_sequence whose kv blocks "
            f"({block_kv} rows here) each hold consecutive ascending positions: the "
            "load-balanced order with chunks a multiple of every kv block size the op uses "
            "(its block_sizes, the backward's included), or kv_sequence=None"
        )
    return _classify_dense(mask, block_q, block_kv)


def _row_is_empty(mask: mask_lib.Mask) -> np.ndarray:
    intervals = mask.row_intervals()
    ranges = _kv_block_ranges(mask.kv_positions(), mask.shape[1], 1)
    if intervals is None or ranges is None:
        if mask.shape[1] == 0:
            return np.ones(mask.shape[0], np.bool_)
        return _classify_dense(mask, 1, mask.shape[1]).ravel() == EMPTY
    return np.asarray(_classify_intervals(np, *intervals, 1, ranges) == EMPTY).all(axis=1)


# ---- traversal arrays


def _next_flagged(flags, values, xp=np):
    """values at the first flagged position at or after each position (wrapping to the
    first flagged one); zeros when nothing is flagged. 1-D arrays."""
    size = flags.shape[0]
    position = xp.where(flags, xp.arange(size, dtype=np.int32), size)
    if xp is np:
        following = np.minimum.accumulate(position[::-1])[::-1]
    else:
        following = jax.lax.cummin(position, reverse=True)
    following = xp.where(following == size, following[0] if size else 0, following)
    found = xp.where(following == size, 0, values[xp.minimum(following, size - 1)])
    return xp.where(xp.any(flags), found, 0)


def _traverse(classes, partial_ids, is_dkv: bool, xp=np):
    """data_next, mask_next [h, q, kv] for one shard slice, in the kernel's grid order:
    (h, qi, ki) row-major, or (ki, h, qi) for dK/dV."""
    _, nq, nk = classes.shape
    if is_dkv:
        order = (2, 0, 1)
        block = xp.broadcast_to(xp.arange(nq, dtype=np.int32)[None, :, None], classes.shape)
    else:
        order = (0, 1, 2)
        block = xp.broadcast_to(xp.arange(nk, dtype=np.int32)[None, None, :], classes.shape)

    def walk(flags, values):
        walked = _next_flagged(flags.transpose(order).ravel(), values.transpose(order).ravel(), xp)
        return walked.reshape([classes.shape[a] for a in order]).transpose(np.argsort(order))

    data_next = walk(classes != EMPTY, block)
    mask_next = None if partial_ids is None else walk(classes == PARTIAL, partial_ids)
    return data_next, mask_next


def _traverse_shards(classes, partial_ids, grid: _Grid, is_dkv: bool, xp=np):
    """`_traverse` per (head shard, q shard): indices stay relative to each shard."""
    rows_per_shard = max(classes.shape[0] // grid.head_shards, 1)
    blocks_per_shard = grid.q_blocks // grid.q_seq_shards
    data, masks = [], []
    for r in range(0, classes.shape[0], rows_per_shard):
        data_row, mask_row = [], []
        for s in range(0, grid.q_blocks, blocks_per_shard):
            part = (slice(r, r + rows_per_shard), slice(s, s + blocks_per_shard))
            ids = None if partial_ids is None else partial_ids[part]
            d, m = _traverse(classes[part], ids, is_dkv, xp)
            data_row.append(d)
            mask_row.append(m)
        data.append(xp.concatenate(data_row, axis=1))
        masks.append(None if partial_ids is None else xp.concatenate(mask_row, axis=1))
    return xp.concatenate(data, 0), None if partial_ids is None else xp.concatenate(masks, 0)


# ---- partial blocks


def _packed_partial_blocks(mask: mask_lib.Mask, classes: np.ndarray, grid: _Grid) -> np.ndarray:
    """uint8 [num_partial, ceil(block_q * block_kv / 8)]: the partial blocks of one mask,
    row-major, bit-packed; evaluated about DENSE_CHUNK_ELEMENTS elements at a time."""
    qi, ki = np.nonzero(classes == PARTIAL)
    size = grid.block_q * grid.block_kv
    step = max(DENSE_CHUNK_ELEMENTS // size, 1)
    packed = [np.zeros((0, -(-size // 8)), np.uint8)]
    for start in range(0, len(qi), step):
        q, k = qi[start : start + step], ki[start : start + step]
        rows = q[:, None, None] * grid.block_q + np.arange(grid.block_q)[None, :, None]
        cols = k[:, None, None] * grid.block_kv + np.arange(grid.block_kv)[None, None, :]
        values = np.asarray(mask.evaluate(rows, cols), np.bool_)
        packed.append(np.packbits(values.reshape(len(q), size), axis=1))
    return np.concatenate(packed)


def _deduplicate(packed: np.ndarray, block_shape: tuple[int, int]):
    """(unique blocks bool [n, *block_shape] in order of first appearance, id of every
    input block) from bit-packed blocks; only the unique ones are unpacked."""
    if len(packed) == 0:
        return np.zeros((0, *block_shape), np.bool_), np.zeros(0, np.int32)
    keys = np.ascontiguousarray(packed).view(np.dtype((np.void, packed.shape[1]))).ravel()
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int32)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int32)
    size = block_shape[0] * block_shape[1]
    unique = np.unpackbits(packed[np.sort(first)], axis=1, count=size).astype(np.bool_)
    return unique.reshape(-1, *block_shape), rank[inverse.ravel()]


def _partial_ids(unique_masks, classes, grid: _Grid):
    """Deduplicated partial blocks of every unique mask and their ids [masks, nq, nk]."""
    per_mask = [
        _packed_partial_blocks(m, c, grid) for m, c in zip(unique_masks, classes, strict=True)
    ]
    blocks, ids = _deduplicate(np.concatenate(per_mask), (grid.block_q, grid.block_kv))
    partial_ids = np.zeros(classes.shape, np.int32)
    partial_ids[classes == PARTIAL] = ids  # row-major per mask, matching the concatenation
    return blocks, partial_ids


# ---- grid shrinking


def _compact(arrays, keep: np.ndarray, pad_front: bool):
    """Move the kept entries of every row (last axis) together; pad with 0 (block_mask) or
    the nearest kept entry (so a padded step fetches nothing new)."""
    count = keep.sum(axis=-1)
    width = max(int(count.max()) if count.size else 0, 1)
    # order[r, j]: column of the j-th kept entry of row r (slots past `count` unused).
    row, col = np.nonzero(keep)
    order = np.zeros((keep.shape[0], width), np.int32)
    order[row, np.arange(len(row)) - (np.cumsum(count) - count)[row]] = col
    slot = np.arange(width)
    if pad_front:  # kept entries end the row: slot j holds kept entry j - (width - count)
        source = slot[None, :] - (width - count)[:, None]
        valid = source >= 0
        source = np.clip(source, 0, None)
    else:
        valid = slot[None, :] < count[:, None]
        source = np.minimum(slot[None, :], np.maximum(count - 1, 0)[:, None])
    picked = np.take_along_axis(order, np.minimum(source, order.shape[-1] - 1), -1)
    out = []
    for index, array in enumerate(arrays):
        if array is None:
            out.append(None)
            continue
        values = np.take_along_axis(
            array, np.broadcast_to(picked, array.shape[:-2] + picked.shape), -1
        )
        out.append(np.where(valid, values, 0) if index == 0 else values)
    return out


def _shrink(block_mask, data_next, mask_next, grid: _Grid, is_dkv: bool):
    """Drop empty steps: per q shard, compact kv (forward/dQ) or q (dK/dV) blocks of
    every row to its non-empty ones; shards padded to one width (empty steps)."""
    arrays = (block_mask, data_next, mask_next)
    per_shard = grid.q_blocks // grid.q_seq_shards
    shards = []
    for s in range(0, grid.q_blocks, per_shard):
        part = [None if a is None else a[:, s : s + per_shard] for a in arrays]
        if is_dkv:  # compact along q: work on the transpose, pad at the front like JAX
            part = [None if a is None else a.swapaxes(1, 2) for a in part]
        keep = np.broadcast_to(part[0][0] != EMPTY, part[0].shape[1:])
        part = _compact(part, keep, pad_front=is_dkv)
        shards.append(part)
    width = max(p[0].shape[-1] for p in shards)
    padded = []
    for part in shards:
        extra = width - part[0].shape[-1]
        padded.append(
            [
                None
                if a is None
                else np.pad(a, ((0, 0), (0, 0), (0, extra)), mode="constant" if i == 0 else "edge")
                for i, a in enumerate(part)
            ]
        )
    joined = []
    for i in range(3):
        if padded[0][i] is None:
            joined.append(None)
            continue
        if is_dkv:
            joined.append(np.concatenate([p[i].swapaxes(1, 2) for p in padded], axis=1))
        else:
            joined.append(np.concatenate([p[i] for p in padded], axis=1))
    return joined


def _smallest_int(max_value: int) -> np.dtype:
    """The smallest of int8/int16/int32 holding 0..max_value."""
    for dtype in (np.int8, np.int16):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def _downcast(array, max_value: int):
    return None if array is None else array.astype(_smallest_int(max_value))


# ---- processing


def _as_heads(mask, name: str) -> tuple[mask_lib.Mask, ...]:
    if isinstance(mask, mask_lib.MultiHeadMask):
        return mask.masks
    if isinstance(mask, mask_lib.Mask):
        return (mask,)
    raise TypeError(f"{name}: mask must be a Mask or MultiHeadMask, got {type(mask).__name__}")


def _element_mask(mask: mask_lib.Mask) -> ElementMask | None:
    """How the kernel evaluates `mask` itself, or None when it must load partial blocks."""
    if isinstance(mask, mask_lib.DocumentMask):
        q_rel, kv_rel, q_doc, kv_doc = mask.element_arrays()
        return ElementMask(mask.rule, q_rel, kv_rel, q_doc, kv_doc)
    if isinstance(mask, mask_lib._ComputableMask):
        return ElementMask(mask.rule, mask.q_sequence, mask.kv_sequence)
    return None


def _check_rows(masks, name: str) -> None:
    for head, mask in enumerate(masks):
        empty = np.nonzero(_row_is_empty(mask))[0]
        if empty.size:
            raise ValueError(
                f"{name}: q rows {empty[:8].tolist()} of head mask {head} attend no kv "
                "position (their output would be 0); pass check_empty_rows=False to allow"
            )


def _block_rows(head_to_mask, grid: _Grid) -> tuple[list[int], bool]:
    """The unique mask of every row of block_mask, and whether rows are head shards."""
    per_shard = grid.heads // grid.head_shards
    shard_masks = [
        set(head_to_mask[s * per_shard : (s + 1) * per_shard]) for s in range(grid.head_shards)
    ]
    if max(len(m) for m in shard_masks) == 1:
        return [head_to_mask[s * per_shard] for s in range(grid.head_shards)], True
    return list(head_to_mask), False


@functools.lru_cache(maxsize=16)
def _process_static(
    heads,
    block_shape,
    is_dkv,
    downcast_smem_data,
    head_shards,
    q_seq_shards,
    shrink_grid,
    check_empty_rows,
    name,
):
    grid = _Grid.make(name, (len(heads), *heads[0].shape), block_shape, head_shards, q_seq_shards)
    unique: dict[mask_lib.Mask, int] = {}
    head_to_mask = [unique.setdefault(m, len(unique)) for m in heads]
    unique_masks = list(unique)
    if check_empty_rows:
        _check_rows(unique_masks, name)
    classes = np.stack([classify_blocks(m, (grid.block_q, grid.block_kv)) for m in unique_masks])
    element = _element_mask(unique_masks[0]) if len(unique_masks) == 1 else None
    blocks, partial_ids = None, None
    if element is None and np.any(classes == PARTIAL):
        blocks, partial_ids = _partial_ids(unique_masks, classes, grid)
    rows, rows_are_shards = _block_rows(head_to_mask, grid)
    block_mask = classes[rows]
    data_next, mask_next = _traverse_shards(
        block_mask, None if partial_ids is None else partial_ids[rows], grid, is_dkv
    )
    if shrink_grid and rows_are_shards and len(unique_masks) == 1:
        block_mask, data_next, mask_next = _shrink(block_mask, data_next, mask_next, grid, is_dkv)
    if downcast_smem_data:  # the smallest type holding the largest value, as JAX does
        block_mask = _downcast(block_mask, FULL)
        data_next = _downcast(data_next, int(data_next.max(initial=0)))
        mask_next = None if mask_next is None else _downcast(mask_next, int(mask_next.max()))
    else:
        block_mask, data_next = block_mask.astype(np.int32), data_next.astype(np.int32)
        mask_next = None if mask_next is None else mask_next.astype(np.int32)
    if is_dkv and blocks is not None:
        blocks = blocks.swapaxes(1, 2)
    q_sequence = None if element is None else element.q_sequence
    info = MaskInfo(data_next, mask_next, block_mask, blocks, q_sequence)
    return info, element


def _process_traced(mask: mask_lib.DocumentMask, grid: _Grid, is_dkv, downcast_smem_data):
    """A document mask with traced documents: static shapes, no shrinking, no partial
    blocks (the kernel evaluates them from the mask's per-token arrays)."""
    classes = classify_blocks(mask, (grid.block_q, grid.block_kv))[None]
    data_next, _ = _traverse_shards(classes, None, grid, is_dkv, xp=jnp)
    shape = (grid.head_shards, grid.q_blocks, grid.kv_blocks)
    block_mask, data_next = jnp.broadcast_to(classes, shape), jnp.broadcast_to(data_next, shape)
    int_type = jnp.int32
    if downcast_smem_data:
        block_mask = block_mask.astype(jnp.int8)
        bound = (grid.q_blocks // grid.q_seq_shards if is_dkv else grid.kv_blocks) - 1
        int_type = _smallest_int(bound)
    element = _element_mask(mask)
    mask_next = jnp.zeros(shape, int_type)
    info = MaskInfo(
        data_next.astype(int_type),
        mask_next,
        block_mask,
        None,
        element.q_sequence,
        is_dynamic_mask=True,
    )
    return info, element


def _process_mask(
    mask,
    block_shape,
    is_dkv,
    *,
    downcast_smem_data=True,
    head_shards=1,
    q_seq_shards=1,
    shrink_grid=True,
    check_empty_rows=False,
):
    name = "process_mask_dkv" if is_dkv else "process_mask"
    heads = _as_heads(mask, name)
    traced = [m for m in heads if getattr(m, "traced", False)]
    if traced:
        if any(m is not heads[0] for m in heads):
            raise ValueError(f"{name}: a traced DocumentMask must be the mask of every head")
        grid = _Grid.make(
            name, (len(heads), *heads[0].shape), block_shape, head_shards, q_seq_shards
        )
        return _process_traced(heads[0], grid, is_dkv, downcast_smem_data)
    return _process_static(
        heads,
        tuple(block_shape),
        is_dkv,
        downcast_smem_data,
        head_shards,
        q_seq_shards,
        shrink_grid,
        check_empty_rows,
        name,
    )


def process_mask(
    mask,
    block_shape,
    *,
    downcast_smem_data=True,
    head_shards=1,
    q_seq_shards=1,
    shrink_grid=True,
    check_empty_rows=False,
):
    """MaskInfo for the forward and dQ kernels (grid (head, q block, kv step)).

    Args:
      mask: a `MultiHeadMask` [heads, q_len, kv_len] or one 2-D `Mask` (every head).
      block_shape: (block_q, block_kv); each must divide its sequence length.
      downcast_smem_data: store the int arrays as int8/int16 where the values fit.
      head_shards, q_seq_shards: the mesh split of heads / q sequence inside `shard_map`;
        traversal indices stay relative to each shard.
      shrink_grid: compact every row to its non-empty kv blocks (one unique mask only).
      check_empty_rows: raise ValueError when a q row attends nothing.

    Returns:
      (MaskInfo, ElementMask | None): the element mask when the kernel evaluates partial
      blocks itself (a single computable mask), else None and `partial_mask_blocks`.
    """
    return _process_mask(
        mask,
        block_shape,
        False,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
        check_empty_rows=check_empty_rows,
    )


def process_mask_dkv(
    mask,
    block_shape,
    *,
    downcast_smem_data=True,
    head_shards=1,
    q_seq_shards=1,
    shrink_grid=True,
    check_empty_rows=False,
):
    """MaskInfo for the dK/dV kernel: grid (kv block, head, q step), `data_next` holds q
    block indices, partial blocks stored transposed [n, block_kv, block_q]. Arguments as
    `process_mask`."""
    return _process_mask(
        mask,
        block_shape,
        True,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
        check_empty_rows=check_empty_rows,
    )


def _process_dynamic(mask, block_shape, is_dkv, downcast_smem_data, head_shards, q_seq_shards):
    name = "process_dynamic_mask_dkv" if is_dkv else "process_dynamic_mask"
    if not hasattr(mask, "shape") or len(mask.shape) != 3:
        raise ValueError(f"{name}: expected a [heads, q_len, kv_len] array")
    if jnp.dtype(mask.dtype) != jnp.bool_:
        raise ValueError(f"{name}: expected a bool mask, got {mask.dtype}")
    grid = _Grid.make(name, mask.shape, block_shape, head_shards, q_seq_shards)
    h, nq, nk, bq, bk = grid.heads, grid.q_blocks, grid.kv_blocks, grid.block_q, grid.block_kv
    blocks = jnp.asarray(mask).reshape(h, nq, bq, nk, bk).swapaxes(2, 3)
    full, any_ = blocks.all(axis=(3, 4)), blocks.any(axis=(3, 4))
    classes = jnp.where(full, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int32)
    flat_ids = jnp.arange(h * nq * nk, dtype=jnp.int32).reshape(h, nq, nk)
    data_next, mask_next = _traverse_shards(classes, flat_ids, grid, is_dkv, xp=jnp)
    blocks = blocks.reshape(h * nq * nk, bq, bk)
    if is_dkv:
        blocks = blocks.swapaxes(1, 2)
    if downcast_smem_data:
        classes = classes.astype(jnp.int8)
        data_next = data_next.astype(_smallest_int(max(nq, nk) - 1))
        mask_next = mask_next.astype(_smallest_int(h * nq * nk - 1))
    return MaskInfo(data_next, mask_next, classes, blocks, None, is_dynamic_mask=True), None


def process_dynamic_mask(
    mask, block_shape, *, downcast_smem_data=True, head_shards=1, q_seq_shards=1, shrink_grid=True
):
    """MaskInfo of a traced dense mask bool [heads, q_len, kv_len], under `jax.jit`.

    Empty blocks are still marked (and skipped by the kernels); every block is kept in
    `partial_mask_blocks` [heads * q_blocks * kv_blocks, block_q, block_kv] with
    `mask_next` its flat index, since which blocks are partial is only known at run time.
    The grid is never shrunk (`shrink_grid` is accepted for JAX compatibility).
    """
    del shrink_grid
    return _process_dynamic(mask, block_shape, False, downcast_smem_data, head_shards, q_seq_shards)


def process_dynamic_mask_dkv(
    mask, block_shape, *, downcast_smem_data=True, head_shards=1, q_seq_shards=1, shrink_grid=True
):
    """`process_dynamic_mask` for the dK/dV traversal (blocks stored transposed)."""
    del shrink_grid
    return _process_dynamic(mask, block_shape, True, downcast_smem_data, head_shards, q_seq_shards)
