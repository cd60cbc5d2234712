"""grouped_matmul (gmm) and transposed_grouped_matmul (tgmm).

Both implementations (Triton through its interpreter, and XLA) are checked against a
float64 numpy loop over groups; gradients against `jax.grad` of a dense masked float32
formulation; the tile metadata against its stated invariants; bad arguments against the
errors they must raise.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

from jax_bridge.grouped_matmul.api import grouped_matmul, transposed_grouped_matmul
from jax_bridge.grouped_matmul.metadata import (
    local_group_bounds,
    make_group_metadata,
    num_tile_slots,
)
from jax_bridge.launch.triton_call import triton_call
from triton_kernels.grouped_matmul.config import check_tiling, gmm_config, tgmm_config
from triton_kernels.grouped_matmul.kernels import gmm_grid, gmm_kernel

IMPLEMENTATIONS = ("triton", "xla")
HIGHEST = jax.lax.Precision.HIGHEST


# --- oracles --------------------------------------------------------------------------


def _bounds(sizes) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(np.asarray(sizes, np.int64))
    return ends - np.asarray(sizes, np.int64), ends


def gmm_reference(lhs, rhs, sizes, *, offset=0, existing=None, transpose_rhs=False):
    """float64 loop: out[rows of g] (+)= lhs[rows of g] @ rhs[g - offset]."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    if existing is not None:
        out += np.asarray(existing, np.float64)
    starts, ends = _bounds(sizes)
    for local in range(rhs.shape[0]):
        s, e = starts[offset + local], ends[offset + local]
        out[s:e] += lhs[s:e] @ rhs[local]
    return out


