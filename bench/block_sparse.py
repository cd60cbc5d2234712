"""Block-sparse attention: the sparsity sweep and the XLA path against dense attention.

1. The sweep (no timing): for causal, sliding window (1024), chunked causal (2048),
   prefix-LM (2048 prompt), 16 causal documents and random 50% / 90% block sparsity, at
   8k and 16k tokens (and 32k with `--full`: the random masks are predicates evaluated per
   element, ~9 s each there) and 128 x 128 blocks, the blocks `block_sparse_attention` visits
   against the blocks of the dense grid (`jax_bridge.block_sparse.masks.block_counts`),
   and how many of the visited ones need an element mask (partial).
2. Timed at 2048 tokens (4096 with `--full`: the dense baseline then takes ~2 s a call),
   2 heads of 64, float32, forward + backward (jit, median of 3):
   `block_sparse_attention(implementation="xla")` against `jax.nn.dot_product_attention`
   with the dense boolean mask, and, for the document mask, against our
   `varlen_attention(implementation="xla")` too. Every row checks its output and
   gradients against the dense result.
On a GPU, part 2 is bench/block_sparse_gpu.py instead: the Triton kernels in bfloat16 at
16k tokens against cuDNN, PyTorch's SDPA and FlexAttention (bench/gpu_rows.py).
Rows carry the useful FLOPs: 4 * head_dim per allowed (query, key) pair and head, times
3.5 for forward + backward (bench/report.py).
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import FWD_BWD_FLOP_FACTOR, BenchRow
from bench.timing import jit_with_grads, relative_errors, repeat_seconds
from jax_bridge import block_sparse_attention, varlen_attention
from jax_bridge.block_sparse.masks import block_counts
from pallas_tpu.splash import (
    BlockSizes,
    CausalMask,
    ChunkedCausalMask,
    DocumentMask,
    LocalMask,
    PredicateMask,
    PrefixLMMask,
)

# (sweep lengths, timed length) per mode.
QUICK_TOKENS = ((8192, 16384), 2048)
FULL_TOKENS = ((8192, 16384, 32768), 4096)
BLOCK = 128
HEADS, HEAD_DIM, REPEATS = 2, 64, 3
TOLERANCE = 1e-4  # float32, HIGHEST: only the summation order differs


class RandomBlocks:
    """A predicate keeping each (BLOCK x BLOCK) block with probability `density`; one
    object per (tokens, density), so equal masks share their cached block lists."""

    def __init__(self, tokens: int, density: float, seed: int = 0):
        blocks = -(-tokens // BLOCK)
        self.keep = np.random.default_rng(seed).random((blocks, blocks)) < density
        self.keep[np.arange(blocks), np.arange(blocks)] = True  # no query row left empty

    def __call__(self, q, kv):
        return self.keep[q // BLOCK, kv // BLOCK]


def document_starts(tokens: int) -> np.ndarray:
    """cu_seqlens of 16 equal documents."""
    return np.linspace(0, tokens, 17).astype(np.int32)


@functools.cache
def masks(tokens: int) -> dict:
    """The sweep's masks at `tokens` (cached: RandomBlocks compare by identity)."""
    shape = (tokens, tokens)
    cu = document_starts(tokens)
    return {
        "causal": CausalMask(shape),
        "window 1024": LocalMask(shape, (1024, 0), 0),
        "chunked 2048": ChunkedCausalMask(shape, 2048),
        "prefix-LM 2048": PrefixLMMask(shape, 2048),
        "16 documents": DocumentMask(cu, shape=shape, causal=True),
        "random 50%": PredicateMask(shape, RandomBlocks(tokens, 0.5), name="random 50%"),
        "random 90% sparse": PredicateMask(shape, RandomBlocks(tokens, 0.1), name="random 10%"),
    }


