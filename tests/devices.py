"""The devices a test needs: enough for its mesh, and libtpu's compile-only TPUs.

The conftest gives every run on the CPU eight devices; a run on an accelerator
(`JAX_PLATFORMS=cuda` on a one-GPU machine) has as many as the machine, and a mesh test
that needs more is skipped there with the count it needs, not failed in `Mesh`.

Compile-only TPUs come from libtpu (`jax[tpu]`, in the `test` extra). A machine without
it (a GPU image with its own packages) skips the tests that compile for a TPU; CI
(`CI` set) installs the test extra, so there a missing libtpu is an install error and
those tests run and fail loudly rather than skip.

A test of what a machine without an accelerator does (`cpu_only`: nothing to tune, the
host's memory as the device's, a plain GPU lowering refused) is skipped on one; a test of
the interpreter runs it there too (`jax_bridge.launch.target.interpreting`).

On a GPU every test runs within `jax_bridge.poisoned_outputs()` (the conftest), so that a
kernel output starts poisoned there as it does on the interpreter, except the tests that
inspect lowered programs (`UNPOISONED`); so does a run as on a GPU (`pytest --as-gpu 90`).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os

import jax
import pytest

LIBTPU_INSTALLED = importlib.util.find_spec("libtpu") is not None
TPU_COMPILES = LIBTPU_INSTALLED or bool(os.environ.get("CI"))
"""Whether this run compiles for TPU targets: with libtpu, and always in CI."""

needs_libtpu = pytest.mark.skipif(
    not TPU_COMPILES,
    reason="needs libtpu's compile-only TPUs: install the test extra (pip install -e '.[test]')",
)


def first_devices(count: int) -> list[jax.Device]:
    """The first `count` devices of the default backend; skips the test when fewer exist."""
    devices = jax.devices()
    if len(devices) < count:
        pytest.skip(
            f"needs {count} devices; this {devices[0].platform} run has {len(devices)} "
            "(on the CPU the conftest provides 8)"
        )
    return devices[:count]


def _runs_tensor_descriptors() -> bool:
    from jax_bridge.launch.target import tensor_descriptors_available

    return jax.default_backend() == "gpu" and tensor_descriptors_available()


needs_tensor_descriptors = pytest.mark.skipif(
    not _runs_tensor_descriptors(),
    reason="runs on a Hopper GPU with jaxlib >= 0.11.1 (it allocates the descriptors' scratch)",
)
"""For tests that launch device-side tensor descriptors (TMA) on the GPU itself."""


def skip_unless_host_descriptors_launch() -> None:
    """Skips the calling test where a kernel taking host-side tensor descriptors cannot
    run: on a GPU before Hopper or whose jaxlib cannot pass them, and under `pytest
    --as-gpu` (its jax_triton stand-in does not see their launches, which bypass
    jax_triton). Triton's interpreter runs them."""
    from jax_bridge.launch.host_descriptors import host_descriptors_launchable
    from jax_bridge.launch.target import launch_target

    target = launch_target()
    if not target.on_gpu:
        return
    if (target.compute_capability or 0) < 90:
        pytest.skip("host-side descriptors need a Hopper or later GPU")
    if jax.default_backend() == "cpu":
        pytest.skip("host-side descriptors bypass jax_triton, which --as-gpu stands in for")
    if not host_descriptors_launchable():
        pytest.skip("host-side descriptors need jaxlib >= 0.11.2 on a GPU")


def cpu_only(why: str) -> pytest.MarkDecorator:
    """Skips a test on an accelerator (`JAX_PLATFORMS=cuda`): it checks what a machine
    without one does (`why`, in the skip's reason)."""
    return pytest.mark.skipif(jax.default_backend() != "cpu", reason=f"CPU only: {why}")


UNPOISONED = (
    "tests/aot/*",
    "tests/launch/*",
    "tests/tuning/*",
    "tests/test_bench_*",
    "tests/*/test_lowering.py::*",
)
"""Tests (node-id patterns) that inspect lowered programs or launch layers: kernel names,
aliases, registers, temp memory. They see programs as users get them, never poisoned."""


def poisons_outputs(nodeid: str, as_gpu: int | None = None) -> bool:
    """Whether a test runs within `jax_bridge.poisoned_outputs()`: on a GPU (where outputs
    otherwise start as their buffers' old contents; the interpreter always poisons them)
    or run as on one (`--as-gpu`), unless it is `UNPOISONED`."""
    on_gpu = jax.default_backend() == "gpu" or as_gpu is not None
    return on_gpu and not any(fnmatch.fnmatchcase(nodeid, p) for p in UNPOISONED)
