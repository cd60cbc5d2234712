"""What is specific to the Triton grouped matmul backend (`jax_bridge.grouped_matmul.triton`).

* Group metadata (`make_group_metadata`, hypothesis): every row of every local group is
  visited by exactly one chunk, no chunk is empty, surplus slots stay in range; group
  bounds clip to m when traced sizes overflow.
* The gmm kernel launched bare (outputs start NaN) writes every row once: the rows of
  its local groups, each to the float64 loop's value, and zeros elsewhere (valid group
  sizes, and traced negative ones, which count as 0).
* Launch configurations: `GroupedMatmulConfig` validation (messages name
  `GroupedMatmulConfig.field`), the defaults and tiling overrides of `gmm_config` /
  `tgmm_config`, pipeline stages that fit shared memory, the launches the op makes
  (recorded for sm_80 and sm_90, no kernel runs): each kernel's default, or `config=`
  in every launch with the stages tgmm's shared memory holds; and `config=` through the
  public ops: used as given (it replaces `tiling`), for the gradient's matmuls too, with
  the float64 loop's numbers.
"""

from __future__ import annotations

import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import (
    GroupedMatmulConfig,
    GroupedMatmulConfigs,
    grouped_matmul,
    transposed_grouped_matmul,
)
from jax_bridge.grouped_matmul import triton as triton_backend
from jax_bridge.grouped_matmul.metadata import (
    local_group_bounds,
    make_group_metadata,
    num_chunk_slots,
)
from jax_bridge.launch.host_descriptors import HostDescriptor
from jax_bridge.launch.target import cuda_lowering, interpreting
from jax_bridge.launch.triton_call import triton_call
from jax_bridge.tuning import default_grouped_matmul_config
from tests.devices import needs_tensor_descriptors, skip_unless_host_descriptors_launch
from tests.grouped_matmul.helpers import (
    assert_close,
    bounds,
    gmm_float64,
    normal,
    tgmm_float64,
)
from tests.launches import Launch, record_launches
from triton_kernels.config import pipeline_buffers
from triton_kernels.grouped_matmul.config import (
    DEFAULT_TILING,
    HOPPER_WARP_SPECIALIZED_GMM,
    HOPPER_WARP_SPECIALIZED_TGMM,
    gmm_config,
    tgmm_config,
    warp_specialized_gmm_config,
)
from triton_kernels.grouped_matmul.kernels import (
    gmm_grid,
    gmm_kernel,
    tgmm_grid,
    tgmm_kernel,
    tgmm_walk_grid,
    tgmm_walk_kernel,
    tgmm_walk_splits,
)
from triton_kernels.grouped_matmul.schedule import gmm_schedule_kernel

# --- group metadata ----------------------------------------------------------------------


@st.composite
def metadata_problems(draw):
    num_total = draw(st.integers(1, 9))
    sizes = draw(st.lists(st.integers(0, 40), min_size=num_total, max_size=num_total))
    m = draw(st.integers(sum(sizes), sum(sizes) + 50))
    local = draw(st.integers(1, num_total))
    offset = draw(st.integers(0, num_total - local))
    return sizes, m, draw(st.sampled_from([1, 4, 16, 128])), offset, local


@hypothesis.given(metadata_problems())
def test_metadata_visits_each_row_of_each_local_group_exactly_once(problem):
    sizes, m, block, offset, local = problem
    meta = jax.jit(make_group_metadata, static_argnames=("m", "block_m", "num_groups"))(
        jnp.asarray(sizes, jnp.int32), m=m, block_m=block, group_offset=offset, num_groups=local
    )
    num_slots = num_chunk_slots(m, block, local)
    assert meta.chunk_group.shape == meta.chunk_row_start.shape == (num_slots,)
    num_chunks = int(meta.num_chunks[0])
    assert num_chunks <= num_slots

    starts, ends = bounds(sizes)
    chunk_group = np.asarray(meta.chunk_group)[:num_chunks]
    row_starts = np.asarray(meta.chunk_row_start)[:num_chunks]
    assert np.all(np.diff(chunk_group) >= 0)
    visits = np.zeros(m, np.int64)
    for g in range(local):
        # A group's tiles start at its first row and step by the block: only its last
        # tile is partial, and no tile holds another group's rows.
        s, e = starts[offset + g], ends[offset + g]
        np.testing.assert_array_equal(row_starts[chunk_group == g], np.arange(s, e, block))
        for r in row_starts[chunk_group == g]:
            visits[r : min(r + block, e)] += 1
    wanted = np.zeros(m, np.int64)
    wanted[starts[offset] : ends[offset + local - 1]] = 1
    np.testing.assert_array_equal(visits, wanted)
    # Surplus slots still index valid groups and rows (they are read, then skipped).
    assert np.all((np.asarray(meta.chunk_group) >= 0) & (np.asarray(meta.chunk_group) < local))
    assert np.all(np.asarray(meta.chunk_row_start) >= 0)
    assert np.all(np.asarray(meta.chunk_row_start) < max(m, 1))


@st.composite
def unchecked_metadata_problems(draw):
    """Any values a traced call may bring: negative sizes, sizes past m (and sums past
    int32), offsets outside the groups (clamped, as `jax.lax.dynamic_slice` clamps them)."""
    num_total = draw(st.integers(1, 9))
    size = st.one_of(st.integers(-5, 40), st.integers(2**31 - 40, 2**31 - 1))
    sizes = draw(st.lists(size, min_size=num_total, max_size=num_total))
    local = draw(st.integers(1, num_total))
    offset = draw(st.integers(-2, num_total + 1))
    block = draw(st.sampled_from([1, 4, 16, 128]))
    return sizes, draw(st.integers(1, 120)), block, offset, local


@hypothesis.given(st.one_of(metadata_problems().filter(lambda p: p[1] > 0),
                            unchecked_metadata_problems()))  # fmt: skip
def test_schedule_kernel_builds_the_xla_metadata(problem):
    """The gmm backend's one-launch metadata (`gmm_schedule_kernel`) is
    `make_group_metadata`'s, array for array, surplus slots included."""
    sizes, m, block, offset, local = problem
    sizes = jnp.asarray(sizes, jnp.int32)
    got = triton_backend.group_metadata(sizes, offset, m=m, block_m=block, num_groups=local)
    want = make_group_metadata(sizes, m=m, block_m=block, group_offset=offset, num_groups=local)
    for field, a, b in zip(want._fields, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=field)