def tgmm_reference(lhs, rhs, sizes, *, num_groups, offset=0, existing=None):
    """float64 loop: out[g] (+)= lhs[:, rows of g + offset] @ rhs[rows of g + offset]."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    out = np.zeros((num_groups, lhs.shape[0], rhs.shape[1]))
    if existing is not None:
        out += np.asarray(existing, np.float64)
    starts, ends = _bounds(sizes)
    for local in range(num_groups):
        s, e = starts[offset + local], ends[offset + local]
        out[local] += lhs[:, s:e] @ rhs[s:e]
    return out


def _row_masks(sizes, m: int, offset: int, num_groups: int) -> jax.Array:
    """[num_groups, m] bool: row r belongs to local group g."""
    ends = jnp.cumsum(jnp.asarray(sizes))
    starts = ends - jnp.asarray(sizes)
    rows = jnp.arange(m)
    g = jnp.arange(num_groups) + offset
    return (rows[None, :] >= starts[g, None]) & (rows[None, :] < ends[g, None])


def gmm_dense(lhs, rhs, sizes, *, offset=0, existing=None, transpose_rhs=False):
    """Dense float32 gmm: every group multiplies every row, a mask keeps its own."""
    r = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    masks = _row_masks(sizes, lhs.shape[0], offset, rhs.shape[0])
    per_group = jnp.einsum("mk,gkn->gmn", lhs, r, precision=HIGHEST)
    out = jnp.sum(jnp.where(masks[:, :, None], per_group, 0.0), axis=0)
    return out if existing is None else out + existing


def tgmm_dense(lhs, rhs, sizes, *, num_groups, offset=0, existing=None):
    masks = _row_masks(sizes, lhs.shape[1], offset, num_groups)
    out = jnp.einsum("km,gm,mn->gkn", lhs, masks.astype(lhs.dtype), rhs, precision=HIGHEST)
    return out if existing is None else out + existing


def _normal(rng, shape, dtype=np.float32) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _close(actual, expected, *, dtype=jnp.float32) -> None:
    tol = {jnp.float32: 2e-5, jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2}[dtype]
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


# --- forward: structured cases, both implementations ----------------------------------

# (m, k, n, group sizes, offset, local groups, tiling). Patterns that matter: empty
# groups (also first/last), length-1 groups, one group holding every row, rows past the
# sum, m/k/n that are not multiples of the tiles, offsets at both ends.
GMM_CASES = {
    "empty_groups_and_tail_rows": (90, 40, 48, [17, 0, 31, 0, 25], 0, 5, (32, 16, 32)),
    "one_group_holds_every_row": (70, 32, 24, [0, 70, 0], 0, 3, (32, 16, 16)),
    "length_one_groups": (37, 16, 16, [1, 1, 0, 1, 30, 1], 0, 6, (16, 16, 16)),
    "single_group": (33, 24, 40, [29], 0, 1, (16, 16, 32)),
    "offset_middle": (80, 24, 32, [9, 14, 0, 21, 5, 11, 8], 2, 3, (16, 16, 16)),
    "offset_first": (64, 16, 32, [20, 1, 13, 0, 30], 0, 2, (32, 16, 16)),
    "offset_last_empty": (50, 16, 16, [12, 7, 0, 0], 2, 2, (16, 16, 16)),
}


def _gmm_case(rng, case, *, dtype, transpose_rhs, with_existing):
    m, k, n, sizes, offset, local, tiling = case
    lhs = _normal(rng, (m, k), dtype)
    rhs = _normal(rng, (local, n, k) if transpose_rhs else (local, k, n), dtype)
    existing = _normal(rng, (m, n)) if with_existing else None
    group_sizes = jnp.asarray(sizes, jnp.int32)
    has_offset = offset or local != len(sizes)
    return lhs, rhs, group_sizes, (offset if has_offset else None), existing, tiling


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", GMM_CASES.values(), ids=GMM_CASES.keys())
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_reference(case, implementation, transpose_rhs):
    rng = np.random.default_rng()
    with_existing = case[4] > 0  # offsets also exercise accumulation
    lhs, rhs, sizes, offset, existing, tiling = _gmm_case(
        rng, case, dtype=jnp.float32, transpose_rhs=transpose_rhs, with_existing=with_existing
    )
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=tiling,
        group_offset=offset,
        existing_out=existing,
        transpose_rhs=transpose_rhs,
        precision=HIGHEST,
        implementation=implementation,
    )
    assert out.shape == (lhs.shape[0], case[2]) and out.dtype == jnp.float32
    expected = gmm_reference(
        lhs, rhs, sizes, offset=offset or 0, existing=existing, transpose_rhs=transpose_rhs
    )
    _close(out, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("out_dtype", [jnp.float32, "same"])
def test_gmm_half_precision(implementation, dtype, out_dtype):
    rng = np.random.default_rng()
    out_dtype = dtype if out_dtype == "same" else out_dtype
    m, k, n = 72, 48, 32
    sizes = jnp.asarray([0, 25, 1, 30, 0], jnp.int32)
    lhs, rhs = _normal(rng, (m, k), dtype), _normal(rng, (5, k, n), dtype)
    existing = _normal(rng, (m, n), out_dtype)
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        preferred_element_type=out_dtype,
        tiling=(32, 16, 16),
        existing_out=existing,
        implementation=implementation,
    )
    assert out.dtype == out_dtype
    expected = gmm_reference(lhs, rhs, sizes, existing=existing)
    # 16-bit products are exact in float32: only the output rounding is 16-bit.
    _close(out, expected, dtype=out_dtype)
    tail = np.arange(m) >= 56
    np.testing.assert_array_equal(np.asarray(out)[tail], np.asarray(existing)[tail])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("lhs_layout", ["[k, m]", "callable tiling"])
def test_tgmm_matches_reference(implementation, dtype, lhs_layout):
    rng = np.random.default_rng()
    m, k, n = 75, 40, 24
    sizes = jnp.asarray([0, 16, 1, 0, 33, 0], jnp.int32)  # 50 < m: rows past the sum ignored
    lhs, rhs = _normal(rng, (k, m), dtype), _normal(rng, (m, n), dtype)
    calls = []

    def tiling(*sizes_):
        calls.append(sizes_)
        return (16, 16, 16)

    out = transposed_grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=tiling if lhs_layout == "callable tiling" else (32, 16, 16),
        precision=HIGHEST,
        implementation=implementation,
    )
    assert out.shape == (6, k, n) and out.dtype == jnp.float32
    _close(out, tgmm_reference(lhs, rhs, sizes, num_groups=6))
    if lhs_layout == "callable tiling" and implementation == "triton":
        assert calls == [(m, k, n)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_tgmm_group_offset_and_existing_out(implementation):
    rng = np.random.default_rng()
    m, k, n = 60, 16, 32
    sizes = jnp.asarray([5, 0, 22, 1, 14, 9], jnp.int32)
    lhs, rhs = _normal(rng, (k, m)), _normal(rng, (m, n))
    existing = _normal(rng, (3, k, n))
    out = transposed_grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=(16, 16, 16),
        group_offset=1,
        num_groups=3,
        existing_out=existing,
        precision=HIGHEST,
        implementation=implementation,
    )
    expected = tgmm_reference(lhs, rhs, sizes, num_groups=3, offset=1, existing=existing)
    _close(out, expected)
    np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(existing)[0])  # empty group


# --- forward: random cases ------------------------------------------------------------


@st.composite
def gmm_problems(draw, max_m: int):
    num_total = draw(st.integers(1, 6))
    # Sizes favour zeros and ones, the cases that break tile bookkeeping.
    sizes = draw(
        st.lists(
            st.one_of(st.just(0), st.just(1), st.integers(0, max_m // 2)),
            min_size=num_total,
            max_size=num_total,
        )
    )
    m = draw(st.integers(max(sum(sizes), 1), max(sum(sizes), 1) + 20))
    local = draw(st.integers(1, num_total))
    offset = draw(st.integers(0, num_total - local))
    return dict(
        m=m,
        k=draw(st.sampled_from([16, 24, 40])),
        n=draw(st.sampled_from([16, 20, 48])),
        sizes=sizes,
        offset=offset,
        local=local,
        use_offset=draw(st.booleans()) or local != num_total,
        tiling=(draw(st.sampled_from([16, 32])), 16, draw(st.sampled_from([16, 32]))),
        transpose_rhs=draw(st.booleans()),
        existing=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _check_random_gmm(p, implementation):
    rng = np.random.default_rng(p["seed"])
    m, k, n, local = p["m"], p["k"], p["n"], p["local"]
    lhs = _normal(rng, (m, k))
    rhs = _normal(rng, (local, n, k) if p["transpose_rhs"] else (local, k, n))
    existing = _normal(rng, (m, n)) if p["existing"] else None
    offset = p["offset"] if p["use_offset"] else None
    out = grouped_matmul(
        lhs,
        rhs,
        jnp.asarray(p["sizes"], jnp.int32),
        tiling=p["tiling"],
        group_offset=offset,
        existing_out=existing,
        transpose_rhs=p["transpose_rhs"],
        precision=HIGHEST,
        implementation=implementation,
    )
    expected = gmm_reference(
        lhs,
        rhs,
        p["sizes"],
        offset=offset or 0,
        existing=existing,
        transpose_rhs=p["transpose_rhs"],
    )
    _close(out, expected)


@hypothesis.settings(max_examples=12)
@hypothesis.given(gmm_problems(max_m=60))
def test_gmm_random_problems_triton(p):
    _check_random_gmm(p, "triton")


@hypothesis.given(gmm_problems(max_m=120))
def test_gmm_random_problems_xla(p):
    _check_random_gmm(p, "xla")


# --- every output element written where the semantics say so --------------------------


def test_gmm_kernel_writes_exactly_the_rows_of_its_groups():
    """Launched bare, the output starts NaN (triton_call's poison): afterwards every row of
    a local group must hold its product, every other row must be untouched."""
    rng = np.random.default_rng()
    m, k, n, block = 75, 24, 40, 16
    sizes = jnp.asarray([3, 20, 1, 0, 17, 6, 2], jnp.int32)  # 49 rows < m
    offset, local = 1, 4  # groups 1..4: rows [3, 41)
    lhs, rhs = _normal(rng, (m, k)), _normal(rng, (local, k, n))
    config = gmm_config(m, k, n, element_bytes=4, compute_capability=None, tiling=(block,) * 3)
    meta = make_group_metadata(sizes, m=m, block_m=block, group_offset=offset, num_groups=local)
    out = triton_call(
        lhs,
        rhs,
        jnp.zeros((1,), jnp.float32),
        *meta,
        kernel=gmm_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=gmm_grid(meta.tile_group.shape[0], n, config.block_n),
        M=m,
        K=k,
        N=n,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        BLOCK_N=config.block_n,
        TRANSPOSE_RHS=False,
        ACCUMULATE=False,
        INPUT_PRECISION="ieee",
    )
    out = np.asarray(out)
    local_rows = (np.arange(m) >= 3) & (np.arange(m) < 41)
    assert np.isnan(out[~local_rows]).all()
    expected = gmm_reference(lhs, rhs, sizes, offset=offset)
    _close(out[local_rows], expected[local_rows])


def test_tgmm_writes_every_group_including_empty_ones():
    """tgmm's output is not pre-filled (it starts NaN): empty groups must be written 0."""
    rng = np.random.default_rng()
    m, k, n = 40, 40, 24  # k, n not multiples of the tiles
    sizes = jnp.asarray([0, 17, 0, 1, 0], jnp.int32)
    lhs, rhs = _normal(rng, (k, m)), _normal(rng, (m, n))
    out = np.asarray(
        transposed_grouped_matmul(lhs, rhs, sizes, tiling=(16, 32, 16), implementation="triton")
    )
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[[0, 2, 4]], 0.0)
    _close(out, tgmm_reference(lhs, rhs, sizes, num_groups=5))


