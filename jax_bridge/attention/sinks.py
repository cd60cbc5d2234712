"""The gradient of attention sinks, shared by every implementation's backward pass."""

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
