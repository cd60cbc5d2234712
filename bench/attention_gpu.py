"""GPU benchmark: the Triton varlen attention kernels against cuDNN, SDPA and FlexAttention.

Run by the `attention` section when JAX's default backend is a GPU: the varlen rows of
bench/gpu_rows.py (16384 packed tokens, 16 heads of 128, bfloat16: 16 x 1024, 4 x 4096 and
1 x 16384 causal documents, 4 x 4096 not causal, 4 x 4096 with GQA 32q/8kv, and mixed
lengths 7000 down to 484 against padded cuDNN) through bench/runner.py: back-to-back calls
with one sync per repeat, forward and forward + backward (output returned with the
gradients), every anchor's result checked against ours.
"""

from __future__ import annotations

import jax

from bench import gpu_rows
from bench.report import BenchRow
from bench.runner import Timing, run_cases


def main(sizes: gpu_rows.Sizes | None = None, timing: Timing | None = None) -> list[BenchRow]:
    """Prints a line per measurement; returns a row per (case, pass, anchor that ran)."""
    print(f"Varlen attention (Triton) vs its anchors on {jax.devices()[0].device_kind}")
    return run_cases(gpu_rows.varlen_cases(sizes or gpu_rows.Sizes.gpu()), timing or Timing())
