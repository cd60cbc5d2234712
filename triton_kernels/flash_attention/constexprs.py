"""The compile-time arguments of the attention kernels, decided in one place.

Pure Python (no JAX). The JAX bridge (`jax_bridge.attention.triton`,
`jax_bridge.block_sparse.triton`) and the offline catalog (`triton_kernels.catalog`,
which the static report and the tuner's pruning compile) both build a launch's
constexprs here, so that the report describes the very kernel a call runs: a switch
decided twice could otherwise differ between the two, and the report would price a
kernel that never runs.
"""

from __future__ import annotations

from typing import Any

from triton_kernels.flash_attention.config import (
    AttentionFeatures,
    AttentionKernelConfig,
    block_d,
    check_kind,
)
from triton_kernels.flash_attention.forward import HOST_TMA

__all__ = [
    "attention_constexprs",
    "attention_num_warps",
    "block_sparse_constexprs",
    "finds_bad_rows_in_kernel",
    "raw_score_max",
]


def raw_score_max(
    softmax_scale: float, *, soft_cap: bool, alibi: bool, score_hook: bool = False
) -> bool:
    """Whether a forward kernel may take its row max on raw q.k (RAW_SCORE_MAX): the max
    commutes with a positive scale, and with nothing else that transforms a score (a soft
    cap's tanh, ALiBi's position term, a user's score hook)."""
    return softmax_scale > 0 and not (soft_cap or alibi or score_hook)


def finds_bad_rows_in_kernel(compute_capability: int | None) -> bool:
    """Whether the block-sparse forward and dQ kernels find their operand's non-finite
    rows (V, K) in the partial tiles they load (FIND_BAD_ROWS) instead of reading copies
    the bridge zeroed, each a reduce and a select over the operand a call (~65 us at
    16384 x 16 x 128 on an H100): on sm_90 and up, and in the interpreter (None). On
    sm_80..89 the forward's select spills (216 B at d=64). Where it is on, the dQ kernel
    also flags the non-finite rows of q and dO for dK/dV (XLA does elsewhere: there those
    flags spill the dQ kernel), whose partial tiles load them as zeros: the select would
    spill it (76 B at d=128 on sm_90)."""
    return compute_capability is None or compute_capability >= 90


def _tile_constexprs(
    config: AttentionKernelConfig,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    input_precision: str,
) -> dict[str, Any]:
    """What every attention kernel takes: heads, head dim, tiles, tl.dot's precision."""
    return dict(
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d(head_dim),
        INPUT_PRECISION=input_precision,
    )


def attention_constexprs(
    kind: str,
    config: AttentionKernelConfig,
    features: AttentionFeatures,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softmax_scale: float,
    input_precision: str,
    persistent: bool,
    has_d_lse: bool = False,
    dq_atomic: bool = False,
) -> dict[str, Any]:
    """The constexprs of varlen attention kernel `kind` (one of `KINDS`) under `config`
    for a call with `features`.

    input_precision: tl.dot's ("ieee", "tf32", ...; it matters for float32 only).
    persistent: the programs walk the tile list (PERSISTENT). has_d_lse: the dQ kernel
    reads an lse cotangent. dq_atomic: the dK/dV kernel accumulates dQ (DQ_ATOMIC,
    `AttentionConfigs.dq_atomic`). TMA is `config.tma`: the caller checks that the launch
    can pass descriptors.
    """
    check_kind(kind)
    constexprs = _tile_constexprs(config, num_q_heads, num_kv_heads, head_dim, input_precision)
    constexprs |= dict(PERSISTENT=persistent, TMA=config.tma, **features.kernel_flags())
    if config.host_descriptors:  # the streamed tiles through the launch's descriptors
        constexprs["TMA"] = HOST_TMA.value
    if kind == "forward":
        constexprs["HAS_SINKS"] = features.sinks
        constexprs["RAW_SCORE_MAX"] = raw_score_max(
            softmax_scale, soft_cap=features.soft_cap, alibi=features.alibi
        )
        constexprs["OVERLAP_SOFTMAX"] = config.overlap_softmax
    elif kind == "backward_dq":
        constexprs["HAS_D_LSE"] = has_d_lse
    else:
        constexprs["DQ_ATOMIC"] = dq_atomic
        constexprs["OVERLAP_SOFTMAX"] = config.overlap_softmax
        constexprs["HEAD_MAJOR"] = config.head_major
    if kind != "backward_dq":
        # the persistent walk is a loop around the tile loop: not partitioned
        constexprs["WARP_SPECIALIZE"] = config.warp_specialize and not persistent
    return constexprs


