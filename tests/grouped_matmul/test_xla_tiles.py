"""The XLA tile strategy of grouped matmul (`jax_bridge.grouped_matmul.xla`).

Checked against two oracles: a float64 numpy loop over groups, and the package's dense
`grouped_matmul_reference` (gradients: `jax.grad` of it). Also: NaN/Inf isolation
between experts (xla and triton), `jax.vmap` over every argument, `preferred_element_type=
None`, float64 on both paths, and the ragged_dot strategy kept for TPUs. Every input is
random; nothing is filled with zeros or ones.
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge.grouped_matmul import checks, xla
from jax_bridge.grouped_matmul.api import (
    MatmulOptions,
    grouped_matmul,
    transposed_grouped_matmul,
)
from jax_bridge.grouped_matmul.metadata import chunk_row_bounds, make_group_metadata
from jax_bridge.grouped_matmul.reference import (
    grouped_matmul_reference,
    transposed_grouped_matmul_reference,
)
from tests.grouped_matmul.helpers import bounds as _bounds
from tests.grouped_matmul.helpers import gmm_float64 as gmm_loop
from tests.grouped_matmul.helpers import normal as _normal
from tests.grouped_matmul.helpers import tgmm_float64 as tgmm_loop

# --- oracles and helpers ----------------------------------------------------------------
# The float64 loops are the suite's shared independent oracle (tests/grouped_matmul/helpers.py).


def _close(actual, expected, rtol=1e-5):
    """Equal to `rtol` relative to the largest magnitude (float32 sums of k products)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def _xla(**kw) -> dict:
    return dict(implementation="xla", **kw)


# Group sizes (rows), m (>= sum), k, n. m, k, n are not multiples of the 64-row tile.
CASES = {
    "empty_first_middle_last": ([0, 37, 0, 81, 5, 0], 140, 24, 19),
    "length_one_groups": ([1, 1, 70, 1, 1], 93, 17, 31),
    "one_group_holds_all_rows": ([0, 203, 0], 203, 37, 29),
    "sum_below_m": ([12, 0, 49, 3], 150, 20, 12),
    "many_groups_straddling_tiles": ([9, 64, 1, 0, 55, 128, 7, 2, 70], 341, 16, 23),
}


