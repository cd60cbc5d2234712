"""Benchmark: grouped matmul (the MoE expert matmul), forward and forward+backward.

CPU: our XLA path (`grouped_matmul(implementation="xla")`) against `jax.lax.ragged_dot`
and against a dense per-group loop (one jitted `lhs[rows] @ rhs[g]` per group, sizes
static): 8192 tokens over 64 experts, float32. XLA's CPU backend runs `ragged_dot` as a
dense product per group (64 times the FLOPs), so at the issue's k=2048, n=1408 one
forward takes about a minute here; k and n are therefore cut to 512 and 352 (same
tokens, experts and aspect) unless GMM_BENCH_FULL=1.

GPU (when present): TFLOP/s of the Triton kernels against `jax.lax.ragged_dot` at the
full shape in bfloat16.

Run with `python -m bench.grouped_matmul` (or through `python -m bench`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.grouped_matmul.api import grouped_matmul

M, K, N, GROUPS = 8192, 2048, 1408, 64
CPU_K, CPU_N = 512, 352


def _group_sizes(m: int, groups: int, seed: int = 0) -> np.ndarray:
    """Uneven routing: expert popularity from a Dirichlet, a few experts left empty."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(groups, 0.7))
    weights[rng.choice(groups, size=groups // 16, replace=False)] = 0.0
    return rng.multinomial(m, weights / weights.sum()).astype(np.int32)


def _seconds(fn: Callable, *args, repeats: int) -> tuple[float, float, object]:
    """(first call incl. compile, best of `repeats` later calls, the result)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return first, best, result


def _per_group_loop(sizes: tuple[int, ...]) -> Callable:
    """Dense baseline: one matmul per group on its static row slice."""

    def gmm(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        outs, start = [], 0
        for g, size in enumerate(sizes):
            outs.append(lhs[start : start + size] @ rhs[g])
            start += size
        outs.append(jnp.zeros((lhs.shape[0] - start, rhs.shape[2]), lhs.dtype))
        return jnp.concatenate(outs)

    return gmm


def _loss_grad(gmm: Callable) -> Callable:
    # A cotangent that is not all ones, so the backward pass does real work.
    return jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(gmm(a, b))), argnums=(0, 1)))


def _cpu(m: int, k: int, n: int, groups: int) -> list[str]:
    sizes = _group_sizes(m, groups)
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32))
    rhs = jnp.asarray(rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k))
    group_sizes = jnp.asarray(sizes)
    methods = {
        "ours (xla)": lambda a, b: grouped_matmul(a, b, group_sizes, implementation="xla"),
        "ragged_dot": lambda a, b: jax.lax.ragged_dot(a, b, group_sizes),
        "dense loop": _per_group_loop(tuple(int(s) for s in sizes)),
    }
    print(
        f"grouped_matmul CPU float32: m={m} k={k} n={n}, {groups} groups "
        f"({int((sizes == 0).sum())} empty, largest {sizes.max()} rows)"
    )
    failures = []
    for label, make, repeats in (("forward", jax.jit, 2), ("fwd+bwd", _loss_grad, 1)):
        times, results = {}, {}
        for name, f in methods.items():
            first, times[name], results[name] = _seconds(make(f), lhs, rhs, repeats=repeats)
            print(f"  {label} {name:<11} {times[name] * 1e3:9.1f} ms  (first call {first:.1f} s)")
        ours = times["ours (xla)"]
        print(
            f"  {label} ratios: ours/ragged_dot = {ours / times['ragged_dot']:.2f}x, "
            f"ours/dense loop = {ours / times['dense loop']:.1f}x; "
            f"max |ours - dense loop| = {_max_difference(results):.1e}"
        )
        # float32 sums over k = 512..2048 terms of unit-scale products.
        if not _max_difference(results) < 1e-3:
            failures.append(f"grouped_matmul {label}: xla path differs from the dense loop")
    return failures


def _max_difference(results: dict[str, object]) -> float:
    ours = jax.tree.leaves(results["ours (xla)"])
    loop = jax.tree.leaves(results["dense loop"])
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ours, loop, strict=True))


def _gpu(m: int, k: int, n: int, groups: int) -> None:
    sizes = jnp.asarray(_group_sizes(m, groups))
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    methods = {
        "ours (triton)": lambda a, b: grouped_matmul(a, b, sizes, implementation="triton"),
        "ragged_dot": lambda a, b: jax.lax.ragged_dot(
            a, b, sizes, preferred_element_type=jnp.float32
        ),
    }
    flops = 2 * m * k * n
    print(f"grouped_matmul GPU bfloat16: m={m} k={k} n={n}, {groups} groups")
    for label, make, work in (("forward", jax.jit, flops), ("fwd+bwd", _loss_grad, 3 * flops)):
        tflops = {}
        for name, f in methods.items():
            _, best, _ = _seconds(make(f), lhs, rhs, repeats=20)
            tflops[name] = work / best / 1e12
            print(f"  {label} {name:<13} {best * 1e3:8.3f} ms  {tflops[name]:6.1f} TFLOP/s")
        ratio = tflops["ours (triton)"] / tflops["ragged_dot"]
        print(f"  {label} ours/ragged_dot throughput = {ratio:.2f}x")


def main() -> list[str]:
    """Prints the table; returns the names of failed correctness checks."""
    if jax.default_backend() in ("cuda", "rocm", "gpu"):
        _gpu(M, K, N, GROUPS)
        return []
    full = os.environ.get("GMM_BENCH_FULL") == "1"
    return _cpu(M, K if full else CPU_K, N if full else CPU_N, GROUPS)


if __name__ == "__main__":
    main()
