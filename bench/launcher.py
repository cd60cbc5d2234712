"""The Triton launcher, end to end on this machine: interpreter, cuda lowering, static report.

The softmax row carries `bytes` (x read, the output written): a row-wise softmax is
memory-bound, so its throughput column is bytes per second.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import BenchRow
from bench.timing import repeat_seconds
from examples.softmax import softmax_block_cols, softmax_rows_kernel
from jax_bridge import lower_for_cuda, static_kernel_report, triton_call

REPEATS = 3


def _softmax(x: jax.Array) -> jax.Array:
    rows, cols = x.shape
    return triton_call(
        x,
        cols,
        kernel=softmax_rows_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows,),
        BLOCK_COLS=softmax_block_cols(cols),
    )


def main() -> list[BenchRow]:
    """Prints what it checked; returns the softmax timing and one row per lowering check."""
    x = jax.random.normal(jax.random.key(0), (64, 1000), jnp.float32)
    times, out = repeat_seconds(jax.jit(_softmax), x, repeats=REPEATS)
    baseline_times, expected = repeat_seconds(jax.jit(jax.nn.softmax), x, repeats=REPEATS)
    error = float(np.max(np.abs(np.asarray(out) - np.asarray(expected))))
    on_cpu = jax.default_backend() == "cpu"
    where = "interpreter on CPU" if on_cpu else jax.default_backend()
    print(
        f"softmax [64, 1000] f32 via {where}: {statistics.median(times) * 1e3:.1f} ms, "
        f"max |err| vs jax.nn = {error:.1e}"
    )
    backend = "triton interpreter" if on_cpu else f"triton {jax.default_backend()}"
    rows = [
        BenchRow(
            "launcher",
            "softmax (triton_call)",
            "64x1000 f32",
            backend,
            times,
            "jax.nn.softmax",
            baseline_times,
            error < 1e-6,
            bytes=float(x.nbytes + out.nbytes),
            params={"rows": x.shape[0], "cols": x.shape[1]},
        )
    ]
    for cc in (80, 90):
        text = lower_for_cuda(
            _softmax, jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16), compute_capability=cc
        )
        lowered = "triton_kernel_call" in text
        report = static_kernel_report(
            softmax_rows_kernel,
            {"x_ptr": "*bf16", "num_cols": "i32", "out_ptr": "*bf16"},
            {"BLOCK_COLS": softmax_block_cols(1000)},
            compute_capability=cc,
        )
        print(f"sm_{cc}: cuda lowering has triton_kernel_call: {lowered}; {report.summary()}")
        rows.append(
            BenchRow("launcher", "cuda lowering (softmax)", "64x1000 bf16", f"sm_{cc}", ok=lowered)
        )
    return rows