def test_many_groups_take_the_xla_metadata(monkeypatch):
    """Past the kernel's group limits (it holds every group in registers) the metadata
    comes from XLA, the same arrays; below them from the kernel."""
    sizes = jnp.asarray(np.random.default_rng(3).integers(0, 5, 40), jnp.int32)
    launches = []
    real_call = triton_backend.triton_call
    monkeypatch.setattr(
        triton_backend, "triton_call", lambda *a, **k: launches.append(1) or real_call(*a, **k)
    )
    want = make_group_metadata(sizes, m=100, block_m=16, group_offset=3, num_groups=20)
    for limits, kernel_launches in (((512, 8192), 1), ((16, 8192), 0), ((512, 32), 0)):
        monkeypatch.setattr(triton_backend, "_KERNEL_METADATA_GROUPS", limits[0])
        monkeypatch.setattr(triton_backend, "_KERNEL_METADATA_TOTAL", limits[1])
        launches.clear()
        got = triton_backend.group_metadata(sizes, 3, m=100, block_m=16, num_groups=20)
        assert len(launches) == kernel_launches, limits
        for field, a, b in zip(want._fields, got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=field)


@pytest.mark.parametrize(
    "sizes, offset, want",
    [
        ([10, 30, 25], 1, ([10, 32], [32, 32])),
        # sums past int32 (a plain int32 cumsum wraps them to [2**31 - 1, -2, 3])
        ([2**31 - 1, 2**31 - 1, 5], 1, ([32, 32], [32, 32])),
        ([20, 2**30, 2**30, 2**30, 2**30, 3], 3, ([32, 32], [32, 32])),
    ],
)
def test_local_group_bounds_clip_to_m_when_sizes_overflow(sizes, offset, want):
    # Traced sizes are not value-checked: bounds are the exact ones cut at m, in [0, m].
    bounds_fn = jax.jit(local_group_bounds, static_argnames=("m", "num_groups"))
    starts, ends = bounds_fn(jnp.asarray(sizes, jnp.int32), m=32, group_offset=offset, num_groups=2)
    np.testing.assert_array_equal(starts, want[0])
    np.testing.assert_array_equal(ends, want[1])


# --- launch configuration ----------------------------------------------------------------


def test_launch_config_defaults_and_overrides():
    default = gmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=90)
    assert default.tiling == (128, 64, 256) and default.num_warps == 8
    # megablox's tiling elsewhere, and where the Hopper tile's init epilogue would spill
    for capability, accumulate in ((80, False), (None, False), (90, True)):
        other = gmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=capability,
                           accumulate=accumulate)  # fmt: skip
        assert other.tiling == DEFAULT_TILING, (capability, accumulate)
    # 4-byte inputs: a quarter of the reduction step (their FMA dots spill at 64)
    fp32 = gmm_config(8192, 2048, 1408, element_bytes=4, compute_capability=90)
    assert fp32.tiling == (128, 32, 128) and fp32.num_stages == 4
    assert tgmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=90).tiling == (
        DEFAULT_TILING
    )
    # The weight gradient (token-major lhs) on Hopper: over short groups (<= 256 rows on
    # average) 64-row steps at 2 stages; over longer ones (or groups not given) a
    # [128, 256] output tile at 8 warps, but with existing_out; other GPUs, the [k, m]
    # layout: the default.
    weight_gradient = dict(element_bytes=2, lhs_token_major=True)
    short = tgmm_config(8192, 2048, 1408, compute_capability=90, num_groups=32, **weight_gradient)
    assert (short.tiling, short.num_stages, short.num_warps) == ((64, 128, 128), 2, 4)
    for groups in (31, None):
        wide = tgmm_config(8192, 2048, 1408, compute_capability=90, num_groups=groups,
                           **weight_gradient)  # fmt: skip
        assert (wide.tiling, wide.num_stages, wide.num_warps) == ((128, 128, 256), 2, 8)
    accumulating = tgmm_config(8192, 2048, 1408, compute_capability=90, num_groups=31,
                               accumulate=True, **weight_gradient)  # fmt: skip
    assert (accumulating.tiling, accumulating.num_warps) == (DEFAULT_TILING, 4)
    for capability, groups, token_major in ((80, 64, True), (90, 64, False), (90, 31, False)):
        other = tgmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=capability,
                            num_groups=groups, lhs_token_major=token_major)  # fmt: skip
        assert other.tiling == DEFAULT_TILING, (capability, groups, token_major)
    override = gmm_config(
        8192, 2048, 1408, element_bytes=2, compute_capability=80, tiling=(64, 32, 64)
    )
    assert override.tiling == (64, 32, 64) and override.num_warps == 4
    # Tiles larger than a dimension shrink to it (rounded up to a power of two, >= 16).
    small = gmm_config(20, 8, 100, element_bytes=2, compute_capability=90, tiling=(128, 128, 128))
    assert small.tiling == (32, 16, 128)
    assert tgmm_config(20, 40, 8, element_bytes=2, compute_capability=None).tiling == (32, 64, 16)


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("accumulate", [False, True], ids=["no_existing_out", "existing_out"])
def test_the_op_launches_the_default_configs(monkeypatch, capability, accumulate):
    """Without tiling or config, the forward gmm, the input gradient's gmm (transposed
    rhs) and the weight gradient's tgmm (token-major lhs) each launch their own kernel's
    default for the target GPU, sizes and groups (`gmm_config` / `tgmm_config`), which
    `default_grouped_matmul_config` reports: on sm_90 the gmm launches without
    existing_out take the Hopper tile, tgmm over these short groups 64-row steps."""
    launches = record_launches(monkeypatch, triton_backend)
    m, k, n, groups = 1024, 512, 768, 4
    rng = np.random.default_rng(3)
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (groups, k, n), jnp.bfloat16)
    init = normal(rng, (m, n)) if accumulate else None
    sizes = jnp.asarray([300, 0, 500, 224], jnp.int32)

    def loss(lhs, rhs):
        return grouped_matmul(lhs, rhs, sizes, existing_out=init, implementation="triton").sum()

    with cuda_lowering(capability):
        jax.grad(loss, (0, 1))(lhs, rhs)
    ops = [launch for launch in launches if launch.kernel is not gmm_schedule_kernel]
    assert [launch.kernel for launch in ops] == [gmm_kernel, gmm_kernel, tgmm_kernel]
    # one metadata launch for XLA to merge: tgmm asks for gmm's row tile, not its own
    schedules = [launch for launch in launches if launch.kernel is gmm_schedule_kernel]
    assert len(schedules) == 3 and all(s == schedules[0] for s in schedules)
    wanted = [
        gmm_config(m, k, n, element_bytes=2, compute_capability=capability,
                   accumulate=accumulate),
        gmm_config(m, n, k, element_bytes=2, compute_capability=capability),
        tgmm_config(m, k, n, element_bytes=2, compute_capability=capability,
                    lhs_token_major=True, num_groups=groups),
    ]  # fmt: skip
    for launch, config in zip(ops, wanted, strict=True):
        assert _launched_config(launch) == config
    hopper = capability == 90
    assert wanted[0].tiling == ((128, 64, 256) if hopper and not accumulate else DEFAULT_TILING)
    assert wanted[1].tiling == ((128, 64, 256) if hopper else DEFAULT_TILING)
    # 256 rows per group on average: short groups, which Hopper's tgmm takes in 64-row steps
    assert wanted[2].tiling == ((64, 128, 128) if hopper else DEFAULT_TILING)
    if not accumulate:  # what `default_grouped_matmul_config` reports (no existing_out)
        assert default_grouped_matmul_config((m, k, n), jnp.bfloat16, capability) == wanted[0]


