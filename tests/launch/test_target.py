"""The one launch-target decision and the contexts that steer it."""

import jax
import jax.numpy as jnp
import pytest

from jax_bridge.launch.target import (
    INTERPRETER,
    LaunchTarget,
    cuda_lowering,
    interpreting,
    launch_target,
    multiprocessor_count,
)
from tests.devices import cpu_only


@cpu_only("a CPU launches on the interpreter")
def test_cpu_launches_on_the_interpreter():
    target = launch_target()
    assert target == INTERPRETER and target.interpreter and target.compute_capability is None


@pytest.mark.parametrize("capability", [80, 90])
def test_cuda_lowering_targets_the_gpu_and_interpreting_wins(capability):
    outside = launch_target()  # the interpreter on a CPU, the device's on a GPU
    with cuda_lowering(capability):
        assert launch_target() == LaunchTarget(on_gpu=True, compute_capability=capability)
        with interpreting():
            assert launch_target() == INTERPRETER
        with interpreting(False):
            assert launch_target().on_gpu
    assert launch_target() == outside


def test_unknown_compute_capability_is_refused():
    with pytest.raises(ValueError, match="compute_capability must be one of"):
        with cuda_lowering(75):
            pass


def test_targets_are_part_of_the_jit_cache_key():
    traces = []

    @jax.jit
    def f(x):
        traces.append(launch_target())
        return x + 1

    x = jnp.ones(3)
    f(x)
    with interpreting():
        f(x)
    with cuda_lowering(90):
        f.trace(x)
    # Each context traces anew, even where it names the target of the one before.
    assert traces == [launch_target(), INTERPRETER, LaunchTarget(True, 90)]


class _FakeGpu:
    """A GPU device as JAX describes one: platform, compute capability, SM count."""

    platform = "gpu"
    device_kind = "NVIDIA H100 PCIe"
    compute_capability = "9.0"
    core_count = 114


def test_multiprocessor_count_reads_the_device_else_the_capabilitys_largest_gpu(monkeypatch):
    """A persistent launch's SMs: none on the interpreter; lowered for a capability with
    no such GPU at hand, its largest part's (H100 SXM / H200: 132); on a GPU of the
    target's capability, the device's own count (an H100 PCIe: 114), and the table's again
    when the target is another capability or the device reports none."""
    with interpreting():
        assert multiprocessor_count() is None
    with cuda_lowering(90):
        assert multiprocessor_count() == 132
    with cuda_lowering(80):
        assert multiprocessor_count() == 108
    monkeypatch.setattr(jax, "devices", lambda *backend: [_FakeGpu()])
    with cuda_lowering(90):
        assert multiprocessor_count() == 114
    with cuda_lowering(100):
        assert multiprocessor_count() == 148
    monkeypatch.setattr(_FakeGpu, "core_count", None)
    with cuda_lowering(90):
        assert multiprocessor_count() == 132
