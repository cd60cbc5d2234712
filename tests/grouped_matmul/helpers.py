"""What every grouped matmul test shares: random operands, the float64 oracle and the
comparison with its element-wise error bound.

The oracle (`gmm_float64`, `tgmm_float64`) is a float64 loop over groups on the same
(rounded) inputs; its own rounding is negligible. It returns each element's value and its
magnitude: the same loop on |inputs| (plus |existing_out|), i.e. sum_k |a_ik| |b_kj|,
the sum of the absolute terms that element adds up.

Bound (`assert_close`): |actual - expected| <= units * magnitude, element by element, with

    float32   units = C * u * sqrt(n),            u = 2^-24, C = 4
    16-bit    that plus 4 * u16,                  u16 = 2^-11 (float16), 2^-8 (bfloat16)

n is the number of terms an element sums: the reduction length, plus one for
existing_out. Why this holds on any machine and BLAS build: float32 products of float32
inputs are rounded at most once (u |a b|), and a sum of n terms in any order (sequential,
pairwise, blocked, SIMD lanes, FMA or not) commits at most n - 1 roundings of partial
sums, each partial sum <= magnitude: the worst case is n u * magnitude, and it is only
reached when every rounding has the same sign. Roundings behave as independent errors of
either sign, so (Higham and Mary's probabilistic bound) the total exceeds
lambda * sqrt(n) u * magnitude only with probability about 2 exp(-lambda^2 / 2), whatever
the summation order, and that bound is itself loose: it replaces every partial sum by the
magnitude, which sums of normal terms stay well below. The worst element of a test is
one whose terms share a sign (|value| near its magnitude): ~4 u * magnitude at n ~ 25
between two float32 paths. C = 4: lambda = 2 for each of two float32 paths (ours and a
float32 reference; against the float64 loop only ours counts); for n <= 4 it is above
the worst case of two paths too. Measured (tests/margins.py): worst margin 0.35 with this
machine's OpenBLAS settings, without them and with XLA limited to AVX2.
A 16-bit result adds its own rounding (u16 |e| <= u16 * magnitude) and, for gradients,
the cotangent's rounding to the input dtype (another u16 * magnitude); four units cover
both. An element whose magnitude is 0 (a row of no group, an empty group) must be exact.
Comparisons against a float32 reference pass the float64 loop's product as `oracle`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tests import margins

U32 = 2.0**-24  # float32 unit roundoff
C = 4  # see the module docstring: lambda = 2 for each of two float32 paths
# The 16-bit part: four units of the result dtype's roundoff (result and cotangent).
SIXTEEN_BIT_UNITS = {jnp.dtype(jnp.float16): 4 * 2.0**-11, jnp.dtype(jnp.bfloat16): 4 * 2.0**-8}


def bound_units(dtype, terms: int) -> float:
    """Units of `magnitude` a result of `dtype` summing `terms` terms may be off by (module
    docstring)."""
    return C * U32 * np.sqrt(max(terms, 1)) + SIXTEEN_BIT_UNITS.get(jnp.dtype(dtype), 0.0)


@dataclasses.dataclass(frozen=True)
class Float64Product:
    """The float64 loop's result: `value`, the element-wise `magnitude` (the loop on
    absolute inputs) and `terms`, the most terms an element sums. Indexing and `.T`
    apply to both arrays; numpy sees `value`."""

    value: np.ndarray
    magnitude: np.ndarray
    terms: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def T(self) -> Float64Product:
        return Float64Product(self.value.T, self.magnitude.T, self.terms)

    def __getitem__(self, index) -> Float64Product:
        return Float64Product(self.value[index], self.magnitude[index], self.terms)

    @classmethod
    def exact(cls, values) -> Float64Product:
        """An array the op returns unchanged (one term: only its rounding, none here)."""
        value = _f64(values)
        return cls(value, np.abs(value), 1)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.value, dtype)


def bounds(sizes) -> tuple[np.ndarray, np.ndarray]:
    """(first row, one past the last row) of every group."""
    ends = np.cumsum(np.asarray(sizes, np.int64))
    return ends - np.asarray(sizes, np.int64), ends


def _f64(x) -> np.ndarray:
    """float64 copy of exact values, widened by numpy (ml_dtypes for bfloat16): exact, and
    no XLA program to compile."""
    return np.asarray(x).astype(np.float64)


def gmm_float64(lhs, rhs, sizes, **loop_args) -> Float64Product:
    """`_gmm_loop` on the inputs and on their absolute values (the magnitude)."""
    absolute = {
        k: np.abs(_f64(v)) if k == "existing" and v is not None else v for k, v in loop_args.items()
    }
    terms = np.shape(lhs)[1] + (loop_args.get("existing") is not None)
    return Float64Product(
        _gmm_loop(_f64(lhs), _f64(rhs), sizes, **loop_args),
        _gmm_loop(np.abs(_f64(lhs)), np.abs(_f64(rhs)), sizes, **absolute),
        terms,
    )


def tgmm_float64(lhs, rhs, sizes, **loop_args) -> Float64Product:
    """`_tgmm_loop` on the inputs and on their absolute values (the magnitude)."""
    absolute = {
        k: np.abs(_f64(v)) if k == "existing" and v is not None else v for k, v in loop_args.items()
    }
    # Group g sums its rows: at most the largest group size (the m of lhs [k, m] bounds it).
    terms = int(np.max(np.asarray(sizes), initial=0)) + (loop_args.get("existing") is not None)
    return Float64Product(
        _tgmm_loop(_f64(lhs), _f64(rhs), sizes, **loop_args),
        _tgmm_loop(np.abs(_f64(lhs)), np.abs(_f64(rhs)), sizes, **absolute),
        terms,
    )


def _gmm_loop(lhs, rhs, sizes, *, offset=0, existing=None, transpose_rhs=False):
    """float64 loop: out[rows of g] (+)= lhs[rows of g] @ rhs[g - offset]."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    if existing is not None:
        out += np.asarray(existing, np.float64)
    starts, ends = bounds(sizes)
    for local in range(rhs.shape[0]):
        s, e = starts[offset + local], ends[offset + local]
        out[s:e] += lhs[s:e] @ rhs[local]
    return out


