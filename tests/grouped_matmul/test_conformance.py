"""Every grouped matmul backend against two oracles, through the public ops.

`grouped_matmul` / `transposed_grouped_matmul` with `implementation=impl` for every entry
of `IMPLEMENTATIONS` must match both the package's dense references
(`grouped_matmul_reference`, `transposed_grouped_matmul_reference`) and an independent
float64 numpy loop over groups; gradients (lhs, rhs, existing_out) must match `jax.grad`
of the references and the float64 loop's closed forms. Tolerances: one table by result
dtype (`tests/grouped_matmul/helpers.py`): float32 2e-5, float16 2e-3, bfloat16 1.6e-2.

Cases: empty groups first, in the middle and last, length-1 groups, one group holding
every row, rows past sum(group_sizes), m/k/n not multiples of the tiles, group_offset at
both ends, existing_out, transpose_rhs, float32/float16/bfloat16, traced sizes and
offsets (garbage too: negative sizes, sums past int32, offsets out of range), expert
parallelism under shard_map, and hypothesis-random problems. The Triton launcher on the
CPU starts outputs as NaN: the finiteness check in `assert_close` proves every element
was written. Adding a backend is one entry in `IMPLEMENTATIONS`.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_bridge import (
    grouped_matmul,
    grouped_matmul_reference,
    transposed_grouped_matmul,
    transposed_grouped_matmul_reference,
)
from tests.devices import first_devices
from tests.grouped_matmul.helpers import (
    Float64Product,
    assert_close,
    bounds,
    gmm_float64,
    normal,
    tgmm_float64,
)

IMPLEMENTATIONS = ["xla", "triton"]
every_implementation = pytest.mark.parametrize("implementation", IMPLEMENTATIONS)


def check_gmm(out, lhs, rhs, sizes, *, offset=None, existing=None, transpose_rhs=False):
    """`out` against grouped_matmul_reference and the float64 loop."""
    reference = grouped_matmul_reference(
        lhs,
        rhs,
        sizes,
        group_offset=offset,
        existing_out=existing,
        transpose_rhs=transpose_rhs,
        preferred_element_type=out.dtype,
    )
    assert reference.dtype == out.dtype
    float64 = gmm_float64(
        lhs, rhs, sizes, offset=offset or 0, existing=existing, transpose_rhs=transpose_rhs
    )
    assert_close(out, reference, name="vs grouped_matmul_reference", oracle=float64)
    assert_close(out, float64, name="vs the float64 loop")


def check_tgmm(out, lhs, rhs, sizes, *, num_groups, offset=None, existing=None):
    """`out` against transposed_grouped_matmul_reference and the float64 loop."""
    reference = transposed_grouped_matmul_reference(
        lhs,
        rhs,
        sizes,
        num_groups=num_groups,
        group_offset=offset,
        existing_out=existing,
        preferred_element_type=out.dtype,
    )
    float64 = tgmm_float64(
        lhs, rhs, sizes, num_groups=num_groups, offset=offset or 0, existing=existing
    )
    assert_close(out, reference, name="vs transposed_grouped_matmul_reference", oracle=float64)
    assert_close(out, float64, name="vs the float64 loop")


# --- forward: structured cases ------------------------------------------------------------

# (m, k, n, group sizes, offset, local groups, tiling).
GMM_CASES = {
    "empty_groups_and_tail_rows": (90, 40, 48, [17, 0, 31, 0, 25], 0, 5, (32, 16, 32)),
    "empty_first_and_last": (64, 24, 16, [0, 20, 1, 30, 0], 0, 5, (16, 16, 16)),
    "one_group_holds_every_row": (70, 32, 24, [0, 70, 0], 0, 3, (32, 16, 16)),
    "length_one_groups": (37, 16, 16, [1, 1, 0, 1, 30, 1], 0, 6, (16, 16, 16)),
    "single_group": (33, 24, 40, [29], 0, 1, (16, 16, 32)),
    "offset_middle": (80, 24, 32, [9, 14, 0, 21, 5, 11, 8], 2, 3, (16, 16, 16)),
    "offset_first": (64, 16, 32, [20, 1, 13, 0, 30], 0, 2, (32, 16, 16)),
    "offset_last_empty": (50, 16, 16, [12, 7, 0, 0], 2, 2, (16, 16, 16)),
}


@every_implementation
@pytest.mark.parametrize("case", GMM_CASES.values(), ids=GMM_CASES.keys())
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_references(case, implementation, transpose_rhs):
    m, k, n, sizes, offset, local, tiling = case
    rng = np.random.default_rng(sum(sizes) + 7 * transpose_rhs)
    lhs = normal(rng, (m, k))
    rhs = normal(rng, (local, n, k) if transpose_rhs else (local, k, n))
    has_offset = offset or local != len(sizes)
    existing = normal(rng, (m, n)) if has_offset else None  # offsets also accumulate
    sizes = jnp.asarray(sizes, jnp.int32)
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=tiling,
        group_offset=offset if has_offset else None,
        existing_out=existing,
        transpose_rhs=transpose_rhs,
        implementation=implementation,
    )
    assert out.shape == (m, n) and out.dtype == jnp.float32
    check_gmm(
        out,
        lhs,
        rhs,
        sizes,
        offset=offset if has_offset else None,
        existing=existing,
        transpose_rhs=transpose_rhs,
    )


@every_implementation
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, "same"])
def test_gmm_half_precision(implementation, dtype, out_dtype):
    """16-bit products are exact in float32: only the output rounding is 16-bit. Rows
    past sum(group_sizes) keep existing_out bit for bit."""
    rng = np.random.default_rng(3)
    out_dtype = dtype if out_dtype == "same" else out_dtype
    m, k, n = 72, 48, 32
    sizes = jnp.asarray([0, 25, 1, 30, 0], jnp.int32)
    lhs, rhs = normal(rng, (m, k), dtype), normal(rng, (5, k, n), dtype)
    existing = normal(rng, (m, n), out_dtype)
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
    check_gmm(out, lhs, rhs, sizes, existing=existing)
    tail = np.arange(m) >= 56
    np.testing.assert_array_equal(np.asarray(out)[tail], np.asarray(existing)[tail])


@every_implementation
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_tgmm_matches_references(implementation, dtype):
    """Empty groups first, middle and last get zeros (tgmm's output is not pre-filled);
    rows past the sum are ignored; k and n are not multiples of the tiles."""
    rng = np.random.default_rng(4)
    m, k, n = 75, 40, 24
    sizes = jnp.asarray([0, 16, 1, 0, 33, 0], jnp.int32)
    lhs, rhs = normal(rng, (k, m), dtype), normal(rng, (m, n), dtype)
    out = transposed_grouped_matmul(
        lhs, rhs, sizes, tiling=(32, 16, 32), implementation=implementation
    )
    assert out.shape == (6, k, n) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out)[[0, 3, 5]], 0.0)
    check_tgmm(out, lhs, rhs, sizes, num_groups=6)


@every_implementation
def test_tgmm_group_offset_and_existing_out(implementation):
    rng = np.random.default_rng(5)
    m, k, n = 60, 16, 32
    sizes = jnp.asarray([5, 0, 22, 1, 14, 9], jnp.int32)
    lhs, rhs = normal(rng, (k, m)), normal(rng, (m, n))
    existing = normal(rng, (3, k, n))
    out = transposed_grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=(16, 16, 16),
        group_offset=1,
        num_groups=3,
        existing_out=existing,
        implementation=implementation,
    )
    check_tgmm(out, lhs, rhs, sizes, num_groups=3, offset=1, existing=existing)
    np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(existing)[0])  # empty group


# --- forward: random problems -------------------------------------------------------------


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
        offset=offset if (draw(st.booleans()) or local != num_total) else None,
        local=local,
        tiling=(draw(st.sampled_from([16, 32])), 16, draw(st.sampled_from([16, 32]))),
        transpose_rhs=draw(st.booleans()),
        existing=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@every_implementation
@hypothesis.settings(max_examples=6)
@hypothesis.given(p=gmm_problems(max_m=60))
def test_gmm_random_problems(implementation, p):
    rng = np.random.default_rng(p["seed"])
    m, k, n, local = p["m"], p["k"], p["n"], p["local"]
    lhs = normal(rng, (m, k))
    rhs = normal(rng, (local, n, k) if p["transpose_rhs"] else (local, k, n))
    existing = normal(rng, (m, n)) if p["existing"] else None
    sizes = jnp.asarray(p["sizes"], jnp.int32)
    out = grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=p["tiling"],
        group_offset=p["offset"],
        existing_out=existing,
        transpose_rhs=p["transpose_rhs"],
        implementation=implementation,
    )
    check_gmm(
        out,
        lhs,
        rhs,
        sizes,
        offset=p["offset"],
        existing=existing,
        transpose_rhs=p["transpose_rhs"],
    )


@every_implementation
@hypothesis.settings(max_examples=4)
@hypothesis.given(p=gmm_problems(max_m=60))
def test_tgmm_random_problems(implementation, p):
    rng = np.random.default_rng(p["seed"])
    m, k, n, local = p["m"], p["k"], p["n"], p["local"]
    lhs, rhs = normal(rng, (k, m)), normal(rng, (m, n))
    existing = normal(rng, (local, k, n)) if p["existing"] else None
    sizes = jnp.asarray(p["sizes"], jnp.int32)
    offset = p["offset"]
    out = transposed_grouped_matmul(
        lhs,
        rhs,
        sizes,
        tiling=p["tiling"],
        group_offset=offset,
        num_groups=local if offset is not None else len(p["sizes"]),
        existing_out=existing if offset is not None or local == len(p["sizes"]) else None,
        implementation=implementation,
    )
    num_groups = local if offset is not None else len(p["sizes"])
    check_tgmm(
        out,
        lhs,
        rhs,
        sizes,
        num_groups=num_groups,
        offset=offset,
        existing=existing if offset is not None or local == len(p["sizes"]) else None,
    )


# --- gradients ------------------------------------------------------------------------------

GRAD_CASES = {
    "plain": dict(offset=None, existing=False, transpose_rhs=False),
    "transpose_rhs": dict(offset=None, existing=False, transpose_rhs=True),
    "offset_existing": dict(offset=1, existing=True, transpose_rhs=False),
    "offset_existing_transposed": dict(offset=2, existing=True, transpose_rhs=True),
}


@every_implementation
@pytest.mark.parametrize("case", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_gmm_gradients(implementation, case):
    """d_lhs, d_rhs (and d_existing_out) vs jax.grad of the reference and the float64
    closed forms d_lhs = gmm(w, rhs^T), d_rhs = tgmm(lhs^T, w); rows of no local group
    get exactly zero gradient."""
    rng = np.random.default_rng(6)
    m, k, n = 56, 24, 16
    sizes = jnp.asarray([11, 0, 1, 19, 0, 15], jnp.int32)  # 46 rows < m
    offset, transpose_rhs = case["offset"], case["transpose_rhs"]
    local = 6 if offset is None else 3
    lhs = normal(rng, (m, k))
    rhs = normal(rng, (local, n, k) if transpose_rhs else (local, k, n))
    existing = normal(rng, (m, n)) if case["existing"] else None
    weight = normal(rng, (m, n))
    options = dict(group_offset=offset, transpose_rhs=transpose_rhs)

    def ours(lhs, rhs, existing):
        out = grouped_matmul(
            lhs,
            rhs,
            sizes,
            tiling=(16, 16, 16),
            existing_out=existing,
            implementation=implementation,
            **options,
        )
        return jnp.sum(out * weight)

    def reference(lhs, rhs, existing):
        return jnp.sum(
            grouped_matmul_reference(lhs, rhs, sizes, existing_out=existing, **options) * weight
        )

    argnums = (0, 1, 2) if case["existing"] else (0, 1)
    got = jax.jit(jax.grad(ours, argnums))(lhs, rhs, existing)
    want = jax.grad(reference, argnums)(lhs, rhs, existing)
    first = offset or 0
    d_lhs = gmm_float64(weight, rhs, sizes, offset=first, transpose_rhs=not transpose_rhs)
    if transpose_rhs:
        d_rhs = tgmm_float64(weight.T, lhs, sizes, num_groups=local, offset=first)
    else:
        d_rhs = tgmm_float64(lhs.T, weight, sizes, num_groups=local, offset=first)
    d_existing = Float64Product.exact(weight)  # d_existing_out = weight, exactly
    sizes_of = (d_lhs, d_rhs, d_existing)
    for name, g, w, size in zip(
        ("d_lhs", "d_rhs", "d_existing_out"), got, want, sizes_of, strict=False
    ):
        assert_close(g, w, name=f"{name} vs jax.grad of the reference", oracle=size)
    assert_close(got[0], d_lhs, name="d_lhs vs the float64 loop")
    assert_close(got[1], d_rhs, name="d_rhs vs the float64 loop")
    if case["existing"]:
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(weight))
    starts, ends = bounds(sizes)
    outside = (np.arange(m) < starts[first]) | (np.arange(m) >= ends[first + local - 1])
    np.testing.assert_array_equal(np.asarray(got[0])[outside], 0.0)


@every_implementation
@pytest.mark.parametrize("offset", [None, 1])
def test_tgmm_gradients(implementation, offset):
    rng = np.random.default_rng(7)
    m, k, n = 48, 16, 24
    sizes = jnp.asarray([10, 0, 1, 21, 7], jnp.int32)
    local = 5 if offset is None else 3
    lhs, rhs = normal(rng, (k, m)), normal(rng, (m, n))
    existing = normal(rng, (local, k, n))
    weight = normal(rng, (local, k, n))
    options = dict(group_offset=offset, num_groups=local)

    def ours(lhs, rhs, existing):
        out = transposed_grouped_matmul(
            lhs,
            rhs,
            sizes,
            tiling=(16, 16, 16),
            existing_out=existing,
            implementation=implementation,
            **options,
        )
        return jnp.sum(out * weight)

    def reference(lhs, rhs, existing):
        out = transposed_grouped_matmul_reference(lhs, rhs, sizes, existing_out=existing, **options)
        return jnp.sum(out * weight)

    got = jax.grad(ours, (0, 1, 2))(lhs, rhs, existing)
    want = jax.grad(reference, (0, 1, 2))(lhs, rhs, existing)
    # d_rhs[rows of g] = lhs[:, rows].T @ weight[g]: a gmm of lhs.T with the weights;
    # d_lhs[:, rows of g] = weight[g] @ rhs[rows].T: the transpose of a gmm of rhs.
    d_rhs = gmm_float64(lhs.T, weight, sizes, offset=offset or 0)
    d_lhs_t = gmm_float64(rhs, weight, sizes, offset=offset or 0, transpose_rhs=True)
    d_existing = Float64Product.exact(weight)
    sizes_of = (d_lhs_t.T, d_rhs, d_existing)
    for name, g, w, size in zip(
        ("d_lhs", "d_rhs", "d_existing_out"), got, want, sizes_of, strict=True
    ):
        assert_close(g, w, name=name, oracle=size)
    assert_close(got[1], d_rhs, name="d_rhs vs the float64 loop")


@every_implementation
def test_gmm_gradient_of_bf16_inputs_has_input_dtypes(implementation):
    """The cotangent is rounded to bf16 before the backward matmuls: bf16 tolerance."""
    rng = np.random.default_rng(8)
    lhs, rhs = normal(rng, (40, 16), jnp.bfloat16), normal(rng, (3, 16, 16), jnp.bfloat16)
    sizes = jnp.asarray([13, 0, 20], jnp.int32)

    def loss(a, b):
        out = grouped_matmul(a, b, sizes, tiling=(16, 16, 16), implementation=implementation)
        return jnp.sum(out**2)

    d_lhs, d_rhs = jax.grad(loss, (0, 1))(lhs, rhs)
    assert d_lhs.dtype == jnp.bfloat16 and d_rhs.dtype == jnp.bfloat16
    want = jax.grad(lambda a, b: jnp.sum(grouped_matmul_reference(a, b, sizes) ** 2), (0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    )
    # d_lhs = 2 out @ rhs^T, d_rhs = lhs^T @ 2 out per group: their float64 magnitudes.
    twice_out = 2 * gmm_float64(lhs, rhs, sizes).value
    sizes_of = (
        gmm_float64(twice_out, rhs, sizes, transpose_rhs=True),
        tgmm_float64(lhs.T, twice_out, sizes, num_groups=3),
    )
    for name, g, w, size in zip(("d_lhs", "d_rhs"), (d_lhs, d_rhs), want, sizes_of, strict=True):
        assert_close(g, w, name=name, oracle=size)


# --- traced sizes and offsets, expert parallelism -----------------------------------------


@every_implementation
def test_gmm_under_jit_with_traced_sizes_and_offset(implementation):
    rng = np.random.default_rng(9)
    m, k, n = 48, 16, 16
    lhs, rhs = normal(rng, (m, k)), normal(rng, (2, k, n))

    @jax.jit
    def f(sizes, offset):
        return grouped_matmul(
            lhs,
            rhs,
            sizes,
            tiling=(16, 16, 16),
            group_offset=offset,
            implementation=implementation,
        )

    for sizes, offset in (([5, 17, 0, 20], 1), ([0, 0, 30, 18], 2), ([40, 1, 7, 0], 0)):
        sizes = jnp.asarray(sizes, jnp.int32)
        check_gmm(f(sizes, jnp.int32(offset)), lhs, rhs, sizes, offset=offset)
    assert f._cache_size() == 1


@every_implementation
def test_traced_negative_sizes_count_as_zero(implementation):
    """Traced sizes are never checked: a negative size counts as 0 on every backend and in
    the reference (the groups then tile one range, never overlapping), and rows past m
    are cut. Counted as they come, [48, -48, 64] would overlap and need more tiles than
    the launch has; [5, 2, -6, 2, 9] from group 1 would leave gaps."""
    rng = np.random.default_rng(12)
    m, k, n = 64, 16, 16

    @jax.jit
    def f(lhs, rhs, sizes, offset):
        return grouped_matmul(
            lhs, rhs, sizes, tiling=(16, 16, 16), group_offset=offset,
            implementation=implementation,
        )  # fmt: skip

    for sizes, offset in (([48, -48, 64], 0), ([5, 2, -6, 2, 9], 1)):
        lhs, rhs = normal(rng, (m, k)), normal(rng, (3, k, n))
        traced = jnp.asarray(sizes, jnp.int32)
        out = f(lhs, rhs, traced, jnp.int32(offset))
        reference = grouped_matmul_reference(
            lhs, rhs, traced, group_offset=offset, preferred_element_type=out.dtype
        )
        float64 = gmm_float64(lhs, rhs, np.maximum(sizes, 0), offset=offset)
        assert_close(out, reference, name="vs grouped_matmul_reference", oracle=float64)
        assert_close(out, float64, name="vs the float64 loop")


@every_implementation
def test_traced_sizes_past_int32_are_cut_at_m(implementation):
    """Traced sizes whose sums pass int32 do not wrap around: the groups are cut at the m
    rows that exist, exactly, on every backend and in the reference. Wrapped, [2**31 - 1,
    2**31 - 1, 5] would end its groups at [2**31 - 1, -2, 3], and group 2 would take
    rows 0..2 from group 0."""
    rng = np.random.default_rng(13)
    m, k, n, big, quarter = 64, 16, 16, 2**31 - 1, 2**30

    @jax.jit
    def f(lhs, rhs, sizes, offset, existing):
        kw = dict(tiling=(16, 16, 16), group_offset=offset, implementation=implementation)
        out = grouped_matmul(lhs, rhs, sizes, existing_out=existing, **kw)
        return out, transposed_grouped_matmul(lhs.T, existing, sizes, num_groups=3, **kw)

    for sizes, offset in (
        ([big, big, 5], 0),
        ([40, big, big, 5], 1),
        ([30, quarter, quarter, quarter, quarter, 7], 2),  # sums to 37 mod 2**32
    ):
        lhs, rhs, existing = normal(rng, (m, k)), normal(rng, (3, k, n)), normal(rng, (m, n))
        traced = jnp.asarray(sizes, jnp.int32)
        out, weights = f(lhs, rhs, traced, jnp.int32(offset), existing)
        # The sizes cut at m, from exact (int64) sums.
        cut = np.diff(np.minimum(np.cumsum(np.asarray(sizes, np.int64)), m), prepend=0)
        reference = grouped_matmul_reference(
            lhs, rhs, traced, group_offset=offset, existing_out=existing
        )
        float64 = gmm_float64(lhs, rhs, cut, offset=offset, existing=existing)
        assert_close(out, reference, name="gmm vs grouped_matmul_reference", oracle=float64)
        assert_close(out, float64, name="gmm vs the float64 loop")
        reference = transposed_grouped_matmul_reference(
            lhs.T, existing, traced, num_groups=3, group_offset=offset
        )
        float64 = tgmm_float64(lhs.T, existing, cut, num_groups=3, offset=offset)
        assert_close(weights, reference, name="tgmm vs the reference", oracle=float64)
        assert_close(weights, float64, name="tgmm vs the float64 loop")


@every_implementation
def test_traced_group_offset_out_of_range_is_taken_as_dynamic_slice_takes_it(implementation):
    """A traced offset is not checked: outside [0, len(group_sizes) - num_groups] it is
    taken as `jax.lax.dynamic_slice` takes a start (a negative one counts from the end,
    then it is clamped into that range), on every backend and in the reference."""
    rng = np.random.default_rng(14)
    m, k, n = 64, 16, 16
    sizes = jnp.asarray([10, 20, 5, 17], jnp.int32)  # 2 local groups: offsets 0..2

    @jax.jit
    def f(lhs, rhs, offset, existing):
        kw = dict(tiling=(16, 16, 16), group_offset=offset, implementation=implementation)
        out = grouped_matmul(lhs, rhs, sizes, existing_out=existing, **kw)
        return out, transposed_grouped_matmul(lhs.T, existing, sizes, num_groups=2, **kw)

    # (traced offset, the offset it is taken as)
    for offset, taken_as in ((-1, 2), (-3, 1), (-7, 0), (-(2**31), 0), (3, 2), (9, 2)):
        lhs, rhs, existing = normal(rng, (m, k)), normal(rng, (2, k, n)), normal(rng, (m, n))
        out, weights = f(lhs, rhs, jnp.int32(offset), existing)
        reference = grouped_matmul_reference(
            lhs, rhs, sizes, group_offset=jnp.int32(offset), existing_out=existing
        )
        float64 = gmm_float64(lhs, rhs, sizes, offset=taken_as, existing=existing)
        assert_close(out, reference, name=f"gmm at {offset} vs the reference", oracle=float64)
        assert_close(out, float64, name=f"gmm at {offset} vs the float64 loop")
        reference = transposed_grouped_matmul_reference(
            lhs.T, existing, sizes, num_groups=2, group_offset=jnp.int32(offset)
        )
        float64 = tgmm_float64(lhs.T, existing, sizes, num_groups=2, offset=taken_as)
        assert_close(weights, reference, name=f"tgmm at {offset} vs the reference", oracle=float64)
        assert_close(weights, float64, name=f"tgmm at {offset} vs the float64 loop")


@every_implementation
def test_expert_parallel_shard_map_sums_to_the_full_product(implementation):
    """Each device holds 2 of 8 experts; summing the devices' outputs is the full gmm."""
    rng = np.random.default_rng(10)
    devices, per_device = 4, 2
    m, k, n = 64, 16, 16
    sizes = jnp.asarray([9, 0, 14, 1, 0, 17, 8, 5], jnp.int32)
    lhs, rhs = normal(rng, (m, k)), normal(rng, (devices * per_device, k, n))
    mesh = jax.make_mesh(
        (devices,),
        ("expert",),
        devices=first_devices(devices),
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
            implementation=implementation,
        )
        return jax.lax.psum(out, "expert")

    f = jax.jit(
        jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P())
    )
    check_gmm(f(lhs, rhs, sizes), lhs, rhs, sizes)


