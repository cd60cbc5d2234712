"""The public grouped matmul API: argument checking and options.

Numerics per backend are `test_conformance.py`'s business. Here: bad arguments raise
naming the argument; `interpret=True` selects the Triton backend (and rejects any other
explicit implementation); "auto" runs XLA on a CPU; `precision=` accepts jax's forms, its
default is exact float32 (bit for bit `"highest"` on the interpreter, and within a few
float32 roundoffs of a float64 numpy loop) and `Precision.DEFAULT` runs on the XLA path;
a callable tiling is asked once per launch with that launch's sizes; traced group sizes
are checked by checkify.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from jax_bridge import (
    GroupedMatmulConfig,
    GroupedMatmulConfigs,
    grouped_matmul,
    transposed_grouped_matmul,
)
from jax_bridge.core.backend import compiling_for_platform
from jax_bridge.grouped_matmul import triton as triton_backend
from jax_bridge.grouped_matmul import xla as xla_backend
from tests.grouped_matmul.helpers import assert_close, gmm_float64, normal, tgmm_float64
from triton_kernels.grouped_matmul.config import check_tiling


def _problem(seed=0, m=48, k=24, n=16):
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray([13, 0, 1, 30], jnp.int32)
    return normal(rng, (m, k)), normal(rng, (4, k, n)), sizes


def _count_calls(monkeypatch, module, name):
    """Counts calls of `module.name` (a backend's gmm or tgmm) while the test runs."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("implementation", ["auto", "triton"])
def test_interpret_selects_the_triton_kernels(monkeypatch, implementation):
    lhs, rhs, sizes = _problem(1)
    triton_calls = _count_calls(monkeypatch, triton_backend, "gmm")
    xla_calls = _count_calls(monkeypatch, xla_backend, "gmm")
    out = grouped_matmul(
        lhs, rhs, sizes, tiling=(16, 16, 16), interpret=True, implementation=implementation
    )
    assert triton_calls == ["gmm"] and not xla_calls
    # Equal on a CPU (both interpreted); on a GPU the compiled kernel sums k in another
    # order: there each against the float64 loop.
    compiled = grouped_matmul(lhs, rhs, sizes, tiling=(16, 16, 16), implementation="triton")
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(out), np.asarray(compiled))
    for result in (out, compiled):
        assert_close(result, gmm_float64(lhs, rhs, sizes))


def test_auto_runs_xla_on_cpu(monkeypatch):
    lhs, rhs, sizes = _problem(2)
    xla_calls = _count_calls(monkeypatch, xla_backend, "gmm")
    tgmm_calls = _count_calls(monkeypatch, xla_backend, "tgmm")
    with compiling_for_platform("cpu"):  # "auto" as on a CPU, whatever this host is
        grouped_matmul(lhs, rhs, sizes)
        transposed_grouped_matmul(lhs.T, lhs, sizes)
    assert xla_calls == ["gmm"] and tgmm_calls == ["tgmm"]


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_default_precision_is_exact_float32(implementation):
    """float32: the default equals precision="highest" bit for bit (Triton: on the
    interpreter) and the float64 loop to a few float32 roundoffs, for gmm and tgmm."""
    lhs, rhs, sizes = _problem(3)
    gmm = functools.partial(grouped_matmul, tiling=(16, 16, 16), implementation=implementation)
    default = np.asarray(gmm(lhs, rhs, sizes))
    np.testing.assert_array_equal(default, np.asarray(gmm(lhs, rhs, sizes, precision="highest")))
    assert_close(default, gmm_float64(lhs, rhs, sizes), name="gmm vs the float64 loop")
    tgmm = functools.partial(
        transposed_grouped_matmul, tiling=(16, 16, 16), implementation=implementation
    )
    default = np.asarray(tgmm(lhs.T, lhs, sizes))
    np.testing.assert_array_equal(default, np.asarray(tgmm(lhs.T, lhs, sizes, precision="highest")))
    tgmm64 = tgmm_float64(lhs.T, lhs, sizes, num_groups=4)
    assert_close(default, tgmm64, name="tgmm vs the float64 loop")


@pytest.mark.parametrize(
    "precision",
    [
        jax.lax.Precision.HIGHEST,
        "float32",
        "HIGHEST",
        ("highest", "default"),
        jax.lax.Precision.DEFAULT,
        jax.lax.Precision.HIGH,
        "tensorfloat32",
        "bfloat16",
    ],
)
def test_precision_forms_run_on_the_xla_path(precision):
    """Every accepted form runs; on a CPU even the TF32 ones agree to TF32 accuracy."""
    lhs, rhs, sizes = _problem(4)
    out = grouped_matmul(lhs, rhs, sizes, precision=precision, implementation="xla")
    assert_close(out, gmm_float64(lhs, rhs, sizes), jnp.bfloat16)


