"""GPU benchmark: the Triton block-sparse kernels against cuDNN, SDPA and FlexAttention.

Run by the `block_sparse` section when JAX's default backend is a GPU, after the sweep: the
block-sparse rows of bench/gpu_rows.py (16384 tokens, 16 heads of 128, bfloat16: causal,
causal window 1024, 16 causal documents, random 50% block sparsity), forward and forward +
backward through bench/runner.py. Anchors: cuDNN through JAX (its causal and window
kernels, the documents as a batch, the random blocks as a dense mask), PyTorch's SDPA
where it can express the mask, and compiled FlexAttention with the same mask as a
mask_mod. Every anchor's output and gradients are checked against ours.
"""

from __future__ import annotations

import jax

from bench import gpu_rows
from bench.report import BenchRow
from bench.runner import Timing, run_cases


def main(sizes: gpu_rows.Sizes | None = None, timing: Timing | None = None) -> list[BenchRow]:
    """Prints a line per measurement; returns a row per (case, pass, anchor that ran)."""
    print(f"block-sparse attention (Triton) vs its anchors on {jax.devices()[0].device_kind}")
    cases = gpu_rows.block_sparse_cases(sizes or gpu_rows.Sizes.gpu())
    return run_cases(cases, timing or Timing())
