"""JAX's module name `splash_attention_kernel`, re-exporting this package's equivalents.

`from pallas_tpu.splash import splash_attention_kernel as splash` gives the names JAX's
`jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel` offers users.
"""

from pallas_tpu.splash.config import (
    DEFAULT_MASK_VALUE,
    NUM_LANES,
    NUM_SUBLANES,
    BlockSizes,
    QKVLayout,
    SegmentIds,
)
from pallas_tpu.splash.kernel import (
    SplashAttentionKernel,
    make_splash_mha,
    make_splash_mha_single_device,
    make_splash_mqa,
    make_splash_mqa_single_device,
)
from pallas_tpu.splash.reference import (
    attention_reference,
    make_attention_reference,
    make_masked_mha_reference,
    make_masked_mqa_reference,
)

__all__ = [
    "DEFAULT_MASK_VALUE",
    "NUM_LANES",
    "NUM_SUBLANES",
    "BlockSizes",
    "QKVLayout",
    "SegmentIds",
    "SplashAttentionKernel",
    "attention_reference",
    "make_attention_reference",
    "make_masked_mha_reference",
    "make_masked_mqa_reference",
    "make_splash_mha",
    "make_splash_mha_single_device",
    "make_splash_mqa",
    "make_splash_mqa_single_device",
]
