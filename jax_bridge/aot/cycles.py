"""libtpu's static estimate of a TPU kernel's cycles, from a subprocess.

libtpu writes a `*_static_llo_profile.textproto` per HLO op (with `estimated_cycles`)
when `LIBTPU_INIT_ARGS` holds `--xla_jf_dump_static_llo_profile_to=DIR`. It reads that
flag once, when it starts, and the profiler aborts the process on some kernels (DMA
patterns on v4 and v5e; a bf16 pack in our partial-block dQ kernel on v5p); so the
program is exported (`jax.export`, with the traced value checks left out: their effect
cannot be serialized) and compiled again in a child process that starts libtpu with
the flag.

What the estimate is: the cost of the kernel's code per grid step, summed over the grid
with every step priced as taken (a block-sparse kernel costs the same whatever its
mask), and a branch priced by its dearest side. So it measures the cost of a visited
block, not block skipping.

The child is `python -m jax_bridge.aot.cycles REQUEST RESULT`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_bridge.aot.common import parse_compiled_text, tracing_for
from jax_bridge.aot.targets import CompileTarget, get_target, target_devices
from jax_bridge.core.validation import traced_value_checks

_TIMEOUT_S = 900
_PROFILE = re.compile(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)')


def estimate_kernel_cycles(
    jitted: Any, args: tuple, kwargs: dict, target: CompileTarget
) -> dict[str, int]:
    """{kernel instruction name: estimated cycles} of `jitted(*args, **kwargs)` compiled
    for `target` (arguments already placed on its devices), from a child process.

    Raises:
      RuntimeError: the child failed (libtpu's profiler aborts on some chips), naming why.
    """
    with tracing_for(target), traced_value_checks(False):
        exported = jax.export.export(jitted, platforms=("tpu",))(*args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="ragged-kernels-cycles-") as tmp:
        request, result = Path(tmp) / "request.pkl", Path(tmp) / "result.json"
        request.write_bytes(
            pickle.dumps(
                {
                    "target": target.name,
                    "exported": exported.serialize(),
                    "mesh": _mesh_axes((args, kwargs)),
                }
            )
        )
        env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
        env["LIBTPU_INIT_ARGS"] = (
            f"{env.get('LIBTPU_INIT_ARGS', '')} "
            f"--xla_jf_dump_static_llo_profile_to={Path(tmp) / 'profile'}"
        ).strip()
        child = subprocess.run(
            [sys.executable, "-m", "jax_bridge.aot.cycles", str(request), str(result)],
            env=env,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
        if child.returncode != 0 or not result.exists():
            tail = "\n".join(child.stderr.strip().splitlines()[-5:])
            raise RuntimeError(
                f"estimating cycles for {target.name} failed (exit {child.returncode}; "
                f"libtpu's static profiler aborts on some kernels): {tail}"
            )
        return json.loads(result.read_text())


def _mesh_axes(tree: Any) -> list[tuple[str, int, str]] | None:
    """(name, size, axis type) of the mesh the arguments are sharded over; None when they
    sit on one device. The child rebuilds that mesh on its own compile-only devices."""
    for leaf in jax.tree.leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and mesh.size > 1:
            return [
                (name, size, kind.name)
                for name, size, kind in zip(
                    mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True
                )
            ]
    return None


def _child_arguments(exported: Any, target: CompileTarget, mesh_axes) -> tuple[tuple, dict]:
    """The exported program's arguments, placed as they were, on this process' devices."""
    devices = target_devices(target, exported.nr_devices)
    if mesh_axes is None:
        one = jax.sharding.SingleDeviceSharding(devices[0])
        shardings = [one] * len(exported.in_avals)
    else:
        names, sizes, kinds = zip(*mesh_axes, strict=True)
        mesh = jax.sharding.Mesh(
            np.array(devices, dtype=object).reshape(sizes),
            names,
            axis_types=tuple(jax.sharding.AxisType[kind] for kind in kinds),
        )
        shardings = exported.in_shardings_jax(mesh)
    flat = [
        jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
        for aval, sharding in zip(exported.in_avals, shardings, strict=True)
    ]
    return jax.tree.unflatten(exported.in_tree, flat)


def read_profiles(directory: Path) -> dict[str, int]:
    """{HLO op name: estimated cycles} of every profile libtpu wrote into `directory`."""
    cycles = {}
    for path in Path(directory).glob("*static_llo_profile.textproto"):
        for name, value in _PROFILE.findall(path.read_text()):
            cycles[name] = int(value)
    return cycles


def _child(request_path: str, result_path: str) -> None:
    """Compiles the exported program on compile-only devices of the request's target and
    writes {kernel: cycles} as JSON."""
    request = pickle.loads(Path(request_path).read_bytes())
    target = get_target(request["target"])
    exported = jax.export.deserialize(request["exported"])
    args, kwargs = _child_arguments(exported, target, request["mesh"])
    compiled = jax.jit(exported.call).trace(*args, **kwargs).lower().compile()
    _, kernels, _ = parse_compiled_text(compiled.as_text())
    flag = os.environ["LIBTPU_INIT_ARGS"].split("--xla_jf_dump_static_llo_profile_to=")[-1]
    profiles = read_profiles(Path(flag.split()[0]))
    Path(result_path).write_text(json.dumps({k: profiles[k] for k in kernels if k in profiles}))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
