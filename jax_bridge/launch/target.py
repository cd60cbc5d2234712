"""The one decision of where a Triton kernel launches: a GPU (and for which compute
capability) or Triton's interpreter on the host.

`launch_target()` answers it for `triton_call` and for every op that picks a launch
configuration. Two contexts steer it:

* `cuda_lowering(cc)`: lower for cuda with kernels compiled for `cc`, from any machine
  (used by `lower_for_cuda` and `compile_for`; no GPU needed);
* `interpreting()`: run through the interpreter even where a GPU exists (what
  `grouped_matmul(..., interpret=True)` asks for).

Both are JAX user contexts, hence part of `jax.jit`'s cache key: a function traced for
one target is never reused for another.

Outside both, `follow_lowering_platform` makes a Triton backend follow the platform its
program is lowered for rather than the host: on a GPU machine the op is traced for the
GPU and for the interpreter under `jax.lax.platform_dependent` (so `jax.jit(f, device=
cpu_device)` interprets); on a machine without a GPU it is traced for the GPU when its
arguments sit on a mesh of GPUs of a registered kind (`register_device_kind`: the
compile-only targets), else for the interpreter; lowering that for cuda (e.g. arguments
on one compile-only GPU, whose kind a trace does not see) stops with an error that says
how to name the GPU, since its compute capability picks the kernels' configurations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_bridge.core import backend

COMPUTE_CAPABILITIES = (80, 86, 89, 90, 100, 120)

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


def device_compute_capability(device: Any) -> int | None:
    """A device's compute capability as an int (JAX's "9.0" -> 90); None where the device
    does not say (a CPU, a TPU)."""
    capability = getattr(device, "compute_capability", None)
    if not capability:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major) * 10 + int(minor or 0)


def _device_compute_capability() -> int | None:
    """The default device's compute capability as an int; None if unknown."""
    return device_compute_capability(jax.devices()[0])


_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def launch_target() -> LaunchTarget:
    """Where `triton_call` launches a kernel now (see the module docstring)."""
    if _force_interpreter.value:
        return INTERPRETER
    if _cuda_target.value is not None:
        return LaunchTarget(on_gpu=True, compute_capability=_cuda_target.value)
    if backend.default_platform() in _GPU_PLATFORMS:
        return LaunchTarget(on_gpu=True, compute_capability=_device_compute_capability())
    return INTERPRETER


# An identity that cannot be lowered for a GPU. It marks the inputs of an op traced for
# the interpreter on a host without a GPU, so that a program lowered for cuda from that
# host fails with directions instead of calling the host interpreter from the GPU.
_host_only_p = Primitive("ragged_kernels_host_only")
_host_only_p.multiple_results = True
_host_only_p.def_impl(lambda *args, what: args)
_host_only_p.def_abstract_eval(lambda *avals, what: avals)
batching.primitive_batchers[_host_only_p] = lambda args, dims, what: (
    _host_only_p.bind(*args, what=what),
    dims,
)
mlir.register_lowering(_host_only_p, lambda ctx, *args, what: args)


def _refuse_gpu_lowering(ctx, *args, what: str):
    raise RuntimeError(
        f"{what} were traced on a host without a GPU, for Triton's interpreter, and "
        "cannot be lowered for cuda: the GPU's compute capability picks their launch "
        "configurations at trace time. Compile with jax_bridge.compile_for(fn, *args, "
        "target='h100') (or 'a100'), or trace inside jax_bridge.cuda_lowering(90)."
    )


for _platform in ("cuda", "rocm"):
    mlir.register_lowering(_host_only_p, _refuse_gpu_lowering, platform=_platform)


# GPU device kinds (jax.Device.device_kind) whose compute capability is known without
# the device: the compile-only targets register theirs (`jax_bridge.aot.targets`).
_CAPABILITY_OF_KIND: dict[str, int] = {}


def register_device_kind(device_kind: str, compute_capability: int) -> None:
    """Lets a program traced for GPU devices of `device_kind` (seen through the mesh of
    its arguments) pick the launch configurations of `compute_capability`."""
    _CAPABILITY_OF_KIND[device_kind] = compute_capability


def _mesh_gpu_capability(leaves: list[Any]) -> int | None:
    """The compute capability of the GPUs that the arguments' mesh (or the mesh being
    traced for, inside `shard_map`) names at trace time, when its kind is registered."""
    meshes = [jax.sharding.get_abstract_mesh()]
    for x in leaves:
        if isinstance(x, jax.Array):
            meshes.append(getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None))
    for mesh in meshes:
        device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
        if device is not None and device.platform in _GPU_PLATFORMS:
            return _CAPABILITY_OF_KIND.get(device.device_kind)
    return None


