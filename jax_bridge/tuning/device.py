"""What a tuned config is valid for: the device (from JAX's device attributes, never by
shelling out to `nvidia-smi`) and the software that compiled and measured it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

import jax

from jax_bridge.tuning.keys import short_hash

__all__ = ["device_compute_capability", "device_fingerprint", "get_device_platform"]

# Distributions whose version changes what a kernel compiles to or how it launches: a
# config measured under one is not known to be best under another.
_SOFTWARE = ("ragged-kernels", "jax", "jaxlib", "triton", "jax-triton")


def _device(device: Any | None) -> Any:
    # The default device, as `launch_target` reads it.
    return jax.devices()[0] if device is None else device


def get_device_platform(device: Any | None = None) -> str:
    """ "cpu", "gpu" (NVIDIA or AMD) or "tpu": the platform of `device` (default: JAX's first
    device). Any other platform name is returned lower-cased as JAX spells it."""
    platform = str(_device(device).platform).lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _capability_attribute(device: Any) -> str | None:
    capability = getattr(device, "compute_capability", None)
    return str(capability) if capability else None


def device_compute_capability(device: Any | None = None) -> int | None:
    """The CUDA compute capability as an int (attribute "9.0" -> 90); None where the device
    has none (CPU, TPU) or names its architecture otherwise (ROCm's "gfx90a")."""
    match = re.fullmatch(r"(\d+)(?:\.(\d+))?", _capability_attribute(_device(device)) or "")
    return int(match[1]) * 10 + int(match[2] or 0) if match else None


@functools.cache
def _software_versions() -> tuple[tuple[str, str], ...]:
    versions = []
    for name in _SOFTWARE:
        try:
            versions.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((name, "absent"))
    return tuple(versions)


def device_description(device: Any | None = None) -> dict[str, Any]:
    """Everything the fingerprint is made of: platform, device kind, the compute
    capability attribute as JAX gives it (None without one) and the versions of
    `_SOFTWARE` (a JSON-ready dict)."""
    device = _device(device)
    return {
        "platform": get_device_platform(device),
        "device_kind": str(device.device_kind),
        "compute_capability": _capability_attribute(device),
        "software": dict(_software_versions()),
    }


def device_fingerprint(device: Any | None = None) -> str:
    """A short, stable name of (device, software), e.g. "gpu-nvidia-h100-80gb-hbm3-sm90-
    3f2a9c01d4e5b6a7": readable platform, kind and compute capability, then a hash of
    `device_description` (so new software versions give a new fingerprint). `device`:
    a JAX device (default: the first)."""
    description = device_description(device)
    slug = lambda text: re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    parts = [description["platform"], slug(description["device_kind"]) or "unknown"]
    capability = device_compute_capability(device)
    if capability is not None:
        parts.append(f"sm{capability}")
    elif description["compute_capability"] is not None:  # e.g. ROCm's "gfx90a"
        parts.append(slug(description["compute_capability"]))
    return "-".join([*parts, short_hash(description)])
