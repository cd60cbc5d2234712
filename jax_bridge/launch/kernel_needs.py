"""What a compiled Triton kernel needs from its launch that jax_triton does not pass to
jaxlib: global scratch (device-side tensor descriptors, Hopper's TMA) and its own warp
count (warp-specialized loops); and what no launch can give it: more shared memory than
one CTA of its target has.

* Global scratch. Since Triton 3.3 every compiled kernel has two hidden pointer parameters
  after its own, global scratch and profile scratch. A kernel that builds tensor
  descriptors on the device writes them to global scratch (128 bytes a descriptor and
  program): its compile metadata says how much (`global_scratch_size`,
  `global_scratch_align`), and the launcher must allocate it. jaxlib's Triton call
  allocates it when the kernel object it is given carries the two numbers
  (`gpu_triton.TritonKernel(..., global_scratch_size, global_scratch_align)`, jaxlib >
  0.11.0). jax_triton 0.4 passes them but requires Triton >= 3.7; jax_triton 0.3.1 never
  does, so such a kernel launched through it reads a null pointer on the device and the
  call fails with CUDA_ERROR_ILLEGAL_ADDRESS.
* Warps. A loop written `tl.range(..., warp_specialize=True)` is split by Triton into a
  producer warpgroup (the loads) and consumer warpgroups (the MMAs): the compiled kernel
  runs more warps than it was asked for (on Hopper, 4 asked -> 12: one producer, two
  consumers; the metadata's `num_warps`, PTX `.reqntid`). jax_triton 0.3 and 0.4 hand
  jaxlib the warps they were asked for, and a launch with fewer threads than `.reqntid`
  fails on the device.
* Shared memory. jax_triton compiles to PTX only; Triton's own check of a kernel's shared
  memory against the device runs when Triton loads a kernel, which jaxlib does instead,
  so a config whose pipeline does not fit (too many stages or too large a tile) compiles
  for a compile-only target and fails only at launch on the GPU.

`pass_kernel_needs()` fills both gaps, once per process, with two wrappers around
jax_triton's module globals (a kernel that needs neither is built exactly as before):

* its PTX compile step gets a backend whose `make_ptx` keeps the compile's metadata, so
  the kernel's needs are known when the compile returns (recorded per thread, with the
  kernel's name: jax_triton builds the kernel object right after compiling it); the
  step goes through the PTX cache (`ptx_cache`), which keeps those needs with the PTX;
* its jaxlib module's `TritonKernel` gets the kernel's own warp count and (from jax_triton
  0.3, which builds the kernel from 7 arguments) its scratch, or, on a jaxlib that cannot
  take scratch, raises `NotImplementedError` naming the kernel; and it raises ValueError
  naming the kernel where the kernel's shared memory exceeds its target's limit: errors
  at trace time instead of a failed launch on the device.

A third wrapper keeps its kernel build (Python to TTIR to PTX) apart from any launch in
Triton's interpreter, which patches `triton.language` while it runs
(`interpreter.no_interpreted_launch`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from typing import Any

from jax_bridge.launch import ptx_cache
from jax_bridge.launch.interpreter import no_interpreted_launch

# jaxlib versions whose `TritonKernel` takes the global scratch's size and alignment.
FIRST_JAXLIB_WITH_SCRATCH = (0, 11, 1)


@dataclasses.dataclass(frozen=True)
class KernelNeeds:
    """What one compiled kernel needs from its launch: `scratch_size` bytes of global
    scratch a program, aligned to `scratch_align`, and `num_warps` warps a program (None
    where the metadata does not say: the warps asked for)."""

    scratch_size: int
    scratch_align: int
    num_warps: int | None = None
    descriptors: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> KernelNeeds:
        warps = metadata.get("num_warps")
        descriptors = tuple(dict(d) for d in metadata.get("tensordesc_meta") or ())
        return cls(int(metadata.get("global_scratch_size", 0) or 0),
                   int(metadata.get("global_scratch_align", 1) or 1),
                   int(warps) if warps else None, descriptors)  # fmt: skip


_compiled = threading.local()  # .last: (kernel name, KernelNeeds) of this thread's compile
# Every jaxlib kernel object built here, by id, with what it needs (the object is kept, so
# its id is never another's): jax_triton caches the objects, and a launch that passes
# host-side tensor descriptors asks what the kernel it was given needs.
_built: dict[int, tuple[Any, KernelNeeds]] = {}
_built_lock = threading.Lock()


def needs_of(kernel: Any) -> KernelNeeds | None:
    """What the jaxlib kernel object `kernel` (built while `pass_kernel_needs` is in force)
    needs from its launch; None for one built otherwise."""
    with _built_lock:
        entry = _built.get(id(kernel))
    return None if entry is None or entry[0] is not kernel else entry[1]


class _MetadataKeepingBackend:
    """A Triton backend whose `make_ptx` copies the compile's metadata into `seen` (by
    then the LLVM step has filled in the scratch and the warps); everything else is the
    backend's."""

    def __init__(self, backend: Any, seen: dict[str, Any]):
        self._backend, self._seen = backend, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def make_ptx(self, src: Any, metadata: dict[str, Any], *rest: Any) -> Any:
        self._seen.update(metadata)
        return self._backend.make_ptx(src, metadata, *rest)