@pytest.mark.parametrize("op", [grouped_matmul, transposed_grouped_matmul])
@pytest.mark.parametrize("precision", ["bf16", "tf32", 3, ("highest",)])
def test_bad_precision_raises_naming_the_op(op, precision):
    lhs, rhs, sizes = _problem(5)
    args = (lhs, rhs, sizes) if op is grouped_matmul else (lhs.T, lhs, sizes)
    with pytest.raises(ValueError, match=f"{op.__name__}: precision"):
        op(*args, precision=precision)


def test_callable_tiling_is_asked_with_each_launch_sizes():
    """The op asks (m, k, n) once to check the answer, on every backend; the tgmm launch
    asks again for its own (the same here); the XLA backend uses no tiling."""
    lhs, _, sizes = _problem(6)
    calls = []

    def tiling(*sizes_):
        calls.append(sizes_)
        return (16, 16, 16)

    out = transposed_grouped_matmul(lhs.T, lhs, sizes, tiling=tiling, implementation="triton")
    assert calls == [(48, 24, 24)] * 2
    assert_close(out, tgmm_float64(lhs.T, lhs, sizes, num_groups=4))
    transposed_grouped_matmul(lhs.T, lhs, sizes, tiling=tiling, implementation="xla")
    assert calls == [(48, 24, 24)] * 3


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_callable_tiling_is_not_asked_where_no_kernel_would_ask_it(implementation):
    """No rows (an expert-parallel shard without tokens), or a config that gives every
    kernel its launch (it replaces the tiling): the op asks the callable nothing, as its
    kernels would not, so an answer that would be refused there cannot fail the call."""
    lhs, rhs, sizes = _problem(7)

    def tiling(m, k, n):  # a tile from the sizes: invalid for m = 0
        return (m, 16, 16)

    empty = grouped_matmul(lhs[:0], rhs, jnp.zeros(4, jnp.int32), tiling=tiling,
                           implementation=implementation)  # fmt: skip
    assert empty.shape == (0, rhs.shape[2])
    config = GroupedMatmulConfig(16, 16, 16)
    out = grouped_matmul(lhs, rhs, sizes, tiling=tiling, config=config,
                         implementation=implementation)  # fmt: skip
    assert_close(out, gmm_float64(lhs, rhs, sizes))
    # One kernel left to the tiling: asked, and its answer refused.
    half = GroupedMatmulConfigs(gmm=config)
    with pytest.raises(ValueError, match=r"^grouped_matmul: tiling\(48, 24, 16\) returned"):
        grouped_matmul(lhs, rhs, sizes, tiling=tiling, config=half, implementation=implementation)


def test_one_config_with_tma_reaches_tgmm_gradients_gmm_launches(monkeypatch):
    """One config for every kernel keeps `tma` in transposed_grouped_matmul: its forward
    reads its lhs [k, m] by pointers, its gradient's gmm launches take the descriptors."""
    lhs, _, sizes = _problem(8, k=32)
    config = GroupedMatmulConfig(16, 16, 16, tma=True)
    launches = []  # what each launch that asks decides
    decide = triton_backend._tma

    def recorded(*args, **kwargs):
        launches.append(decide(*args, **kwargs))
        return launches[-1]

    monkeypatch.setattr(triton_backend, "_tma", recorded)

    def tgmm(a, b):
        return transposed_grouped_matmul(a, b, sizes, config=config, implementation="triton")

    assert_close(tgmm(lhs.T, lhs), tgmm_float64(lhs.T, lhs, sizes, num_groups=4))
    assert launches == []  # the forward's lhs [k, m]: by pointers, never asked
    jax.make_jaxpr(jax.grad(lambda a, b: tgmm(a, b).sum(), (0, 1)))(lhs.T, lhs)
    assert launches == [True, True]  # the gradient's two gmm launches


def test_check_tiling_accepts_lists_and_returns_a_tuple():
    assert check_tiling([16, 32, 64]) == (16, 32, 64)


def test_int64_group_sizes_that_fit_are_accepted():
    lhs, rhs, sizes = _problem(8)
    wide = np.asarray(sizes, np.int64)
    np.testing.assert_array_equal(
        np.asarray(grouped_matmul(lhs, rhs, wide, implementation="xla")),
        np.asarray(grouped_matmul(lhs, rhs, sizes, implementation="xla")),
    )


