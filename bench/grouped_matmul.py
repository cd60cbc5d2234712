"""Benchmark: grouped matmul (the MoE expert matmul), forward and forward+backward.

CPU: our XLA path (`grouped_matmul(implementation="xla")`, the tile loop of
`jax_bridge.grouped_matmul.xla`) against `jax.lax.ragged_dot` and against a dense
per-group loop (one jitted `lhs[rows] @ rhs[g]` per group, sizes static): tokens routed
over 64, 16 and 8 experts, float32; times are medians. XLA's CPU backend runs
`ragged_dot` as a dense product per group (num_groups times the FLOPs), so it is timed
forward only, with one repeat (its backward would take seconds a call). By default m, k
and n are cut to 4096, 512 and 352 (same experts and aspect); `--full` runs the issue's
m=8192, k=2048, n=1408 (several minutes).

GPU (when present): the Triton kernels in bfloat16 at m8192 k2048 n1408 G64 and m32768
k4096 n2048 G32 against `jax.lax.ragged_dot`, a dense matmul of the same FLOPs (cuBLAS,
the roofline) and `torch._grouped_mm` where PyTorch imports (bench/gpu_rows.py, timed by
bench/runner.py).

Rows carry the useful FLOPs (2 m k n forward over the m routed rows, 3x that forward +
backward; bench/report.py) and `params["num_groups"]` for `python -m bench --plot`.

Run with `python -m bench grouped_matmul` (`--full` for the full CPU shape).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import FWD_BWD_FLOP_FACTOR as REPORT_FACTORS
from bench.report import BenchRow
from jax_bridge.grouped_matmul.api import grouped_matmul

M, K, N, GROUPS = 8192, 2048, 1408, 64
CPU_M, CPU_K, CPU_N = 4096, 512, 352
CPU_GROUPS = (64, 16, 8)  # three group counts: time against groups in --plot
FWD_BWD_FLOP_FACTOR = REPORT_FACTORS["matmul"]  # bench/report.py
# float32 results of ours and of the dense loop differ by summation order only.
RELATIVE_TOLERANCE = 1e-5


def _group_sizes(m: int, groups: int, seed: int = 0) -> np.ndarray:
    """Uneven routing: expert popularity from a Dirichlet, a few experts left empty."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(groups, 0.7))
    weights[rng.choice(groups, size=groups // 16, replace=False)] = 0.0
    return rng.multinomial(m, weights / weights.sum()).astype(np.int32)


def useful_flops(sizes: np.ndarray, k: int, n: int) -> float:
    """Forward FLOPs of the rows routed to a group: 2 k n each (rows past sum(sizes) and
    empty groups do no useful work)."""
    return 2.0 * int(sizes.sum()) * k * n


def _params(sizes: np.ndarray, k: int, n: int) -> dict[str, int]:
    """The row's sizes for plots (Python ints: JSON-ready)."""
    return {"num_groups": len(sizes), "m": int(sizes.sum()), "k": k, "n": n}


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


def _interleaved(fns: dict[str, Callable], args: tuple, repeats: int) -> dict[str, tuple]:
    """{name: (first call incl. compile, median later call, result, later calls' times)}.

    The timed calls of the methods alternate, so load from other processes on this shared
    CPU hits each method alike and their ratio stays meaningful."""
    firsts, results, times = {}, {}, {name: [] for name in fns}
    for name, fn in fns.items():
        start = time.perf_counter()
        results[name] = jax.block_until_ready(fn(*args))
        firsts[name] = time.perf_counter() - start
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {
        name: (firsts[name], statistics.median(times[name]), results[name], tuple(times[name]))
        for name in fns
    }


def _cpu(m: int, k: int, n: int, groups: int) -> list[BenchRow]:
    """Prints the CPU timings; returns rows of ours against the dense loop and ragged_dot."""
    sizes = _group_sizes(m, groups)
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32))
    rhs = jnp.asarray(rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k))
    group_sizes = jnp.asarray(sizes)
    methods = {
        "ours (xla)": lambda a, b: grouped_matmul(a, b, group_sizes, implementation="xla"),
        "dense loop": _per_group_loop(tuple(int(s) for s in sizes)),
    }
    ragged = {
        "ragged_dot": lambda a, b: jax.lax.ragged_dot(
            a, b, group_sizes, precision=jax.lax.Precision.HIGHEST
        )
    }
    print(
        f"grouped_matmul CPU float32: m={m} k={k} n={n}, {groups} groups "
        f"({int((sizes == 0).sum())} empty, largest {sizes.max()} rows)"
    )
    rows = []
    for label, make, repeats in (("forward", jax.jit, 7), ("fwd+bwd", _loss_grad, 5)):
        made = {name: make(f) for name, f in methods.items()}
        timed = _interleaved(made, (lhs, rhs), repeats)
        if label == "forward":
            # One timed call only: ragged_dot does num_groups times the dense work here.
            timed |= _interleaved({n: make(f) for n, f in ragged.items()}, (lhs, rhs), 1)
        for name, (first, median, _, _) in timed.items():
            print(f"  {label} {name:<11} {median * 1e3:9.1f} ms  (first call {first:.1f} s)")
        ours, error = timed["ours (xla)"][1], _relative_difference(timed)
        # Time ratios as the summary table prints them: baseline / ours, above 1 ours is faster.
        versus_ragged = (
            f"ragged_dot/ours = {timed['ragged_dot'][1] / ours:.1f}x, "
            if "ragged_dot" in timed
            else ""
        )
        print(
            f"  {label} time ratios ({groups} groups; above 1: ours faster): {versus_ragged}"
            f"dense loop/ours = {timed['dense loop'][1] / ours:.2f}x; "
            f"max |ours - dense loop| / max |dense loop| = {error:.1e}"
        )
        shape = f"m{m} k{k} n{n} G{groups} f32"
        flops = useful_flops(sizes, k, n) * (1 if label == "forward" else FWD_BWD_FLOP_FACTOR)
        rows += [
            BenchRow(
                "grouped_matmul",
                f"grouped_matmul {label}",
                shape,
                "cpu xla",
                timed["ours (xla)"][3],
                baseline,
                timed[name][3],
                error < RELATIVE_TOLERANCE,
                flops=flops,
                params=_params(sizes, k, n),
            )
            for name, baseline in (
                ("dense loop", "per-group jnp.dot"),
                ("ragged_dot", "ragged_dot"),
            )
            if name in timed
        ]
    return rows


def _relative_difference(results: dict[str, tuple]) -> float:
    """Largest over result arrays of max |ours - loop| / max |loop|."""
    ours = jax.tree.leaves(results["ours (xla)"][2])
    loop = jax.tree.leaves(results["dense loop"][2])
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(ours, loop, strict=True)
    )


def _gpu() -> list[BenchRow]:
    """The GPU rows of bench/gpu_rows.py through bench/runner.py: ours against ragged_dot,
    the dense matmul of the same FLOPs and (with PyTorch) torch._grouped_mm."""
    from bench import gpu_rows
    from bench.runner import Timing, run_cases

    return run_cases(gpu_rows.matmul_cases(gpu_rows.Sizes.gpu()), Timing())


def main(*, full: bool = False) -> list[BenchRow]:
    """Prints the table; returns its rows (the CPU ones carry the check against the loop)."""
    if jax.default_backend() in ("cuda", "rocm", "gpu"):
        return _gpu()
    m, k, n = (M, K, N) if full else (CPU_M, CPU_K, CPU_N)
    return [f for groups in CPU_GROUPS for f in _cpu(m, k, n, groups)]


if __name__ == "__main__":
    main()
