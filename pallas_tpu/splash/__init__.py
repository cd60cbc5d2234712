"""Splash-style block-sparse attention for TPU: a mask algebra (`masks`), its compact
per-block description (`mask_info`), and the Pallas kernels that skip every empty block.

Runs compiled on a TPU and in Pallas' interpret mode elsewhere (tests, CPUs).
"""

from pallas_tpu.splash.backward import splash_backward_dkv, splash_backward_dq
from pallas_tpu.splash.config import BlockSizes, KernelOptions, SegmentIds
from pallas_tpu.splash.forward import splash_forward
from pallas_tpu.splash.kernel import SplashAttentionKernel, make_splash_mha, make_splash_mqa
from pallas_tpu.splash.mask_info import (
    ElementMask,
    MaskInfo,
    classify_blocks,
    process_dynamic_mask,
    process_dynamic_mask_dkv,
    process_mask,
    process_mask_dkv,
)
from pallas_tpu.splash.masks import (
    CausalMask,
    ChunkedCausalMask,
    DocumentMask,
    FullMask,
    LocalMask,
    Mask,
    MultiHeadMask,
    NumpyMask,
    PredicateMask,
    PrefixLMMask,
)

__all__ = [
    "BlockSizes",
    "CausalMask",
    "ChunkedCausalMask",
    "DocumentMask",
    "ElementMask",
    "FullMask",
    "KernelOptions",
    "LocalMask",
    "Mask",
    "MaskInfo",
    "MultiHeadMask",
    "NumpyMask",
    "PredicateMask",
    "PrefixLMMask",
    "SegmentIds",
    "SplashAttentionKernel",
    "classify_blocks",
    "make_splash_mha",
    "make_splash_mqa",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
    "splash_backward_dkv",
    "splash_backward_dq",
    "splash_forward",
]
