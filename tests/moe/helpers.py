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
Gradients (`moe_grads_float64`, of sum(block * cotangent) for a fixed cotangent c) take
the same element-wise bound, with the value `jax.grad` of `moe_dense` in float64 and M
the gradient of `_magnitude_loss` at the absolute inputs: the loss sum(|c| * block') of a
block' whose every local derivative dominates the float32 chain's in absolute value and
whose forward values carry their errors (in units) as M does:

    w'_j = (1 + 2 (L_t + 1)) w_j   slopes w_j |delta_ij - w_i| (softmax's Jacobian)
    g'   = |g| + 1.2 (|x|@|U| + |h|)   slope 1.13 + 0.8 |x|@|U| (|gelu'| plus |gelu''|
                                      times h's error: gelu' is taken at the rounded h)
    h'   = |x| @ |U|,  y' = g' @ |D|,  out' = sum_j w'_j y'_j

so each gradient element of block' is a sum of absolute terms at least those the float32
backward sums, plus the forward errors it multiplies. n is the chain's reductions summed:
the errors of its stages (up, down, their two transposes, the sum over tokens of the
weight gradients) are independent roundings and count as one sum of all their terms.
Comparisons between two float32 paths (sharded vs single device, Triton vs XLA) compare
each with the float64 oracle: both within the bound, they agree within twice it.
Margins (tests/margins.py) are small, ~0.01 forward and ~0.001 gradients: M replaces
every partial sum of random-sign terms by the sum of their magnitudes, stage after stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.moe import MoEParams
from tests import margins
from tests.grouped_matmul.helpers import Float64Product, bound_units

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


def moe_grads_float64(x, params: MoEParams, top_k: int, cotangent):
    """Gradients (dx, MoEParams of weight gradients) of sum(block(x, params) * cotangent), each
    a `Float64Product`: the value is `jax.grad` of `moe_dense` in float64; the magnitude is
    `jax.grad` of `_magnitude_loss` at the absolute inputs (module docstring)."""
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), (x, params))
        c = jnp.asarray(np.asarray(cotangent, np.float64))
        loss = lambda x, p: jnp.sum(moe_dense(x, p, top_k) * c)
        # Jitted: one program each instead of one per operation.
        values = jax.jit(jax.grad(loss, (0, 1)))(*wide)
        absolute = jax.tree.map(jnp.abs, wide)
        magnitude_grads = jax.jit(jax.grad(_magnitude_loss, (0, 1)), static_argnums=4)
        magnitudes = magnitude_grads(*absolute, *wide, top_k, jnp.abs(c))
        as_numpy = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
        values, magnitudes = as_numpy(values), as_numpy(magnitudes)
    x, params = wide
    hidden, ffn = params.w_up.shape[1:]
    terms = 2 * (hidden + ffn) + x.shape[0]  # the longest chain's reductions, summed
    product = lambda v, m: Float64Product(v, m, terms)
    return jax.tree.map(product, values, magnitudes)


def _magnitude_loss(xa, pa: MoEParams, x, p: MoEParams, top_k: int, ca):
    """sum(|cotangent| * the block on absolute inputs `xa`, `pa`), built so that every
    derivative dominates the float32 backward's: at xa = |x|, pa = |p| each gradient is a
    sum of absolute terms, at least those the backward sums, plus the errors of the
    forward values it reuses (module docstring). x, p (signed) give the true h, g and w."""
    logits = jnp.dot(x, p.router)
    _, ids = jax.lax.top_k(logits, top_k)
    w = jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=1), axis=-1)  # [T, k]
    size = jnp.max(jnp.abs(x) @ jnp.abs(p.router), axis=1, keepdims=True)  # L_t
    # Zero-valued increments whose derivatives carry the chain's absolute Jacobians.
    delta = lambda a: a - jax.lax.stop_gradient(a)
    dz = delta(jnp.take_along_axis(jnp.dot(xa, pa.router), ids, axis=1))
    # d w_j / d z_i = w_j (delta_ij - w_i), in absolute value w_j (1 - w_j) for i = j and
    # w_j w_i otherwise; (1 + 2 (L + 1)) w: the weights' own error (units) on top, as in
    # the forward's M.
    spread = dz - 2 * w * dz + jnp.sum(w * dz, axis=1, keepdims=True)
    wa = (1 + 2 * (size + 1)) * w * (1 + spread)
    h = jnp.einsum("th,tkhf->tkf", x, p.w_up[ids])
    ha = jnp.einsum("th,tkhf->tkf", xa, pa.w_up[ids])  # |x| @ |U|: h's error, in units
    g = jax.nn.gelu(h, approximate=True)
    # Value |g| plus the up matmul's and gelu's errors (the forward's 1.2 (|x|@|U| + |h|));
    # slope |gelu'| <= 1.13 plus |gelu''| <= 0.8 times h's error (gelu' taken at the
    # rounded h).
    base = jax.lax.stop_gradient(ha)
    ga = jnp.abs(g) + 1.2 * (base + jnp.abs(h)) + (1.13 + 0.8 * base) * delta(ha)
    ya = jnp.einsum("tkf,tkfh->tkh", ga, pa.w_down[ids])
    return jnp.sum(ca * jnp.sum(ya * wa[..., None], axis=1))


def assert_close(actual, expected: Float64Product, name: str = "") -> None:
    """|a - e| <= bound_units(a.dtype, n) * M element-wise against the float64 oracle's
    `Float64Product` (module docstring); actual finite."""
    if not isinstance(expected, Float64Product):
        raise TypeError(f"{name}: compare with a float64 oracle's Float64Product")
    _assert_within(actual, expected, name)


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


def assert_tree_close(actual, expected) -> None:
    """`assert_close` for every leaf of `actual` against the `Float64Product` leaves of
    `expected` (same structure; names from the paths)."""
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree.leaves(expected),
        strict=True,
    )
    for (path, a), e in pairs:
        assert_close(a, e, name=jax.tree_util.keystr(path))