def follow_lowering_platform(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, a Triton backend's entry point, traced for the platform its program is
    lowered for (see the module docstring). `fn` returns a pytree of arrays."""
    what = f"The Triton kernels of {fn.__module__}.{fn.__name__}"

    @functools.wraps(fn)
    def for_lowering_platform(*args: Any, **kwargs: Any) -> Any:
        if _force_interpreter.value or _cuda_target.value is not None:
            return fn(*args, **kwargs)

        def host() -> Any:
            with _force_interpreter(True):
                return fn(*args, **kwargs)

        if jax.default_backend() not in _GPU_PLATFORMS:
            leaves, tree = jax.tree.flatten((args, kwargs))
            capability = _mesh_gpu_capability(leaves)
            if capability is not None:  # arguments on a mesh of (compile-only) GPUs
                with _cuda_target(capability):
                    return fn(*args, **kwargs)
            # Marks the inputs, so that the refusal is lowered before the interpreter's
            # host callback (which a cuda lowering cannot place at all).
            arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
            marked = _host_only_p.bind(*(leaves[i] for i in arrays), what=what)
            for i, x in zip(arrays, marked, strict=True):
                leaves[i] = x
            marked_args, marked_kwargs = jax.tree.unflatten(tree, leaves)
            with _force_interpreter(True):
                return fn(*marked_args, **marked_kwargs)

        def gpu() -> Any:
            with _cuda_target(_device_compute_capability()):
                return fn(*args, **kwargs)

        return jax.lax.platform_dependent(cuda=gpu, rocm=gpu, default=host)

    return for_lowering_platform


# Streaming multiprocessors of the largest GPU of each compute capability (A100: 108;
# RTX A6000: 84; L40: 142 is sm_89's largest; H100 SXM and H200: 132; B200: 148; RTX PRO
# 6000 Blackwell: 188), for persistent launches traced without the device (`compile_for`,
# `cuda_lowering`).
_MULTIPROCESSORS = {80: 108, 86: 84, 89: 142, 90: 132, 100: 148, 120: 188}


def multiprocessor_count() -> int | None:
    """Streaming multiprocessors of the GPU kernels launch on now, for persistent launches:
    the device's own count (`core_count`) where the default device is a GPU of the
    target's compute capability (an H100 PCIe has 114 where the SXM part has 132), else
    `_MULTIPROCESSORS`' for that capability; None on the interpreter, and for a capability
    the table lacks on a device that reports no count."""
    target = launch_target()
    if target.interpreter:
        return None
    device = jax.devices()[0]
    if (
        device.platform in _GPU_PLATFORMS
        and _device_compute_capability() == target.compute_capability
        and getattr(device, "core_count", None)
    ):
        return int(device.core_count)
    return _MULTIPROCESSORS.get(target.compute_capability)


def tensor_descriptors_available() -> bool:
    """Whether kernels launched now can use device-side tensor descriptors with nothing
    raised: on a GPU of compute capability >= 9.0 whose jaxlib allocates the descriptors'
    global scratch (`kernel_needs.FIRST_JAXLIB_WITH_SCRATCH`). What default configs that
    take TMA check; an explicit `tma=True` elsewhere gets the errors of
    `require_tensor_descriptors` and `kernel_needs` instead."""
    from jax_bridge.launch import kernel_needs

    target = launch_target()
    return (
        target.on_gpu
        and _has_tensor_memory_accelerator(target)
        and kernel_needs.jaxlib_version() >= kernel_needs.FIRST_JAXLIB_WITH_SCRATCH
    )


def _has_tensor_memory_accelerator(target: LaunchTarget) -> bool:
    """Compute capability >= 9.0 (ROCm reports none)."""
    return target.compute_capability is not None and target.compute_capability >= 90


def require_tensor_descriptors(op: str) -> None:
    """ValueError naming `op` where kernels launch on a GPU without Hopper's tensor memory
    accelerator (compute capability < 9.0, or none reported: ROCm), which device-side
    tensor descriptors need; Triton's interpreter runs them anywhere."""
    target = launch_target()
    if target.on_gpu and not _has_tensor_memory_accelerator(target):
        capability = target.compute_capability
        got = "none reported" if capability is None else f"{capability / 10:.1f}"
        raise ValueError(
            f"{op}: config tma=True needs a GPU of compute capability >= 9.0 "
            f"(tensor memory accelerator), got {got}"
        )
