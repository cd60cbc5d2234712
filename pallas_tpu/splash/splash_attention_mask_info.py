"""JAX's module name `splash_attention_mask_info`, re-exporting this package's MaskInfo
and mask processing (`mask_info`)."""

from pallas_tpu.splash.mask_info import (
    MaskInfo,
    process_dynamic_mask,
    process_dynamic_mask_dkv,
    process_mask,
    process_mask_dkv,
)

__all__ = [
    "MaskInfo",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "process_mask",
    "process_mask_dkv",
]
