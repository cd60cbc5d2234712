"""Dense reference of the splash kernels' semantics: float32 for float32 and 16-bit inputs,
float64 for float64 ones (the tests' oracle runs it so under `jax.enable_x64`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: np.ndarray | jax.Array,
    *,
    segment_ids=None,
    sinks: jax.Array | None = None,
    softmax_scale: float = 1.0,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dense attention in float32 (float64 for float64 inputs), differentiable with jax.grad.

    Args:
      q: [num_q_heads, q_len, head_dim]; k: [num_kv_heads, kv_len, head_dim] or
        [kv_len, head_dim] (MQA); v likewise with head_dim_v.
      mask: bool [num_q_heads or 1, q_len, kv_len].
      segment_ids: (q [q_len], kv [kv_len]) or None.
      sinks: float [num_q_heads] or None.

    Returns:
      out: [num_q_heads, q_len, head_dim_v] (0 on fully masked rows);
      lse: [num_q_heads, q_len] (-inf on fully masked rows, sink if only it);
      both float32, or float64 for float64 q.
    """
    wide = jnp.promote_types(q.dtype, jnp.float32)  # float32, or float64 for the oracle
    q, k, v = (x.astype(wide) for x in (q, k, v))
    if k.ndim == 2:
        k, v = k[None], v[None]
    group = q.shape[0] // k.shape[0]
    k, v = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
    s = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest") * softmax_scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    allowed = jnp.asarray(mask, bool)
    if segment_ids is not None:
        allowed = allowed & (segment_ids[0][:, None] == segment_ids[1][None, :])[None]
    allowed = jnp.broadcast_to(allowed, s.shape)
    s = jnp.where(allowed, s, -jnp.inf)
    if sinks is not None:
        sink_col = jnp.broadcast_to(sinks.astype(wide)[:, None, None], (*s.shape[:2], 1))
        s = jnp.concatenate([s, sink_col], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), jax.lax.stop_gradient(m), 0.0)
    e = jnp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    safe_l = jnp.where(l == 0, 1.0, l)
    p = e / safe_l
    if sinks is not None:
        p = p[..., :-1]
    out = jnp.einsum("hqk,hkd->hqd", p, v, precision="highest")
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(safe_l))[..., 0]
    return out, lse
