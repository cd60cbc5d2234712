"""The tile lists of the varlen attention kernels, built on the device in one launch.

The attention kernels take their work as tile lists (`chunk_indices`, see
`flash_attention_fwd`) over an extended set of sequences that covers every packed row
(`jax_bridge.attention.triton` describes it): B given sequences plus a head and a tail
on each axis. Built with XLA, these lists took seven small kernels ahead of every
attention kernel (concatenations, a comparison, a sort, a gather): ~50 us of a 320 us
forward on an H100. This kernel builds the extended `cu_seqlens` and both lists at once.

Order: under a right bound (causal, right window) a tile's work depends on its index, so
the lists put the heaviest first (programs start in grid order, and light tiles first
would leave the last wave half empty). A query tile t of a sequence with n tiles sees
about t + 1 key tiles; a key tile t about n - t query tiles. Both keys are "how many of
the sequence's tiles a tile spans", c in [1, n], so one rank serves both: rows by
descending c, ties in sequence order,

    rank(s, t) = sum_s' max(0, n_s' - c) + #{s' < s : n_s' >= c},

which is a permutation of [0, total tiles) (every c of sequence s' is taken by exactly one
of its tiles, for c <= n_s'), so each row is written once, with no sort.
"""

import triton
import triton.language as tl


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _boundaries(cu_seqlens_ptr, slots, batch, total, KEY_SIDE: tl.constexpr):
    """The extended cu_seqlens at `slots` ([SLOTS] indices >= 0): B + 5 boundaries, then
    `total` in every slot past them.

    Queries (KEY_SIDE False): 0, cu[0], cu[0..B], total, total: a query head without keys,
    an empty key head, the B sequences, a query tail without keys, an empty key tail.
    Keys: 0, 0, cu[0..B], cu[B], total, the mirror image. cu_seqlens is clipped to
    [0, total] and made non-decreasing (a running max): invalid values (unchecked under
    jit) give garbage, never an out-of-bounds row. Slots that are one apart give the
    boundaries one apart, since every boundary before slot 1 is 0.
    """
    given = tl.load(cu_seqlens_ptr + tl.minimum(tl.maximum(slots - 2, 0), batch))
    if KEY_SIDE:
        first_total = batch + 4
        given = tl.where(slots < 2, 0, given)
    else:
        first_total = batch + 3
        given = tl.where(slots == 0, 0, given)
    given = tl.where(slots >= first_total, total, given)
    given = tl.minimum(tl.maximum(given, 0), total)
    return tl.associative_scan(given, 0, _max)


@triton.jit
def _tiles_per_sequence(cu_seqlens_ptr, slots, batch, total, BLOCK: tl.constexpr,
                        KEY_SIDE: tl.constexpr):  # fmt: skip
    """(first boundary, tiles) of each extended sequence at `slots`: cdiv(length, BLOCK)
    tiles; 0 past the B + 4 sequences."""
    start = _boundaries(cu_seqlens_ptr, slots, batch, total, KEY_SIDE)
    end = _boundaries(cu_seqlens_ptr, slots + 1, batch, total, KEY_SIDE)
    return start, (end - start + BLOCK - 1) // BLOCK