def _launched_config(launch: Launch) -> GroupedMatmulConfig:
    c = launch.constexprs
    return GroupedMatmulConfig(
        block_m=c["BLOCK_M"], block_k=c["BLOCK_K"], block_n=c["BLOCK_N"],
        num_warps=launch.num_warps, num_stages=launch.num_stages, tma=c.get("TMA", False),
        warp_specialize=c.get("WARP_SPECIALIZE", False), persistent=c.get("PERSISTENT", False),
    )  # fmt: skip


def test_a_config_reaches_every_launch_with_the_stages_shared_memory_holds(monkeypatch):
    """config= reaches the forward and both gradient launches; Hopper's default gmm config
    (128 x 64 x 256, 4 stages: 192 KB in gmm) holds 80 KB a stage in tgmm, where 4 stages
    could not launch (320 KB): the weight gradient takes the 2 that fit, the rest as given."""
    launches = record_launches(monkeypatch, triton_backend)
    m, k, n, groups = 1024, 512, 768, 4
    rng = np.random.default_rng(4)
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (groups, k, n), jnp.bfloat16)
    sizes = jnp.asarray([300, 0, 500, 224], jnp.int32)
    config = default_grouped_matmul_config((m, k, n), jnp.bfloat16, 90)
    assert (config.tiling, config.num_stages) == ((128, 64, 256), 4)

    def loss(lhs, rhs):
        return grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton").sum()

    with cuda_lowering(90):
        jax.grad(loss, (0, 1))(lhs, rhs)
    ops = [launch for launch in launches if launch.kernel is not gmm_schedule_kernel]
    assert [launch.kernel for launch in ops] == [gmm_kernel, gmm_kernel, tgmm_kernel]
    assert [_launched_config(launch) for launch in ops] == [
        config, config, dataclasses.replace(config, num_stages=2)
    ]  # fmt: skip


def test_an_enclosing_interpreting_holds_inside_the_op():
    """`interpreting()` around the op (whose `interpret=False` is the default) runs every
    kernel, the gradients' too, through the interpreter under a GPU target: the op's own
    context had switched it off, and the kernels were lowered for the GPU."""
    rng = np.random.default_rng(31)
    sizes = jnp.asarray([20, 0, 27], jnp.int32)
    lhs, rhs, weight = normal(rng, (50, 32)), normal(rng, (3, 32, 16)), normal(rng, (50, 16))

    def loss(lhs, rhs):
        return jnp.sum(grouped_matmul(lhs, rhs, sizes, implementation="triton") * weight)

    with cuda_lowering(90), interpreting():
        d_lhs, d_rhs = jax.grad(loss, (0, 1))(lhs, rhs)
    assert_close(d_lhs, gmm_float64(weight, jnp.swapaxes(rhs, 1, 2), sizes))
    assert_close(d_rhs, tgmm_float64(lhs.T, weight, sizes, num_groups=3))


def test_each_kernel_takes_its_own_config(monkeypatch):
    """`GroupedMatmulConfigs`: gmm's config reaches the forward and the input gradient,
    tgmm's the weight gradient, and a kernel without one launches its default; the
    numbers are the float64 loop's. A warp-specialized tgmm config launches its loop
    warp-specialized through descriptors, but at block_k 64 with block_n 256 (gmm's
    warp-specialized tile, which Triton cannot compile in tgmm), where it runs
    unspecialized."""
    rng = np.random.default_rng(23)
    m, k, n, groups = 96, 64, 48, 3
    sizes = jnp.asarray([40, 0, 37], jnp.int32)
    lhs, rhs, weight = normal(rng, (m, k)), normal(rng, (groups, k, n)), normal(rng, (m, n))
    gmm = GroupedMatmulConfig(block_m=32, block_k=16, block_n=64, num_warps=2)
    tgmm = GroupedMatmulConfig(16, 32, 16, num_warps=4, tma=True, warp_specialize=True)
    wide = GroupedMatmulConfig(16, 64, 256, num_warps=4, tma=True, warp_specialize=True)

    def gradients(config):
        def loss(lhs, rhs):
            out = grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton")
            return jnp.sum(out * weight)

        return jax.grad(loss, (0, 1))(lhs, rhs)

    d_lhs, d_rhs = gradients(GroupedMatmulConfigs(gmm=gmm, tgmm=tgmm))
    assert_close(d_lhs, gmm_float64(weight, jnp.swapaxes(rhs, 1, 2), sizes))
    assert_close(d_rhs, tgmm_float64(lhs.T, weight, sizes, num_groups=groups))

    launches = record_launches(monkeypatch, triton_backend)

    def launched(config):
        launches.clear()
        with interpreting():  # the interpreter's defaults, on a GPU host too
            gradients(config)
        ops = [launch for launch in launches if launch.kernel is not gmm_schedule_kernel]
        assert [launch.kernel for launch in ops] == [gmm_kernel, gmm_kernel, tgmm_kernel]
        return [_launched_config(launch) for launch in ops]

    assert launched(GroupedMatmulConfigs(gmm=gmm, tgmm=tgmm)) == [gmm, gmm, tgmm]
    seen = launched(GroupedMatmulConfigs(tgmm=tgmm))
    assert seen[0] == gmm_config(m, k, n, element_bytes=4, compute_capability=None)
    assert seen[2] == tgmm
    assert launched(GroupedMatmulConfigs(tgmm=wide))[2] == dataclasses.replace(
        wide, warp_specialize=False
    )
    with pytest.raises(TypeError, match=r"GroupedMatmulConfigs\.tgmm must be a GroupedMatmul"):
        GroupedMatmulConfigs(tgmm=(16, 16, 16))


