"""Device platform, compute capability and fingerprint, from JAX's device attributes."""

import re
import subprocess
import types

import jax
import pytest

from jax_bridge.tuning import device as device_module
from jax_bridge.tuning.device import (
    device_compute_capability,
    device_description,
    device_fingerprint,
    get_device_platform,
)
from tests.devices import cpu_only

H100 = types.SimpleNamespace(
    platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0"
)
CPU = types.SimpleNamespace(platform="cpu", device_kind="cpu")
A100 = types.SimpleNamespace(
    platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0"
)


@cpu_only("the test machine is a CPU")
def test_the_test_machine_is_a_cpu():
    assert get_device_platform() == "cpu"
    assert get_device_platform(jax.devices()[-1]) == "cpu"
    assert device_compute_capability() is None


@pytest.mark.parametrize(
    "platform, expected",
    [("cuda", "gpu"), ("rocm", "gpu"), ("gpu", "gpu"), ("TPU", "tpu"), ("cpu", "cpu")],
)
def test_platform_names(platform, expected):
    assert get_device_platform(types.SimpleNamespace(platform=platform)) == expected


@pytest.mark.parametrize(
    "capability, expected",
    [("9.0", 90), ("8.6", 86), ("10.0", 100), ("12", 120), ("", None), (None, None)],
)
def test_compute_capability_as_an_int(capability, expected):
    fake = types.SimpleNamespace(platform="gpu", compute_capability=capability)
    assert device_compute_capability(fake) == expected
    assert device_compute_capability(types.SimpleNamespace(platform="tpu")) is None


def test_fingerprint_is_readable_short_and_stable():
    fingerprint = device_fingerprint(H100)
    assert re.fullmatch(r"gpu-nvidia-h100-80gb-hbm3-sm90-[0-9a-f]{16}", fingerprint), fingerprint
    assert device_fingerprint(H100) == fingerprint
    assert device_fingerprint(A100).startswith("gpu-nvidia-a100-sxm4-80gb-sm80-")
    assert device_fingerprint() == device_fingerprint(jax.devices()[0])  # the default
    assert re.fullmatch(r"cpu-cpu-[0-9a-f]{16}", device_fingerprint(CPU))
    mi250 = types.SimpleNamespace(
        platform="rocm", device_kind="AMD Instinct MI250X", compute_capability="gfx90a"
    )
    assert device_compute_capability(mi250) is None
    assert device_fingerprint(mi250).startswith("gpu-amd-instinct-mi250x-gfx90a-")


def test_fingerprint_changes_with_the_device_and_the_software(monkeypatch):
    fingerprint = device_fingerprint(H100)
    other_capability = types.SimpleNamespace(**{**vars(H100), "compute_capability": "9.1"})
    assert device_fingerprint(other_capability) != fingerprint
    # A tuned config is only valid for the compiler that measured it.
    software = dict(device_description(H100)["software"])
    assert software["jax"] == jax.__version__ and "triton" in software
    monkeypatch.setattr(
        device_module, "_software_versions", lambda: (*software.items(), ("triton", "0.0.1"))
    )
    assert device_fingerprint(H100) != fingerprint


def test_never_shells_out(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the device is read from JAX, never from a subprocess")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    device_module._software_versions.cache_clear()
    assert device_fingerprint() and device_fingerprint(H100)