@every_implementation
def test_non_finite_values_stay_in_their_group(implementation):
    """A NaN in one group's weights reaches only that group's rows (the reference selects,
    never multiplies by zero); the other rows are still exact."""
    rng = np.random.default_rng(11)
    m, k, n = 40, 16, 16
    sizes = jnp.asarray([12, 0, 20], jnp.int32)
    lhs, rhs = normal(rng, (m, k)), normal(rng, (3, k, n))
    rhs = rhs.at[2, 3, 5].set(jnp.nan)
    out = np.asarray(
        grouped_matmul(lhs, rhs, sizes, tiling=(16, 16, 16), implementation=implementation)
    )
    group_2 = (np.arange(m) >= 12) & (np.arange(m) < 32)
    assert np.isnan(out[group_2, 5]).all()
    expected = np.asarray(grouped_matmul_reference(lhs, rhs, sizes))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    size = gmm_float64(lhs, rhs, sizes)[~group_2]
    assert_close(out[~group_2], expected[~group_2], jnp.float32, "rows of other groups", size)


@every_implementation
def test_transposed_non_finite_values_stay_in_their_group(implementation):
    """tgmm: a NaN in one group's lhs columns and an Inf in another's rhs rows reach only
    their own group's [k, n] block, in the op and in the reference (which selects each
    group's rows, never multiplies another group's by zero), forward and backward: the
    other groups match the float64 loop, and with a cotangent that is NaN / Inf in those
    two blocks (the gradient of sum(out ** 2)) so do group 0's inputs' gradients."""
    rng = np.random.default_rng(12)
    m, k, n = 36, 16, 16
    sizes = jnp.asarray([10, 0, 14, 12], jnp.int32)
    lhs, rhs = normal(rng, (k, m)), normal(rng, (m, n))
    lhs = lhs.at[4, 12].set(jnp.nan)  # group 2's rows are 10..23
    rhs = rhs.at[30, 7].set(jnp.inf)  # group 3's rows are 24..35
    op = functools.partial(transposed_grouped_matmul, tiling=(16, 16, 16),
                           implementation=implementation)  # fmt: skip
    out = np.asarray(op(lhs, rhs, sizes))
    expected = np.asarray(transposed_grouped_matmul_reference(lhs, rhs, sizes))
    clean = np.array([True, True, False, False])
    assert np.isfinite(out[clean]).all() and np.isfinite(expected[clean]).all()
    assert not np.isfinite(out[2]).all() and not np.isfinite(out[3]).all()
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(expected))
    size = tgmm_float64(lhs, rhs, sizes, num_groups=4)[clean]
    assert_close(out[clean], expected[clean], jnp.float32, "groups without NaN or Inf", size)

    # Group 0 (rows 0..9): d lhs[:, rows] = 2 out0 rhs[rows]^T, d rhs[rows] = lhs[:, rows]^T
    # 2 out0, in float64 with their magnitudes (sums of 10 terms, then of 16).
    lhs0, rhs0 = np.asarray(lhs, np.float64)[:, :10], np.asarray(rhs, np.float64)[:10]
    out0, size0 = lhs0 @ rhs0, np.abs(lhs0) @ np.abs(rhs0)
    d_lhs0 = Float64Product(2 * out0 @ rhs0.T, 2 * size0 @ np.abs(rhs0).T, 10 + n)
    d_rhs0 = Float64Product(lhs0.T @ (2 * out0), np.abs(lhs0).T @ (2 * size0), 10 + k)

    def loss(lhs, rhs, fn):
        return jnp.sum(fn(lhs, rhs, sizes) ** 2)

    for name, fn in (("op", op), ("reference", transposed_grouped_matmul_reference)):
        d_lhs, d_rhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs, fn)
        assert_close(np.asarray(d_lhs)[:, :10], d_lhs0, jnp.float32, f"{name} d_lhs group 0")
        assert_close(np.asarray(d_rhs)[:10], d_rhs0, jnp.float32, f"{name} d_rhs group 0")
