"""The one place that decides which implementation of an op runs.

`implementation="auto"` picks Triton on cuda/rocm, Pallas on TPU and XLA anywhere else;
an explicit choice always wins. Asking for one that cannot run says why.

The Triton implementation also runs on the CPU, through Triton's interpreter (slow, meant
for tests), so `implementation="triton"` is accepted everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax

Implementation = Literal["auto", "triton", "pallas", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "triton", "pallas", "xla")

_AUTO_BY_PLATFORM = {"cuda": "triton", "rocm": "triton", "gpu": "triton", "tpu": "pallas"}


def default_platform() -> str:
    """The platform JAX computes on by default: 'cpu', 'cuda', 'rocm' or 'tpu'."""
    return jax.default_backend()


def resolve_implementation(
    implementation: str,
    *,
    op: str,
    supported: Sequence[str],
    platform: str | None = None,
) -> str:
    """Turns `implementation` into the concrete implementation an op runs.

    Args:
      implementation: "auto", "triton", "pallas" or "xla".
      op: the op's name, for error messages.
      supported: the implementations this op has (a subset of "triton", "pallas", "xla").
      platform: the platform to decide for; defaults to JAX's default backend.

    Returns:
      One of `supported`. For "auto": the platform's native kernel when the op has one
      (Triton on cuda/rocm, Pallas on TPU), otherwise "xla".
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}."
        )
    platform = platform or default_platform()
    if implementation == "auto":
        native = _AUTO_BY_PLATFORM.get(platform)
        return native if native in supported else "xla"
    if implementation not in supported:
        raise ValueError(
            f"{op}: implementation={implementation!r} is not available for this op; "
            f"it has {tuple(supported)}."
        )
    if implementation == "pallas" and platform != "tpu":
        raise ValueError(
            f"{op}: implementation='pallas' needs a TPU, but JAX runs on {platform!r}. "
            "Use implementation='xla' (or 'auto')."
        )
    return implementation
