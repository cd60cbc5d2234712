"""Launch configurations for the grouped matmul kernels: a small function of the shapes,
the element size and the GPU generation, with the caller's tiling as the override.

Pure Python (no JAX): the bridge resolves the user's `tiling` argument to a tuple or
None and asks here for the block sizes, warps and pipeline stages.
"""

from __future__ import annotations

import dataclasses
from typing import Self

import triton

from triton_kernels.config import (
    MIN_BLOCK,
    KernelConfig,
    check_block,
    multiplies_by_mma_sync,
    pipeline_buffers,
)

# Shared memory one program may use for its pipeline buffers, by compute capability.
# The hardware limits (per block, opt-in) are 163 KiB on sm_80, 99 KiB on sm_86/89 and
# 227 KiB on sm_90/100; the margin leaves room for the epilogue's layout conversion.
_SHARED_MEMORY_BUDGET = {
    80: 150 * 1024,
    86: 90 * 1024,
    89: 90 * 1024,
    90: 200 * 1024,
    100: 200 * 1024,
}
_SHARED_MEMORY_BUDGET_DEFAULT = 90 * 1024
_MAX_STAGES = 4

DEFAULT_TILING = (128, 128, 128)
"""megablox's default tiling: each kernel's default for 16-bit inputs but on Hopper
(gmm's `_HOPPER_GMM_TILING`, tgmm's `_SHORT_GROUP_TILING`); 4-byte inputs take a quarter
of its reduction step (`_reduction_step`), and a GPU that holds one buffer of it two
of half its step (`_pipelined`)."""

