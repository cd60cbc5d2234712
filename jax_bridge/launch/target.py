"""The one decision of where a Triton kernel launches: a GPU (and for which compute
capability) or Triton's interpreter on the host.

`launch_target()` answers it for `triton_call` and for every op that picks a launch
configuration. Two contexts steer it:

* `cuda_lowering(cc)`: lower for cuda with kernels compiled for `cc`, from any machine
  (used by `lower_for_cuda`; no GPU needed);
* `interpreting()`: run through the interpreter even where a GPU exists (what
  `grouped_matmul(..., interpret=True)` asks for).

Both are JAX user contexts, hence part of `jax.jit`'s cache key: a function traced for
one target is never reused for another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax

from jax_bridge.core import backend

COMPUTE_CAPABILITIES = (80, 86, 89, 90, 100)

_cuda_target = jax.make_user_context(None)
_force_interpreter = jax.make_user_context(False)


@dataclasses.dataclass(frozen=True)
class LaunchTarget:
    """Where kernels launch now.

    Attributes:
      on_gpu: True for a GPU (or lowering for one); False for Triton's interpreter.
      compute_capability: e.g. 90 for sm_90; None on the interpreter, and on a GPU that
        does not report one (ROCm).
    """

    on_gpu: bool
    compute_capability: int | None = None

    @property
    def interpreter(self) -> bool:
        return not self.on_gpu


INTERPRETER = LaunchTarget(on_gpu=False)


@contextlib.contextmanager
def cuda_lowering(compute_capability: int) -> Iterator[None]:
    """Within this context kernels launch (lower) for cuda at `compute_capability`."""
    if compute_capability not in COMPUTE_CAPABILITIES:
        raise ValueError(
            f"compute_capability must be one of {COMPUTE_CAPABILITIES}, got {compute_capability!r}"
        )
    with _cuda_target(compute_capability):
        yield


@contextlib.contextmanager
def interpreting(enabled: bool = True) -> Iterator[None]:
    """Within this context kernels run through Triton's interpreter, GPU or not."""
    with _force_interpreter(bool(enabled)):
        yield


def _device_compute_capability() -> int | None:
    """The default device's compute capability as an int (9.0 -> 90); None if unknown."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if not capability:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major) * 10 + int(minor or 0)


def launch_target() -> LaunchTarget:
    """Where `triton_call` launches a kernel now (see the module docstring)."""
    if _force_interpreter.value:
        return INTERPRETER
    if _cuda_target.value is not None:
        return LaunchTarget(on_gpu=True, compute_capability=_cuda_target.value)
    if backend.default_platform() in ("cuda", "rocm", "gpu"):
        return LaunchTarget(on_gpu=True, compute_capability=_device_compute_capability())
    return INTERPRETER
