"""The dense attention oracle: a [total_q, total_k] score matrix per head, masked.

Written for clarity, not speed: every rule of `jax_bridge.attention.spec` appears once,
on whole matrices, so memory is O(heads * total_q * total_k). Differentiable with
`jax.grad` in every float input (q, k, v, sinks). Use float32 (or float64 under
`jax.enable_x64(True)`) inputs for an oracle.

`attention_reference` takes `varlen_attention`'s arguments; users check their own runs
against it, and every backend's tests share it. `dense_attention` is the same oracle
for a ready-made `AttentionSpec`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention.spec import AttentionSpec

__all__ = ["alibi_distance", "allowed_mask", "attention_reference", "dense_attention"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _positions(cu_seqlens: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence id, position in sequence, sequence length) of every packed token.

    Tokens past cu_seqlens[-1] get sequence id `batch` (no sequence), position 0, length 0.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    batch = len(cu) - 1
    token = np.arange(total)
    seq = np.searchsorted(cu, token, side="right") - 1
    inside = seq < batch
    seq_in = np.minimum(seq, max(batch - 1, 0))
    lengths = np.diff(cu)
    if batch == 0:
        return seq, np.zeros(total, np.int64), np.zeros(total, np.int64)
    return seq, np.where(inside, token - cu[seq_in], 0), np.where(inside, lengths[seq_in], 0)


def _diagonal(
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    total_q: int,
    shift: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(sequence id, key position aligned with the query) of every packed query.

    `shift[b]` is the key position aligned with query 0 of sequence b; None is
    bottom-right alignment, `len_k - len_q`.
    """
    seq_q, pos_q, len_q = _positions(cu_seqlens_q, total_q)
    if shift is None:
        len_k_of_q = np.append(np.diff(np.asarray(cu_seqlens_k, np.int64)), 0)[seq_q]
        return seq_q, pos_q + len_k_of_q - len_q
    shift_of_q = np.append(np.asarray(shift, np.int64), 0)[seq_q]
    return seq_q, pos_q + shift_of_q


def allowed_mask(
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    total_q: int,
    total_k: int,
    spec: AttentionSpec,
    shift: np.ndarray | None = None,
) -> np.ndarray:
    """bool [total_q, total_k]: which key each query may attend (bottom-right aligned, or
    with query 0 of sequence b at key position `shift[b]`)."""
    seq_q, diag = _diagonal(cu_seqlens_q, cu_seqlens_k, total_q, shift)
    seq_k, pos_k, _ = _positions(cu_seqlens_k, total_k)
    offset = pos_k[None, :] - diag[:, None]  # j - diag(i)
    # Tokens past cu_seqlens[-1] belong to no sequence: they attend and are attended by nothing.
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q < len(cu_seqlens_q) - 1)[:, None]
    if spec.window_left is not None:
        allowed &= offset >= -spec.window_left
    if spec.window_right is not None:
        allowed &= offset <= spec.window_right
    return allowed


def alibi_distance(
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    total_q: int,
    total_k: int,
    shift: np.ndarray | None = None,
) -> np.ndarray:
    """float [total_q, total_k]: |diag(i) - j| (meaningful only within a sequence)."""
    _, diag = _diagonal(cu_seqlens_q, cu_seqlens_k, total_q, shift)
    _, pos_k, _ = _positions(cu_seqlens_k, total_k)
    return np.abs(diag[:, None] - pos_k[None, :]).astype(np.float32)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    spec: AttentionSpec,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    shift: np.ndarray | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense varlen attention under `spec`.

    Args:
      q: [total_q, num_q_heads, head_dim]; k, v: [total_k, num_kv_heads, head_dim].
      cu_seqlens_q, cu_seqlens_k: concrete int [batch + 1].
      spec: the attention options.
      sinks: [num_q_heads] or None. alibi_slopes: [num_q_heads] or None.
      shift: concrete int [batch] or None: query 0 of sequence b sits at key position
        `shift[b]` (what ring attention's pieces of one document need); None is the
        bottom-right alignment `len_k - len_q`.

    Returns:
      out: [total_q, num_q_heads, head_dim] in q's dtype (computed in q's dtype's
        promotion with float32), lse: float [num_q_heads, total_q] (natural log).
    """
    total_q, num_q_heads, _ = q.shape
    total_k, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    compute = jnp.promote_types(q.dtype, jnp.float32)
    # HIGHEST: XLA:GPU would otherwise multiply float32 in TF32 (~1e-3 off on an H100), and
    # an oracle must be exact in its dtype on every platform.
    s = jnp.einsum("qhd,khd->hqk", q.astype(compute), k.astype(compute), precision=_HIGHEST)
    s = s * spec.softmax_scale
    if spec.logits_soft_cap is not None:
        s = spec.logits_soft_cap * jnp.tanh(s / spec.logits_soft_cap)
    if alibi_slopes is not None:
        distance = alibi_distance(cu_seqlens_q, cu_seqlens_k, total_q, total_k, shift)
        s = s - alibi_slopes.astype(compute)[:, None, None] * distance[None]
    allowed = allowed_mask(cu_seqlens_q, cu_seqlens_k, total_q, total_k, spec, shift)[None]
    s = jnp.where(allowed, s, -jnp.inf)
    if sinks is not None:
        sink_column = jnp.broadcast_to(
            sinks.astype(compute)[:, None, None], (num_q_heads, total_q, 1)
        )
        s = jnp.concatenate([s, sink_column], axis=-1)
    row_max = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)  # no keys: -inf
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(s - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    lse = jnp.where(
        total[..., 0] > 0,
        jnp.log(jnp.where(total[..., 0] > 0, total[..., 0], 1.0)) + row_max[..., 0],
        -jnp.inf,
    )
    if sinks is not None:
        p = p[..., :-1]
    out = jnp.einsum("hqk,khd->qhd", p, v.astype(compute), precision=_HIGHEST)
    return out.astype(q.dtype), lse.astype(jnp.float32)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    causal: bool = False,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """What `varlen_attention` computes, densely: the oracle to check a run against.

    Args:
      q: [total_q, num_q_heads, head_dim]; k, v: [total_k, num_kv_heads, head_dim].
      cu_seqlens_q, cu_seqlens_k: concrete int [batch + 1] (numpy or a concrete array).
      causal, sliding_window, logits_soft_cap, softmax_scale, sinks, alibi_slopes,
      return_lse: as in `varlen_attention`.

    Returns:
      out: [total_q, num_q_heads, head_dim] in q's dtype, computed in float32 (float64
      for float64 inputs); with `return_lse` also lse: float32 [num_q_heads, total_q].
    """
    spec = AttentionSpec.create(
        q.shape[2],
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_scale=softmax_scale,
    )
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    out, lse = dense_attention(q, k, v, cu_q, cu_k, spec, sinks, alibi_slopes)
    return (out, lse) if return_lse else out
