"""ragged-kernels' public JAX API.

Ops pick their implementation in one place (`jax_bridge.backend`): Triton on GPUs, Pallas
on TPUs, XLA elsewhere. Importing this package never imports `jax_triton`.
"""

from jax_bridge.attention import varlen_attention
from jax_bridge.attention_padded import flash_attention
from jax_bridge.attention_spec import AttentionSpec
from jax_bridge.backend import resolve_implementation
from jax_bridge.context_parallel import (
    inverse_load_balanced_positions,
    load_balanced_positions,
    reorder_sequence,
)
from jax_bridge.cuda_lowering import lower_for_cuda
from jax_bridge.grouped_matmul import grouped_matmul, transposed_grouped_matmul
from jax_bridge.kernel_report import KernelReport, static_kernel_report
from jax_bridge.numerics import (
    cdiv,
    chunk_array,
    identity_dtype_convert,
    log_sum_exp,
    safe_divide,
    unchunk_array,
)
from jax_bridge.packing import pack, unpack
from jax_bridge.segment_masks import (
    SegmentMasks,
    is_segment_mask,
    mask_to_segment_ids,
    segment_ids_to_mask,
)
from jax_bridge.sequences import (
    FILL_INDEX,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    prepare_position_ids,
    prepare_sequence_ids,
    prepare_token_indices,
)
from jax_bridge.sharding import get_corrected_named_sharding
from jax_bridge.triton_launch import cuda_lowering, triton_call

__all__ = [
    "FILL_INDEX",
    "AttentionSpec",
    "KernelReport",
    "SegmentMasks",
    "cdiv",
    "chunk_array",
    "cuda_lowering",
    "flash_attention",
    "get_corrected_named_sharding",
    "grouped_matmul",
    "identity_dtype_convert",
    "inverse_load_balanced_positions",
    "is_segment_mask",
    "load_balanced_positions",
    "log_sum_exp",
    "lower_for_cuda",
    "mask_to_segment_ids",
    "pack",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_cu_seqlens_from_mask",
    "prepare_lens",
    "prepare_lens_from_mask",
    "prepare_position_ids",
    "prepare_sequence_ids",
    "prepare_token_indices",
    "reorder_sequence",
    "resolve_implementation",
    "safe_divide",
    "segment_ids_to_mask",
    "static_kernel_report",
    "transposed_grouped_matmul",
    "triton_call",
    "unchunk_array",
    "unpack",
    "varlen_attention",
]