# gmm's tile on Hopper for 16-bit inputs: a [128, 256] output tile is two warpgroups of
# m64n256 MMAs, whose operands carry 2*128*256 / ((128 + 256) * 2) = 85 FLOP per byte
# loaded against 64 at 128 x 128 (less L2-to-SM traffic per FLOP, where a grouped matmul
# with many output tiles per group reads each operand many times); it is also the first
# config Triton's matmul tutorial tries on NVIDIA GPUs (128 x 256 x 64, 8 warps). Static
# report, sm_90 (bench report; 3.6 / 3.9 warp-instructions per MFLOP): 277 / 309 -> 219 /
# 225 at m 32768, k 4096, n 2048, no spill, not serialized; the transposed-rhs launch
# (the input gradient) 252 / 278 -> 191 / 198. With `existing_out` the epilogue's
# [128, 256] float32 init tile spills (200 / 236 B under 3.6 / 3.9): that launch keeps
# DEFAULT_TILING. Not yet timed on a GPU (bench/gpu_rows.py times the two as A/B rows).
_HOPPER_GMM_TILING = (128, 64, 256)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig(KernelConfig):
    """One launch of `gmm_kernel` or `tgmm_kernel`.

    Attributes:
      block_m: rows (tokens) per tile. In gmm a program owns `block_m` output rows; in
        tgmm it is the chunk of rows summed per loop step.
      block_k, block_n: tile sizes along k and n. In gmm `block_k` is the reduction step;
        in tgmm a program owns a `[block_k, block_n]` output tile.
      num_warps, num_stages: GPU launch configuration (ignored by the interpreter).
      tma: the tiles through device-side tensor descriptors (Hopper's bulk tensor copies,
        sm_90 and up; the interpreter runs them too). Needs rows of k and n elements to
        span multiples of 16 bytes. gmm reads lhs and the group's weights so; tgmm, where
        its lhs is token-major (the weight gradient), reads lhs and rhs through
        descriptors over each group's own rows (a [k, m] lhs loads by pointers). Off by
        default: on an H100 gmm ran 2.6x slower with it at m 8192, 3% at m 32768 (before
        its tile list and grid order changed); tgmm's is not yet timed on a GPU (static
        report, sm_90, m 8192: 341 -> 156 warp-instructions per MFLOP at its default tile).
      warp_specialize: the reduction loop warp-specialized (needs `tma` and 4 warps):
        Triton gives the tile loads to a producer warpgroup and the MMAs to two consumer
        warpgroups (on Hopper the kernel runs 12 warps), which CUTLASS's Hopper GEMMs (and
        `torch._grouped_mm`) do by hand. Its float32 output tile passes through shared
        memory (`shared_memory_bytes`). Off by default: not yet timed on a GPU (A/B rows of
        `python -m bench gpu-check --warp-specialized`). Triton compiles the loop
        unspecialized (4 warps; the report's warps say which) for float32 inputs, 16-row
        tiles, 256-row tiles, and a single stage (128 x 128 x 256 fits only one beside its
        hand-off tile); tgmm runs unspecialized at `block_k` 64 with `block_n` 256, whose
        consumers Triton fails to compile (`tgmm_warp_specializes`), and with a [k, m] lhs.
      persistent: gmm launches one program per CTA the GPU holds at once (the bridge
        counts `multiprocessor_count()` SMs times the CTAs that fit) instead of one a
        tile, each walking the tile list in the default's order, column tiles fastest;
        with `tma` a program builds its two tensor descriptors once for all its tiles,
        where a program a tile builds them for each (a write to global memory and a
        fence before its first copy). CUTLASS's grouped GEMMs (`torch._grouped_mm`)
        schedule so. Not with `warp_specialize` (these Tritons partition no loop around
        the k loop). tgmm over a token-major lhs (the weight gradient) without `tma`
        takes it too (`tgmm_walk_kernel`): a program per (k tile, n tile, split of the
        groups), as many splits as balance its waves (`tgmm_walk_splits`), walks its
        groups' rows in one loop, so the next group's loads are in flight while one ends
        (a program per group starts each with a load nothing hides: at m 8192 over 64
        groups, two 64-row steps a program); elsewhere tgmm ignores it. Off by default:
        not yet timed on a GPU (A/B rows of `python -m bench gpu-check`).
      host_descriptors (with `tma`, gmm only): the launch encodes gmm's two tensor
        descriptors once, on the host, and passes them as kernel parameters (grid
        constants), instead of every program writing its own to global memory and
        fencing them before its first copy (`jax_bridge.launch.host_descriptors`: on a
        GPU it needs jaxlib >= 0.11.2; Triton's interpreter runs it anywhere). Why TMA
        made gmm slower on an H100 (2.6x at m 8192, where every program builds its
        descriptors) is not known; this takes that work away. Off by default: not yet run
        on a GPU (the A/B rows of `python -m bench gpu-check --host-descriptors`). tgmm
        ignores it (its descriptors span one group's rows each).

    Validated by `KernelConfig` (blocks: powers of two >= 16).
    """

    block_m: int
    block_k: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False
    warp_specialize: bool = False
    persistent: bool = False
    host_descriptors: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.persistent and self.warp_specialize:
            raise ValueError(
                "GroupedMatmulConfig: persistent=True excludes warp_specialize=True (Triton "
                "partitions no loop around the k loop)."
            )
        if self.host_descriptors and not self.tma:
            raise ValueError(
                "GroupedMatmulConfig: host_descriptors=True needs tma=True (they are the "
                "tiles' tensor descriptors)."
            )

    @property
    def tiling(self) -> tuple[int, int, int]:
        return (self.block_m, self.block_k, self.block_n)

    def stage_bytes(self, element_bytes: int, transposed: bool) -> int:
        """Shared memory of one pipeline stage: gmm's lhs and rhs tiles, `[block_m,
        block_k]` and `[block_k, block_n]`, or (`transposed`) tgmm's, `[block_k, block_m]`
        and `[block_m, block_n]`."""
        if transposed:
            return (self.block_k + self.block_n) * self.block_m * element_bytes
        return (self.block_m + self.block_n) * self.block_k * element_bytes

    def shared_memory_bytes(self, element_bytes: int, transposed: bool) -> int:
        """Shared memory of the pipeline (`num_stages` stages of `stage_bytes`: the buffers
        of sm_90 and sm_100; an upper bound on mma.sync GPUs, which keep one fewer,
        `pipeline_buffers`) and, where warp-specialized, of the float32 output tile its
        consumers hand the epilogue: gmm's `[block_m, block_n]`, tgmm's (`transposed`;
        where `tgmm_warp_specializes`) `[block_k, block_n]`, a tile of fewer than 128 rows
        taking the space of 128 (the static report under Triton 3.6 and 3.9: gmm 128 x 64
        x 128 at 4 stages takes 192 KiB, 128 + 64; gmm 64 x 128 x 128 and tgmm 128 x 64 x
        128 hand off 64 KiB, not 32)."""
        pipeline = self.num_stages * self.stage_bytes(element_bytes, transposed)
        if not (tgmm_warp_specializes(self) if transposed else self.warp_specialize):
            return pipeline
        rows = self.block_k if transposed else self.block_m
        return pipeline + 4 * max(rows, 128) * self.block_n

    def within_shared_memory(self, element_bytes: int, transposed: bool, limit: int) -> Self:
        """This config as a kernel launches it on a GPU of `limit` bytes of shared memory
        a CTA: as given where it fits, else with as many pipeline stages as fit (at least
        one). A config reaches every matmul of the op's gradient, and a gmm tile reused by
        tgmm (or the reverse) holds other tiles a stage (gmm's 128 x 64 x 256 at 4 stages
        is 192 KiB in gmm and 320 KiB in tgmm)."""
        needed = self.shared_memory_bytes(element_bytes, transposed)
        if needed <= limit:
            return self
        stage = self.stage_bytes(element_bytes, transposed)
        fixed = needed - self.num_stages * stage
        return dataclasses.replace(self, num_stages=max(1, (limit - fixed) // stage))

    def descriptor_boxes(self, transpose_rhs: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The boxes gmm loads through its lhs [m, k] and rhs [groups, k, n] (or, with
        `transpose_rhs`, [groups, n, k]) descriptors: [block_m, block_k] and one group's
        [block_k, block_n] (or [block_n, block_k])."""
        rhs = (self.block_n, self.block_k) if transpose_rhs else (self.block_k, self.block_n)
        return (self.block_m, self.block_k), (1, *rhs)

    def shape_constexprs(self, m: int, k: int, n: int) -> dict[str, int]:
        """The kernels' shape and tile constexprs for problem sizes m, k, n."""
        return dict(M=m, K=k, N=n, BLOCK_M=self.block_m, BLOCK_K=self.block_k, BLOCK_N=self.block_n)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfigs:
    """A launch configuration per kernel; None: that kernel's default.

    `gmm` reaches every `gmm_kernel` launch (the forward, the input gradient), `tgmm`
    every `tgmm_kernel` launch (the weight gradient, `transposed_grouped_matmul`). A
    single `GroupedMatmulConfig` given as `config=` reaches both kernels alike.
    """

    gmm: GroupedMatmulConfig | None = None
    tgmm: GroupedMatmulConfig | None = None

    def __post_init__(self):
        for kernel in ("gmm", "tgmm"):
            config = getattr(self, kernel)
            if config is not None and not isinstance(config, GroupedMatmulConfig):
                raise TypeError(
                    f"GroupedMatmulConfigs.{kernel} must be a GroupedMatmulConfig or None, "
                    f"got {type(config).__name__}"
                )

    def for_kernel(self, transposed: bool) -> GroupedMatmulConfig | None:
        """tgmm's config where `transposed`, else gmm's."""
        return self.tgmm if transposed else self.gmm


def tgmm_warp_specializes(config: GroupedMatmulConfig) -> bool:
    """Whether tgmm runs `config` warp-specialized: as asked, but at `block_k` 64 with
    `block_n` 256, where Triton (3.6 and 3.9) fails to lay out the consumers' MMAs (a
    gmm config of `HOPPER_WARP_SPECIALIZED_GMM` reaching the weight gradient)."""
    return config.warp_specialize and not (config.block_k == 64 and config.block_n == 256)


# gmm warp-specialized on Hopper (`GroupedMatmulConfig.warp_specialize`), the A/B rows of
# `python -m bench gpu-check --warp-specialized` until a GPU has timed them: the Hopper
# tile with the most stages that fit beside its float32 hand-off tile (2: 96 + 128 KiB),
# and a [128, 128] tile at 5 (160 + 64 KiB), the producer further ahead. Static report,
# sm_90, m 8192, k 2048, n 1408 (3.6 / 3.9): the consumers' loop 103 / 99 and 221 / 237
# warp-instructions per MFLOP, against 223 / 225 for the default by pointers and 145 /
# 143 through descriptors at 8 warps; no spill, not serialized.
HOPPER_WARP_SPECIALIZED_GMM = ((128, 64, 256, 2), (128, 64, 128, 5))


# tgmm (the weight gradient, token-major lhs) warp-specialized on Hopper, the A/B row of
# `python -m bench gpu-check --warp-specialized`: 64-row steps into a [128, 256] output
# tile, two consumers of 64 x 256 (224 KiB with the hand-off tile). Static report, sm_90,
# m 8192, k 2048, n 1408 (3.6 / 3.9): the consumers' loop 99 / 93 warp-instructions per
# MFLOP, against 319 / 341 for the default by pointers and 151 / 156 at its tile through
# descriptors; no spill, not serialized. (128, 64, 256) does not compile
# (`tgmm_warp_specializes`).
HOPPER_WARP_SPECIALIZED_TGMM = (64, 128, 256, 2)


def warp_specialized_gmm_config(
    m: int, k: int, n: int, tiling: tuple[int, int, int, int]
) -> GroupedMatmulConfig:
    """The warp-specialized config of gmm (or tgmm) at `tiling` = (tm, tk, tn, stages)
    (an entry of `HOPPER_WARP_SPECIALIZED_GMM`, or `HOPPER_WARP_SPECIALIZED_TGMM`),
    blocks shrunk to the problem as `gmm_config` does."""
    tm, tk, tn, stages = tiling
    return GroupedMatmulConfig(
        block_m=_fit(tm, m), block_k=_fit(tk, k), block_n=_fit(tn, n), num_warps=4,
        num_stages=stages, tma=True, warp_specialize=True,
    )  # fmt: skip


def check_tiling(tiling: tuple[int, int, int], name: str = "tiling") -> tuple[int, int, int]:
    """ValueError unless `tiling` is three powers of two, each at least 16."""
    if not isinstance(tiling, tuple | list) or len(tiling) != 3:
        raise ValueError(f"{name} must be a tuple (tm, tk, tn), got {tiling!r}.")
    for size in tiling:
        try:
            check_block(size, f"{name} entries")
        except (TypeError, ValueError) as err:
            raise ValueError(f"{err} (got {name}={tiling!r})") from None
    return tuple(tiling)


def _fit(block: int, dim: int) -> int:
    # A block larger than its dimension only computes masked-out padding: shrink it to
    # the dimension rounded up to a power of two (never below tl.dot's minimum).
    return min(block, max(MIN_BLOCK, triton.next_power_of_2(max(dim, 1))))


def _num_stages(stage_bytes: int, compute_capability: int | None) -> int:
    """The most stages (up to `_MAX_STAGES`) whose buffers (`pipeline_buffers`) fit the
    GPU's budget."""
    if compute_capability is None:  # interpreter: no pipelining to size
        return 2
    budget = _SHARED_MEMORY_BUDGET.get(compute_capability, _SHARED_MEMORY_BUDGET_DEFAULT)
    buffers = budget // stage_bytes
    if buffers == 0:  # not even one: the launch's own check says so
        return 1
    stages = buffers + 1 if multiplies_by_mma_sync(compute_capability) else buffers
    return min(_MAX_STAGES, stages)


def _pipelined(
    tiles: GroupedMatmulConfig, element_bytes: int, transposed: bool, compute_capability: int | None
) -> GroupedMatmulConfig:
    """A default tile whose pipeline would hold a single buffer in the GPU's budget, with
    its reduction step halved until two fit (gmm's `block_k`, tgmm's `block_m`; not below
    32): with one, each step's copy is awaited before its MMAs (`pipeline_buffers`).
    The GPUs of 99 KiB a block (sm_86/89, sm_120; a 90 KiB budget) hold one 64 KiB
    buffer of the 16-bit default, two of 128x64x128 (three stages). The halved step
    lengthens the loop (warp-instructions per MFLOP, static report, Triton 3.6 / 3.9,
    bf16, m 8192 k 2048 n 1408, sm_86: gmm 551 -> 614 / 551 -> 710, the weight gradient
    601 -> 656 / 601 -> 782; no spill), which is cheap there: at 4 issue slots a clock an
    SM that is under 200 clocks a MFLOP, against the 1-2 thousand that a MFLOP of
    mma.sync takes on these GPUs' tensor cores."""
    field = "block_m" if transposed else "block_k"
    while (
        compute_capability is not None
        and getattr(tiles, field) > 32
        and pipeline_buffers(
            _num_stages(tiles.stage_bytes(element_bytes, transposed), compute_capability),
            compute_capability,
        )
        < 2
    ):
        tiles = dataclasses.replace(tiles, **{field: getattr(tiles, field) // 2})
    return tiles


def _num_warps(out_tile_elements: int) -> int:
    # Eight warps keep a 128x128 float32 accumulator at 64 registers a thread. Four-warp
    # configs checked with `python -m bench report` (bf16, m=8192 k=2048 n=1408, sm_90):
    # gmm 128x64x128 at 4 warps runs 284 warp-instructions per MFLOP with 2 CTAs per SM,
    # against 305 and 1 CTA for the default; tgmm's [K, M] layout spills at 4 warps. The
    # gain is within what wave quantisation can undo, so the default waits for a GPU.
    return 8 if out_tile_elements >= 128 * 128 else 4


def _reduction_step(element_bytes: int) -> int:
    # 16-bit inputs: DEFAULT_TILING's 128 elements a pipeline stage. 4-byte inputs: 32.
    # Their exact products ("ieee", the default precision) run as FMA dots on CUDA cores,
    # which hold each operand's [block, step] slice in registers: at a 64-element step the
    # default tiles spilled 7-20 KiB a thread (gmm's forward on sm_80 and sm_90 under
    # Triton 3.6 and 3.9, down to 32 registers; under 3.9 on sm_80 every launch of a
    # training step); at 32 none spills, on either GPU under either Triton.
    return 128 if element_bytes <= 2 else 32


def gmm_default_tiling(
    *, element_bytes: int, compute_capability: int | None, accumulate: bool = False
) -> tuple[int, int, int]:
    """gmm's `(tm, tk, tn)` where the caller gives none: `_HOPPER_GMM_TILING` on sm_90
    for 16-bit inputs without `existing_out` (`accumulate`), else `DEFAULT_TILING`
    (with a quarter of its reduction step for 4-byte inputs)."""
    if compute_capability == 90 and element_bytes == 2 and not accumulate:
        return _HOPPER_GMM_TILING
    return (128, _reduction_step(element_bytes), 128)


def gmm_config(
    m: int,
    k: int,
    n: int,
    *,
    element_bytes: int,
    compute_capability: int | None,
    tiling: tuple[int, int, int] | None = None,
    accumulate: bool = False,
) -> GroupedMatmulConfig:
    """The launch configuration of `gmm_kernel` for `lhs: [m, k]`, `rhs: [g, k, n]`.

    Args:
      m, k, n: problem sizes.
      element_bytes: size of one input element (2 for bf16/fp16, 4 for fp32).
      compute_capability: target GPU (80, 90, ...), or None for the interpreter.
      tiling: `(tm, tk, tn)` to use instead of `gmm_default_tiling`; each entry is
        shrunk to its dimension (rounded up to a power of two) when larger.
      accumulate: the launch adds the product to `existing_out` (the kernel's
        ACCUMULATE), which only the default tiling depends on.
    """
    default = tiling is None
    if default:
        tiling = gmm_default_tiling(
            element_bytes=element_bytes,
            compute_capability=compute_capability,
            accumulate=accumulate,
        )
    tm, tk, tn = check_tiling(tiling)
    tiles = GroupedMatmulConfig(block_m=_fit(tm, m), block_k=_fit(tk, k), block_n=_fit(tn, n))
    if default:
        tiles = _pipelined(tiles, element_bytes, False, compute_capability)
    return dataclasses.replace(
        tiles,
        num_warps=_num_warps(tiles.block_m * tiles.block_n),
        num_stages=_num_stages(tiles.stage_bytes(element_bytes, False), compute_capability),
    )


# tgmm over a token-major lhs (the weight gradient) on Hopper at 16 bits, where the
# average group spans at most two of the default's 128-row steps (m <= 256 * num_groups:
# 8192 tokens over 64 experts): a program then runs one or two steps, so a deep pipeline
# buys little, and its shared memory (3 stages of 64 KB) holds the SM to one CTA of 4
# warps, whose load latency and epilogue nothing overlaps (the H100 measured tgmm at 355
# us against gmm's 258 for the same FLOPs at m 8192). 64-row steps at 2 stages take 64 KB
# and 166 registers: three CTAs per SM; 319 / 341 warp-instructions per MFLOP against
# 287 / 340 under Triton 3.6 / 3.9, no spill, not serialized. Not yet timed on a GPU.
_SHORT_GROUP_ROWS = 256
_SHORT_GROUP_TILING = (64, 128, 128)
_SHORT_GROUP_STAGES = 2
# Longer groups (the weight gradient of m 32768 over 32 experts: 1024 rows each) on
# Hopper, 16 bits, token-major lhs, no `existing_out`: the analogue of gmm's Hopper tile,
# a [128, 256] output tile (85 FLOP per operand byte against 64 at [128, 128]) in two
# warpgroups at 8 warps, 2 stages (192 KB). The default before ran [128, 128] at 4 warps,
# one warpgroup per SM (at 8 warps Triton 3.6 has ptxas serialize its wgmma; at 128x256
# it does not). Static report, m 32768, k 4096, n 2048, 3.6 / 3.9: 299 / 308
# warp-instructions per MFLOP against 303 / 346, no spill, not serialized. With
# `existing_out` the epilogue's float32 init tile spills (88-100 B): that launch keeps
# the default. Not yet timed on a GPU (the m 32768 row's op at tiling (128, 128, 128)
# runs every launch as before).
_HOPPER_TGMM_TILING = (128, 128, 256)


def _short_groups(m: int, num_groups: int | None) -> bool:
    return num_groups is not None and m <= _SHORT_GROUP_ROWS * num_groups


def tgmm_config(
    m: int,
    k: int,
    n: int,
    *,
    element_bytes: int,
    compute_capability: int | None,
    tiling: tuple[int, int, int] | None = None,
    lhs_token_major: bool = False,
    num_groups: int | None = None,
    accumulate: bool = False,
) -> GroupedMatmulConfig:
    """The launch configuration of `tgmm_kernel` for `lhs: [k, m]` (`[m, k]` when
    `lhs_token_major`: gmm's weight gradient), `rhs: [m, n]`.

    Same arguments as `gmm_config`; here `tm` is the reduction step and a program owns a
    `[tk, tn]` tile of one group's output. `num_groups`: the groups the launch computes,
    if known; `accumulate`: the launch adds to `existing_out`. The default tiling is
    `DEFAULT_TILING` (a quarter of its reduction step for 4-byte inputs), but on sm_90 for a
    16-bit token-major lhs: at most 256 rows per group (m / num_groups, m counting every
    row of lhs) take `_SHORT_GROUP_TILING` at 2 stages, longer ones (or unknown groups)
    without `accumulate` `_HOPPER_TGMM_TILING`. There a [128, 128] output tile or smaller
    takes 4 warps: at 8, Triton 3.6's code has ptxas serialize the warpgroup MMAs
    (C7515), and at 4 the loop is shorter too (bench report, m=8192 k=2048 n=1408: 410 ->
    336 warp-instructions per MFLOP under 3.6, 414 -> 360 under 3.9, no spill); the [k, m]
    layout spills at 4 warps (610 B).
    """
    hopper_token_major = lhs_token_major and compute_capability == 90 and element_bytes == 2
    default = (_reduction_step(element_bytes), 128, 128)
    short = False
    if tiling is None and hopper_token_major:
        short = _short_groups(m, num_groups)
        if short:
            default = _SHORT_GROUP_TILING
        elif not accumulate:
            default = _HOPPER_TGMM_TILING
    tm, tk, tn = check_tiling(tiling) if tiling is not None else default
    tiles = GroupedMatmulConfig(block_m=_fit(tm, m), block_k=_fit(tk, k), block_n=_fit(tn, n))
    if tiling is None:
        tiles = _pipelined(tiles, element_bytes, True, compute_capability)
    num_stages = _num_stages(tiles.stage_bytes(element_bytes, True), compute_capability)
    num_warps = _num_warps(tiles.block_k * tiles.block_n)
    if hopper_token_major and tiles.block_k * tiles.block_n <= 128 * 128:
        num_warps = 4
    return dataclasses.replace(
        tiles,
        num_warps=num_warps,
        num_stages=min(num_stages, _SHORT_GROUP_STAGES) if short else num_stages,
    )