def attention_num_warps(config: AttentionKernelConfig, persistent: bool) -> int:
    """The warps a varlen attention launch of `config` asks for: its own, but 8 for a
    warp-specialized config in a persistent launch. There the loop compiles unspecialized
    (`attention_constexprs`), and at the 4 warps a warp-specialized config names its
    stationary tile's accumulators spill (sm_90, d=128, Triton 3.6, the A/B rows' tiles:
    1712 B stored a thread by the forward, 2468 by dK/dV); at 8 they are the default
    tiles' launches (128x128 forward, 64x128 dK/dV with `tma`)."""
    return 8 if config.warp_specialize and persistent else config.num_warps


def block_sparse_constexprs(
    kind: str,
    config: AttentionKernelConfig,
    rule_flags: dict[str, Any],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softmax_scale: float,
    input_precision: str,
    soft_cap: bool,
    alibi: bool,
    sinks: bool,
    score_mod: Any,
    score_mod_grad: Any,
    group_width: int,
    find_bad_rows: bool,
    has_d_lse: bool = False,
) -> dict[str, Any]:
    """The constexprs of block-sparse kernel `kind` (one of `KINDS`) under `config`.

    rule_flags: the element rule's switches (MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX,
    PREDICATE). score_mod, score_mod_grad: the user's `@triton.jit` score hook and its
    derivative, or None. group_width: the widest head group (the forward's and dQ's
    second grid axis). find_bad_rows: the forward and dQ find non-finite rows in their
    tiles (`finds_bad_rows_in_kernel` of the target; the caller passes the bad-row
    arguments to match). CAREFUL is False: the first of the kernel's two launches (the
    bridge's second sets it; `triton_kernels.block_sparse.forward` says why). has_d_lse:
    the dQ kernel reads lse's cotangent into delta. OVERLAP_SOFTMAX (the forward, whose
    full tiles take it, and dK/dV, every tile) is `config.overlap_softmax`.
    """
    check_kind(kind)
    constexprs = _tile_constexprs(config, num_q_heads, num_kv_heads, head_dim, input_precision)
    constexprs |= dict(HAS_SOFT_CAP=soft_cap, HAS_ALIBI=alibi, SCORE_MOD=score_mod, **rule_flags)
    constexprs["CAREFUL"] = False
    if kind != "backward_dq":
        constexprs["OVERLAP_SOFTMAX"] = config.overlap_softmax
    if kind != "forward":
        constexprs["SCORE_MOD_GRAD"] = score_mod_grad
    if kind == "backward_dkdv":  # its flags come from dQ or XLA (see above)
        constexprs["HEAD_MAJOR"] = config.head_major
        return constexprs
    constexprs |= dict(GROUP_WIDTH=group_width, FIND_BAD_ROWS=find_bad_rows)
    if kind == "backward_dq":
        constexprs["HAS_D_LSE"] = has_d_lse
    if kind == "forward":
        constexprs["HAS_SINKS"] = sinks
        constexprs["RAW_SCORE_MAX"] = raw_score_max(
            softmax_scale, soft_cap=soft_cap, alibi=alibi, score_hook=score_mod is not None
        )
    return constexprs
