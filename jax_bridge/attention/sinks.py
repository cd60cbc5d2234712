"""Sink pieces every attention backend shares: the non-finite limits, delta and the
sinks' gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sink_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """d sinks[h] = -sum_i P_sink(h, i) * delta[h, i], with P_sink = exp(sinks[h] - lse[h, i]).

    A sink carries no value: raising it scales every output row by (1 - P_sink) and moves
    lse_i by P_sink. lse >= sink, so P_sink <= 1; lse_i = -inf only when the row has no
    key and the sink is -inf, where P_sink is 0 (not exp(-inf + inf) = NaN).

    Args:
      sinks: [num_q_heads]; lse: float32 [num_q_heads, total_q] (the forward's, sink
        included); delta: float32 [num_q_heads, total_q], rowsum(dO * O) minus any lse
        cotangent.

    Returns:
      float32 [num_q_heads].
    """
    sink = sinks.astype(jnp.float32)[:, None]
    finite = jnp.isfinite(lse)
    p_sink = jnp.where(finite, jnp.exp(sink - jnp.where(finite, lse, 0.0)), 0.0)
    return -jnp.sum(p_sink * delta, axis=1)


def row_delta(out: jax.Array, d_out: jax.Array, d_lse: jax.Array | None) -> jax.Array:
    """float32 [Hq, total_q]: delta_i = rowsum(dO_i * O_i) - d_lse_i.

    dS_ij = P_ij * (dP_ij - delta_i); since d lse_i / d s_ij = P_ij, an lse cotangent
    enters exactly as this shift of delta. out, d_out: [total_q, Hq, D].
    """
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).T
    return delta if d_lse is None else delta - d_lse.astype(jnp.float32)


def apply_sink_limits(out: jax.Array, lse: jax.Array, sinks: jax.Array):
    """The documented limits of non-finite sinks, the same on every backend: a NaN sink
    makes its head's rows NaN; a +inf sink takes all the probability (output 0, lse +inf).
    Finite sinks (and -inf: a sink that is never there) pass through unchanged.

    out: [total_q, Hq, D]; lse: float32 [Hq, total_q]; sinks: [Hq].
    """
    sink = sinks.astype(jnp.float32)[:, None]  # [Hq, 1]: broadcasts over [Tq, Hq, D]
    is_nan, is_inf = jnp.isnan(sink), sink == jnp.inf
    out = jnp.where(is_nan, jnp.nan, jnp.where(is_inf, 0, out)).astype(out.dtype)
    return out, jnp.where(is_nan | is_inf, sink, lse)
