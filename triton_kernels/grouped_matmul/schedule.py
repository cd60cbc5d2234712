"""The tile list of the gmm kernel, built on the device in one launch.

`jax_bridge.grouped_matmul.metadata.make_group_metadata` defines the list (and builds it
with XLA for the XLA backend): each local group's rows in tiles of BLOCK_M rows from the
group's first row, group after group. Built with XLA it took five small kernels ahead of
every gmm launch (~20 us on an H100, beside a ~300 us kernel); here it is one launch.
"""

import triton
import triton.language as tl


@triton.jit
def _local_groups(group_sizes_ptr, group_offset_ptr, groups,
                  G_TOTAL: tl.constexpr, GROUPS: tl.constexpr, TOTAL_SLOTS: tl.constexpr,
                  M: tl.constexpr):  # fmt: skip
    """(starts, ends) [GROUP_SLOTS] of the local groups `groups` (lanes >= GROUPS: 0, 0):
    their rows, a negative size counted as 0, cut at M (`local_group_bounds`). The offset
    is taken as `jax.lax.dynamic_slice` takes a start: a negative one counts from the end,
    then it is clamped to [0, G_TOTAL - GROUPS]."""
    offset = tl.load(group_offset_ptr)
    offset = tl.where(offset < 0, offset + G_TOTAL, offset)
    offset = tl.minimum(tl.maximum(offset, 0), G_TOTAL - GROUPS)
    # Sums in int64: G_TOTAL sizes below 2**31 add up far below 2**63, so (unlike int32,
    # where traced sizes near 2**31 wrap) the bounds are exact before they are cut at M.
    every = tl.arange(0, TOTAL_SLOTS)
    sizes = tl.load(group_sizes_ptr + every, mask=every < G_TOTAL, other=0)
    sizes = tl.maximum(sizes, 0).to(tl.int64)
    before = tl.sum(tl.where(every < offset, sizes, 0), 0)
    local = groups < GROUPS
    own = tl.load(group_sizes_ptr + offset + groups, mask=local, other=0)
    own = tl.maximum(own, 0).to(tl.int64)
    ends = before + tl.cumsum(own, 0)
    starts = ends - own
    starts = tl.where(local, tl.minimum(starts, M), 0).to(tl.int32)
    ends = tl.where(local, tl.minimum(ends, M), 0).to(tl.int32)
    return starts, ends


@triton.jit
def gmm_schedule_kernel(
    group_sizes_ptr,
    group_offset_ptr,
    group_starts_ptr,
    group_ends_ptr,
    chunk_group_ptr,
    chunk_row_start_ptr,
    num_chunks_ptr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    G_TOTAL: tl.constexpr,
    GROUPS: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    TOTAL_SLOTS: tl.constexpr,
    GROUP_SLOTS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """`GroupMetadata` of one gmm launch: grid (cdiv(NUM_SLOTS, ROWS),).

    Program p writes slots [p * ROWS, (p + 1) * ROWS) of the list; program 0 also the
    group bounds and the number of real slots.

    Args:
      group_sizes_ptr: int32 [G_TOTAL]; group_offset_ptr: int32 [1], the first local group.
      group_starts_ptr, group_ends_ptr: int32 [GROUPS]: each local group's rows.
      chunk_group_ptr, chunk_row_start_ptr: int32 [NUM_SLOTS]: the list (slot s: rows
        [chunk_row_start, min(chunk_row_start + BLOCK_M, end)) of local group chunk_group);
        num_chunks_ptr: int32 [1], its real slots.
      TOTAL_SLOTS, GROUP_SLOTS: powers of two >= G_TOTAL and >= GROUPS.
    """
    groups = tl.arange(0, GROUP_SLOTS)
    starts, ends = _local_groups(group_sizes_ptr, group_offset_ptr, groups,
                                 G_TOTAL, GROUPS, TOTAL_SLOTS, M)  # fmt: skip
    tiles = tl.where(ends > starts, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    slot_ends = tl.cumsum(tiles, 0)
    slot_starts = slot_ends - tiles
    slots = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    # A slot's group: how many local groups end at or before it (empty ones end where
    # they start); surplus slots are clipped to the last group.
    ended = (slot_ends[None, :] <= slots[:, None]) & (groups < GROUPS)[None, :]
    group = tl.minimum(tl.sum(ended.to(tl.int32), 1), GROUPS - 1)
    mine = groups[None, :] == group[:, None]
    first_row = tl.sum(tl.where(mine, starts[None, :], 0), 1)
    first_slot = tl.sum(tl.where(mine, slot_starts[None, :], 0), 1)
    row_start = first_row + (slots - first_slot) * BLOCK_M
    row_start = tl.minimum(tl.maximum(row_start, 0), M - 1)  # M >= 1: no launch without rows
    ok = slots < NUM_SLOTS
    tl.store(chunk_group_ptr + slots, group, mask=ok)
    tl.store(chunk_row_start_ptr + slots, row_start, mask=ok)
    if tl.program_id(0) == 0:
        tl.store(group_starts_ptr + groups, starts, mask=groups < GROUPS)
        tl.store(group_ends_ptr + groups, ends, mask=groups < GROUPS)
        tl.store(num_chunks_ptr, tl.sum(tiles, 0))
