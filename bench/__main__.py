"""Runs every benchmark section in turn: `python -m bench [section ...]`.

Each section's `main()` prints its table and returns the names of its failed correctness
checks; any failure makes the run exit non-zero. Speed goals are printed as ratios
against a baseline measured in the same run, and reported, not enforced. On a
machine without a GPU, JAX is kept on the CPU (and the Triton kernels run through
Triton's interpreter, at small sizes only).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys

SECTIONS = ("host_layer", "segment_masks", "launcher", "attention", "grouped_matmul")


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
    failures = []
    for name in argv or SECTIONS:
        print(f"\n## {name}")
        failures += importlib.import_module(f"bench.{name}").main()
    if failures:
        raise SystemExit("failed checks:\n  " + "\n  ".join(failures))
    print("\nall bench checks passed")


if __name__ == "__main__":
    main(sys.argv[1:])