# --- gradients ------------------------------------------------------------------------

GRAD_CASES = {
    "plain": dict(offset=None, existing=False, transpose_rhs=False),
    "transpose_rhs": dict(offset=None, existing=False, transpose_rhs=True),
    "offset_existing": dict(offset=1, existing=True, transpose_rhs=False),
    "offset_existing_transposed": dict(offset=2, existing=True, transpose_rhs=True),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_gmm_gradients(implementation, case):
    rng = np.random.default_rng()
    m, k, n = 56, 24, 16
    sizes = jnp.asarray([11, 0, 1, 19, 0, 15], jnp.int32)  # 46 rows < m
    local = 6 if case["offset"] is None else 3
    offset = case["offset"] or 0
    lhs = _normal(rng, (m, k))
    rhs = _normal(rng, (local, n, k) if case["transpose_rhs"] else (local, k, n))
    existing = _normal(rng, (m, n)) if case["existing"] else None
    weight = _normal(rng, (m, n))

    def loss(fn, lhs, rhs, existing):
        return jnp.sum(fn(lhs, rhs, existing) * weight)

    def ours(lhs, rhs, existing):
        return grouped_matmul(
            lhs,
            rhs,
            sizes,
            tiling=(16, 16, 16),
            group_offset=case["offset"],
            existing_out=existing,
            transpose_rhs=case["transpose_rhs"],
            precision=HIGHEST,
            implementation=implementation,
        )

    def dense(lhs, rhs, existing):
        return gmm_dense(
            lhs,
            rhs,
            sizes,
            offset=offset,
            existing=existing,
            transpose_rhs=case["transpose_rhs"],
        )

    argnums = (0, 1, 2) if case["existing"] else (0, 1)
    got = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums))(lhs, rhs, existing)
    want = jax.grad(lambda *a: loss(dense, *a), argnums)(lhs, rhs, existing)
    for g, w in zip(got, want, strict=True):
        _close(g, np.asarray(w, np.float64))
    # Rows of no local group get no gradient.
    starts, ends = _bounds(sizes)
    outside = (np.arange(m) < starts[offset]) | (np.arange(m) >= ends[offset + local - 1])
    np.testing.assert_array_equal(np.asarray(got[0])[outside], 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("offset", [None, 1])
def test_tgmm_gradients(implementation, offset):
    rng = np.random.default_rng()
    m, k, n = 48, 16, 24
    sizes = jnp.asarray([10, 0, 1, 21, 7], jnp.int32)
    local = 5 if offset is None else 3
    lhs, rhs = _normal(rng, (k, m)), _normal(rng, (m, n))
    existing = _normal(rng, (local, k, n))
    weight = _normal(rng, (local, k, n))

    def ours(lhs, rhs, existing):
        return transposed_grouped_matmul(
            lhs,
            rhs,
            sizes,
            tiling=(16, 16, 16),
            group_offset=offset,
            num_groups=local,
            existing_out=existing,
            precision=HIGHEST,
            implementation=implementation,
        )

    def dense(lhs, rhs, existing):
        return tgmm_dense(lhs, rhs, sizes, num_groups=local, offset=offset or 0, existing=existing)

    got = jax.grad(lambda *a: jnp.sum(ours(*a) * weight), (0, 1, 2))(lhs, rhs, existing)
    want = jax.grad(lambda *a: jnp.sum(dense(*a) * weight), (0, 1, 2))(lhs, rhs, existing)
    for g, w in zip(got, want, strict=True):
        _close(g, np.asarray(w, np.float64))


def test_gmm_gradient_of_bf16_inputs_has_input_dtypes():
    rng = np.random.default_rng()
    lhs, rhs = _normal(rng, (40, 16), jnp.bfloat16), _normal(rng, (3, 16, 16), jnp.bfloat16)
    sizes = jnp.asarray([13, 0, 20], jnp.int32)
    d_lhs, d_rhs = jax.grad(
        lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, tiling=(16, 16, 16)) ** 2), (0, 1)
    )(lhs, rhs)
    assert d_lhs.dtype == jnp.bfloat16 and d_rhs.dtype == jnp.bfloat16
    want = jax.grad(lambda a, b: jnp.sum(gmm_dense(a, b, sizes) ** 2), (0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    )
    # The cotangent is rounded to bf16 before the backward matmuls: bf16 tolerance.
    for g, w in zip((d_lhs, d_rhs), want, strict=True):
        _close(g, np.asarray(w, np.float64), dtype=jnp.bfloat16)


# --- traced sizes and offsets, expert parallelism --------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gmm_under_jit_with_traced_sizes_and_offset(implementation):
    rng = np.random.default_rng()
    m, k, n = 48, 16, 16
    lhs, rhs = _normal(rng, (m, k)), _normal(rng, (2, k, n))

    @jax.jit
    def f(sizes, offset):
        return grouped_matmul(
            lhs,
            rhs,
            sizes,
            tiling=(16, 16, 16),
            group_offset=offset,
            precision=HIGHEST,
            implementation=implementation,
        )

    for sizes, offset in (([5, 17, 0, 20], 1), ([0, 0, 30, 18], 2), ([40, 1, 7, 0], 0)):
        sizes = jnp.asarray(sizes, jnp.int32)
        _close(f(sizes, jnp.int32(offset)), gmm_reference(lhs, rhs, sizes, offset=offset))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_expert_parallel_shard_map_sums_to_the_full_product(implementation):
    """Each device holds 2 of 8 experts; summing the devices' outputs is the full gmm."""
    rng = np.random.default_rng()
    devices, per_device = 4, 2
    m, k, n = 64, 16, 16
    sizes = jnp.asarray([9, 0, 14, 1, 0, 17, 8, 5], jnp.int32)
    lhs, rhs = _normal(rng, (m, k)), _normal(rng, (devices * per_device, k, n))
    mesh = jax.make_mesh(
        (devices,),
        ("expert",),
        devices=jax.devices()[:devices],
        axis_types=(jax.sharding.AxisType.Auto,),
    )

    def per_shard(lhs, rhs_local, sizes):
        offset = jax.lax.axis_index("expert") * per_device
        out = grouped_matmul(
            lhs,
            rhs_local,
            sizes,
            tiling=(16, 16, 16),
            group_offset=offset,
            precision=HIGHEST,
            implementation=implementation,
        )
        return jax.lax.psum(out, "expert")

    f = jax.jit(
        jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P())
    )
    _close(f(lhs, rhs, sizes), gmm_reference(lhs, rhs, sizes))


