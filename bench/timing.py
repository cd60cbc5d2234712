"""Wall-clock timing shared by the bench sections."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def repeat_seconds(
    fn: Callable[..., Any], *args: Any, repeats: int = 5
) -> tuple[tuple[float, ...], Any]:
    """Wall times of `repeats` calls of `fn(*args)` after one warm-up (compile) call.

    Every call is synchronised with `jax.block_until_ready`. Returns the times in seconds
    and the warm-up call's output (for correctness checks).
    """
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return tuple(times), out


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> tuple[float, Any]:
    """Median wall time of `fn(*args)` over `repeats` calls after one warm-up (compile) call.

    Returns the median in seconds and the warm-up call's output (for correctness checks).
    """
    times, out = repeat_seconds(fn, *args, repeats=repeats)
    return statistics.median(times), out


def jit_with_grads(fn: Callable[..., Any], d_out: Any) -> Callable[..., Any]:
    """jit of (q, k, v, *rest) -> (fn(q, k, v, *rest), (dq, dk, dv)) for the cotangent
    `d_out`: a forward + backward pass to time. `rest` (masks, offsets) is passed as
    arguments, not closed over, so XLA does not fold it as a constant."""

    def run(q, k, v, *rest):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, *rest), q, k, v)
        return out, pullback(d_out)

    return jax.jit(run)


def relative_errors(result, reference, names=("out", "dq", "dk", "dv")) -> dict[str, float]:
    """{name: max |result - reference| / max |reference|} of each leaf of two equal pytrees
    (e.g. an output and its gradients), in float32; leaves are named in order."""
    pairs = zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True)
    errors = {}
    for name, (a, b) in zip(names, pairs, strict=False):
        a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
        errors[name] = float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1e-30)
    return errors
