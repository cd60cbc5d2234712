"""`jit_shard_map` takes global arrays of any sharding on meshes of every axis type.

A `shard_map` under `jit` on a mesh with explicit axes (`jax.make_mesh`'s default) refuses
inputs whose sharding differs from the spec; the wrapper moves them first. The body here
reports each device's shard, so the test checks the layout the body saw, not only the
result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bridge.core.sharding import jit_shard_map
from tests.devices import first_devices

KINDS = {
    "explicit": (AxisType.Explicit, AxisType.Explicit),
    "auto": (AxisType.Auto, AxisType.Auto),
    "mixed": (AxisType.Explicit, AxisType.Auto),
}


def _mesh(kind: str):
    return jax.make_mesh((2, 2), ("a", "b"), axis_types=KINDS[kind], devices=first_devices(4))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("placed", [P(), P("b"), P(None, "a")])
def test_inputs_of_any_sharding_reach_the_body_as_their_spec(kind, placed):
    mesh = _mesh(kind)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    explicit_only = all(mesh._name_to_type[n] == AxisType.Explicit for n in placed if n)
    x_in = jax.device_put(x, NamedSharding(mesh, placed)) if explicit_only else jnp.asarray(x)
    # Per device: its row shard (along "a") and the rows' global offset, plus the
    # replicated second input, which must arrive whole.
    body = lambda x, y: (x + jnp.sum(y), jnp.full((1,), x.shape[0]))
    run = jit_shard_map(body, mesh=mesh, in_specs=(P("a"), P()), out_specs=(P("a"), P("a")))
    y = jnp.arange(3.0)
    out, rows = run(x_in, y)
    np.testing.assert_allclose(out, x + 3.0)
    np.testing.assert_array_equal(rows, [2, 2])


def test_none_arguments_and_pytrees_of_specs():
    mesh = _mesh("explicit")
    # Every row distinct: row shards that came back swapped or repeated would show.
    w, bias = np.arange(8.0).reshape(4, 2) + 1.0, np.array([2.0, 3.0])
    tree = {"w": jnp.asarray(w), "b": jnp.asarray(bias)}
    body = lambda t, none: t["w"] * t["b"] if none is None else None
    specs = ({"w": P("a"), "b": P()}, None)
    out = jit_shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("a"))(tree, None)
    np.testing.assert_array_equal(out, w * bias)  # exact: one product an element
