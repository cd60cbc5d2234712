"""Pieces every block-sparse backend shares: delta, the sinks' gradient and the limits of
non-finite sinks. Layout: lse, delta float32 [batch, num_q_heads, q_len]."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_delta(out: jax.Array, d_out: jax.Array, d_lse: jax.Array | None) -> jax.Array:
    """float32 [B, Hq, Lq]: delta_i = rowsum(dO_i * O_i) - d_lse_i.

    dS_ij = P_ij (dP_ij - delta_i); d lse_i / d s_ij = P_ij, so an lse cotangent enters
    exactly as this shift of delta. out, d_out: [B, Lq, Hq, D].
    """
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = delta.transpose(0, 2, 1)
    return delta if d_lse is None else delta - d_lse.astype(jnp.float32)


def sink_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """float32 [Hq]: d sinks[h] = -sum_{b,i} P_sink(b, h, i) delta[b, h, i], with
    P_sink = exp(sink - lse). lse >= sink, so P_sink <= 1; rows with lse = -inf (no key,
    a -inf sink) weigh 0 instead of exp(-inf + inf) = NaN."""
    sink = sinks.astype(jnp.float32)[None, :, None]
    finite = jnp.isfinite(lse)
    p_sink = jnp.where(finite, jnp.exp(sink - jnp.where(finite, lse, 0.0)), 0.0)
    return -jnp.sum(p_sink * delta, axis=(0, 2))


def apply_sink_limits(out: jax.Array, lse: jax.Array, sinks: jax.Array):
    """The limits of non-finite sinks, the same on every backend: a NaN sink makes its
    head's rows NaN; a +inf sink takes all the probability (out 0, lse +inf); -inf is no
    sink. out: [B, Lq, Hq, D]; lse: [B, Hq, Lq]; sinks: [Hq]."""
    sink = sinks.astype(jnp.float32)
    is_nan, is_inf = jnp.isnan(sink), sink == jnp.inf
    head = lambda x: x[None, None, :, None]
    out = jnp.where(head(is_nan), jnp.nan, jnp.where(head(is_inf), 0, out)).astype(out.dtype)
    row = lambda x: x[None, :, None]
    return out, jnp.where(row(is_nan | is_inf), row(sink), lse)
