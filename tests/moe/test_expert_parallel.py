"""The MoE block expert-sharded over 2 and 4 of the 8 fake CPU devices equals the block
on one device, forward and gradients of x and every weight, with both dispatches:
tokens replicated (group_offset + psum) and tokens sharded (all_to_all). Also: the
all-to-all dispatch/combine round trip, the documented capacity drops (against the
float64 oracle with those copies removed), and the argument checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bridge.moe import (
    all_to_all_combine,
    all_to_all_dispatch,
    expert_parallel_moe_feed_forward,
    route,
)
from tests.devices import first_devices
from tests.moe.helpers import (
    assert_close,
    assert_tree_close,
    moe_float64,
    moe_grads_float64,
    problem,
    top_k64,
)

TOP_K = 2


def _mesh(devices: int) -> Mesh:
    return Mesh(np.array(first_devices(devices)), ("expert",))


@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_block_equals_the_single_device_block(devices, dispatch):
    x, params = problem(100 + devices)
    sharded = functools.partial(
        expert_parallel_moe_feed_forward,
        mesh=_mesh(devices),
        axis_name="expert",
        top_k=TOP_K,
        dispatch=dispatch,
    )
    # The single-device block meets the same float64 bounds (tests/moe/test_block.py): the
    # two agree within twice them whatever either's summation order.
    assert_close(jax.jit(sharded)(x, params), moe_float64(x, params, TOP_K), "forward")

    cotangent = jnp.asarray(np.random.default_rng(devices).standard_normal(x.shape), jnp.float32)
    loss = lambda x, params: jnp.sum(sharded(x, params) * cotangent)
    grads = jax.jit(jax.grad(loss, (0, 1)))(x, params)
    assert_tree_close(grads, moe_grads_float64(x, params, TOP_K, cotangent))


def test_outputs_and_weight_gradients_are_sharded_as_documented():
    x, params = problem(7)
    mesh = _mesh(4)
    block = functools.partial(expert_parallel_moe_feed_forward, mesh=mesh, axis_name="expert")
    replicated = jax.jit(block)(x, params)
    sharded = jax.jit(functools.partial(block, dispatch="all_to_all"))(x, params)
    assert replicated.sharding.is_fully_replicated
    assert sharded.sharding.spec == P("expert")  # tokens stay where they were
    grads = jax.jit(jax.grad(lambda p: jnp.sum(block(x, p, dispatch="all_to_all") ** 2)))(params)
    assert grads.w_up.sharding.spec == P("expert")  # each device: its experts' gradient
    assert grads.router.sharding.is_fully_replicated


@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
def test_make_mesh_explicit_axes_and_inputs_sharded_otherwise(dispatch):
    """`jax.make_mesh` gives explicit axes, where a jitted shard_map refuses inputs not
    laid out as its spec: the block reshards them (tokens over "data", weights whole)."""
    x, params = problem(13)
    mesh = jax.make_mesh((2, 2), ("data", "expert"), devices=first_devices(4))
    assert jax.sharding.AxisType.Explicit in mesh.axis_types
    x_in = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    block = functools.partial(
        expert_parallel_moe_feed_forward, mesh=mesh, axis_name="expert", dispatch=dispatch
    )
    assert_close(block(x_in, params), moe_float64(x, params, TOP_K), "forward")
    # A fixed cotangent: the block's rounded output does not feed its own backward.
    cotangent = jnp.asarray(np.random.default_rng(14).standard_normal(x.shape), jnp.float32)
    loss = lambda x, p: jnp.sum(block(x, p) * cotangent)
    grads = jax.jit(jax.grad(loss, (0, 1)))(x_in, params)
    assert_tree_close(grads, moe_grads_float64(x, params, TOP_K, cotangent))


def _dispatch_round_trip(x, expert_ids, mesh, capacity):
    """Per device: route, dispatch, identity experts, combine. Returns (the combined rows
    [T*K, hidden], the routing's sorted rows, rows received per local expert)."""

    def body(x, ids):
        routing = route(x, ids, 8)
        sent = all_to_all_dispatch(routing, "expert", capacity=capacity)
        back = all_to_all_combine(sent.x, sent, "expert")
        return back, routing.sorted_x, sent.group_sizes

    spec = P("expert")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec, spec))
    return jax.jit(fn)(x, expert_ids)