def _recording_compile(compile_to_ptx: Any) -> Any:
    """jax_triton's TTIR-to-PTX step, recording what the kernel needs and going through
    the PTX cache (`ptx_cache`: a kernel found there is not compiled)."""

    @functools.wraps(compile_to_ptx)
    def compile_recording_needs(ttir: Any, backend: Any, options: Any, *rest: Any) -> Any:
        # rest: the compute capability (jax_triton 0.3 and 0.4)
        slot = ptx_cache.slot_for(ttir, backend, options, rest)
        cached = None if slot is None else ptx_cache.load(*slot)
        if cached is not None:
            needs = KernelNeeds(
                cached.scratch_size, cached.scratch_align, cached.num_warps, cached.descriptors
            )
            _compiled.last = (cached.name, needs)
            return _compilation_result(cached)
        metadata: dict[str, Any] = {}
        result = compile_to_ptx(ttir, _MetadataKeepingBackend(backend, metadata), options, *rest)
        needs = KernelNeeds.from_metadata(metadata)
        _compiled.last = (result.name, needs)
        if slot is not None:
            kernel = ptx_cache.CachedKernel(
                name=result.name, ptx=result.binary, shared_mem_bytes=result.shared_mem_bytes,
                scratch_size=needs.scratch_size, scratch_align=needs.scratch_align,
                num_warps=needs.num_warps, descriptors=needs.descriptors,
            )  # fmt: skip
            ptx_cache.store(*slot, kernel)
        return result

    return compile_recording_needs


def _compilation_result(kernel: ptx_cache.CachedKernel) -> Any:
    """jax_triton's `CompilationResult` of a cached kernel (no intermediate IRs)."""
    from jax_triton import triton_lib

    given = dict(binary=kernel.ptx, name=kernel.name, shared_mem_bytes=kernel.shared_mem_bytes)
    fields = dataclasses.fields(triton_lib.CompilationResult)
    return triton_lib.CompilationResult(**{f.name: given.get(f.name) for f in fields})


def jaxlib_version() -> tuple[int, int, int]:
    """The installed jaxlib's (major, minor, patch)."""
    import jaxlib.version

    major, minor, patch = re.match(r"(\d+)\.(\d+)\.(\d+)", jaxlib.version.__version__).groups()
    return int(major), int(minor), int(patch)


