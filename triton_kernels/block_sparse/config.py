"""Launch configurations of the block-sparse attention kernels.

Pure Python (no JAX). The kernels' inner loops are the varlen kernels' plus, in partial
tiles, an element mask and the isolating products' finiteness test: as many registers
as a varlen call with a two-sided window, so they take the varlen tables for such a
call (`default_attention_config` with `window_left` and a right bound), chosen there
with `static_kernel_report`.
"""

from __future__ import annotations

from triton_kernels.flash_attention.config import (
    KINDS,
    AttentionFeatures,
    AttentionKernelConfig,
    default_attention_config,
)

__all__ = ["KINDS", "block_sparse_config"]


def block_sparse_config(
    head_dim: int,
    dtype_name: str,
    compute_capability: int | None,
    kind: str,
    *,
    soft_cap: bool = False,
) -> AttentionKernelConfig:
    """The default launch configuration of one block-sparse kernel (`kind` in `KINDS`:
    forward, backward_dkdv, backward_dq); arguments as `default_attention_config`."""
    features = AttentionFeatures(causal=True, window_left=True, soft_cap=soft_cap)
    return default_attention_config(
        head_dim, dtype_name, compute_capability, kind, features=features
    )
