"""The Triton backend of grouped matmul: `gmm_kernel` and `tgmm_kernel` launched through
`triton_call` (on a GPU, or on a CPU through Triton's interpreter).

Backend contract (see `jax_bridge.grouped_matmul.api`): `gmm`, `tgmm`. Arguments arrive
validated. Group metadata (`make_group_metadata`'s list) comes from one small kernel
(`gmm_schedule_kernel`; from XLA for very many groups, `group_metadata`) and travels to
the gmm kernel as int32 arrays, so group sizes and the group offset may be traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jax_bridge.core.numerics import cdiv
from jax_bridge.core.precision import triton_input_precision
from jax_bridge.grouped_matmul import checks
from jax_bridge.grouped_matmul.metadata import (
    GroupMetadata,
    make_group_metadata,
    num_chunk_slots,
)
from jax_bridge.grouped_matmul.options import MatmulOptions
from jax_bridge.launch.host_descriptors import HostDescriptor
from jax_bridge.launch.report import ctas_per_sm, max_shared_memory_per_cta
from jax_bridge.launch.target import (
    follow_lowering_platform,
    launch_target,
    multiprocessor_count,
    require_tensor_descriptors,
)
from jax_bridge.launch.triton_call import triton_call
from triton_kernels.grouped_matmul.config import (
    GroupedMatmulConfig,
    GroupedMatmulConfigs,
    gmm_config,
    tgmm_config,
    tgmm_warp_specializes,
)
from triton_kernels.grouped_matmul.kernels import (
    gmm_grid,
    gmm_kernel,
    tgmm_grid,
    tgmm_kernel,
    tgmm_walk_grid,
    tgmm_walk_kernel,
    tgmm_walk_splits,
)
from triton_kernels.grouped_matmul.schedule import gmm_schedule_kernel


def _config(
    options: MatmulOptions, m: int, k: int, n: int, dtype, make, *, transposed: bool
) -> GroupedMatmulConfig:
    """The caller's config for this kernel (`_within_shared_memory`), else `make`
    (gmm_config, or tgmm_config when `transposed`) from the tiling (a callable one is
    asked once)."""
    given = _given_config(options, transposed)
    if given is not None:
        return _within_shared_memory(given, np.dtype(dtype).itemsize, transposed)
    tiling = checks.resolve_tiling(options.tiling, m, k, n)
    return _default_config(make, m, k, n, dtype, tiling)


def _given_config(options: MatmulOptions, transposed: bool) -> GroupedMatmulConfig | None:
    """The caller's config for tgmm (`transposed`) or gmm: the one config given for
    both, or the kernel's entry of a `GroupedMatmulConfigs`; None: none given."""
    if isinstance(options.config, GroupedMatmulConfigs):
        return options.config.for_kernel(transposed)
    return options.config


def _default_config(make, m: int, k: int, n: int, dtype, tiling) -> GroupedMatmulConfig:
    return make(
        m,
        k,
        n,
        element_bytes=np.dtype(dtype).itemsize,
        compute_capability=launch_target().compute_capability,
        tiling=tiling,
    )


def _within_shared_memory(
    config: GroupedMatmulConfig, element_bytes: int, transposed: bool
) -> GroupedMatmulConfig:
    """`config` with the pipeline stages the GPU's shared memory holds
    (`GroupedMatmulConfig.within_shared_memory`); as given in the interpreter."""
    capability = launch_target().compute_capability
    if capability is None:  # the interpreter: no shared memory to fit
        return config
    limit = max_shared_memory_per_cta(capability)
    return config.within_shared_memory(element_bytes, transposed, limit)


def _tma(config: GroupedMatmulConfig, k: int, n: int, dtype, op: str = "grouped_matmul") -> bool:
    """Whether a kernel loads its tiles through tensor descriptors: where the config asks
    and the hardware and row sizes allow it (ValueError otherwise)."""
    if not config.tma:
        return False
    require_tensor_descriptors(op)
    itemsize = np.dtype(dtype).itemsize
    if (k * itemsize) % 16 or (n * itemsize) % 16:
        raise ValueError(
            f"{op}: config tma=True needs rows of k and n elements that span "
            f"multiples of 16 bytes (a descriptor's stride), got k={k}, n={n} of "
            f"{itemsize} bytes"
        )
    return True


# Programs of a persistent launch in Triton's interpreter: a few, so that each walks
# several tiles.
_INTERPRETER_PROGRAMS = 3
# The grid is fixed before the kernel compiles: a resident count taken with the most
# registers a Triton thread may hold is one every program reaches (a program that is not
# resident waits for another to end: a second wave).
_MOST_REGISTERS = 255