def _tgmm_loop(lhs, rhs, sizes, *, num_groups, offset=0, existing=None):
    """float64 loop: out[g] (+)= lhs[:, rows of g + offset] @ rhs[rows of g + offset]."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    out = np.zeros((num_groups, lhs.shape[0], rhs.shape[1]))
    if existing is not None:
        out += np.asarray(existing, np.float64)
    starts, ends = bounds(sizes)
    for local in range(num_groups):
        s, e = starts[offset + local], ends[offset + local]
        out[local] += lhs[:, s:e] @ rhs[s:e]
    return out


def normal(rng, shape, dtype=np.float32) -> jax.Array:
    """Standard-normal values, rounded to `dtype`."""
    # Rounded by numpy (ml_dtypes for bfloat16: to nearest even, as XLA's convert), so
    # that drawing inputs compiles nothing (`jnp.asarray` compiles a copy per shape).
    return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(dtype))


def assert_close(actual, expected, dtype=None, name: str = "", oracle=None) -> None:
    """|a - e| <= bound_units(dtype, n) * magnitude element-wise (module docstring), `actual`
    finite. `expected` is a `Float64Product`, or an array (a float32 reference) with the
    float64 loop's product as `oracle` for its magnitude and n. dtype defaults to
    actual's. A failure names the worst element."""
    oracle = expected if oracle is None else oracle
    if not isinstance(oracle, Float64Product):
        raise TypeError(f"{name}: pass oracle= (the float64 loop's result) with a plain array")
    units = bound_units(dtype if dtype is not None else actual.dtype, oracle.terms)
    actual, expected = _f64(actual), _f64(expected)
    allowed = units * np.broadcast_to(oracle.magnitude, expected.shape)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    bad = ~np.isfinite(actual)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} non-finite element(s), first at "
        f"{tuple(int(i) for i in np.argwhere(bad)[0])} (never written?)"
    )
    if actual.size == 0:
        return
    error = np.abs(actual - expected)
    # A zero magnitude means every term is zero: the element must be exact (ratio 0 or inf).
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(error == 0, 0.0, error / allowed)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    margins.record(name, ratio[worst])
    assert ratio[worst] <= 1.0, (
        f"{name}: worst element {tuple(int(i) for i in worst)}: got {actual[worst]!r}, "
        f"expected {expected[worst]!r}, error {ratio[worst]:.3g}x the allowed "
        f"{units:.3g} * magnitude {allowed[worst] / units:.4g}; "
        f"{int((ratio > 1).sum())} of {ratio.size} off"
    )
