"""What an attention call computes, independent of how: the static half of its arguments.

Every implementation (Triton kernels, the blockwise XLA path, the dense test oracle)
takes an `AttentionSpec`, so the semantics below are stated once.

Within sequence b, with `len_q = cu_seqlens_q[b+1] - cu_seqlens_q[b]` and `len_k`
likewise, query `i` and key `j` (positions within the sequence, from 0) are aligned at the
bottom-right corner (the FlashAttention >= 2.1 convention): query i sits at key position
`diag(i) = i + len_k - len_q`.

* score:   s = softmax_scale * <q_i, k_j>
* soft cap: s = logits_soft_cap * tanh(s / logits_soft_cap)         (when set)
* ALiBi:   s = s - slope[h] * |diag(i) - j|                          (when slopes are given)
* allowed: diag(i) - window_left <= j <= diag(i) + window_right, where causal means
           window_right = 0 and a None bound is unbounded on that side
* softmax over the allowed keys and, with sinks, one extra logit `sinks[h]` per row that
  joins the denominator and carries no value.

A row with no allowed key (and no sink) outputs 0 and has log-sum-exp -inf; with a sink,
it outputs 0 and has log-sum-exp `sinks[h]`. The log-sum-exp is natural-log, float32.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

# A window side this wide masks nothing in any sequence the kernels index (int32 token
# offsets; a wider side would overflow `diag + side` there): it is stored as None.
UNBOUNDED_WINDOW = 2**30


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static attention options; see the module docstring for their exact meaning.

    Attributes:
      softmax_scale: multiplies q.k before anything else.
      causal: keys after the query's (bottom-right aligned) diagonal are masked.
      window_left: keys further than this left of the diagonal are masked (None: unbounded;
        a side of `UNBOUNDED_WINDOW` = 2^30 or more is stored as None).
      window_right: keys further than this right of the diagonal are masked (None:
        unbounded). `causal=True` makes it 0.
      logits_soft_cap: cap * tanh(s / cap) on the scaled scores (None: off); a finite
        number > 0 (an infinite cap would compute inf * tanh(s / inf) = NaN: pass None).

    Raises ValueError naming the argument for a non-finite (or bool) scale, a window bound
    that is not None or an int >= 0, or a cap that is not None or a finite number > 0.
    Frozen, hence hashable: usable as a static (jit) argument.
    """

    softmax_scale: float
    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self):
        if not _is_finite_real(self.softmax_scale) or self.softmax_scale == 0:
            # Zero makes every score 0 (a uniform average, zero dQ and dK): almost always a
            # bug such as `1 // head_dim**0.5`; block_sparse_attention refuses it too.
            raise ValueError(
                f"softmax_scale must be a finite non-zero number, got {self.softmax_scale!r}"
            )
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(
                    f"sliding_window: {name} must be None or an int >= 0, got {value!r}"
                )
            if value is not None and value >= UNBOUNDED_WINDOW:
                object.__setattr__(self, name, None)
        cap = self.logits_soft_cap
        if cap is not None and not (_is_finite_real(cap) and cap > 0):
            raise ValueError(f"logits_soft_cap must be a finite number > 0 or None, got {cap!r}")
        if self.causal:
            right = 0 if self.window_right is None else min(self.window_right, 0)
            object.__setattr__(self, "window_right", right)

    @classmethod
    def create(
        cls,
        head_dim: int,
        *,
        causal: bool = False,
        sliding_window: tuple[int | None, int | None] | None = None,
        logits_soft_cap: float | None = None,
        softmax_scale: float | None = None,
    ) -> AttentionSpec:
        """Builds a spec from the public arguments; `softmax_scale` defaults to 1/sqrt(head_dim)."""
        if sliding_window is not None and (
            not isinstance(sliding_window, tuple | list) or len(sliding_window) != 2
        ):
            raise ValueError(f"sliding_window must be (left, right), got {sliding_window!r}")
        left, right = (None, None) if sliding_window is None else sliding_window
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        cap = logits_soft_cap
        # Plain floats (e.g. from numpy scalars) keep specs equal and hashes stable; the
        # checks in __post_init__ see the original value's type.
        if _is_finite_real(scale):
            scale = float(scale)
        if _is_finite_real(cap):
            cap = float(cap)
        return cls(scale, bool(causal), left, right, cap)


def _is_finite_real(value: object) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
