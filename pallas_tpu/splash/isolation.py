"""Products that keep documents independent inside a partial block.

A partial block may hold rows of two documents. A masked pair has weight exactly 0, but
0 * NaN = NaN: a NaN or Inf value of one document would reach every row of another
through a matmul. `isolated_dot` multiplies the finite part of the values, and takes the
plain product only for rows that give a non-zero weight to a non-finite value (rows of
that document, which the non-finite value must reach). Full blocks hold one document
pair with every weight allowed, so they use the plain product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def isolated_dot(weights: jax.Array, values: jax.Array, dims) -> jax.Array:
    """float32 weights . values (dot_general `dims`), where a zero weight never meets a
    non-finite value.

    Args:
      weights: [rows, n] (or laid out as `dims` contracts), exact zeros where masked.
      values: [n, features] (or laid out as `dims` contracts).
      dims: dot_general dimension numbers contracting the n axes.

    Returns:
      float32 [rows, features].
    """
    (_, values_axes), _ = dims
    finite = jnp.isfinite(values.astype(jnp.float32))
    clean = jax.lax.dot_general(
        weights,
        jnp.where(finite, values, 0).astype(values.dtype),
        dims,
        preferred_element_type=jnp.float32,
    )
    # Which of the n contracted entries carries a non-finite feature, as a [n, 1] column
    # in `values`' layout, and whether each row weighs one of them.
    free_axis = 1 - values_axes[0]
    bad = jnp.any(~finite, axis=free_axis, keepdims=True).astype(jnp.float32)
    used = (weights != 0).astype(jnp.float32)
    touches = jax.lax.dot_general(used, bad, dims, preferred_element_type=jnp.float32) > 0
    raw = jax.lax.dot_general(weights, values, dims, preferred_element_type=jnp.float32)
    return jnp.where(touches, raw, clean)
