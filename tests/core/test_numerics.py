"""Tests for jax_bridge.core.numerics against float64 numpy references and jax.grad of
plain-jnp references."""

import functools
import math
from fractions import Fraction

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify

from jax_bridge.core.numerics import (
    cdiv,
    chunk_array,
    identity_dtype_convert,
    log_sum_exp,
    safe_divide,
    unchunk_array,
)

# ---------------------------------------------------------------- cdiv


@given(a=st.integers(-(10**6), 10**6), b=st.integers(-50, 50).filter(lambda v: v != 0))
def test_cdiv_python_ints_is_exact_ceiling(a, b):
    got = cdiv(a, b)
    assert isinstance(got, int)
    assert got == math.ceil(Fraction(a, b))
    # Defining property of the ceiling: the smallest q with q * b >= a (b > 0) / <= a (b < 0).
    assert (got * b >= a and (got - 1) * b < a) if b > 0 else (got * b <= a and (got - 1) * b > a)


@given(
    a=hnp.arrays(np.int32, (16,), elements=st.integers(-1000, 1000)),
    b=hnp.arrays(np.int32, (16,), elements=st.integers(1, 40)),
)
def test_cdiv_arrays_match_numpy_ceil(a, b):
    want = np.ceil(a.astype(np.float64) / b).astype(np.int64)
    np.testing.assert_array_equal(jax.jit(cdiv)(a, b), want)
    np.testing.assert_array_equal(cdiv(jnp.asarray(a), 7), np.ceil(a / 7.0).astype(np.int64))


def test_cdiv_unsigned_and_errors():
    a = np.array([0, 1, 63, 64, 65, 4_000_000_000], np.uint32)
    np.testing.assert_array_equal(cdiv(a, np.uint32(64)), -(-a.astype(np.int64) // 64))
    with pytest.raises(ValueError, match="divisor b"):
        cdiv(3, 0)
    with pytest.raises(TypeError, match="a must be an integer"):
        cdiv(2.5, 2)
    with pytest.raises(TypeError, match="b must be an integer"):
        cdiv(jnp.arange(3), jnp.ones(3))
    # a zero among an array's divisors, concrete (even under jit) or traced (checkify)
    with pytest.raises(ValueError, match="divisor b"):
        cdiv(jnp.arange(3), jnp.array([2, 0, 1]))
    with pytest.raises(ValueError, match="divisor b"):
        jax.jit(lambda a: cdiv(a, np.array([2, 0, 1])))(jnp.arange(3))
    err, _ = jax.jit(checkify.checkify(cdiv))(jnp.arange(3), jnp.array([2, 0, 1]))
    with pytest.raises(checkify.JaxRuntimeError, match="divisor b"):
        err.throw()
    # divisors given as a list holding a traced value: checked when traced, never read
    np.testing.assert_array_equal(jax.jit(lambda s: cdiv(jnp.arange(3), [s, 2, 3]))(2), [0, 1, 1])


# ---------------------------------------------------------------- log_sum_exp


def ref_log_sum_exp(x, axis, keepdims=False):
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(x - shift), axis=axis, keepdims=True)) + shift
    return out if keepdims else np.squeeze(out, axis=axis)


