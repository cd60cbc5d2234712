"""What the MoE tests share: random problems and the independent oracles.

The oracles never sort tokens and never call `grouped_matmul`: each token's chosen
experts' weights are gathered and applied to that token alone.

* `moe_float64`: a numpy loop over tokens and choices in float64, the forward's last word;
* `moe_dense`: the same per-token computation vectorised in jnp (float32, HIGHEST), so
  that `jax.grad` gives the oracle's gradients.

Tolerances: float32 results of the block and of the oracles differ by summation order
only (exact float32 products everywhere), so 2e-5 relative to the array's scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.moe import MoEParams
from tests import margins

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


def moe_float64(x, params: MoEParams, top_k: int, keep=None) -> np.ndarray:
    """Loop over tokens and choices: out[t] = sum_j w[t,j] * ffn_{e(t,j)}(x[t]).

    `keep` (bool [T, k], optional) drops the copies where it is False."""
    x64 = np.asarray(x, np.float64)
    up = np.asarray(params.w_up, np.float64)
    down = np.asarray(params.w_down, np.float64)
    ids, weights = top_k64(x, params.router, top_k)
    out = np.zeros_like(x64)
    for t in range(x64.shape[0]):
        for j in range(top_k):
            if keep is None or keep[t, j]:
                e = ids[t, j]
                out[t] += weights[t, j] * (_gelu64(x64[t] @ up[e]) @ down[e])
    return out


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
    """|a - e| <= tol * (|e| + max|e|), elementwise; actual finite."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    scale = float(np.max(np.abs(expected), initial=0.0)) or 1.0
    if actual.size:
        margins.record(name, np.max(np.abs(actual - expected) / (tol * (np.abs(expected) + scale))))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=name)


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
