"""The one place that decides which implementation of an op runs.

`implementation="auto"` picks Triton on cuda/rocm, Pallas on TPU and XLA anywhere else,
among the backends an op has (an op without a Pallas backend runs XLA on a TPU); an
explicit choice always wins. Asking for one that cannot run says why. "auto" is decided
when the op is traced, for the platform JAX computes on, or for the platform of
`compiling_for_platform` (what `jax_bridge.compile_for` sets while it traces for a
target: a CPU host compiling for a TPU picks the TPU's kernels).

The Triton implementation also runs on the CPU, through Triton's interpreter, and the
Pallas one off-TPU in Pallas' interpret mode (both slow, meant for tests), so an
explicit "triton" or "pallas" is accepted everywhere.

Each op keeps a `BackendTable`: its implementations by name, each a module with the op's
small backend contract. Adding a backend is one module and one table entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

IMPLEMENTATIONS: tuple[str, ...] = ("auto", "triton", "pallas", "xla")

_AUTO_BY_PLATFORM = {"cuda": "triton", "rocm": "triton", "gpu": "triton", "tpu": "pallas"}
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# A JAX user context, hence part of jit's cache key: a function traced while compiling
# for one platform is never reused for another.
_compile_platform = jax.make_user_context(None)


@contextlib.contextmanager
def compiling_for_platform(platform: str) -> Iterator[None]:
    """Within this context ops are traced for `platform` ('cpu', 'cuda', 'rocm', 'tpu'),
    whatever the host computes on: "auto" picks that platform's kernels."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    with _compile_platform(platform):
        yield


def default_platform() -> str:
    """The platform ops are traced for: `compiling_for_platform`'s, else the one JAX
    computes on by default ('cpu', 'cuda', 'rocm' or 'tpu')."""
    return _compile_platform.value or jax.default_backend()


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
        # Names only what this op accepts: listing a backend it lacks would send the
        # caller from one error to the next.
        choices = ("auto", *(name for name in IMPLEMENTATIONS[1:] if name in supported))
        raise ValueError(f"{op}: implementation must be one of {choices}, got {implementation!r}.")
    platform = platform or default_platform()
    if implementation == "auto":
        native = _AUTO_BY_PLATFORM.get(platform)
        return native if native in supported else "xla"
    if implementation not in supported:
        raise ValueError(
            f"{op}: implementation={implementation!r} is not available for this op; "
            f"it has {tuple(supported)}."
        )
    return implementation


@dataclasses.dataclass(frozen=True, eq=False)
class BackendTable:
    """An op's implementations: {"xla": module, "triton": module, ...}.

    Every entry exports the same contract (the op's api.py documents it), so the op's
    custom_vjp rules call `table[name].forward(...)` and never branch on the name.
    """

    op: str
    backends: Mapping[str, Any]

    def __post_init__(self) -> None:
        unknown = set(self.backends) - set(IMPLEMENTATIONS[1:])
        if unknown:
            raise ValueError(f"{self.op}: unknown backends {sorted(unknown)}")
        object.__setattr__(self, "backends", types.MappingProxyType(dict(self.backends)))

    def resolve(self, implementation: str, *, interpret: bool = False) -> str:
        """The backend that runs for `implementation` (see `resolve_implementation`).

        `interpret=True` asks for the Triton kernels through Triton's interpreter: it
        selects "triton" and refuses any other explicit choice.
        """
        if interpret:
            if "triton" not in self.backends or implementation not in ("auto", "triton"):
                raise ValueError(
                    f"{self.op}: interpret=True runs the Triton kernels through Triton's "
                    f"interpreter, but implementation={implementation!r} was asked for; pass "
                    "implementation='triton' or 'auto'."
                )
            return "triton"
        return resolve_implementation(implementation, op=self.op, supported=tuple(self.backends))

    def __getitem__(self, name: str) -> Any:
        return self.backends[name]
