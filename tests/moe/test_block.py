"""The example MoE block on one device against the per-token oracles (tests/moe/helpers):
forward against a float64 numpy loop, gradients of x and every weight against
`jax.grad` of a dense per-token jnp oracle in float64, each within the element-wise bound
of the helpers; plus its argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge.moe import MoEParams, init_moe_params, moe_feed_forward, top_k_router
from tests.grouped_matmul.helpers import Float64Product
from tests.moe.helpers import (
    assert_close,
    assert_tree_close,
    moe_dense,
    moe_float64,
    moe_grads_float64,
    problem,
    top_k64,
)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_forward_matches_the_float64_loop(top_k):
    x, params = problem(top_k)
    out = jax.jit(moe_feed_forward, static_argnames="top_k")(x, params, top_k=top_k)
    assert out.dtype == jnp.float32 and out.shape == x.shape
    assert_close(out, moe_float64(x, params, top_k), "out")
    assert_close(moe_dense(x, params, top_k), moe_float64(x, params, top_k), "dense oracle")


def test_router_picks_the_top_k_and_normalises_their_softmax():
    x, params = problem(4)
    ids, weights = top_k_router(x, params.router, 3)
    expected_ids, expected_weights = top_k64(x, params.router, 3)
    np.testing.assert_array_equal(ids, expected_ids)
    # Each logit is off by units * L_t (L_t = max_e |x_t| @ |router_e|, the logits'
    # magnitude); softmax turns that into a relative weight error of twice it, plus the
    # exp's and the division's roundings: M = 2 (L_t + 1) w (the helpers' forward term).
    x64, router64 = np.asarray(x, np.float64), np.asarray(params.router, np.float64)
    size = (np.abs(x64) @ np.abs(router64)).max(axis=1, keepdims=True)
    hidden = x.shape[1]
    relative = 2 * (size + 1)
    expected = Float64Product(expected_weights, relative * expected_weights, hidden)
    assert_close(weights, expected, "weights")
    # Their sum: those errors plus the sum's own k - 1 = 2 roundings of numbers <= 1 (3:
    # one to spare).
    ones = np.ones((x.shape[0], 1))
    sums = Float64Product(ones, relative + 3, hidden)
    assert_close(weights.sum(axis=1, keepdims=True), sums, "weight sums")


@pytest.mark.parametrize("top_k", [1, 2])
def test_gradients_match_the_dense_oracle(top_k):
    x, params = problem(10 + top_k)
    cotangent = jnp.asarray(np.random.default_rng(20).standard_normal(x.shape), jnp.float32)

    def loss(block):
        return lambda x, params: jnp.sum(block(x, params, top_k) * cotangent)

    block = lambda x, params, k: moe_feed_forward(x, params, top_k=k)
    grads = jax.jit(jax.grad(loss(block), (0, 1)))(x, params)
    assert isinstance(grads[1], MoEParams)
    assert_tree_close(grads, moe_grads_float64(x, params, top_k, cotangent))


def test_experts_without_tokens_get_zero_gradient():
    x, params = problem(30, tokens=6)  # 6 tokens x top-1 reach at most 6 of 8 experts
    ids, _ = top_k_router(x, params.router, 1)
    unused = np.setdiff1d(np.arange(8), np.asarray(ids))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(moe_feed_forward(x, p, top_k=1) ** 2)))(params)
    assert unused.size and not np.any(grads.w_up[unused]) and not np.any(grads.w_down[unused])
    assert np.all(np.any(grads.w_up[np.asarray(ids)[:, 0]] != 0, axis=(1, 2)))


def test_bfloat16_block_follows_the_float32_block():
    x, params = problem(41)  # seed 40: a near-tie of bf16 logits
    as_bf16 = lambda a: a.astype(jnp.bfloat16)
    x16, params16 = as_bf16(x), jax.tree.map(as_bf16, params)
    out = moe_feed_forward(x16, params16, top_k=2)
    assert out.dtype == jnp.bfloat16
    # The oracle on the same (rounded) inputs; bf16 rounds h and the output (~2^-8 each).
    expected = moe_float64(x16.astype(jnp.float32), jax.tree.map(jnp.float32, params16), 2)
    assert_close(out, expected, "bf16 out")


def test_triton_implementation_matches_xla():
    x, params = problem(50, tokens=16, hidden=16, ffn=32, experts=4)
    triton = moe_feed_forward(x, params, top_k=2, implementation="triton")
    xla = moe_feed_forward(x, params, top_k=2, implementation="xla")
    # Each within the float64 loop's bound, so within twice of each other.
    assert_close(triton, moe_float64(x, params, 2), "triton")
    assert_close(xla, moe_float64(x, params, 2), "xla")


def test_init_moe_params_shapes_and_scale():
    params = init_moe_params(jax.random.key(0), hidden=32, ffn=64, num_experts=8)
    assert params.router.shape == (32, 8) and params.w_up.shape == (8, 32, 64)
    assert params.w_down.shape == (8, 64, 32) and params.w_up.dtype == jnp.float32
    assert 0.5 < float(jnp.std(params.w_down)) * 8 < 2  # ~ 1 / sqrt(ffn)
    small = init_moe_params(jax.random.key(0), hidden=4, ffn=4, num_experts=2, dtype=jnp.bfloat16)
    assert small.router.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("router rows", ValueError, r"top_k_router: router must have shape \[hidden=32, E\]"),
        ("x rank", ValueError, r"top_k_router: x must have shape \[tokens, hidden\]"),
        ("x batched", ValueError, r"top_k_router: x must have shape \[tokens, hidden\]"),
        ("router rank", ValueError, r"top_k_router: router must have shape \[hidden, E\]"),
        ("int", TypeError, "top_k_router: x must have a floating dtype, got int32"),
        ("list", TypeError, "top_k_router: router must be an array of shape"),
        ("top_k", ValueError, r"top_k_router: top_k must lie in \[1, 8\], got 9"),
    ],
)
def test_top_k_router_checks_its_arguments(case, error, match):
    """Shapes and dtypes are the docstring's (x [T, hidden], router [hidden, E],
    floating): a wrong one is refused naming the op, never run with broadcasting."""
    x, params = problem(1, tokens=4)
    router, top_k = params.router, 2
    if case == "router rows":
        router = router[:5]
    elif case in ("x rank", "x batched"):
        x = x[0] if case == "x rank" else x[None]
    elif case == "router rank":
        router = router[None]
    elif case == "int":
        x, router = x.astype(jnp.int32), router.astype(jnp.int32)
    elif case == "list":
        router = np.asarray(router).tolist()
    else:
        top_k = 9
    with pytest.raises(error, match=match):
        top_k_router(x, router, top_k)


def _bad(params: MoEParams, **change) -> MoEParams:
    return MoEParams(**{**vars(params), **change})


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("x rank", ValueError, r"moe_feed_forward: x must be a floating array of shape"),
        ("x int", ValueError, r"moe_feed_forward: x must be a floating array"),
        ("x list", TypeError, r"moe_feed_forward: x must be an array, got list"),
        ("router list", TypeError, r"moe_feed_forward: params.router must be an array"),
        ("params type", TypeError, "moe_feed_forward: params must be MoEParams"),
        ("router", ValueError, r"params.router must have shape \[hidden=32"),
        ("w_up", ValueError, r"params.w_up must have shape \[num_experts=8, hidden=32, ffn\]"),
        ("w_down", ValueError, r"params.w_down must have shape .* = \(8, 64, 32\), got \(7"),
        ("ffn", ValueError, r"params.w_down .* = \(8, 3, 32\), got \(8, 64, 32\)"),
        ("dtype", TypeError, "params.w_down has dtype bfloat16, x has float32"),
        ("top_k 0", ValueError, "moe_feed_forward: top_k must be >= 1"),
        ("top_k 9", ValueError, r"top_k must lie in \[1, 8\], got 9"),
        ("top_k float", TypeError, "moe_feed_forward: top_k must be a Python int"),
    ],
)
def test_bad_arguments_name_the_op_and_the_argument(case, error, match):
    x, params = problem(0, tokens=4)
    top_k = {"top_k 0": 0, "top_k 9": 9, "top_k float": 2.0}.get(case, 2)
    x = {"x rank": x[0], "x int": x.astype(jnp.int32), "x list": np.asarray(x).tolist()}.get(
        case, x
    )
    params = {
        "params type": tuple(vars(params).values()),
        "router": _bad(params, router=params.router[:5]),
        "router list": _bad(params, router=np.asarray(params.router).tolist()),
        "w_up": _bad(params, w_up=params.w_up[:, :5]),
        "ffn": _bad(params, w_up=params.w_up[:, :, :3]),
        "w_down": _bad(params, w_down=params.w_down[:7]),
        "dtype": _bad(params, w_down=params.w_down.astype(jnp.bfloat16)),
    }.get(case, params)
    with pytest.raises(error, match=match):
        moe_feed_forward(x, params, top_k=top_k)


def test_forward_mode_is_refused_naming_the_op_and_reverse_mode_works():
    """`jax.jvp` / `jax.jacfwd` of the block (its experts' products are custom_vjp
    grouped matmuls) raise a NotImplementedError naming it and why, with tangents on
    every argument or on one weight; `jax.jacrev` agrees with the float64 gradients'
    oracle."""
    x, params = problem(2, tokens=4)

    def block(x, params):
        return moe_feed_forward(x, params, top_k=2)

    with pytest.raises(NotImplementedError, match=r"moe_feed_forward: forward-mode .*grouped"):
        jax.jvp(block, (x, params), (x, params))
    with pytest.raises(NotImplementedError, match=r"moe_feed_forward: .*jax\.jacrev"):
        jax.jacfwd(lambda w: block(x, MoEParams(params.router, w, params.w_down)))(params.w_up)
    cotangent = jnp.asarray(np.random.default_rng(21).standard_normal(x.shape), jnp.float32)
    loss = lambda x, params: jnp.sum(block(x, params) * cotangent)
    grads = jax.jit(jax.jacrev(loss, (0, 1)))(x, params)
    assert_tree_close(grads, moe_grads_float64(x, params, 2, cotangent))
