"""Launch heuristics: warps and pipeline stages for a tile, each op's default params, and
the candidate configs the autotuner times.

The defaults are the kernels' own tables (`triton_kernels.*.config`), read, never
copied: `default_params` converts them to `FwdParams` / `BwdParams`. The candidates are
small grids around them, and on Hopper the kernels' off-by-default options at the tiles
their config modules name for them; the static report prunes the ones that spill or do
not fit in shared memory before anything is timed (`jax_bridge.tuning.autotune`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import jax.numpy as jnp

from jax_bridge.launch.report import SM_LIMITS, max_shared_memory_per_cta
from jax_bridge.tuning.device import device_compute_capability
from jax_bridge.tuning.params import BwdParams, FwdParams
from triton_kernels.config import check_block, multiplies_by_mma_sync
from triton_kernels.flash_attention.config import (
    HEAD_MAJOR_DKDV_TILE,
    HEAD_MAJOR_DQ_ATOMIC_TILE,
    KINDS,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    ONE_STAGE_TWO_CTA_TILE,
    OVERLAPPED_DKDV_TILE,
    OVERLAPPED_FORWARD_TILE,
    TWO_CTA_BACKWARD_TILE,
    WARP_SPECIALIZED_DKDV_TILE,
    WARP_SPECIALIZED_FORWARD_TILE,
    AttentionConfigs,
    AttentionFeatures,
    AttentionKernelConfig,
    block_d,
    check_kind,
    default_attention_config,
)
from triton_kernels.grouped_matmul.config import (
    DEFAULT_TILING,
    HOPPER_WARP_SPECIALIZED_GMM,
    HOPPER_WARP_SPECIALIZED_TGMM,
    GroupedMatmulConfig,
    gmm_config,
    tgmm_config,
    warp_specialized_gmm_config,
)

__all__ = [
    "ATTENTION_FEATURES",
    "DEFAULT_SHARED_MEMORY_LIMIT",
    "GROUPED_MATMUL_FEATURES",
    "SHARED_MEMORY_LIMITS",
    "attention_candidates",
    "attention_features",
    "default_attention_configs",
    "default_grouped_matmul_config",
    "default_params",
    "grouped_matmul_candidates",
    "select_num_stages",
    "select_num_warps",
    "shared_memory_limit_for",
]

# Shared memory one program (thread block) may use after opting in, by compute
# capability (CUDA's cudaDevAttrMaxSharedMemoryPerBlockOptin), from the static report's
# per-SM table.
SHARED_MEMORY_LIMITS = {cc: max_shared_memory_per_cta(cc) for cc in SM_LIMITS}
DEFAULT_SHARED_MEMORY_LIMIT = 99 * 1024
"""Where the device is unknown: the smallest limit of the GPUs above (sm_86/89/120), so a
stage count chosen with it fits on every one of them."""

ATTENTION_FEATURES = frozenset(f.name for f in dataclasses.fields(AttentionFeatures))
"""Names of the attention options that change the kernels' code (`AttentionFeatures`)."""
GROUPED_MATMUL_FEATURES = frozenset({"transpose_rhs", "accumulate", "group_offset"})
"""Grouped matmul options; "accumulate" (`existing_out`) changes gmm's default on
Hopper (`gmm_default_tiling`), the others no default config."""
OPS = ("attention", "grouped_matmul", "transposed_grouped_matmul")

_DTYPES = ("float16", "bfloat16", "float32")
# 8 warps once the larger tile holds 128 x 64 elements: such a tile is 64 fp32 registers
# per thread at 4 warps, and the kernels keep two or three of them live (Q, O, or K, V,
# dK, dV), which spills; at 8 warps a 128-row tile is also two Hopper warpgroups of m64.
_EIGHT_WARP_TILE = 128 * 64


def _dtype_name(dtype: object) -> str:
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {name}.")
    return name


