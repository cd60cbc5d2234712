"""GPU benchmark: the Triton block-sparse kernels against dense masked attention.

Run by the `block_sparse` section when JAX's default backend is a GPU, after the sweep.
bfloat16, one sequence of T tokens, 8 heads of 128 (GQA off), forward + backward through
`jax.vjp` (median of `REPEATS` calls after a warm-up), for every mask of the sweep at 8k,
16k and 32k tokens. Baselines, each timed in the same run:

* `dense`: `jax.nn.dot_product_attention` with the mask as a dense boolean array (cuDNN
  where it takes one, else XLA, which materialises the scores: skipped past
  `XLA_DENSE_LIMIT` tokens);
* `cudnn`: cuDNN's own causal or sliding-window attention, for those two masks;
* `varlen`: our Triton varlen kernels, for the document mask.

Every row checks the output and the three gradients against its baseline (relative to the
largest magnitude, bf16 tolerance) and carries the useful FLOPs (4 * head_dim per allowed
pair and head, x3.5 for forward + backward).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.attention_gpu import TOLERANCE
from bench.report import BenchRow
from bench.timing import jit_with_grads, relative_errors, repeat_seconds
from jax_bridge import block_sparse_attention, varlen_attention
from pallas_tpu.splash import CausalMask, DocumentMask, LocalMask

TOKENS = (8192, 16384, 32768)
HEADS, HEAD_DIM, REPEATS = 8, 128, 5
XLA_DENSE_LIMIT = 8192
MASKS = (
    "causal",
    "window 1024",
    "chunked 2048",
    "prefix-LM 2048",
    "16 documents",
    "random 50%",
    "random 90% sparse",
)


def _dense(dense_mask: np.ndarray, implementation: str) -> Callable:
    mask = jnp.asarray(dense_mask)[None, None]
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, implementation=implementation
    )


def _baselines(mask, tokens: int, cu: np.ndarray) -> dict[str, Callable]:
    """The baselines that apply to `mask` (see the module docstring)."""
    dense = np.asarray(mask[0:tokens, 0:tokens])
    found = {"dense cudnn": _dense(dense, "cudnn")}
    if tokens <= XLA_DENSE_LIMIT:
        found["dense xla"] = _dense(dense, "xla")
    if isinstance(mask, CausalMask):
        found["cudnn causal"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    if isinstance(mask, LocalMask):
        left, _ = mask.window_size
        found["cudnn window"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(left, 0), implementation="cudnn"
        )
    if isinstance(mask, DocumentMask):
        starts = jnp.asarray(cu)
        found["varlen triton"] = lambda q, k, v: varlen_attention(
            q[0], k[0], v[0], starts, starts, causal=True, implementation="triton"
        )[None]
    return found


def _row(name, mask, tokens, cu, q, k, v, d_out) -> list[BenchRow]:
    def ours(q, k, v):
        return block_sparse_attention(q, k, v, mask, implementation="triton")

    allowed = float(np.count_nonzero(np.asarray(mask[0:tokens, 0:tokens])))
    flops = 3.5 * 4 * HEAD_DIM * HEADS * allowed
    t_ours, result = repeat_seconds(jit_with_grads(ours, d_out), q, k, v, repeats=REPEATS)
    mine = statistics.median(t_ours)
    shape = f"{tokens} tok h{HEADS} d{HEAD_DIM} {name} bf16"
    print(f"  {shape}: triton {mine * 1e3:8.2f} ms {flops / mine / 1e12:6.1f} TFLOP/s")
    rows = []
    for label, fn in _baselines(mask, tokens, cu).items():
        try:
            t_base, reference = repeat_seconds(jit_with_grads(fn, d_out), q, k, v, repeats=REPEATS)
        except Exception as error:  # a baseline refusing the shape or mask: say so, go on
            print(f"    {label:14s} unavailable: {type(error).__name__}: {str(error)[:120]}")
            continue
        errors = relative_errors(result, reference)
        ok = max(errors.values()) < TOLERANCE
        theirs = statistics.median(t_base)
        print(
            f"    vs {label:14s} {theirs * 1e3:8.2f} ms: {theirs / mine:5.2f}x | "
            + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
            + (" OK" if ok else " MISMATCH")
        )
        rows.append(
            BenchRow(
                "block_sparse",
                "block_sparse_attention fwd+bwd",
                shape,
                f"{jax.default_backend()} triton",
                t_ours,
                label,
                t_base,
                ok,
                flops=flops,
                params={"seq_len": tokens},
            )
        )
    return rows


def main(
    masks: Callable[[int], dict], document_starts: Callable[[int], np.ndarray]
) -> list[BenchRow]:
    """Times every mask of `MASKS` (from the sweep's `masks(tokens)`) at each of `TOKENS`."""
    print(f"block-sparse attention (Triton) on {jax.devices()[0].device_kind}, fwd+bwd, base/ours:")
    rows = []
    for tokens in TOKENS:
        rng = np.random.default_rng(tokens)
        shape = (1, tokens, HEADS, HEAD_DIM)
        q, k, v, d_out = (
            jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16) for _ in range(4)
        )
        for name in MASKS:
            rows += _row(name, masks(tokens)[name], tokens, document_starts(tokens), q, k, v, d_out)
    return rows
