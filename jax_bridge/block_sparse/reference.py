"""The dense block-sparse attention oracle: the whole boolean mask, a masked softmax.

Written for clarity, not speed: memory is O(batch * heads * q_len * kv_len). Every
convention of `block_sparse_attention` appears once, on whole matrices: scores scaled,
then soft-capped, shifted by ALiBi, through the score hook, then masked; sinks join the
denominator; a row that sees nothing returns 0 with lse -inf (the sink's logit with
sinks).
Differentiable with `jax.grad` in q, k, v and sinks. Computes in float32, or in float64
for float64 inputs (under `jax.enable_x64`).
An oracle for finite inputs: unlike the backends it does not keep a masked NaN value
from meeting a zero weight (0 * NaN) in the value product.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.block_sparse.score_mod import ScoreMod
from pallas_tpu.splash.masks import DocumentMask, Mask, MultiHeadMask

__all__ = ["block_sparse_attention_reference", "dense_mask"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _dense_2d(mask: Mask) -> jax.Array | np.ndarray:
    """bool [q_len, kv_len]; a traced DocumentMask is evaluated in jnp from its tokens."""
    if isinstance(mask, DocumentMask) and mask.traced:
        q_rel, kv_rel, q_doc, kv_doc = mask.element_arrays()
        allowed = q_doc[:, None] == kv_doc[None, :]
        if mask.rule is not None:
            allowed = allowed & mask.rule(q_rel[:, None], kv_rel[None, :])
        return allowed
    q_len, kv_len = mask.shape
    return np.asarray(mask[0:q_len, 0:kv_len], np.bool_).reshape(q_len, kv_len)


def dense_mask(mask: Mask, num_q_heads: int) -> jax.Array | np.ndarray:
    """bool [num_q_heads, q_len, kv_len]: `mask` for every query head."""
    if isinstance(mask, MultiHeadMask):
        xp = jnp if any(isinstance(m, DocumentMask) and m.traced for m in mask.masks) else np
        return xp.stack([_dense_2d(m) for m in mask.masks])
    dense = _dense_2d(mask)
    xp = np if isinstance(dense, np.ndarray) else jnp
    return xp.broadcast_to(dense[None], (num_q_heads, *dense.shape))


def block_sparse_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
    **unused: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """What `block_sparse_attention` computes, densely.

    Args:
      q: [batch, q_len, num_q_heads, head_dim]; k, v: [batch, kv_len, num_kv_heads,
        head_dim] (GQA: query head h reads kv head h // (num_q_heads // num_kv_heads)).
      mask: a 2-D splash `Mask` (q_len, kv_len) for every head or a `MultiHeadMask` with
        one mask per query head; a DocumentMask of traced arrays is evaluated in jnp.
      softmax_scale: default 1 / sqrt(head_dim). logits_soft_cap: c * tanh(s / c), None
        or 0 is off. sinks: [num_q_heads] logits in every row's denominator.
      alibi_slopes: [num_q_heads]: -slope[h] * |q_index - kv_index| joins the scores.
      score_mod: a `ScoreMod` applied to the (soft-capped, ALiBi-shifted) scores before
        the mask.
      return_lse: also return lse, float32 [batch, num_q_heads, q_len].
      unused: `block_sizes`, `precision`, `implementation` of the op, accepted and ignored.

    Returns:
      out [batch, q_len, num_q_heads, head_dim] in q's dtype (and lse).
    """
    del unused
    compute = jnp.promote_types(q.dtype, jnp.float32)  # float64 inputs: float64
    num_q_heads, head_dim = q.shape[2], q.shape[3]
    group = num_q_heads // k.shape[2]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    k = jnp.repeat(k.astype(compute), group, axis=2)
    v = jnp.repeat(v.astype(compute), group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(compute), k, precision=_HIGHEST) * scale
    if logits_soft_cap:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    b, h, i, j = (jnp.arange(n, dtype=jnp.int32) for n in s.shape)
    if alibi_slopes is not None:
        distance = jnp.abs(i[:, None] - j[None, :]).astype(compute)
        s = s - alibi_slopes.astype(compute)[:, None, None] * distance
    if score_mod is not None:
        s = score_mod.apply(s, b[:, None, None, None], h[:, None, None], i[:, None], j)
    allowed = dense_mask(mask, num_q_heads)[None]
    s = jnp.where(allowed, s, -jnp.inf)  # a select: NaN of masked pairs never counts
    if sinks is not None:
        column = jnp.broadcast_to(sinks.astype(compute)[None, :, None, None], (*s.shape[:3], 1))
        s = jnp.concatenate([s, column], axis=-1)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(s - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    p = e / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, jnp.log(jnp.where(seen, total, 1.0)) + row_max, -jnp.inf)[..., 0]
    if sinks is not None:
        p = p[..., :-1]
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=_HIGHEST)
    out = out.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    return (out, lse) if return_lse else out