def _persistent_programs(
    config: GroupedMatmulConfig, element_bytes: int, transposed: bool = False
) -> int | None:
    """Programs of a persistent launch at `config` (gmm's, or tgmm's walk where
    `transposed`): as many as the GPU holds at once (`multiprocessor_count()` SMs, each
    as many CTAs as shared memory and the most registers allow; `_INTERPRETER_PROGRAMS`
    in the interpreter). None unless `persistent`, and on a GPU whose SMs are not known
    (a capability without a table entry, lowered without the device): then a program a
    tile, which a persistent kernel runs as it runs any grid."""
    if not config.persistent:
        return None
    target = launch_target()
    if target.interpreter:
        return _INTERPRETER_PROGRAMS
    sms = multiprocessor_count()
    if target.compute_capability is None or sms is None:
        return None
    shared = config.shared_memory_bytes(element_bytes, transposed)
    per_sm = ctas_per_sm(target.compute_capability, config.num_warps, _MOST_REGISTERS, shared)
    return sms * max(1, per_sm)


def _init_only(existing_out: jax.Array | None, out_shape: jax.ShapeDtypeStruct) -> jax.Array:
    if existing_out is not None:
        return existing_out
    return jnp.zeros(out_shape.shape, out_shape.dtype)


def _placeholder(dtype: jnp.dtype) -> jax.Array:
    # Stands in for `init_ptr` when the kernel does not accumulate (it is never read).
    return jnp.zeros((1,), dtype)


# `gmm_schedule_kernel` holds [rows, local groups] tiles (rows >= 16) and a vector of every
# group's size: past these it would spill heavily (and past 2^20 elements not compile).
_KERNEL_METADATA_GROUPS = 512
_KERNEL_METADATA_TOTAL = 8192


