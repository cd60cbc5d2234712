"""ragged-kernels' public JAX API: this module only re-exports.

Each op lives in its own package (`attention`, `grouped_matmul`, `block_sparse`) and picks
its backend from a table (`jax_bridge.core.backend`): Triton on GPUs, XLA elsewhere. The host-side
sequence layer is `host`, the Triton launcher `launch`; `moe` holds the mixture-of-experts
layers built on grouped matmul, and `attention.ring` context-parallel ring attention;
`tuning` holds launch parameters, heuristics and the opt-in autotuner.
Importing this package never imports `jax_triton`.
"""

from jax_bridge.aot.compile import CompiledProgram, CompileReport, compile_for
from jax_bridge.aot.targets import TARGETS, CompileTarget, target_devices, target_mesh
from jax_bridge.attention.api import varlen_attention
from jax_bridge.attention.padded import flash_attention
from jax_bridge.attention.reference import attention_reference
from jax_bridge.attention.ring import RingStats, ring_attention, ring_attention_shard
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.block_sparse.api import block_sparse_attention
from jax_bridge.block_sparse.reference import block_sparse_attention_reference
from jax_bridge.block_sparse.score_mod import ScoreMod
from jax_bridge.core.backend import resolve_implementation
from jax_bridge.core.numerics import (
    cdiv,
    chunk_array,
    identity_dtype_convert,
    log_sum_exp,
    safe_divide,
    unchunk_array,
)
from jax_bridge.core.precision import DEFAULT_PRECISION
from jax_bridge.core.validation import debug_checks
from jax_bridge.grouped_matmul.api import grouped_matmul, transposed_grouped_matmul
from jax_bridge.grouped_matmul.reference import (
    grouped_matmul_reference,
    transposed_grouped_matmul_reference,
)
from jax_bridge.host.context_parallel import (
    inverse_load_balanced_positions,
    load_balanced_positions,
    reorder_sequence,
)
from jax_bridge.host.cu_seqlens import (
    FILL_INDEX,
    chunk_bound,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    prepare_position_ids,
    prepare_sequence_ids,
    prepare_token_indices,
)
from jax_bridge.host.packing import pack, unpack
from jax_bridge.host.segment_ids import (
    SegmentMasks,
    is_segment_mask,
    mask_to_segment_ids,
    segment_ids_to_mask,
)
from jax_bridge.host.sharding import get_corrected_named_sharding
from jax_bridge.launch.lowering import lower_for_cuda
from jax_bridge.launch.poisoned_outputs import poisoned_outputs
from jax_bridge.launch.program_conflicts import ProgramConflictError, program_conflicts_checked
from jax_bridge.launch.report import KernelReport, static_kernel_report, variant_report
from jax_bridge.launch.target import cuda_lowering
from jax_bridge.launch.triton_call import triton_call
from jax_bridge.moe import (
    Dispatched,
    MoEParams,
    Routing,
    all_to_all_combine,
    all_to_all_dispatch,
    expert_parallel_moe_feed_forward,
    init_moe_params,
    moe_feed_forward,
    route,
    top_k_router,
    unroute,
)
from jax_bridge.tuning.autotune import (
    TuneResult,
    autotune,
    static_report_prune,
    tune_attention,
    tune_grouped_matmul,
)
from jax_bridge.tuning.cache import TuningCache
from jax_bridge.tuning.device import device_fingerprint, get_device_platform
from jax_bridge.tuning.heuristics import (
    default_attention_configs,
    default_params,
    select_num_stages,
    select_num_warps,
)
from jax_bridge.tuning.keys import abstractify, short_hash, stable_json
from jax_bridge.tuning.params import BwdParams, FwdParams, attention_configs
from triton_kernels.config import KernelConfig
from triton_kernels.flash_attention.config import (
    AttentionConfigs,
    AttentionFeatures,
    AttentionKernelConfig,
)
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig, GroupedMatmulConfigs

__all__ = [
    "DEFAULT_PRECISION",
    "FILL_INDEX",
    "TARGETS",
    "AttentionConfigs",
    "AttentionFeatures",
    "AttentionKernelConfig",
    "AttentionSpec",
    "BwdParams",
    "CompileReport",
    "CompileTarget",
    "CompiledProgram",
    "Dispatched",
    "FwdParams",
    "GroupedMatmulConfig",
    "GroupedMatmulConfigs",
    "KernelConfig",
    "KernelReport",
    "MoEParams",
    "ProgramConflictError",
    "RingStats",
    "Routing",
    "ScoreMod",
    "SegmentMasks",
    "TuneResult",
    "TuningCache",
    "abstractify",
    "all_to_all_combine",
    "all_to_all_dispatch",
    "attention_configs",
    "attention_reference",
    "autotune",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "cdiv",
    "chunk_array",
    "chunk_bound",
    "compile_for",
    "cuda_lowering",
    "debug_checks",
    "default_attention_configs",
    "default_params",
    "device_fingerprint",
    "expert_parallel_moe_feed_forward",
    "flash_attention",
    "get_corrected_named_sharding",
    "get_device_platform",
    "grouped_matmul",
    "grouped_matmul_reference",
    "identity_dtype_convert",
    "init_moe_params",
    "inverse_load_balanced_positions",
    "is_segment_mask",
    "load_balanced_positions",
    "log_sum_exp",
    "lower_for_cuda",
    "mask_to_segment_ids",
    "moe_feed_forward",
    "pack",
    "poisoned_outputs",
    "prepare_chunk_indices",
    "prepare_chunk_offsets",
    "prepare_cu_seqlens_from_mask",
    "prepare_lens",
    "prepare_lens_from_mask",
    "prepare_position_ids",
    "prepare_sequence_ids",
    "prepare_token_indices",
    "program_conflicts_checked",
    "reorder_sequence",
    "resolve_implementation",
    "ring_attention",
    "ring_attention_shard",
    "route",
    "safe_divide",
    "segment_ids_to_mask",
    "select_num_stages",
    "select_num_warps",
    "short_hash",
    "stable_json",
    "static_kernel_report",
    "static_report_prune",
    "target_devices",
    "target_mesh",
    "top_k_router",
    "transposed_grouped_matmul",
    "transposed_grouped_matmul_reference",
    "triton_call",
    "tune_attention",
    "tune_grouped_matmul",
    "unchunk_array",
    "unpack",
    "unroute",
    "variant_report",
    "varlen_attention",
]
