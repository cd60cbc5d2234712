"""Segment ids <-> attention masks for packed sequences.

A *segment mask* is the attention pattern of packed, independent sequences: query `i` may
attend key `j` exactly when both belong to the same (non-padding) segment. Up to a
permutation of rows and of columns it is block diagonal, with padding rows and columns
all zero. `segment_ids_to_mask` builds one from ids; `mask_to_segment_ids` recovers ids
from any boolean mask, and `is_segment_mask` says whether the ids describe the mask exactly.

Conventions shared by every function here:
- ids <= 0 mark padding: a padding query attends nothing and a padding key is attended
  by nothing, even when two padding ids are equal;
- recovered ids are int32, start at 1 in the order the query rows first appear, and an
  all-zero row or column gets -1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_bridge.core.numerics import cdiv
from jax_bridge.core.validation import naming_op

__all__ = [
    "SegmentMasks",
    "is_segment_mask",
    "mask_to_segment_ids",
    "segment_ids_to_mask",
]

_BITS_PER_WORD = 32
# Row patterns are compared `_WORDS_PER_SORT` uint32 words (512 keys) at a time: one sort
# per group of words keeps the comparator small however long the key axis is.
_WORDS_PER_SORT = 16
_PADDING_ID = -1


class SegmentMasks(NamedTuple):
    """What `segment_ids_to_mask(..., return_separate_masks=True)` returns, in the order
    of the API this package follows (`q_mask, kv_mask, attention_mask = ...`).

    q_mask:         [..., Q]     True where the query id is a real segment (id > 0)
    kv_mask:        [..., K]     True where the key id is a real segment (id > 0)
    attention_mask: [..., Q, K]  q_mask[..., :, None] & kv_mask[..., None, :] & (q_ids == kv_ids)
    All three have the requested dtype.
    """

    q_mask: jax.Array
    kv_mask: jax.Array
    attention_mask: jax.Array


def _dtype_of(value: object) -> np.dtype:
    """The dtype `value` has or would get, without converting tracers."""
    return value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype


def _as_segment_ids(ids: object, name: str) -> jax.Array:
    dtype = _dtype_of(ids)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer segment ids, got dtype {dtype}")
    array = jnp.asarray(ids)
    if array.ndim < 1:
        raise ValueError(f"{name} must have shape [..., seq_len], got a scalar")
    return array


@naming_op("segment_ids_to_mask")
def segment_ids_to_mask(
    segment_ids: jax.Array | tuple[jax.Array, jax.Array],
    dtype: jnp.dtype = jnp.bool_,
    return_separate_masks: bool = False,
) -> jax.Array | SegmentMasks:
    """Attention mask of packed segments.

    Args:
      segment_ids: int ids `[..., S]` (an array, or a list of ints) used for both
        queries and keys, or a pair of arrays `(q_segment_ids [..., Q], kv_segment_ids
        [..., K])` whose leading dims broadcast.
        Ids <= 0 are padding.
      dtype: dtype of the returned masks (bool, or a number type holding 1 / 0).
      return_separate_masks: also return the query-side and key-side validity masks.

    Returns:
      mask `[..., Q, K]`: True where both ids are equal and positive; or, with
      `return_separate_masks=True`, a `SegmentMasks(q_mask [..., Q], kv_mask [..., K],
      attention_mask [..., Q, K])` named tuple.
    """
    # A sequence of arrays is a (q, kv) pair; one of scalars is a list of ids.
    if isinstance(segment_ids, tuple | list) and any(np.ndim(x) for x in segment_ids):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids must be one id array or a pair (q_segment_ids, kv_segment_ids), "
                f"got a sequence of length {len(segment_ids)}"
            )
        q_ids = _as_segment_ids(segment_ids[0], "q_segment_ids")
        kv_ids = _as_segment_ids(segment_ids[1], "kv_segment_ids")
    else:
        q_ids = kv_ids = _as_segment_ids(segment_ids, "segment_ids")
    try:
        np.broadcast_shapes(q_ids.shape[:-1], kv_ids.shape[:-1])
    except ValueError:
        raise ValueError(
            "q_segment_ids [..., Q] and kv_segment_ids [..., K] must have broadcastable "
            f"leading dims, got shapes {q_ids.shape} and {kv_ids.shape}"
        ) from None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a JAX dtype, got {dtype!r}") from None

    q_valid = q_ids > 0
    kv_valid = kv_ids > 0
    # Equal ids with a positive query id: the key id is then positive too.
    mask = (q_ids[..., :, None] == kv_ids[..., None, :]) & q_valid[..., :, None]
    if not return_separate_masks:
        return mask.astype(dtype)
    return SegmentMasks(q_valid.astype(dtype), kv_valid.astype(dtype), mask.astype(dtype))


def _pack_rows(mask: jax.Array) -> jax.Array:
    """Packs each row into words. mask: [Q, K] bool -> [Q, W] uint32, W = ceil(K / 32)."""
    q_len, kv_len = mask.shape
    num_words = cdiv(kv_len, _BITS_PER_WORD)
    # Zero padding never changes which rows are equal.
    bits = jnp.pad(mask, ((0, 0), (0, num_words * _BITS_PER_WORD - kv_len)))
    bits = bits.astype(jnp.uint32).reshape(q_len, num_words, _BITS_PER_WORD)
    shifts = jnp.arange(_BITS_PER_WORD, dtype=jnp.uint32)
    # The shifted bits are disjoint, so their sum is their bitwise OR.
    return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)


def _pattern_labels(words: jax.Array) -> jax.Array:
    """Dense labels of row patterns. words: [Q, W] uint32 -> [Q] int32.

    Invariant after each step: rows share a label iff they agree on every word seen so far.
    Each step sorts by (label, next group of words) and relabels where the keys change.
    """
    q_len, num_words = words.shape
    words_per_sort = min(num_words, _WORDS_PER_SORT)
    num_steps = cdiv(num_words, words_per_sort)
    words = jnp.pad(words, ((0, 0), (0, num_steps * words_per_sort - num_words)))
    groups = words.reshape(q_len, num_steps, words_per_sort).transpose(1, 2, 0)
    row_index = jnp.arange(q_len, dtype=jnp.int32)

    def refine(labels: jax.Array, group: jax.Array) -> tuple[jax.Array, None]:
        """group: [words_per_sort, Q]."""
        keys = (labels, *(group[w] for w in range(words_per_sort)))
        *sorted_keys, order = lax.sort((*keys, row_index), num_keys=len(keys))
        changed = jnp.zeros(q_len - 1, dtype=jnp.bool_)
        for key in sorted_keys:
            changed = changed | (key[1:] != key[:-1])
        starts_group = jnp.concatenate([jnp.ones(1, dtype=jnp.bool_), changed])
        sorted_labels = jnp.cumsum(starts_group, dtype=jnp.int32) - 1
        return jnp.zeros(q_len, jnp.int32).at[order].set(sorted_labels), None

    labels = jnp.zeros(q_len, jnp.int32)
    if num_steps == 1:
        return refine(labels, groups[0])[0]
    return lax.scan(refine, labels, groups)[0]


def _segment_ids_2d(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """mask: [Q, K] bool -> (q_ids [Q], kv_ids [K]) int32, both Q and K non-zero."""
    q_len = mask.shape[0]
    labels = _pattern_labels(_pack_rows(mask))
    row_index = jnp.arange(q_len, dtype=jnp.int32)
    first_row_of_label = jax.ops.segment_min(row_index, labels, num_segments=q_len)
    first_row = first_row_of_label[labels]  # earliest row with the same pattern
    row_attends = jnp.any(mask, axis=1)
    opens_segment = (first_row == row_index) & row_attends
    # Ids count the distinct non-empty patterns up to and including the row's first copy.
    ids_by_first_row = jnp.cumsum(opens_segment, dtype=jnp.int32)
    q_ids = jnp.where(row_attends, ids_by_first_row[first_row], _PADDING_ID)

    # A key takes the id of the first query that attends it. In a segment mask all queries
    # attending a key share one pattern, hence one id, so the round trip is exact there.
    # A min-reduction over rows (q_len where nobody attends) is much faster on CPU than a
    # column-wise argmax.
    first_attending_row = jnp.min(jnp.where(mask, row_index[:, None], q_len), axis=0)
    key_attended = first_attending_row < q_len
    kv_ids = jnp.where(
        key_attended, q_ids[jnp.minimum(first_attending_row, q_len - 1)], _PADDING_ID
    )
    return q_ids, kv_ids


def _as_mask(mask: object, per_head: bool) -> jax.Array:
    """Validates a mask argument and returns it as a bool array (non-zero attends)."""
    dtype = _dtype_of(mask)
    if not (
        dtype == np.bool_
        or jnp.issubdtype(dtype, jnp.integer)
        or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(f"mask must be bool or numeric (non-zero attends), got dtype {dtype}")
    array = jnp.asarray(mask)
    if array.ndim not in (2, 3, 4):
        raise ValueError(
            "mask must have shape [Q, K], [B, Q, K] or [B, H, Q, K], "
            f"got {array.ndim} dims (shape {array.shape})"
        )
    if per_head and array.ndim != 4:
        raise ValueError(f"per_head=True needs a mask of shape [B, H, Q, K], got {array.shape}")
    return array if array.dtype == jnp.bool_ else array != 0


@naming_op("mask_to_segment_ids")
def mask_to_segment_ids(mask: jax.Array, per_head: bool = False) -> tuple[jax.Array, jax.Array]:
    """Segment ids that describe `mask`, exactly so when it is a segment mask.

    Query ids: rows with identical patterns share an id; ids start at 1 in the order the
    rows first appear; all-zero rows get -1. Key ids: column `j` gets the id of the first
    row that attends it (-1 if none attends it), so identical columns share an id, and
    for a segment mask each key's id is the id of its segment's queries. Hence
    `segment_ids_to_mask(mask_to_segment_ids(m)) == m` exactly when `m` is a segment mask
    (see `is_segment_mask`); for any other mask the ids are only a description of rows.

    Args:
      mask: `[Q, K]`, `[B, Q, K]` or `[B, H, Q, K]`, bool or numeric (non-zero attends).
      per_head: for `[B, H, Q, K]` only: give every head its own ids. With the default
        `False` the heads are combined by union (a query attends a key if any head lets
        it) and the ids describe that union; when all heads agree it is each head's mask.

    Returns:
      `(q_segment_ids, kv_segment_ids)`, int32, shaped like the mask without its last
      (resp. second-to-last) axis and, unless `per_head`, without the head axis:
      `[Q]/[K]`, `[B, Q]/[B, K]`, `[B, Q]/[B, K]` or (per_head) `[B, H, Q]/[B, H, K]`.
    """
    return _segment_ids_of_bool_mask(_as_mask(mask, per_head), per_head)


# Jitted as a whole so that eager callers compile one program instead of dozens of ops.
@functools.partial(jax.jit, static_argnames="per_head")
def _segment_ids_of_bool_mask(mask: jax.Array, per_head: bool) -> tuple[jax.Array, jax.Array]:
    """mask: validated bool [Q, K] / [B, Q, K] / [B, H, Q, K]; see `mask_to_segment_ids`."""
    if mask.ndim == 4 and not per_head:
        mask = jnp.any(mask, axis=1)
    batch_shape, (q_len, kv_len) = mask.shape[:-2], mask.shape[-2:]
    if q_len == 0 or kv_len == 0:
        # No entry is set: every row and column is padding.
        return (
            jnp.full((*batch_shape, q_len), _PADDING_ID, jnp.int32),
            jnp.full((*batch_shape, kv_len), _PADDING_ID, jnp.int32),
        )
    flat = mask.reshape(-1, q_len, kv_len)
    q_ids, kv_ids = jax.vmap(_segment_ids_2d)(flat)
    return q_ids.reshape(*batch_shape, q_len), kv_ids.reshape(*batch_shape, kv_len)


@naming_op("is_segment_mask")
def is_segment_mask(mask: jax.Array, per_head: bool = False) -> jax.Array:
    """Whether `mask` is exactly the mask of some segment ids.

    True exactly when `segment_ids_to_mask(mask_to_segment_ids(mask, per_head))`
    reproduces `mask` (broadcast over the head axis of a `[B, H, Q, K]` mask when
    `per_head=False`, which therefore also requires all heads to agree). Equivalently,
    any two non-empty rows attend either the same keys or disjoint keys. A causal mask
    with Q >= 2 is not a segment mask (its rows are nested, not disjoint), nor is a
    sliding-window mask.

    Args:
      mask: `[Q, K]`, `[B, Q, K]` or `[B, H, Q, K]`, bool or numeric (non-zero attends).
      per_head: see `mask_to_segment_ids`.

    Returns:
      bool scalar array: True when every batch entry (and head) round-trips.
    """
    return _round_trips(_as_mask(mask, per_head), per_head)


@functools.partial(jax.jit, static_argnames="per_head")
def _round_trips(mask: jax.Array, per_head: bool) -> jax.Array:
    """mask: validated bool mask -> bool scalar; see `is_segment_mask`."""
    rebuilt = segment_ids_to_mask(_segment_ids_of_bool_mask(mask, per_head))
    if mask.ndim == 4 and not per_head:
        rebuilt = rebuilt[:, None]
    return jnp.all(rebuilt == mask)
