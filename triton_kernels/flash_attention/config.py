"""Launch configurations for the varlen flash attention kernels.

Pure Python (no JAX). One function, `default_attention_config`, maps (head_dim, dtype,
compute capability, kernel kind, the call's features) to block sizes, warps and pipeline
stages; callers may pass their own `AttentionKernelConfig` instead.
`compute_capability=None` means Triton's CPU interpreter, where small blocks keep tests
fast and still cross block boundaries.

The GPU defaults were chosen with `jax_bridge.launch.report.static_kernel_report`
(causal):

* bf16/fp16: at head_dim <= 128 the kernels spill no registers in their loops, and
  outside them at most a few bytes where every spill-free tile is slower
  (tests/attention/test_lowering.py lists each case, under Triton 3.6 and 3.9), and on sm_90 each
  kernel emits wgmma (Hopper warpgroup MMA); the report checks that a kernel uses it,
  not that every one of its matmuls does.
* float32: the package's default precision (HIGHEST) multiplies exactly, on CUDA cores
  (FMA; neither mma nor wgmma exists for exact fp32), so the float32 tables use small
  tiles spread over 8 warps: none of them spills at head_dim 64, 128 or 256. The same
  tiles serve the TF32 precisions (an opt-in through the op's `precision=`).
"""

from __future__ import annotations

import dataclasses

import triton

from triton_kernels.config import (
    MIN_BLOCK,
    KernelConfig,
    multiplies_by_mma_sync,
    pipeline_buffers,
)

KINDS = ("forward", "backward_dkdv", "backward_dq")
"""The kernels a config is for: the forward, the key-stationary dK/dV kernel, the dQ kernel."""


@dataclasses.dataclass(frozen=True)
class StreamedTiles:
    """What one kernel streams tile by tile through its loop (the rest stay put a
    program): the tiles `tma` and `host_descriptors` load.

    Attributes:
      parameters: the two kernel parameters streamed (arrays [rows, heads, head_dim]).
      rows: the config field that gives a streamed tile's rows.
    """

    parameters: tuple[str, str]
    rows: str


STREAMED_TILES = {
    "forward": StreamedTiles(("k_ptr", "v_ptr"), "block_n"),
    "backward_dq": StreamedTiles(("k_ptr", "v_ptr"), "block_n"),
    "backward_dkdv": StreamedTiles(("q_ptr", "d_out_ptr"), "block_m"),
}

