"""Mixture-of-experts helpers built on `grouped_matmul`: `routing` (route / unroute:
tokens sorted by expert and back), `dispatch` (the expert-parallel all-to-all dispatch
and combine, inside `jax.shard_map`) and `block` (an example MoE feed-forward block, on
one device and expert-sharded). Imports `core` and `grouped_matmul` only."""

from jax_bridge.moe.block import (
    MoEParams,
    expert_feed_forward,
    expert_parallel_moe_feed_forward,
    init_moe_params,
    moe_feed_forward,
    top_k_router,
)
from jax_bridge.moe.dispatch import (
    Dispatched,
    all_to_all_bytes,
    all_to_all_combine,
    all_to_all_dispatch,
)
from jax_bridge.moe.routing import Routing, route, unroute

__all__ = [
    "Dispatched",
    "MoEParams",
    "Routing",
    "all_to_all_bytes",
    "all_to_all_combine",
    "all_to_all_dispatch",
    "expert_feed_forward",
    "expert_parallel_moe_feed_forward",
    "init_moe_params",
    "moe_feed_forward",
    "route",
    "top_k_router",
    "unroute",
]
