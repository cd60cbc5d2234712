"""`MatmulOptions`: the static half of one gmm or tgmm call.

Its own module so the backends can name the type they receive without importing `api`
(which imports them): every import in the op runs one way, api -> backends -> options.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_bridge.core.options import OpOptions
from jax_bridge.grouped_matmul import checks

__all__ = ["MatmulOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatmulOptions(OpOptions):
    """The static half of one gmm or tgmm call (see `OpOptions`).

    `config` is a `GroupedMatmulConfig` (every launch), a `GroupedMatmulConfigs` (one per
    kernel) or None. `tiling` is the caller's tuple,
    callable or None, resolved per call against the call's own sizes, so the backward
    matmuls get tilings for their shapes. `lhs_token_major` is used by tgmm only: its
    lhs is `[m, k]` instead of `[k, m]`.
    """

    preferred_element_type: np.dtype
    tiling: checks.TilingArg = None
    transpose_rhs: bool = False
    lhs_token_major: bool = False