# What `AttentionKernelConfig.shared_memory_bytes` adds to the operand tiles: the
# scratch of row reductions across warps (float32 tiles: a float a row) and, on sm_90,
# the pipeline's barriers and the alignment of dK/dV's row-stat buffers (up to 0.5 KiB).
_REDUCTION_AND_BARRIER_BYTES = 512

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class AttentionKernelConfig(KernelConfig):
    """One launch configuration of one attention kernel.

    Attributes:
      block_m: query rows per tile. The forward and dQ kernels own one such tile per
        program; the dK/dV kernel steps through query tiles of this size.
      block_n: key rows per tile. The dK/dV kernel owns one such tile per program; the
        forward and dQ kernels step through key tiles of this size.
      num_warps, num_stages: GPU launch configuration (ignored by the interpreter).
      tma: the kernel loads the tiles its loop streams (the forward and dQ kernels: K and
        V; dK/dV: Q and dO) through device-side tensor descriptors (Hopper's bulk tensor
        copies, sm_90 and up; the interpreter runs them too). Needs a head_dim that is a
        power of two. The default tables take it for Hopper's dK/dV only
        (`_HOPPER_DKDV_TMA`): on an H100 all three at their default tiles ran slower with
        it (forward 5%, fwd+bwd 3-12%).
      warp_specialize: the forward's key loop, or dK/dV's query loop, warp-specialized
        (needs `tma` and 4 warps; a config for every kernel gives it to the forward only;
        `AttentionConfigs` refuses it for dQ, and for dK/dV with `dq_atomic` or a
        `block_m` over 64): Triton gives the streamed tiles' copies to a producer
        warpgroup and the rest to two consumer warpgroups of half the stationary tile's
        rows each (`block_m / 2` queries in the forward, `block_n / 2` keys in dK/dV; on
        Hopper the kernel runs 12 warps), FlashAttention-3's split, but in one loop whose
        every tile is masked (`forward._forward_keys` says why). An A/B option for 16-bit
        inputs on Hopper, off by default: not yet timed on a GPU (`python -m bench
        gpu-check --warp-specialized`, `--warp-specialized-dkdv`). Where Triton does not
        partition the loop, the kernel runs it unspecialized: a persistent launch (past
        60 sequences) at 8 warps (`attention_num_warps`), float32 inputs and 16-row tiles
        at the 4 warps asked (float32 tiles this large spill whatever the warps: its
        defaults are 32x16 and 16x32).
      overlap_softmax: the kernel issues a wgmma its exp2s do not need before them, so
        that it runs beside them (FlashAttention-3's intra-warpgroup overlap). The
        forward: each unmasked key tile's QK^T before the previous tile's softmax
        (`forward._overlapped_key_tiles`; the default loop waits for QK^T, then computes
        the softmax, the tensor cores idle); it holds a second tile of scores in
        registers: ptxas keeps the overlap at 128x64 tiles and 8 warps by pointers
        (`OVERLAPPED_FORWARD_TILE`), not at 128x128 (spills), 4 warps, with `tma`, nor
        in the persistent launch (SASS, sm_90, Triton 3.6 and 3.9). dK/dV: each query
        tile's dP = V dO^T before P's exp2s (`steps._dkdv_products`): at 32x128 by
        pointers 16 / 11 of 16 exp2s beside it (3.6 / 3.9), at 64x128 with `tma` it
        spills. Not for dQ (its exp2s already run beside dP; refused), exclusive with
        `warp_specialize`; off by default: not yet timed on a GPU (A/B rows of `python
        -m bench gpu-check`). The block-sparse kernels take it too, with the same steps:
        the forward over its full tiles (`block_sparse.forward._overlapped_full_tiles`),
        dK/dV over every tile; at these tiles (sm_90, d=128, causal) the forward issues
        34 / 34 exp2s beside the next QK^T under Triton 3.6 and 3.9, dK/dV 16 / 16
        beside dP under 3.6 (also assembled by CUDA 13.0's ptxas, as on the device) and
        none from 3.9's code, where ptxas waits for dP first.
      host_descriptors (with `tma`): the streamed tiles (the forward's and dQ's K and V,
        dK/dV's Q and dO) through descriptors the launch encodes over the whole arrays
        (`jax_bridge.launch.host_descriptors`: on a GPU jaxlib >= 0.11.2; Triton's
        interpreter anywhere), instead of two a tile that each program writes to global
        memory and fences: the unmasked tiles lie inside their sequence and load as they
        are, the masked ones zero the rows past it in registers (`forward._key_rows`,
        which the forward's and dQ's key loops call; dK/dV's query loop). dK/dV with
        `dq_atomic` still builds each sequence's dQ descriptor itself: its bulk
        reductions must stop at the sequence's last row. Why the forward with `tma` ran
        5% slower than by pointers on an H100 is not known; this takes the per-tile
        descriptor work away. Off by default: not yet run on a GPU (the A/B rows of
        `gpu-check --host-descriptors`). Excludes `warp_specialize` (whose loop masks
        every tile).
      head_major: dK/dV only: the kernel accumulates dK^T = Q^T dS and dV^T = dO^T P,
        `[head_dim, block_n]` tiles, where it would accumulate dS^T Q and P^T dO
        (FlashAttention-3's swapped dK/dV products; `steps._dkdv_step`). The products'
        rows are then the head dim, which a CTA's warpgroups split without repeating
        one (Triton's layouts repeat a product whose 64 rows one warpgroup covers in
        every warpgroup: 1.5x the tile's work at 64 keys and 8 warps), at the cost of
        P and dS staged through shared memory as the MMAs' second operands. The Hopper
        default at head dims 129-256 (`HEAD_MAJOR_DKDV_TILE`), the block-sparse dK/dV's
        too; elsewhere it loses (sm_80's mma.sync tiles repeat more). Refused in the
        forward's and dQ's configs; excludes `warp_specialize`.

    Validated by `KernelConfig` (blocks: powers of two >= 16).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False
    warp_specialize: bool = False
    overlap_softmax: bool = False
    host_descriptors: bool = False
    head_major: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_major and self.warp_specialize:
            raise ValueError(
                "AttentionKernelConfig: head_major and warp_specialize exclude each other "
                "(the head-major dK/dV loop is not partitioned)."
            )
        if self.overlap_softmax and self.warp_specialize:
            raise ValueError(
                "AttentionKernelConfig: overlap_softmax and warp_specialize exclude each "
                "other (a warp-specialized kernel runs one loop over every tile, masked)."
            )
        if self.host_descriptors and (not self.tma or self.warp_specialize):
            raise ValueError(
                "AttentionKernelConfig: host_descriptors=True needs tma=True and excludes "
                f"warp_specialize=True, got tma={self.tma}, "
                f"warp_specialize={self.warp_specialize}."
            )

    def descriptor_box(self, kind: str, head_dim: int) -> tuple[int, int]:
        """The box kernel `kind` loads its streamed tiles in through the launch's
        descriptors (`host_descriptors`) over [rows, heads x head_dim]: one head of a key
        tile (the forward's and dQ's K and V), or of a query tile (dK/dV's Q and dO)."""
        check_kind(kind)
        return getattr(self, STREAMED_TILES[kind].rows), head_dim

    def shared_memory_bytes(
        self, kind: str, head_dim: int, element_bytes: int, compute_capability: int | None
    ) -> int:
        """Shared memory one CTA of kernel `kind` takes, launched by pointers, estimated:
        its stationary operand tiles (the forward's Q; dQ's Q and dO; dK/dV's K and V;
        each `[rows, block_d(head_dim)]`), `pipeline_buffers` of the two tiles its loop
        streams (dK/dV's with their float32 log-sum-exp and delta rows) and, where the
        products run on mma.sync (`multiplies_by_mma_sync`: on sm_90-119 too under 64
        stationary rows) with fewer stationary rows than `block_d`, one `[rows, step]`
        tile of scores: Triton spreads the warps over the head dim there, and P (dS) goes
        to the next product through shared memory.

        Against the static report's allocation at the tuning grid's tiles, at 2 to 4
        stages: at most 1 KiB above it, never below (bf16; Triton 3.9: sm_80 and sm_120 at
        d=128, sm_86 at d=64/128/256, sm_90 at d=128/256; 3.6: sm_86 at d=64/128/256,
        sm_90 at d=128; float32, 3.9, sm_86 and sm_90 at d=128). float32 tiles of 64 rows
        or more on sm_90 count a buffer a stage, as wgmma keeps them (TF32): their exact
        products run on CUDA cores, which keep one fewer. At 1 stage dK/dV on mma.sync
        allocates more than the estimate: up to 7 KiB at d=128, 23 KiB at d=256.
        Descriptors, warp specialization and `dq_atomic` add barriers and staging that
        this leaves out. `head_major` dK/dV: an upper bound (d=256, sm_90: 9 KiB above
        the report at `HEAD_MAJOR_DKDV_TILE`, 19 KiB at 16x64 and two stages, where
        Triton shares buffers this counts apart)."""
        check_kind(kind)
        d = block_d(head_dim)
        streamed = getattr(self, STREAMED_TILES[kind].rows)
        stationary = self.block_n if kind == "backward_dkdv" else self.block_m
        stage = 2 * streamed * d * element_bytes
        if kind == "backward_dkdv":
            stage += 2 * streamed * 4
        fixed = (1 if kind == "forward" else 2) * stationary * d * element_bytes
        fixed += _REDUCTION_AND_BARRIER_BYTES
        # The stationary rows are the products' M: below 64, mma.sync on sm_90-119 too.
        if self.head_major and kind == "backward_dkdv":
            # P and dS staged as the MMAs' second operands; at one stage Q and dO are
            # stored in both orientations.
            fixed += 2 * stationary * streamed * element_bytes + (self.num_stages == 1) * stage
        elif multiplies_by_mma_sync(compute_capability, stationary) and stationary < d:
            fixed += stationary * streamed * element_bytes
        buffers = pipeline_buffers(self.num_stages, compute_capability, stationary)
        return fixed + buffers * stage


# The forward with `overlap_softmax` on Hopper, the A/B row of `python -m bench
# gpu-check` until a GPU has timed it: (block_m, block_n, num_warps, num_stages), the
# tile and depth of FlexAttention's H100 forward (the three-stage A/B row's, without the
# overlap). Static report, sm_90, bf16, d=128, causal, Triton 3.6 / 3.9: the unmasked
# loop issues all 34 of its MUFUs while the next tile's QK^T wgmma is in flight (none
# without the overlap, nor in the 128x128 default), 690 / 711 warp-instructions per
# MFLOP against 637 / 694 without it and 495 / 527 for the default; no spill, not
# serialized (128x128 with the overlap spills 132 / 40 B; by descriptors (`tma`) or at
# 4 warps ptxas issues no exp2 beside the MMA).
OVERLAPPED_FORWARD_TILE = (128, 64, 8, 3)
# dK/dV with `overlap_softmax` (dP issued before P's exp2s), the A/B row's: the tile
# dK/dV takes by pointers on Hopper (calls without a right bound, or without descriptors),
# 32x128 at 8 warps and two stages. Static report, sm_90, bf16, d=128, causal, Triton 3.6
# / 3.9: 16 / 11 of the loop's 16 exp2s beside dP's wgmma in flight (none without it),
# 494 / 530 warp-instructions per MFLOP against 492 / 528, no spill, not serialized.
# (The Hopper default for light causal calls, 64x128 with `tma`, spills with it: 76-280 B.)
OVERLAPPED_DKDV_TILE = (32, 128, 8, 2)
# The warp-specialized forward (`warp_specialize`, with `tma`), the A/B row's and the
# tuner's candidate: a producer warpgroup and two consumers of 64 query rows over
# 128-key steps, two stages (176 KiB). Static report, sm_90, d=128, bf16: 12 warps, no
# spill, not serialized, no barrier of the whole CTA in the consumers' loop.
WARP_SPECIALIZED_FORWARD_TILE = (128, 128, 4, 2)
# dK/dV warp-specialized, the A/B row's and the tuner's candidate: a producer warpgroup
# copying Q and dO, two consumers of 64 keys each over 64-query steps, two stages (144
# KiB). Static report, sm_90, d=128, bf16, causal, Triton 3.6 / 3.9: 12 warps, the
# consumers' loop 534 / 527 warp-instructions per MFLOP (every tile masked) against
# 360 / 341 for the default's unmasked loop (64x128, 8 warps, `tma`; its masked loop
# 657), no barrier of the whole CTA in it (the default's: 4 / 6 a tile), not serialized;
# under 3.6 12 B spilled and 64 B reloaded (one reload a step; the default: 20 / 24 B),
# nothing under 3.9. Three stages spill more under 3.6; 32-query steps spill nothing but
# run 620.
WARP_SPECIALIZED_DKDV_TILE = (64, 128, 4, 2)
# dK/dV's longest warp-specialized query step: at 128 (with 64- or 128-key tiles) Triton
# 3.6's and 3.9's partitioning passes fail (sm_90); 16 to 64 compile.
MAX_WARP_SPECIALIZED_DKDV_ROWS = 64
# The backward's kernels at one warpgroup a CTA, with `tma`, the A/B row's: dK/dV and dQ
# at 64x64, 4 warps, two stages, two CTAs an SM (97 KiB of shared memory each). The
# 8-warp defaults' loops take 2-6 barriers of the whole CTA a tile (Triton's pipeline:
# before reading what its copies wrote, before refilling a stage; more with `tma`), each
# holding their two warpgroups in step, so neither's exp2s run beside the other's MMAs;
# two CTAs of one warpgroup are held by none, at twice the reads of the streamed tiles
# (Q and dO for dK/dV, K and V for dQ). Static report, sm_90, bf16, d=128, causal,
# Triton 3.6 / 3.9, warp-instructions per MFLOP: dK/dV 360 / 338 (the default where
# descriptors launch, 64x128 with `tma`: 360 / 341), dQ 351 / 374 (the default, 128x64 by
# pointers: 359 / 422; with `tma`: 352 / 379); no spill in the loops.
TWO_CTA_BACKWARD_TILE = (64, 64, 4, 2)
# The forward and dQ at one warpgroup a CTA and one stage, the A/B rows' and the tuning
# grid's: 64 query rows into 128-key steps, 4 warps, two CTAs an SM (forward 80 KiB, dQ
# 96 KiB). At one stage Triton pipelines nothing: each step loads its K and V tiles at
# its top (plain global loads into registers, then stores to shared memory; SASS: 32
# LDG, 32 STS) and waits for them, so nothing of its own hides them: the other CTA's
# loop may. In exchange, under Triton 3.6 (the H100 machine's), the 128-key step runs
# fewer warp-instructions per MFLOP than the 8-warp defaults in the forward and dQ, where
# two CTAs at 64x64 and two stages run more; under 3.9 dQ does, the forward does not
# (nor the block-sparse forward under either). Static report, sm_90, bf16, d=128,
# causal, Triton 3.6 / 3.9: forward 467 / 614 (the default, 128x128 at 8 warps and two
# stages: 495 / 527; 64x64 at two stages: 669 under 3.6; 3.9's extra instructions are
# the loads' address arithmetic, 106 IMAD an iteration against 11: its PTX carries each
# row's pointer as a 64-bit induction variable of its own, where 3.6's keeps one base
# and ptxas folds the rows into immediate offsets; the cause is the masked key loop
# reading through the same hoisted row offsets as the unmasked one: a masked loop
# addressing its rows from the sequence's row 0 instead gives 499 under 3.9, but the two
# sequence bases it keeps live spill 16 of the default variants, so it is not taken;
# Triton 3.9 has no block pointers), dQ 291 / 305 (the default, 128x64:
# 359 / 422), the block-sparse forward 539 / 564 (its default 504 / 526); no spill in
# the loops (outside them dQ 48 / 4 B, 28 / 0 B without a right bound; the forward
# without one 8 / 0 B). By descriptors (`tma`: a bulk copy a tile for a thread's 32
# loads and 32 stores; the --tma A/B rows, the grid where descriptors launch): forward
# 458 / 487, dQ 279 / 297, no spill in the loops. A persistent walk (many documents):
# forward 471 against 492 under 3.6; under 3.9 its dQ spills in the loop, so the tuning
# grid leaves persistent launches out. Each reads K and V twice as often as the default.
ONE_STAGE_TWO_CTA_TILE = (64, 128, 4, 1)
# dK/dV at head dims 129-256 on Hopper (`head_major`, by pointers): 32 query rows into
# 64-key tiles at 8 warps and one stage (128 KiB). Key-major, every wgmma tile there
# either repeats K Q^T and V dO^T in both warpgroups (16x64, the default until
# 2026-12-08: 1.5x the tile's work, 1690 / 2361 warp-instructions per MFLOP of it under
# Triton 3.6 / 3.9, causal) or spills in its loop; head-major, each product runs once,
# and no loop spills under 3.6 or 3.9: causal 629 / 645, not causal 633 / 645, a soft cap
# 881 / 938, ALiBi 732 / 761, a left window 633 / 645, all three 984 / 1059 (GQA 4; MHA
# 612 / 628 causal), persistent 648 / 666; 0 B outside the loops but 8 B with all three
# options and MHA under 3.6. (sm_90, bf16, `python -m bench report`'s compile.) Two
# stages spill at 32 rows (304 B); 16x64 at two stages holds (908 / 957 causal), and
# so does the old tile's mma.sync rival, 64x32 key-major (788 / 797): the d=256 row's
# A/B anchors. One stage loads each step's Q and dO unprefetched, which the count cannot
# price.
HEAD_MAJOR_DKDV_TILE = (32, 64, 8, 1)
# ... and with `AttentionConfigs.dq_atomic` (`_HOPPER_HEAD_MAJOR_DKDV`), two stages.
HEAD_MAJOR_DQ_ATOMIC_TILE = (16, 64, 8, 2)


@dataclasses.dataclass(frozen=True)
class AttentionFeatures:
    """The options of a call that change the kernels' code, hence their best tiles.

    `causal` and `window_right` bound keys on the right (both compile the same masking);
    `window_left`, `soft_cap` and `alibi` add per-score arithmetic and registers.
    """

    causal: bool = False
    window_left: bool = False
    window_right: bool = False
    soft_cap: bool = False
    alibi: bool = False
    sinks: bool = False

    @property
    def bounded_right(self) -> bool:
        """Keys bounded on the right (causal is a right window of 0): a query tile's work
        grows with its index, and both compile the same masking (HAS_WINDOW_RIGHT)."""
        return self.causal or self.window_right

    @property
    def heavy_options(self) -> tuple[str, ...]:
        """The register-heavy options on, by name, sorted: score arithmetic beyond the
        scale and a right bound (ALiBi's |i - j| term, the tanh of a soft cap and its
        gradient, a second window bound)."""
        return tuple(name for name in ("alibi", "soft_cap", "window_left") if getattr(self, name))

    @property
    def register_heavy(self) -> bool:
        """Any of `heavy_options` on."""
        return bool(self.heavy_options)

    def kernel_flags(self) -> dict[str, bool]:
        """The constexpr switches every attention kernel takes (the forward also takes
        HAS_SINKS). Causal is a right window of 0, so both set HAS_WINDOW_RIGHT."""
        return dict(
            HAS_WINDOW_LEFT=self.window_left,
            HAS_WINDOW_RIGHT=self.bounded_right,
            HAS_SOFT_CAP=self.soft_cap,
            HAS_ALIBI=self.alibi,
        )

    def describe(self) -> str:
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "+".join(on) if on else "plain"


@dataclasses.dataclass(frozen=True)
class AttentionConfigs:
    """The launch configurations of the three attention kernels; None: the default.

    `dq_atomic`: the backward accumulates dQ inside the dK/dV kernel, by float32 atomic
    adds (FlashAttention-2's backward), instead of running the dQ kernel: two of a tile
    pair's seven products fewer, for the atomics' traffic, a float32 dQ buffer and a pass
    that writes the row statistics; `backward_dq` is then unused. The float32 sums of dQ
    then run in an order that varies between runs (dK and dV stay deterministic). With
    `tma` in `backward_dkdv` a step's dQ share goes out as one bulk tensor reduction
    (Hopper's TMA adds the tile into dQ in L2; the copy engine leaves the rows past the
    sequence alone) instead of every thread's vector atomics (`DQ_REDUCE_DKDV_TILE`).

    Refused here, where the configs are built rather than when a gradient is first traced:
    `warp_specialize` and `overlap_softmax` in `backward_dq` (its exp2s already run beside
    its dP), `head_major` in `forward` and `backward_dq` (a dK/dV option), and a
    warp-specialized `backward_dkdv` with `dq_atomic` (Triton cannot partition the atomic
    adds) or with a `block_m` over `MAX_WARP_SPECIALIZED_DKDV_ROWS`.
    """

    forward: AttentionKernelConfig | None = None
    backward_dkdv: AttentionKernelConfig | None = None
    backward_dq: AttentionKernelConfig | None = None
    dq_atomic: bool = False

    def __post_init__(self):
        for kind in KINDS:
            config = getattr(self, kind)
            if config is not None and not isinstance(config, AttentionKernelConfig):
                raise TypeError(
                    f"AttentionConfigs.{kind} must be an AttentionKernelConfig or None, "
                    f"got {type(config).__name__}"
                )
        if not isinstance(self.dq_atomic, bool):
            raise TypeError(
                f"AttentionConfigs.dq_atomic must be a bool, got {type(self.dq_atomic).__name__}"
            )
        self._check_options()

    @classmethod
    def for_every_kernel(cls, config: AttentionKernelConfig) -> AttentionConfigs:
        """One config for all three kernels, each taking the options it runs: warp
        specialization is the forward's alone (and dK/dV's at a tile of its own), the
        softmax overlap the forward's and dK/dV's (the dQ kernel's exp2s already run
        beside its dP), `head_major` dK/dV's alone."""
        if not isinstance(config, AttentionKernelConfig):
            raise TypeError(
                "AttentionConfigs.for_every_kernel takes an AttentionKernelConfig, got "
                f"{type(config).__name__}."
            )
        forward = config.replace(head_major=False)
        dkdv = config.replace(warp_specialize=False)
        dq = config.replace(warp_specialize=False, overlap_softmax=False, head_major=False)
        return cls(forward, dkdv, dq)

    def _check_options(self) -> None:
        """ValueError naming the kernel for an option its kernel cannot run (class doc)."""
        dq, dkdv = self.backward_dq, self.backward_dkdv
        for option in ("warp_specialize", "overlap_softmax"):
            if dq is not None and getattr(dq, option):
                raise ValueError(
                    f"AttentionConfigs: {option}=True is for the forward and dK/dV kernels' "
                    f"configs only, got it in the backward_dq kernel's"
                )
        for kind in ("forward", "backward_dq"):
            config = getattr(self, kind)
            if config is not None and config.head_major:
                raise ValueError(
                    f"AttentionConfigs: head_major=True is for the backward_dkdv kernel's "
                    f"config only, got it in the {kind} kernel's"
                )
        if dkdv is None or not dkdv.warp_specialize:
            return
        if self.dq_atomic:
            raise ValueError(
                "AttentionConfigs: warp_specialize=True in the backward_dkdv kernel's config "
                "excludes dq_atomic=True (Triton cannot partition a loop of atomic adds)"
            )
        if dkdv.block_m > MAX_WARP_SPECIALIZED_DKDV_ROWS:
            raise ValueError(
                f"AttentionConfigs: warp_specialize=True in the backward_dkdv kernel's config "
                f"needs block_m <= {MAX_WARP_SPECIALIZED_DKDV_ROWS} (Triton's partitioning "
                f"fails on longer query steps), got block_m={dkdv.block_m}"
            )


def check_kind(kind: str) -> None:
    """ValueError unless `kind` is one of `KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def block_d(head_dim: int) -> int:
    """The head-dim tile: the next power of two (>= 16); the kernel masks the padding."""
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


def row_stats_config(head_dim: int, compute_capability: int | None) -> AttentionKernelConfig:
    """The launch of `attention_backward_row_stats_kernel` (a pass over O and dO, no
    matmul): 8192 elements of each a program on a GPU (64 rows at head_dim 128), 16 rows
    in the interpreter. block_n is unused."""
    if compute_capability is None:
        return AttentionKernelConfig(MIN_BLOCK, MIN_BLOCK, num_warps=4, num_stages=1)
    rows = max(MIN_BLOCK, 8192 // block_d(head_dim))
    return AttentionKernelConfig(rows, MIN_BLOCK, num_warps=4, num_stages=1)


# (block_m, block_n, num_warps, num_stages) by kind and head-dim tile (64 covers head
# dims up to 64, 128 up to 128, 256 up to 256), for 2-byte inputs. Chosen with
# `static_kernel_report` at bf16: none spills at head_dim <= 128 (causal, and with every
# option on), and on sm_90 each kernel uses wgmma.
# Forward: a 128-row query tile is two Hopper warpgroups of m64 at 8 warps; K and V tiles
# are streamed through `num_stages` shared-memory buffers.
# dK/dV: the key tile is stationary (dK, dV accumulate in registers all program long; on
# sm_90 K and V stay in shared memory as wgmma operands), so it is the large one (m64 per
# warpgroup on sm_90); the query tile it streams is small. Hopper d=128 fits 32x128 with
# every option on since the kernel walks (query tile, head) pairs in one loop and reads
# lse in log2 units (bench report, bf16 causal: 828 -> 540 warp-instructions per MFLOP).
# At d=256 its 16x64 computes K Q^T and V dO^T in both warpgroups (1.5x the tile's work)
# and spills 120-232 B; every wgmma tile without repeats spills in its loop. 64x32 at 8
# warps (m16 a warp: mma.sync) runs each product once, spill-free under Triton 3.6 and
# 3.9 (causal or not, a soft cap, a window; GQA 1, 3, 4; either launch; with ALiBi under
# 3.9 16-24 B, 4 accesses in the loop), at 788 / 797 warp-instructions per MFLOP of the
# tile's work against 1690 / 2361 (causal); since mma.sync peaks at about half
# wgmma's rate on an H100, which the count cannot price, it is gpu-check's A/B. On sm_90
# the d=256 dK/dV default is head-major (`HEAD_MAJOR_DKDV_TILE`, 629 / 645): this
# table's 16x64 is sm_100's.
# dQ: the mirror image (Q, dO, dQ stationary, key tiles streamed). At 8 warps a Hopper
# kernel's stationary tile wants 128 rows, m64 for each of its two warpgroups: dQ at d=256
# took 64x32 until 2026-12-06, whose two warpgroups each computed all of QK^T and dO V^T
# (64 m64n16 wgmma a key step, SASS, Triton 3.6 and 3.9): 5/3 of the tile's tensor-core
# work (`KernelReport.mma_redundancy`). 128x32 (192 KiB of shared memory) does it once and
# spills nothing in any loop under Triton 3.6 and 3.9, causal or not, with each
# register-heavy option and all of them, GQA 1, 3 and 4, a program a tile or persistent
# (outside the key loops: none under 3.6; under 3.9 a persistent walk 12-88 B, once a
# tile). Key loop, warp-instructions per MFLOP of the tile's work, 3.6 / 3.9: causal 1035
# -> 328 / 1607 -> 510, soft cap 1628 -> 621 / 2200 -> 790, ALiBi 1208 -> 448 / 1757 ->
# 615. sm_100 keeps 64x32 (`_BLACKWELL_OVERRIDES`).
_Table = dict[str, dict[int, tuple[int, int, int, int]]]
_HOPPER_16BIT: _Table = {
    "forward": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3), 256: (128, 32, 8, 2)},
    "backward_dkdv": {64: (32, 128, 8, 3), 128: (32, 128, 8, 2), 256: (16, 64, 8, 3)},
    "backward_dq": {64: (128, 32, 8, 3), 128: (128, 32, 8, 2), 256: (128, 32, 8, 2)},
}
# sm_80..89: mma.sync tiles hold more per thread, so the head-dim-128 tiles are halved.
# dK/dV at d=256 took 16x64 at 8 warps until 2026-12-06, whose warps computed K Q^T and V
# dO^T four times over (64 keys where 8 warps of m16 cover 128; 2.5x the tile's work,
# `KernelReport.mma_redundancy`). 32x32 at 4 warps computes each product once, at 66 KiB
# and 255 registers two CTAs an SM (8 warps, as before); loop, per MFLOP of the tile's
# work, Triton 3.6 / 3.9: causal 1896 -> 788 / 1877 -> 772, soft cap 2945 -> 1091 / 2914
# -> 1066. No spill in its loop with 2, 3 or 4 query heads a kv head, causal or not, with
# each register-heavy option and all of them, a program a tile or persistent (0-24 B
# outside it), but under 3.9 at one query head a kv head without options: 2-4 local
# accesses an iteration (one stage spills none there, but loads each step unprefetched).
# The kernel that adds dQ too (`dq_atomic`) keeps 16x64 (`_AMPERE_DQ_ATOMIC_DKDV`).
# dK/dV at d=128 steps 64 query rows where it stepped 32 (64x64, 72 KiB; 32x64 at 8 warps
# repeated part of its products, 1.5x the tile's work), for every call: it had been
# sm_80's light calls' tile. No spill in its loop under Triton 3.6 and
# 3.9, on sm_80, sm_86/89 and sm_120, causal or not, with sinks, a right window, each
# register-heavy option and all of them, 1 or 4 query heads a kv head, a program a tile
# or persistent; outside it at most 8 B (sm_120 with a soft cap, persistent: 20-28 B).
# Warp-instructions per MFLOP of the tile's work, sm_80 / sm_86, 3.6 and 3.9 within 4%:
# causal 1335 -> 816 (sm_86; sm_80's light calls took it already), a left window 1335 ->
# 814, soft cap 2201 -> 1247, ALiBi 1705 -> 1015 / 1724 -> 1028, all three 2590 -> 1453 /
# 2632 -> 1472.
# Three stages where two were: on these mma.sync GPUs Triton keeps one shared-memory
# buffer fewer than the stages, and at two each K / V / Q / dO copy is issued after the
# MMAs of its step and awaited at the top of the next (TTGIR: `async_wait` of 0 copies
# left in flight; `triton_kernels.config.pipeline_buffers`), so no load overlaps the
# loop's MMAs; at three one step's copies stay in flight. Triton's own attention
# tutorial tries 3, 4 and 7 stages on NVIDIA GPUs, never 2. No spill in the
# loop on sm_80 under 3.6 and 3.9 (causal or not, sinks, a right window, each register-
# heavy option and all of them, GQA 1 or 4, either launch; outside it at most 8 B).
# Warp-instructions per MFLOP of the tile's work, 3.6 / 3.9, causal, two stages -> three:
# dK/dV d=64 942 -> 1068 / 877 -> 1003 (48 KiB), d=128 814 -> 849 / 784 -> 820 (105 KiB),
# dQ d=128 684 -> 768 / 684 -> 783 (96 KiB): the price of the copies in flight. The
# 99 KiB GPUs take three too but for dK/dV at d=128 (three do not fit; 64x32 at three,
# 85 KiB, spills in no loop with any option, GQA 1 or 4, either launch, under 3.6 and
# 3.9, but runs 24-26% more warp-instructions per MFLOP: not taken untimed). Their register-
# heavy calls spill a few bytes a thread there, never in a loop: dK/dV at d=64 up to 28
# B (80 B persistent) under 3.6 on sm_86, 8 B under 3.9; dQ at d=128 none on sm_86, on
# sm_120 under 3.9 a persistent walk with a soft cap, ALiBi and a left window 60 B (two
# stages: 32), a left window alone 8 B. Those are stored and reloaded once a tile; the
# two stages they took kept no copy in flight, one CTA an SM (8 warps of 255
# registers), so nothing overlapped a load. Persistent walks with the register-heavy
# options take three too, where they took fewer (until 2026-12-07): the forward at d=64
# two (with three, a soft cap spills 44 B under 3.6 on sm_80, 36 B on sm_86, outside
# the loop; none under 3.9) and dQ at d=128 one, which issues no asynchronous copy at
# all (with three, none spilled on sm_80 or sm_86, either Triton).
# At d=256 sm_80 keeps two stages for the forward (64x32, 68 KiB) and dK/dV (32x32, 66
# KiB): two CTAs share an SM there, so one's MMAs run while the other awaits its copy
# (at three, 100 and 98 KiB, one CTA would). Its dQ steps 32 query rows at 4 warps where
# it stepped 64 at 8 (100 KiB, one CTA an SM), whose warps computed QK^T and dO V^T over
# again (5/3 of the tile's work): 66 KiB, two CTAs an SM, loop 1152 -> 806 / 1152 -> 849
# per MFLOP (3.6 / 3.9, causal), none spilled in it (causal or not, sinks, a right window,
# each register-heavy option and all of them, GQA 1 or 4, either launch; outside it at
# most 16 B).
_AMPERE_16BIT: _Table = {
    "forward": {64: (128, 64, 8, 3), 128: (128, 32, 8, 3), 256: (64, 32, 4, 2)},
    "backward_dkdv": {64: (32, 128, 8, 3), 128: (64, 64, 8, 3), 256: (32, 32, 4, 2)},
    "backward_dq": {64: (128, 32, 8, 3), 128: (128, 32, 8, 3), 256: (32, 32, 4, 2)},
}
# sm_86/89 and sm_120 have 99 KiB of shared memory per block (sm_80: 163 KiB, sm_90: 227
# KiB), one CTA an SM at d=256 whatever the tile, so two stages kept no copy in flight
# there: they take tiles of 32 query rows at three, none spilled in a loop under Triton
# 3.6 or 3.9 on sm_86 or sm_120 (causal or not, sinks, a right window, each register-
# heavy option and all of them, GQA 1 or 4, either launch). Per MFLOP of the tile's work
# on sm_86, causal, 3.6 / 3.9:
# - the forward 32x32 (82 KiB), where 64x32 at two spilled in its loop (sm_86 under 3.6,
#   8-10 accesses; sm_120 under 3.9, 13-17): 1390 -> 1640 / 1404 -> 1625;
# - dQ 32x32 (98 KiB), where 64x16 at 4 warps computed QK^T and dO V^T over again (5/3
#   of the tile's work): 1177 -> 913 / 1157 -> 910; outside the loop up to 88 B (sm_86,
#   ALiBi, persistent, 3.9);
# - dK/dV 32x16 (81 KiB), where 16x32 repeated part of its products (1.5x the tile's
#   work): 1255 -> 1251 / 1221 -> 1186 (32x32 at three, 837 / 811, spills in its loop
#   with ALiBi under 3.6 on sm_86, and under 3.9 on sm_120). The dK/dV that adds dQ
#   takes it too (no table of its own here): none spilled in a loop, where 16x32 did on
#   sm_120 under 3.9, but its atomic adds, a [32, 256] share of dQ every 16 keys, cost
#   more a FLOP than 16x32's [16, 256] every 32: 1740 -> 2304 / 1508 -> 1849.
_SMALL_SHARED_MEMORY_OVERRIDES: _Table = {
    "forward": {256: (32, 32, 4, 3)},
    "backward_dkdv": {128: (64, 64, 8, 2), 256: (32, 16, 4, 3)},
    "backward_dq": {256: (32, 32, 4, 3)},
}
# Calls without the register-heavy score options (`AttentionFeatures.register_heavy`):
# the forward fits a 128x128 tile (two m64 warpgroups, a 128-key step) and dQ a 128x64
# one without spills, which amortise the softmax and address arithmetic over twice the
# matmul work. `python -m bench report` (bf16, causal, d=128, sm_90), warp-instructions
# of the inner loop per MFLOP: forward 694 -> 527, dQ 610 -> 417; Hopper dK/dV at d=64
# takes 64x128 (904 -> 650 at d=64). With a soft cap, ALiBi and a left window these
# tiles spill, so heavy calls keep the tables above, but where `_HEAVY_LIGHT` lists
# them. sm_80 gains too (forward 1301 -> 845); its dQ at d=128 spills at 128x64. Other
# architectures keep the tables above. At d=256 (head dims 129-256) the Hopper forward
# takes 64-key steps where it took 32 (192 KiB of shared memory): loop 729 -> 443 / 835
# -> 528 under Triton 3.6 / 3.9 (causal, with sinks or a right window alike; not causal
# 706 -> 460 / 772 -> 508), none spilled in the loop, 0 / 16-20 B between loops. Its
# persistent walk keeps 32 (88-260 B of spill with 64).
_HOPPER_16BIT_LIGHT: _Table = {
    "forward": {64: (128, 128, 8, 2), 128: (128, 128, 8, 2), 256: (128, 64, 8, 2)},
    "backward_dkdv": {64: (64, 128, 8, 2)},
    "backward_dq": {64: (128, 64, 8, 2), 128: (128, 64, 8, 2)},
}
# sm_80's light calls at 3 stages too (above): the forward at d=64 128x128 (80 KiB;
# 3.6 / 3.9, causal, 1133 -> 1181 / 1133 -> 1200 per MFLOP), at d=128 128x64 where it
# took 128x128 at two (96 KiB, 841 -> 1022 / 847 -> 1030; 128x128 spills 128 B in its
# loop at three), dQ at d=64 128x64 (64 KiB, 847 -> 895 both); no spill in their loops
# (causal or not, sinks, a right window, GQA 1 or 4, either launch; the persistent
# forward at d=128, which keeps the base tile, 12 B outside it).
_AMPERE_16BIT_LIGHT: _Table = {
    "forward": {64: (128, 128, 8, 3), 128: (128, 64, 8, 3)},
    "backward_dq": {64: (128, 64, 8, 3)},
}
# The GPUs of 99 KiB of shared memory a block (sm_86/89: RTX 30xx/40xx, A10, L4, L40S;
# sm_120: RTX 50xx, RTX PRO Blackwell; mma.sync) had no light tiles. Their light calls
# take twice the keys (the forward) or keys (dQ at d=64) a step of the base table, at 3
# stages, which keep a copy in flight on mma.sync GPUs where 2 do not (`_AMPERE_16BIT`'s
# comment; `triton_kernels.config.pipeline_buffers`). Warp-instructions per MFLOP of
# the tile's work, causal, Triton 3.6 / 3.9, sm_86 and sm_89 alike: forward
# d=64 128x128 1339 -> 1186 both (80 KiB), d=128 128x64 1247 -> 984 / 1255 -> 1020 (96
# KiB of 99), dQ d=64 128x64 977 -> 895 both (sm_120: forward d=64 1350 -> 1167 / 1293
# -> 1127, dQ 997 -> 938 / 926 -> 857). No spill in any loop, causal or not, with sinks
# or a right window, 1 or 4 query heads a kv head, a program a tile or persistent, under
# both Tritons; outside it the d=64 forward 4-8 B (none persistent). Not taken: the
# persistent forward at d=128 (16-76 B outside its loop), and on sm_120 the forward at
# d=128 at all (its loop reaches local memory under 3.9, 9 accesses).
_SMALL_SHARED_MEMORY_LIGHT: _Table = {
    "forward": {64: (128, 128, 8, 3), 128: (128, 64, 8, 3)},
    "backward_dq": {64: (128, 64, 8, 3)},
}
# Only where the report showed them spill-free: sm_100's tcgen05 code spills at 128x128.
# Keyed by `_table_arch`.
_LIGHT_TABLES = {
    80: _AMPERE_16BIT_LIGHT,
    86: _SMALL_SHARED_MEMORY_LIGHT,
    90: _HOPPER_16BIT_LIGHT,
    120: {**_SMALL_SHARED_MEMORY_LIGHT, "forward": {64: (128, 128, 8, 3)}},
}
# Persistent launches (past 60 sequences: packed batches of many documents) take the
# light dQ and dK/dV tiles too, spill-free under Triton 3.6 and 3.9
# (sm_90 and sm_80, causal or not, 1, 3 or 7 query heads per kv head; 4 B under 3.6
# with 3 or 7), warp-instructions per MFLOP 3.6 / 3.9: dQ d=128 496 -> 360 / 600 -> 422,
# d=64 783 -> 610 / 931 -> 702, sm_80 d=64 992 -> 837 / 987 -> 837; dK/dV d=64 843 ->
# 654 / 874 -> 643. The forward takes its light 128x128 where `_PERSISTENT_LIGHT_FORWARD`
# lists it. At d=64 spill-free under both Tritons, on sm_90 and sm_80, causal or not,
# with sinks, and with each option set `_HEAVY_LIGHT` lists (the 128x64 tile it replaces
# spilled 4-40 B on sm_80); key loop, 3.6 / 3.9, causal: sm_90 1072 -> 868 / 1133 -> 902,
# sm_80 1442 -> 1133 / 1389 -> 1135. At d=128 on sm_90 it stores 12-20 / 16-20 B once
# before the walk and reloads them once a tile (3 / 9 loads, a few against a tile's key
# loops; none in them): 652 -> 492 / 702 -> 547, causal, without a bound or with sinks
# alike. Not sm_80 at d=128 (72-120 B), nor d=128 with a soft cap or ALiBi (4-376 B; a
# left window alone takes it, `_HEAVY_LIGHT`).
_PERSISTENT_LIGHT_FORWARD = frozenset({(90, 64), (90, 128), (80, 64), (86, 64), (120, 64)})
# sm_90, d=128, light calls bounded on the right (causal or a right window), one program a
# tile (not persistent), where tensor descriptors can be launched: dK/dV loads Q and dO
# through TMA at 64x128: 341 / 360 warp-instructions per MFLOP under Triton 3.9 / 3.6,
# against 528 / 492 for 32x128 by pointers, its loop free of spills (under 3.6 one
# reload of a loop invariant; a few bytes outside it: 0-20 B under 3.9, 20-32 B under
# 3.6; by pointers the tile spills 84-116 B under 3.9, in its loop). Any GQA group: those
# that are not powers of two carry the walk's (tile, head) pair, and spill less (3.6: 8 B
# outside the loop at 3, 5, 6, 7 or 12 query heads a kv head; 3.9: none).
# (Until 2026-11-27 every causal dK/dV kernel compiled by Triton 3.6 had its wgmma
# serialized by ptxas, C7515: the kernel now visits its masked tiles in one loop.) Not
# taken without a right bound (3.6, 4 query heads a kv head: 2 spill instructions in the
# loop), nor persistent (44-116 B under both Tritons). On the H100 (Triton 3.6,
# 2026-11-27, with the serialized kernel,
# bench/results/gpu-check-20261127T0221Z-tma.json) 4 x 4096 causal fwd+bwd took 3.46 ms
# with it against 3.74 by default, though the other two kernels ran with TMA too (all
# three with TMA at their default tiles: forward 5% slower, fwd+bwd 3%); 16 x 1024: 1.35
# ms against 1.33 (12% slower with the default tiles on TMA). This tile alone is not timed
# yet (`gpu-check --tma` does it), nor with GQA.
_HOPPER_DKDV_TMA = AttentionKernelConfig(64, 128, 8, 2, tma=True)
# sm_100 (tcgen05 code): the Hopper dK/dV tile at d=128 spills there (176 B, causal);
# 16x64 does not (12 B with soft cap, ALiBi and a left window all on). dQ at d=256 keeps
# 64x32: its persistent walk spills 492 B at Hopper's 128x32 under Triton 3.6 (144 B).
_BLACKWELL_OVERRIDES: _Table = {
    "backward_dkdv": {128: (16, 64, 8, 2)},
    "backward_dq": {256: (64, 32, 8, 2)},
}
# The dK/dV kernel that accumulates dQ too (`AttentionConfigs.dq_atomic`) holds a third
# product, dS K, and its atomic adds: it keeps the base tables' tile, by pointers (with
# it the light and TMA tiles spill 80-430 B at sm_90, d=128), spill-free at d <= 128 on
# sm_80 and sm_90 without the register-heavy options (Triton 3.6 and 3.9; with a soft
# cap, ALiBi and a left window all on, 4-60 B outside the loop at sm_90, d=128). At d=256
# on sm_90, key-major, 16x64 spilled in the loop (56-160 B) and every wgmma tile tried
# spilled (20-3000 B): it took 16x32 (mma.sync, whose warps computed the key-row
# products 2.2 times; three stages, 80 KiB, since at two every Q / dO copy was awaited
# before the MMAs that read it), and light calls 64x32 (dQ's [64, 256] product on wgmma,
# the key-row ones on mma.sync, each once; with a soft cap, ALiBi or a left window its
# loop reached local memory under 3.9), until 2026-12-08. Both gave way to head-major
# dK/dV (`AttentionKernelConfig.head_major`) at `HEAD_MAJOR_DQ_ATOMIC_TILE`: every
# product on wgmma, each once, no spill in any loop under Triton 3.6 or 3.9 with any
# option (128 KiB); warp-instructions per MFLOP of the tile's work, 3.6 / 3.9, causal:
# 1007 / 1044 (16x32's 2380 / 2332, 64x32's 1010 / 1025), a soft cap 1175 / 1227 (16x32's
# 3015 / 3052), ALiBi 1138 / 1184, all three options 1312 / 1367. The call's default
# tile, `HEAD_MAJOR_DKDV_TILE` at one stage, reaches local memory in its loop under 3.9
# with dQ's product. Keyed by `dq_atomic`:
_HOPPER_HEAD_MAJOR_DKDV = {
    False: AttentionKernelConfig(*HEAD_MAJOR_DKDV_TILE, head_major=True),
    True: AttentionKernelConfig(*HEAD_MAJOR_DQ_ATOMIC_TILE, head_major=True),
}
# sm_80 at d=256: the base table's 32x32 at 4 warps spills in that kernel's loop (16 B,
# Triton 3.9, causal): it keeps the former 16x64 at 8 warps. At d=128 the base table's
# 64x64 holds it, where 32x64 computed part of its products over again (1.4x the tile's
# work): 1465 -> 1039 / 1706 -> 1277 warp-instructions per MFLOP of the tile's work (3.6
# / 3.9, sm_80, causal), no spill in any loop with any option, GQA 1, 3 or 4, either
# launch (under 3.9, 4-28 B outside it with a soft cap, ALiBi or a left window); at the
# base table's three stages (113 KiB) 1077 / 1120, none spilled in any loop, 0-24 B
# outside it (3.6, persistent, every option); on sm_86/89 and sm_120 too, at two stages
# (which take no table of this kernel's own): sm_86 1477 -> 1039
# / 1706 -> 1410, sm_120 1364 -> 960 / 1312 -> 891, no spill in any loop with any option,
# GQA 1 or 4, either launch (under 3.9 on sm_86, 8-12 B outside it).
# At d=64 it takes the base table's 32x128 at three stages (two until 2026-12-07, one
# CTA an SM either way: no copy was in flight): none spilled in its loop on sm_80, causal
# or not, sinks, a right window, each register-heavy option and all of them, GQA 1 or 4,
# either launch; outside it at most 24 B (32 B under 3.9 with all three options,
# persistent); 1639 -> 1715 / 1727 -> 1733 per MFLOP (3.6 / 3.9, causal).
_AMPERE_DQ_ATOMIC_DKDV: dict[int, tuple[int, int, int, int]] = {256: (16, 64, 8, 3)}
# ... and at d=64 light calls step 64 query rows at 4 warps, two CTAs an SM (8 warps, as
# the base table's 32x128 at 8 warps, one CTA, which computed part of its products twice:
# 1.4x the tile's work): 1639 -> 1190 / 1727 -> 1398 warp-instructions per MFLOP of the
# tile's work (3.6 / 3.9, causal), no spill in its loop (causal or not, sinks, a right
# window, GQA 1, 3 or 4, either launch; 0-36 B outside it); with a soft cap, ALiBi and a
# left window it spills in its loop under 3.9 (32 B). Three stages where it took two
# (65 KiB, two CTAs an SM still): 1202 -> 1306 / 1408 -> 1256, none spilled in its loop,
# outside it up to 72 B (3.6, one query head a kv head; 20 B under 3.9).
_AMPERE_DQ_ATOMIC_DKDV_LIGHT: dict[int, tuple[int, int, int, int]] = {64: (64, 64, 4, 3)}
# That kernel with `tma` (the A/B row "dq by tma reduction", sm_90, d=128): its Q and dO
# tiles by descriptor and each step's dQ share added by one bulk tensor reduction
# (UTMAREDG) where the pointer loop issues 8 vector atomics (REDG.ADD.F32x4) a thread,
# with their [32, 128] tile of 64-bit addresses. Static report, causal, Triton 3.6 / 3.9:
# 540 / 528 warp-instructions per MFLOP against 612 / 624 by pointers (x 5 products,
# against 360 x 4 + 417 x 3 for the default's dK/dV and dQ), no spill; 64 x 128 spills
# in its loop (48 / 28 loop instructions), 64 x 64 at 4 warps too (33 / 5). Not yet
# timed on a GPU.
DQ_REDUCE_DKDV_TILE = (32, 128, 8, 2)
# float32 inputs, exact ("ieee") products on CUDA cores (FMA), which need many more
# registers per tile than tensor cores: 4-warp tiles of 32x32 and up spill at head_dim
# 128, so tiles stay small and 8 warps share them. static_kernel_report (causal, sm_80
# and sm_90): none spills at head dims 64/128/256 (with a soft cap, ALiBi and a left
# window at most 4 B), and every tile's shared memory fits the 99 KiB of sm_86/89 too.
# At d=256, 2 stages where 1 was (65 KiB either way): dQ at one spilled 428-604 B a
# thread under Triton 3.6 and 3.9, one CTA an SM (two or three at 2 stages); dK/dV gains
# the asynchronous copies. dK/dV at d=128 keeps one (two spill 32 B on sm_80 under 3.9).
_FLOAT32: _Table = {
    "forward": {64: (32, 16, 8, 2), 128: (32, 16, 8, 2), 256: (32, 16, 8, 2)},
    "backward_dkdv": {64: (16, 32, 8, 2), 128: (16, 32, 8, 1), 256: (16, 16, 8, 2)},
    "backward_dq": {64: (32, 16, 8, 2), 128: (32, 16, 8, 2), 256: (16, 16, 8, 2)},
}


def _takes_hopper_dkdv_tma(
    head_dim: int,
    compute_capability: int,
    kind: str,
    features: AttentionFeatures,
    descriptors: bool,
) -> bool:
    """`_HOPPER_DKDV_TMA`'s conditions, past the light-call check (16-bit inputs): where
    the static report found that tile free of spills in its loop under Triton 3.6 and 3.9.
    d=64 has its own light tile; others were not measured."""
    return (
        descriptors
        and compute_capability == 90
        and kind == "backward_dkdv"
        and head_dim == 128
        and features.bounded_right
    )


# Calls with register-heavy options take the light tiles where those stay free with them:
# not serialized and spill-free under Triton 3.6 and 3.9 (causal or not, sinks, 1 or 3
# query heads per kv head), or, for a left window alone at d=128, spilling a few bytes
# between loops only, listed by the call's heavy options, then (arch, kind, head-dim
# tile, persistent). A left window alone (sliding-window attention) masks only
# the tiles at its edges, so its unmasked loop is the causal one; a soft cap and ALiBi
# add work to every score. Warp-instructions per MFLOP, 3.6 / 3.9, sm_90 dQ d=128:
# window 526 -> 373 / 610 -> 417, soft cap 1055 -> 923 / 1172 -> 987, ALiBi 636 -> 497
# / 750 -> 553; ALiBi's forward at d=128 870 -> 685 / 1089 -> 934; at d=64 the forward,
# dQ and dK/dV gain 8-25%. The sliding-window forward at d=128, 128x128: key loop 692 ->
# 537 / 723 -> 543, spilling 20-64 / 0 B a thread between its loops (a persistent walk
# 8-16 / 4-8 B), none in any; the persistent dQ 521 -> 373 / 603 -> 420 (3.9: 8 B
# outside its loops). At d=256 the forward's 64-key steps hold with each listed option
# set: none spilled in the loop (under 3.6 with a soft cap and a window one reload of a
# loop invariant), between loops up to 16 B with a soft cap, 112 B with a window (under
# 3.6; the 32-key tile it replaces spilled 4-8 B); loop, 3.6 / 3.9: soft cap 1122 -> 878
# / 1167 -> 952, ALiBi 811 -> 554 / 965 -> 695, window 704 -> 459 / 748 -> 512, soft cap
# and window 1095 -> 882 / 1152 -> 994. Not listed: the forward at d=128 with a soft cap
# (its loop spills under 3.6), the forward at d=128 on sm_80 (4-148 B), any other
# combination of options. At d=64 every listed option set takes these (forward, dQ, dK/dV
# on sm_90; forward and dQ on sm_80); at d=128 and 256 each set its own.
_HEAVY_LIGHT_D64 = frozenset({
    (90, "forward", 64, False), (90, "forward", 64, True),
    (90, "backward_dq", 64, False), (90, "backward_dq", 64, True),
    (90, "backward_dkdv", 64, False), (90, "backward_dkdv", 64, True),
    (80, "forward", 64, False), (80, "forward", 64, True),
    (80, "backward_dq", 64, False), (80, "backward_dq", 64, True),
})  # fmt: skip
_HEAVY_LIGHT: dict[tuple[str, ...], frozenset[tuple[int, str, int, bool]]] = {
    ("window_left",): _HEAVY_LIGHT_D64 | {
        (90, "backward_dq", 128, False), (90, "backward_dq", 128, True),
        (90, "forward", 128, False), (90, "forward", 128, True),
        (90, "forward", 256, False),
    },
    ("soft_cap",): _HEAVY_LIGHT_D64 | {
        (90, "backward_dq", 128, False), (90, "backward_dq", 128, True),
        (90, "forward", 256, False),
    },
    ("alibi",): _HEAVY_LIGHT_D64 | {
        (90, "backward_dq", 128, False), (90, "backward_dq", 128, True),
        (90, "forward", 128, False), (90, "forward", 256, False),
    },
    # dQ persistent only: a program a tile spills 8-16 B (3.9 causal, 3.6 GQA 3)
    ("soft_cap", "window_left"): _HEAVY_LIGHT_D64 | {
        (90, "backward_dq", 128, True), (90, "forward", 256, False),
    },
}  # fmt: skip


def _table_arch(compute_capability: int) -> int:
    """The key of the light tables for a compute capability: sm_89 shares sm_86's (the
    same 99 KiB of shared memory and the same code: every report there matched), and
    every consumer Blackwell (sm_120 and later) sm_120's. Keys 86 and 120 are the GPUs of
    99 KiB a block, which take `_SMALL_SHARED_MEMORY_OVERRIDES`."""
    if compute_capability == 89:
        return 86
    return min(compute_capability, 120)


def _takes_light_tile(
    features: AttentionFeatures, arch: int, kind: str, tile_d: int, persistent: bool
) -> bool:
    """Whether a call takes `_LIGHT_TABLES`' tile (`arch`: `_table_arch`'s key), where it
    has one: calls without the register-heavy options, and heavy ones where `_HEAVY_LIGHT`
    lists them; a persistent forward only where `_PERSISTENT_LIGHT_FORWARD` lists it (its
    walk holds registers)."""
    if arch not in _LIGHT_TABLES:
        return False
    fits = (arch, tile_d) in _PERSISTENT_LIGHT_FORWARD
    if persistent and kind == "forward" and not fits:
        return False
    if not features.register_heavy:
        return True
    listed = _HEAVY_LIGHT.get(features.heavy_options, frozenset())
    return (arch, kind, tile_d, persistent) in listed


# Interpreter: 16x16 tiles. A test sequence of a few dozen tokens then spans several
# query and key blocks, so every loop phase (masked edges, unmasked middle) runs.
_INTERPRETER_CONFIG = AttentionKernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def default_attention_config(
    head_dim: int,
    dtype_name: str,
    compute_capability: int | None,
    kind: str,
    *,
    features: AttentionFeatures = AttentionFeatures(),
    persistent: bool = False,
    descriptors: bool = False,
    dq_atomic: bool = False,
) -> AttentionKernelConfig:
    """The launch configuration of one attention kernel.

    Args:
      head_dim: the head dimension (16..256; need not be a power of two).
      dtype_name: "float16", "bfloat16" or "float32".
      compute_capability: 80, 86, 89, 90, 100, 120, ... for a GPU; None for the CPU interpreter.
      kind: one of `KINDS`.
      features: the call's code-changing options (larger tiles where they do not spill).
      persistent: the kernel walks its tile list (PERSISTENT): the walk holds registers,
        so the forward takes the larger tiles of light calls only where they fit
        (`_PERSISTENT_LIGHT_FORWARD`), and dK/dV not the TMA tile.
      descriptors: the launch can use device-side tensor descriptors
        (`jax_bridge.launch.target.tensor_descriptors_available`): configs with `tma`
        may be chosen (Hopper's dK/dV, `_HOPPER_DKDV_TMA`).
      dq_atomic: the dK/dV kernel also accumulates dQ (`AttentionConfigs.dq_atomic`):
        it holds a third tile product, so it keeps the base tables' tile, by pointers
        (sm_80's `_AMPERE_DQ_ATOMIC_DKDV`).

    On Hopper's wgmma GPUs (sm_90-99) the dK/dV kernel at head dims 129-256 is head-major
    (`AttentionKernelConfig.head_major`) whatever the call's options, at a tile of its
    own with `dq_atomic` (`_HOPPER_HEAD_MAJOR_DKDV`).
    """
    check_kind(kind)
    if dtype_name not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype_name!r}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")
    if compute_capability is None:
        return _INTERPRETER_CONFIG
    tile_d = max(64, block_d(head_dim))
    if dtype_name == "float32":
        return AttentionKernelConfig(*_FLOAT32[kind][tile_d])
    # sm_90 and sm_100 (datacenter, 227 KiB of shared memory) take the Hopper tables; sm_120
    # (consumer Blackwell: mma.sync and 99 KiB, like sm_86/89) the Ampere ones.
    hopper = 90 <= compute_capability < 120
    if hopper and compute_capability < 100 and kind == "backward_dkdv" and tile_d == 256:
        return _HOPPER_HEAD_MAJOR_DKDV[dq_atomic]
    arch = _table_arch(compute_capability)
    small_shared_memory = arch in (86, 120)  # 99 KiB a block: sm_86/89, sm_120 and later
    config = (_HOPPER_16BIT if hopper else _AMPERE_16BIT)[kind][tile_d]
    if small_shared_memory:
        config = _SMALL_SHARED_MEMORY_OVERRIDES.get(kind, {}).get(tile_d, config)
    elif compute_capability >= 100:
        config = _BLACKWELL_OVERRIDES.get(kind, {}).get(tile_d, config)
    if dq_atomic and kind == "backward_dkdv":  # its own tables on sm_80 only
        if not (hopper or small_shared_memory):
            atomic_table = _AMPERE_DQ_ATOMIC_DKDV
            if not features.register_heavy:  # light calls: their own tiles where listed
                atomic_table = {**atomic_table, **_AMPERE_DQ_ATOMIC_DKDV_LIGHT}
            config = atomic_table.get(tile_d, config)
    elif _takes_light_tile(features, arch, kind, tile_d, persistent):
        if not (persistent or features.register_heavy) and _takes_hopper_dkdv_tma(
            head_dim, compute_capability, kind, features, descriptors
        ):
            return _HOPPER_DKDV_TMA
        config = _LIGHT_TABLES[arch].get(kind, {}).get(tile_d, config)
    return AttentionKernelConfig(*config)
