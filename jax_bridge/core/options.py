"""`OpOptions`: the static half of an op call, one pattern for every op.

An op validates its arguments once, then packs everything that is not an array into a
frozen (hashable) dataclass derived from `OpOptions`. That object is the custom_vjp's
non-differentiable argument and the static argument of jitted backend functions: equal
options share one trace, and the backward rule sees exactly what the forward saw.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jax_bridge.core.precision import DEFAULT_PRECISION


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpOptions:
    """Fields every op shares; ops subclass it with their own (all keyword-only).

    Attributes:
      implementation: the resolved backend name ("xla", "triton", ...), a key of the
        op's `BackendTable`.
      precision: float32 matmul precision (see `jax_bridge.core.precision`).
      config: the Triton kernels' launch configuration, or None for the defaults.
      interpret: run the Triton kernels through Triton's interpreter even on a GPU.
    """

    implementation: str
    precision: jax.lax.Precision = DEFAULT_PRECISION
    config: Any = None
    interpret: bool = False
