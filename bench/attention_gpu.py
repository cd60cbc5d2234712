"""GPU benchmark: the Triton varlen attention kernels against cuDNN's flash attention.

Run by the `attention` section when JAX's default backend is a GPU. Packed documents of
equal length L (16384 tokens in all), causal, 16 heads of 128, bfloat16: the same work as a
batch of T / L causal sequences, which is what the baseline gets
(`jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")` on
[T / L, L, heads, 128]; XLA's attention where cuDNN is unavailable, and the row says so).
Reported: median wall times of 20 calls after a warm-up (forward, and forward + backward
through `jax.vjp`), throughput in useful causal FLOPs, and a correctness check of the
output and the three gradients against the baseline.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import BenchRow
from bench.timing import jit_with_grads, relative_errors, repeat_seconds
from jax_bridge.attention.api import varlen_attention

TOTAL_TOKENS = 16384
DOC_LENS = (1024, 4096)
NUM_HEADS = 16
HEAD_DIM = 128
REPEATS = 20
# bfloat16 inputs: both sides round probabilities and outputs to 8 mantissa bits, so their
# difference relative to the largest magnitude stays within a few units of 2^-8.
TOLERANCE = 3e-2
FWD_BWD_FLOP_FACTOR = 3.5  # bench/report.py: the backward counts 2.5x the forward


def causal_flops(total: int, doc_len: int, num_heads: int, head_dim: int) -> float:
    """Useful forward FLOPs: 4 * head_dim per allowed (query, key) pair and head."""
    return 4.0 * head_dim * num_heads * (total // doc_len) * doc_len * (doc_len + 1) / 2


def _baseline(doc_len: int, implementation: str) -> Callable:
    def dense(q, k, v):
        total, heads, dim = q.shape
        batched = [x.reshape(total // doc_len, doc_len, heads, dim) for x in (q, k, v)]
        out = jax.nn.dot_product_attention(*batched, is_causal=True, implementation=implementation)
        return out.reshape(total, heads, dim)

    return dense


def _pick_baseline(doc_len: int, q: jax.Array) -> tuple[str, Callable]:
    """cuDNN's attention where this jax and GPU run it, else XLA's (named in the row)."""
    for implementation in ("cudnn", "xla"):
        fn = _baseline(doc_len, implementation)
        try:
            jax.block_until_ready(jax.jit(fn)(q, q, q))
        except Exception as error:  # cuDNN missing or refusing the shape: say so, go on
            print(f"  {implementation} attention unavailable: {type(error).__name__}: {error}")
            continue
        return f"dot_product_attention {implementation}", fn
    raise RuntimeError("no baseline attention ran")


def _bench_size(doc_len: int, total: int, heads: int, dim: int, repeats: int) -> list[BenchRow]:
    rng = np.random.default_rng(doc_len)
    q, k, v, d_out = (
        jnp.asarray(rng.standard_normal((total, heads, dim), np.float32), jnp.bfloat16)
        for _ in range(4)
    )
    cu_seqlens = jnp.arange(total // doc_len + 1, dtype=jnp.int32) * doc_len

    def ours(q, k, v):
        return varlen_attention(
            q, k, v, cu_seqlens, cu_seqlens, causal=True, implementation="triton"
        )

    baseline_name, baseline = _pick_baseline(doc_len, q)
    flops = causal_flops(total, doc_len, heads, dim)
    passes = {
        "forward": (jax.jit(ours), jax.jit(baseline), flops),
        "fwd+bwd": (
            jit_with_grads(ours, d_out),
            jit_with_grads(baseline, d_out),
            FWD_BWD_FLOP_FACTOR * flops,
        ),
    }
    shape = f"{total // doc_len}x{doc_len} tok h{heads} d{dim} causal bf16"
    print(f"{shape} vs {baseline_name}:")
    rows = []
    for label, (fn_ours, fn_base, work) in passes.items():
        t_ours, result = repeat_seconds(fn_ours, q, k, v, repeats=repeats)
        t_base, reference = repeat_seconds(fn_base, q, k, v, repeats=repeats)
        errors = relative_errors(result, reference)
        ok = max(errors.values()) < TOLERANCE
        mine, theirs = statistics.median(t_ours), statistics.median(t_base)
        print(
            f"  {label:8s} triton {mine * 1e3:8.3f} ms {work / mine / 1e12:6.1f} TFLOP/s | "
            f"baseline {theirs * 1e3:8.3f} ms {work / theirs / 1e12:6.1f} TFLOP/s | "
            + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
            + (" OK" if ok else " MISMATCH")
        )
        rows.append(
            BenchRow(
                "attention",
                f"varlen_attention {label}",
                shape,
                f"{jax.default_backend()} triton",
                t_ours,
                baseline_name,
                t_base,
                ok,
                flops=work,
                params={"seq_len": doc_len, "total_tokens": total},
            )
        )
    return rows


def main(
    *,
    total: int = TOTAL_TOKENS,
    doc_lens: tuple[int, ...] = DOC_LENS,
    heads: int = NUM_HEADS,
    dim: int = HEAD_DIM,
    repeats: int = REPEATS,
) -> list[BenchRow]:
    """Prints the table; returns a forward and a forward+backward row per document length."""
    print(f"Varlen attention (Triton) vs cuDNN flash attention on {jax.devices()[0].device_kind}")
    return [row for n in doc_lens for row in _bench_size(n, total, heads, dim, repeats)]
