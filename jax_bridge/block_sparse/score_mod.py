"""The user's score hook of `block_sparse_attention` (FlexAttention's `score_mod`).

A `ScoreMod` is written twice, once in jax.numpy (the reference and the XLA path) and once
as a `@triton.jit` function (the Triton kernels), like a `PredicateMask`; the op applies
it to every scaled (and soft-capped) score before the mask. Its gradient flows through
the score: the XLA path and the reference differentiate the JAX function; the Triton
kernels call `triton_grad` for the derivative, or take 1 when it is None (an additive
hook: a relative bias, ALiBi).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ScoreMod"]


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """score' = fn(score, batch, head, q_index, kv_index), before masking.

    Attributes:
      fn: the hook in jax.numpy: float32 scores and int32 batch / query-head / query
        position / key position arrays that broadcast against them -> float32 scores of
        the same shape. Elementwise in the score; differentiable in it where the
        gradient is wanted.
      triton_fn: the same hook as a `@triton.jit` function of (score tile, batch, head,
        q_index, kv_index) (scalars and index tensors that broadcast against the tile),
        or None: the Triton backend then refuses the call.
      triton_grad: `@triton.jit` d score' / d score with the same arguments, or None for
        an additive hook (derivative 1).
      name: a label for errors (default fn's __name__).

    Positions are row indices of the sequences (0 .. q_len - 1, 0 .. kv_len - 1).
    """

    fn: Callable[..., Any]
    triton_fn: Any = None
    triton_grad: Any = None
    name: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"ScoreMod: fn must be callable, got {type(self.fn).__name__}")
        for field in ("triton_fn", "triton_grad"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise TypeError(f"ScoreMod: {field} must be a @triton.jit function or None")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", "score_mod"))

    def apply(self, scores: jax.Array, batch, head, q_index, kv_index) -> jax.Array:
        """fn on `scores` with its index arrays (each broadcasting against scores),
        checked to keep the scores' shape and float dtype."""
        out = jnp.asarray(self.fn(scores, batch, head, q_index, kv_index))
        if out.shape != scores.shape or not jnp.issubdtype(out.dtype, jnp.floating):
            raise ValueError(
                f"block_sparse_attention: score_mod {self.name!r} must return float scores "
                f"of shape {scores.shape}, got {out.dtype}{list(out.shape)}."
            )
        return out.astype(scores.dtype)
