"""Lowering for cuda from a machine that has no GPU.

With jax's CUDA plugin installed (no driver needed), `jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))` runs jax_triton's real lowering: Triton compiles every
kernel to PTX (jaxlib assembles the PTX when it first launches a kernel, on the GPU: no
ptxas runs here), the launch layer checks the kernel's shared memory against the target
(`kernel_needs.check_shared_memory`), and the module carries one `triton_kernel_call`
custom call per launch. There is no device to ask for its compute capability, so it is
given here. (`python -m bench report` runs ptxas itself: registers, spills, SASS.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_bridge.launch.target import cuda_lowering


def lower_for_cuda(
    fn: Callable[..., Any],
    *args: Any,
    compute_capability: int = 90,
    static_argnames: tuple[str, ...] = (),
    **kwargs: Any,
) -> str:
    """Lowers `jax.jit(fn)(*args, **kwargs)` for cuda and returns the StableHLO text.

    `fn` is traced on this host: an op's `implementation="auto"` resolves for the host's
    backend (XLA on a CPU host), so pass `implementation="triton"` to lower its Triton
    kernels (`compile_for` traces for its target's devices instead, where "auto" picks
    them).

    Args:
      fn: the function to lower.
      *args, **kwargs: its arguments: arrays or `jax.ShapeDtypeStruct`s.
      compute_capability: the GPU generation the Triton kernels are compiled for
        (80 = A100, 90 = H100).
      static_argnames: keyword arguments of `fn` to treat as static.

    Raises:
      RuntimeError: when jax's CUDA plugin or jax_triton is missing (install the `test`
        extra: `jax[cuda12-local]` and `jax-triton`).
    """
    try:
        import jax_triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "lower_for_cuda needs jax_triton and jax's CUDA plugin: "
            "pip install 'jax[cuda12-local]' jax-triton"
        ) from e
    with cuda_lowering(compute_capability):
        traced = jax.jit(fn, static_argnames=static_argnames).trace(*args, **kwargs)
        lowered = traced.lower(lowering_platforms=("cuda",))
    return lowered.as_text()
