"""libtpu's estimated cycles of our splash kernels against JAX's, per visited block.

What libtpu's static profile can and cannot price (`jax_bridge.aot.cycles`): it sums the
kernel's code over the grid with every step taken, and it reads every scalar-memory value
(the MaskInfo that kernels prefetch) as 0. Both our kernels and JAX's guard a block's
work by its MaskInfo kind, so as compiled, neither kernel's block work is priced at all:
a plain estimate compares loop overheads only. To price the work of a block, both are
compiled with every grid step forced to one kind: ours with
`pallas_tpu.splash.common.pricing_blocks_as(kind)`, JAX's by wrapping its `_next_nonzero`
during tracing so that every step runs, masked ("partial") or not ("full"). The forced
programs are for pricing only; they are never run.

Kinds: "full" (a block inside the mask: no mask arithmetic), "partial" (a block the mask
cuts, here causal: the mask computed from positions), and for ours "isolating" (a
partial block whose values hold a NaN or an Inf, where the product keeps zero weights
from meeting them; JAX's kernels have no such form: a NaN there reaches every row).

`estimate_mask_cycles` prices a whole mask from its MaskInfo: cycles of a full block x
full blocks visited + cycles of a partial block x partial blocks visited.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as jax_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jax_masks

from jax_bridge import compile_for
from pallas_tpu import splash
from pallas_tpu.splash import common

KERNELS = ("forward", "dq", "dkv")
# Our kernels' and JAX's kernel names (HLO instruction prefixes) per role.
_ROLE_OF = {
    "splash_forward": "forward",
    "splash_backward_dq": "dq",
    "splash_backward_dkv": "dkv",
    "splash_mha_fwd": "forward",
    "splash_mha_dq": "dq",
    "splash_mha_dkv": "dkv",
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention problem to price: q, k, v [heads, seq, head_dim], square blocks.

    Per-step estimates fall a little as the grid grows (each row's prologue and epilogue
    spread over more steps); the default keeps libtpu's profiler under ~8 GB (it holds
    the whole grid: 4 heads x 2048 took over 20 GB)."""

    heads: int = 2
    seq: int = 2048
    head_dim: int = 128
    block: int = 512

    @property
    def grid_steps(self) -> int:
        return self.heads * (self.seq // self.block) ** 2


@contextlib.contextmanager
def jax_blocks_as(kind: str) -> Iterator[None]:
    """JAX's splash kernels traced within run every grid step as a `kind` block."""
    original = jax_kernel._next_nonzero

    def forced(*args: Any, **kwargs: Any):
        next_block, next_mask, _, _ = original(*args, **kwargs)
        return next_block, next_mask, True, kind == "full"

    jax_kernel._next_nonzero = forced
    try:
        yield
    finally:
        jax_kernel._next_nonzero = original


def _forward_and_backward(kernel):
    def program(q, k, v, dout):
        out, vjp = jax.vjp(kernel, q, k, v)
        return (out, *vjp(dout))

    return program


def _ours(problem: Problem, kind: str):
    n, block = problem.seq, problem.block
    mask = splash.FullMask((n, n)) if kind == "full" else splash.CausalMask((n, n))
    blocks = splash.BlockSizes(block, block)
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([mask] * problem.heads), block_sizes=blocks, interpret=False
    )
    return _forward_and_backward(kernel), common.pricing_blocks_as(kind)


def _theirs(problem: Problem, kind: str):
    n, b = problem.seq, problem.block
    mask = jax_masks.FullMask((n, n)) if kind == "full" else jax_masks.CausalMask((n, n))
    blocks = jax_kernel.BlockSizes(b, b, b, b, b, b, b, b, use_fused_bwd_kernel=False)
    kernel = jax_kernel.make_splash_mha_single_device(
        jax_masks.MultiHeadMask([mask] * problem.heads), block_sizes=blocks
    )
    return _forward_and_backward(kernel), jax_blocks_as(kind)


def block_cycles(target: str, dtype: str, problem: Problem, who: str, kind: str) -> dict:
    """{"forward" | "dq" | "dkv": estimated cycles per grid step} of `who` ("ours" or
    "jax") with every step a `kind` block, compiled for `target` in `dtype`."""
    program, forcing = (_ours if who == "ours" else _theirs)(problem, kind)
    x = jax.ShapeDtypeStruct((problem.heads, problem.seq, problem.head_dim), jnp.dtype(dtype))
    with forcing:
        report = compile_for(program, x, x, x, x, target=target, estimate_cycles=True).report
    per_step = {}
    for name, cycles in report.estimated_cycles.items():
        role = next(r for prefix, r in _ROLE_OF.items() if name.startswith(prefix))
        per_step[role] = cycles / problem.grid_steps
    return per_step


def mask_blocks(mask: Any, problem: Problem) -> dict[str, tuple[int, int]]:
    """{kernel: (full blocks, partial blocks) visited} from our MaskInfos of `mask`."""
    blocks = (problem.block, problem.block)
    forward, _ = splash.process_mask(mask, blocks)
    dkv, _ = splash.process_mask_dkv(mask, blocks)
    counts = {}
    for name, info in (("forward", forward), ("dq", forward), ("dkv", dkv)):
        kinds = np.asarray(info.block_mask)
        # Heads with the same mask share one schedule (a leading axis of 1).
        heads = problem.heads if kinds.shape[0] == 1 else 1
        full, partial = np.sum(kinds == common.FULL), np.sum(kinds == common.PARTIAL)
        counts[name] = (int(full) * heads, int(partial) * heads)
    return counts


def estimate_mask_cycles(
    counts: dict[str, tuple[int, int]], full: dict[str, float], partial: dict[str, float]
) -> dict[str, float]:
    """{kernel: cycles} = full-block cycles x full blocks + partial x partial blocks."""
    return {k: full[k] * counts[k][0] + partial[k] * counts[k][1] for k in KERNELS}


def example_masks(problem: Problem, seed: int = 0) -> dict[str, Any]:
    """Causal, local (a window of 1/8 of the sequence) and documents (16 random lengths,
    causal inside each), one per head."""
    n, heads = problem.seq, problem.heads
    rng = np.random.default_rng(seed)
    bounds = np.sort(rng.choice(np.arange(1, n), size=15, replace=False))
    cu = np.concatenate([[0], bounds, [n]]).astype(np.int32)
    per_head = {
        "causal": splash.CausalMask((n, n)),
        "local": splash.LocalMask((n, n), window_size=(n // 8, 0), offset=0),
        "documents": splash.DocumentMask(cu, cu, causal=True),
    }
    return {name: splash.MultiHeadMask([m] * heads) for name, m in per_head.items()}
