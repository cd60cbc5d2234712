"""`BlockSparseOptions`: the static half of one block_sparse_attention call.

Its own module so the backends can name the type they receive without importing `api`
(which imports them): every import in the op runs one way, api -> backends -> options.
"""

from __future__ import annotations

import dataclasses

from jax_bridge.block_sparse.masks import TracedDocument
from jax_bridge.block_sparse.score_mod import ScoreMod
from jax_bridge.core.options import OpOptions
from pallas_tpu.splash.config import BlockSizes
from pallas_tpu.splash.masks import Mask
from triton_kernels.flash_attention.config import AttentionConfigs

__all__ = ["BlockSparseOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSparseOptions(OpOptions):
    """The static half of one call (see `OpOptions`).

    mask: the mask's static half (`masks.split_mask`: the mask, or a traced document's
    shape / window / row orders); softmax_scale: resolved; logits_soft_cap: None is off;
    block_sizes: as given (each backend fills its own defaults); config: the Triton
    kernels' launch configurations (`checks.check_config`; None: the defaults);
    score_mod: the user's score hook or None; hook_heads: the caller's number of each
    query head of this call, the head the score hook sees (None: the call's own numbers;
    a call on a subset of the heads, `api._by_head_groups`, sets it).
    """

    mask: Mask | TracedDocument
    softmax_scale: float
    logits_soft_cap: float | None = None
    block_sizes: BlockSizes | None = None
    config: AttentionConfigs | None = None
    score_mod: ScoreMod | None = None
    hook_heads: tuple[int, ...] | None = None
