"""The accelerators a program can be compiled for on a host that has none.

Each `CompileTarget` names one chip; `target_devices(target, count)` returns `count`
compile-only devices of it: JAX devices that XLA and the kernel compilers accept in
shardings and meshes, but that never run anything.

* TPUs come from libtpu (the `tpu` and `test` extras install it, paired with jax): a
  topology of the smallest slice with at least `count` chips, from
  `jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=...)`.
* GPUs come from jax's CUDA plugin (no driver needed): XLA builds a device from a
  `GpuTargetConfigProto` in text form, shipped beside this file (`targets/*.txtpb`,
  written from the vendor's published figures).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
import re
from pathlib import Path

import jax
import numpy as np
from jax.experimental import topologies

from jax_bridge.launch.target import register_device_kind

_CONFIG_DIR = Path(__file__).parent / "targets"
_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """One kind of accelerator to compile for.

    Attributes:
      name: the name `compile_for` takes ("h100", "tpu-v5e", ...).
      platform: "cuda" or "tpu".
      description: the chip, in words.
      memory_bytes: device memory (HBM) of one device.
      dtypes: the floating dtypes its matrix units take (TPUs have no float16).
      compute_capability: GPUs only: 90 for sm_90, which picks the Triton configurations.
      tpu_version: TPUs only: libtpu's topology prefix ("v5e").
      torus_dims: TPUs only: 2 for a 2-D torus of chips (v5e, v6e), 3 for a 3-D one.
      estimates_cycles: libtpu's static profile prices this TPU's kernels (v5p, v6e; on
        v4 and v5e it aborts the process on some DMA patterns).
    """

    name: str
    platform: str
    description: str
    memory_bytes: int
    dtypes: tuple[str, ...]
    compute_capability: int | None = None
    tpu_version: str | None = None
    torus_dims: int = 0
    estimates_cycles: bool = False

    @property
    def gpu_config_path(self) -> Path:
        """The GpuTargetConfigProto text of a GPU target."""
        return _CONFIG_DIR / f"{self.name}.txtpb"


_GPU_DTYPES = ("float32", "bfloat16", "float16")
_TPU_DTYPES = ("float32", "bfloat16")

TARGETS: dict[str, CompileTarget] = {
    t.name: t
    for t in (
        CompileTarget("h100", "cuda", "NVIDIA H100 SXM5 80GB", 81559 * 2**20, _GPU_DTYPES, 90),
        CompileTarget("a100", "cuda", "NVIDIA A100 SXM4 80GB", 80 * _GIB, _GPU_DTYPES, 80),
        CompileTarget("tpu-v5e", "tpu", "TPU v5e", 16 * _GIB, _TPU_DTYPES, None, "v5e", 2),
        CompileTarget("tpu-v5p", "tpu", "TPU v5p", 95 * _GIB, _TPU_DTYPES, None, "v5p", 3, True),
        CompileTarget("tpu-v6e", "tpu", "TPU v6e", 32 * _GIB, _TPU_DTYPES, None, "v6e", 2, True),
    )
}


def _register_gpu_kinds() -> None:
    """A program traced over a mesh of these GPUs picks their Triton configurations
    (`launch.target.register_device_kind`) even under a plain `jax.jit`."""
    for target in TARGETS.values():
        if target.compute_capability is not None:
            text = target.gpu_config_path.read_text()
            kind = re.search(r'device_description_str:\s*"([^"]+)"', text)
            if kind:
                register_device_kind(kind.group(1), target.compute_capability)


def get_target(target: str | CompileTarget) -> CompileTarget:
    """The `CompileTarget` of a name (or the target itself)."""
    if isinstance(target, CompileTarget):
        return target
    if not isinstance(target, str):
        raise TypeError(
            f"target must be a target name, one of {tuple(TARGETS)}, or a CompileTarget; got "
            f"{target!r}."
        )
    if target not in TARGETS:
        raise ValueError(f"target must be one of {tuple(TARGETS)}, got {target!r}.")
    return TARGETS[target]


def _tpu_topology_name(target: CompileTarget, count: int) -> str:
    """The smallest slice of at least `count` chips: one host (2x2 chips) or more, each
    side a power of two, the sides as even as a torus of the target's rank allows."""
    chips = max(4, 1 << math.ceil(math.log2(count)))
    sides = [2, 2, 1] if target.torus_dims == 3 else [2, 2]
    while math.prod(sides) < chips:
        sides[sides.index(min(sides))] *= 2
    # Ascending, but a side of 1 goes last (libtpu takes "2x2x1", not "1x2x2").
    sides = sorted(sides, key=lambda side: (side == 1, side))
    return f"{target.tpu_version}:{'x'.join(map(str, sides))}"