@pytest.mark.parametrize(
    "capability, budget_kib", [(80, 163), (86, 99), (90, 227), (100, 227), (120, 99)]
)
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_pipeline_stages_fit_in_shared_memory(capability, budget_kib, element_bytes):
    for tiling in [None, (128, 128, 128), (64, 32, 64), (128, 64, 256)]:
        for make in (gmm_config, tgmm_config):
            c = make(
                4096,
                4096,
                4096,
                element_bytes=element_bytes,
                compute_capability=capability,
                tiling=tiling,
            )
            if make is gmm_config:
                stage = (c.block_m * c.block_k + c.block_k * c.block_n) * element_bytes
            else:
                stage = (c.block_k * c.block_m + c.block_m * c.block_n) * element_bytes
            assert 1 <= c.num_stages <= 4
            buffers = pipeline_buffers(c.num_stages, capability)
            assert c.num_stages == 1 or buffers * stage <= budget_kib * 1024
            if tiling is None:  # a default keeps a copy in flight beside its MMAs
                assert buffers >= 2, (capability, element_bytes, c)


@pytest.mark.parametrize("capability", [86, 89, 120])
def test_small_shared_memory_defaults_halve_the_reduction_step(capability):
    """The GPUs of 99 KiB a block hold one buffer of the 16-bit default's 64 KiB stage:
    the default steps 64 rows of the reduction at 3 stages (two buffers) there, gmm's
    `block_k` and tgmm's `block_m`; a tiling the caller gives is kept."""
    gmm = gmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=capability)
    assert (gmm.tiling, gmm.num_stages) == ((128, 64, 128), 3)
    for token_major in (False, True):
        tgmm = tgmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=capability,
                           lhs_token_major=token_major, num_groups=64)  # fmt: skip
        assert (tgmm.tiling, tgmm.num_stages) == ((64, 128, 128), 3)
    given = gmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=capability,
                       tiling=DEFAULT_TILING)  # fmt: skip
    assert (given.tiling, given.num_stages) == (DEFAULT_TILING, 2)
    a100 = gmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=80)
    assert (a100.tiling, a100.num_stages) == (DEFAULT_TILING, 3)


# --- the kernel writes exactly its rows --------------------------------------------------


# (group sizes, offset, local groups, rows of the local groups): each computed once.
_WRITE_CASES = {
    # groups 1..4: rows of group 0, groups 5..6 and past them are zero
    "other-experts-and-tail": ([3, 20, 1, 0, 17, 6, 2], 1, 4, (3, 41)),
    # traced garbage (never checked under jit): a negative size counts as 0, so the local
    # groups 1..3 are [5, 7), [7, 7), [7, 9) and overlap nowhere (counted as they come,
    # [5, 7), [7, 1) and [1, 3) would leave gaps, and [48, -48, 64] more tiles than slots)
    "negative-size": ([5, 2, -6, 2, 9], 1, 3, (5, 9)),
    "negative-size-overlap": ([48, -48, 64], 0, 3, (0, 75)),
    # local groups 1..2 hold no rows (they start and end at row 21): no tile, every row 0
    "no-rows": ([21, 0, 0, 30], 1, 2, (21, 21)),
}


# How a bare launch loads its tiles: by pointers, through descriptors, warp-specialized.
_BY_LOADING = pytest.mark.parametrize(
    "tma, warp_specialize",
    [(False, False), (True, False), (True, True)],
    ids=["pointers", "tma", "tma-warp-specialized"],
)


# gmm's launches: `_BY_LOADING`, persistent (3 programs walking the tile list) by
# pointers and through descriptors, and through descriptors the launch encodes.
_GMM_LAUNCHES = pytest.mark.parametrize(
    "tma, warp_specialize, persistent, host",
    [
        (False, False, False, False),
        (True, False, False, False),
        (True, True, False, False),
        (False, False, True, False),
        (True, False, True, False),
        (True, False, False, True),
        (True, False, True, True),
    ],
    ids=[
        "pointers", "tma", "tma-warp-specialized", "persistent", "persistent-tma",
        "tma-host", "persistent-tma-host",
    ],
)  # fmt: skip


@pytest.mark.parametrize("case", _WRITE_CASES)
@_GMM_LAUNCHES
def test_gmm_kernel_writes_every_row_once(tma, warp_specialize, persistent, host, case):
    """Launched bare on an output that starts NaN (aliased to a NaN input, on a GPU as in
    the interpreter), every row of a local group must hold its product afterwards and
    every other row 0, which the kernel writes itself (no zero fill ahead of it). With
    `tma` tiles read (and multiply) other groups' rows too: those hold NaN and Inf here,
    and must reach no row of a local group. k = 24 also leaves a partial k tile.
    Warp-specialized, surplus slots do not return early: they run an empty loop and
    must store nothing. Persistent, 3 programs walk every tile and share out the zeroing
    of rows before and after the local groups. `host`: the two descriptors are the
    launch's (`HostDescriptor`), not built by the programs."""
    if host:
        skip_unless_host_descriptors_launch()
    rng = np.random.default_rng(20)
    m, k, n, block = 75, 24, 40, 16
    group_sizes, offset, local, (first, end) = _WRITE_CASES[case]
    sizes = jnp.asarray(group_sizes, jnp.int32)
    lhs, rhs = normal(rng, (m, k)), normal(rng, (local, k, n))
    local_rows = (np.arange(m) >= first) & (np.arange(m) < end)
    poisoned = np.where(local_rows[:, None], np.asarray(lhs), np.nan)
    poisoned[::7][~local_rows[::7]] = np.inf
    lhs = jnp.asarray(poisoned)
    config = gmm_config(m, k, n, element_bytes=4, compute_capability=None, tiling=(block,) * 3)
    meta = make_group_metadata(sizes, m=m, block_m=block, group_offset=offset, num_groups=local)
    operands = (lhs, rhs)
    if host:
        operands = (HostDescriptor(lhs, (block, block)), HostDescriptor(rhs, (1, block, block)))
    out = triton_call(
        *operands,
        jnp.full((m, n), jnp.nan, jnp.float32),  # not read: ACCUMULATE is off
        *meta,
        local,
        kernel=gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=gmm_grid(meta.chunk_group.shape[0], n, config.block_n, 3 if persistent else None),
        input_output_aliases={2: 0},
        M=m,
        K=k,
        N=n,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        BLOCK_N=config.block_n,
        TRANSPOSE_RHS=False,
        ACCUMULATE=False,
        INPUT_PRECISION="ieee",
        TMA=tma,
        WARP_SPECIALIZE=warp_specialize,
        PERSISTENT=persistent,
        HOST_DESCRIPTORS=host,
        num_warps=4,
    )
    out = np.asarray(out)
    assert (out[~local_rows] == 0).all()
    expected = gmm_float64(lhs, rhs, np.maximum(group_sizes, 0), offset=offset)
    assert_close(out[local_rows], expected[local_rows])


