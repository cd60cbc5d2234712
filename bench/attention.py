"""CPU benchmark: blockwise varlen attention (implementation="xla") vs dense masked attention.

On a GPU, `main` runs bench/attention_gpu.py instead (the Triton kernels against cuDNN).

Packed documents, causal, 2 heads of 64 (float32): quick (the default), 8 documents of
64, 128 and 256 tokens (512 to 2048 tokens); `--full`, 16 documents of 128, 256 and 512
(2048 to 8192 tokens: the dense baseline's forward + backward then takes seconds a call).
The dense baseline is `jax.nn.dot_product_attention` over the whole packed axis with the
equivalent block-diagonal causal mask, i.e. a [tokens, tokens] score matrix per head; the
varlen path only visits the key blocks inside each document's causal range.
Reported: median wall times (jit, after a warm-up) of the forward and of forward+backward,
their ratio, the FLOP ratio, and the largest difference between the two results, per
document length. The rows carry the useful FLOPs (allowed causal entries only;
bench/report.py) and the document length as `params["seq_len"]` for `--plot`.

Run through `python -m bench attention`, which keeps JAX on the CPU when there is no GPU
(`JAX_PLATFORMS=cpu python -m bench.attention` runs this section alone).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import FWD_BWD_FLOP_FACTOR as REPORT_FACTORS
from bench.report import BenchRow
from bench.timing import jit_with_grads, repeat_seconds
from jax_bridge.attention.api import varlen_attention

# (documents, per-document lengths): one table block per length.
QUICK_SIZES = (8, (64, 128, 256))
FULL_SIZES = (16, (128, 256, 512))
NUM_HEADS = 2  # the dense baseline holds several [heads, 8192, 8192] f32 arrays
HEAD_DIM = 64
REPEATS = 3
TOLERANCE = 1e-4  # max abs error / max abs value, float32 (summation order only)
FWD_BWD_FLOP_FACTOR = REPORT_FACTORS["attention"]  # bench/report.py


def _inputs(num_docs: int, doc_len: int):
    """q, k, v [num_docs * doc_len, NUM_HEADS, HEAD_DIM] f32, cu_seqlens int32 [num_docs + 1]
    and the dense baseline's bool mask [tokens, tokens]."""
    total = num_docs * doc_len
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((total, NUM_HEADS, HEAD_DIM)), jnp.float32)
        for _ in range(3)
    )
    cu_seqlens = jnp.arange(num_docs + 1, dtype=jnp.int32) * doc_len
    doc = np.arange(total) // doc_len
    pos = np.arange(total)
    # Block-diagonal causal mask: same document and key not after query.
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return q, k, v, cu_seqlens, jnp.asarray(mask)


def forward_flops(num_docs: int, doc_len: int) -> float:
    """Useful forward FLOPs: 4 * HEAD_DIM per allowed (query, key) entry and head (QK^T and
    PV); a causal document of L tokens allows L (L + 1) / 2 entries."""
    return 4.0 * HEAD_DIM * NUM_HEADS * num_docs * doc_len * (doc_len + 1) / 2


def _functions(q: jax.Array, cu_seqlens: jax.Array, mask: jax.Array) -> dict:
    """{label: (ours, dense baseline)}, jitted: forward, and forward + backward (vjp)."""

    def varlen(q, k, v):
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True, implementation="xla")

    def dense(q, k, v):
        return jax.nn.dot_product_attention(
            q[None], k[None], v[None], mask=mask[None, None], implementation="xla"
        )[0]

    d_out = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    return {
        "forward": (jax.jit(varlen), jax.jit(dense)),
        "fwd+bwd": (jit_with_grads(varlen, d_out), jit_with_grads(dense, d_out)),
    }


def _bench_size(num_docs: int, doc_len: int) -> list[BenchRow]:
    """Prints one block of the table; returns its forward and forward+backward rows."""
    total = num_docs * doc_len
    q, k, v, cu_seqlens, mask = _inputs(num_docs, doc_len)
    timed = {}
    for label, (ours, baseline) in _functions(q, cu_seqlens, mask).items():
        t_ours, result = repeat_seconds(ours, q, k, v, repeats=REPEATS)
        t_dense, reference = repeat_seconds(baseline, q, k, v, repeats=REPEATS)
        timed[label] = (t_ours, t_dense)
    # The last pair of results is forward+backward: (out, (dq, dk, dv)) each.
    (out, (dq, dk, dv)), (ref, (rdq, rdk, rdv)) = result, reference

    print(f"{total} tokens in {num_docs} documents of {doc_len}:")
    print(f"{'':18s} {'varlen xla':>12s} {'dense masked':>13s} {'time ratio':>11s}")
    for label, (times_ours, times_dense) in timed.items():
        t_ours, t_dense = statistics.median(times_ours), statistics.median(times_dense)
        print(
            f"{label:18s} {t_ours * 1e3:10.1f}ms {t_dense * 1e3:11.1f}ms {t_dense / t_ours:10.1f}x"
        )
    # Matmul FLOPs (QK^T and PV): dense covers T^2 pairs per head; varlen covers each
    # document's L^2 pairs (its key-block loop stops at the causal edge, so it does
    # roughly half of that plus the diagonal blocks).
    flop_ratio = total**2 / (num_docs * doc_len**2)
    causal_ratio = total**2 / (num_docs * doc_len * (doc_len + 1) / 2)
    print(
        f"FLOP ratio dense/varlen: {flop_ratio:.1f}x per-document blocks "
        f"({causal_ratio:.1f}x counting only the causal triangles)"
    )

    errors = {
        name: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for name, a, b in (("out", out, ref), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv))
    }
    ok = max(errors.values()) < TOLERANCE
    details = ", ".join(f"{name} {err:.1e}" for name, err in errors.items())
    print(
        f"correctness vs dense (max abs error / max abs value): {details} -> "
        f"{'OK' if ok else 'MISMATCH'}"
    )
    shape = f"{num_docs}x{doc_len} tok h{NUM_HEADS} d{HEAD_DIM} causal f32"
    flops = {"forward": forward_flops(num_docs, doc_len)}
    flops["fwd+bwd"] = FWD_BWD_FLOP_FACTOR * flops["forward"]
    return [
        BenchRow(
            "attention",
            f"varlen_attention {label}",
            shape,
            f"{jax.default_backend()} xla",
            times_ours,
            "jax.nn.dot_product_attention",
            times_dense,
            ok,
            flops=flops[label],
            params={"seq_len": doc_len, "num_docs": num_docs, "total_tokens": total},
        )
        for label, (times_ours, times_dense) in timed.items()
    ]


def main(*, full: bool = False) -> list[BenchRow]:
    """Prints the table; returns the forward and forward+backward rows of every document
    length (baseline: dense); on a GPU, the Triton kernels against cuDNN instead (the same
    rows at either size). `full`: `python -m bench --full`'s sizes."""
    if jax.default_backend() in ("cuda", "rocm", "gpu"):
        from bench import attention_gpu

        return attention_gpu.main()
    num_docs, doc_lens = FULL_SIZES if full else QUICK_SIZES
    print(
        f'Varlen attention (implementation="xla") vs dense masked attention\n'
        f"{jax.default_backend()}: {num_docs} documents of {', '.join(map(str, doc_lens))} "
        f"tokens, causal, {NUM_HEADS} heads x {HEAD_DIM}, float32, median of {REPEATS}"
    )
    return [row for doc_len in doc_lens for row in _bench_size(num_docs, doc_len)]


if __name__ == "__main__":
    import sys

    main(full="--full" in sys.argv[1:])
