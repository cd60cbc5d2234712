"""`flash_attention`: varlen attention for the padded `[batch, seq, heads, head_dim]` layout.

The layout of `jax.nn.dot_product_attention`, with optional segment ids marking packed
documents. It reshapes to the packed layout and calls `varlen_attention`, so both
implementations and the same custom_vjp serve it; this file only turns segment ids into
`cu_seqlens`.

From segment ids to sequences (per batch row, all vectorised, static sizes):

* a *run* is a maximal stretch of equal ids; each query run is one packed sequence;
* a query run with id s > 0 is paired with the key run of the same id s; a query run with
  id <= 0 (padding) or whose id is absent from the key row gets no keys (output 0);
* the packed key sequences must be non-decreasing slices of the key axis, so key tokens
  not paired with any query run (padding, or documents only on the key side) go into
  extra sequences with no queries. Each query run r thus yields two slots, a key-only
  "gap" slot followed by the paired slot, and each row ends with one more gap slot:
  `batch * (2 * q_seq + 1)` sequences in all, most of them empty.

Cost of the empty sequences: the tile lists are `chunk_bound(total, BLOCK,
num_sequences)` rows, which counts at most `total` non-empty sequences rather than the
`batch * (2 * q_seq + 1)` slots. The Triton kernels walk such a list with
`cdiv(total, BLOCK) + 64` persistent programs (past 60 sequences), so their launch does
not grow with the empty slots; the XLA implementation's chunk scan still steps over
every row (an empty row costs a few scalar ops). Without segment ids each row is exactly
one sequence.

This requires every document to be one contiguous run in each row (an id must not
reappear after a different id) and the documents to appear in the same order in the
query and the key rows. Both are checked: a ValueError on concrete segment ids; under
`jit` (traced ids) a `jax.experimental.checkify` check, and without checkify the result
for ids breaking them is unspecified.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention.api import REVERSE_MODE_ONLY, varlen_attention
from jax_bridge.core.autodiff import refuse_forward_mode
from jax_bridge.core.validation import as_int32, is_traced, naming_op, require_all

__all__ = ["flash_attention"]

_OP = "flash_attention"


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    causal: bool = False,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    return_lse: bool = False,
    precision: Any = None,
    config: Any = None,
    implementation: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over padded batches, with packed documents marked by segment ids.

    Query i may attend key j of the same batch row when both carry the same segment id
    s > 0 (ids <= 0 are padding: a padding query outputs 0), subject to `causal` and
    `sliding_window` measured within that document. Without segment ids every batch row
    is one document.

    Causal and window masks are aligned at the bottom-right corner of each document (the
    FlashAttention >= 2.1 convention of `varlen_attention`): when a document has n query
    and m key tokens, its query i sits at key position i + m - n. For self-attention
    (same ids on both sides) this is the ordinary causal mask. Note that
    `jax.nn.dot_product_attention(is_causal=True)` aligns top-left instead; the two agree
    when query and key lengths are equal.

    Args:
      q: [batch, q_seq, num_q_heads, head_dim].
      k, v: [batch, kv_seq, num_kv_heads, head_dim] (GQA/MQA as in `varlen_attention`).
      q_segment_ids: int [batch, q_seq] or None.
      kv_segment_ids: int [batch, kv_seq] or None. When only `q_segment_ids` is given it
        is used for the keys too (q_seq must equal kv_seq). Each document must be one
        contiguous run per row, in the same order on both sides (see module docstring).
      causal, sliding_window, logits_soft_cap, softmax_scale, sinks, alibi_slopes,
      precision, config, implementation: as for `varlen_attention` (the batch rows are
      its packed sequences).
      return_lse: also return the log-sum-exp of each query's scores.

    Returns:
      out: [batch, q_seq, num_q_heads, head_dim] in q's dtype; 0 at padding queries and
      at queries that attend no key. With `return_lse`, (out, lse): lse float32
      [batch, num_q_heads, q_seq] (FlashAttention's `softmax_lse` layout), natural log,
      -inf where a query attends no key (padding included) and no sink.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or x.ndim != 4:
            shape = getattr(x, "shape", type(x).__name__)
            raise ValueError(
                f"{_OP}: {name} must have shape [batch, seq, heads, head_dim], got {shape}."
            )
    batch, q_seq = q.shape[:2]
    kv_seq = k.shape[1]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(
            f"{_OP}: q, k and v must share the batch size, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if kv_segment_ids is not None and q_segment_ids is None:
        raise ValueError(f"{_OP}: kv_segment_ids given without q_segment_ids; pass both.")
    if q_segment_ids is None or q_seq == 0:  # (no query tokens: nothing to label)
        cu_q = jnp.arange(batch + 1, dtype=jnp.int32) * q_seq
        cu_k = jnp.arange(batch + 1, dtype=jnp.int32) * kv_seq
    else:
        if kv_segment_ids is None:
            if q_seq != kv_seq:
                raise ValueError(
                    f"{_OP}: kv_segment_ids is required when q and k lengths differ "
                    f"({q_seq} != {kv_seq})."
                )
            kv_segment_ids = q_segment_ids
        q_ids = _check_segment_ids(q_segment_ids, "q_segment_ids", (batch, q_seq))
        kv_ids = _check_segment_ids(kv_segment_ids, "kv_segment_ids", (batch, kv_seq))
        cu_q, cu_k = segment_ids_to_cu_seqlens(q_ids, kv_ids)
    refuse_forward_mode(_OP, q, k, v, sinks, works=REVERSE_MODE_ONLY)
    with naming_op(_OP, replacing=("varlen_attention",)):  # its checks: the call was ours
        out = varlen_attention(
            q.reshape(batch * q_seq, *q.shape[2:]),
            k.reshape(batch * kv_seq, *k.shape[2:]),
            v.reshape(batch * kv_seq, *v.shape[2:]),
            cu_q,
            cu_k,
            causal=causal,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            softmax_scale=softmax_scale,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
            return_lse=return_lse,
            precision=precision,
            config=config,
            implementation=implementation,
        )
    if not return_lse:
        return out.reshape(q.shape)
    out, lse = out  # lse: [num_q_heads, batch * q_seq]
    return out.reshape(q.shape), lse.reshape(-1, batch, q_seq).transpose(1, 0, 2)


def _check_segment_ids(ids: Any, name: str, shape: tuple[int, int]) -> jax.Array:
    arr = ids if is_traced(ids) else np.asarray(ids)
    if not jnp.issubdtype(arr.dtype, jnp.integer) or arr.dtype == np.bool_:
        raise TypeError(f"{_OP}: {name} must hold integer ids, got dtype {arr.dtype}.")
    if tuple(arr.shape) != shape:
        raise ValueError(f"{_OP}: {name} must have shape {shape}, got {tuple(arr.shape)}.")
    # Wrapped to int32, two documents' ids could become one (or padding's 0).
    return jnp.asarray(as_int32(arr, f"{_OP}: {name}"))


def _runs(ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Maximal runs of equal ids in one row `ids: [S]` (S >= 1).

    Returns [S] arrays (start, end, id): run r covers [start[r], end[r]); slots past the
    last run are empty runs at S with id 0 (padding).
    """
    size = ids.shape[0]
    is_start = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
    start = jnp.nonzero(is_start, size=size, fill_value=size)[0].astype(jnp.int32)
    end = jnp.concatenate([start[1:], jnp.full((1,), size, jnp.int32)])
    run_id = jnp.where(start < size, ids[jnp.minimum(start, size - 1)], 0)
    return start, end, run_id


