"""Dense oracles for grouped matmul: what `grouped_matmul` and `transposed_grouped_matmul`
compute, written for clarity rather than speed.

Every row is multiplied by its own group's weights, gathered per row (memory
O(m * k * n)); the transposed product takes one group at a time, its rows selected from
both operands. A row of no local group (or of another group) is selected away, never
multiplied by zero: NaN or Inf in one group's rows or weights stays in that group,
forward and backward.
Products run at `Precision.HIGHEST` in float32 (float64 for float64 inputs under
`jax.enable_x64(True)`). Differentiable with `jax.grad` in lhs, rhs and
existing_out; group sizes and the offset may be traced.

Values are not checked (the ops refuse bad concrete ones; traced ones they cannot), and
garbage gets the backends' rules: a negative size counts as 0; groups are cut at the m
rows that exist, exactly (sizes near 2**31 do not wrap around int32); an offset outside
`[0, len(group_sizes) - num_groups]` is taken as `jax.lax.dynamic_slice` takes a start:
a negative one counts from the end, then it is clamped into that range.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["grouped_matmul_reference", "transposed_grouped_matmul_reference"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _local_group_of_rows(
    group_sizes: jax.Array, m: int, group_offset: Any, num_groups: int
) -> tuple[jax.Array, jax.Array]:
    """(local group index [m] clipped into range, whether the row is in a local group [m]).
    Unchecked sizes and offsets as on every backend (module docstring)."""
    sizes = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)

    def cut_at_m(end, size):  # the next group's end: end + size, at most m, never wrapped
        end = end + jnp.minimum(size, m - end)
        return end, end

    _, ends = jax.lax.scan(cut_at_m, jnp.int32(0), sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    # A row's group is the number of groups that end at or before it.
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    offset = 0
    if group_offset is not None:
        total = sizes.shape[0]
        offset = jnp.asarray(group_offset, jnp.int32).reshape(())
        offset = jnp.clip(jnp.where(offset < 0, offset + total, offset), 0, total - num_groups)
    local = group - offset
    in_local = (local >= 0) & (local < num_groups) & (rows < ends[-1])
    return jnp.clip(local, 0, num_groups - 1), in_local


def _compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


# Jitted (shape arguments static) so that an eager call compiles one program per shape, not
# one per jnp operation; under an outer jit or grad they are inlined.
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "preferred_element_type"))
def grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: Any = None,
    existing_out: jax.Array | None = None,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
) -> jax.Array:
    """`out[rows of group g] = lhs[rows of g] @ rhs[g - group_offset]` (+ existing_out).

    Args:
      lhs: [m, k]; rhs: [num_groups, k, n] ([num_groups, n, k] with `transpose_rhs`).
      group_sizes: int [num_groups_total]; group_offset: int or scalar, or None (0);
        values outside the op's contract as in the module docstring.
      existing_out: [m, n] or None: added to the local groups' rows and kept elsewhere.
      preferred_element_type: the result's dtype; None: float32 (float64 for float64).

    Returns:
      [m, n]: rows of no local group are existing_out's, or zero.
    """
    compute = _compute_dtype(lhs, rhs)
    m = lhs.shape[0]
    weights = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    group, in_local = _local_group_of_rows(group_sizes, m, group_offset, rhs.shape[0])
    rows = jnp.where(in_local[:, None], lhs.astype(compute), 0)
    per_row = jnp.einsum("mk,mkn->mn", rows, weights.astype(compute)[group], precision=_HIGHEST)
    out = jnp.where(in_local[:, None], per_row, 0)
    if existing_out is not None:
        out = jnp.where(in_local[:, None], out + existing_out.astype(compute), existing_out)
    return out.astype(preferred_element_type or compute)


@functools.partial(jax.jit, static_argnames=("num_groups", "preferred_element_type"))
def transposed_grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int | None = None,
    group_offset: Any = None,
    existing_out: jax.Array | None = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """`out[g] = lhs[:, rows of group g + group_offset] @ rhs[those rows]` (+ existing_out).

    Args:
      lhs: [k, m]; rhs: [m, n]; group_sizes: int [num_groups_total].
      num_groups: groups in the result (default: len(group_sizes)).
      group_offset, existing_out ([num_groups, k, n]), preferred_element_type: as in
        `grouped_matmul_reference`.

    Returns:
      [num_groups, k, n]; an empty group gives zeros (or its existing_out).
    """
    compute = _compute_dtype(lhs, rhs)
    num_groups = len(group_sizes) if num_groups is None else num_groups
    m = rhs.shape[0]
    group, in_local = _local_group_of_rows(group_sizes, m, group_offset, num_groups)
    lhs, rhs = lhs.astype(compute), rhs.astype(compute)

    # Rematerialized: lax.map's gradient would otherwise keep every group's selected
    # operands, num_groups times the memory of one.
    @jax.checkpoint
    def one_group(g):
        # Both operands keep group g's rows and select the others away: a one-hot factor
        # between them would multiply another group's NaN or Inf by 0, which is NaN. A
        # group at a time: memory O(m * (k + n)), forward and backward.
        mine = (group == g) & in_local
        rows_of_lhs = jnp.where(mine[None, :], lhs, 0)
        rows_of_rhs = jnp.where(mine[:, None], rhs, 0)
        return jnp.matmul(rows_of_lhs, rows_of_rhs, precision=_HIGHEST)

    out = jax.lax.map(one_group, jnp.arange(num_groups))
    if existing_out is not None:
        out = out + existing_out.astype(compute)
    return out.astype(preferred_element_type or compute)
