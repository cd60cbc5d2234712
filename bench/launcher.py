"""The Triton launcher, end to end on this machine: interpreter, cuda lowering, static report."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from examples.softmax import softmax_block_cols, softmax_rows_kernel
from jax_bridge import lower_for_cuda, static_kernel_report, triton_call


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


def main() -> list[str]:
    """Prints what it checked; returns the names of failed checks."""
    failures = []
    x = jax.random.normal(jax.random.key(0), (64, 1000), jnp.float32)
    softmax = jax.jit(_softmax)
    start = time.perf_counter()
    out = softmax(x).block_until_ready()
    elapsed = time.perf_counter() - start
    error = float(np.max(np.abs(np.asarray(out) - np.asarray(jax.nn.softmax(x)))))
    if not error < 1e-6:
        failures.append("launcher: softmax differs from jax.nn.softmax")
    where = "interpreter on CPU" if jax.default_backend() == "cpu" else jax.default_backend()
    print(
        f"softmax [64, 1000] f32 via {where}: {elapsed * 1e3:.1f} ms, "
        f"max |err| vs jax.nn = {error:.1e}"
    )
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
        if not lowered:
            failures.append(f"launcher: no triton_kernel_call in the sm_{cc} lowering")
    return failures
