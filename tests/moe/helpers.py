"""What the MoE tests share: random problems and the independent oracles.

The oracles never sort tokens and never call `grouped_matmul`: each token's chosen
experts' weights are gathered and applied to that token alone.

* `moe_float64`: a numpy loop over tokens and choices in float64, the forward's last word;
* `moe_dense`: the same per-token computation vectorised in jnp (float32, HIGHEST), so
  that `jax.grad` gives the oracle's gradients.

Bounds. Against `moe_float64` (a `Float64Product`): element-wise
|actual - expected| <= units * M, with the grouped matmul tests' units
(tests/grouped_matmul/helpers.py: C * u * sqrt(n), plus 4 u16 for a 16-bit result; n the
longest reduction, max(hidden, ffn)) and M the float64 loop's magnitude of the chain

    M[t] = sum_j w_j * ( |g_j| @ |D_j|                      the down matmul's sums
                       + 1.2 * (|x_t| @ |U_j| + |h_j|) @ |D_j|   the up matmul's error and
                                                  gelu's own rounding (|gelu'| <= 1.13),
                                                  carried through the down matmul
                       + 2 * (L_t + 1) * |y_j| )  the routing weights' error: softmax
                                                  turns a logit error of units * L_t into
                                                  a relative weight error of twice that

with h_j = x_t @ U_j, g_j = gelu(h_j), y_j = g_j @ D_j and L_t = max_e |x_t| @ |router_e|
the logits' magnitude. Each line is a few units of roundoff times the absolute sums the
float32 path forms; a 16-bit block rounds h, g and the output (u16 times a term of M each).
Other comparisons (two float32 paths of the same computation: sharded vs single device,
Triton vs XLA, gradients against `moe_dense`'s) keep TOLERANCE = 2e-5 relative to the
array's scale; they are recorded by tests/margins.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.moe import MoEParams
from tests import margins
from tests.grouped_matmul.helpers import Float64Product, bound_units

TOLERANCE = 2e-5
HIGHEST = jax.lax.Precision.HIGHEST


def problem(seed: int, tokens=64, hidden=32, ffn=64, experts=8, dtype=np.float32):
    """(x [tokens, hidden], MoEParams) of fresh normal values (fan-in scaled weights)."""
    rng = np.random.default_rng(seed)

    def normal(shape, fan_in=1):
        return jnp.asarray((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype))

    x = normal((tokens, hidden))
    params = MoEParams(
        router=normal((hidden, experts), hidden),
        w_up=normal((experts, hidden, ffn), hidden),
        w_down=normal((experts, ffn, hidden), ffn),
    )
    return x, params


def _gelu64(h: np.ndarray) -> np.ndarray:
    """jax.nn.gelu(approximate=True) in float64."""
    return 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h**3)))


def top_k64(x, router, top_k: int, *, margin: float = 1e-4):
    """(ids [T, k], softmax weights [T, k]) in float64, asserting that no token's k-th and
    (k+1)-th logits are within `margin` (float32 and float64 then choose alike)."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    order = np.argsort(-logits, axis=1, kind="stable")
    ids = order[:, :top_k]
    if top_k < logits.shape[1] and len(logits):
        ranked = np.take_along_axis(logits, order, axis=1)
        assert np.min(ranked[:, top_k - 1] - ranked[:, top_k]) > margin, "near-tie in top-k"
    chosen = np.take_along_axis(logits, ids, axis=1)
    weights = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return ids, weights / weights.sum(axis=1, keepdims=True)


def moe_float64(x, params: MoEParams, top_k: int, keep=None) -> Float64Product:
    """Loop over tokens and choices: out[t] = sum_j w[t,j] * ffn_{e(t,j)}(x[t]), with the
    magnitude M of the module docstring.

    `keep` (bool [T, k], optional) drops the copies where it is False."""
    x64 = np.asarray(x, np.float64)
    up = np.asarray(params.w_up, np.float64)
    down = np.asarray(params.w_down, np.float64)
    ids, weights = top_k64(x, params.router, top_k)
    logit_size = (np.abs(x64) @ np.abs(np.asarray(params.router, np.float64))).max(axis=1)
    out, magnitude = np.zeros_like(x64), np.zeros_like(x64)
    for t in range(x64.shape[0]):
        for j in range(top_k):
            if keep is None or keep[t, j]:
                e, w = ids[t, j], weights[t, j]
                h = x64[t] @ up[e]
                y = _gelu64(h) @ down[e]
                out[t] += w * y
                up_error = 1.2 * (np.abs(x64[t]) @ np.abs(up[e]) + np.abs(h))
                magnitude[t] += w * (
                    (np.abs(_gelu64(h)) + up_error) @ np.abs(down[e])
                    + 2 * (logit_size[t] + 1) * np.abs(y)
                )
    return Float64Product(out, magnitude, max(up.shape[1], up.shape[2]))


def moe_dense(x, params: MoEParams, top_k: int) -> jax.Array:
    """The per-token oracle in jnp (float32, HIGHEST): differentiable by jax.grad."""
    logits = jnp.dot(x, params.router, precision=HIGHEST)
    values, ids = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(values, axis=-1)  # [T, k]
    up, down = params.w_up[ids], params.w_down[ids]  # [T, k, hidden, ffn], [T, k, ffn, hidden]
    h = jax.nn.gelu(jnp.einsum("th,tkhf->tkf", x, up, precision=HIGHEST), approximate=True)
    y = jnp.einsum("tkf,tkfh->tkh", h, down, precision=HIGHEST)
    return jnp.sum(y * weights[..., None], axis=1)


def assert_close(actual, expected, name: str = "", tol: float = TOLERANCE) -> None:
    """Against a `Float64Product`: the element-wise bound of the module docstring (`tol`
    unused); against an array: |a - e| <= tol * (|e| + max|e|). actual finite."""
    if isinstance(expected, Float64Product):
        _assert_within(actual, expected, name)
        return
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    scale = float(np.max(np.abs(expected), initial=0.0)) or 1.0
    if actual.size:
        margins.record(name, np.max(np.abs(actual - expected) / (tol * (np.abs(expected) + scale))))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=name)


def _assert_within(actual, oracle: Float64Product, name: str) -> None:
    """|a - e| <= bound_units(a.dtype, n) * M element-wise; actual finite."""
    allowed = bound_units(actual.dtype, oracle.terms) * oracle.magnitude
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    assert actual.shape == oracle.shape, f"{name}: {actual.shape} != {oracle.shape}"
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    error = np.abs(actual - oracle.value)
    # M = 0 only for a token every copy of which was dropped: its output must be exactly 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(error == 0, 0.0, error / allowed)
    if ratio.size:
        worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        margins.record(name, ratio[worst])
        assert ratio[worst] <= 1.0, (
            f"{name}: worst element {tuple(int(i) for i in worst)}: got {actual[worst]!r}, "
            f"expected {oracle.value[worst]!r}, {ratio[worst]:.3g}x the allowed "
            f"{allowed[worst]:.3g}"
        )


def assert_tree_close(actual, expected, tol: float = TOLERANCE) -> None:
    """`assert_close` for every leaf of two pytrees with the same structure (leaf names
    from their paths)."""
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree.leaves(expected),
        strict=True,
    )
    for (path, a), e in pairs:
        assert_close(a, e, name=jax.tree_util.keystr(path), tol=tol)
