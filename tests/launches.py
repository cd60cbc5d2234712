"""A recorder of the bridge's Triton launches: which kernels an op launches, and how.

`record_launches(monkeypatch, module)` replaces `module.triton_call` (a backend's launch
entry point) with a recorder: no kernel runs, each launch is appended as a `Launch`, and
the outputs are arrays of their shapes holding 0.5. Tests compare what an op launches
(constexprs, warps, stages, grid) with the catalog and the config functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: Any
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    grid: Any = None


def record_launches(monkeypatch, module) -> list[Launch]:
    """The launches of `module.triton_call` from now on (the list fills as they come)."""
    launches: list[Launch] = []

    def recorder(
        *args, kernel, out_shape, grid, name, num_warps, num_stages,
        zeroed_outputs=(), input_output_aliases=None, **constexprs,
    ):  # fmt: skip
        del args, name, zeroed_outputs, input_output_aliases
        launches.append(Launch(kernel, constexprs, num_warps, num_stages, grid))
        many = isinstance(out_shape, tuple)
        shapes = out_shape if many else [out_shape]
        outputs = tuple(jnp.full(s.shape, 0.5, s.dtype) for s in shapes)
        return outputs if many else outputs[0]

    monkeypatch.setattr(module, "triton_call", recorder)
    return launches