# tgmm's bare launches: m, k, n and the row, k and n tile (partial tiles everywhere).
_WEIGHT_GRADIENT = (75, 24, 40, 16)


def _poisoned_weight_gradient(rng, case: str):
    """(lhs [m, k], rhs [m, n], metadata, tile constexprs) of a `_WRITE_CASES` layout at
    `_WEIGHT_GRADIENT`'s sizes: random rows in the local groups, NaN (every fifth -Inf)
    in every other row of both."""
    m, k, n, block = _WEIGHT_GRADIENT
    group_sizes, offset, local, (first, end) = _WRITE_CASES[case]
    local_rows = (np.arange(m) >= first) & (np.arange(m) < end)
    operands = []
    for width in (k, n):
        poisoned = np.where(local_rows[:, None], np.asarray(normal(rng, (m, width))), np.nan)
        poisoned[::5][~local_rows[::5]] = -np.inf
        operands.append(jnp.asarray(poisoned))
    sizes = jnp.asarray(group_sizes, jnp.int32)
    meta = make_group_metadata(sizes, m=m, block_m=block, group_offset=offset, num_groups=local)
    tiles = dict(M=m, K=k, N=n, BLOCK_M=block, BLOCK_K=block, BLOCK_N=block)
    return *operands, meta, tiles


@pytest.mark.parametrize("case", _WRITE_CASES)
@_BY_LOADING
def test_tgmm_kernel_sums_only_its_groups_rows(tma, warp_specialize, case):
    """Launched bare on an output that starts NaN, every local group's [k, n] tile must
    hold the sum over its own rows (an empty group: zeros) though every row outside the
    local groups holds NaN or Inf, in lhs (token-major) and rhs alike: tiles by
    pointers mask them, descriptors over a group's rows read past its end as 0. k = 24
    and n = 40 leave partial tiles, 16-row steps partial ones too."""
    rng = np.random.default_rng(22)
    lhs, rhs, meta, tiles = _poisoned_weight_gradient(rng, case)
    group_sizes, offset, local, _ = _WRITE_CASES[case]
    _, k, n, block = _WEIGHT_GRADIENT
    out = triton_call(
        lhs,
        rhs,
        jnp.full((local, k, n), jnp.nan, jnp.float32),  # not read: ACCUMULATE is off
        meta.group_starts,
        meta.group_ends,
        kernel=tgmm_kernel,
        out_shape=jax.ShapeDtypeStruct((local, k, n), jnp.float32),
        grid=tgmm_grid(local, k, n, block, block),
        input_output_aliases={2: 0},
        **tiles,
        LHS_TOKEN_MAJOR=True,
        ACCUMULATE=False,
        INPUT_PRECISION="ieee",
        TMA=tma,
        WARP_SPECIALIZE=warp_specialize,
        num_warps=4,
    )
    expected = tgmm_float64(lhs.T, rhs, np.maximum(group_sizes, 0), offset=offset, num_groups=local)
    assert_close(out, expected)


@pytest.mark.parametrize("splits, group_chunk", [(1, 16), (2, 2), (3, 16)])
@pytest.mark.parametrize("accumulate", [False, True], ids=["zeros", "existing_out"])
@pytest.mark.parametrize("case", _WRITE_CASES)
def test_tgmm_walk_kernel_sums_only_its_groups_rows(case, accumulate, splits, group_chunk):
    """`tgmm_walk_kernel` launched bare, its programs walking 1, 2 or 3 splits of the local
    groups (at most a split a group; with 2, a split's first entry counted 2 groups at a
    time, in several chunks): every local group's tile holds the sum over its own
    rows, plus existing_out's tile where it accumulates; an empty group's is zeros (the
    output starts NaN) or keeps existing_out's. Rows outside the local groups hold NaN
    and -Inf in lhs and rhs alike and must reach no tile; k = 24, n = 40 and 16-row
    steps leave partial tiles, and a group's last step starts the next from zero."""
    rng = np.random.default_rng(24)
    lhs, rhs, meta, tiles = _poisoned_weight_gradient(rng, case)
    group_sizes, offset, local, _ = _WRITE_CASES[case]
    _, k, n, block = _WEIGHT_GRADIENT
    init = normal(rng, (local, k, n)) if accumulate else jnp.full((local, k, n), jnp.nan)
    splits = min(splits, local)
    out = triton_call(
        lhs,
        rhs,
        init,
        meta.group_starts,
        meta.group_ends,
        meta.chunk_group,
        meta.chunk_row_start,
        local,
        kernel=tgmm_walk_kernel,
        out_shape=jax.ShapeDtypeStruct((local, k, n), jnp.float32),
        grid=tgmm_walk_grid(k, n, block, block, splits),
        input_output_aliases={2: 0},
        **tiles,
        ACCUMULATE=accumulate,
        INPUT_PRECISION="ieee",
        SPLITS=splits,
        GROUP_CHUNK=group_chunk,
        num_warps=4,
    )
    existing = init if accumulate else None
    expected = tgmm_float64(lhs.T, rhs, np.maximum(group_sizes, 0), offset=offset,
                            num_groups=local, existing=existing)  # fmt: skip
    assert_close(out, expected)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(block_m=24, block_k=16, block_n=16), ValueError, "GroupedMatmulConfig.block_m"),
        (dict(block_m=16, block_k=8, block_n=16), ValueError, "GroupedMatmulConfig.block_k"),
        (dict(block_m=16, block_k=16, block_n=16.0), TypeError, "GroupedMatmulConfig.block_n"),
        (dict(block_m=16, block_k=16, block_n=16, num_warps=6), ValueError, "num_warps"),
        (dict(block_m=16, block_k=16, block_n=16, num_stages=0), ValueError, "num_stages"),
        (dict(block_m=16, block_k=16, block_n=16, tma=1), TypeError, "GroupedMatmulConfig.tma"),
        (
            dict(block_m=16, block_k=16, block_n=16, tma=True, warp_specialize=1),
            TypeError,
            "GroupedMatmulConfig.warp_specialize must be a bool",
        ),
        (
            dict(block_m=16, block_k=16, block_n=16, warp_specialize=True),
            ValueError,
            r"warp_specialize needs tma=True.*got tma=False",
        ),
        (
            dict(block_m=16, block_k=16, block_n=16, num_warps=8, tma=True, warp_specialize=True),
            ValueError,
            r"warp_specialize needs .*num_warps=4.*got tma=True, num_warps=8",
        ),
        (
            dict(block_m=16, block_k=16, block_n=16, persistent=1),
            TypeError,
            "GroupedMatmulConfig.persistent must be a bool",
        ),
        (
            dict(
                block_m=16, block_k=16, block_n=16, tma=True, warp_specialize=True, persistent=True
            ),
            ValueError,
            r"persistent=True excludes warp_specialize=True",
        ),
        (
            dict(block_m=16, block_k=16, block_n=16, tma=True, host_descriptors=1),
            TypeError,
            "GroupedMatmulConfig.host_descriptors must be a bool",
        ),
        (
            dict(block_m=16, block_k=16, block_n=16, host_descriptors=True),
            ValueError,
            r"host_descriptors=True needs tma=True",
        ),
    ],
    ids=[
        "block_m",
        "block_k",
        "block_n_float",
        "warps",
        "stages",
        "tma",
        "ws_bool",
        "ws_no_tma",
        "ws_8_warps",
        "persistent_bool",
        "persistent_ws",
        "host_bool",
        "host_no_tma",
    ],
)
def test_config_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        GroupedMatmulConfig(**kwargs)