def kernel_with_scratch(lib: Any, name: str, args: tuple[Any, ...], needs: KernelNeeds):
    """`lib.TritonKernel(name, *args)` with the global scratch appended, or a
    NotImplementedError where this jaxlib cannot take it."""
    if jaxlib_version() < FIRST_JAXLIB_WITH_SCRATCH:
        raise NotImplementedError(
            f"Triton kernel {name!r} needs {needs.scratch_size} bytes of global scratch per "
            "program (device-side tensor descriptors, tl.make_tensor_descriptor), which "
            f"jaxlib {'.'.join(map(str, jaxlib_version()))} cannot allocate for a Triton "
            f"call: it needs jaxlib >= {'.'.join(map(str, FIRST_JAXLIB_WITH_SCRATCH))} "
            "(an op's config with tma=True or warp_specialize=True asks for them; without "
            "those options the kernels load by pointers)"
        )
    return lib.TritonKernel(name, *args, needs.scratch_size, needs.scratch_align)


def check_shared_memory(name: str, *, shared_bytes: int, compute_capability: int) -> None:
    """ValueError naming kernel `name` where its `shared_bytes` of shared memory exceed what
    one CTA of an sm_`compute_capability` GPU can have (targets of unknown limits pass)."""
    from jax_bridge.launch.report import SM_LIMITS, max_shared_memory_per_cta

    if compute_capability not in SM_LIMITS:
        return
    limit = max_shared_memory_per_cta(compute_capability)
    if shared_bytes > limit:
        raise ValueError(
            f"Triton kernel {name!r} needs {shared_bytes} bytes of shared memory a CTA; an "
            f"sm_{compute_capability} GPU gives one CTA at most {limit}: its launch would "
            "fail. Fewer pipeline stages (num_stages) or smaller tiles fit."
        )


class _NeedsPassingLib:
    """jaxlib's `gpu_triton` module as jax_triton sees it, with a `TritonKernel` that
    passes what the kernel this thread compiled last needs."""

    def __init__(self, lib: Any):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def TritonKernel(self, name: str, *args: Any) -> Any:  # jaxlib's name for it
        compiled_name, needs = getattr(_compiled, "last", (None, None))
        _compiled.last = (None, None)
        if len(args) >= 6:
            check_shared_memory(name, shared_bytes=args[2], compute_capability=args[5])
        if compiled_name != name or needs is None:
            return self._lib.TritonKernel(name, *args)
        # args: num_warps, num_ctas, shared memory, PTX, TTIR, compute capability, and
        # (jax_triton 0.4) the scratch's size and alignment where it has some.
        if needs.num_warps is not None:
            args = (needs.num_warps, *args[1:])
        if needs.scratch_size == 0 or len(args) != 6:
            kernel = self._lib.TritonKernel(name, *args)
        else:
            kernel = kernel_with_scratch(self._lib, name, args, needs)
        with _built_lock:
            _built[id(kernel)] = (kernel, needs)
        return kernel


@functools.cache
def pass_kernel_needs() -> None:
    """Makes jax_triton pass each kernel's warps and (0.3) its global scratch to jaxlib
    (module docstring). Idempotent. Called by every launch
    (`jax_triton_compat.call_jax_triton`) before it reaches jax_triton."""
    from jax_triton import triton_lib

    triton_lib.compile_ttir_to_ptx_inplace = _recording_compile(
        triton_lib.compile_ttir_to_ptx_inplace
    )
    triton_lib.triton_kernel_call_lib = _NeedsPassingLib(triton_lib.triton_kernel_call_lib)
    triton_lib.get_or_create_triton_kernel = _apart_from_the_interpreter(
        triton_lib.get_or_create_triton_kernel
    )


def _apart_from_the_interpreter(build: Any) -> Any:
    """jax_triton's kernel build (Python to TTIR to PTX), never beside an interpreted
    launch, which patches `triton.language` while it runs (`no_interpreted_launch`)."""

    @functools.wraps(build)
    def build_alone(*args: Any, **kwargs: Any) -> Any:
        with no_interpreted_launch():
            return build(*args, **kwargs)

    return build_alone