# --- tile metadata ----------------------------------------------------------------------


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
    num_slots = num_tile_slots(m, block, local)
    assert meta.tile_group.shape == meta.tile_row_block.shape == (num_slots,)
    num_tiles = int(meta.num_tiles[0])
    assert num_tiles <= num_slots

    starts, ends = _bounds(sizes)
    tile_group = np.asarray(meta.tile_group)[:num_tiles]
    assert np.all(np.diff(tile_group) >= 0)
    visits = np.zeros(m, np.int64)
    for g, b in zip(tile_group, np.asarray(meta.tile_row_block)[:num_tiles], strict=True):
        s, e = starts[offset + g], ends[offset + g]
        rows = np.arange(b * block, min((b + 1) * block, m))
        owned = rows[(rows >= s) & (rows < e)]
        assert owned.size > 0, "a tile with no row of its group"
        visits[owned] += 1
    wanted = np.zeros(m, np.int64)
    wanted[starts[offset] : ends[offset + local - 1]] = 1
    np.testing.assert_array_equal(visits, wanted)
    # Surplus slots still index valid groups and row blocks (they are read, then skipped).
    assert np.all((np.asarray(meta.tile_group) >= 0) & (np.asarray(meta.tile_group) < local))
    assert np.all(np.asarray(meta.tile_row_block) >= 0)
    assert np.all(np.asarray(meta.tile_row_block) * block < max(m, 1))