def test_config_must_be_a_grouped_matmul_config():
    lhs, rhs, sizes = _problem(7)
    with pytest.raises(TypeError, match="grouped_matmul: config must be a GroupedMatmulConfig"):
        grouped_matmul(lhs, rhs, sizes, config=(16, 16, 16))
    assert GroupedMatmulConfig(16, 16, 16).tiling == (16, 16, 16)


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
    "int64_group_sizes_overflow": (
        dict(group_sizes=np.asarray([1, 2, 2**40], np.int64)),
        ValueError,
        "group_sizes holds values that do not fit int32",
    ),
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
        r"^grouped_matmul: tiling\(32, 16, 8\) returned \(32, 16, 8\): tiling entries",
    ),
    "callable_tiling_xla": (  # refused alike, though XLA would not use it
        dict(tiling=lambda m, k, n: (12, 16, 16), implementation="xla"),
        ValueError,
        r"^grouped_matmul: tiling\(32, 16, 8\) returned \(12, 16, 16\): tiling entries",
    ),
    "preferred_int": (dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type"),
    "implementation": (dict(implementation="cuda"), ValueError, "implementation"),
    "pallas": (dict(implementation="pallas"), ValueError, "pallas"),
    "interpret_xla": (dict(interpret=True, implementation="xla"), ValueError, "interpret"),
    "precision": (dict(precision="bf16"), ValueError, "precision"),
    # A string is true: taken for its truthiness, "no" would transpose.
    "transpose_rhs_str": (dict(transpose_rhs="no"), TypeError, "transpose_rhs must be a bool"),
    "interpret_str": (dict(interpret="no"), TypeError, "grouped_matmul: interpret must be a bool"),
}


@pytest.mark.parametrize("overrides, error, match", GMM_ERRORS.values(), ids=GMM_ERRORS.keys())
def test_gmm_rejects_bad_arguments(overrides, error, match):
    with pytest.raises(error, match=match):
        grouped_matmul(**_gmm_args(**overrides))


TGMM_ERRORS = {
    "m_mismatch": (dict(rhs=jnp.zeros((30, 8))), ValueError, "rhs"),
    "offset_without_num_groups": (dict(group_offset=1), ValueError, "num_groups"),
    "num_groups_float": (dict(group_offset=0, num_groups=2.0), TypeError, "num_groups must be"),
    "num_groups_zero": (dict(group_offset=0, num_groups=0), ValueError, "num_groups must be >= 1"),
    "num_groups_too_many": (
        dict(group_offset=0, num_groups=4),
        ValueError,
        r"group_sizes has 3 groups, fewer than the 4 groups of the result \(num_groups\)",
    ),
    # tgmm's rhs [m, n] holds no groups: the message names what does
    "num_groups_without_offset": (
        dict(num_groups=2),
        ValueError,
        r"one entry per group \(2\), got 3 \(pass group_offset when the result \(num_groups\)",
    ),
    "existing_shape": (dict(existing_out=jnp.zeros((2, 16, 8))), ValueError, "existing_out"),
    "sizes_sum_past_m": (
        dict(group_sizes=jnp.asarray([30, 3, 0], jnp.int32)),
        ValueError,
        r"transposed_grouped_matmul: group_sizes must sum to at most 32, the columns of lhs",
    ),
    "no_groups": (
        dict(group_sizes=jnp.zeros((0,), jnp.int32)),
        ValueError,
        r"group_sizes must hold at least one group .*got shape \(0,\)",
    ),
    "interpret_int": (dict(interpret=1), TypeError, "transposed_grouped_matmul: interpret must be"),
    # The backend table's check, shared with grouped_matmul, names this op, once.
    "pallas": (
        dict(implementation="pallas"),
        ValueError,
        r"^transposed_grouped_matmul: implementation='pallas' is not available",
    ),
    "callable_tiling": (
        dict(tiling=lambda m, k, n: (12, 16, 16)),
        ValueError,
        r"^transposed_grouped_matmul: tiling\(32, 16, 8\) returned \(12, 16, 16\)",
    ),
    # Its descriptors need a token-major lhs: tgmm's own entry would reach no launch.
    "tgmm_tma": (
        dict(config=GroupedMatmulConfigs(tgmm=GroupedMatmulConfig(16, 16, 16, tma=True))),
        ValueError,
        r"^transposed_grouped_matmul: config.tgmm tma=True is for tgmm over a token-major",
    ),
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
    # Summed in int32 these would wrap around to 3.
    error, _ = f(jnp.asarray([2**31 - 1, 2**31 - 1, 5], jnp.int32))
    assert "sum to at most 32" in str(error.get())
    error, _ = f(jnp.asarray([10, 20, 2], jnp.int32))
    assert error.get() is None
