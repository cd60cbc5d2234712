"""Global scratch for kernels launched through jax_triton 0.3: what device-side tensor
descriptors (`tl.make_tensor_descriptor`, Hopper's TMA) need.

Since Triton 3.3 every compiled kernel has two hidden pointer parameters after its own,
global scratch and profile scratch. A kernel that builds tensor descriptors on the device
writes them to global scratch (128 bytes a descriptor and program): its compile metadata
says how much (`global_scratch_size`, `global_scratch_align`), and the launcher must
allocate it. jaxlib's Triton call allocates it when the kernel object it is given carries
the two numbers (`gpu_triton.TritonKernel(..., global_scratch_size, global_scratch_align)`,
jaxlib > 0.11.0). jax_triton 0.4 passes them but requires Triton >= 3.7; jax_triton 0.3.1
never does, so such a kernel launched through it reads a null pointer on the device and the
call fails with CUDA_ERROR_ILLEGAL_ADDRESS.

`pass_global_scratch()` fills that gap for 0.3, once per process, with two wrappers around
jax_triton's module globals (nothing else changes, and a kernel without scratch is built
exactly as before):

* its PTX compile step gets a backend whose `make_ptx` keeps the compile's metadata, so the
  kernel's scratch is known when the compile returns (recorded per thread, with the
  kernel's name: jax_triton builds the kernel object right after compiling it);
* its jaxlib module's `TritonKernel` appends the two numbers for a kernel that needs
  scratch, or, on a jaxlib that cannot take them, raises `NotImplementedError` naming the
  kernel: an error at trace time instead of a crash on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from typing import Any

# jaxlib versions whose `TritonKernel` takes the global scratch's size and alignment.
FIRST_JAXLIB_WITH_SCRATCH = (0, 11, 1)


@dataclasses.dataclass(frozen=True)
class GlobalScratch:
    """What one program of a compiled kernel needs: `size` bytes aligned to `align`."""

    size: int
    align: int

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> GlobalScratch:
        return cls(int(metadata.get("global_scratch_size", 0) or 0),
                   int(metadata.get("global_scratch_align", 1) or 1))  # fmt: skip


_compiled = threading.local()  # .last: (kernel name, GlobalScratch) of this thread's compile


class _MetadataKeepingBackend:
    """A Triton backend whose `make_ptx` copies the compile's metadata into `seen` (by
    then the LLVM step has filled in the scratch); everything else is the backend's."""

    def __init__(self, backend: Any, seen: dict[str, Any]):
        self._backend, self._seen = backend, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def make_ptx(self, src: Any, metadata: dict[str, Any], *rest: Any) -> Any:
        self._seen.update(metadata)
        return self._backend.make_ptx(src, metadata, *rest)


def _recording_compile(compile_to_ptx: Any) -> Any:
    @functools.wraps(compile_to_ptx)
    def compile_recording_scratch(ttir: Any, backend: Any, *rest: Any) -> Any:
        metadata: dict[str, Any] = {}
        result = compile_to_ptx(ttir, _MetadataKeepingBackend(backend, metadata), *rest)
        _compiled.last = (result.name, GlobalScratch.from_metadata(metadata))
        return result

    return compile_recording_scratch


def jaxlib_version() -> tuple[int, int, int]:
    """The installed jaxlib's (major, minor, patch)."""
    import jaxlib.version

    major, minor, patch = re.match(r"(\d+)\.(\d+)\.(\d+)", jaxlib.version.__version__).groups()
    return int(major), int(minor), int(patch)


def kernel_with_scratch(lib: Any, name: str, args: tuple[Any, ...], scratch: GlobalScratch):
    """`lib.TritonKernel(name, *args)` with the global scratch appended, or a
    NotImplementedError where this jaxlib cannot take it."""
    if jaxlib_version() < FIRST_JAXLIB_WITH_SCRATCH:
        raise NotImplementedError(
            f"Triton kernel {name!r} needs {scratch.size} bytes of global scratch per "
            "program (device-side tensor descriptors, tl.make_tensor_descriptor), which "
            f"jaxlib {'.'.join(map(str, jaxlib_version()))} cannot allocate for a Triton "
            f"call: it needs jaxlib >= {'.'.join(map(str, FIRST_JAXLIB_WITH_SCRATCH))}"
        )
    return lib.TritonKernel(name, *args, scratch.size, scratch.align)


class _ScratchPassingLib:
    """jaxlib's `gpu_triton` module as jax_triton sees it, with a `TritonKernel` that
    passes the scratch of the kernel this thread compiled last."""

    def __init__(self, lib: Any):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def TritonKernel(self, name: str, *args: Any) -> Any:  # jaxlib's name for it
        compiled_name, scratch = getattr(_compiled, "last", (None, None))
        _compiled.last = (None, None)
        # jax_triton 0.3 builds a kernel from 7 arguments; any other count already says
        # what it says about scratch, and is passed on untouched.
        if compiled_name != name or scratch is None or scratch.size == 0 or len(args) != 6:
            return self._lib.TritonKernel(name, *args)
        return kernel_with_scratch(self._lib, name, args, scratch)


@functools.cache
def pass_global_scratch() -> None:
    """Makes jax_triton 0.3 pass each kernel's global scratch to jaxlib (module docstring).
    Idempotent. For jax_triton 0.3 only: its launch (`jax_triton_compat._launch_v03`) is
    the one caller; 0.4 passes the scratch itself (as 9 arguments, which
    `_ScratchPassingLib` would pass on untouched anyway)."""
    from jax_triton import triton_lib

    triton_lib.compile_ttir_to_ptx_inplace = _recording_compile(
        triton_lib.compile_ttir_to_ptx_inplace
    )
    triton_lib.triton_kernel_call_lib = _ScratchPassingLib(triton_lib.triton_kernel_call_lib)
