"""Splash-style block-sparse attention for TPU: a mask algebra (`masks`), its compact
per-block description (`mask_info`), and the Pallas kernels that skip every empty block.

The names of JAX's splash package are here too (`QKVLayout`, `make_splash_mha_single_device`,
`make_causal_mask`, `make_masked_mha_reference`, ...), and its module names
`splash_attention_kernel`, `splash_attention_mask` and `splash_attention_mask_info` are
aliases of ours: code written for JAX's splash runs with its import changed (README).

Runs compiled on a TPU and in Pallas' interpret mode elsewhere (tests, CPUs).
"""

# JAX's module names (thin aliases), so `from pallas_tpu.splash import
# splash_attention_kernel as splash` ports code written for JAX's splash.
from pallas_tpu.splash import splash_attention_kernel as splash_attention_kernel
from pallas_tpu.splash import splash_attention_mask as splash_attention_mask
from pallas_tpu.splash import splash_attention_mask_info as splash_attention_mask_info
from pallas_tpu.splash.backward import splash_backward_dkv, splash_backward_dq
from pallas_tpu.splash.config import BlockSizes, KernelOptions, QKVLayout, SegmentIds
from pallas_tpu.splash.forward import splash_forward
from pallas_tpu.splash.kernel import (
    SplashAttentionKernel,
    make_splash_mha,
    make_splash_mha_single_device,
    make_splash_mqa,
    make_splash_mqa_single_device,
)
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
    LogicalAnd,
    LogicalOr,
    Mask,
    MultiHeadMask,
    NumpyMask,
    PredicateMask,
    PrefixLMMask,
    make_causal_mask,
    make_chunk_attention_mask,
    make_local_attention_mask,
    make_random_mask,
)
from pallas_tpu.splash.reference import make_masked_mha_reference, make_masked_mqa_reference

__all__ = [
    "BlockSizes",
    "CausalMask",
    "ChunkedCausalMask",
    "DocumentMask",
    "ElementMask",
    "FullMask",
    "KernelOptions",
    "LocalMask",
    "LogicalAnd",
    "LogicalOr",
    "Mask",
    "MaskInfo",
    "MultiHeadMask",
    "NumpyMask",
    "PredicateMask",
    "PrefixLMMask",
    "QKVLayout",
    "SegmentIds",
    "SplashAttentionKernel",
    "classify_blocks",
    "make_causal_mask",
    "make_chunk_attention_mask",
    "make_local_attention_mask",
    "make_masked_mha_reference",
    "make_masked_mqa_reference",
    "make_random_mask",
    "make_splash_mha",
    "make_splash_mha_single_device",
    "make_splash_mqa",
    "make_splash_mqa_single_device",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
    "splash_backward_dkv",
    "splash_backward_dq",
    "splash_forward",
]
