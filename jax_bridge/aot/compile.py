"""`compile_for`: compile a JAX function for an accelerator this host does not have.

The arguments are placed on compile-only devices of the target (`targets.py`), the
function is traced for the target's platform (so `implementation="auto"` picks its
kernels, and Triton picks the launch configurations of its compute capability), and XLA
with the real kernel compilers (Mosaic for TPUs; Triton to PTX for GPUs, each kernel's
shared memory checked against the target: ptxas runs on the GPU, at a kernel's first
launch, and in `python -m bench report`) compiles the program. Nothing runs: what comes
back is the compiled program and a `CompileReport` of what the compilers said about it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jax_bridge.aot.common import parse_compiled_text, tracing_for
from jax_bridge.aot.targets import CompileTarget, get_target, target_devices
from jax_bridge.launch.target import device_compute_capability


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What the compilers said about one program, per device.

    Attributes:
      target: the target's name.
      devices: how many devices the program spans.
      argument_bytes, output_bytes, temp_bytes, alias_bytes, code_bytes: XLA's memory
        analysis of one device's program (temp: the scratch XLA allocates beyond
        arguments and outputs; alias: outputs that reuse an argument's buffer).
      custom_calls: custom call target -> count in the optimized program.
      kernels: the instruction names of our kernels' calls (Mosaic or Triton), in order.
      collectives: collective kind ("all-reduce", ...) -> count.
      estimated_cycles: TPU only, when asked for: libtpu's static estimate of each
        kernel's cycles (every grid step priced as taken; `cycles.py`).
    """

    target: str
    devices: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int
    custom_calls: Mapping[str, int]
    kernels: tuple[str, ...]
    collectives: Mapping[str, int]
    estimated_cycles: Mapping[str, int] | None = None

    @property
    def total_bytes(self) -> int:
        """Device memory the program needs at once: arguments, outputs and temps."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """A program compiled for a target (it cannot run here) and its report."""

    compiled: jax.stages.Compiled
    report: CompileReport

    def as_text(self) -> str:
        """The optimized HLO."""
        return self.compiled.as_text()


def place(tree: Any, target: CompileTarget, mesh: Mesh | None) -> Any:
    """Every array leaf as a `jax.ShapeDtypeStruct` on the target's devices: its own
    sharding when that is already on devices of the target's platform, else the first
    device (no mesh) or replicated over `mesh`. Other leaves are left as they are."""
    default = (
        SingleDeviceSharding(target_devices(target)[0])
        if mesh is None
        else NamedSharding(mesh, PartitionSpec())
    )

    def leaf(x: Any) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        sharding = getattr(x, "sharding", None)
        if sharding is None or not _on_platform(sharding, target.platform):
            sharding = default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def _on_platform(sharding: Any, platform: str) -> bool:
    devices = getattr(sharding, "device_set", None)
    if not devices:
        return False
    platforms = {"gpu" if d.platform in ("cuda", "rocm") else d.platform for d in devices}
    return platforms == {"gpu" if platform == "cuda" else platform}


def _is_targets(device: Any, target: CompileTarget) -> bool:
    """Whether `device` is of `target`'s kind: its platform and, for a GPU whose device
    says it, its compute capability ("9.0": an A100's mesh would take sm_90 kernels)."""
    if not _on_platform(SingleDeviceSharding(device), target.platform):
        return False
    capability = device_compute_capability(device)
    return target.compute_capability is None or capability in (None, target.compute_capability)


def _check_mesh(mesh: Mesh | None, target: CompileTarget) -> None:
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"compile_for: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}."
        )
    if not all(_is_targets(d, target) for d in mesh.devices.flat):
        raise ValueError(
            f"compile_for: mesh holds devices that are not {target.name}'s; build it with "
            f"jax_bridge.target_mesh({target.name!r}, ...)."
        )


def compile_for(
    fn: Callable[..., Any],
    *args: Any,
    target: str | CompileTarget,
    mesh: Mesh | None = None,
    static_argnames: tuple[str, ...] = (),
    estimate_cycles: bool = False,
    **kwargs: Any,
) -> CompiledProgram:
    """Compiles `jax.jit(fn)(*args, **kwargs)` for `target` on this host.

    Args:
      fn: the function (ops of this package, or anything JAX), or an already `jax.jit`-ed
        one, compiled as it is: its donate_argnums, in/out shardings and static arguments
        are kept (wrapping it in another jit would drop its donation).
      *args, **kwargs: its arguments: arrays or `jax.ShapeDtypeStruct`s (with a sharding
        on `target_devices(target)` / a `target_mesh`, or none: then on the target's first
        device, or replicated over `mesh`), and static values named in `static_argnames`.
      target: "h100", "a100", "tpu-v5e", "tpu-v5p", "tpu-v6e" (`TARGETS`) or a
        `CompileTarget`.
      mesh: a `target_mesh(target, ...)` that the unsharded arguments are replicated over
        (and that `fn` may use for `shard_map`).
      static_argnames: keyword arguments of `fn` that are static.
      estimate_cycles: TPU only: also price every kernel with libtpu's static profile, in
        a subprocess (`cycles.py`); needs `flatbuffers` for `jax.export`.

    Returns:
      A `CompiledProgram`: the compiled program (it cannot run here) and its report.

    Raises:
      ValueError / TypeError: a bad target or mesh; RuntimeError: a compiler missing (its
      message says what to install) or the kernel compiler's own error.
    """
    target = get_target(target)
    _check_mesh(mesh, target)
    if estimate_cycles and target.platform != "tpu":
        raise ValueError(f"compile_for: estimate_cycles is for TPU targets, not {target.name!r}.")
    if estimate_cycles and not target.estimates_cycles:  # libtpu aborts the process there
        raise ValueError(
            f"compile_for: estimate_cycles is not available for {target.name!r}: libtpu "
            "cannot estimate its cycles."
        )
    args, kwargs = place((args, kwargs), target, mesh)
    if isinstance(fn, jax.stages.Wrapped):
        if static_argnames:
            raise ValueError(
                "compile_for: give static_argnames to the jax.jit of an already-jitted fn."
            )
        jitted = fn
    else:
        jitted = jax.jit(fn, static_argnames=static_argnames)
    with tracing_for(target):
        compiled = jitted.trace(*args, **kwargs).lower().compile()
    cycles = None
    if estimate_cycles:
        # Imported here, not at the top: the child process runs `cycles` as __main__, and
        # its package import (jax_bridge -> compile) must not load it a second time.
        from jax_bridge.aot.cycles import estimate_kernel_cycles

        cycles = estimate_kernel_cycles(jitted, args, kwargs, target)
    devices = set().union(
        *(s.device_set for s in jax.tree.leaves(compiled.input_shardings) if s is not None)
    )
    return CompiledProgram(compiled, _report(compiled, target, max(len(devices), 1), cycles))


def _report(compiled: jax.stages.Compiled, target: CompileTarget, devices: int, cycles):
    memory = compiled.memory_analysis()
    custom_calls, kernels, collectives = parse_compiled_text(compiled.as_text())
    return CompileReport(
        target=target.name,
        devices=devices,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
        custom_calls=custom_calls,
        kernels=kernels,
        collectives=collectives,
        estimated_cycles=cycles,
    )
