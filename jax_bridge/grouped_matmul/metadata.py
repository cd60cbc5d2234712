"""Where each group's rows lie, and the chunk indices (work items) the gmm kernel visits.

All sizes are static (they depend on shapes only), all values are computed by
vectorised jnp, so the metadata works under `jax.jit` with traced `group_sizes` and a
traced `group_offset` (expert parallelism inside `shard_map`).

Rows are sorted by group: of the `len(group_sizes)` groups, group `i` owns rows
`[sum(group_sizes[:i]), sum(group_sizes[:i + 1]))`. A device holding experts
`[offset, offset + num_groups)` ("local" groups) computes only those groups' rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_bridge.core.numerics import cdiv
from jax_bridge.host.cu_seqlens import count_at_or_below


class GroupMetadata(NamedTuple):
    """The group bounds and chunk indices of one gmm launch (a pytree of int32 arrays).

    "Chunk indices" is the package's one name for a list of (owner, chunk) work items,
    one per kernel program: `prepare_chunk_indices` gives (sequence, chunk) pairs for
    attention; here the owner is a local group and the chunk `tm` of its rows, counted
    from its first row (so only a group's last tile is partial, and no tile holds rows of
    two groups).

    Attributes:
      group_starts, group_ends: [num_groups], the rows `[start, end)` of each local
        group, clipped to `[0, m]`.
      chunk_group: [num_slots], the local group of each tile slot.
      chunk_row_start: [num_slots], the first row of each tile slot: slot s computes rows
        `[chunk_row_start[s], min(chunk_row_start[s] + tm, group end))`.
      num_chunks: [1], how many leading slots are real chunks; the rest are surplus.

    Invariants (for slots `s < num_chunks`, whatever the sizes: traced ones are never
    checked, and `local_group_bounds` counts a negative size as 0 and cuts the groups
    at m, without int32 wrap-around):
      * the local groups tile the rows `[group_starts[0], group_ends[-1])`, one after
        another, without gaps or overlaps;
      * `chunk_group` is non-decreasing and group g's slots start at its first row and
        step by `tm`: `cdiv(size_g, tm)` tiles, each row of a local group computed exactly
        once, by a tile of its own group; empty groups have no tiles;
      * `num_chunks <= num_slots = cdiv(m, tm) + num_groups - 1`.
    Surplus slots hold in-range values (group `num_groups - 1`, a row in `[0, m)`) so that
    reading them is safe, but must not be computed.
    """

    group_starts: jax.Array
    group_ends: jax.Array
    chunk_group: jax.Array
    chunk_row_start: jax.Array
    num_chunks: jax.Array


def num_chunk_slots(m: int, block_m: int, num_groups: int) -> int:
    """Static length of the chunk list: `cdiv(m, block_m) + num_groups - 1`.

    Why it is enough: group g takes `cdiv(size_g, block_m) < size_g / block_m + 1` tiles,
    and the sizes of the local groups sum to at most m, so the integer sum of their tiles
    is below `m / block_m + num_groups`, hence at most `cdiv(m, block_m) + num_groups - 1`.
    """
    return max(cdiv(m, block_m) + num_groups - 1, 1)


def group_ends(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 [num_groups_total]: one past each group's last row, cut at m.

    `ends[i] = min(max(group_sizes[0], 0) + ... + max(group_sizes[i], 0), m)`, exactly,
    whatever the (traced, unchecked) sizes: a negative size counts as 0, and the sums
    saturate at m instead of wrapping around int32 (sizes near 2**31 would wrap a plain
    `cumsum` to small or negative ends, and groups would overlap).
    """
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
    # Prefix sums under min(a + b, m), which is associative on [0, m]; written as
    # a + min(b, m - a) it never leaves [0, m], so no partial sum can overflow.
    return jax.lax.associative_scan(lambda a, b: a + jnp.minimum(b, m - a), sizes)


