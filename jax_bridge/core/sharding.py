"""Entering `jax.shard_map` from global arrays of any sharding, on any kind of mesh.

`shard_map` under `jit` requires each argument's sharding to match its `in_spec` when the
spec names `Explicit` mesh axes (the default of `jax.make_mesh` since jax 0.7), and says
nothing about inputs on `Auto` axes. The ops that wrap a `shard_map` for the user take
global arrays "in any sharding", so they move each input to its spec first: `reshard` for
explicit axes, `with_sharding_constraint` for auto ones (each API refuses the other kind).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def _spec_axes(spec: PartitionSpec) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def to_spec(x: jax.Array, mesh: Mesh, spec: PartitionSpec) -> jax.Array:
    """`x` laid out as `spec` on `mesh` (under `jit`: a resharding the compiler places).

    A spec over explicit axes (or no axes, on a mesh with explicit ones) reshards; any
    other spec constrains. A spec mixing the two kinds is refused by JAX itself.
    """
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    axes = _spec_axes(spec)
    explicit = [types[a] == AxisType.Explicit for a in axes]
    if all(explicit) and (axes or AxisType.Explicit in types.values()):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def jit_shard_map(
    body: Callable[..., Any], *, mesh: Mesh, in_specs: tuple[Any, ...], out_specs: Any
) -> Callable[..., Any]:
    """`jax.jit(jax.shard_map(body, ...))` that first moves every input to its spec.

    `in_specs` holds one spec (or pytree of specs, or None for a None argument) per
    positional argument, as `shard_map` takes them.
    """
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def run(*args: Any) -> Any:
        def place(spec: PartitionSpec | None, arg: Any) -> Any:
            if spec is None:  # shard_map's spec for a None argument
                return arg
            return jax.tree.map(lambda leaf: to_spec(leaf, mesh, spec), arg)

        is_spec = lambda s: isinstance(s, PartitionSpec) or s is None
        placed = jax.tree.map(place, in_specs, args, is_leaf=is_spec)
        return mapped(*placed)

    return jax.jit(run)
