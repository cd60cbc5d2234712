"""Triton kernels for ragged (packed, variable-length) workloads.

This package imports Triton only, never JAX: kernels take raw pointers, strides and
constexpr configuration, and their launch metadata (block sizes, warps, stages) is
computed by plain Python functions here. `jax_bridge` launches them.
"""