def masked_rows(seed, shape, neg_inf_fraction=0.3):
    """Random normals with some -inf entries and, along the last axis, some all -inf rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 4
    x[rng.random(shape) < neg_inf_fraction] = -np.inf
    x.reshape(-1, shape[-1])[:: max(1, x.size // shape[-1] // 3)] = -np.inf
    return x


@given(
    seed=st.integers(0, 2**32 - 1),
    axis=st.sampled_from([-1, 0, (0, 2), None]),
    keepdims=st.booleans(),
)
def test_log_sum_exp_matches_float64_and_gives_neg_inf_for_masked_rows(seed, axis, keepdims):
    x = masked_rows(seed, (3, 4, 5))
    got = np.asarray(log_sum_exp(x, axis=axis, keepdims=keepdims))
    want = ref_log_sum_exp(x, axis=axis, keepdims=keepdims)
    assert got.shape == want.shape
    assert not np.any(np.isnan(got))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_log_sum_exp_all_neg_inf_row_jit_and_empty_axis():
    x = np.array([[-np.inf] * 4, [0.5, -np.inf, 2.0, -1.0]], np.float32)
    got = jax.jit(log_sum_exp)(x)
    assert np.isneginf(got[0])
    np.testing.assert_allclose(got[1], ref_log_sum_exp(x[1], -1), rtol=1e-6)
    np.testing.assert_array_equal(log_sum_exp(x), got)
    assert np.all(np.isneginf(log_sum_exp(np.zeros((3, 0), np.float32))))


def test_log_sum_exp_bf16_keeps_dtype_and_is_accurate():
    x = masked_rows(4, (6, 33)).astype(jnp.bfloat16)
    got = log_sum_exp(x)
    assert got.dtype == jnp.bfloat16
    want = ref_log_sum_exp(np.asarray(x, np.float32), -1)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)


def test_log_sum_exp_gradient_is_softmax_and_zero_on_masked_rows():
    x = masked_rows(7, (5, 6))
    weights = np.random.default_rng(8).standard_normal(5).astype(np.float32)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(weights * log_sum_exp(x))))(x)
    assert not np.any(np.isnan(grad))
    x64 = x.astype(np.float64)
    finite_rows = np.isfinite(np.max(x64, axis=-1))
    with np.errstate(invalid="ignore"):
        softmax = np.exp(x64 - ref_log_sum_exp(x64, -1, keepdims=True))
    np.testing.assert_allclose(
        grad[finite_rows], (weights[:, None] * softmax)[finite_rows], rtol=1e-5, atol=1e-6
    )
    assert np.all(np.asarray(grad)[~finite_rows] == 0)
    # Same gradient as jax.grad of jax's own logsumexp where the latter is defined.
    ref_grad = jax.grad(lambda x: jnp.sum(weights * jax.nn.logsumexp(x, axis=-1)))(x)
    np.testing.assert_allclose(grad[finite_rows], ref_grad[finite_rows], rtol=1e-5, atol=1e-6)


def test_log_sum_exp_bad_input():
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        log_sum_exp(np.arange(4))
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        log_sum_exp(np.ones((2, 2), np.float32), axis=2)
    with pytest.raises(ValueError, match=r"^log_sum_exp: axis has repeated axes"):
        log_sum_exp(np.ones((2, 2), np.float32), axis=(0, 0))


# ---------------------------------------------------------------- safe_divide


def divide_inputs(seed, shape=(4, 5)):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    b[rng.random(shape) < 0.3] = 0.0
    a[0, 0], b[0, 0] = 0.0, 0.0  # 0 / 0 always present
    return a, b


safe_divide_jit = jax.jit(safe_divide)
safe_divide_sum_grad = jax.jit(jax.grad(lambda a, b: jnp.sum(safe_divide(a, b)), (0, 1)))


@given(seed=st.integers(0, 2**32 - 1))
def test_safe_divide_forward_and_gradients_have_no_nan(seed):
    a, b = divide_inputs(seed)
    zero = b == 0
    out = safe_divide_jit(a, b)
    want = np.where(zero, 0.0, a.astype(np.float64) / np.where(zero, 1.0, b))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    grad_a, grad_b = safe_divide_sum_grad(a, b)
    assert not np.any(np.isnan(grad_a)) and not np.any(np.isnan(grad_b))
    safe_b = np.where(zero, 1.0, b.astype(np.float64))
    np.testing.assert_allclose(grad_a, np.where(zero, 0.0, 1.0 / safe_b), rtol=1e-5)
    np.testing.assert_allclose(grad_b, np.where(zero, 0.0, -a / safe_b**2), rtol=1e-5)


def test_safe_divide_gradient_matches_plain_divide_where_defined():
    a, b = divide_inputs(3)
    nonzero = b != 0
    got = jax.grad(lambda a, b: jnp.sum(safe_divide(a, b) ** 2), (0, 1))(a, b)
    b_filled = np.where(nonzero, b, 1.0)
    want = jax.grad(lambda a, b: jnp.sum(jnp.where(nonzero, a / b, 0.0) ** 2), (0, 1))(a, b_filled)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g)[nonzero], np.asarray(w)[nonzero], rtol=1e-5)
        assert np.all(np.asarray(g)[~nonzero] == 0)


def test_safe_divide_broadcasts():
    a = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    b = np.array([2.0, 0.0, -1.0, 0.5], np.float32)
    np.testing.assert_allclose(safe_divide(a, b), np.where(b == 0, 0.0, a / np.where(b == 0, 1, b)))


# ---------------------------------------------------------------- identity_dtype_convert


@pytest.mark.parametrize(
    ("x_dtype", "grad_dtype"),
    [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float16)],
)
def test_identity_dtype_convert_forward_is_identity_and_grad_has_requested_dtype(
    x_dtype, grad_dtype
):
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((3, 4)), x_dtype)
    weights = jnp.asarray(rng.standard_normal((3, 4)), x_dtype)
    out = identity_dtype_convert(grad_dtype)(x)
    assert out.dtype == x_dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x, np.float32))

    def loss(x):
        return jnp.sum(weights * identity_dtype_convert(grad_dtype)(x))

    grad = jax.jit(jax.grad(loss))(x)
    assert grad.dtype == grad_dtype
    # The gradient of sum(w * x) is w, rounded to the requested dtype.
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(weights.astype(grad_dtype)))


def test_identity_dtype_convert_bad_input():
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        identity_dtype_convert(jnp.int32)
    with pytest.raises(TypeError, match="x must be floating"):
        identity_dtype_convert(jnp.float32)(jnp.arange(3))


# ---------------------------------------------------------------- chunk / unchunk


@given(
    length=st.integers(0, 13),
    chunk_size=st.integers(1, 5),
    axis=st.sampled_from([0, 1, -1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_chunk_array_layout_padding_and_round_trip(length, chunk_size, axis, seed):
    shape = [2, 3]
    shape[axis] = length
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    chunked = np.asarray(chunk_array(x, chunk_size, axis, fill_value=-9.0))
    num_chunks = -(-length // chunk_size)
    a = axis % 2
    want_shape = (*x.shape[:a], num_chunks, chunk_size, *x.shape[a + 1 :])
    assert chunked.shape == want_shape
    moved = np.moveaxis(chunked, (a, a + 1), (0, 1)).reshape(num_chunks * chunk_size, shape[1 - a])
    np.testing.assert_array_equal(
        moved[:length], np.moveaxis(x, a, 0).reshape(length, shape[1 - a])
    )
    assert np.all(moved[length:] == -9.0)
    back = unchunk_array(chunked, axis, length=length)
    np.testing.assert_array_equal(back, x)
    assert unchunk_array(chunked, axis).shape[a] == num_chunks * chunk_size


def test_chunk_array_jit_matches_eager():
    x = np.random.default_rng(2).standard_normal((10, 3)).astype(np.float32)
    f = jax.jit(functools.partial(chunk_array, chunk_size=4, axis=0))
    np.testing.assert_array_equal(f(x), chunk_array(x, 4, 0))
    g = jax.jit(functools.partial(unchunk_array, axis=0, length=10))
    np.testing.assert_array_equal(g(f(x)), x)


def test_chunk_array_bad_input():
    x = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunk_array(x, 0)
    with pytest.raises(TypeError, match="chunk_size must be a Python int"):
        chunk_array(x, 2.0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        chunk_array(x, 2, axis=2)
    with pytest.raises(ValueError, match="length=9 exceeds"):
        unchunk_array(chunk_array(x, 2), 0, length=9)
    with pytest.raises(ValueError, match="rank >= 2"):
        unchunk_array(np.ones(3), 0)
