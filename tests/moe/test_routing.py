"""route / unroute: properties on random inputs (hypothesis), transforms and bad inputs.

Oracles are numpy: `np.bincount` for the group sizes, a per-token float64 sum for the
top-k combine (compared within the grouped matmul tests' element-wise bound, C * u *
sqrt(n) times the sum of the absolute terms, n the roundings an element commits). Each
example draws a seed; the values come from `np.random.default_rng`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify

from jax_bridge.moe import Routing, route, unroute
from tests.grouped_matmul.helpers import Float64Product, assert_close


def _inputs(seed: int, tokens: int, top_k: int, experts: int, hidden: int = 3):
    """x [T, hidden] float32, ids [T, top_k] int32 (some experts usually empty),
    weights [T, top_k] float32 (positive, not normalised)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    return x, ids, weights


# Jitted: one compile per shape instead of one per eager op and shape (the examples
# change shapes); the eager path is what the other tests run.
_route = jax.jit(route, static_argnums=2)
_unroute = jax.jit(unroute)

problems = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(0, 40),  # tokens, 0 included
    st.integers(1, 3),  # top_k
    st.integers(1, 9),  # experts
)


@given(problem=problems)
def test_routing_invariants(problem):
    seed, tokens, top_k, experts = problem
    x, ids, _ = _inputs(seed, tokens, top_k, experts)
    r = _route(x, ids, experts)
    copies = tokens * top_k
    assert r.sorted_x.shape == (copies, 3) and r.inverse.shape == (tokens, top_k)
    for name in ("group_sizes", "sorted_expert_ids", "permutation", "inverse"):
        assert getattr(r, name).dtype == jnp.int32, name
    perm, sorted_ids = np.asarray(r.permutation), np.asarray(r.sorted_expert_ids)
    np.testing.assert_array_equal(np.sort(perm), np.arange(copies))  # a permutation
    np.testing.assert_array_equal(np.asarray(r.inverse).ravel()[perm], np.arange(copies))
    np.testing.assert_array_equal(sorted_ids, ids.ravel()[perm])
    assert np.all(np.diff(sorted_ids) >= 0)  # non-decreasing
    # Stable: within one expert, copies keep their order t * K + j.
    assert np.all(np.diff(perm)[np.diff(sorted_ids) == 0] > 0)
    np.testing.assert_array_equal(r.group_sizes, np.bincount(ids.ravel(), minlength=experts))
    np.testing.assert_array_equal(r.sorted_x, x[perm // top_k])


@given(problem=problems)
def test_top_1_route_then_unroute_is_identity(problem):
    seed, tokens, _, experts = problem
    x, ids, _ = _inputs(seed, tokens, 1, experts)
    for expert_ids in (ids, ids[:, 0]):  # [T, 1] and [T]
        r = _route(x, expert_ids, experts)
        np.testing.assert_array_equal(_unroute(r.sorted_x, r), x)
        ones = np.ones((tokens, 1), np.float32)
        np.testing.assert_array_equal(_unroute(r.sorted_x, r, ones), x)


@given(problem=problems)
def test_top_k_combine_is_the_weighted_sum_of_each_tokens_experts(problem):
    seed, tokens, top_k, experts = problem
    x, ids, weights = _inputs(seed, tokens, top_k, experts)
    r = _route(x, ids, experts)
    scale = np.random.default_rng(seed + 1).standard_normal(experts).astype(np.float32)
    y_sorted = r.sorted_x * scale[np.asarray(r.sorted_expert_ids)][:, None]  # expert e: x*s_e
    s = scale[ids]  # [T, K]: s_e of each copy
    # Each copy is x * s (rounded once) times w (once), and k copies are summed: top_k + 2
    # roundings per element at most.
    weighted = _per_token_sum(x, weights * s.astype(np.float64), top_k + 2)
    assert_close(_unroute(y_sorted, r, weights), weighted, name="weighted")
    unweighted = _per_token_sum(x, s, top_k + 1)
    assert_close(_unroute(y_sorted, r), unweighted, name="unweighted")


def _per_token_sum(x, factors, terms: int) -> Float64Product:
    """float64 x[t] * sum_j factors[t, j], with its magnitude |x[t]| * sum_j |factors[t, j]|
    (the bound's M, tests/grouped_matmul/helpers.py) and `terms` roundings per element."""
    x, factors = np.asarray(x, np.float64), np.asarray(factors, np.float64)
    value = x * factors.sum(axis=1, keepdims=True)
    return Float64Product(value, np.abs(x) * np.abs(factors).sum(axis=1, keepdims=True), terms)


def test_an_expert_with_no_tokens_has_an_empty_group():
    x, ids, _ = _inputs(5, 30, 2, 6)
    ids = np.where(ids == 2, 4, ids).astype(np.int32)  # expert 2 gets nothing
    r = route(x, ids, 6)
    assert r.group_sizes[2] == 0 and int(r.group_sizes.sum()) == 60
    start = int(r.group_sizes[:2].sum())
    assert r.sorted_expert_ids[start - 1] == 1 and r.sorted_expert_ids[start] == 3


def test_zero_tokens():
    r = route(np.zeros((0, 5), np.float32), np.zeros((0, 2), np.int32), 4)
    assert r.sorted_x.shape == (0, 5) and r.inverse.shape == (0, 2)
    np.testing.assert_array_equal(r.group_sizes, np.zeros(4))
    assert unroute(jnp.zeros((0, 7)), r, jnp.zeros((0, 2))).shape == (0, 7)


def test_jit_vmap_and_grad():
    x, ids, weights = _inputs(11, 24, 2, 5)
    batch_x = np.stack([x, -2 * x])
    batch_ids = np.stack([ids, (ids + 1) % 5])
    scale = jnp.asarray(np.random.default_rng(3).standard_normal(5), jnp.float32)

    def layer(x, ids, w):  # each expert scales its rows: y[t] = x[t] sum_j w s_e(t,j)
        r = route(x, ids, 5)
        return unroute(r.sorted_x * scale[r.sorted_expert_ids][:, None], r, w)

    batched = jax.jit(jax.vmap(layer))(batch_x, batch_ids, np.stack([weights, weights]))
    s = np.asarray(scale)[ids]  # [T, K]: s_e of each copy
    for b, s_b in enumerate((s, np.asarray(scale)[batch_ids[1]])):
        expected = _per_token_sum(batch_x[b], weights * s_b.astype(np.float64), 4)  # k + 2
        assert_close(batched[b], expected, name=f"batch {b}")
    assert isinstance(jax.jit(route, static_argnums=2)(x, ids, 5), Routing)

    cotangent = np.random.default_rng(4).standard_normal((24, 3)).astype(np.float32)
    loss = lambda x, w: jnp.sum(layer(x, ids, w) * cotangent)
    d_x, d_w = jax.grad(loss, (0, 1))(x, weights)
    # d_x[t] = cotangent[t] sum_j w s; d_w[t, j] = s_j (cotangent[t] . x[t]), a 3-term dot.
    assert_close(d_x, _per_token_sum(cotangent, weights * s.astype(np.float64), 4), name="d_x")
    c64, x64 = np.asarray(cotangent, np.float64), np.asarray(x, np.float64)
    d_w_value = (c64 * x64).sum(1)[:, None] * s
    d_w_magnitude = np.abs(c64 * x64).sum(1)[:, None] * np.abs(s)
    assert_close(d_w, Float64Product(d_w_value, d_w_magnitude, x.shape[1] + 2), name="d_w")


def test_numpy_data_is_routed_by_traced_ids_under_jit_and_vmap():
    """x, y_sorted and weights as NumPy arrays closed over by a jit or a vmap whose ids
    are traced: they are gathered by traced indices, as JAX arrays would be."""
    x, ids, weights = _inputs(3, 7, 2, 4)
    want = route(jnp.asarray(x), ids, 4)

    def there_and_back(ids):
        r = route(x, ids, 4)
        return r.sorted_x, unroute(r.sorted_x, r, weights)

    sorted_x, combined = jax.jit(there_and_back)(ids)
    np.testing.assert_array_equal(sorted_x, want.sorted_x)
    np.testing.assert_array_equal(combined, unroute(want.sorted_x, want, weights))
    batched = jax.vmap(lambda i: route(x, i, 4).sorted_x)(np.stack([ids, ids[::-1]]))
    np.testing.assert_array_equal(batched[0], want.sorted_x)
    np.testing.assert_array_equal(batched[1], route(x, ids[::-1], 4).sorted_x)
    y = np.asarray(want.sorted_x)  # NumPy rows, traced routing
    np.testing.assert_array_equal(
        jax.jit(lambda r: unroute(y, r, weights))(want), unroute(y, want, weights)
    )


def test_traced_out_of_range_ids_are_in_no_group_and_checkify_reports_them():
    x, ids, _ = _inputs(2, 10, 1, 4)
    ids[3, 0], ids[7, 0] = 4, -1
    r = jax.jit(route, static_argnums=2)(x, ids, 4)
    assert int(r.group_sizes.sum()) == 8
    np.testing.assert_array_equal(r.sorted_expert_ids[-2:], [4, 4])  # sorted last
    err, _ = checkify.checkify(jax.jit(route, static_argnums=2))(x, ids, 4)
    with pytest.raises(checkify.JaxRuntimeError, match="expert_ids must lie in"):
        err.throw()


BAD_ROUTE = [
    (dict(x=np.zeros(4, np.float32)), ValueError, "route: x must have shape"),
    (dict(x=[[1.0, 2.0]] * 4), TypeError, "route: x must be an array of shape"),
    (dict(ids=np.zeros(4, np.float32)), TypeError, "route: expert_ids must have an integer"),
    (dict(ids=np.zeros(4, bool)), TypeError, "route: expert_ids must have an integer"),
    (dict(ids=np.zeros(3, np.int32)), ValueError, r"expert_ids must have shape .*tokens=4"),
    (dict(ids=np.zeros((4, 0), np.int32)), ValueError, "top_k >= 1"),
    (dict(ids=np.zeros((4, 1, 1), np.int32)), ValueError, "route: expert_ids must have shape"),
    (dict(ids=np.array([0, 1, 3, 1])), ValueError, r"route: expert_ids must lie in \[0, 3\)"),
    (dict(ids=np.array([0, -1, 2, 1])), ValueError, r"values in \[-1, 2\]"),
    (dict(num_experts=0), ValueError, "route: num_experts must be >= 1"),
    (dict(num_experts=3.0), TypeError, "route: num_experts must be a Python int"),
]


@pytest.mark.parametrize("bad, error, match", BAD_ROUTE)
def test_route_rejects_bad_arguments(bad, error, match):
    args = dict(x=np.ones((4, 2), np.float32), ids=np.array([0, 1, 2, 1]), num_experts=3)
    args |= bad
    with pytest.raises(error, match=match):
        route(args["x"], args["ids"], args["num_experts"])


def test_route_rejects_a_traced_num_experts():
    with pytest.raises(TypeError, match=r"route: num_experts .* static"):
        jax.jit(route)(np.ones((2, 2)), np.array([0, 1]), 2)


def test_unroute_rejects_bad_arguments():
    x, ids, weights = _inputs(0, 6, 2, 3)
    r = route(x, ids, 3)
    with pytest.raises(TypeError, match="unroute: routing must be the Routing"):
        unroute(r.sorted_x, tuple(r))
    with pytest.raises(ValueError, match=r"unroute: y_sorted has 11 rows, but routing sorted 12"):
        unroute(r.sorted_x[:11], r)
    with pytest.raises(ValueError, match=r"unroute: y_sorted must have shape"):
        unroute(r.sorted_x[:, 0], r)
    with pytest.raises(ValueError, match=r"unroute: weights must have shape \[tokens, top_k\]"):
        unroute(r.sorted_x, r, weights[:, :1])
    with pytest.raises(TypeError, match="unroute: weights must have a floating dtype"):
        unroute(r.sorted_x, r, ids)
    with pytest.raises(TypeError, match="unroute: y_sorted must be an array of shape"):
        unroute(np.asarray(r.sorted_x).tolist(), r)
    with pytest.raises(TypeError, match="unroute: weights must be None or an array"):
        unroute(r.sorted_x, r, weights.tolist())