def sweep(lengths: tuple[int, ...]) -> None:
    """Prints visited / dense blocks per mask and length."""
    print(f"blocks visited / dense grid ({BLOCK} x {BLOCK} blocks; partial in brackets):")
    print(f"{'mask':18s}" + "".join(f"{t:>22d}" for t in lengths))
    for name in masks(lengths[0]):
        cells = []
        for tokens in lengths:
            c = block_counts(masks(tokens)[name], block_sizes=_blocks())
            cells.append(f"{c.visited}/{c.dense} ({c.partial}) {c.visited / c.dense:4.0%}")
        print(f"{name:18s}" + "".join(f"{cell:>22s}" for cell in cells))


def _blocks() -> BlockSizes:
    return BlockSizes(block_q=BLOCK, block_kv=BLOCK)


def _dense_mask(mask, tokens: int) -> np.ndarray:
    return np.asarray(mask[0:tokens, 0:tokens])


def _dense_attention(q, k, v, mask, _cu):
    """The dense baseline, in exact float32 products as ours (XLA's default precision is
    TF32 on a GPU, where this CPU section may still be called)."""
    with jax.default_matmul_precision("float32"):
        return jax.nn.dot_product_attention(q, k, v, mask=mask)


def _timed_row(name: str, mask, q, k, v, d_out) -> list[BenchRow]:
    dense = jnp.asarray(_dense_mask(mask, q.shape[1]))[None, None]
    methods = {
        "ours": lambda q, k, v, *_: block_sparse_attention(
            q, k, v, mask, block_sizes=_blocks(), implementation="xla"
        ),
        "dense": _dense_attention,
    }
    cu = jnp.asarray(document_starts(q.shape[1]))
    if isinstance(mask, DocumentMask):
        methods["varlen"] = lambda q, k, v, _, cu: varlen_attention(
            q[0], k[0], v[0], cu, cu, causal=True, implementation="xla"
        )[None]
    timed = {
        m: repeat_seconds(jit_with_grads(f, d_out), q, k, v, dense, cu, repeats=REPEATS)
        for m, f in methods.items()
    }
    allowed = float(np.count_nonzero(dense))
    flops = FWD_BWD_FLOP_FACTOR["attention"] * 4 * HEAD_DIM * HEADS * allowed
    shape = f"{q.shape[1]} tok h{HEADS} d{HEAD_DIM} {name} f32"
    rows = []
    for baseline in [m for m in methods if m != "ours"]:
        error = max(relative_errors(timed["ours"][1], timed[baseline][1]).values())
        ok = error < TOLERANCE
        ratio = statistics.median(timed[baseline][0]) / statistics.median(timed["ours"][0])
        print(f"  {name:18s} vs {baseline:6s}: {ratio:5.2f}x, max error {error:.1e}")
        label = "dot_product_attention (dense mask)" if baseline == "dense" else "varlen xla"
        rows.append(
            BenchRow(
                "block_sparse",
                "block_sparse_attention fwd+bwd",
                shape,
                f"{jax.default_backend()} xla",
                timed["ours"][0],
                label,
                timed[baseline][0],
                ok,
                flops=flops,
                params={"seq_len": q.shape[1]},
            )
        )
    return rows


def main(*, full: bool = False) -> list[BenchRow]:
    """Prints the sweep and the timed comparisons; returns the timed rows (on a GPU: the
    Triton kernels', bench/block_sparse_gpu.py, at either size). `full`: `python -m bench
    --full`'s sizes."""
    lengths, timed_tokens = FULL_TOKENS if full else QUICK_TOKENS
    sweep(lengths)
    if jax.default_backend() == "gpu":
        from bench import block_sparse_gpu

        return block_sparse_gpu.main()
    rng = np.random.default_rng(0)
    shape = (1, timed_tokens, HEADS, HEAD_DIM)
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    print(f"fwd+bwd at {timed_tokens} tokens, base/ours (> 1: ours is faster):")
    chosen = ("causal", "16 documents", "random 90% sparse")
    return [
        row
        for name in chosen
        for row in _timed_row(name, masks(timed_tokens)[name], q, k, v, d_out)
    ]
