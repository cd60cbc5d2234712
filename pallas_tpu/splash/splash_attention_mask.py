"""JAX's module name `splash_attention_mask`, re-exporting this package's masks.

`from pallas_tpu.splash import splash_attention_mask as mask_lib` gives the names JAX's
`jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask` offers users.
"""

from pallas_tpu.splash.masks import (
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    LogicalAnd,
    LogicalOr,
    Mask,
    MultiHeadMask,
    NumpyMask,
    make_causal_mask,
    make_chunk_attention_mask,
    make_local_attention_mask,
    make_random_mask,
)

__all__ = [
    "CausalMask",
    "ChunkedCausalMask",
    "FullMask",
    "LocalMask",
    "LogicalAnd",
    "LogicalOr",
    "Mask",
    "MultiHeadMask",
    "NumpyMask",
    "make_causal_mask",
    "make_chunk_attention_mask",
    "make_local_attention_mask",
    "make_random_mask",
]