def select_num_warps(q_block: int, kv_block: int, head_dim: int, dtype: object) -> int:
    """Warps of an attention kernel whose tiles are `[q_block | kv_block, head_dim]`.

    float32 (exact products on CUDA cores, no tensor cores) always takes 8: its tiles
    are small and 8 warps share their registers (the kernels' float32 tables). 16-bit
    inputs take 8 when the larger tile has at least 128 x 64 elements (head_dim padded to
    a power of two), 4 below.
    """
    check_block(q_block, "q_block")
    check_block(kv_block, "kv_block")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}.")
    if _dtype_name(dtype) == "float32":
        return 8
    return 8 if max(q_block, kv_block) * block_d(head_dim) >= _EIGHT_WARP_TILE else 4


def shared_memory_limit_for(compute_capability: int | None) -> int:
    """Bytes of shared memory one program may use on `compute_capability`;
    `DEFAULT_SHARED_MEMORY_LIMIT` where it is None or not in the table."""
    return SHARED_MEMORY_LIMITS.get(compute_capability, DEFAULT_SHARED_MEMORY_LIMIT)


def select_num_stages(
    smem_bytes_per_stage: int, *, shared_memory_limit: int | None = None, max_stages: int = 4
) -> int:
    """Pipeline stages: as many stage buffers as fit in shared memory, in [1, max_stages].

    Args:
      smem_bytes_per_stage: bytes one stage buffers (the tiles a loop step streams in).
      shared_memory_limit: bytes one program may use; None: the current device's limit
        (`shared_memory_limit_for` its compute capability; the 99 KiB default on a
        device without one, e.g. the CPU). Pass a budget below the hardware limit when
        the kernel needs shared memory besides its stages.
      max_stages: the upper bound (more stages rarely pay beyond hiding latency).
    """
    for name, value in (("smem_bytes_per_stage", smem_bytes_per_stage), ("max_stages", max_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}.")
    if smem_bytes_per_stage < 1 or max_stages < 1:
        raise ValueError(
            f"smem_bytes_per_stage and max_stages must be >= 1, got {smem_bytes_per_stage} "
            f"and {max_stages}."
        )
    if shared_memory_limit is None:
        shared_memory_limit = shared_memory_limit_for(device_compute_capability())
    return max(1, min(max_stages, shared_memory_limit // smem_bytes_per_stage))


def _check_features(features: Collection[str], known: frozenset[str], op: str) -> None:
    if isinstance(features, str):  # a lone name would be read letter by letter
        features = (features,)
    unknown = sorted(set(features) - known)
    if unknown:
        raise ValueError(f"{op}: unknown feature(s) {unknown}; known: {sorted(known)}.")


def _check_capability(compute_capability: object, fn: str) -> None:
    """An int (90 for sm_90: the tables' keys, a GPU not in them takes the nearest) or
    None; JAX spells a device's capability "9.0", which would miss every key."""
    if compute_capability is not None and (
        isinstance(compute_capability, bool) or not isinstance(compute_capability, int)
    ):
        raise TypeError(
            f"{fn}: compute_capability must be an int such as 90 (sm_90) or None, got "
            f"{compute_capability!r}."
        )


def attention_features(features: AttentionFeatures | Collection[str] = ()) -> AttentionFeatures:
    """`features` as `AttentionFeatures`: given as such, or as the names of the ones on
    (a subset of `ATTENTION_FEATURES`, e.g. {"causal", "sinks"})."""
    if isinstance(features, AttentionFeatures):
        return features
    if isinstance(features, str):  # a lone name would be read letter by letter
        features = (features,)
    _check_features(features, ATTENTION_FEATURES, "attention")
    return AttentionFeatures(**dict.fromkeys(features, True))


def default_attention_configs(
    head_dim: int,
    dtype: object,
    compute_capability: int | None,
    features: AttentionFeatures | Collection[str] = (),
    descriptors: bool = False,
    persistent: bool = False,
    dq_atomic: bool = False,
) -> AttentionConfigs:
    """The complete default `AttentionConfigs` (the kernels' tables) of one problem, as
    `varlen_attention` launches it. `descriptors`, `persistent` and `dq_atomic` as
    `default_attention_config`'s: `jax_bridge.launch.target.tensor_descriptors_available()`;
    whether the call's sequences are many enough for the kernels to walk tile lists
    (`jax_bridge.attention.schedule.call_walks_tile_lists`: such launches keep smaller
    tiles where the larger spill in the walk, e.g. the Hopper forward at d=256); and
    whether dK/dV adds dQ (`AttentionConfigs.dq_atomic`, set in the result too: that
    kernel has its own tiles, and the dQ kernel's is then unused)."""
    _check_capability(compute_capability, "default_attention_configs")
    name, on = _dtype_name(dtype), attention_features(features)
    launch = dict(features=on, descriptors=descriptors, persistent=persistent,
                  dq_atomic=dq_atomic)  # fmt: skip
    configs = [default_attention_config(head_dim, name, compute_capability, kind, **launch)
               for kind in KINDS]  # fmt: skip
    return AttentionConfigs(*configs, dq_atomic=dq_atomic)


def default_grouped_matmul_config(
    shape: tuple[int, int, int],
    dtype: object,
    compute_capability: int | None,
    transposed: bool = False,
    accumulate: bool = False,
) -> GroupedMatmulConfig:
    """The config `grouped_matmul` (`transposed_grouped_matmul` when `transposed`) launches
    for `shape` = (m, k, n) without `tiling` or `config` arguments, with `existing_out`
    when `accumulate`. Its gradient's matmuls take their own kernels' defaults."""
    element_bytes = jnp.dtype(_dtype_name(dtype)).itemsize
    target = dict(element_bytes=element_bytes, compute_capability=compute_capability)
    if transposed:
        return tgmm_config(*shape, **target)
    return gmm_config(*shape, **target, accumulate=accumulate)


def default_params(
    op: str,
    *,
    compute_capability: int | None,
    dtype: object,
    head_dim: int | None = None,
    shape: tuple[int, int, int] | None = None,
    features: AttentionFeatures | Collection[str] = (),
    descriptors: bool = False,
    persistent: bool = False,
    dq_atomic: bool = False,
) -> tuple[FwdParams, BwdParams | None]:
    """The default launch params of `op` as (forward, backward); backward is None for the
    grouped matmuls, whose gradient matmuls take their own kernels' defaults.

    Args:
      op: "attention", "grouped_matmul" or "transposed_grouped_matmul".
      compute_capability: 80, 86, 89, 90, 100, 120, ...; None: Triton's CPU interpreter.
      dtype: float16, bfloat16 or float32 (the inputs').
      head_dim: attention's head dimension (16..256).
      shape: the grouped matmuls' (m, k, n) (see `gmm_config` / `tgmm_config`); the
        default is the one `grouped_matmul` runs without `tiling` or `config` arguments.
      features: the options the call uses. Attention: an `AttentionFeatures` or the
        names of the ones on (`ATTENTION_FEATURES`), passed to the kernels' tables.
        Grouped matmul: names from `GROUPED_MATMUL_FEATURES` (validated; "accumulate"
        changes gmm's default on Hopper).
      descriptors, persistent, dq_atomic: attention's launch, as
        `default_attention_configs` takes it (each changes some kernel's default).
    """
    _check_capability(compute_capability, "default_params")
    launch = dict(descriptors=descriptors, persistent=persistent, dq_atomic=dq_atomic)
    if op == "attention":
        if head_dim is None:
            raise ValueError("default_params('attention') needs head_dim.")
        configs = default_attention_configs(head_dim, dtype, compute_capability, features, **launch)
        return (
            FwdParams.from_attention_config(configs.forward),
            BwdParams.from_attention_configs(configs.backward_dkdv, configs.backward_dq),
        )
    if op in ("grouped_matmul", "transposed_grouped_matmul"):
        if any(launch.values()):
            on = sorted(name for name, value in launch.items() if value)
            raise ValueError(f"default_params({op!r}): {on} are attention's arguments.")
        _check_features(features, GROUPED_MATMUL_FEATURES, op)
        if shape is None or len(shape) != 3:
            raise ValueError(f"default_params({op!r}) needs shape=(m, k, n), got {shape!r}.")
        transposed, accumulate = op == "transposed_grouped_matmul", "accumulate" in features
        config = default_grouped_matmul_config(
            shape, dtype, compute_capability, transposed, accumulate
        )
        return FwdParams.from_grouped_matmul_config(config), None
    raise ValueError(f"op must be one of {OPS}, got {op!r}.")


# ------------------------------------------------------------------------- candidates

# Tile rows (stationary, streamed) tried per attention kernel. The stationary tile is
# the one a program owns (queries in the forward and dQ kernels, keys in dK/dV).
_ATTENTION_TILES_16BIT = {
    "forward": ((64, 128), (32, 64, 128)),
    "backward_dkdv": ((64, 128), (16, 32, 64)),
    "backward_dq": ((64, 128), (16, 32, 64)),
}
# float32 products run on CUDA cores: only small tiles avoid spilling (see the tables).
_ATTENTION_TILES_FLOAT32 = ((16, 32), (16, 32))
# Past d=128 on mma.sync GPUs also stationary tiles of 32 rows, at 4 warps: the shape of
# the 99 KiB GPUs' forward and dQ defaults there and of sm_80's dK/dV (64-row tiles leave
# the 99 KiB GPUs one buffer at most), where 8 warps would split 32 rows' head dim among
# them. Hopper's wgmma takes 64 rows a warpgroup.
_NARROW_ROWS, _NARROW_WARPS = 32, 4


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))


def attention_candidates(
    kind: str,
    *,
    head_dim: int,
    dtype: object,
    compute_capability: int | None,
    features: AttentionFeatures | Collection[str] = (),
    descriptors: bool = False,
    persistent: bool = False,
) -> list[FwdParams] | list[BwdParams]:
    """Configs of one attention kernel to time, the default first (that of a call of many
    sequences where `persistent`, `default_attention_configs`'s).

    `kind` "forward" gives `FwdParams`; "backward_dkdv" and "backward_dq" give
    `BwdParams` that set only that kernel's fields (the other one keeps its default).
    Every candidate sets every field its kernel has, the options included.
    A grid of tiles, each with `select_num_warps` warps (past d=128 on mma.sync GPUs
    also stationary tiles of 32 rows, at 4) and the two largest stage counts up to 3
    (from 2 on mma.sync) whose shared memory (`AttentionKernelConfig.shared_memory_bytes`:
    the stationary tiles, the pipeline's buffers, the scores' scratch) fits
    `compute_capability`'s (a tile that fits at none is left out), by pointers; for
    dK/dV with `descriptors` on sm_90 and up (head_dim a power of two), its 128-key
    tiles of 32 and 64 queries also through tensor descriptors (its default there is one
    of them; the forward and dQ ran slower with them on an H100, and are not searched at
    the grid's tiles: each candidate is a compile on the device). The default is the
    kernels' table entry for `features` and `descriptors` (`default_attention_config`).

    On sm_90 and up, 16-bit inputs, the kernels' off-by-default options are searched
    too (`_hopper_options`): on sm_90-119 the forward and dQ at one stage, two CTAs an
    SM (`ONE_STAGE_TWO_CTA_TILE`, head dims up to 128, not persistent; by pointers, and
    with `descriptors` at a power-of-two head_dim by descriptors too), the forward's and
    dK/dV's `overlap_softmax` at their tiles (`OVERLAPPED_FORWARD_TILE`,
    `OVERLAPPED_DKDV_TILE`) and, with `descriptors` and a head_dim that is a power of
    two, the warp-specialized forward and dK/dV (`WARP_SPECIALIZED_FORWARD_TILE`,
    `WARP_SPECIALIZED_DKDV_TILE`) and dK/dV and dQ at one warpgroup a CTA
    (`TWO_CTA_BACKWARD_TILE`, with `tma`); on sm_90, past head_dim 128, head-major dK/dV
    (`AttentionKernelConfig.head_major`) at `HEAD_MAJOR_DKDV_TILE` and
    `HEAD_MAJOR_DQ_ATOMIC_TILE`.
    """
    check_kind(kind)
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")
    name = _dtype_name(dtype)
    default = default_attention_config(
        head_dim, name, compute_capability, kind, features=attention_features(features),
        descriptors=descriptors, persistent=persistent,
    )  # fmt: skip
    # Descriptors carry whole rows: a head_dim that is a power of two (`block_d`'s).
    tma_here = descriptors and (compute_capability or 0) >= 90 and block_d(head_dim) == head_dim
    configs = [
        default,
        *_attention_grid(kind, head_dim, name, compute_capability, tma_here),
        *_hopper_options(kind, head_dim, name, compute_capability, tma_here, persistent),
    ]
    to_params = {
        "forward": FwdParams.from_attention_config,
        "backward_dkdv": BwdParams.from_dkdv_config,
        "backward_dq": BwdParams.from_dq_config,
    }[kind]
    return _unique([to_params(config) for config in configs])


def _attention_grid(
    kind: str, head_dim: int, dtype_name: str, compute_capability: int | None, tma_here: bool
) -> list[AttentionKernelConfig]:
    """`attention_candidates`' grid of tiles, warps and stages (dK/dV's twins by
    descriptors where `tma_here`)."""
    if dtype_name == "float32":
        stationary, streamed = _ATTENTION_TILES_FLOAT32
    else:
        stationary, streamed = _ATTENTION_TILES_16BIT[kind]
        if block_d(head_dim) > 128 and multiplies_by_mma_sync(compute_capability):
            stationary = (_NARROW_ROWS, *stationary)
    itemsize = jnp.dtype(dtype_name).itemsize
    limit = shared_memory_limit_for(compute_capability)
    configs = []
    for rows in stationary:
        for step in streamed:
            q, kv = (step, rows) if kind == "backward_dkdv" else (rows, step)
            narrow = dtype_name != "float32" and rows == _NARROW_ROWS
            warps = _NARROW_WARPS if narrow else select_num_warps(q, kv, head_dim, dtype_name)
            tile = AttentionKernelConfig(q, kv, warps)
            # The two deepest pipelines up to 3 stages that fit (none: the tile is left
            # out). On mma.sync 1 stage keeps the one buffer 2 keep, with no copy in
            # flight, and dK/dV allocates more at 1 than its estimate: not searched there.
            mma_sync = multiplies_by_mma_sync(compute_capability, rows)
            fitting = [
                stages
                for stages in ((2, 3) if mma_sync else (1, 2, 3))
                if tile.replace(num_stages=stages).shared_memory_bytes(
                    kind, head_dim, itemsize, compute_capability
                )
                <= limit
            ]
            search_tma = tma_here and kind == "backward_dkdv" and kv == 128 and q >= 32
            for stages in fitting[-2:]:
                configs += [
                    tile.replace(num_stages=stages, tma=tma)
                    for tma in ((False, True) if search_tma else (False,))
                ]
    return configs


def _hopper_options(
    kind: str, head_dim: int, dtype_name: str, compute_capability: int | None,
    tma_here: bool, persistent: bool,
) -> list[AttentionKernelConfig]:  # fmt: skip
    """The configs of the options the kernels leave off by default, where they apply:
    sm_90 and up (wgmma), 16-bit inputs (float32 runs on CUDA cores, with its own small
    tiles); on the wgmma GPUs (sm_90-119) the forward and dQ at one warpgroup a CTA and
    one stage, two CTAs an SM, by pointers (and by descriptors where `tma_here`), up to
    head_dim 128, a program a tile
    (`ONE_STAGE_TWO_CTA_TILE`: the grid's stages, sized by one CTA's shared memory, never
    take one; on mma.sync GPUs one stage keeps no copy in flight and two CTAs do not fit
    99 KiB; a persistent walk's dQ at that tile spills in its loop on sm_90 under Triton
    3.9); where descriptors launch (`tma_here`) also the warp-specialized forward and
    dK/dV and the backward's kernels at one warpgroup a CTA, two CTAs an SM; head-major
    dK/dV past head_dim 128 on Hopper's wgmma (sm_90-99). Each at the
    tile the kernels' config module names for it (the kernels' options last); the static
    report prunes the ones that spill at other head dims."""
    if (compute_capability or 0) < 90 or dtype_name == "float32":
        return []
    two_ctas = [AttentionKernelConfig(*TWO_CTA_BACKWARD_TILE, tma=True)] if tma_here else []
    one_stage = []
    wgmma = not multiplies_by_mma_sync(compute_capability, ONE_STAGE_TWO_CTA_TILE[0])
    if kind != "backward_dkdv" and block_d(head_dim) <= 128 and wgmma and not persistent:
        one_stage = [AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE)]
        if tma_here:  # a bulk copy a tile for the pointers' 32 loads and 32 stores a thread
            one_stage.append(AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE, tma=True))
    if kind == "backward_dq":  # it refuses overlap_softmax and warp_specialize
        return two_ctas + one_stage
    overlapped, specialized = {
        "forward": (OVERLAPPED_FORWARD_TILE, WARP_SPECIALIZED_FORWARD_TILE),
        "backward_dkdv": (OVERLAPPED_DKDV_TILE, WARP_SPECIALIZED_DKDV_TILE),
    }[kind]
    options = [AttentionKernelConfig(*overlapped, overlap_softmax=True)]
    if tma_here:
        options.append(AttentionKernelConfig(*specialized, tma=True, warp_specialize=True))
    if kind == "backward_dkdv" and block_d(head_dim) > 128 and compute_capability < 100:
        tiles = (HEAD_MAJOR_DKDV_TILE, HEAD_MAJOR_DQ_ATOMIC_TILE)
        options += [AttentionKernelConfig(*tile, head_major=True) for tile in tiles]
    return (two_ctas if kind == "backward_dkdv" else one_stage) + options


