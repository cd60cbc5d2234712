"""CPU benchmark: blockwise varlen attention (implementation="xla") vs dense masked attention.

8192 packed tokens in 16 documents of 512, causal, 2 heads of 64 (float32). The dense
baseline is `jax.nn.dot_product_attention` over the whole packed axis with the equivalent
block-diagonal causal mask, i.e. a [8192, 8192] score matrix per head; the varlen path
only visits the key blocks inside each document's causal range. Reported: median wall
times (jit, after a warm-up) of the forward and of forward+backward, their ratio, the
FLOP ratio, and the largest difference between the two results.

Run through `python -m bench attention`, which keeps JAX on the CPU when there is no GPU
(`JAX_PLATFORMS=cpu python -m bench.attention` runs this section alone).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import BenchRow
from bench.timing import repeat_seconds
from jax_bridge.attention.api import varlen_attention

NUM_DOCS = 16
DOC_LEN = 512
NUM_HEADS = 2  # the dense baseline holds several [heads, 8192, 8192] f32 arrays
HEAD_DIM = 64
REPEATS = 3


def _inputs():
    total = NUM_DOCS * DOC_LEN
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((total, NUM_HEADS, HEAD_DIM)), jnp.float32)
        for _ in range(3)
    )
    cu_seqlens = jnp.arange(NUM_DOCS + 1, dtype=jnp.int32) * DOC_LEN
    doc = np.arange(total) // DOC_LEN
    pos = np.arange(total)
    # Block-diagonal causal mask: same document and key not after query.
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return q, k, v, cu_seqlens, jnp.asarray(mask)


def main() -> list[BenchRow]:
    """Prints the table; returns the forward and forward+backward rows (baseline: dense)."""
    total = NUM_DOCS * DOC_LEN
    print(
        f'Varlen attention (implementation="xla") vs dense masked attention\n'
        f"{jax.default_backend()}: {total} tokens in {NUM_DOCS} documents of {DOC_LEN}, causal, "
        f"{NUM_HEADS} heads x {HEAD_DIM}, float32, median of {REPEATS}"
    )
    q, k, v, cu_seqlens, mask = _inputs()

    def varlen(q, k, v):
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True, implementation="xla")

    def dense(q, k, v):
        return jax.nn.dot_product_attention(
            q[None], k[None], v[None], mask=mask[None, None], implementation="xla"
        )[0]

    d_out = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def with_grads(fn):
        def run(q, k, v):
            out, pullback = jax.vjp(fn, q, k, v)
            return out, pullback(d_out)

        return jax.jit(run)

    varlen_fwd, dense_fwd = jax.jit(varlen), jax.jit(dense)
    varlen_bwd, dense_bwd = with_grads(varlen), with_grads(dense)

    # Matmul FLOPs (QK^T and PV): dense covers T^2 pairs per head; varlen covers each
    # document's L^2 pairs (its key-block loop stops at the causal edge, so it does
    # roughly half of that plus the diagonal blocks).
    flop_ratio = total**2 / (NUM_DOCS * DOC_LEN**2)
    causal_ratio = total**2 / (NUM_DOCS * DOC_LEN * (DOC_LEN + 1) / 2)

    rows = []
    for label, ours, baseline in (
        ("forward", varlen_fwd, dense_fwd),
        ("fwd+bwd", varlen_bwd, dense_bwd),
    ):
        t_ours, result = repeat_seconds(ours, q, k, v, repeats=REPEATS)
        t_dense, reference = repeat_seconds(baseline, q, k, v, repeats=REPEATS)
        rows.append((label, t_ours, t_dense))
    # The last pair of results is forward+backward: (out, (dq, dk, dv)) each.
    (out, (dq, dk, dv)), (ref, (rdq, rdk, rdv)) = result, reference

    print(f"{'':18s} {'varlen xla':>12s} {'dense masked':>13s} {'time ratio':>11s}")
    for label, times_ours, times_dense in rows:
        t_ours, t_dense = statistics.median(times_ours), statistics.median(times_dense)
        print(
            f"{label:18s} {t_ours * 1e3:10.1f}ms {t_dense * 1e3:11.1f}ms {t_dense / t_ours:10.1f}x"
        )
    print(
        f"FLOP ratio dense/varlen: {flop_ratio:.1f}x per-document blocks "
        f"({causal_ratio:.1f}x counting only the causal triangles)"
    )

    errors = {
        name: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for name, a, b in (("out", out, ref), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv))
    }
    worst = max(errors.values())
    status = "OK" if worst < 1e-4 else "MISMATCH"
    details = ", ".join(f"{name} {err:.1e}" for name, err in errors.items())
    print(f"correctness vs dense (max abs error / max abs value): {details} -> {status}")
    shape = f"{NUM_DOCS}x{DOC_LEN} tok h{NUM_HEADS} d{HEAD_DIM} causal f32"
    return [
        BenchRow(
            "attention",
            f"varlen_attention {label}",
            shape,
            f"{jax.default_backend()} xla",
            times_ours,
            "jax.nn.dot_product_attention",
            times_dense,
            status == "OK",
        )
        for label, times_ours, times_dense in rows
    ]


if __name__ == "__main__":
    main()
