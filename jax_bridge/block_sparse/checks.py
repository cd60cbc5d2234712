"""Trace-time argument checks of `block_sparse_attention`: every message names the op,
the argument and what was expected."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax

from jax_bridge.block_sparse.score_mod import ScoreMod
from jax_bridge.core.validation import check_per_head, check_qkv_arrays, is_traced
from pallas_tpu.splash.config import BLOCK_FIELDS, NUM_LANES, NUM_SUBLANES, BlockSizes
from pallas_tpu.splash.masks import Mask, MultiHeadMask
from triton_kernels.flash_attention.config import KINDS, AttentionConfigs, AttentionKernelConfig

OP = "block_sparse_attention"

# block_sizes fields of each Triton kernel's (query, key) tile.
TRITON_BLOCK_FIELDS = {
    "forward": ("block_q", "block_kv"),
    "backward_dq": ("block_q_dq", "block_kv_dq"),
    "backward_dkdv": ("block_q_dkv", "block_kv_dkv"),
}
# AttentionKernelConfig's options that only the varlen kernels implement.
_VARLEN_ONLY_OPTIONS = ("tma", "warp_specialize", "host_descriptors")


def check_qkv(q: Any, k: Any, v: Any) -> None:
    """q [B, Lq, Hq, D], k / v [B, Lk, Hkv, D], one float dtype, Hq % Hkv == 0."""
    check_qkv_arrays(
        OP, q, k, v,
        q_doc="[batch, seq_len, heads, head_dim]", kv_doc="[batch, kv_len, num_kv_heads, head_dim]",
    )  # fmt: skip
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{OP}: k's batch ({k.shape[0]}) must equal q's batch ({q.shape[0]}).")


def check_mask(mask: Any, q_len: int, kv_len: int, num_q_heads: int) -> None:
    """A 2-D Mask (q_len, kv_len), or a MultiHeadMask of num_q_heads such masks."""
    if not isinstance(mask, Mask):
        raise TypeError(
            f"{OP}: mask must be a splash Mask (pallas_tpu.splash: CausalMask, LocalMask, "
            f"DocumentMask, NumpyMask, ..., or a MultiHeadMask), got {type(mask).__name__}."
        )
    expected = (q_len, kv_len)
    if isinstance(mask, MultiHeadMask):
        if len(mask.masks) != num_q_heads:
            raise ValueError(
                f"{OP}: a MultiHeadMask needs one mask per query head ({num_q_heads}), got "
                f"{len(mask.masks)}."
            )
        shape = tuple(mask.shape[1:])
    else:
        shape = tuple(mask.shape)
    if shape != expected:
        raise ValueError(
            f"{OP}: mask has shape {shape} but (q_len, kv_len) is {expected} (from q's and "
            "k's seq_len axis)."
        )


def check_score_mod(score_mod: Any, implementation: str) -> None:
    """None, or a ScoreMod the backend can run (Triton needs its triton_fn; the splash
    kernels have no hook)."""
    if score_mod is None:
        return
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(
            f"{OP}: score_mod must be a jax_bridge.ScoreMod or None, got "
            f"{type(score_mod).__name__}."
        )
    if implementation == "pallas":
        raise ValueError(
            f"{OP}: score_mod is not supported by implementation='pallas' (the splash "
            "kernels have no score hook); use 'xla' or 'triton'."
        )
    if implementation == "triton" and score_mod.triton_fn is None:
        raise ValueError(
            f"{OP}: score_mod {score_mod.name!r} has no triton_fn, which "
            "implementation='triton' calls in its kernels; give one or use 'xla'."
        )


def check_static_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if is_traced(value) or isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{OP}: {name} must be a static Python float or None, got {value!r}.")
    return float(value)


def check_scale_and_cap(softmax_scale: Any, logits_soft_cap: Any, head_dim: int):
    """(scale, cap): scale defaults to 1 / sqrt(head_dim), any finite non-zero float; a cap
    of None or 0 is off, else positive and finite (an infinite cap would make inf * tanh(0)).

    A negative scale is valid math (softmax of -q.k: attend to the least similar keys) and
    `jax.nn.dot_product_attention` accepts it, so it is kept. Zero is refused: every score
    becomes 0 (a uniform average over the mask, zero dQ and dK), which is almost always a
    bug such as `1 // head_dim**0.5`."""
    scale = check_static_float(softmax_scale, "softmax_scale")
    cap = check_static_float(logits_soft_cap, "logits_soft_cap")
    if scale is not None and not (math.isfinite(scale) and scale != 0):
        raise ValueError(
            f"{OP}: softmax_scale must be a finite non-zero float or None (1 / sqrt(head_dim)), "
            f"got {scale}: zero makes every score 0 (uniform attention, no q/k gradient)."
        )
    if cap is not None and not (cap >= 0 and math.isfinite(cap)):  # negative, NaN or inf
        raise ValueError(
            f"{OP}: logits_soft_cap must be positive and finite (or None / 0: off), got {cap}."
        )
    return (head_dim**-0.5 if scale is None else scale), (cap or None)


def check_alibi(alibi_slopes: Any, num_q_heads: int, implementation: str) -> jax.Array | None:
    """None, or [num_q_heads] float slopes on a backend that runs ALiBi."""
    alibi_slopes = check_per_head(OP, alibi_slopes, "alibi_slopes", num_q_heads)
    if alibi_slopes is not None and implementation == "pallas":
        raise ValueError(
            f"{OP}: alibi_slopes is not supported by implementation='pallas' (the splash "
            "kernels have no ALiBi); use 'xla' or 'triton'."
        )
    return alibi_slopes


def check_block_sizes(block_sizes: Any, implementation: str) -> BlockSizes | None:
    """A splash `BlockSizes` or None. XLA reads block_q / block_kv (positive multiples of 8);
    Pallas every field (positive multiples of 128); Triton its three kernels' (q, kv)
    tiles (powers of two >= 16)."""
    if block_sizes is None:
        return None
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            f"{OP}: block_sizes must be a pallas_tpu.splash.BlockSizes or None, got "
            f"{type(block_sizes).__name__}."
        )
    fields = list(BLOCK_FIELDS)  # the int fields; JAX's layout / fused flags are checked there
    if implementation == "xla":
        fields = ["block_q", "block_kv"]
    elif implementation == "triton":
        fields = [name for pair in TRITON_BLOCK_FIELDS.values() for name in pair]
    for name in fields:
        value = getattr(block_sizes, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{OP}: block_sizes.{name} must be a positive int, got {value!r}.")
        if implementation == "triton" and (value < 16 or value & (value - 1)):
            raise ValueError(
                f"{OP}: block_sizes.{name}={value} must be a power of two >= 16 for "
                "implementation='triton'."
            )
        if implementation == "xla" and value % NUM_SUBLANES:
            raise ValueError(
                f"{OP}: block_sizes.{name}={value} must be a multiple of {NUM_SUBLANES} for "
                "implementation='xla' (whole float32 sublane tiles, as its defaults)."
            )
        if implementation == "pallas" and value % NUM_LANES:
            raise ValueError(
                f"{OP}: block_sizes.{name}={value} must be a multiple of {NUM_LANES} for "
                "implementation='pallas' (the TPU lane width)."
            )
    return block_sizes


def check_config(
    config: Any, block_sizes: BlockSizes | None, implementation: str
) -> AttentionConfigs | None:
    """The Triton kernels' launch configuration as an `AttentionConfigs` (one
    `AttentionKernelConfig` stands for all three kernels:
    `AttentionConfigs.for_every_kernel`), or None. XLA ignores it (as
    `varlen_attention`'s XLA path does); Pallas takes `block_sizes` instead. The
    block-sparse kernels read no tensor descriptors, run no warp-specialized loop and
    keep their own dQ kernel, so those options are refused on every backend (the
    softmax overlap they take, the forward's full tiles and every dK/dV tile, and
    head-major dK/dV); a Triton
    kernel whose tile both `config` and `block_sizes` give must get the same one (XLA's
    block_sizes are its own blocks)."""
    if config is None:
        return None
    if isinstance(config, AttentionKernelConfig):
        _refuse_varlen_options(config, "config")
        config = AttentionConfigs.for_every_kernel(config)
    if not isinstance(config, AttentionConfigs):
        raise TypeError(
            f"{OP}: config must be an AttentionConfigs, an AttentionKernelConfig or None, "
            f"got {type(config).__name__}."
        )
    if implementation == "pallas":
        raise ValueError(
            f"{OP}: config is the Triton kernels' launch configuration; implementation="
            "'pallas' takes its tiles from block_sizes."
        )
    if config.dq_atomic:
        raise ValueError(
            f"{OP}: config.dq_atomic=True is varlen_attention's; the block-sparse backward "
            "keeps its dQ kernel."
        )
    for kind in KINDS:
        kernel = getattr(config, kind)
        if kernel is None:
            continue
        _refuse_varlen_options(kernel, f"config.{kind}")
        if implementation == "triton":
            _check_same_tile(kind, kernel, block_sizes)
    return config


def _refuse_varlen_options(kernel: AttentionKernelConfig, where: str) -> None:
    options = [name for name in _VARLEN_ONLY_OPTIONS if getattr(kernel, name)]
    if options:
        given = ", ".join(f"{where}.{name}=True" for name in options)
        raise ValueError(
            f"{OP}: {given}: varlen_attention kernel options; the block-sparse kernels do "
            "not take them."
        )


def _check_same_tile(kind: str, kernel: AttentionKernelConfig, block_sizes: Any) -> None:
    if block_sizes is None:
        return
    names = TRITON_BLOCK_FIELDS[kind]
    for name, tile in zip(names, (kernel.block_m, kernel.block_n), strict=True):
        given = getattr(block_sizes, name)
        if given is not None and given != tile:
            raise ValueError(
                f"{OP}: block_sizes.{name}={given} and config.{kind} ({kernel.block_m}x"
                f"{kernel.block_n}) give the {kind} kernel two tiles; give one, or both alike."
            )
