"""Runs every benchmark section in turn: `python -m bench [section ...]`.

Speed goals are printed as ratios against a baseline measured in the same run. On a
machine without a GPU, JAX is kept on the CPU (and the Triton kernels run through
Triton's interpreter, at small sizes only).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys

SECTIONS = ("host_layer", "segment_masks", "launcher")


def _prefer_cpu_without_gpu() -> None:
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def main(argv: list[str]) -> None:
    unknown = [s for s in argv if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    _prefer_cpu_without_gpu()
    import jax

    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    for name in argv or SECTIONS:
        importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main(sys.argv[1:])
