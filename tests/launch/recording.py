"""What the launch layer hands on for a GPU, seen without one: jaxlib's `TritonKernel`
recorded while a test lowers for cuda (each kernel's name, warps, shared memory, PTX, ...,
and the global scratch where there is one), and jax_triton's launches run through
Triton's interpreter as a GPU runs them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_bridge.launch.interpreter import run_interpreted


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


class InterpretedLikeAGpu:
    """Stands for jax_triton 0.3's `triton_call`: runs the launch it is handed through
    Triton's interpreter with 0.3's buffers on a GPU: an aliased output is its input's
    buffer (array operands counted), a zeroed one starts at 0, any other as old memory (a
    value no kernel here writes, and unlike the poison: False for bool)."""

    @staticmethod
    def old_memory(dtype) -> int | bool:
        return False if np.dtype(dtype) == np.bool_ else 7

    def __init__(self):
        self.kernels = []  # each launch's kernel, in order
        self.tiles = {}  # kernel name -> (BLOCK_M, BLOCK_N, num_warps) of its last launch

    def __call__(self, *args, kernel, out_shape, input_output_aliases, zeroed_outputs,
                 grid, num_warps, num_stages, compute_capability, name, **constexprs):  # fmt: skip
        self.kernels.append(kernel)
        tile = (constexprs.get("BLOCK_M"), constexprs.get("BLOCK_N"), num_warps)
        self.tiles[kernel.__name__] = tile
        is_array = [isinstance(a, jax.Array) for a in args]
        args = [a.item() if isinstance(a, np.generic) else a for a in args]  # np.float32

        def run(*arrays):
            given = iter(np.array(a) for a in arrays)
            host = [next(given) if array else a for a, array in zip(args, is_array, strict=True)]
            outputs = [np.full(s.shape, self.old_memory(s.dtype), s.dtype) for s in out_shape]
            arrays_at = [i for i, a in enumerate(host) if isinstance(a, np.ndarray)]
            for array_index, o in input_output_aliases.items():
                outputs[o][...] = host[arrays_at[array_index]]
                host[arrays_at[array_index]] = outputs[o]  # one buffer, as on a GPU
            for o in zeroed_outputs:
                outputs[o][...] = 0
            run_interpreted(kernel, grid, host, outputs, constexprs)
            return tuple(outputs)

        arrays = [a for a, array in zip(args, is_array, strict=True) if array]
        return jax.pure_callback(run, tuple(out_shape), *arrays)


def interpret_gpu_launches(monkeypatch: pytest.MonkeyPatch) -> InterpretedLikeAGpu:
    """jax_triton 0.3's launches run by `InterpretedLikeAGpu` for as long as the test runs
    (a cuda lowering, `jax_bridge.cuda_lowering`, then computes on this host)."""
    import jax_triton

    gpu = InterpretedLikeAGpu()
    monkeypatch.setattr(jax_triton, "triton_call", gpu)
    return gpu