def test_local_group_bounds_clip_to_m_when_sizes_overflow():
    # Traced sizes are not value-checked: bounds must still stay inside [0, m].
    starts, ends = jax.jit(local_group_bounds, static_argnames=("m", "num_groups"))(
        jnp.asarray([10, 30, 25], jnp.int32), m=32, group_offset=1, num_groups=2
    )
    np.testing.assert_array_equal(starts, [10, 32])
    np.testing.assert_array_equal(ends, [32, 32])


# --- launch configuration ----------------------------------------------------------------


def test_launch_config_defaults_and_overrides():
    default = gmm_config(8192, 2048, 1408, element_bytes=2, compute_capability=90)
    assert default.tiling == (128, 64, 128) and default.num_warps == 8
    assert gmm_config(8192, 2048, 1408, element_bytes=4, compute_capability=90).block_k == 32
    override = gmm_config(
        8192, 2048, 1408, element_bytes=2, compute_capability=80, tiling=(64, 32, 64)
    )
    assert override.tiling == (64, 32, 64) and override.num_warps == 4
    # Tiles larger than a dimension shrink to it (rounded up to a power of two, >= 16).
    small = gmm_config(20, 8, 100, element_bytes=2, compute_capability=90, tiling=(128, 128, 128))
    assert small.tiling == (32, 16, 128)
    assert tgmm_config(20, 40, 8, element_bytes=2, compute_capability=None).tiling == (32, 64, 16)


