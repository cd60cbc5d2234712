"""`AttentionOptions`: the static half of one varlen_attention call.

Its own module so the backends can name the type they receive without importing `api`
(which imports them): every import in the op runs one way, api -> backends -> options.
"""

from __future__ import annotations

import dataclasses

from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.options import OpOptions

__all__ = ["AttentionOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionOptions(OpOptions):
    """The static half of one varlen_attention call (see `OpOptions`).

    `config` is an `AttentionConfigs` or None. The max_seqlen hints are deliberately
    absent: no backend uses them, so calls differing only in the hints share one trace.
    `op`: the public op the user called, which the autodiff refusals name.
    """

    spec: AttentionSpec
    op: str = "varlen_attention"