def _has_repeats(run_id: jax.Array) -> jax.Array:
    """True when a positive id labels two runs of the row (a non-contiguous document)."""
    ordered = jnp.sort(jnp.where(run_id > 0, run_id, 0))
    return jnp.any((ordered[1:] == ordered[:-1]) & (ordered[1:] > 0))


def _row_boundaries(q_ids: jax.Array, kv_ids: jax.Array):
    """Slot boundaries of one row (see module docstring).

    Returns:
      q_bounds, kv_bounds: int32 [2 * Sq + 1], the end of each slot within the row
      (gap_0, run_0, gap_1, run_1, ..., final gap); q_repeat, kv_repeat, out_of_order:
      scalar bools for the checks.
    """
    q_size, kv_size = q_ids.shape[0], kv_ids.shape[0]
    qs, qe, q_run_id = _runs(q_ids)
    if kv_size == 0:
        kv_start = kv_end = jnp.zeros((1,), jnp.int32)
        kv_run_id = jnp.zeros((1,), jnp.int32)
    else:
        kv_start, kv_end, kv_run_id = _runs(kv_ids)
    # Pair each query run with the key run of the same positive id: sort the key runs by
    # id (padding runs get the largest key so they never match) and search them (by a
    # sort: the default method is a `while` loop, a host round trip per step on a GPU).
    sentinel = jnp.iinfo(jnp.int32).max
    key = jnp.where(kv_run_id > 0, kv_run_id, sentinel)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    pos = jnp.clip(jnp.searchsorted(sorted_key, q_run_id, method="sort"), 0, key.shape[0] - 1)
    kv_run = order[pos]
    matched = (q_run_id > 0) & (sorted_key[pos] == q_run_id) & (kv_run_id[kv_run] > 0)
    ks, ke = kv_start[kv_run], kv_end[kv_run]
    # prev_end[r]: end of the last paired key run before query run r (0 if none).
    last_end = jax.lax.cummax(jnp.where(matched, ke, 0))
    prev_end = jnp.concatenate([jnp.zeros((1,), jnp.int32), last_end[:-1]])
    out_of_order = jnp.any(matched & (ks < prev_end))
    # Unpaired query runs take an empty key slice where the previous one ended, keeping
    # the key boundaries non-decreasing.
    ks = jnp.where(matched, ks, prev_end)
    ke = jnp.where(matched, ke, prev_end)
    q_bounds = jnp.concatenate([jnp.stack([qs, qe], axis=1).reshape(-1), jnp.array([q_size])])
    kv_bounds = jnp.concatenate([jnp.stack([ks, ke], axis=1).reshape(-1), jnp.array([kv_size])])
    return (
        q_bounds.astype(jnp.int32),
        kv_bounds.astype(jnp.int32),
        _has_repeats(q_run_id),
        _has_repeats(kv_run_id),
        out_of_order,
    )