def local_group_bounds(
    group_sizes: jax.Array,
    *,
    m: int,
    group_offset: jax.Array | int,
    num_groups: int,
) -> tuple[jax.Array, jax.Array]:
    """Rows `[starts[i], ends[i])` of local group `i` (global group `group_offset + i`).

    Args:
      group_sizes: int32 [num_groups_total], rows per group, in row order.
      m: number of rows.
      group_offset: first local group (int or int32 scalar, may be traced), taken as
        `jax.lax.dynamic_slice` takes a start: a negative one counts from the end, then
        it is clamped to `[0, num_groups_total - num_groups]`.
      num_groups: number of local groups (static).

    Returns:
      starts, ends: int32 [num_groups], non-decreasing, in `[0, m]`, with
      `starts[i + 1] = ends[i]`: a traced negative size counts as 0 (such a group is empty
      and overlaps none), and the groups are cut to the m rows that exist (`group_ends`),
      so that a traced `sum(group_sizes) > m`, even one past int32, never addresses rows
      past `m`.
    """
    ends = group_ends(group_sizes, m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offset = jnp.asarray(group_offset, jnp.int32).reshape(())
    starts = jax.lax.dynamic_slice_in_dim(starts, offset, num_groups)
    ends = jax.lax.dynamic_slice_in_dim(ends, offset, num_groups)
    return starts, ends


# Jitted (sizes static) so that an eager call (the Triton backend's, op by op) compiles one
# program per shape; inlined under an outer jit.
@functools.partial(jax.jit, static_argnames=("m", "block_m", "num_groups"))
def make_group_metadata(
    group_sizes: jax.Array,
    *,
    m: int,
    block_m: int,
    group_offset: jax.Array | int,
    num_groups: int,
) -> GroupMetadata:
    """The chunk indices for rows of `num_groups` local groups starting at `group_offset`.

    Args:
      group_sizes: int32 [num_groups_total].
      m: number of rows of lhs.
      block_m: rows per tile.
      group_offset: first local group (int or int32 scalar, may be traced).
      num_groups: number of local groups (static, >= 1).
    """
    starts, ends = local_group_bounds(
        group_sizes, m=m, group_offset=group_offset, num_groups=num_groups
    )
    num_slots = num_chunk_slots(m, block_m, num_groups)

    # Tiles of each group, from its first row. An empty group (also one clipped away
    # past m) has none, wherever its empty range sits.
    tiles_per_group = jnp.where(ends > starts, cdiv(ends - starts, block_m), 0)

    # Slots are handed out group after group: group i owns slots
    # [slot_ends[i] - tiles_per_group[i], slot_ends[i]).
    slot_ends = jnp.cumsum(tiles_per_group)
    slot_starts = slot_ends - tiles_per_group
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    # The owner of slot s is the first group whose slots end after s: the number of
    # groups ending at or before s (counted loop-free, no searchsorted `while`). Empty
    # groups end where they start, so they are skipped. Surplus slots (s >= num_chunks)
    # would get num_groups: clip into range.
    chunk_group = count_at_or_below(slot_ends, num_slots)
    chunk_group = jnp.minimum(chunk_group, num_groups - 1)
    chunk_row_start = starts[chunk_group] + (slots - slot_starts[chunk_group]) * block_m
    chunk_row_start = jnp.clip(chunk_row_start, 0, max(m - 1, 0))

    return GroupMetadata(
        group_starts=starts,
        group_ends=ends,
        chunk_group=chunk_group,
        chunk_row_start=chunk_row_start.astype(jnp.int32),
        num_chunks=slot_ends[-1:].astype(jnp.int32),
    )


def chunk_row_bounds(meta: GroupMetadata, block_m: int) -> tuple[jax.Array, jax.Array]:
    """Rows `[lo[s], hi[s])` that slot `s` computes: up to `block_m` of its group's rows.

    Args:
      meta: from `make_group_metadata(..., block_m=block_m)`.
      block_m: rows per tile, as given to `make_group_metadata`.

    Returns:
      lo, hi: int32 [num_slots]. For real chunks (`s < num_chunks`) the ranges are
      nonempty and pairwise disjoint, and together they are exactly the rows of the local
      groups (the invariants of `GroupMetadata`); surplus slots give ranges that must be
      ignored, like the slots themselves.
    """
    lo = meta.chunk_row_start
    hi = jnp.minimum(meta.group_ends[meta.chunk_group], lo + block_m)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)
