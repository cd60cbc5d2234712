"""Shared argument checks: int32 conversion of any integer dtype, and the debug switch
that makes checks on traced values raise under plain `jax.jit`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_bridge
from jax_bridge import varlen_attention
from jax_bridge.core.validation import as_int32, host_value, naming_op, require


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int16, np.int64])
def test_as_int32_checks_the_int32_range_in_any_integer_dtype(dtype):
    """Traced: no false error for values that fit (unsigned ones used to be compared with
    a wrapped -2**31 and all fail); values past int32, above or below, are reported."""
    info = np.iinfo(dtype)
    fits = np.array([0, 7, min(info.max, 2**31 - 1)], dtype)
    convert = jax.jit(checkify.checkify(lambda x: as_int32(x, "x"), errors=checkify.user_checks))
    with jax.enable_x64(True):  # 64-bit dtypes stay 64-bit
        err, out = convert(fits)
        assert err.get() is None and out.dtype == jnp.int32
        np.testing.assert_array_equal(out, fits.astype(np.int64))
        outside = [v for v in (info.max, info.min) if not -(2**31) <= v < 2**31]
        for value in outside:
            err, _ = convert(np.array([0, value], dtype))
            assert "x holds values that do not fit int32" in str(err.get()), value


def test_debug_checks_raise_under_plain_jit():
    """Plain jit drops the traced checks (documented); within `jax_bridge.debug_checks()`
    the same bad cu_seqlens make the call fail with the check's message, good ones give
    the unchecked result."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    good, bad = jnp.array([0, 3, 8], jnp.int32), jnp.array([0, 6, 3], jnp.int32)
    run = lambda cu: varlen_attention(q, q, q, cu, cu, implementation="xla")
    expected = run(good)
    jax.jit(run)(bad).block_until_ready()  # unchecked: no error
    with jax_bridge.debug_checks():
        np.testing.assert_array_equal(jax.jit(run)(good), expected)
        with pytest.raises(
            jax.errors.JaxRuntimeError, match=r"cu_seqlens_[qk] must be non-decreasing"
        ):
            jax.jit(run)(bad).block_until_ready()


def test_traced_checks_name_the_op_as_concrete_ones_do():
    """A check on a traced value fails after the op returned, outside `naming_op`: its
    message still begins with the op's name (and the ops around it, outermost first),
    under checkify and under `debug_checks` alike, and a message that names it already
    is not named twice."""
    lhs, rhs = jnp.ones((40, 8)), jnp.ones((3, 8, 5))
    sizes = np.array([30, 0, 25], np.int32)
    gmm = jax.jit(lambda g: jax_bridge.grouped_matmul(lhs, rhs, g, implementation="xla"))
    error, _ = checkify.checkify(gmm)(sizes)
    assert str(error.get()).startswith("grouped_matmul: group_sizes must sum to at most 40")
    with (
        jax_bridge.debug_checks(),
        pytest.raises(
            jax.errors.JaxRuntimeError, match=r"ValueError: grouped_matmul: group_sizes must sum"
        ),
    ):
        gmm(sizes).block_until_ready()

    def nested(predicate):
        with naming_op("outer"), naming_op("inner"), naming_op("inner"):
            require(predicate, "x must hold")
        return predicate

    error, _ = checkify.checkify(jax.jit(nested))(jnp.asarray(False))
    assert str(error.get()).startswith("outer: inner: x must hold")
    with naming_op("outer"), pytest.raises(ValueError, match=r"^outer: inner: x must hold"):
        nested(False)


def test_naming_op_renames_the_op_a_public_op_is_built_on():
    with pytest.raises(ValueError, match=r"^outer: x must hold$"), naming_op("outer", ("inner",)):
        raise ValueError("inner: x must hold")
    with pytest.raises(TypeError, match=r"^outer: other: y$"), naming_op("outer", ("inner",)):
        raise TypeError("other: y")


def test_naming_op_leaves_other_errors_as_they_are_and_restores_its_stack():
    """JAX's own TypeErrors (their constructors take no message) pass through unchanged,
    with a note naming the op, other errors untouched; the ops named are back to none
    after an error."""

    def python_branch(x):
        with naming_op("some_op"):
            return x if x.sum() > 0 else -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        jax.jit(python_branch)(jnp.ones(3))
    assert "(raised within some_op)" in info.value.__notes__
    with pytest.raises(KeyError) as info, naming_op("some_op"):
        raise KeyError("k")
    assert not hasattr(info.value, "__notes__")
    error, _ = checkify.checkify(jax.jit(lambda p: require(p, "x must hold") or p))(
        jnp.asarray(False)
    )
    assert str(error.get()).startswith("x must hold")


def test_a_jitted_check_names_each_op_that_traces_it():
    """The ops named are part of jit's cache key: a jitted helper traced under one op is
    traced again under another, each failure naming its own."""

    @jax.jit
    def positive(x):
        require(x > 0, "x must be positive")
        return x

    for op in ("op_a", "op_b"):

        def call(x, op=op):
            with naming_op(op):
                return positive(x)

        error, _ = checkify.checkify(call)(jnp.asarray(-1))
        assert str(error.get()).startswith(f"{op}: x must be positive")


def test_host_value_reads_concrete_inputs_even_under_jit_and_nothing_traced():
    """A NumPy array, a Python list or scalar, or a device array: its values on the host,
    inside a jitted function too (a closed-over constant); None where any part of it is
    traced (an argument of the jitted function, or inside a list)."""
    values = np.arange(3, dtype=np.int32)
    on_device = jnp.asarray(values)

    def inside(traced):
        for x in (values, values.tolist(), 7, on_device):
            np.testing.assert_array_equal(host_value(x), np.asarray(x))
        assert host_value(traced) is None and host_value([1, traced]) is None
        return traced

    jax.jit(inside)(jnp.int32(2))
