"""Launches the Triton grouped matmul kernels from JAX (forward only; the custom_vjp
wiring lives in `grouped_matmul.py`).

Arguments arrive validated. Group metadata is computed here in jnp and travels to the
kernel as int32 arrays, so group sizes and the group offset may be traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge import triton_launch
from jax_bridge.group_metadata import local_group_bounds, make_group_metadata
from triton_kernels.grouped_matmul import gmm_grid, gmm_kernel, tgmm_grid, tgmm_kernel
from triton_kernels.grouped_matmul_config import gmm_config, tgmm_config

Tiling = tuple[int, int, int] | None

# jax.lax.Precision -> tl.dot's input_precision for float32 operands (ignored by Triton
# for 16-bit operands, which always multiply exactly and accumulate in float32).
_INPUT_PRECISION = {
    jax.lax.Precision.DEFAULT: "tf32",
    jax.lax.Precision.HIGH: "tf32x3",
    jax.lax.Precision.HIGHEST: "ieee",
}


def _launch_target() -> tuple[bool, int | None]:
    """(runs on a GPU, its compute capability if known); (False, None) means the
    kernels run through Triton's interpreter."""
    on_gpu, target = triton_launch.gpu_launch_target()
    if on_gpu and target is None:
        capability = getattr(jax.devices()[0], "compute_capability", None)
        target = round(float(capability) * 10) if capability else None
    return on_gpu, target


def _operands(
    *arrays: jax.Array, precision: jax.lax.Precision, on_interpreter: bool
) -> tuple[list[jax.Array], str]:
    """The operands as the kernel should see them, and tl.dot's input precision."""
    input_precision = _INPUT_PRECISION[precision]
    if on_interpreter and arrays[0].dtype == jnp.bfloat16:
        # Triton's interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies
        # those bits. Widening to float32 is exact, and a float32 product of two bf16
        # values is exact too, so this reproduces the GPU's bf16 tensor-core math.
        return [a.astype(jnp.float32) for a in arrays], "ieee"
    return list(arrays), input_precision


def _init_only(existing_out: jax.Array | None, out_shape: jax.ShapeDtypeStruct) -> jax.Array:
    if existing_out is not None:
        return existing_out
    return jnp.zeros(out_shape.shape, out_shape.dtype)


def _placeholder(dtype: jnp.dtype) -> jax.Array:
    # Stands in for `init_ptr` when the kernel does not accumulate (it is never read).
    return jnp.zeros((1,), dtype)


def gmm_triton(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    preferred_element_type: jnp.dtype,
    transpose_rhs: bool,
    tiling: Tiling,
    precision: jax.lax.Precision,
) -> jax.Array:
    """`out[rows of g] = lhs[rows of g] @ rhs[g]` for local groups g, via `gmm_kernel`.

    lhs: [m, k]; rhs: [num_groups, k, n] ([num_groups, n, k] if `transpose_rhs`);
    group_sizes: int32 [num_groups_total]; existing_out: [m, n] or None.
    Returns [m, n] of `preferred_element_type`; rows of no local group are
    `existing_out`'s (or zero).
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_shape = jax.ShapeDtypeStruct((m, n), preferred_element_type)
    if m == 0 or n == 0 or k == 0:  # nothing to multiply: every row keeps its init
        return _init_only(existing_out, out_shape)

    on_gpu, capability = _launch_target()
    config = gmm_config(
        m,
        k,
        n,
        element_bytes=np.dtype(lhs.dtype).itemsize,
        compute_capability=capability,
        tiling=tiling,
    )
    meta = make_group_metadata(
        group_sizes,
        m=m,
        block_m=config.block_m,
        group_offset=0 if group_offset is None else group_offset,
        num_groups=num_groups,
    )
    (lhs, rhs), input_precision = _operands(
        lhs, rhs, precision=precision, on_interpreter=not on_gpu
    )
    accumulate = existing_out is not None
    # Rows that no tile writes (other experts, rows past sum(group_sizes), masked rows of
    # straddling tiles) must still hold init: alias existing_out, or zero the output.
    init = existing_out if accumulate else _placeholder(out_shape.dtype)
    return triton_launch.triton_call(
        lhs,
        rhs,
        init,
        meta.group_starts,
        meta.group_ends,
        meta.tile_group,
        meta.tile_row_block,
        meta.num_tiles,
        kernel=gmm_kernel,
        out_shape=out_shape,
        grid=gmm_grid(meta.tile_group.shape[0], n, config.block_n),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        input_output_aliases={2: 0} if accumulate else None,
        zeroed_outputs=() if accumulate else (0,),
        name="grouped_matmul",
        M=m,
        K=k,
        N=n,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        BLOCK_N=config.block_n,
        TRANSPOSE_RHS=transpose_rhs,
        ACCUMULATE=accumulate,
        INPUT_PRECISION=input_precision,
    )


def tgmm_triton(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    preferred_element_type: jnp.dtype,
    lhs_token_major: bool,
    tiling: Tiling,
    precision: jax.lax.Precision,
) -> jax.Array:
    """`out[g] = lhs[:, rows of g] @ rhs[rows of g]` for local groups g, via `tgmm_kernel`.

    lhs: [k, m] ([m, k] if `lhs_token_major`); rhs: [m, n]; group_sizes: int32
    [num_groups_total]; existing_out: [num_groups, k, n] or None.
    Returns [num_groups, k, n] of `preferred_element_type`; empty groups give zeros
    (or `existing_out`).
    """
    m, k = lhs.shape if lhs_token_major else lhs.shape[::-1]
    n = rhs.shape[1]
    out_shape = jax.ShapeDtypeStruct((num_groups, k, n), preferred_element_type)
    if m == 0 or n == 0 or k == 0:  # every group is empty, or its product is
        return _init_only(existing_out, out_shape)

    on_gpu, capability = _launch_target()
    config = tgmm_config(
        m,
        k,
        n,
        element_bytes=np.dtype(lhs.dtype).itemsize,
        compute_capability=capability,
        tiling=tiling,
    )
    starts, ends = local_group_bounds(
        group_sizes,
        m=m,
        group_offset=0 if group_offset is None else group_offset,
        num_groups=num_groups,
    )
    (lhs, rhs), input_precision = _operands(
        lhs, rhs, precision=precision, on_interpreter=not on_gpu
    )
    accumulate = existing_out is not None
    # Every program writes its whole tile (zeros for an empty group): no zero fill needed.
    init = existing_out if accumulate else _placeholder(out_shape.dtype)
    return triton_launch.triton_call(
        lhs,
        rhs,
        init,
        starts,
        ends,
        kernel=tgmm_kernel,
        out_shape=out_shape,
        grid=tgmm_grid(num_groups, k, n, config.block_k, config.block_n),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        input_output_aliases={2: 0} if accumulate else None,
        name="transposed_grouped_matmul",
        M=m,
        K=k,
        N=n,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        BLOCK_N=config.block_n,
        LHS_TOKEN_MAJOR=lhs_token_major,
        ACCUMULATE=accumulate,
        INPUT_PRECISION=input_precision,
    )
