"""What every grouped matmul test shares: random operands, the float64 oracle and the
comparison with its one tolerance table.

Tolerances (`TOLERANCES`, by the result's dtype, relative to the largest magnitude of the
expected array): float32 2e-5 (exact float32 products, Precision.HIGHEST by default; only
the order of float32 sums differs over reductions of up to ~100 terms), float16 2e-3 and
bfloat16 1.6e-2 (four units of roundoff of the dtype: 16-bit products are exact in
float32, so only the result's rounding, and for gradients the cotangent's rounding to the
input dtype, are 16-bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests import margins

TOLERANCES = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1.6e-2,
}


def bounds(sizes) -> tuple[np.ndarray, np.ndarray]:
    """(first row, one past the last row) of every group."""
    ends = np.cumsum(np.asarray(sizes, np.int64))
    return ends - np.asarray(sizes, np.int64), ends


def gmm_float64(lhs, rhs, sizes, *, offset=0, existing=None, transpose_rhs=False):
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


def tgmm_float64(lhs, rhs, sizes, *, num_groups, offset=0, existing=None):
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
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def assert_close(actual, expected, dtype=None, name: str = "") -> None:
    """|a - e| <= tol * (|e| + max|e|) with tol = TOLERANCES[dtype] (default: actual's
    dtype); `actual` must be finite. A failure names the worst element."""
    tol = TOLERANCES[jnp.dtype(dtype if dtype is not None else actual.dtype)]
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    bad = ~np.isfinite(actual)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} non-finite element(s), first at "
        f"{tuple(int(i) for i in np.argwhere(bad)[0])} (never written?)"
    )
    if actual.size == 0:
        return
    scale = float(np.max(np.abs(expected))) or 1.0
    ratio = np.abs(actual - expected) / (tol * (np.abs(expected) + scale))
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    margins.record(name, ratio[worst])
    assert ratio[worst] <= 1.0, (
        f"{name}: worst element {tuple(int(i) for i in worst)}: got {actual[worst]!r}, "
        f"expected {expected[worst]!r}, error {ratio[worst]:.3g}x the allowed "
        f"{tol:g} * (|expected| + {scale:.4g}); {int((ratio > 1).sum())} of {ratio.size} off"
    )
