"""Expert-parallel dispatch and combine with `jax.lax.all_to_all` (inside `jax.shard_map`).

Tokens are sharded over a mesh axis of D devices, and so are the experts: device `d`
holds experts `[d * L, (d + 1) * L)`, L = E / D. Each device routes its own tokens
(`route`), sends every other device the copies routed to that device's experts, runs its
L experts on what it received, and sends the results back to where the tokens live:

    routing = route(x_local, expert_ids, num_experts)          # sorted by global expert
    sent = all_to_all_dispatch(routing, "expert", capacity=C)  # rows for my L experts
    y = my_experts(sent.x, sent.group_sizes)                    # [D*C, d_out], e.g. gmm
    y_sorted = all_to_all_combine(y, sent, "expert")            # back in routing's order
    out = unroute(y_sorted, routing, router_weights)            # [T_local, d_out]

Shapes are static: every (source, destination) pair exchanges a buffer of `capacity` (C)
rows, padded with zeros. Because `route` sorts by expert, the copies bound for device
`d` are one contiguous run of the sorted rows; the first C of them are sent and the rest
are **dropped**: a dropped copy contributes zero to its token's output (the residual
connection around the block carries the token on). Which copies drop is deterministic:
within a (source, destination) pair, lower expert ids first, then token order. The
default capacity, every local copy (`T_local * top_k`), never drops, at D times the
traffic of a balanced load; the usual choice is `capacity_factor * T_local * top_k / D`.

Traffic per device and direction: `D * C * (hidden * itemsize + 4)` bytes (rows plus
their int32 local expert ids) to dispatch, `D * C * d_out * itemsize` to combine
(`all_to_all_bytes` computes both).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.validation import check_static_int, naming_op
from jax_bridge.moe.routing import Routing, route, unroute


class Dispatched(NamedTuple):
    """What one device received from `all_to_all_dispatch`, and how to send it back.

    Attributes:
      local: the received rows routed by *local* expert (`route` with L + 1 groups, the
        last one the zero padding): `local.sorted_x` is [D*C, hidden].
      slot: int32 [T_local*K], for each row of the source routing, its slot `d * C + c`
        in the buffer sent to device `d`; `D * C` when the copy was dropped.
    """

    local: Routing
    slot: jax.Array

    @property
    def x(self) -> jax.Array:
        """[D*C, hidden]: the received rows, sorted by local expert, padding last."""
        return self.local.sorted_x

    @property
    def group_sizes(self) -> jax.Array:
        """int32 [L]: received rows per local expert (their sum <= D*C)."""
        return self.local.group_sizes[:-1]


def all_to_all_bytes(
    *, devices: int, capacity: int, hidden: int, d_out: int, itemsize: int, out_itemsize: int
) -> tuple[int, int]:
    """(dispatch, combine) bytes one device sends (and receives) per call.

    Each all_to_all exchanges a [D, C, ...] buffer; the D-th of it addressed to the
    device itself stays local but is counted, as XLA copies it.
    """
    dispatch = devices * capacity * (hidden * itemsize + np.dtype(np.int32).itemsize)
    return dispatch, devices * capacity * d_out * out_itemsize


def _send_plan(routing: Routing, devices: int, capacity: int) -> tuple[jax.Array, ...]:
    """For each send slot (d, c): the sorted row it carries and whether it is real; for
    each sorted row: its slot (D*C when dropped).

    Invariant: sorted rows bound for device d are rows [start[d], start[d] + count[d]),
    because experts of device d are the contiguous id range [d*L, (d+1)*L).
    """
    rows = routing.sorted_x.shape[0]
    experts = routing.num_experts
    local_experts = experts // devices
    count = routing.group_sizes.reshape(devices, local_experts).sum(axis=1)  # [D]
    start = jnp.cumsum(count) - count
    c = jnp.arange(capacity, dtype=jnp.int32)
    sent = c[None, :] < jnp.minimum(count, capacity)[:, None]  # [D, C]
    # Padding slots read row `rows`: the zero row appended by the caller.
    source_row = jnp.where(sent, start[:, None] + c[None, :], rows)
    # Source side: an out-of-range id (== E, traced input only) has no destination.
    dest = routing.sorted_expert_ids // local_experts  # [T*K], D for invalid ids
    pos = jnp.arange(rows, dtype=jnp.int32) - start[jnp.minimum(dest, devices - 1)]
    kept = (dest < devices) & (pos < capacity)
    slot = jnp.where(kept, dest * capacity + pos, devices * capacity)
    return source_row, sent, slot


def all_to_all_dispatch(
    routing: Routing, axis_name: str, *, capacity: int | None = None
) -> Dispatched:
    """Sends each device the copies routed to its experts (call inside `jax.shard_map`).

    Args:
      routing: this device's `route(x_local, expert_ids, E)` with global expert ids; E
        must be a multiple of D, the size of `axis_name`.
      axis_name: the mesh axis the experts (and tokens) are sharded over.
      capacity: C, the most rows one device sends another (a static int >= 1); None:
        `T_local * top_k` (all of them, never drops). Rows past C are dropped (zero
        output) - see the module docstring.

    Returns:
      `Dispatched`: `x` [D*C, hidden] sorted by local expert (rows of device s's tokens
      before device s+1's within an expert), `group_sizes` int32 [L].
    """
    with naming_op("all_to_all_dispatch"):
        devices = jax.lax.axis_size(axis_name)
        if routing.num_experts % devices:
            raise ValueError(
                f"num_experts ({routing.num_experts}) must be a multiple of the size of "
                f"axis {axis_name!r} ({devices})."
            )
        rows = routing.sorted_x.shape[0]
        if capacity is None:
            capacity = max(rows, 1)
        capacity = check_static_int(capacity, "capacity", minimum=1)
    local_experts = routing.num_experts // devices
    source_row, sent, slot = _send_plan(routing, devices, capacity)
    hidden = routing.sorted_x.shape[1]
    padded = jnp.concatenate([routing.sorted_x, jnp.zeros((1, hidden), routing.sorted_x.dtype)])
    send_x = padded[source_row]  # [D, C, hidden]; gather, so the gradient is a scatter-add
    d = jnp.arange(devices, dtype=jnp.int32)[:, None]
    ids = jnp.concatenate([routing.sorted_expert_ids, jnp.zeros((1,), jnp.int32)])
    # Local expert ids; padding gets L, an extra group after the real ones.
    send_ids = jnp.where(sent, ids[source_row] - d * local_experts, local_experts)
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0)  # recv_x[s]: sent to me by s
    recv_ids = jax.lax.all_to_all(send_ids, axis_name, 0, 0)
    local = route(
        recv_x.reshape(devices * capacity, hidden),
        recv_ids.reshape(devices * capacity),
        local_experts + 1,
    )
    return Dispatched(local=local, slot=slot)


def all_to_all_combine(y: jax.Array, dispatched: Dispatched, axis_name: str) -> jax.Array:
    """Sends the experts' results back to the tokens' devices (inside `jax.shard_map`).

    Args:
      y: [D*C, d_out], one row per row of `dispatched.x` (its order).
      dispatched: what `all_to_all_dispatch` returned on this device.
      axis_name: the axis given to `all_to_all_dispatch`.

    Returns:
      [T_local*K, d_out] in the order of the source `routing` (ready for `unroute`);
      dropped copies are zero.
    """
    with naming_op("all_to_all_combine"):
        rows = dispatched.x.shape[0]
        if y.ndim != 2 or y.shape[0] != rows:
            raise ValueError(f"y must have shape [{rows}, d_out], got shape {tuple(y.shape)}.")
    devices = jax.lax.axis_size(axis_name)
    in_slots = unroute(y, dispatched.local)  # [D*C, d_out], back in receive-buffer order
    back = jax.lax.all_to_all(in_slots.reshape(devices, rows // devices, -1), axis_name, 0, 0)
    back = back.reshape(rows, -1)  # back[d*C + c]: the result for my slot (d, c)
    padded = jnp.concatenate([back, jnp.zeros((1, back.shape[1]), back.dtype)])
    return padded[dispatched.slot]  # dropped copies read the zero row
