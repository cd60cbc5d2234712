"""Timings and correctness of the packed-sequence host layer at a realistic size.

64 documents with random lengths summing to 131072 tokens. These functions are meant to
run inside a jitted training step, on arrays already on the device, so that is what a
row times: `calls_per_step` calls of the op in one jitted loop (`in_step`), inputs placed
on the device beforehand, the loop's median wall time divided by the number of calls.
A single eager call would add a jit dispatch (tens of microseconds, more than the whole
numpy baseline of the small ops) and, for the padded batch, a host-to-device copy of its
23 MB on every call: costs a step pays once, not per op. That single-call time is printed
in the section's own table and kept in each row's `params["one_call_s"]`.

The baseline is a numpy loop over documents on host arrays, timed per call; every result
must equal it exactly. Each row's `bytes` is what the op must read and write (its inputs
plus its output): the summary's throughput column is that over the median time.

Run: ``python -m bench.host_layer`` (``python -m bench`` calls :func:`main`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from bench.report import BenchRow
from bench.timing import repeat_seconds
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
    calls_per_step: int = 32  # op calls in one timed jitted loop (dispatch amortised)


@dataclass(frozen=True)
class BenchCase:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    reference: Callable[[], np.ndarray]  # numpy oracle and baseline; compared exactly


def random_lengths(rng: np.random.Generator, num_docs: int, total: int) -> np.ndarray:
    """``[num_docs]`` non-negative lengths summing to ``total``, uneven like real documents."""
    return rng.multinomial(total, rng.dirichlet(np.full(num_docs, 2.0))).astype(np.int32)


def reference_token_indices(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [np.stack([np.full(n, doc), np.arange(n)], axis=1) for doc, n in enumerate(lengths)]
    )


def reference_chunk_indices(lengths: np.ndarray, chunk_size: int, num_chunks: int) -> np.ndarray:
    """[num_chunks, 2] (document, chunk) rows, then -1 rows; more rows than `num_chunks`
    when the chunks do not fit (the comparison then fails on the shape)."""
    counts = -(-lengths.astype(np.int64) // chunk_size)
    out = np.full((max(num_chunks, int(counts.sum())), 2), -1, np.int64)
    row = 0
    for doc, count in enumerate(counts):
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
    valid = np.arange(max_len)[None, :] < lengths[:, None]
    # The library's static row count (its documented bound), read from its output shape.
    num_chunks = jax.eval_shape(
        functools.partial(prepare_chunk_indices, chunk_size=chunk, total_tokens=total), cu
    ).shape[0]
    static_tokens = {"total_tokens": total}
    return [
        BenchCase(
            "prepare_position_ids",
            jax.jit(functools.partial(prepare_position_ids, **static_tokens)),
            (cu,),
            lambda: reference_token_indices(lengths)[:, 1],
        ),
        BenchCase(
            "prepare_sequence_ids",
            jax.jit(functools.partial(prepare_sequence_ids, **static_tokens)),
            (cu,),
            lambda: reference_token_indices(lengths)[:, 0],
        ),
        BenchCase(
            "prepare_token_indices",
            jax.jit(functools.partial(prepare_token_indices, **static_tokens)),
            (cu,),
            lambda: reference_token_indices(lengths),
        ),
        BenchCase(
            f"prepare_chunk_indices C={chunk}",
            jax.jit(functools.partial(prepare_chunk_indices, chunk_size=chunk, **static_tokens)),
            (cu,),
            lambda: reference_chunk_indices(lengths, chunk, num_chunks),
        ),
        BenchCase(
            f"prepare_chunk_offsets C={chunk}",
            jax.jit(functools.partial(prepare_chunk_offsets, chunk_size=chunk)),
            (cu,),
            lambda: np.concatenate([[0], np.cumsum(-(-lengths.astype(np.int64) // chunk))]),
        ),
        BenchCase(
            "pack (lengths)",
            jax.jit(lambda x, n: pack(x, n, total_tokens=total)[0]),
            (padded, lengths),
            lambda: np.concatenate([padded[doc, :n] for doc, n in enumerate(lengths)]),
        ),
        BenchCase(
            "pack (mask)",
            jax.jit(lambda x, m: pack(x, m, total_tokens=total)[0]),
            (padded, valid),
            lambda: padded[valid],
        ),
        BenchCase(
            "unpack",
            jax.jit(functools.partial(unpack, batch=config.num_docs, max_len=max_len)),
            (packed, cu),
            lambda: reference_padded(packed, cu, max_len),
        ),
    ]


def in_step(fn: Callable[..., Any], calls: int) -> Callable[..., Any]:
    """A jitted function that runs `fn(*args)` `calls` times in one loop and returns the
    last result (equal to `fn(*args)`).

    Invariant: every iteration computes `fn` afresh. The arguments travel through the loop
    behind an optimization barrier, so XLA cannot see that they never change: it can
    neither hoist the op out of the loop nor merge the iterations into one; the result is
    carried out of the loop, so no iteration is dead code.
    """

    def body(_, carry):
        args, _ = carry
        args = jax.lax.optimization_barrier(args)
        return args, fn(*args)

    @jax.jit
    def run(*args):
        first = jax.eval_shape(fn, *args)
        init = (args, jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), first))
        return jax.lax.fori_loop(0, calls, body, init)[1]

    return run


def time_case(
    case: BenchCase, config: HostLayerBenchConfig
) -> tuple[tuple[float, ...], Any, float]:
    """(per-call times of `case.fn` inside a jitted loop, its output, the median time of
    one eager call with host inputs: the dispatch and transfer the loop amortises)."""
    on_device = jax.device_put(case.args)
    calls = config.calls_per_step
    loop_times, out = repeat_seconds(in_step(case.fn, calls), *on_device, repeats=config.repeats)
    one_call, _ = repeat_seconds(case.fn, *case.args, repeats=config.repeats)
    return tuple(t / calls for t in loop_times), out, statistics.median(one_call)


def main(config: HostLayerBenchConfig | None = None) -> list[BenchRow]:
    """Prints the table; returns one row per case (baseline: its numpy oracle)."""
    config = config or HostLayerBenchConfig()
    backend, calls = jax.default_backend(), config.calls_per_step
    print(
        f"host layer: {config.num_docs} docs, {config.total_tokens} tokens, backend={backend}; "
        f"in step: per call of {calls} in one jitted loop, inputs on the device (median of "
        f"{config.repeats}); one call: a single eager call with numpy inputs"
    )
    print(f"{'name':<30} {'output shape':<18} {'in step ms':>10} {'one call ms':>11}  check")
    rows = []
    for case in build_cases(config):
        times, out, one_call = time_case(case, config)
        numpy_times, expected = _time_numpy(case.reference, config.repeats)
        ok = out.shape == expected.shape and np.array_equal(np.asarray(out), expected)
        shape = "x".join(map(str, out.shape))
        median = statistics.median(times)
        print(
            f"{case.name:<30} {shape:<18} {median * 1e3:>10.3f} {one_call * 1e3:>11.3f}  "
            f"{'ok' if ok else 'MISMATCH'}"
        )
        rows.append(
            BenchRow(
                "host_layer",
                case.name,
                f"{shape}, per call of {calls} in one jit",
                f"{backend} in step",
                times,
                "numpy",
                numpy_times,
                ok,
                bytes=io_bytes(case.args, out),
                params={
                    "total_tokens": config.total_tokens,
                    "num_docs": config.num_docs,
                    "calls_per_step": calls,
                    "one_call_s": one_call,
                },
            )
        )
    return rows


def io_bytes(args: tuple[Any, ...], out: Any) -> float:
    """Bytes an op must move at least: every input read once, its output written once."""
    return float(sum(np.asarray(a).nbytes for a in args) + np.asarray(out).nbytes)


def _time_numpy(reference: Callable[[], np.ndarray], repeats: int) -> tuple[tuple[float, ...], Any]:
    """Wall times of `repeats` calls of the numpy oracle, and its result."""
    expected = reference()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        reference()
        times.append(time.perf_counter() - start)
    return tuple(times), expected


if __name__ == "__main__":
    main()
