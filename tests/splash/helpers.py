"""The splash tests' float64 oracle and tolerance.

The oracle is `reference.attention_reference` run in float64 under `jax.enable_x64` on
the kernels' own (rounded) inputs: its rounding is negligible, so a comparison measures
the kernel's error alone. The tolerance is the attention tests' (tests/attention/helpers.py,
whose docstring gives the reasoning): relative to `|expected| + max|expected|`,

    C * u * (S + sqrt(L))  (+ four units of the 16-bit dtype's roundoff for 16-bit inputs)

with S the largest |exponent| the softmax can see (scale * max |q.k| over every pair of a
head, plus the largest |sink|) and L the longest reduction: head dims (q.k and dO.v),
keys per query (P @ V), queries per key (dK, dV and the sinks' gradient). A logits soft
cap only shrinks the exponents (cap * tanh(s / cap) is 1-Lipschitz), so S taken before
the cap still bounds the error the scores carry. Splash's q, k, v are [heads, tokens,
dim] (k, v 2-D for MQA); `score_bound` wants [tokens, heads, dim]: transposed here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.attention.helpers import U32, C, assert_close, assert_lse_close, score_bound, tolerance
from tests.splash.reference import attention_reference


def _tokens_first(x) -> jax.Array:
    """[heads, tokens, dim] (or [tokens, dim]) -> [tokens, heads, dim]."""
    x = jnp.asarray(x)
    return x[:, None] if x.ndim == 2 else jnp.swapaxes(x, 0, 1)


def splash_tolerance(q, k, v, *, softmax_scale: float = 1.0, sinks=None, dtype=None) -> float:
    """C * u * (S + sqrt(L)) + the 16-bit part for `dtype` (default q's): module docstring."""
    longest = max(q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2])
    bound = score_bound(_tokens_first(q), _tokens_first(k), softmax_scale, sinks)
    return C * U32 * (bound + np.sqrt(longest)) + tolerance(q.dtype if dtype is None else dtype)


def _wide(x):
    """float64 copy of an array's exact value (16-bit through float32); None stays."""
    return None if x is None else jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))


def oracle_value_and_grad(fn, *args, argnums):
    """`jax.value_and_grad(fn, argnums, has_aux=True)(*args)` in float64 (inputs widened
    exactly under `jax.enable_x64`); every array of the result as float64 numpy."""
    with jax.enable_x64(True):
        result = jax.jit(jax.value_and_grad(fn, argnums, has_aux=True))(*map(_wide, args))
        return jax.tree.map(lambda x: np.asarray(x, np.float64), result)


def oracle_forward(q, k, v, mask, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of `attention_reference` in float64; kwargs are its own."""
    with jax.enable_x64(True):
        if kwargs.get("sinks") is not None:
            kwargs["sinks"] = _wide(kwargs["sinks"])
        out, lse = attention_reference(_wide(q), _wide(k), _wide(v), mask, **kwargs)
        return np.asarray(out, np.float64), np.asarray(lse, np.float64)


def assert_out_and_lse(out, lse, oracle, tol: float, name: str = "") -> None:
    """out against the oracle's (its finite check included), lse with -inf rows exact."""
    assert_close(out, oracle[0], tol, f"{name}out")
    assert_lse_close(lse, oracle[1], tol, f"{name}lse")


def assert_grads(grads, oracle_grads, tol: float, prefix: str = "") -> None:
    """Each gradient (q, k, v and, when given, sinks) against the oracle's, named
    `prefix` + dq, dk, dv, ds."""
    for name, got, want in zip("qkvs"[: len(grads)], grads, oracle_grads, strict=True):
        assert_close(got, want, tol, f"{prefix}d{name}")
