"""XLA:GPU's float32 products, emulated on a CPU: `pytest --emulate-tf32`.

On an Ampere or Hopper GPU, XLA multiplies float32 operands in TF32 (10 mantissa bits)
at its default precision: a test whose oracle or tolerance assumed exact float32 products
passes on a CPU and fails on the device (the attention oracle did, 1.4e-3 off a float64
one on an H100). With this option every float32 dot_general that XLA:CPU compiles below
`Precision.HIGHEST` reads its operands as a tensor core does (`tf32_truncated`: the 13
low mantissa bits dropped), so such a test fails here first. That is the coarser of
XLA:GPU's two paths: its cuBLAS calls take TF32 unless an operand asks for HIGHEST, its
own Triton GEMMs only where both ask for DEFAULT.
Triton kernels need no option: the interpreter always multiplies float32 operands at
their `input_precision` as the GPU does (`jax_bridge/launch/interpreter.py`).

`install()` registers the emulating lowering for the rest of the process (pytest-xdist
workers each run `pytest_configure`), before anything is compiled; `emulated()` within a
block (tests/core/test_precision.py checks the emulation with it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import mlir

_EXACT = jax.lax.Precision.HIGHEST
_installed = False


def _truncated(x: jax.Array) -> jax.Array:
    """`jax_bridge.launch.interpreter.tf32_truncated`, in XLA."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0xFFFFE000)
    return jnp.where(jnp.isfinite(x), jax.lax.bitcast_convert_type(bits, jnp.float32), x)


def takes_tf32(precision, dtypes) -> bool:
    """Whether XLA:GPU may multiply a dot of these operand dtypes at `precision` in TF32:
    float32 operands, and neither operand's precision HIGHEST (an algorithm preset that
    names its own arithmetic is left alone; `DotAlgorithmPreset.DEFAULT` names none)."""
    if any(np.dtype(d) != np.float32 for d in dtypes):
        return False
    if precision is None or precision == jax.lax.DotAlgorithmPreset.DEFAULT:
        return True
    pair = precision if isinstance(precision, tuple) else (precision,)
    return all(isinstance(p, jax.lax.Precision) and p != _EXACT for p in pair)


def _emulating_rule(original):
    truncate = mlir.lower_fun(_truncated, multiple_results=False)

    def lowering(ctx, lhs, rhs, *, precision, **params):
        if takes_tf32(precision, [aval.dtype for aval in ctx.avals_in]):
            operands = []
            for operand, aval in zip((lhs, rhs), ctx.avals_in, strict=True):
                (rounded,) = truncate(ctx.replace(avals_in=[aval], avals_out=[aval]), operand)
                operands.append(rounded)
            lhs, rhs = operands
        return original(ctx, lhs, rhs, precision=precision, **params)

    return lowering


def _cpu_rule():
    return mlir._platform_specific_lowerings["cpu"][jax.lax.dot_general_p].rule


def installed() -> bool:
    """Whether `install()` ran in this process (`--emulate-tf32`)."""
    return _installed


def install() -> None:
    """Makes XLA:CPU compile TF32-eligible float32 dots as XLA:GPU does, for the rest of
    the process (idempotent)."""
    global _installed
    if not _installed:
        mlir.register_lowering(jax.lax.dot_general_p, _emulating_rule(_cpu_rule()), platform="cpu")
        _installed = True


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """`install()` within the block only. jit's caches do not key on lowering rules, so
    they are cleared on entry and exit: nothing compiled inside is served outside."""
    original = _cpu_rule()
    jax.clear_caches()
    mlir.register_lowering(jax.lax.dot_general_p, _emulating_rule(original), platform="cpu")
    try:
        yield
    finally:
        mlir.register_lowering(jax.lax.dot_general_p, original, platform="cpu")
        jax.clear_caches()