def _gpu_topology(count: int) -> str:
    """Hosts of up to 8 GPUs: "1x{hosts}x{gpus per host}" (slices x hosts x devices)."""
    per_host = min(count, 8)
    return f"1x{math.ceil(count / per_host)}x{per_host}"


def _quiet_libtpu() -> None:
    """On a host without a TPU, libtpu looks for the TPU it would run on when it starts
    and prints errors and warnings for what it cannot find (the accelerator type, the
    worker hostnames, the metadata server), and it takes a host-wide lock that a second
    process then fails on. Compile-only topologies need none of them, and the compiled
    program does not depend on them (checked: same HLO for any value)."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return  # a TPU host: libtpu finds its own chips
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    # libtpu locks the host's TPUs for one process; compile-only devices have no chips to
    # share, and parallel test workers or bench subprocesses each need their own libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@functools.cache
def _topology(target: CompileTarget, topology: str):
    if target.platform == "tpu":
        _quiet_libtpu()
        try:
            return topologies.get_topology_desc(platform="tpu", topology_name=topology)
        except Exception as e:  # libtpu missing or too old for this chip
            raise RuntimeError(
                f"compile target {target.name!r} needs libtpu's compile-only TPUs ({e}); "
                "install the `tpu` or `test` extra: pip install 'jax[tpu]'"
            ) from e
    try:
        return topologies.get_topology_desc(
            platform="cuda",
            topology_name="",
            target_config=target.gpu_config_path.read_text(),
            topology=topology,
        )
    except Exception as e:
        raise RuntimeError(
            f"compile target {target.name!r} needs jax's CUDA plugin for compile-only GPUs "
            f"({e}): on a machine without a GPU, start Python with JAX_PLATFORMS=cpu (jax "
            "then does not load the plugin's CUDA runtime, which fails there); without the "
            "plugin, install the `test` extra: pip install 'jax[cuda12-local]'"
        ) from e


def target_devices(target: str | CompileTarget, count: int = 1) -> list[jax.Device]:
    """`count` compile-only devices of `target`, in the topology's order.

    Raises:
      ValueError: for an unknown target or a count below 1.
      RuntimeError: when the compiler for the target is not installed.
    """
    target = get_target(target)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}.")
    if target.platform == "tpu":
        name = _tpu_topology_name(target, count)
    else:
        name = _gpu_topology(count)
    return list(_topology(target, name).devices[:count])


def target_mesh(
    target: str | CompileTarget, axis_sizes: dict[str, int], **mesh_kwargs
) -> jax.sharding.Mesh:
    """A `Mesh` of compile-only devices of `target`, e.g. `target_mesh("h100", {"data": 2,
    "expert": 4})`: 8 H100s. `mesh_kwargs` go to `jax.sharding.Mesh` (e.g. axis_types)."""
    if not axis_sizes or any(not isinstance(n, int) or n < 1 for n in axis_sizes.values()):
        raise ValueError(f"axis_sizes must map axis names to positive ints, got {axis_sizes!r}.")
    devices = target_devices(target, math.prod(axis_sizes.values()))
    grid = np.array(devices, dtype=object).reshape(tuple(axis_sizes.values()))
    return jax.sharding.Mesh(grid, tuple(axis_sizes), **mesh_kwargs)


_register_gpu_kinds()
