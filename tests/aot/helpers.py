"""Shared pieces of the compile-only suite: abstract arguments and the compile check.

Nothing here runs a kernel: every program is compiled by the real compilers (XLA:TPU and
Mosaic through libtpu; XLA:GPU and Triton through jax's CUDA plugin) for compile-only
devices, and a test fails on any compile error. A compile that silently fell back to
another backend would also pass the compiler, so `compile_checked` asserts that the
compiled program holds the kernels the backend must launch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import TARGETS, compile_for
from tests.devices import needs_libtpu

GPU_TARGETS = ("h100", "a100")
TPU_TARGETS = ("tpu-v5e", "tpu-v6e")
SUITE_TARGETS = (*GPU_TARGETS, *TPU_TARGETS)

# The custom call each backend's kernels become, per platform.
KERNEL_CALL = {
    ("triton", "cuda"): "triton_kernel_call",
    ("pallas", "tpu"): "tpu_custom_call",
}


def target_params(targets=SUITE_TARGETS, dtypes=None):
    """pytest params (target, dtype) for every dtype each target's matrix units take."""
    return [
        pytest.param(t, d, id=f"{t}-{d}", marks=needs_libtpu if t.startswith("tpu") else ())
        for t in targets
        for d in TARGETS[t].dtypes
        if dtypes is None or d in dtypes
    ]


def backends_of(target: str, implementations=("xla", "triton", "pallas")) -> list[str]:
    """The backends an op has on `target`'s platform: XLA everywhere, Triton on GPUs,
    Pallas (Mosaic) on TPUs."""
    platform = TARGETS[target].platform
    return [i for i in implementations if i == "xla" or (i, platform) in KERNEL_CALL]


def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def compile_checked(fn, *args, target: str, implementation: str, min_kernels: int = 1, **kwargs):
    """`compile_for(fn, *args, target=target, **kwargs)`, asserting that the program holds
    at least `min_kernels` kernels of `implementation` (none for "xla"). Returns the
    report."""
    program = compile_for(fn, *args, target=target, **kwargs)
    report = program.report
    call = KERNEL_CALL.get((implementation, TARGETS[target].platform))
    launched = report.custom_calls.get(call, 0) if call else 0
    if implementation == "xla":
        ours = [
            c for (_, platform), c in KERNEL_CALL.items() if platform == TARGETS[target].platform
        ]
        assert not any(report.custom_calls.get(c) for c in ours), report.custom_calls
    else:
        assert launched >= min_kernels, (implementation, target, report.custom_calls)
    assert report.temp_bytes >= 0 and report.argument_bytes > 0
    return report
