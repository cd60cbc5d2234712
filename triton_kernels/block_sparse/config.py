"""Launch configurations of the block-sparse attention kernels.

Pure Python (no JAX). The kernels' full-tile loops are the varlen kernels' unmasked loops
and their partial-tile loops the masked ones with an element mask read or evaluated in
place of the window arithmetic, so they start from the varlen tables for a causal call
(with a soft cap or ALiBi: the register-heavy ones). Where that tile spills here,
`_OVERRIDES` holds the largest one `static_kernel_report` found without spills (bf16 and
float32, sm_90 and sm_80, head dims 64 / 128 / 256, with and without a soft cap, bf16
also with a soft cap plus ALiBi; tests/block_sparse/test_triton.py checks the report's
problem). The full-tile loops are then within 5% of the varlen kernels' instructions per
MFLOP on sm_90 (with ALiBi alone: d=128 forward 1019 vs 1089, dQ 793 vs 750, dK/dV 694
vs 774).
"""

from __future__ import annotations

from triton_kernels.flash_attention.config import (
    KINDS,
    ONE_STAGE_TWO_CTA_TILE,
    AttentionFeatures,
    AttentionKernelConfig,
    block_d,
    default_attention_config,
)

__all__ = ["BLOCK_SPARSE_TWO_CTA_TILES", "KINDS", "block_sparse_config"]

# The kernels at one warpgroup a CTA, two CTAs an SM, the A/B row's (bench/gpu_rows.py):
# kind -> (block_m, block_n, num_warps, num_stages). By pointers (the block-sparse kernels
# take no descriptors) dK/dV spills at 64x64 (260-304 B), not at 32x64. The forward at
# one stage in 128-key steps (`ONE_STAGE_TWO_CTA_TILE`): 539 / 564 warp-instructions per
# MFLOP under Triton 3.6 / 3.9, where 64x64 at two stages ran 690 / 736.
BLOCK_SPARSE_TWO_CTA_TILES = {
    "forward": ONE_STAGE_TWO_CTA_TILE,
    "backward_dq": (64, 64, 4, 2),
    "backward_dkdv": (32, 64, 4, 2),
}

# (sm_90 or sm_80 family, dtype, kind, head-dim tile, soft cap)
#   -> (block_m, block_n, num_warps, num_stages)
_OVERRIDES = {
    # (sm_90 takes the varlen forward's light 128x128 at two stages: spill-free under
    # Triton 3.6 and 3.9 since partial tiles compare their row numbers with per-row
    # intervals (INTERVALS); with the token rule's per-key vectors it spilled 20 B.)
    # dK/dV at d=64: the light 64x128 spills 8 B outside its loops at two stages under
    # Triton 3.6 (none at three; 2-4% more full-loop instructions).
    (90, "bfloat16", "backward_dkdv", 64, False): (64, 128, 8, 3),
    # dK/dV with a soft cap at d=128 spills 8 B at 32x128.
    (90, "bfloat16", "backward_dkdv", 128, True): (16, 128, 8, 2),
    # The varlen forward's 64-key steps at d=256 spill in this forward's full-tile loop
    # with a soft cap (Triton 3.6) or ALiBi (3.9), and 20-28 B outside it without: it
    # keeps 32-key steps (no spill with either).
    (90, "bfloat16", "forward", 256, False): (128, 32, 8, 2),
    (90, "bfloat16", "forward", 256, True): (128, 32, 8, 2),
    # (dK/dV at d=256 takes the varlen kernel's head-major 32x64 at one stage
    # (`AttentionKernelConfig.head_major`): no spill under Triton 3.6 and 3.9, in either
    # launch, with a soft cap and ALiBi, one query head a kv head or four; full-tile loop
    # 1747 -> 669 / 2419 -> 689 warp-instructions per MFLOP of the tile's work under 3.6 /
    # 3.9 against the key-major 16x64's, whose warpgroups both ran K Q^T and V dO^T.)
    # (dQ at d=256 takes the varlen 128x32: none spilled in its loops, 24-68 B outside
    # them under Triton 3.6, once a program; its full-tile loop 1071 -> 343 / 1628 -> 528
    # warp-instructions per MFLOP of the tile's work under 3.6 / 3.9, against 64x32's.)
    # sm_80: the light 128x128 forward spills 16 B at d=128. (With a soft cap it takes the
    # varlen 128x32 at three stages, two until 2026-12-07, one buffer on mma.sync GPUs:
    # with ALiBi too none spilled on sm_80 or sm_86 under Triton 3.6 and 3.9.)
    (80, "bfloat16", "forward", 128, False): (128, 32, 8, 3),
    # (dK/dV at d=256 takes the varlen 32x32 at 4 warps: no spill under Triton 3.6 and
    # 3.9, with a soft cap and ALiBi too; its full-tile loop 1923 -> 847 / 1904 -> 830
    # warp-instructions per MFLOP of the tile's work under 3.6 / 3.9, against 16x64's
    # at 8 warps.)
    (80, "float32", "forward", 128, False): (32, 16, 4, 2),
    (80, "float32", "forward", 128, True): (32, 16, 4, 2),
}


def block_sparse_config(
    head_dim: int,
    dtype_name: str,
    compute_capability: int | None,
    kind: str,
    *,
    soft_cap: bool = False,
    alibi: bool = False,
) -> AttentionKernelConfig:
    """The default launch configuration of one block-sparse kernel (`kind` in `KINDS`:
    forward, backward_dkdv, backward_dq); arguments as `default_attention_config`."""
    features = AttentionFeatures(causal=True, soft_cap=soft_cap, alibi=alibi)
    config = default_attention_config(
        head_dim, dtype_name, compute_capability, kind, features=features
    )
    if compute_capability is None:
        return config
    family = compute_capability // 10 * 10  # sm_86 / sm_89 take sm_80's entries
    dtype = "bfloat16" if dtype_name == "float16" else dtype_name  # same tiles, same code
    override = _OVERRIDES.get((family, dtype, kind, max(64, block_d(head_dim)), soft_cap))
    return config if override is None else AttentionKernelConfig(*override)
