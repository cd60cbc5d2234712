"""jaxlib's `TritonKernel` recorded while a test lowers for cuda: what the launch layer
hands jaxlib for each kernel (its name, warps, shared memory, PTX, ..., and the global
scratch where there is one)."""

from __future__ import annotations

import pytest


class RecordedKernels:
    """Stands for jaxlib's `TritonKernel`: records each call's arguments and builds the
    real kernel object from the first seven (what every jaxlib takes)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.real(*args[:7])

    def of(self, name: str) -> list[tuple]:
        return [call for call in self.calls if call[0] == name]


def record_triton_kernels(monkeypatch: pytest.MonkeyPatch, jaxlib_version: tuple[int, ...]):
    """Records jaxlib's TritonKernel calls with a fresh jax_triton kernel cache (a kernel
    built by an earlier test would not be built again), the launch layer believing the
    installed jaxlib is `jaxlib_version`."""
    from jax._src.lib import gpu_triton
    from jax_triton import triton_lib

    from jax_bridge.launch import kernel_needs

    recorder = RecordedKernels(gpu_triton.TritonKernel)
    monkeypatch.setattr(gpu_triton, "TritonKernel", recorder)
    monkeypatch.setattr(triton_lib, "_COMPILED_KERNEL_CACHE", {})
    monkeypatch.setattr(kernel_needs, "jaxlib_version", lambda: jaxlib_version)
    return recorder