def test_config_is_used_as_given_for_the_op_and_its_gradient(monkeypatch):
    """config= replaces tiling (the tiling given here is ignored) and reaches every launch of the
    forward and the backward (d_lhs: gmm, d_rhs: tgmm), with the float64 loop's numbers."""
    rng = np.random.default_rng(21)
    m, k, n = 56, 24, 40
    sizes = jnp.asarray([11, 0, 1, 19, 15], jnp.int32)
    lhs, rhs, weight = normal(rng, (m, k)), normal(rng, (5, k, n)), normal(rng, (m, n))
    config = GroupedMatmulConfig(block_m=32, block_k=16, block_n=64, num_warps=2)
    seen = []
    original = triton_backend._config  # the launch configuration every launch uses

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(triton_backend, "_config", spy)

    def loss(lhs, rhs):
        out = grouped_matmul(
            lhs, rhs, sizes, tiling=(64, 64, 16), config=config, implementation="triton"
        )
        return jnp.sum(out * weight), out

    (d_lhs, d_rhs), out = jax.grad(loss, (0, 1), has_aux=True)(lhs, rhs)
    assert seen == [config] * 3
    assert_close(out, gmm_float64(lhs, rhs, sizes))
    assert_close(d_lhs, gmm_float64(weight, rhs, sizes, transpose_rhs=True))
    assert_close(d_rhs, tgmm_float64(lhs.T, weight, sizes, num_groups=5))
    tgmm = transposed_grouped_matmul(lhs.T, weight, sizes, config=config, implementation="triton")
    assert len(seen) == 4
    assert_close(tgmm, tgmm_float64(lhs.T, weight, sizes, num_groups=5))


@pytest.mark.parametrize(
    "warp_specialize, host",
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["tma", "tma-warp-specialized", "tma-host", "tma-host-warp-specialized"],
)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_tma_tiles_give_the_float64_numbers(transpose_rhs, warp_specialize, host):
    """`tma=True` (tiles through tensor descriptors, whose rows and columns past the arrays
    read 0), warp-specialized, with the launch's descriptors (`host_descriptors`): k and n
    with partial tiles, an empty group, rows past the groups; the forward and both
    gradients (d_lhs: gmm with the other rhs layout; d_rhs: tgmm, which ignores the
    three)."""
    if host:
        skip_unless_host_descriptors_launch()
    rng = np.random.default_rng()
    m, k, n = 61, 40, 24
    sizes = jnp.asarray([9, 0, 17, 1, 20], jnp.int32)  # 47 rows < m
    rhs_shape = (5, n, k) if transpose_rhs else (5, k, n)
    lhs, rhs, weight = normal(rng, (m, k)), normal(rng, rhs_shape), normal(rng, (m, n))
    config = GroupedMatmulConfig(
        block_m=16, block_k=16, block_n=16, num_warps=4, tma=True,
        warp_specialize=warp_specialize, host_descriptors=host,
    )  # fmt: skip

    def loss(lhs, rhs):
        out = grouped_matmul(lhs, rhs, sizes, config=config, transpose_rhs=transpose_rhs,
                             implementation="triton")  # fmt: skip
        return jnp.sum(out * weight), out

    (d_lhs, d_rhs), out = jax.grad(loss, (0, 1), has_aux=True)(lhs, rhs)
    assert_close(out, gmm_float64(lhs, rhs, sizes, transpose_rhs=transpose_rhs))
    rhs_for_d_lhs = rhs if transpose_rhs else jnp.swapaxes(rhs, 1, 2)
    assert_close(d_lhs, gmm_float64(weight, rhs_for_d_lhs, sizes))
    # d rhs[g] = lhs_g^T weight_g, or its transpose (weight_g^T lhs_g) for [G, n, k].
    a, b = (weight.T, lhs) if transpose_rhs else (lhs.T, weight)
    assert_close(d_rhs, tgmm_float64(a, b, sizes, num_groups=5))


@pytest.mark.parametrize(
    "tma, host", [(False, False), (True, False), (True, True)], ids=["pointers", "tma", "tma-host"]
)
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("accumulate", [False, True], ids=["no_existing_out", "existing_out"])
def test_persistent_gmm_gives_the_float64_numbers(accumulate, transpose_rhs, tma, host):
    """`persistent=True`: a few programs (3 in the interpreter) walk the tile list; with
    expert parallelism's group offset the rows before and after the local groups are 0
    (or existing_out's), an empty local group, partial k and n tiles (and the 3-D
    descriptor's zeros past a group's k rows; built by the programs or, `host`, by the
    launch), the forward and both gradients."""
    if host:
        skip_unless_host_descriptors_launch()
    rng = np.random.default_rng()
    m, k, n, offset = 70, 40, 24, 1
    sizes = jnp.asarray([6, 9, 0, 17, 1, 20, 5], jnp.int32)  # local: groups 1..4, rows 6..33
    rhs_shape = (4, n, k) if transpose_rhs else (4, k, n)
    lhs, rhs, weight = normal(rng, (m, k)), normal(rng, rhs_shape), normal(rng, (m, n))
    existing = normal(rng, (m, n)) if accumulate else None
    config = GroupedMatmulConfig(
        block_m=16, block_k=16, block_n=16, tma=tma, persistent=True, host_descriptors=host
    )

    def loss(lhs, rhs):
        out = grouped_matmul(lhs, rhs, sizes, group_offset=offset, existing_out=existing,
                             config=config, transpose_rhs=transpose_rhs,
                             implementation="triton")  # fmt: skip
        return jnp.sum(out * weight), out

    (d_lhs, d_rhs), out = jax.grad(loss, (0, 1), has_aux=True)(lhs, rhs)
    assert_close(out, gmm_float64(lhs, rhs, sizes, offset=offset, existing=existing,
                                  transpose_rhs=transpose_rhs))  # fmt: skip
    rhs_for_d_lhs = rhs if transpose_rhs else jnp.swapaxes(rhs, 1, 2)
    assert_close(d_lhs, gmm_float64(weight, rhs_for_d_lhs, sizes, offset=offset))
    a, b = (weight.T, lhs) if transpose_rhs else (lhs.T, weight)
    assert_close(d_rhs, tgmm_float64(a, b, sizes, num_groups=4, offset=offset))


