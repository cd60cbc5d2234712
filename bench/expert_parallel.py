"""Benchmark: the example MoE feed-forward block (`jax_bridge.moe`), on one device and
expert-sharded, forward + backward (jax.grad wrt x and every weight), float32.

Rows:
* single device, `moe_feed_forward` (route, two gmms, unroute) against a dense MoE that
  runs every expert on every token and weights the outputs (E / top_k times the FLOPs),
  the usual naive baseline; checked against it.
* expert-sharded over D devices, `dispatch="replicated"` (tokens everywhere, group_offset,
  psum) and `dispatch="all_to_all"` (tokens sharded, `jax.lax.all_to_all` dispatch and
  combine), each against the single-device block and checked equal to it. The
  all_to_all row's shape names the bytes one device sends per all_to_all, from the shapes
  (`all_to_all_bytes`, default capacity: no drops).

On a CPU the D devices are fake (`--xla_force_host_platform_device_count`) and share the
same cores, so the sharded rows measure the overhead of the sharded program, not a
speed-up. This module never sets XLA_FLAGS (JAX may already be running): with fewer than
2 devices the sharded rows are skipped, with a note and a row that says so. Quick by
default (a few seconds); `--full` runs 8192 tokens.

Rows carry the block's useful FLOPs (`block_flops`: router and the two expert matmuls of
the routed copies, forward + backward = 3x the forward), the same for every dispatch.

Run with `python -m bench expert_parallel`, or with fake devices:
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.expert_parallel
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from bench.report import BenchRow
from jax_bridge.moe import (
    MoEParams,
    all_to_all_bytes,
    expert_parallel_moe_feed_forward,
    init_moe_params,
    moe_feed_forward,
)

SECTION = "expert_parallel"
HIDDEN, FFN, EXPERTS, TOP_K = 128, 256, 8, 2
QUICK_TOKENS, FULL_TOKENS = 1024, 8192
# float32 block vs its references: summation order only (exact products, HIGHEST).
RELATIVE_TOLERANCE = 1e-5


def dense_moe(x: jax.Array, params: MoEParams, top_k: int) -> jax.Array:
    """Every expert on every token, outputs weighted by the top-k softmax (zero elsewhere)."""
    highest = jax.lax.Precision.HIGHEST
    logits = jnp.dot(x, params.router, precision=highest)
    values, ids = jax.lax.top_k(logits, top_k)
    gates = (
        jnp.zeros_like(logits)
        .at[jnp.arange(x.shape[0])[:, None], ids]
        .set(jax.nn.softmax(values, axis=-1))
    )  # [T, E]
    h = jax.nn.gelu(jnp.einsum("th,ehf->etf", x, params.w_up, precision=highest))
    y = jnp.einsum("etf,efh->eth", h, params.w_down, precision=highest)
    return jnp.einsum("te,eth->th", gates, y, precision=highest)


def block_flops(tokens: int) -> float:
    """Useful FLOPs of one forward + backward of the block: the router matmul (2 T h E) and,
    per routed copy (T k of them), the up and down matmuls (2 h f each); the backward is
    twice the forward (input and weight gradients). The dense baseline's extra experts and
    the elementwise work do not count."""
    forward = 2.0 * tokens * HIDDEN * EXPERTS + tokens * TOP_K * 2 * (2.0 * HIDDEN * FFN)
    return 3 * forward


def _loss_grad(block: Callable) -> Callable:
    # A cotangent that is not all ones, so the backward pass does real work.
    return jax.jit(jax.grad(lambda x, p: jnp.sum(jnp.sin(block(x, p))), argnums=(0, 1)))


def _relative_difference(a, b) -> float:
    """Largest over leaves of max |a - b| / max |b|."""
    return max(
        float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _shard_count(devices: int) -> int:
    """The largest D <= devices dividing the experts (1 when nothing larger fits)."""
    return max(d for d in range(1, min(devices, EXPERTS) + 1) if EXPERTS % d == 0)


def _traffic(tokens: int, devices: int) -> str:
    """Bytes one device sends per dispatch and per combine all_to_all (float32)."""
    capacity = tokens // devices * TOP_K  # the default: every local copy, no drops
    dispatch, combine = all_to_all_bytes(
        devices=devices, capacity=capacity, hidden=HIDDEN, d_out=HIDDEN, itemsize=4, out_itemsize=4
    )
    balanced = all_to_all_bytes(
        devices=devices,
        capacity=int(np.ceil(1.25 * capacity / devices)),
        hidden=HIDDEN,
        d_out=HIDDEN,
        itemsize=4,
        out_itemsize=4,
    )[0]
    print(
        f"  all_to_all bytes per device, D={devices}: dispatch {dispatch / 2**10:.0f} KiB, "
        f"combine {combine / 2**10:.0f} KiB (capacity {capacity}, no drops); at capacity "
        f"factor 1.25 the dispatch would be {balanced / 2**10:.0f} KiB"
    )
    return f"a2a {dispatch / 2**10:.0f}+{combine / 2**10:.0f} KiB/dev"


def _interleaved(fns: dict[str, Callable], args: tuple, repeats: int) -> dict[str, tuple]:
    """{name: (later calls' times, first call's result)}. The timed calls of the methods
    alternate, so load from other processes on a shared CPU hits each alike."""
    results = {name: jax.block_until_ready(fn(*args)) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (tuple(times[name]), results[name]) for name in fns}


def _methods(devices: int) -> dict[str, Callable]:
    """The timed fwd+bwd functions: the block, the dense baseline and, with D >= 2
    devices, both expert-sharded dispatches."""
    methods = {
        "single": functools.partial(moe_feed_forward, top_k=TOP_K, implementation="xla"),
        "dense": functools.partial(dense_moe, top_k=TOP_K),
    }
    if devices >= 2:
        mesh = Mesh(np.array(jax.devices()[:devices]), ("expert",))
        for dispatch in ("replicated", "all_to_all"):
            methods[dispatch] = functools.partial(
                expert_parallel_moe_feed_forward,
                mesh=mesh,
                axis_name="expert",
                top_k=TOP_K,
                dispatch=dispatch,
                implementation="xla",
            )
    return {name: _loss_grad(block) for name, block in methods.items()}


def _row(timed: dict, name: str, baseline: str, shape: str, backend: str, tokens: int) -> BenchRow:
    """`name` against `baseline` (times), checked against the baseline's gradients."""
    error = _relative_difference(timed[name][1], timed[baseline][1])
    print(
        f"  {backend}: {np.median(timed[name][0]) * 1e3:.1f} ms, {baseline} "
        f"{np.median(timed[baseline][0]) * 1e3:.1f} ms, max rel. difference {error:.1e}"
    )
    return BenchRow(
        SECTION,
        "moe_feed_forward fwd+bwd" if name == "single" else "moe expert-parallel fwd+bwd",
        shape,
        backend,
        timed[name][0],
        {"dense": "dense all-experts MoE", "single": "single device"}[baseline],
        timed[baseline][0],
        error < RELATIVE_TOLERANCE,
        flops=block_flops(tokens),
        params={"tokens": tokens, "num_experts": EXPERTS, "top_k": TOP_K},
    )


