"""Pallas kernels for TPU: splash-style block-sparse attention (`pallas_tpu.splash`).

The splash API is re-exported here, so `import pallas_tpu; pallas_tpu.process_mask(...)`
works as `jax_bridge`'s root does; `pallas_tpu.splash.__all__` is the list, and
tests/splash/test_package.py keeps both the same. Imports JAX, never jax_bridge.
"""

from pallas_tpu import splash
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
    "splash",
    "splash_backward_dkv",
    "splash_backward_dq",
    "splash_forward",
]
