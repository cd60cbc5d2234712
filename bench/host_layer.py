"""Timings and correctness of the packed-sequence host layer at a realistic size.

64 documents with random lengths summing to 131072 tokens. Every function runs under
``jax.jit`` with static sizes; the table shows the median wall time of a few calls after a
compile warm-up, and whether the result equals a numpy loop over documents.

Run: ``python -m bench.host_layer`` (``python -m bench`` calls :func:`main`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from bench.timing import median_seconds
from jax_bridge.host.cu_seqlens import (
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_position_ids,
    prepare_sequence_ids,
    prepare_token_indices,
)
from jax_bridge.host.packing import pack, unpack


@dataclass(frozen=True)
class HostLayerBenchConfig:
    num_docs: int = 64
    total_tokens: int = 131072
    chunk_size: int = 64
    feature_dim: int = 16  # of the padded batch for pack/unpack; keeps it a few tens of MB
    repeats: int = 5
    seed: int = 0


@dataclass(frozen=True)
class BenchCase:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    expected: Any  # numpy oracle; the jitted output is compared to it exactly


def random_lengths(rng: np.random.Generator, num_docs: int, total: int) -> np.ndarray:
    """``[num_docs]`` non-negative lengths summing to ``total``, uneven like real documents."""
    return rng.multinomial(total, rng.dirichlet(np.full(num_docs, 2.0))).astype(np.int32)


def reference_token_indices(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [np.stack([np.full(n, doc), np.arange(n)], axis=1) for doc, n in enumerate(lengths)]
    )


def reference_chunk_indices(lengths: np.ndarray, chunk_size: int, num_chunks: int) -> np.ndarray:
    out = np.full((num_chunks, 2), -1, np.int64)
    row = 0
    for doc, n in enumerate(lengths):
        count = -(-int(n) // chunk_size)
        out[row : row + count] = np.stack([np.full(count, doc), np.arange(count)], axis=1)
        row += count
    return out


def reference_padded(packed: np.ndarray, cu: np.ndarray, max_len: int) -> np.ndarray:
    out = np.zeros((len(cu) - 1, max_len, *packed.shape[1:]), packed.dtype)
    for doc in range(len(cu) - 1):
        out[doc, : cu[doc + 1] - cu[doc]] = packed[cu[doc] : cu[doc + 1]]
    return out


def build_cases(config: HostLayerBenchConfig) -> list[BenchCase]:
    rng = np.random.default_rng(config.seed)
    total, chunk = config.total_tokens, config.chunk_size
    lengths = random_lengths(rng, config.num_docs, total)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    max_len = int(lengths.max())
    packed = rng.standard_normal((total, config.feature_dim)).astype(np.float32)
    padded = reference_padded(packed, cu, max_len)
    tokens = reference_token_indices(lengths)
    num_chunks = -(-total // chunk) + config.num_docs  # the documented static bound
    chunk_counts = -(-lengths.astype(np.int64) // chunk)
    static_tokens = {"total_tokens": total}
    return [
        BenchCase(
            "prepare_position_ids",
            jax.jit(functools.partial(prepare_position_ids, **static_tokens)),
            (cu,),
            tokens[:, 1],
        ),
        BenchCase(
            "prepare_sequence_ids",
            jax.jit(functools.partial(prepare_sequence_ids, **static_tokens)),
            (cu,),
            tokens[:, 0],
        ),
        BenchCase(
            "prepare_token_indices",
            jax.jit(functools.partial(prepare_token_indices, **static_tokens)),
            (cu,),
            tokens,
        ),
        BenchCase(
            f"prepare_chunk_indices C={chunk}",
            jax.jit(functools.partial(prepare_chunk_indices, chunk_size=chunk, **static_tokens)),
            (cu,),
            reference_chunk_indices(lengths, chunk, num_chunks),
        ),
        BenchCase(
            f"prepare_chunk_offsets C={chunk}",
            jax.jit(functools.partial(prepare_chunk_offsets, chunk_size=chunk)),
            (cu,),
            np.concatenate([[0], np.cumsum(chunk_counts)]),
        ),
        BenchCase(
            "pack (lengths)",
            jax.jit(lambda x, n: pack(x, n, total_tokens=total)[0]),
            (padded, lengths),
            packed,
        ),
        BenchCase(
            "pack (mask)",
            jax.jit(lambda x, m: pack(x, m, total_tokens=total)[0]),
            (padded, np.arange(max_len)[None, :] < lengths[:, None]),
            packed,
        ),
        BenchCase(
            "unpack",
            jax.jit(functools.partial(unpack, batch=config.num_docs, max_len=max_len)),
            (packed, cu),
            padded,
        ),
    ]


def main() -> list[str]:
    """Prints the table; returns the names of cases whose result differs from the oracle."""
    config = HostLayerBenchConfig()
    print(
        f"host layer: {config.num_docs} docs, {config.total_tokens} tokens, "
        f"backend={jax.default_backend()}, median of {config.repeats} jitted calls"
    )
    print(f"{'name':<30} {'output shape':<18} {'median ms':>10}  check")
    failures = []
    for case in build_cases(config):
        seconds, out = median_seconds(case.fn, *case.args, repeats=config.repeats)
        ok = out.shape == case.expected.shape and np.array_equal(np.asarray(out), case.expected)
        shape = "x".join(map(str, out.shape))
        print(f"{case.name:<30} {shape:<18} {seconds * 1e3:>10.3f}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"host layer: {case.name}")
    return failures


if __name__ == "__main__":
    main()