def segment_ids_to_cu_seqlens(
    q_segment_ids: jax.Array, kv_segment_ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Packed-layout `cu_seqlens` of padded, segment-id-labelled batches.

    Args:
      q_segment_ids: int32 [batch, q_seq]; kv_segment_ids: int32 [batch, kv_seq]
        (q_seq >= 1). Ids <= 0 are padding.

    Returns:
      (cu_seqlens_q, cu_seqlens_k): int32 [batch * (2 * q_seq + 1) + 1] each, indexing the
      row-major flattened token axes `[batch * q_seq]` and `[batch * kv_seq]`.

    Raises:
      ValueError (concrete ids) when a document is split into several runs of a row or
      when the documents' order differs between the query and key rows.
    """
    cu_q, cu_k, q_repeat, kv_repeat, out_of_order = _cu_seqlens_and_checks(
        jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)
    )
    # After the (jitted) computation the flags are concrete unless the caller traces.
    require_all(
        ~q_repeat,
        f"{_OP}: q_segment_ids must hold each document as one contiguous run per row "
        "(an id reappears after a different id).",
    )
    require_all(
        ~kv_repeat,
        f"{_OP}: kv_segment_ids must hold each document as one contiguous run per row "
        "(an id reappears after a different id).",
    )
    require_all(
        ~out_of_order,
        f"{_OP}: kv_segment_ids must list the documents in the same order as q_segment_ids.",
    )
    return cu_q, cu_k


@jax.jit
def _cu_seqlens_and_checks(q_ids: jax.Array, kv_ids: jax.Array):
    """cu_seqlens_q, cu_seqlens_k and per-row check flags [batch] (see the caller)."""
    (batch, q_seq), kv_seq = q_ids.shape, kv_ids.shape[1]
    q_bounds, kv_bounds, q_repeat, kv_repeat, out_of_order = jax.vmap(_row_boundaries)(
        q_ids, kv_ids
    )
    row = jnp.arange(batch, dtype=jnp.int32)[:, None]
    zero = jnp.zeros((1,), jnp.int32)
    cu_q = jnp.concatenate([zero, (q_bounds + row * q_seq).reshape(-1)])
    cu_k = jnp.concatenate([zero, (kv_bounds + row * kv_seq).reshape(-1)])
    return cu_q, cu_k, q_repeat, kv_repeat, out_of_order
