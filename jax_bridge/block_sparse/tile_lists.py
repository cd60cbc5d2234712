"""The Triton kernels' work lists and element rules, built from the mask.

Tile lists (`TileLists`; layout in `triton_kernels.block_sparse.forward`): for each head
group and each stationary tile (a query tile for the forward and dQ kernels, a key tile
for dK/dV) the other side's tiles it visits, full ones first; and the order in which
programs take the stationary tiles, heaviest first. A static mask's lists are numpy
arrays built once per (mask, tile shape) from `masks.static_block_list`; a DocumentMask
of traced arrays gets its lists in the graph from `classify_blocks` (every tile of the
other side is a slot: width = that side's tile count).

Element rules (`ElementRule`): how a kernel evaluates a partial tile. A mask whose every
row allows one run of kv rows (`Mask.row_intervals` of one column, over plain kv
positions: documents, causal, local, chunked) is that run's bounds per query token
(INTERVALS), which the kernels compare with their tiles' row numbers. Other masks with a
rule on token positions are evaluated in the kernel from per-token arrays (TOKENS): a
DocumentMask is its documents and window; Causal / Local / ChunkedCausal / PrefixLM
masks are one document (ChunkedCausal: one per chunk) with a window and, for PrefixLM,
the prefix. A PredicateMask with a `triton_predicate` calls it (PREDICATE). Everything
else (NumpyMask, `|` / `&`, a PredicateMask without one, several head groups) reads its
deduplicated partial blocks from a table (TABLE).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.block_sparse.masks import (
    EMPTY,
    FULL,
    PARTIAL,
    is_traced_document,
    pad_mask,
    padded_shape,
    static_block_list,
)
from pallas_tpu.splash.mask_info import classify_blocks
from pallas_tpu.splash.masks import (
    CausalRule,
    ChunkedCausalRule,
    DocumentMask,
    LocalRule,
    Mask,
    PredicateMask,
    PrefixLMRule,
    _ComputableMask,
)
from triton_kernels.block_sparse.forward import INTERVALS as _INTERVALS
from triton_kernels.block_sparse.forward import PREDICATE_MODE as _PREDICATE
from triton_kernels.block_sparse.forward import TABLE as _TABLE
from triton_kernels.block_sparse.forward import TOKENS as _TOKENS

TABLE, TOKENS, PREDICATE, INTERVALS = (m.value for m in (_TABLE, _TOKENS, _PREDICATE, _INTERVALS))


# ------------------------------------------------------------------------- tile lists


@dataclasses.dataclass(frozen=True, eq=False)
class TileLists:
    """One kernel's lists for every head group (numpy, or jax arrays for a traced mask).

    counts: int32 [G, n, 2] (full, total) tiles visited by each of the n stationary tiles;
    tiles: int32 [G, n, width] their other-side tiles, full first; codes: int32
    [G, n, width] the table block of each partial tile (TABLE mode; 0 otherwise);
    items: the program order, heaviest first: int32 [G * n, 2] (tile, group) for query
    stationary kernels, int32 [n] for dK/dV; table: int8 [P, block_q, block_kv].
    """

    counts: Any
    tiles: Any
    codes: Any
    items: Any
    table: Any

    @property
    def shape(self) -> tuple[int, int]:
        """(n stationary tiles, width)."""
        return self.tiles.shape[1], self.tiles.shape[2]


def _one_group(mask: Mask, block_shape, kv_major: bool, code_offset: int):
    """(counts [n, 2], tiles [n, w], codes [n, w], partial blocks) of one static mask."""
    blocks = static_block_list(mask, block_shape)
    stationary, other = blocks.q_block, blocks.kv_block
    if kv_major:
        stationary, other = other, stationary
    n = mask.shape[1] // block_shape[1] if kv_major else mask.shape[0] // block_shape[0]
    order = np.lexsort((other, blocks.kind != FULL, stationary))
    stationary, other = stationary[order], other[order]
    kind, partial_id = blocks.kind[order], blocks.partial_id[order]
    total = np.bincount(stationary, minlength=n)
    full = np.bincount(stationary[kind == FULL], minlength=n)
    starts = np.concatenate([[0], np.cumsum(total)[:-1]])
    slot = np.arange(len(order)) - starts[stationary]
    width = max(int(total.max(initial=0)), 1)
    tiles = np.zeros((n, width), np.int32)
    codes = np.zeros((n, width), np.int32)
    tiles[stationary, slot] = other
    codes[stationary, slot] = np.where(kind == PARTIAL, partial_id + code_offset, 0)
    return np.stack([full, total], -1), tiles, codes, blocks.partial_blocks


@functools.lru_cache(maxsize=64)
def static_tile_lists(
    masks: tuple[Mask, ...], heads: tuple[int, ...], block_shape: tuple[int, int], kv_major: bool
) -> TileLists:
    """The lists of padded static 2-D masks, one per head group, `heads[g]` heads each."""
    parts, offset = [], 0
    for mask in masks:
        part = _one_group(mask, block_shape, kv_major, offset)
        offset += len(part[3])
        parts.append(part)
    width = max(p[1].shape[1] for p in parts)
    pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1])))
    counts = np.stack([p[0] for p in parts]).astype(np.int32)
    tiles = np.stack([pad(p[1]) for p in parts])
    codes = np.stack([pad(p[2]) for p in parts])
    table = np.concatenate([p[3] for p in parts]).astype(np.int8)
    work = counts[..., 1]  # [G, n]
    if kv_major:  # every query head of every group adds to a key tile's program
        items = np.argsort(-(np.asarray(heads)[:, None] * work).sum(0), kind="stable")
    else:
        group, tile = np.divmod(np.argsort(-work.ravel(), kind="stable"), work.shape[1])
        items = np.stack([tile, group], -1)
    return TileLists(counts, tiles, codes, items.astype(np.int32), table)


def traced_tile_lists(mask: DocumentMask, block_shape, kv_major: bool) -> TileLists:
    """The lists of one padded DocumentMask of traced arrays, built in the graph."""
    classes = classify_blocks(mask, block_shape)  # traced int8 [nq, nk]
    if kv_major:
        classes = classes.T
    rank = jnp.where(classes == FULL, 0, jnp.where(classes == PARTIAL, 1, 2))
    tiles = jnp.argsort(rank, axis=1, stable=True).astype(jnp.int32)
    full = jnp.sum(classes == FULL, axis=1, dtype=jnp.int32)
    total = jnp.sum(classes != EMPTY, axis=1, dtype=jnp.int32)
    order = jnp.argsort(-total, stable=True).astype(jnp.int32)
    items = order if kv_major else jnp.stack([order, jnp.zeros_like(order)], -1)
    counts = jnp.stack([full, total], -1)[None]
    return TileLists(counts, tiles[None], jnp.zeros_like(tiles)[None], items, _NO_TABLE)


_NO_TABLE = np.zeros((1, 1, 1), np.int8)


def tile_lists(groups, block_shape, q_len: int, kv_len: int, kv_major: bool) -> TileLists:
    """The lists of `groups` (((heads...), 2-D mask), ...) for tiles of `block_shape`
    (block_q, block_kv), the masks padded to whole tiles."""
    shape = padded_shape(q_len, kv_len, block_shape)
    if is_traced_document(groups[0][1]):
        return traced_tile_lists(pad_mask(groups[0][1], shape), block_shape, kv_major)
    masks = tuple(pad_mask(mask, shape) for _, mask in groups)
    heads = tuple(len(h) for h, _ in groups)
    return static_tile_lists(masks, heads, tuple(block_shape), kv_major)


# ---------------------------------------------------------------------- element rules


@dataclasses.dataclass(frozen=True, eq=False)
class ElementRule:
    """How the kernels evaluate partial tiles (module docstring).

    mode: TABLE, TOKENS, PREDICATE or INTERVALS. arrays: (q_doc, kv_doc, q_pos, kv_pos),
    int32 [the padded q / kv lengths] (1-element placeholders for TABLE; INTERVALS: each
    query row's lo and hi in the q_doc and q_pos places, placeholders in the kv ones,
    empty (lo > hi) past the mask's rows); window: (left, right), a
    side None is unbounded; prefix: keys at positions < prefix are visible inside the
    document (None: no prefix); predicate: the `@triton.jit` function (PREDICATE).
    """

    mode: int
    arrays: tuple[Any, Any, Any, Any]
    window: tuple[int | None, int | None] = (None, None)
    prefix: int | None = None
    predicate: Any = None

    def scalars(self) -> tuple[int, int, int]:
        """The kernels' runtime (window_left, window_right, prefix)."""
        left, right = self.window
        return (left or 0, right or 0, self.prefix or 0)

    def flags(self) -> dict[str, Any]:
        """The kernels' constexprs of the rule."""
        return dict(
            MASK_MODE=self.mode,
            HAS_LEFT=self.window[0] is not None,
            HAS_RIGHT=self.window[1] is not None,
            HAS_PREFIX=self.prefix is not None,
            PREDICATE=self.predicate,
        )


_PLACEHOLDER = np.zeros((1,), np.int32)


def _padded(values: np.ndarray, length: int, fill: int) -> np.ndarray:
    return np.concatenate(
        [np.asarray(values, np.int32), np.full(length - len(values), fill, np.int32)]
    )


def _positions(mask) -> tuple[np.ndarray, np.ndarray]:
    kv_len = mask.shape[1]
    kv = mask.kv_sequence if mask.kv_sequence is not None else np.arange(kv_len)
    return np.asarray(mask.q_sequence, np.int64), np.asarray(kv, np.int64)


def _rule_tokens(mask: _ComputableMask):
    """(q_doc, kv_doc, q_pos, kv_pos, window, prefix) of a position rule, or None."""
    q, kv = _positions(mask)
    rule, one = mask.rule, (np.zeros_like(q), np.zeros_like(kv))
    if isinstance(rule, CausalRule):
        return (*one, q + rule.offset, kv, (None, 0), None)
    if isinstance(rule, LocalRule):
        return (*one, q + rule.offset, kv, (rule.left, rule.right), None)
    if isinstance(rule, ChunkedCausalRule):
        return (q // rule.chunk_size, kv // rule.chunk_size, q, kv, (None, 0), None)
    if isinstance(rule, PrefixLMRule):
        return (*one, q + rule.offset, kv, (None, 0), rule.prefix_length)
    return None


def _interval_rule(mask: Mask, q_tokens: int) -> ElementRule | None:
    """The INTERVALS rule of `mask` (its arrays padded to q_tokens rows), or None where a
    row may allow more than one run of kv rows or kv positions are not the row numbers."""
    if mask.kv_positions() is not None:
        return None
    intervals = mask.row_intervals()
    if intervals is None or intervals[0].shape[1] != 1:
        return None
    xp = jnp if isinstance(intervals[0], jax.Array) else np  # a traced DocumentMask's
    q_len, kv_len = mask.shape
    # Bounded to the real kv rows (a FullMask's are unbounded): padded keys never match.
    lo = xp.maximum(intervals[0][:, 0], 0).astype(np.int32)
    hi = xp.minimum(intervals[1][:, 0], kv_len - 1).astype(np.int32)
    padding = q_tokens - q_len
    lo = xp.concatenate([lo, xp.ones((padding,), np.int32)])  # empty rows: lo > hi
    hi = xp.concatenate([hi, xp.zeros((padding,), np.int32)])
    return ElementRule(INTERVALS, (lo, _PLACEHOLDER, hi, _PLACEHOLDER))


def element_rule(groups, q_tokens: int, kv_tokens: int) -> ElementRule:
    """The rule of `groups` (as `tile_lists`), its arrays padded to q_tokens / kv_tokens
    (at least every kernel's padded lengths)."""
    if len(groups) > 1:
        return ElementRule(TABLE, (_PLACEHOLDER,) * 4)
    mask = groups[0][1]
    if (rule := _interval_rule(mask, q_tokens)) is not None:
        return rule
    fits = lambda x: np.all(np.abs(np.asarray(x)) < 2**30)
    if isinstance(mask, DocumentMask):
        q_rel, kv_rel, q_doc, kv_doc = pad_mask(mask, (q_tokens, kv_tokens)).element_arrays()
        return ElementRule(TOKENS, (q_doc, kv_doc, q_rel, kv_rel), mask.window)
    if isinstance(mask, _ComputableMask):
        tokens = _rule_tokens(mask)
        # The kernels compare positions +- the window in int32.
        if tokens is not None and all(
            fits(x) for x in (*tokens[:4], *tokens[4], tokens[5]) if x is not None
        ):
            q_doc, kv_doc, q_pos, kv_pos, window, prefix = tokens
            arrays = (
                _padded(q_doc, q_tokens, -1),
                _padded(kv_doc, kv_tokens, -2),
                _padded(q_pos, q_tokens, 0),
                _padded(kv_pos, kv_tokens, 0),
            )
            return ElementRule(TOKENS, arrays, window, prefix)
    if isinstance(mask, PredicateMask) and mask.triton_predicate is not None:
        q, kv = _positions(mask)
        arrays = (_PLACEHOLDER, _PLACEHOLDER, _padded(q, q_tokens, 0), _padded(kv, kv_tokens, 0))
        return ElementRule(PREDICATE, arrays, predicate=mask.triton_predicate)
    return ElementRule(TABLE, (_PLACEHOLDER,) * 4)