def group_metadata(
    group_sizes: jax.Array,
    group_offset: jax.Array | int | None,
    *,
    m: int,
    block_m: int,
    num_groups: int,
) -> GroupMetadata:
    """`make_group_metadata(group_sizes, m=m, block_m=block_m, group_offset=group_offset,
    num_groups=num_groups)`, the very same arrays, from `gmm_schedule_kernel` in one launch
    (the XLA builder takes five small kernels), or from that builder past
    `_KERNEL_METADATA_GROUPS` local groups or `_KERNEL_METADATA_TOTAL` groups in all (a
    program holds every group in registers). m >= 1.

    group_sizes: int [num_groups_total]; group_offset: int scalar (may be traced) or None (0).
    """
    total = group_sizes.shape[0]
    offset = 0 if group_offset is None else group_offset
    if num_groups > _KERNEL_METADATA_GROUPS or total > _KERNEL_METADATA_TOTAL:
        return make_group_metadata(
            group_sizes, m=m, block_m=block_m, group_offset=offset, num_groups=num_groups
        )
    num_slots = num_chunk_slots(m, block_m, num_groups)
    group_slots = max(16, triton.next_power_of_2(num_groups))
    rows = max(16, min(64, 8192 // group_slots))  # [rows, group_slots] per 2-D step
    bounds = jax.ShapeDtypeStruct((num_groups,), jnp.int32)
    slots = jax.ShapeDtypeStruct((num_slots,), jnp.int32)
    return GroupMetadata(
        *triton_call(
            jnp.asarray(group_sizes, jnp.int32),
            jnp.reshape(jnp.asarray(offset, jnp.int32), (1,)),
            kernel=gmm_schedule_kernel,
            out_shape=(
                bounds,
                bounds,
                slots,
                slots,
                jax.ShapeDtypeStruct((1,), jnp.int32),
            ),
            grid=(cdiv(num_slots, rows),),
            num_warps=4,
            num_stages=1,
            name="grouped_matmul_schedule",
            M=m,
            BLOCK_M=block_m,
            G_TOTAL=total,
            GROUPS=num_groups,
            NUM_SLOTS=num_slots,
            TOTAL_SLOTS=max(16, triton.next_power_of_2(total)),
            GROUP_SLOTS=group_slots,
            ROWS=rows,
        )
    )


@follow_lowering_platform
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    options: MatmulOptions,
) -> jax.Array:
    """`out[rows of g] = lhs[rows of g] @ rhs[g]` for local groups g, via `gmm_kernel`.

    lhs: [m, k]; rhs: [num_groups, k, n] ([num_groups, n, k] if `transpose_rhs`);
    group_sizes: int32 [num_groups_total]; existing_out: [m, n] or None.
    Returns [m, n] of `preferred_element_type`; rows of no local group are
    `existing_out`'s (or zero).
    """
    checks.check_triton_dtypes("grouped_matmul", lhs.dtype, options.preferred_element_type)
    m, k = lhs.shape
    n = rhs.shape[1] if options.transpose_rhs else rhs.shape[2]
    checks.check_triton_group_elements("grouped_matmul", k, n)
    out_shape = jax.ShapeDtypeStruct((m, n), options.preferred_element_type)
    if m == 0 or n == 0 or k == 0:  # nothing to multiply: every row keeps its init
        return _init_only(existing_out, out_shape)
    accumulate = existing_out is not None
    make = functools.partial(gmm_config, accumulate=accumulate)
    config = _config(options, m, k, n, lhs.dtype, make, transposed=False)
    meta = group_metadata(
        group_sizes, group_offset, m=m, block_m=config.block_m, num_groups=rhs.shape[0]
    )
    # Rows that no tile writes (other experts' rows, rows past sum(group_sizes)) must
    # still hold init: alias existing_out, or the kernel zeroes them.
    init = existing_out if accumulate else _placeholder(out_shape.dtype)
    tma = _tma(config, k, n, lhs.dtype)
    host = tma and config.host_descriptors and rhs.shape[0] > 0  # a descriptor has no 0 extent
    return triton_call(
        *_gmm_operands(lhs, rhs, config, options.transpose_rhs, host),
        init,
        meta.group_starts,
        meta.group_ends,
        meta.chunk_group,
        meta.chunk_row_start,
        meta.num_chunks,
        meta.group_starts.shape[0],
        kernel=gmm_kernel,
        out_shape=out_shape,
        grid=gmm_grid(
            meta.chunk_group.shape[0],
            n,
            config.block_n,
            _persistent_programs(config, np.dtype(lhs.dtype).itemsize),
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        input_output_aliases={2: 0} if accumulate else None,
        name="grouped_matmul",
        **config.shape_constexprs(m, k, n),
        TRANSPOSE_RHS=options.transpose_rhs,
        ACCUMULATE=accumulate,
        INPUT_PRECISION=triton_input_precision(options.precision, lhs.dtype),
        TMA=tma,
        WARP_SPECIALIZE=config.warp_specialize,
        PERSISTENT=config.persistent,
        HOST_DESCRIPTORS=host,
    )


def _gmm_operands(
    lhs: jax.Array, rhs: jax.Array, config: GroupedMatmulConfig, transpose_rhs: bool, host: bool
) -> tuple[jax.Array | HostDescriptor, jax.Array | HostDescriptor]:
    """gmm's lhs and rhs as the kernel takes them: arrays, or (`host`) the tensor
    descriptors the launch encodes (`GroupedMatmulConfig.host_descriptors`)."""
    if not host:
        return lhs, rhs
    lhs_box, rhs_box = config.descriptor_boxes(transpose_rhs)
    return HostDescriptor(lhs, lhs_box), HostDescriptor(rhs, rhs_box)


def _bounds_rows(options: MatmulOptions, config: GroupedMatmulConfig, m, k, n, dtype) -> int:
    """The row tile of tgmm's metadata launch where tgmm reads only the group bounds,
    which no row tile changes: the one gmm takes here, so that XLA merges it with the
    equal launch of the gmm calls beside it (a gradient makes both): gmm's config's, its
    default's where neither a config nor a tiling is given, else tgmm's own (a tiling's
    rows are gmm's too, unless tgmm has a config of its own: then the two launches
    differ)."""
    gmm_given = _given_config(options, transposed=False)
    if gmm_given is not None:
        return gmm_given.block_m
    if options.tiling is None:
        return _default_config(gmm_config, m, k, n, dtype, None).block_m
    return config.block_m


@follow_lowering_platform
def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    num_groups: int,
    options: MatmulOptions,
) -> jax.Array:
    """`out[g] = lhs[:, rows of g] @ rhs[rows of g]` for local groups g, via `tgmm_kernel`
    (or, at a `persistent` config without `tma` over a token-major lhs, `_tgmm_walk`).

    lhs: [k, m] ([m, k] if `lhs_token_major`); rhs: [m, n]; group_sizes: int32
    [num_groups_total]; existing_out: [num_groups, k, n] or None.
    Returns [num_groups, k, n] of `preferred_element_type`; empty groups give zeros
    (or `existing_out`).
    """
    checks.check_triton_dtypes(
        "transposed_grouped_matmul", lhs.dtype, options.preferred_element_type
    )
    m, k = lhs.shape if options.lhs_token_major else lhs.shape[::-1]
    n = rhs.shape[1]
    checks.check_triton_group_elements("transposed_grouped_matmul", k, n)
    out_shape = jax.ShapeDtypeStruct((num_groups, k, n), options.preferred_element_type)
    if m == 0 or n == 0 or k == 0:  # every group is empty, or its product is
        return _init_only(existing_out, out_shape)
    accumulate = existing_out is not None
    make = functools.partial(
        tgmm_config, lhs_token_major=options.lhs_token_major, num_groups=num_groups,
        accumulate=accumulate,
    )  # fmt: skip
    config = _config(options, m, k, n, lhs.dtype, make, transposed=True)
    # The walk over a token-major lhs reads the tile list itself, at its own row step.
    walk = config.persistent and options.lhs_token_major and not config.tma
    rows = config.block_m if walk else _bounds_rows(options, config, m, k, n, lhs.dtype)
    meta = group_metadata(group_sizes, group_offset, m=m, block_m=rows, num_groups=num_groups)
    # Every program writes its whole tile (zeros for an empty group): no zero fill needed.
    init = existing_out if accumulate else _placeholder(out_shape.dtype)
    if walk:
        return _tgmm_walk(lhs, rhs, init, meta, config, options, out_shape, accumulate)
    # Descriptors over a group's rows need them token-major (16-byte aligned bases).
    op = "transposed_grouped_matmul (tgmm: also grouped_matmul's weight gradient)"
    tma = options.lhs_token_major and _tma(config, k, n, lhs.dtype, op)
    return triton_call(
        lhs,
        rhs,
        init,
        meta.group_starts,
        meta.group_ends,
        kernel=tgmm_kernel,
        out_shape=out_shape,
        grid=tgmm_grid(num_groups, k, n, config.block_k, config.block_n),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        input_output_aliases={2: 0} if accumulate else None,
        name="transposed_grouped_matmul",
        **config.shape_constexprs(m, k, n),
        LHS_TOKEN_MAJOR=options.lhs_token_major,
        ACCUMULATE=accumulate,
        INPUT_PRECISION=triton_input_precision(options.precision, lhs.dtype),
        TMA=tma,
        WARP_SPECIALIZE=tma and tgmm_warp_specializes(config),
    )


def _tgmm_walk(
    lhs: jax.Array,
    rhs: jax.Array,
    init: jax.Array,
    meta: GroupMetadata,
    config: GroupedMatmulConfig,
    options: MatmulOptions,
    out_shape: jax.ShapeDtypeStruct,
    accumulate: bool,
) -> jax.Array:
    """tgmm over a token-major lhs [m, k] by `tgmm_walk_kernel`: each program walks the
    rows of a split of the local groups (`meta`: the tile list at `config.block_m`), as
    many splits as balance its waves over the programs the GPU holds at once
    (`tgmm_walk_splits`; a few in the interpreter, so that each walks several groups)."""
    (m, k), n = lhs.shape, rhs.shape[1]
    num_groups = out_shape.shape[0]
    programs = _persistent_programs(config, np.dtype(lhs.dtype).itemsize, transposed=True)
    if launch_target().interpreter:
        splits = max(1, min(num_groups, _INTERPRETER_PROGRAMS))
    elif programs is None:  # a GPU of unknown size: a split a group, as many as tgmm's
        splits = max(1, num_groups)
    else:
        splits = tgmm_walk_splits(num_groups, k, n, config.block_k, config.block_n, programs)
    return triton_call(
        lhs,
        rhs,
        init,
        meta.group_starts,
        meta.group_ends,
        meta.chunk_group,
        meta.chunk_row_start,
        num_groups,
        kernel=tgmm_walk_kernel,
        out_shape=out_shape,
        grid=tgmm_walk_grid(k, n, config.block_k, config.block_n, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        input_output_aliases={2: 0} if accumulate else None,
        name="transposed_grouped_matmul",
        **config.shape_constexprs(m, k, n),
        ACCUMULATE=accumulate,
        INPUT_PRECISION=triton_input_precision(options.precision, lhs.dtype),
        SPLITS=splits,
        GROUP_CHUNK=min(1024, max(16, triton.next_power_of_2(num_groups))),
    )
