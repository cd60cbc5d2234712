"""ragged-kernels' public JAX API.

Ops pick their implementation in one place (`jax_bridge.backend`): Triton on GPUs, Pallas
on TPUs, XLA elsewhere. Importing this package never imports `jax_triton`.
"""

from jax_bridge.attention_spec import AttentionSpec
from jax_bridge.backend import resolve_implementation
from jax_bridge.cuda_lowering import lower_for_cuda
from jax_bridge.kernel_report import KernelReport, static_kernel_report
from jax_bridge.triton_launch import cuda_lowering, triton_call

__all__ = [
    "AttentionSpec",
    "KernelReport",
    "cuda_lowering",
    "lower_for_cuda",
    "resolve_implementation",
    "static_kernel_report",
    "triton_call",
]
