"""Partition specs corrected to fit an array's shape and a mesh.

A spec written for one model (say `P("data", "fsdp", "tensor")`) often meets arrays of
another rank, meshes without some axis, or dimensions a mesh axis does not divide.
`get_corrected_named_sharding` turns any such spec into one `jax.device_put` accepts,
keeping every entry that is valid as it was written and replicating the rest.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jax_bridge.core.validation import naming_op

__all__ = ["get_corrected_named_sharding"]

SpecEntry = str | tuple[str, ...] | None


def _entry_axes(entry: object, position: int) -> tuple[str, ...]:
    """Mesh axis names of one spec entry (None -> no axes)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple | list) and all(isinstance(name, str) for name in entry):
        return tuple(entry)
    raise TypeError(
        f"partition_spec entry {position} must be None, a mesh axis name or a tuple of "
        f"names, got {entry!r}"
    )


def _spec_entries(partition_spec: object) -> list[object]:
    if partition_spec is None:
        return []
    if isinstance(partition_spec, PartitionSpec | tuple | list):
        return list(partition_spec)
    raise TypeError(
        "partition_spec must be a jax.sharding.PartitionSpec, a tuple/list of entries or "
        f"None, got {type(partition_spec).__name__}"
    )


@naming_op("get_corrected_named_sharding")
def get_corrected_named_sharding(
    shape: Sequence[int],
    partition_spec: PartitionSpec | Sequence[SpecEntry] | None,
    mesh: Mesh | AbstractMesh,
) -> NamedSharding:
    """A `NamedSharding` of `mesh` for an array of `shape`, as close to the spec as fits.

    Entry `d` of the result shards dimension `d`. Rules, applied left to right:
    - the spec is padded with None or truncated to `len(shape)` entries;
    - an entry (one axis name or a tuple such as `("data", "fsdp")`) is kept exactly as
      written when all its axes are in the mesh, no axis repeats within it or appears in
      an earlier kept entry, and the product of their sizes divides `shape[d]`;
      otherwise it becomes None.
      JAX rejects a spec naming one mesh axis twice, so the later use is the one dropped.
      (A zero-sized dimension is divisible by any mesh size and stays sharded.)
    - when no entry is kept the spec is `PartitionSpec()` (fully replicated); otherwise it
      has exactly `len(shape)` entries.

    Args:
      shape: the array's shape, non-negative ints.
      partition_spec: the wanted spec (a `PartitionSpec`, a tuple/list of entries, or None).
      mesh: the device mesh (`jax.sharding.Mesh` or `AbstractMesh`).

    Returns:
      `NamedSharding(mesh, corrected_spec)`.
    """
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must have non-negative dims, got {tuple(shape)}")

    entries = _spec_entries(partition_spec)[: len(dims)]
    entries += [None] * (len(dims) - len(entries))
    axis_sizes = dict(mesh.shape)
    used_axes: set[str] = set()
    corrected: list[SpecEntry] = []
    for position, (entry, dim) in enumerate(zip(entries, dims, strict=True)):
        axes = _entry_axes(entry, position)
        keep = (
            bool(axes)
            and all(name in axis_sizes for name in axes)
            and len(set(axes)) == len(axes)
            and used_axes.isdisjoint(axes)
            and dim % math.prod(axis_sizes[name] for name in axes) == 0
        )
        if keep:
            used_axes.update(axes)
            corrected.append(tuple(entry) if isinstance(entry, list) else entry)
        else:
            corrected.append(None)

    if not used_axes:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(*corrected))