def test_a_persistent_launch_takes_a_program_for_each_cta_the_gpu_holds(monkeypatch):
    """On an H100 (132 SMs) a persistent gmm launches as many programs as the SMs hold
    at once, counted with the most registers a thread may take (255): at Hopper's
    default tile (8 warps, 192 KB of shared memory: one CTA an SM) 132, at 128 x 64 x 64
    with 2 stages (4 warps, 48 KB: four by shared memory, two by registers) and at 16 x
    16 x 16 in one stage 264; never more than the tile list's slots times its column
    tiles; a launch a tile keeps its grid."""
    launches = record_launches(monkeypatch, triton_backend)
    rng = np.random.default_rng(5)
    m, k, n = 16384, 512, 768
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (4, k, n), jnp.bfloat16)
    sizes = jnp.asarray([3000, 0, 5000, 8384], jnp.int32)
    hopper = default_grouped_matmul_config((m, k, n), jnp.bfloat16, 90)
    small = GroupedMatmulConfig(128, 64, 64, num_warps=4, num_stages=2)
    tiny = GroupedMatmulConfig(16, 16, 16, num_stages=1)
    for config in (hopper, small, tiny):
        for persistent in (False, True):
            given = dataclasses.replace(config, persistent=persistent)
            with cuda_lowering(90):
                grouped_matmul(lhs, rhs, sizes, config=given, implementation="triton")
    gmms = [launch for launch in launches if launch.kernel is gmm_kernel]
    tiles = [
        gmm_grid(num_chunk_slots(m, c.block_m, 4), n, c.block_n)[0] for c in (hopper, small, tiny)
    ]
    assert tiles == [131 * 3, 131 * 12, 1027 * 48]
    assert hopper.shared_memory_bytes(2, False) == 192 * 1024
    assert [launch.grid[0] for launch in gmms] == [
        tiles[0], 132, tiles[1], 264, tiles[2], 264
    ]  # fmt: skip
    assert [launch.constexprs["PERSISTENT"] for launch in gmms] == [False, True] * 3


