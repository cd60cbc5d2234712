"""The XLA implementation of gmm and tgmm, through `jax.lax.ragged_dot_general`.

`ragged_dot_general` in jax 0.10 has no `group_offset`: its groups always start at row
0. With an offset, the local groups' rows `[start, end)` are rotated to the top
(`jnp.roll` by `-start`), multiplied with the local group sizes, and rotated back. Rows
past the local groups' sum come out of `ragged_dot_general` as zeros, so after
rotating back exactly the rows of other experts are zero.

Backend contract (see `jax_bridge.grouped_matmul.api`): `gmm`, `tgmm`.

Semantics match the Triton path: float32 accumulation whenever `existing_out` is added,
rows of no local group keep `existing_out` bit for bit. Note that on CPU XLA expands
`ragged_dot` into a dense product per group (num_groups times the work).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jax_bridge.grouped_matmul.metadata import local_group_bounds

if TYPE_CHECKING:
    from jax_bridge.grouped_matmul.api import MatmulOptions


def _local_sizes(
    group_sizes: jax.Array, m: int, group_offset: jax.Array | None, num_groups: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sizes of the local groups, first local row, one past the last local row)."""
    starts, ends = local_group_bounds(
        group_sizes,
        m=m,
        group_offset=0 if group_offset is None else group_offset,
        num_groups=num_groups,
    )
    return ends - starts, starts[0], ends[-1]


def gmm_xla(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    preferred_element_type: jnp.dtype,
    transpose_rhs: bool,
    precision: jax.lax.Precision,
) -> jax.Array:
    """`out[rows of g] = lhs[rows of g] @ rhs[g]` for local groups g.

    lhs: [m, k]; rhs: [num_groups, k, n] ([num_groups, n, k] if `transpose_rhs`);
    group_sizes: int32 [num_groups_total]; existing_out: [m, n] or None -> [m, n].
    """
    m = lhs.shape[0]
    sizes, first_row, end_row = _local_sizes(group_sizes, m, group_offset, rhs.shape[0])
    if group_offset is not None:
        lhs = jnp.roll(lhs, -first_row, axis=0)
    dimension_numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    accumulate = existing_out is not None
    out = jax.lax.ragged_dot_general(
        lhs,
        rhs,
        sizes,
        dimension_numbers,
        precision=precision,
        preferred_element_type=jnp.float32 if accumulate else preferred_element_type,
    )
    if group_offset is not None:
        out = jnp.roll(out, first_row, axis=0)
    if not accumulate:
        return out
    rows = jnp.arange(m)[:, None]
    local = (rows >= first_row) & (rows < end_row)
    summed = (existing_out.astype(jnp.float32) + out).astype(preferred_element_type)
    return jnp.where(local, summed, existing_out)


def tgmm_xla(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    preferred_element_type: jnp.dtype,
    lhs_token_major: bool,
    precision: jax.lax.Precision,
) -> jax.Array:
    """`out[g] = lhs[:, rows of g] @ rhs[rows of g]` for local groups g.

    lhs: [k, m] ([m, k] if `lhs_token_major`); rhs: [m, n]; group_sizes: int32
    [num_groups_total]; existing_out: [num_groups, k, n] or None -> [num_groups, k, n].
    """
    token_axis = 0 if lhs_token_major else 1
    m = lhs.shape[token_axis]
    sizes, first_row, _ = _local_sizes(group_sizes, m, group_offset, num_groups)
    if group_offset is not None:
        lhs = jnp.roll(lhs, -first_row, axis=token_axis)
        rhs = jnp.roll(rhs, -first_row, axis=0)
    dimension_numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([token_axis], [0]), ([], [])),
        lhs_ragged_dimensions=[token_axis],
        rhs_group_dimensions=[],
    )
    accumulate = existing_out is not None
    out = jax.lax.ragged_dot_general(
        lhs,
        rhs,
        sizes,
        dimension_numbers,
        precision=precision,
        preferred_element_type=jnp.float32 if accumulate else preferred_element_type,
    )
    if not accumulate:
        return out
    return (existing_out.astype(jnp.float32) + out).astype(preferred_element_type)


def gmm(lhs, rhs, group_sizes, group_offset, existing_out, options: MatmulOptions) -> jax.Array:
    """The backend contract's gmm: `gmm_xla` under `options`."""
    return gmm_xla(
        lhs,
        rhs,
        group_sizes,
        group_offset=group_offset,
        existing_out=existing_out,
        preferred_element_type=options.preferred_element_type,
        transpose_rhs=options.transpose_rhs,
        precision=options.precision,
    )


def tgmm(
    lhs, rhs, group_sizes, group_offset, existing_out, num_groups: int, options: MatmulOptions
) -> jax.Array:
    """The backend contract's tgmm: `tgmm_xla` under `options`."""
    return tgmm_xla(
        lhs,
        rhs,
        group_sizes,
        num_groups=num_groups,
        group_offset=group_offset,
        existing_out=existing_out,
        preferred_element_type=options.preferred_element_type,
        lhs_token_major=options.lhs_token_major,
        precision=options.precision,
    )