def test_dispatch_then_combine_returns_every_copy_to_its_slot():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((32, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 8, (32, 3)), jnp.int32)
    back, sorted_x, received = _dispatch_round_trip(x, ids, _mesh(4), capacity=None)
    np.testing.assert_array_equal(back, sorted_x)
    # Device d received, per local expert, every copy of the batch routed there.
    np.testing.assert_array_equal(received, np.bincount(np.ravel(ids), minlength=8))


def _kept_copies(ids: np.ndarray, devices: int, capacity: int, experts: int = 8) -> np.ndarray:
    """The documented drop rule, as a loop: per (source, destination) pair the first
    `capacity` copies in (expert, token, choice) order are kept. bool [T, K]."""
    tokens, top_k = ids.shape
    local_tokens, local_experts = tokens // devices, experts // devices
    keep = np.zeros(ids.shape, bool)
    for source in range(devices):
        copies = [
            (ids[t, j], t, j)
            for t in range(source * local_tokens, (source + 1) * local_tokens)
            for j in range(top_k)
        ]
        for dest in range(devices):
            bound = sorted(c for c in copies if c[0] // local_experts == dest)
            for _, t, j in bound[:capacity]:
                keep[t, j] = True
    return keep


@pytest.mark.parametrize("capacity", [3, 9])
def test_capacity_drops_the_documented_copies(capacity):
    x, params = problem(9)
    devices = 4
    ids, _ = top_k64(x, params.router, TOP_K)
    keep = _kept_copies(ids, devices, capacity)
    assert 0 < keep.sum() < keep.size  # some copies drop, some stay
    out = jax.jit(
        functools.partial(
            expert_parallel_moe_feed_forward,
            mesh=_mesh(devices),
            axis_name="expert",
            top_k=TOP_K,
            dispatch="all_to_all",
            capacity=capacity,
        )
    )(x, params)
    assert_close(out, moe_float64(x, params, TOP_K, keep=keep), "dropped copies")


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(axis_name="data"), ValueError, r"axis_name 'data' is not an axis of mesh"),
        (dict(dispatch="ring"), ValueError, r"dispatch must be one of \('replicated'"),
        (dict(devices=8, experts=4), ValueError, r"num_experts \(4\) must be a multiple"),
        (dict(dispatch="all_to_all", tokens=6), ValueError, r"tokens \(6\) .* multiple of its"),
        (dict(capacity=4), ValueError, r"capacity applies to dispatch='all_to_all' only"),
        (dict(dispatch="all_to_all", capacity=0), ValueError, "capacity must be >= 1"),
        (dict(top_k=0), ValueError, "top_k must be >= 1"),
    ],
)
def test_bad_arguments_name_the_op_and_the_argument(change, error, match):
    devices, experts = change.pop("devices", 4), change.pop("experts", 8)
    x, params = problem(1, tokens=change.pop("tokens", 8), experts=experts)
    kwargs = dict(mesh=_mesh(devices), axis_name="expert") | change
    with pytest.raises(error, match=f"expert_parallel_moe_feed_forward: .*{match}"):
        expert_parallel_moe_feed_forward(x, params, **kwargs)


def test_forward_mode_is_refused_naming_the_op():
    x, params = problem(3, tokens=8)
    block = functools.partial(
        expert_parallel_moe_feed_forward, mesh=_mesh(2), axis_name="expert", top_k=TOP_K
    )
    with pytest.raises(NotImplementedError, match="expert_parallel_moe_feed_forward: forward"):
        jax.jvp(block, (x, params), (x, params))