def grouped_matmul_candidates(
    shape: tuple[int, int, int],
    *,
    dtype: object,
    compute_capability: int | None,
    transposed: bool = False,
    descriptors: bool = False,
) -> list[FwdParams]:
    """Configs of `gmm_kernel` (or `tgmm_kernel` when `transposed`) to time, the op's
    default (`default_grouped_matmul_config`) first: a grid of tilings, each completed by
    `gmm_config` / `tgmm_config` (tiles shrunk to small dimensions, warps and stages from
    its shared-memory budget).

    With `descriptors` (`jax_bridge.launch.target.tensor_descriptors_available`) on sm_90
    and up, 16-bit inputs whose rows of k and n elements span multiples of 16 bytes (a
    descriptor's stride), also the kernel's warp-specialized tiles
    (`warp_specialized_gmm_config` at each of `HOPPER_WARP_SPECIALIZED_GMM`, or tgmm's
    `HOPPER_WARP_SPECIALIZED_TGMM`: tgmm specializes where its lhs is token-major, the
    weight gradient of `grouped_matmul`), and gmm's default tile persistent through
    descriptors. Everywhere also the default tile persistent
    (`GroupedMatmulConfig.persistent`)."""
    element_bytes = jnp.dtype(_dtype_name(dtype)).itemsize
    make = tgmm_config if transposed else gmm_config
    step = 128 // element_bytes  # 128 bytes of each operand row per reduction step
    rows, cols = (64, 128), (64, 128, 256)
    if transposed:  # tgmm reduces over rows (tm is the step); a program owns [tk, tn]
        tilings = [(s, tk, tn) for s in (step, 2 * step) for tk in rows for tn in cols]
    else:
        tilings = [(tm, s, tn) for tm in rows for s in (step, 2 * step) for tn in cols]
    complete = functools.partial(
        make, *shape, element_bytes=element_bytes, compute_capability=compute_capability
    )
    configs = [complete(), *(complete(tiling=t) for t in (DEFAULT_TILING, *tilings))]
    # The default tile persistent: gmm's programs walk the tile list, tgmm's the rows of a
    # split of the groups (over a token-major lhs: the weight gradient).
    configs.append(dataclasses.replace(configs[0], persistent=True))
    _, k, n = shape
    # Float32 compiles unspecialized (`GroupedMatmulConfig.warp_specialize`), and the
    # launch refuses descriptors over rows that are not multiples of 16 bytes.
    if (
        descriptors
        and (compute_capability or 0) >= 90
        and element_bytes == 2
        and (k * element_bytes) % 16 == (n * element_bytes) % 16 == 0
    ):
        tiles = (HOPPER_WARP_SPECIALIZED_TGMM,) if transposed else HOPPER_WARP_SPECIALIZED_GMM
        configs += [warp_specialized_gmm_config(*shape, tiling) for tiling in tiles]
        if not transposed:  # and persistent through descriptors built once a program
            configs.append(dataclasses.replace(configs[0], tma=True, persistent=True))
    return [FwdParams.from_grouped_matmul_config(config) for config in _unique(configs)]