@triton.jit
def _write_rows(tiles_ptr, first_row, num_rows, tiles, slots, HEAVIEST_FIRST: tl.constexpr,
                QUERY_TILES: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Places the tiles [first_row, first_row + ROWS) of packed order, of one axis, in its
    list (rows < num_rows).

    The r-th tile in packed order is (s, t) with s the sequence whose tiles span r; it
    goes to row r, or to its rank (module docstring, anywhere in the list) with
    HEAVIEST_FIRST. Past the real tiles, row r itself gets (-1, -1): the ranks of real
    tiles are exactly the rows before them, so every row is written once.
    """
    ends = tl.cumsum(tiles, 0)
    starts = ends - tiles
    real_tiles = tl.sum(tiles, 0)
    rows = first_row + tl.arange(0, ROWS)
    seq = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), 1)
    mine = slots[None, :] == seq[:, None]
    t = rows - tl.sum(tl.where(mine, starts[None, :], 0), 1)
    if HEAVIEST_FIRST:
        if QUERY_TILES:
            span = t + 1
        else:
            span = tl.sum(tl.where(mine, tiles[None, :], 0), 1) - t
        longer = tl.sum(tl.maximum(tiles[None, :] - span[:, None], 0), 1)
        ahead = (slots[None, :] < seq[:, None]) & (tiles[None, :] >= span[:, None])
        rank = longer + tl.sum(ahead.to(tl.int32), 1)
    else:
        rank = rows
    real = rows < real_tiles
    target = tl.where(real, rank, rows)
    # `chunk_bound` keeps real_tiles <= num_rows, so a rank never passes the list; the
    # second term keeps a broken bound from writing past the buffer.
    ok = (rows < num_rows) & (target < num_rows)
    tl.store(tiles_ptr + 2 * target, tl.where(real, seq, -1), mask=ok)
    tl.store(tiles_ptr + 2 * target + 1, tl.where(real, t, -1), mask=ok)


@triton.jit
def attention_schedule_kernel(
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    batch,
    total_q,
    total_k,
    num_q_rows,
    num_k_rows,
    cu_q_out_ptr,
    cu_k_out_ptr,
    q_tiles_ptr,
    k_tiles_ptr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLOTS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAVIEST_FIRST: tl.constexpr,
    KEY_LIST: tl.constexpr,
):
    """Extended cu_seqlens and the query (and key) tile lists of one attention call.

    Grid: (cdiv(max list rows, ROWS), 2 with KEY_LIST else 1). Program (r, a) places the
    tiles [r * ROWS, (r + 1) * ROWS) of packed order in axis a's list (0: queries, 1:
    keys; `_write_rows`); program (0, 0) also writes both extended cu_seqlens.

    Args:
      cu_seqlens_q_ptr, cu_seqlens_k_ptr: int32 [batch + 1], as given.
      batch: B; total_q, total_k: the packed rows of each axis.
      num_q_rows, num_k_rows: rows of each list (static bounds, e.g. `chunk_bound`).
      cu_q_out_ptr, cu_k_out_ptr: int32 [B + 5]: the extended cu_seqlens (`_boundaries`).
      q_tiles_ptr: int32 [num_q_rows, 2]: (extended sequence, tile of BLOCK_Q rows).
      k_tiles_ptr: int32 [num_k_rows, 2] likewise with BLOCK_K (unwritten without KEY_LIST).
      SLOTS: a power of two >= B + 5; ROWS: list rows per program.
      HEAVIEST_FIRST: rank the rows (module docstring) instead of packed order.
    """
    slots = tl.arange(0, SLOTS)
    axis = tl.program_id(1)
    first_row = tl.program_id(0) * ROWS
    if axis == 0:
        q_start, q_tiles = _tiles_per_sequence(
            cu_seqlens_q_ptr, slots, batch, total_q, BLOCK_Q, False
        )
        _write_rows(q_tiles_ptr, first_row, num_q_rows, q_tiles, slots, HEAVIEST_FIRST, True, ROWS)
        if tl.program_id(0) == 0:
            k_start = _boundaries(cu_seqlens_k_ptr, slots, batch, total_k, True)
            tl.store(cu_q_out_ptr + slots, q_start, mask=slots < batch + 5)
            tl.store(cu_k_out_ptr + slots, k_start, mask=slots < batch + 5)
    if KEY_LIST:
        if axis == 1:
            _, k_tiles = _tiles_per_sequence(cu_seqlens_k_ptr, slots, batch, total_k, BLOCK_K, True)
            _write_rows(
                k_tiles_ptr, first_row, num_k_rows, k_tiles, slots, HEAVIEST_FIRST, False, ROWS
            )