def main(*, full: bool = False) -> list[BenchRow]:
    """Prints the timings; returns the single-device row and the sharded rows (or a
    skipped row when JAX has one device). `full`: 8192 tokens (`python -m bench --full`)."""
    tokens = FULL_TOKENS if full else QUICK_TOKENS
    params = init_moe_params(jax.random.key(0), hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS)
    x = jax.random.normal(jax.random.key(1), (tokens, HIDDEN), jnp.float32)
    shape = f"T{tokens} h{HIDDEN} f{FFN} E{EXPERTS} k{TOP_K} f32"
    devices = _shard_count(len(jax.devices()))
    print(f"expert_parallel: MoE block fwd+bwd, {shape}, {len(jax.devices())} device(s)")
    timed = _interleaved(_methods(devices), (x, params), repeats=5)
    rows = [_row(timed, "single", "dense", shape, "cpu xla", tokens)]
    if devices < 2:
        print(
            f"  expert-sharded rows skipped: {len(jax.devices())} device(s); set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before JAX starts to run them"
        )
        return [*rows, BenchRow(SECTION, "moe expert-parallel fwd+bwd", shape, "skipped: 1 device")]
    rows.append(
        _row(timed, "replicated", "single", f"{shape} D{devices}", "cpu xla replicated", tokens)
    )
    traffic = _traffic(tokens, devices)
    rows.append(
        _row(
            timed,
            "all_to_all",
            "single",
            f"{shape} D{devices} {traffic}",
            "cpu xla all_to_all",
            tokens,
        )
    )
    return rows


if __name__ == "__main__":
    from bench.report import format_table

    print(format_table(main()))