# --- forward vs the oracles ---------------------------------------------------------------


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_gmm_tiles_match_both_oracles(case, transpose_rhs):
    sizes, m, k, n = CASES[case]
    rng = np.random.default_rng()
    g = len(sizes)
    lhs = _normal(rng, (m, k))
    rhs = _normal(rng, (g, n, k) if transpose_rhs else (g, k, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, **_xla())
    assert out.dtype == jnp.float32
    _close(out, gmm_loop(lhs, rhs, sizes, transpose_rhs=transpose_rhs))
    ref = grouped_matmul_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    _close(out, ref)
    # Rows past sum(group_sizes) belong to no group: exactly zero.
    assert not np.any(np.asarray(out[sum(sizes) :]))


@pytest.mark.parametrize("lhs_token_major", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_tgmm_tiles_match_both_oracles(case, lhs_token_major):
    sizes, m, k, n = CASES[case]
    rng = np.random.default_rng()
    lhs_km, rhs = _normal(rng, (k, m)), _normal(rng, (m, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = xla.tgmm_tiles(
        lhs_km.T if lhs_token_major else lhs_km,
        rhs,
        group_sizes,
        num_groups=len(sizes),
        group_offset=None,
        existing_out=None,
        preferred_element_type=np.dtype(np.float32),
        lhs_token_major=lhs_token_major,
        precision=jax.lax.Precision.HIGHEST,
    )
    _close(out, tgmm_loop(lhs_km, rhs, sizes, num_groups=len(sizes)))
    _close(out, transposed_grouped_matmul_reference(lhs_km, rhs, group_sizes))
    public = transposed_grouped_matmul(lhs_km, rhs, group_sizes, **_xla())
    _close(public, out)
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.any(np.asarray(out[g]))  # empty groups: exactly zero


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gmm_and_tgmm_16_bit_inputs_accumulate_in_float32(dtype):
    sizes, m, k, n = CASES["many_groups_straddling_tiles"]
    rng = np.random.default_rng()
    lhs, rhs = _normal(rng, (m, k), dtype), _normal(rng, (len(sizes), k, n), dtype)
    other = _normal(rng, (m, n), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(lhs, rhs, group_sizes, **_xla())
    _close(out, gmm_loop(lhs, rhs, sizes))  # exact products, float32 sums
    low = grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=dtype, **_xla())
    assert low.dtype == dtype
    _close(low, gmm_loop(lhs, rhs, sizes), rtol=1e-2)
    t = transposed_grouped_matmul(lhs.T, other, group_sizes, **_xla())
    _close(t, tgmm_loop(lhs.T, other, sizes, num_groups=len(sizes)))


def test_tile_rows_and_chunk_row_bounds_cover_each_local_row_once():
    assert xla.tile_rows(8192, 64) == 128
    assert xla.tile_rows(8192, 8) == 256
    assert xla.tile_rows(8192, 512) == 64
    assert xla.tile_rows(10, 3) == 10
    sizes = jnp.asarray([3, 0, 70, 1, 64, 0, 9, 40], jnp.int32)
    m, tm, offset, local = 200, 16, 2, 5
    meta = make_group_metadata(sizes, m=m, block_m=tm, group_offset=offset, num_groups=local)
    lo, hi = (np.asarray(x) for x in chunk_row_bounds(meta, tm))
    count = int(meta.num_chunks[0])
    covered = np.zeros(m, np.int64)
    for s in range(count):
        assert lo[s] < hi[s] and hi[s] - lo[s] <= tm
        covered[lo[s] : hi[s]] += 1
    starts, ends = _bounds(np.asarray(sizes))
    expected = np.zeros(m, np.int64)
    expected[starts[offset] : ends[offset + local - 1]] = 1
    np.testing.assert_array_equal(covered, expected)


# --- group_offset and existing_out ----------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 3, 5])  # start, middle, end of 8 groups (3 local)
def test_group_offset_with_existing_out_keeps_other_rows_bit_for_bit(offset):
    sizes = [20, 0, 33, 7, 70, 1, 0, 26]
    m, k, n, local = 170, 21, 18, 3
    rng = np.random.default_rng()
    lhs, rhs = _normal(rng, (m, k)), _normal(rng, (local, k, n))
    existing = _normal(rng, (m, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    kw = dict(group_offset=offset, existing_out=existing)
    out = grouped_matmul(lhs, rhs, group_sizes, **_xla(**kw))
    _close(out, gmm_loop(lhs, rhs, sizes, offset=offset, existing=existing))
    _close(out, grouped_matmul_reference(lhs, rhs, group_sizes, **kw))
    starts, ends = _bounds(sizes)
    local_rows = np.zeros(m, bool)
    local_rows[starts[offset] : ends[offset + local - 1]] = True
    np.testing.assert_array_equal(np.asarray(out)[~local_rows], np.asarray(existing)[~local_rows])

    existing_t = _normal(rng, (local, k, n))
    lhs_km, rhs_t = _normal(rng, (k, m)), _normal(rng, (m, n))
    t = transposed_grouped_matmul(
        lhs_km, rhs_t, group_sizes, num_groups=local, **_xla(**dict(kw, existing_out=existing_t))
    )
    expected = tgmm_loop(lhs_km, rhs_t, sizes, num_groups=local, offset=offset, existing=existing_t)
    _close(t, expected)
    for g in range(local):
        if sizes[offset + g] == 0:  # an empty local group keeps its existing_out exactly
            np.testing.assert_array_equal(np.asarray(t[g]), np.asarray(existing_t[g]))


# --- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("offset", [None, 1])
def test_gmm_gradients_match_grad_of_the_reference(offset, transpose_rhs):
    sizes = [14, 0, 65, 1, 30]
    m, k, n = 123, 19, 26
    local = 4 if offset is not None else 5
    rng = np.random.default_rng()
    lhs = _normal(rng, (m, k))
    rhs = _normal(rng, (local, n, k) if transpose_rhs else (local, k, n))
    existing, cotangent = _normal(rng, (m, n)), _normal(rng, (m, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    kw = dict(group_offset=offset, existing_out=existing, transpose_rhs=transpose_rhs)

    def loss(fn, **more):
        return lambda a, b, e: jnp.sum(
            cotangent * jnp.sin(fn(a, b, group_sizes, **dict(kw, existing_out=e), **more))
        )

    ours = jax.jit(jax.grad(loss(grouped_matmul, **_xla()), argnums=(0, 1, 2)))(lhs, rhs, existing)
    ref = jax.grad(loss(grouped_matmul_reference), argnums=(0, 1, 2))(lhs, rhs, existing)
    for a, b in zip(ours, ref, strict=True):
        _close(a, b)


def test_tgmm_gradients_match_grad_of_the_reference():
    sizes = [30, 2, 0, 77]
    m, k, n = 120, 13, 22
    rng = np.random.default_rng()
    lhs, rhs = _normal(rng, (k, m)), _normal(rng, (m, n))
    cotangent = _normal(rng, (len(sizes), k, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(fn, **kw):
        return lambda a, b: jnp.sum(cotangent * jnp.sin(fn(a, b, group_sizes, **kw)))

    ours = jax.jit(jax.grad(loss(transposed_grouped_matmul, **_xla()), argnums=(0, 1)))(lhs, rhs)
    ref = jax.grad(loss(transposed_grouped_matmul_reference), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(ours, ref, strict=True):
        _close(a, b)


# --- NaN / Inf isolation ---------------------------------------------------------------------

ISOLATION_SIZES = [10, 0, 17, 5]  # m = 40: rows 32..39 belong to no group
POISONED_GROUP = 2


def _isolation_run(implementation, lhs, rhs, cotangent):
    sizes = jnp.asarray(ISOLATION_SIZES, jnp.int32)
    kw = dict(implementation=implementation, tiling=(16, 16, 16))

    def loss(a, b):
        out = grouped_matmul(a, b, sizes, **kw)
        return jnp.sum(cotangent * out), out

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, out), (d_lhs, d_rhs) = run(lhs, rhs)
    return out, d_lhs, d_rhs


@pytest.mark.parametrize(
    "implementation, where, value",
    [
        ("xla", "weights", np.nan),
        ("xla", "weights", np.inf),
        ("xla", "rows", np.nan),
        ("xla", "rows", -np.inf),
        ("xla", "tail_rows", np.nan),
        ("xla", "tail_rows", np.inf),
        ("triton", "weights", np.nan),
        ("triton", "rows", np.inf),
        ("triton", "tail_rows", np.nan),
    ],
)
def test_nan_and_inf_stay_in_their_expert(implementation, where, value):
    """Forward and both gradients: everything outside the poisoned expert (or the tail
    rows) is finite and equal to the clean run."""
    m, k, n = 40, 12, 9
    rng = np.random.default_rng()
    lhs, rhs = rng.standard_normal((m, k), np.float32), rng.standard_normal((4, k, n), np.float32)
    cotangent = _normal(rng, (m, n))
    clean = _isolation_run(implementation, jnp.asarray(lhs), jnp.asarray(rhs), cotangent)
    starts, ends = _bounds(ISOLATION_SIZES)
    bad_rows = np.zeros(m, bool)
    bad_group = np.zeros(4, bool)
    if where == "weights":
        rhs[POISONED_GROUP, 3, 4] = value
    elif where == "rows":
        lhs[starts[POISONED_GROUP] + 4, 5] = value
    else:
        lhs[ends[-1] :] = value  # every row past sum(group_sizes)
    if where != "tail_rows":
        bad_rows[starts[POISONED_GROUP] : ends[POISONED_GROUP]] = True
        bad_group[POISONED_GROUP] = True
    poisoned = _isolation_run(implementation, jnp.asarray(lhs), jnp.asarray(rhs), cotangent)
    for name, a, b, bad in zip(
        ("out", "d_lhs", "d_rhs"), poisoned, clean, (bad_rows, bad_rows, bad_group), strict=True
    ):
        a, b = np.asarray(a)[~bad], np.asarray(b)[~bad]
        assert np.all(np.isfinite(a)), f"{name}: non-finite outside the poisoned expert"
        np.testing.assert_array_equal(a, b, err_msg=name)
    if where != "tail_rows":  # the poison did reach its own expert's rows
        assert not np.all(np.isfinite(np.asarray(poisoned[0])[bad_rows]))


# --- vmap -------------------------------------------------------------------------------------


def _check_vmap_matches_a_loop(fn, in_axes, args, diff_argnums):
    """`jax.vmap(fn)` forward, and `jax.grad` of a loss over the whole batch, against a
    Python loop of unbatched calls: per-example gradients stacked for batched arguments,
    summed for shared ones."""
    batch = next(a.shape[ax] for a, ax in zip(args, in_axes, strict=True) if ax is not None)

    def example(i):
        return [a if ax is None else a[i] for a, ax in zip(args, in_axes, strict=True)]

    def loss(*a):
        return jnp.sum(jnp.sin(fn(*a)))

    def batched_loss(*a):
        return jnp.sum(jnp.sin(jax.vmap(fn, in_axes=in_axes)(*a)))

    single, single_grad = jax.jit(fn), jax.jit(jax.grad(loss, diff_argnums))
    looped = jnp.stack([single(*example(i)) for i in range(batch)])
    _close(jax.jit(jax.vmap(fn, in_axes=in_axes))(*args), looped)
    grads = jax.jit(jax.grad(batched_loss, diff_argnums))(*args)
    per_example = [single_grad(*example(i)) for i in range(batch)]
    for j, argnum in enumerate(diff_argnums):
        stacked = jnp.stack([g[j] for g in per_example])
        _close(grads[j], stacked if in_axes[argnum] == 0 else stacked.sum(0))


BATCHED_SIZES = [[20, 0, 41, 9], [1, 77, 3, 0], [0, 0, 90, 0]]


@pytest.mark.parametrize("in_axes", [(0, None, None), (0, None, 0)], ids=["lhs", "lhs_and_sizes"])
def test_vmap_gmm_shared_weights_and_batched_sizes_match_a_loop(in_axes):
    rng = np.random.default_rng()
    lhs = _normal(rng, (3, 90, 11) if in_axes[0] == 0 else (90, 11))
    sizes = jnp.asarray(BATCHED_SIZES if in_axes[2] == 0 else BATCHED_SIZES[1], jnp.int32)
    rhs = _normal(rng, (4, 11, 14))

    def fn(a, b, s):
        return grouped_matmul(a, b, s, **_xla())

    _check_vmap_matches_a_loop(fn, in_axes, (lhs, rhs, sizes), diff_argnums=(0, 1))
    if in_axes[2] == 0:  # and the loop itself is right
        out = jax.vmap(fn, in_axes=in_axes)(lhs, rhs, sizes)
        for i, s in enumerate(BATCHED_SIZES):
            _close(out[i], gmm_loop(lhs[i] if in_axes[0] == 0 else lhs, rhs, s))


def test_vmap_batched_group_offset_and_existing_out_match_a_loop():
    rng = np.random.default_rng()
    sizes = jnp.asarray([13, 0, 28, 6, 40, 2], jnp.int32)
    lhs, rhs = _normal(rng, (100, 10)), _normal(rng, (3, 10, 12))
    offsets = jnp.asarray([0, 2, 3], jnp.int32)
    existing = _normal(rng, (3, 100, 12))

    def fn(a, b, offset, e):
        return grouped_matmul(a, b, sizes, group_offset=offset, existing_out=e, **_xla())

    args = (lhs, rhs, offsets, existing)
    _check_vmap_matches_a_loop(fn, (None, None, 0, 0), args, diff_argnums=(0, 1, 3))
    out = jax.vmap(fn, in_axes=(None, None, 0, 0))(*args)
    for i, offset in enumerate([0, 2, 3]):
        _close(out[i], gmm_loop(lhs, rhs, sizes, offset=offset, existing=existing[i]))


def test_vmap_tgmm_with_batched_sizes_matches_a_loop():
    rng = np.random.default_rng()
    sizes = jnp.asarray(BATCHED_SIZES, jnp.int32)
    lhs, rhs = _normal(rng, (3, 8, 90)), _normal(rng, (90, 7))

    def fn(a, b, s):
        return transposed_grouped_matmul(a, b, s, **_xla())

    _check_vmap_matches_a_loop(fn, (0, None, 0), (lhs, rhs, sizes), diff_argnums=(0, 1))


def test_ragged_dot_strategy_matches_and_falls_back_to_tiles_under_vmap(monkeypatch):
    """The TPU strategy (forced here on CPU) computes the same, and vmaps via the tiles."""
    monkeypatch.setattr(xla, "ragged_dot_is_faster", lambda platform=None: True)
    rng = np.random.default_rng()
    lhs, rhs = _normal(rng, (3, 90, 11)), _normal(rng, (4, 11, 14))
    sizes = jnp.asarray(BATCHED_SIZES, jnp.int32)
    existing = _normal(rng, (90, 14))
    group_sizes = jnp.asarray([9, 30, 0, 22, 5, 1], jnp.int32)
    kw = _xla(group_offset=1, existing_out=existing)
    out = grouped_matmul(lhs[0], rhs, group_sizes, **kw)
    _close(out, gmm_loop(lhs[0], rhs, group_sizes, offset=1, existing=existing))
    _check_vmap_matches_a_loop(
        lambda a, b, s: grouped_matmul(a, b, s, **_xla()), (0, None, 0), (lhs, rhs, sizes), (0,)
    )
    options = MatmulOptions(implementation="xla", preferred_element_type=np.dtype(np.float32))
    t = xla.tgmm(lhs[0].T, existing, group_sizes, jnp.int32(1), None, 4, options)
    _close(t, tgmm_loop(lhs[0].T, existing, group_sizes, num_groups=4, offset=1))
    options = dataclasses.replace(options, lhs_token_major=True)
    _close(xla.tgmm(lhs[0], existing, group_sizes, jnp.int32(1), None, 4, options), t)


# --- preferred_element_type=None and float64 ----------------------------------------------


def test_preferred_element_type_none_means_the_default():
    rng = np.random.default_rng()
    sizes, m, k, n = CASES["sum_below_m"]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _normal(rng, (m, k)), _normal(rng, (len(sizes), k, n))
    out = grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=None, **_xla())
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, grouped_matmul(lhs, rhs, group_sizes, **_xla()))
    other = _normal(rng, (m, n))
    t = transposed_grouped_matmul(lhs.T, other, group_sizes, preferred_element_type=None, **_xla())
    assert t.dtype == jnp.float32
    _close(t, tgmm_loop(lhs.T, other, sizes, num_groups=len(sizes)))
    low = grouped_matmul(
        lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), group_sizes, None, **_xla()
    )
    assert low.dtype == jnp.float32  # lax.dot's default, promoted to the float32 accumulator
    assert checks.check_preferred_element_type(None) == np.float32
    assert checks.check_preferred_element_type(None, jnp.bfloat16) == np.float32
    assert checks.check_preferred_element_type(None, np.float64) == np.float64


def test_float64_on_the_xla_path_matches_a_float64_loop():
    rng = np.random.default_rng()
    sizes, m, k, n = CASES["many_groups_straddling_tiles"]
    with jax.enable_x64(True):
        group_sizes = jnp.asarray(sizes, jnp.int32)
        lhs, rhs = _normal(rng, (m, k), np.float64), _normal(rng, (len(sizes), k, n), np.float64)
        existing = _normal(rng, (m, n), np.float64)
        f64 = dict(preferred_element_type=jnp.float64, **_xla())
        out = grouped_matmul(lhs, rhs, group_sizes, existing_out=existing, **f64)
        assert out.dtype == jnp.float64
        _close(out, gmm_loop(lhs, rhs, sizes, existing=existing), rtol=1e-13)
        other = _normal(rng, (m, n), np.float64)
        t = transposed_grouped_matmul(lhs.T, other, group_sizes, **f64)
        assert t.dtype == jnp.float64
        _close(t, tgmm_loop(lhs.T, other, sizes, num_groups=len(sizes)), rtol=1e-13)
        d_lhs, d_rhs = jax.grad(
            lambda a, b: jnp.sum(other * grouped_matmul(a, b, group_sizes, **f64)), (0, 1)
        )(lhs, rhs)
        assert d_lhs.dtype == d_rhs.dtype == jnp.float64
        _close(d_lhs, gmm_loop(other, rhs, sizes, transpose_rhs=True), rtol=1e-13)
        _close(d_rhs, tgmm_loop(lhs.T, other, sizes, num_groups=len(sizes)), rtol=1e-13)


def test_check_triton_dtypes_rejects_float64():
    checks.check_triton_dtypes("grouped_matmul", np.float32, np.float32)
    checks.check_triton_dtypes("grouped_matmul", jnp.bfloat16, np.float32)
    for operands, out in ((np.float64, np.float64), (np.float32, np.float64)):
        with pytest.raises(TypeError, match="float64 is unsupported on the Triton path"):
            checks.check_triton_dtypes("grouped_matmul", operands, out)


@pytest.mark.parametrize("op", ["gmm", "tgmm"])
def test_float64_on_the_triton_path_raises_a_type_error(op):
    rng = np.random.default_rng()
    with jax.enable_x64(True):
        group_sizes = jnp.asarray([5, 11], jnp.int32)
        lhs = _normal(rng, (20, 8), np.float64)
        kw = dict(preferred_element_type=jnp.float64, implementation="triton", interpret=True)
        with pytest.raises(TypeError, match="float64 is unsupported on the Triton path"):
            if op == "gmm":
                grouped_matmul(lhs, _normal(rng, (2, 8, 6), np.float64), group_sizes, **kw)
            else:
                transposed_grouped_matmul(
                    lhs.T, _normal(rng, (20, 6), np.float64), group_sizes, **kw
                )


# --- random problems ---------------------------------------------------------------------------


@st.composite
def problems(draw):
    total = draw(st.integers(1, 7))
    sizes = draw(st.lists(st.integers(0, 90), min_size=total, max_size=total))
    m = sum(sizes) + draw(st.integers(0, 30))
    hypothesis.assume(m > 0)
    local = draw(st.integers(1, total))
    offset = draw(st.one_of(st.none(), st.integers(0, total - local)))
    if offset is None:
        local = total
    return dict(
        sizes=sizes,
        m=m,
        k=draw(st.integers(1, 40)),
        n=draw(st.integers(1, 40)),
        local=local,
        offset=offset,
        existing=draw(st.booleans()),
        transpose_rhs=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@hypothesis.settings(max_examples=6)
@hypothesis.given(problems())
def test_random_problems_match_the_float64_loop(p):
    rng = np.random.default_rng(p["seed"])
    m, k, n, local = p["m"], p["k"], p["n"], p["local"]
    lhs = _normal(rng, (m, k))
    rhs = _normal(rng, (local, n, k) if p["transpose_rhs"] else (local, k, n))
    existing = _normal(rng, (m, n)) if p["existing"] else None
    group_sizes = jnp.asarray(p["sizes"], jnp.int32)
    out = grouped_matmul(
        lhs,
        rhs,
        group_sizes,
        group_offset=p["offset"],
        existing_out=existing,
        transpose_rhs=p["transpose_rhs"],
        **_xla(),
    )
    expected = gmm_loop(
        lhs,
        rhs,
        p["sizes"],
        offset=p["offset"] or 0,
        existing=existing,
        transpose_rhs=p["transpose_rhs"],
    )
    _close(out, expected)
    lhs_km, rhs_t = _normal(rng, (k, m)), _normal(rng, (m, n))
    t = transposed_grouped_matmul(
        lhs_km, rhs_t, group_sizes, group_offset=p["offset"], num_groups=local, **_xla()
    )
    _close(t, tgmm_loop(lhs_km, rhs_t, p["sizes"], num_groups=local, offset=p["offset"] or 0))
