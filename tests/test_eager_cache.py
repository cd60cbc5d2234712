"""Eager (un-jitted) calls of the ops compile once per shape and options, then reuse it.

Counted with JAX's compile event (`jax.monitoring`): after a first call, further eager
calls with new values of the same shapes compile nothing, and still give the reference's
numbers (a cache that returned a stale program would not). Covers the XLA tile loop of
the grouped matmuls (its `fori_loop` with a concrete trip count became a `scan` over a
fresh closure, compiled on every call) and the Triton interpreter's `pure_callback`
launches (a new callback object per call, so a new program per call).
"""

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import (
    attention_reference,
    grouped_matmul,
    grouped_matmul_reference,
    transposed_grouped_matmul,
    transposed_grouped_matmul_reference,
    varlen_attention,
)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiled_programs() -> Iterator[list[str]]:
    """Within: the names of the programs XLA compiles (one entry per compilation)."""
    names: list[str] = []

    def listen(event: str, duration: float, **metadata) -> None:
        if event == COMPILE_EVENT:
            names.append(str(metadata.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _normal(rng: np.random.Generator, *shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _close(out: jax.Array, expected: jax.Array) -> None:
    """float32 results against a float32-accumulated oracle: a few ulps of the scale."""
    expected = np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(expected))) + 1e-30
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=0, atol=1e-5 * scale)


def _gmm_case(implementation: str) -> Callable[[np.random.Generator], None]:
    def call(rng):
        lhs, rhs = _normal(rng, 72, 16), _normal(rng, 3, 16, 8)
        sizes = jnp.asarray([20, 36, 12], jnp.int32)  # 4 rows past the last group
        out = grouped_matmul(lhs, rhs, sizes, implementation=implementation)
        _close(out, grouped_matmul_reference(lhs, rhs, sizes))

    return call


def _tgmm_case(implementation: str) -> Callable[[np.random.Generator], None]:
    def call(rng):
        lhs, rhs = _normal(rng, 16, 72), _normal(rng, 72, 8)
        sizes = jnp.asarray([20, 0, 48], jnp.int32)  # an empty group
        out = transposed_grouped_matmul(lhs, rhs, sizes, implementation=implementation)
        _close(out, transposed_grouped_matmul_reference(lhs, rhs, sizes))

    return call


def _varlen_triton(rng):
    q, k, v = (_normal(rng, 40, 2, 16) for _ in range(3))
    cu = jnp.asarray([0, 15, 40], jnp.int32)
    out = varlen_attention(q, k, v, cu, cu, causal=True, implementation="triton")
    _close(out, attention_reference(q, k, v, np.asarray(cu), np.asarray(cu), causal=True))


CASES = {
    "grouped_matmul xla": _gmm_case("xla"),
    "transposed_grouped_matmul xla": _tgmm_case("xla"),
    "grouped_matmul triton": _gmm_case("triton"),
    "transposed_grouped_matmul triton": _tgmm_case("triton"),
    "varlen_attention triton": _varlen_triton,
}


@pytest.mark.parametrize("name", list(CASES))
def test_repeated_eager_calls_compile_nothing_after_the_first(name):
    """On this CPU machine "triton" runs the kernels through Triton's interpreter."""
    call, rng = CASES[name], np.random.default_rng(len(name))
    call(rng)  # compiles what the op needs at these shapes
    with compiled_programs() as compiled:
        for _ in range(3):
            call(rng)
    assert compiled == [], f"{name}: eager calls compiled {compiled}"