@pytest.mark.parametrize("capability, budget_kib", [(80, 163), (86, 99), (90, 227)])
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
            assert c.num_stages == 1 or c.num_stages * stage <= budget_kib * 1024


# --- bad arguments ------------------------------------------------------------------------


def _gmm_args(**overrides):
    args = dict(
        lhs=jnp.zeros((32, 16), jnp.float32),
        rhs=jnp.zeros((3, 16, 8), jnp.float32),
        group_sizes=jnp.asarray([10, 0, 12], jnp.int32),
    )
    args.update(overrides)
    return args


GMM_ERRORS = {
    "float_group_sizes": (dict(group_sizes=jnp.asarray([1.0, 2.0, 3.0])), TypeError, "group_sizes"),
    "int64_group_sizes": (dict(group_sizes=np.asarray([1, 2, 3], np.int64)), TypeError, "int32"),
    "short_group_sizes": (
        dict(group_sizes=jnp.asarray([1, 2], jnp.int32)),
        ValueError,
        "group_sizes",
    ),
    "2d_group_sizes": (dict(group_sizes=jnp.ones((3, 1), jnp.int32)), ValueError, "group_sizes"),
    "sizes_sum_past_m": (dict(group_sizes=jnp.asarray([10, 20, 3], jnp.int32)), ValueError, "sum"),
    "negative_size": (
        dict(group_sizes=jnp.asarray([10, -1, 3], jnp.int32)),
        ValueError,
        "non-negative",
    ),
    "lhs_rank": (dict(lhs=jnp.zeros((2, 32, 16))), ValueError, "lhs"),
    "rhs_rank": (dict(rhs=jnp.zeros((16, 8))), ValueError, "rhs"),
    "k_mismatch": (dict(rhs=jnp.zeros((3, 12, 8))), ValueError, "rhs"),
    "k_mismatch_transposed": (dict(transpose_rhs=True), ValueError, "transpose_rhs"),
    "dtype_mismatch": (dict(rhs=jnp.zeros((3, 16, 8), jnp.bfloat16)), TypeError, "same dtype"),
    "integer_lhs": (dict(lhs=jnp.zeros((32, 16), jnp.int32)), TypeError, "lhs"),
    "existing_dtype": (
        dict(existing_out=jnp.zeros((32, 8), jnp.bfloat16)),
        TypeError,
        "existing_out",
    ),
    "existing_shape": (dict(existing_out=jnp.zeros((32, 16))), ValueError, "existing_out"),
    "offset_range": (dict(group_offset=1), ValueError, "group_offset"),
    "offset_float": (dict(group_offset=jnp.float32(0)), TypeError, "group_offset"),
    "tiling_not_pow2": (dict(tiling=(24, 16, 16)), ValueError, "tiling"),
    "tiling_too_small": (dict(tiling=(8, 16, 16)), ValueError, "tiling"),
    "tiling_length": (dict(tiling=(16, 16)), ValueError, "tiling"),
    "callable_tiling": (
        dict(tiling=lambda m, k, n: (m, k, n), implementation="triton"),
        ValueError,
        "tiling",
    ),
    "preferred_int": (dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type"),
    "implementation": (dict(implementation="cuda"), ValueError, "implementation"),
    "pallas": (dict(implementation="pallas"), ValueError, "pallas"),
    "interpret_xla": (dict(interpret=True, implementation="xla"), ValueError, "interpret"),
    "precision": (dict(precision="bf16"), ValueError, "precision"),
}


@pytest.mark.parametrize("overrides, error, match", GMM_ERRORS.values(), ids=GMM_ERRORS.keys())
def test_gmm_rejects_bad_arguments(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_matmul(**_gmm_args(**overrides))


TGMM_ERRORS = {
    "m_mismatch": (dict(rhs=jnp.zeros((30, 8))), ValueError, "rhs"),
    "offset_without_num_groups": (dict(group_offset=1), ValueError, "num_groups"),
    "num_groups_too_many": (dict(group_offset=0, num_groups=4), ValueError, "group_sizes"),
    "existing_shape": (dict(existing_out=jnp.zeros((2, 16, 8))), ValueError, "existing_out"),
    "sizes_sum_past_m": (dict(group_sizes=jnp.asarray([30, 3, 0], jnp.int32)), ValueError, "sum"),
}


@pytest.mark.parametrize("overrides, error, match", TGMM_ERRORS.values(), ids=TGMM_ERRORS.keys())
def test_tgmm_rejects_bad_arguments(overrides, error, match):
    args = dict(
        lhs=jnp.zeros((16, 32), jnp.float32),
        rhs=jnp.zeros((32, 8), jnp.float32),
        group_sizes=jnp.asarray([10, 0, 12], jnp.int32),
    )
    args.update(overrides)
    with pytest.raises(error, match=match):
        transposed_grouped_matmul(**args)


def test_traced_group_sizes_are_checked_by_checkify():
    args = _gmm_args(implementation="xla")
    f = checkify.checkify(
        jax.jit(lambda sizes: grouped_matmul(args["lhs"], args["rhs"], sizes, implementation="xla"))
    )
    error, _ = f(jnp.asarray([10, 20, 3], jnp.int32))
    assert "sum to at most 32" in str(error.get())
    error, _ = f(jnp.asarray([10, 20, 2], jnp.int32))
    assert error.get() is None


def test_check_tiling_accepts_lists_and_returns_a_tuple():
    assert check_tiling([16, 32, 64]) == (16, 32, 64)
