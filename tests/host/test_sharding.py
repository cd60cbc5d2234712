"""get_corrected_named_sharding on the 8 fake CPU devices set up in conftest."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_bridge.host.sharding import get_corrected_named_sharding
from tests.devices import first_devices

MESH_LAYOUTS = {
    "flat": ((8,), ("data",)),
    "2d": ((2, 4), ("data", "model")),
    "3d": ((2, 2, 2), ("data", "fsdp", "tensor")),
}
# Names on some meshes but not others, plus one that is on none.
AXIS_NAMES = ["data", "model", "fsdp", "tensor", "absent"]


def make_mesh(layout: str) -> Mesh:
    shape, names = MESH_LAYOUTS[layout]
    return Mesh(np.array(first_devices(math.prod(shape))).reshape(shape), names)


spec_entries = st.one_of(
    st.none(),
    st.sampled_from(AXIS_NAMES),
    st.lists(st.sampled_from(AXIS_NAMES), min_size=1, max_size=3).map(tuple),
)


def entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def as_spec(entries) -> PartitionSpec:
    return PartitionSpec(*entries)


@given(
    layout=st.sampled_from(sorted(MESH_LAYOUTS)),
    shape=st.lists(st.sampled_from([0, 1, 2, 3, 4, 6, 8, 12, 16]), max_size=4).map(tuple),
    entries=st.lists(spec_entries, max_size=6),
    as_partition_spec=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_corrected_spec_is_valid_and_keeps_every_valid_entry(
    layout, shape, entries, as_partition_spec, seed
):
    mesh = make_mesh(layout)
    spec_in = PartitionSpec(*entries) if as_partition_spec else tuple(entries)
    sharding = get_corrected_named_sharding(shape, spec_in, mesh)

    assert isinstance(sharding, NamedSharding) and sharding.mesh is mesh
    out = list(sharding.spec)
    wanted = (list(entries) + [None] * len(shape))[: len(shape)]
    if all(entry is None for entry in out):
        assert sharding.spec == PartitionSpec()  # fully replicated spelled canonically
        out = [None] * len(shape)
    assert len(out) == len(shape)

    # Walk left to right: each entry is kept as written iff it is valid given the entries
    # kept before it; otherwise it is None.
    used: set[str] = set()
    for dim, entry, got in zip(shape, wanted, out, strict=True):
        axes = entry_axes(entry)
        valid = (
            bool(axes)
            and set(axes) <= set(mesh.axis_names)
            and len(set(axes)) == len(axes)
            and used.isdisjoint(axes)
            and dim % math.prod(mesh.shape[a] for a in axes) == 0
        )
        if valid:
            assert PartitionSpec(got) == PartitionSpec(entry)
            used.update(axes)
        else:
            assert got is None

    # JAX accepts it: the array lands on the mesh intact, split as the spec says.
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    placed = jax.device_put(x, sharding)
    np.testing.assert_array_equal(np.asarray(placed), x)
    expected_shard = tuple(
        dim // math.prod(mesh.shape[a] for a in entry_axes(entry))
        for dim, entry in zip(shape, out, strict=True)
    )
    assert sharding.shard_shape(shape) == expected_shard
    assert all(shard.data.shape == expected_shard for shard in placed.addressable_shards)


def test_tuple_entry_is_kept_when_the_product_divides():
    mesh = make_mesh("3d")
    sharding = get_corrected_named_sharding((8, 6), (("data", "fsdp"), "tensor"), mesh)
    assert sharding.spec == PartitionSpec(("data", "fsdp"), "tensor")
    # 4 devices do not divide 6, although each axis alone would.
    sharding = get_corrected_named_sharding((6, 8), (("data", "fsdp"), "tensor"), mesh)
    assert sharding.spec == PartitionSpec(None, "tensor")


def test_spec_is_padded_and_truncated_to_the_rank():
    mesh = make_mesh("2d")
    assert get_corrected_named_sharding((4, 8, 3), ("data",), mesh).spec == PartitionSpec(
        "data", None, None
    )
    assert get_corrected_named_sharding((4,), ("data", "model"), mesh).spec == PartitionSpec("data")
    assert get_corrected_named_sharding((), ("data",), mesh).spec == PartitionSpec()


def test_repeated_axis_keeps_the_first_kept_use():
    mesh = make_mesh("2d")
    spec = get_corrected_named_sharding((4, 8), ("data", ("model", "data")), mesh).spec
    assert spec == PartitionSpec("data", None)
    # A use that is dropped for another reason does not block a later one.
    spec = get_corrected_named_sharding((3, 8), ("data", "data"), mesh).spec
    assert spec == PartitionSpec(None, "data")
    spec = get_corrected_named_sharding((8,), (("data", "data"),), mesh).spec
    assert spec == PartitionSpec()


def test_nothing_valid_gives_a_replicated_sharding():
    mesh = make_mesh("flat")
    sharding = get_corrected_named_sharding((3, 5), ("absent", "data"), mesh)
    assert sharding.spec == PartitionSpec() and sharding.is_fully_replicated
    assert get_corrected_named_sharding((3, 5), None, mesh).spec == PartitionSpec()


def test_works_inside_jit_as_a_sharding_constraint():
    mesh = make_mesh("2d")
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)

    @jax.jit
    def double(x):
        sharding = get_corrected_named_sharding(x.shape, ("data", "model"), mesh)
        return jax.lax.with_sharding_constraint(2 * x, sharding)

    out = double(x)
    np.testing.assert_allclose(np.asarray(out), 2 * x)
    # 6 is not divisible by the 4-way "model" axis, so only "data" survives.
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("data", None)), 2)


@pytest.mark.parametrize(
    ("shape", "spec", "mesh", "error", "match"),
    [
        ((4,), ("data",), "not a mesh", TypeError, "mesh must be"),
        ((4,), "data", None, TypeError, "partition_spec must be"),
        ((4,), (3,), None, TypeError, "partition_spec entry 0"),
        ((4, 4), (None, ("data", 1)), None, TypeError, "partition_spec entry 1"),
        ((4, -1), ("data",), None, ValueError, "shape must have non-negative"),
        ((4.0,), ("data",), None, TypeError, "shape must be a sequence of ints"),
        (4, ("data",), None, TypeError, "shape must be a sequence of ints"),
    ],
)
def test_bad_input_is_rejected(shape, spec, mesh, error, match):
    mesh = make_mesh("flat") if mesh is None else mesh
    with pytest.raises(error, match=match):
        get_corrected_named_sharding(shape, spec, mesh)
