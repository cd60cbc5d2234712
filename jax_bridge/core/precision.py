"""The one precision rule for float32 inputs, shared by every op and backend.

Ops take `precision=` with `jax.lax.dot`'s meaning and one package-wide default:

* `Precision.HIGHEST` (the default, also what `None` means): exact float32 products,
  on every backend. An MoE block built of attention and grouped matmul therefore has one
  numerics, and both match a float32 oracle to ~1e-5.
* `Precision.HIGH`: three TF32 passes on NVIDIA GPUs (Triton's "tf32x3", ~float32
  accuracy at tensor-core speed); XLA decides for its own path.
* `Precision.DEFAULT`: one TF32 pass on NVIDIA GPUs (10-bit mantissas, ~1e-3 relative);
  XLA's fastest mode on its path.

Strings accepted by `jax.lax.Precision` ("highest", "float32", "tensorfloat32", ...)
work too. 16-bit inputs are unaffected: they always multiply exactly and accumulate in
float32. Triton's CPU interpreter multiplies float32 operands as the GPU does at each
setting (`jax_bridge/launch/interpreter.py`), so a CPU run is no more accurate than the device.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

Precision = jax.lax.Precision

DEFAULT_PRECISION = Precision.HIGHEST

# jax.lax.Precision -> tl.dot's `input_precision` for float32 operands.
_TRITON_INPUT_PRECISION = {
    Precision.DEFAULT: "tf32",
    Precision.HIGH: "tf32x3",
    Precision.HIGHEST: "ieee",
}


def canonicalize_precision(precision: Any, op: str) -> Precision:
    """`precision` as a `jax.lax.Precision`; None is the package default (HIGHEST).

    A pair (jax's per-operand form) counts as the higher of the two.

    Raises:
      ValueError naming `op` for anything `jax.lax.Precision` does not accept.
    """
    if precision is None:
        return DEFAULT_PRECISION
    if isinstance(precision, Precision):
        return precision
    if isinstance(precision, tuple | list) and len(precision) == 2:
        # jax's per-operand pair: these ops have one product, so the higher one governs.
        pair = [canonicalize_precision(p, op) for p in precision]
        return max(pair, key=lambda p: p.value)
    if isinstance(precision, str):
        try:
            return Precision(precision.lower())
        except ValueError:
            pass
    raise ValueError(
        f"{op}: precision must be None, a jax.lax.Precision, one of its names "
        f"('default', 'high', 'highest', 'bfloat16', 'tensorfloat32', 'float32') or a "
        f"pair of them, got {precision!r}."
    )


def triton_input_precision(precision: Precision, dtype: Any = "float32") -> str:
    """tl.dot's `input_precision` for operands of `dtype` under `precision`: the setting
    matters for float32 only; 16-bit operands multiply exactly ("ieee")."""
    if np.dtype(dtype) != np.float32:
        return "ieee"
    return _TRITON_INPUT_PRECISION[precision]