@pytest.mark.parametrize(
    "m, k, n, groups, splits",
    [(8192, 2048, 1408, 64, 3), (32768, 4096, 2048, 32, 1), (4096, 512, 256, 3, 3)],
)
def test_the_weight_gradient_walks_as_many_splits_as_one_wave_holds(monkeypatch, m, k, n, groups,
                                                                    splits):  # fmt: skip
    """A persistent config reaches the weight gradient's tgmm (token-major lhs) as
    `tgmm_walk_kernel` on an H100: at m 8192 over 64 groups (64 x 128 x 128 tiles, 4
    warps: two CTAs an SM by the most registers, 264 at once) 176 tiles take 3 splits,
    two full waves; at m 32768 (128 x 128 x 256, 8 warps: 132 at once) 256 tiles take 1;
    a small problem of 4 tiles as many as it has groups. The walk's tile list comes from
    a schedule launch of its own row step (at m 8192 64 rows, where gmm's takes 128),
    and tgmm with `tma` keeps a program a tile."""
    launches = record_launches(monkeypatch, triton_backend)
    # Traced only: the launches are what is checked, not numbers (other tests run them).
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
    sizes = jnp.asarray(np.full(groups, m // groups), jnp.int32)
    config = tgmm_config(m, k, n, element_bytes=2, compute_capability=90, lhs_token_major=True,
                         num_groups=groups)  # fmt: skip

    def loss(lhs, rhs, tgmm):
        configs = GroupedMatmulConfigs(tgmm=tgmm)
        return grouped_matmul(lhs, rhs, sizes, config=configs, implementation="triton").sum()

    with cuda_lowering(90):
        for tma in (False, True):
            tgmm = dataclasses.replace(config, persistent=True, tma=tma)
            jax.eval_shape(jax.grad(functools.partial(loss, tgmm=tgmm), 1), lhs, rhs)
    walks = [launch for launch in launches if launch.kernel is tgmm_walk_kernel]
    assert len(walks) == 1 and [launch.kernel for launch in launches].count(tgmm_kernel) == 1
    k_tiles, n_tiles = -(-k // config.block_k), -(-n // config.block_n)
    assert walks[0].grid == (k_tiles, n_tiles, splits) and walks[0].constexprs["SPLITS"] == splits
    # The launch just before the walk is the schedule of its own tile list.
    schedule = launches[launches.index(walks[0]) - 1]
    assert schedule.kernel is gmm_schedule_kernel
    assert schedule.constexprs["BLOCK_M"] == walks[0].constexprs["BLOCK_M"] == config.block_m


@hypothesis.given(
    groups=st.integers(1, 128),
    k=st.integers(1, 4096),
    n=st.integers(1, 4096),
    block_k=st.sampled_from([32, 64, 128, 256]),
    block_n=st.sampled_from([32, 64, 128, 256]),
    resident=st.integers(1, 1024),
)
def test_walk_splits_balance_the_waves(groups, k, n, block_k, block_n, resident):
    """`tgmm_walk_splits`: between 1 and a split a group; its time within 5% of the best
    any split count up to the groups reaches, and no fewer splits reach that. The time is
    simulated: a program per (output tile, split), each doing 1 / splits of a tile's work,
    dealt in turn to `resident` slots; the busiest slot finishes last. Output tiles are
    counted by their origins, partial tiles at the edges included."""
    splits = tgmm_walk_splits(groups, k, n, block_k, block_n, resident)
    tiles = len(range(0, k, block_k)) * len(range(0, n, block_n))

    def time(s):
        programs_per_slot = np.bincount(np.arange(tiles * s) % resident, minlength=resident)
        return programs_per_slot.max() / s

    times = {s: time(s) for s in range(1, groups + 1)}
    best = min(times.values())
    assert 1 <= splits <= groups and times[splits] <= 1.05 * best
    assert all(times[s] > 1.05 * best for s in range(1, splits))


def test_a_persistent_launch_on_a_gpu_of_unknown_size_takes_a_program_a_tile(monkeypatch):
    """Lowered for a GPU whose SMs are not known (no device, no table entry), a
    persistent gmm launches a program a tile and the walk a split a group: correct
    grids, not ones sized for the interpreter."""
    monkeypatch.setattr(triton_backend, "multiprocessor_count", lambda: None)
    launches = record_launches(monkeypatch, triton_backend)
    rng = np.random.default_rng(7)
    m, k, n, groups = 1024, 256, 384, 4
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (groups, k, n), jnp.bfloat16)
    sizes = jnp.asarray([300, 0, 500, 224], jnp.int32)
    config = GroupedMatmulConfig(128, 64, 128, num_warps=8, persistent=True)

    def loss(rhs):
        return grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton").sum()

    with cuda_lowering(90):
        jax.grad(loss)(rhs)
    gmm, walk = (next(x for x in launches if x.kernel is kind)
                 for kind in (gmm_kernel, tgmm_walk_kernel))  # fmt: skip
    assert gmm.grid == gmm_grid(num_chunk_slots(m, 128, groups), n, 128)  # the forward
    assert walk.grid == (k // 64, n // 128, groups) and walk.constexprs["SPLITS"] == groups


def test_tma_needs_16_byte_rows_and_a_hopper_gpu():
    from jax_bridge.launch.lowering import lower_for_cuda

    rng = np.random.default_rng()
    sizes = jnp.asarray([3, 5], jnp.int32)
    config = GroupedMatmulConfig(block_m=16, block_k=16, block_n=16, tma=True)

    def gmm(lhs, rhs):
        return grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton")

    lhs, rhs = normal(rng, (8, 20)).astype(jnp.bfloat16), normal(rng, (2, 20, 16))
    with pytest.raises(ValueError, match=r"grouped_matmul: config tma=True.*16 bytes.*k=20"):
        gmm(lhs, rhs.astype(jnp.bfloat16))
    lhs, rhs = normal(rng, (8, 32)), normal(rng, (2, 32, 16))
    with pytest.raises(ValueError, match=r"grouped_matmul: config tma=True.*9\.0.*8\.0"):
        lower_for_cuda(gmm, lhs, rhs, compute_capability=80)


@needs_tensor_descriptors
@pytest.mark.parametrize("tiling", HOPPER_WARP_SPECIALIZED_GMM, ids=lambda t: "x".join(map(str, t)))
def test_warp_specialized_tma_gmm_on_a_hopper_gpu(tiling):
    """gmm warp-specialized at the A/B rows' tiles (a producer warpgroup and two
    consumers, 12 warps), against the float64 loop: partial row tiles, an empty group,
    rows past the groups (zeros), surplus slots, a partial column tile."""
    rng = np.random.default_rng()
    m, k, n = 1000, 256, 320
    sizes = jnp.asarray([301, 0, 450, 7], jnp.int32)  # 758 rows < m
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (4, k, n), jnp.bfloat16)
    config = warp_specialized_gmm_config(m, k, n, tiling)
    out = jax.jit(
        lambda lhs, rhs: grouped_matmul(
            lhs, rhs, sizes, config=config, implementation="triton",
            preferred_element_type=jnp.float32,
        )
    )(lhs, rhs)  # fmt: skip
    assert_close(out, gmm_float64(lhs, rhs, sizes))


@needs_tensor_descriptors
@pytest.mark.parametrize(
    "tiling", [None, HOPPER_WARP_SPECIALIZED_TGMM], ids=["tma", "warp_specialized"]
)
def test_tma_tgmm_on_a_hopper_gpu(tiling):
    """The weight gradient's tgmm through descriptors over each group's rows, at its
    default tile or warp-specialized at the A/B row's (`GroupedMatmulConfigs.tgmm`),
    against the float64 loop: groups of 301, 0, 450 and 7 rows (partial and empty
    steps), rows past them, a partial column tile."""
    rng = np.random.default_rng()
    m, k, n = 1000, 256, 320
    sizes = jnp.asarray([301, 0, 450, 7], jnp.int32)  # 758 rows < m
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (4, k, n), jnp.bfloat16)
    weight = normal(rng, (m, n), jnp.bfloat16)
    if tiling is None:
        config = tgmm_config(m, k, n, element_bytes=2, compute_capability=90,
                             lhs_token_major=True, num_groups=4)  # fmt: skip
        config = dataclasses.replace(config, tma=True)
    else:
        config = warp_specialized_gmm_config(m, k, n, tiling)

    def loss(rhs):
        configs = GroupedMatmulConfigs(tgmm=config)
        out = grouped_matmul(lhs, rhs, sizes, config=configs, implementation="triton",
                             preferred_element_type=jnp.float32)  # fmt: skip
        return jnp.sum(out * weight.astype(jnp.float32))

    d_rhs = jax.jit(jax.grad(loss))(rhs)
    assert_close(d_rhs, tgmm_float64(lhs.T, weight, sizes, num_groups=4), dtype=jnp.bfloat16)


@pytest.mark.parametrize("transposed", [False, True], ids=["gmm", "tgmm"])
def test_a_group_past_int32_indexing_is_refused(transposed):
    """The kernels index within one group's [k, n] weights in int32: a group of 2**31
    elements or more is a ValueError naming the op (traced only: nothing is allocated)."""
    k, n, m, groups = 65536, 32768, 64, 2
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    if transposed:
        op, name = transposed_grouped_matmul, "transposed_grouped_matmul"
        args = (
            jax.ShapeDtypeStruct((k, m), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        )
    else:
        op, name = grouped_matmul, "grouped_matmul"
        args = (
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
        )
    call = functools.partial(op, implementation="triton")
    with pytest.raises(ValueError, match=f"{name}: one group's weights are k x n = 65536 x 32768"):
        jax.eval_shape(call, *args, sizes)
    n //= 2  # 2**30 elements a group: traced as usual
    args = (*args[:-1], jax.ShapeDtypeStruct((*args[-1].shape[:-1], n), jnp.bfloat16))
    assert jax.eval_shape(call, *args, sizes).shape[-1] == n
