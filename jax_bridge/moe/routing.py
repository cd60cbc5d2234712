"""Token routing for mixture-of-experts: sort token copies by expert and undo the sort.

`route` turns tokens and their chosen experts into the layout `grouped_matmul` wants
(rows sorted by expert, one count per expert); `unroute` brings the rows back to token
order and combines each token's `top_k` copies. Both are gathers with fixed output
shapes, so they jit, vmap and differentiate with plain JAX autodiff (the gradient of a
gather is a scatter-add).

Layout (T tokens, K = top_k choices per token, E experts):

* copy `c = t * K + j` is choice `j` of token `t` (the row-major flattening of
  `expert_ids [T, K]`);
* `permutation [T*K]`: sorted row `r` holds copy `permutation[r]`, i.e. token
  `permutation[r] // K`. The sort is stable, so the copies of one expert keep token order;
* `inverse [T, K]`: the sorted row of copy `(t, j)`; `inverse.ravel()` is the inverse
  permutation of `permutation`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.validation import (
    check_array,
    check_static_int,
    is_traced,
    naming_op,
    require_all,
)


class Routing(NamedTuple):
    """Tokens sorted by expert, and what `unroute` needs to undo the sort (a pytree).

    Attributes:
      sorted_x: [T*K, hidden], `x[permutation // K]`: the token copies, sorted by expert.
      group_sizes: int32 [E], rows per expert (`bincount` of the valid expert ids);
        expert `e` owns rows `[sum(group_sizes[:e]), sum(group_sizes[:e + 1]))`.
      sorted_expert_ids: int32 [T*K], non-decreasing: the expert of each sorted row (E
        for a copy whose id was out of range under a trace: it sorts last, in no group).
      permutation: int32 [T*K], the copy `t * K + j` that each sorted row holds.
      inverse: int32 [T, K], the sorted row of each copy (undoes `permutation`).
    """

    sorted_x: jax.Array
    group_sizes: jax.Array
    sorted_expert_ids: jax.Array
    permutation: jax.Array
    inverse: jax.Array

    @property
    def top_k(self) -> int:
        """K, the copies per token."""
        return self.inverse.shape[1]

    @property
    def num_experts(self) -> int:
        """E, the length of `group_sizes`."""
        return self.group_sizes.shape[0]


def _rows_array(x: Any, name: str, shape_doc: str) -> jax.Array:
    """`x` as a JAX array of rank 2 (`shape_doc`): a NumPy array becomes one, so that it
    can be gathered by the traced indices of a jit or vmap; a list or a scalar is refused
    (TypeError), as every op refuses them."""
    check_array(name, x, shape_doc)
    return jnp.asarray(x)


def _check_expert_ids(expert_ids: Any, tokens: int, num_experts: int) -> jax.Array:
    """expert_ids as int32 [T, K]; values in [0, E) (now when concrete, else checkify)."""
    ids = expert_ids if is_traced(expert_ids) else np.asarray(expert_ids)
    if ids.dtype == np.bool_ or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"expert_ids must have an integer dtype, got {ids.dtype}.")
    if ids.ndim not in (1, 2) or ids.shape[0] != tokens or (ids.ndim == 2 and ids.shape[1] < 1):
        raise ValueError(
            f"expert_ids must have shape [tokens] or [tokens, top_k] with tokens={tokens} "
            f"(the rows of x) and top_k >= 1, got shape {tuple(ids.shape)}."
        )
    if not is_traced(ids) and ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(
            f"expert_ids must lie in [0, {num_experts}) (num_experts={num_experts}), got "
            f"values in [{ids.min()}, {ids.max()}]."
        )
    require_all((ids >= 0) & (ids < num_experts), "expert_ids must lie in [0, num_experts).")
    ids = jnp.asarray(ids).astype(jnp.int32)
    return ids if ids.ndim == 2 else ids[:, None]


def route(x: jax.Array, expert_ids: jax.Array, num_experts: int) -> Routing:
    """Sorts the tokens' copies by expert: the input of `grouped_matmul`.

    Args:
      x: [T, hidden], any dtype (the rows are gathered, never combined).
      expert_ids: integer [T] (one expert per token) or [T, top_k] (token `t` is copied
        once per choice). Values must lie in `[0, num_experts)`: checked now when
        concrete (ValueError); under a trace a `checkify` check, and an out-of-range copy
        sorts after every group and belongs to none.
      num_experts: E, a static positive int.

    Returns:
      `Routing`: `sorted_x` [T*K, hidden] (K = 1 for [T] ids), `group_sizes` int32 [E],
      `sorted_expert_ids` int32 [T*K], `permutation` int32 [T*K], `inverse` int32 [T, K].
      Equal expert ids keep their copies' order `t * K + j` (stable sort).

    Raises:
      TypeError / ValueError starting "route:" and naming the argument, at trace time
      for shapes and dtypes.
    """
    with naming_op("route"):
        x = _rows_array(x, "x", "[tokens, hidden]")
        num_experts = check_static_int(num_experts, "num_experts", minimum=1)
        ids = _check_expert_ids(expert_ids, x.shape[0], num_experts)
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    # Out-of-range ids (possible only when traced) become E: sorted last, in no group.
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    permutation = jnp.argsort(flat, stable=True).astype(jnp.int32)
    copies = tokens * top_k
    # inverse[permutation[r]] = r: a scatter of distinct indices, O(T*K) after the sort.
    inverse = (
        jnp.zeros((copies,), jnp.int32)
        .at[permutation]
        .set(jnp.arange(copies, dtype=jnp.int32), unique_indices=True)
    )
    return Routing(
        sorted_x=x[permutation // top_k],
        group_sizes=jnp.bincount(flat, length=num_experts).astype(jnp.int32),  # drops E
        sorted_expert_ids=flat[permutation],
        permutation=permutation,
        inverse=inverse.reshape(tokens, top_k),
    )


def unroute(y_sorted: jax.Array, routing: Routing, weights: jax.Array | None = None) -> jax.Array:
    """Brings sorted rows back to token order and sums each token's copies.

    `out[t] = sum_j weights[t, j] * y_sorted[routing.inverse[t, j]]`. With top_k = 1 and
    no weights this is exactly the inverse of `route` (`unroute(route(x, ...).sorted_x,
    ...) == x`). Rows that `grouped_matmul` leaves out (past `sum(group_sizes)`, or of
    experts outside its `group_offset` range) are zero, so they add nothing.

    Args:
      y_sorted: [T*K, d], rows in the sorted order of `routing` (d may differ from hidden).
      routing: the `Routing` that `route` returned for these tokens.
      weights: None (every copy weighs 1) or floating [T, K], e.g. the router's
        probabilities of the chosen experts.

    Returns:
      [T, d], dtype of `y_sorted` promoted with `weights`'.

    Raises:
      TypeError / ValueError starting "unroute:" and naming the argument.
    """
    with naming_op("unroute"):
        if not isinstance(routing, Routing):
            raise TypeError(f"routing must be the Routing of route(), got {type(routing)}.")
        tokens, top_k = routing.inverse.shape
        y_sorted = _rows_array(y_sorted, "y_sorted", "[tokens * top_k, d]")
        if y_sorted.shape[0] != tokens * top_k:
            raise ValueError(
                f"y_sorted has {y_sorted.shape[0]} rows, but routing sorted {tokens * top_k} "
                f"(tokens={tokens} x top_k={top_k})."
            )
        if weights is not None:
            if not hasattr(weights, "shape") or not hasattr(weights, "dtype"):
                raise TypeError(
                    f"weights must be None or an array [tokens, top_k], got {type(weights)}."
                )
            if not jnp.issubdtype(weights.dtype, jnp.floating):
                raise TypeError(f"weights must have a floating dtype, got {weights.dtype}.")
            if tuple(weights.shape) != (tokens, top_k):
                raise ValueError(
                    f"weights must have shape [tokens, top_k] = {(tokens, top_k)}, got "
                    f"shape {tuple(weights.shape)}."
                )
    copies = y_sorted[routing.inverse]  # [T, K, d]
    if weights is None:
        return jnp.sum(copies, axis=1) if top_k > 1 else copies[:, 0]
    # Elementwise products and a K-term sum: exact float32 products, no matmul precision.
    return jnp.sum(copies * weights[..., None], axis=1)
