"""Grouped matmul kernels for mixture-of-experts layers.

Tokens (rows) arrive sorted by group (expert); group `g` owns the contiguous rows
`[group_start[g], group_end[g])`.

* `gmm_kernel`: `out[rows of g] = lhs[rows of g] @ rhs[g]`. Programs walk a list of
  (group, first row) tiles computed ahead of it (`gmm_schedule_kernel`): each group's
  rows from its first one, BLOCK_M at a time, so a tile never holds two groups' rows and
  only a group's last tile is partial (masked to the group).
* `tgmm_kernel`: `out[g] = lhs[:, rows of g] @ rhs[rows of g]`, one program per
  (group, k tile, n tile), summing over the group's rows. This is gmm's weight gradient.

Both accumulate in float32 and cast once when storing. Shapes are constexprs (JAX
shapes are static, so every shape compiles once anyway, and the compiler sees the
strides). Offsets that scale with the rows or the groups are computed in int64; within
one group's [K, N] weights in int32 (the bridge refuses K * N >= 2**31).
"""

import triton
import triton.language as tl


@triton.jit
def _store_tile(out_ptr, init_ptr, offsets, mask, acc, ACCUMULATE: tl.constexpr):
    """out[offsets] = acc (+ init[offsets] where ACCUMULATE) in out's dtype, where `mask`."""
    if ACCUMULATE:
        acc += tl.load(init_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gmm_descriptors(
    lhs_ptr, rhs_ptr, num_groups, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSPOSE_RHS: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr,
):  # fmt: skip
    """Tensor descriptors over lhs [M, K] and rhs [G, K, N] (or [G, N, K]): built once a
    program, whatever groups its tiles take, or (HOST_DESCRIPTORS) the launch's own,
    which lhs_ptr and rhs_ptr then are. The weights' descriptor is 3-D, so a tile's k rows
    (or n rows) past the group's own read 0 instead of the next group's weights."""
    if HOST_DESCRIPTORS:  # (Triton 3.6 compiles what follows a return: no early one)
        lhs, rhs = lhs_ptr, rhs_ptr
    else:
        lhs = tl.make_tensor_descriptor(lhs_ptr, shape=[M, K], strides=[K, 1],
                                        block_shape=[BLOCK_M, BLOCK_K])  # fmt: skip
        if TRANSPOSE_RHS:
            rhs = tl.make_tensor_descriptor(rhs_ptr, shape=[num_groups, N, K],
                                            strides=[N * K, K, 1],
                                            block_shape=[1, BLOCK_N, BLOCK_K])  # fmt: skip
        else:
            rhs = tl.make_tensor_descriptor(rhs_ptr, shape=[num_groups, K, N],
                                            strides=[K * N, N, 1],
                                            block_shape=[1, BLOCK_K, BLOCK_N])  # fmt: skip
    return lhs, rhs


@triton.jit
def _gmm_tiles_by_descriptor(
    acc, lhs, rhs, group, row0, col0, k_end, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSPOSE_RHS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """acc += lhs[row0 : row0 + BLOCK_M, :k_end] @ rhs[group][:k_end, col0 : col0 + BLOCK_N]
    through the descriptors of `_gmm_descriptors`, whose rows and columns past the arrays
    (and past the group's weights) read 0, so K and N need no masks; k_end: K, or 0 for
    nothing."""
    for k0 in tl.range(0, k_end, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        a = lhs.load([row0, k0])
        if TRANSPOSE_RHS:
            b = tl.trans(rhs.load([group, col0, k0]).reshape(BLOCK_N, BLOCK_K))
        else:
            b = rhs.load([group, k0, col0]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _gmm_tiles_by_pointer(
    acc, lhs_ptr, rhs_group, rows64, in_group, cols, in_cols, K: tl.constexpr,
    N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSPOSE_RHS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += lhs[rows] @ rhs_group[:, cols] by masked loads: rows outside the group, and
    k and columns past K and N, read 0."""
    offs_k = tl.arange(0, BLOCK_K)
    lhs_ptrs = lhs_ptr + rows64[:, None] * K + offs_k[None, :]
    if TRANSPOSE_RHS:
        rhs_ptrs = rhs_group + cols[None, :] * K + offs_k[:, None]
        rhs_step = BLOCK_K
    else:
        rhs_ptrs = rhs_group + offs_k[:, None] * N + cols[None, :]
        rhs_step = BLOCK_K * N
    # Shapes are constexpr: when BLOCK_K divides K (and BLOCK_N divides N) the loop's
    # k (and column) masks are all-true, and compiling them away leaves only the group's
    # row mask in the loop.
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    EVEN_N: tl.constexpr = N % BLOCK_N == 0
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(lhs_ptrs, mask=in_group[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(rhs_ptrs)
            else:
                b = tl.load(rhs_ptrs, mask=in_cols[None, :], other=0.0)
        else:
            in_k = offs_k < K - k_block * BLOCK_K
            a = tl.load(lhs_ptrs, mask=in_group[:, None] & in_k[None, :], other=0.0)
            b = tl.load(rhs_ptrs, mask=in_k[:, None] & in_cols[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        lhs_ptrs += BLOCK_K
        rhs_ptrs += rhs_step
    return acc


@triton.jit
def _zero_unwritten_rows(
    out_ptr, group_start_ptr, group_end_ptr, num_groups, row_tile, col_tile,
    M: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Zeroes, in column tile `col_tile`, the rows of row tile `row_tile` that no tile of
    the list writes: those outside [group_start[0], group_end[num_groups - 1]), which the
    local groups tile without gaps (`local_group_bounds`). No row is written twice."""
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.load(group_start_ptr)
    hi = tl.load(group_end_ptr + num_groups - 1)
    unwritten = ((rows < lo) | (rows >= hi)) & (rows < M)
    if tl.max(unwritten.to(tl.int32), 0) > 0:  # only where the groups leave rows out
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + offsets, zeros, mask=unwritten[:, None] & (cols < N)[None, :])


@triton.jit
def _gmm_output_tile(
    lhs_ptr, rhs_ptr, init_ptr, out_ptr, lhs_desc, rhs_desc, group_start_ptr,
    group_end_ptr, chunk_group_ptr, chunk_row_start_ptr, slot, pid_n, real,
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr,
    ACCUMULATE: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """Column tile `pid_n` of tile slot `slot` of the list (its group's rows from the
    slot's first one, BLOCK_M at a time): out = (init +) lhs @ rhs[group] there. `real`:
    whether the slot holds a tile (only a warp-specialized launch asks for a surplus one:
    it runs no k step and stores nothing)."""
    group = tl.load(chunk_group_ptr + slot)
    row_begin = tl.load(group_start_ptr + group)
    row_end = tl.load(group_end_ptr + group)
    k_end = K
    if WARP_SPECIALIZE:  # a surplus slot: no rows, no k steps
        row_end = tl.where(real, row_end, row_begin)
        k_end = tl.where(real, K, 0)

    row0 = tl.load(chunk_row_start_ptr + slot)
    rows = row0 + tl.arange(0, BLOCK_M)
    # Rows past the group's end (in its last tile) are another program's business: they
    # are never written here (nor read, but with TMA).
    in_group = (rows >= row_begin) & (rows < row_end)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        acc = _gmm_tiles_by_descriptor(
            acc, lhs_desc, rhs_desc, group, row0, pid_n * BLOCK_N, k_end,
            BLOCK_K, BLOCK_N, TRANSPOSE_RHS, INPUT_PRECISION, WARP_SPECIALIZE,
        )  # fmt: skip
    else:
        rhs_group = rhs_ptr + group.to(tl.int64) * (K * N)
        acc = _gmm_tiles_by_pointer(
            acc, lhs_ptr, rhs_group, rows64, in_group, cols, in_cols,
            K, N, BLOCK_K, BLOCK_N, TRANSPOSE_RHS, INPUT_PRECISION,
        )  # fmt: skip

    out_offsets = rows64[:, None] * N + cols[None, :]
    _store_tile(out_ptr, init_ptr, out_offsets, in_group[:, None] & in_cols[None, :], acc,
                ACCUMULATE)  # fmt: skip


@triton.jit
def _zero_rows_outside_groups(
    out_ptr, group_start_ptr, group_end_ptr, num_groups, M: tl.constexpr,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A persistent program's share of the zeroing of `_zero_unwritten_rows`: only the
    row tiles that reach outside [group_start[0], group_end[num_groups - 1]) (those
    before its first row's tile and from its end's on: none where the groups cover every
    row), column tiles fastest, dealt round the programs."""
    N_TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    ROW_TILES: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    head = tl.cdiv(tl.load(group_start_ptr), BLOCK_M)  # row tiles [0, head)
    # Row tiles [tail, ROW_TILES); never below head (no groups' rows: lo == hi), so that
    # no tile is zeroed twice.
    tail = tl.maximum(tl.load(group_end_ptr + num_groups - 1) // BLOCK_M, head)
    outside = head + (ROW_TILES - tail)
    for item in range(tl.program_id(0), outside * N_TILES, tl.num_programs(0)):
        row_tile = item // N_TILES
        row_tile = tl.where(row_tile < head, row_tile, tail + row_tile - head)
        _zero_unwritten_rows(
            out_ptr, group_start_ptr, group_end_ptr, num_groups, row_tile, item % N_TILES,
            M, N, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def gmm_kernel(
    lhs_ptr,
    rhs_ptr,
    init_ptr,
    group_start_ptr,
    group_end_ptr,
    chunk_group_ptr,
    chunk_row_start_ptr,
    num_chunks_ptr,
    num_groups,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSE_RHS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
    HOST_DESCRIPTORS: tl.constexpr = False,
):
    """[BLOCK_M, BLOCK_N] output tiles of one group each: a program a tile, grid
    (num_slots * cdiv(N, BLOCK_N),), column tiles fastest (`gmm_grid`); or (PERSISTENT)
    a few programs, each walking the tiles p, p + programs, ... in that order.

    lhs: [M, K]; rhs: [G, K, N], or [G, N, K] when TRANSPOSE_RHS; init, out: [M, N].
    group_start, group_end: int32 [G], rows of each group, clipped to [0, M]; num_groups:
    G. chunk_group, chunk_row_start: int32 [num_slots], the tile list (`GroupMetadata`:
    the slot's group, and its first row; a tile never spans two groups); num_chunks:
    int32 [1], how many of its entries are real. Surplus slots compute nothing.
    ACCUMULATE: add init to the product (out = init + lhs @ rhs) instead of overwriting;
    out aliases init, so rows no tile writes keep init's values. Otherwise program
    (slot s, column tile c) also zeroes the rows of row tile s (rows [s * BLOCK_M, (s +
    1) * BLOCK_M); num_slots >= cdiv(M, BLOCK_M)) that no tile writes, in column tile c
    (persistent programs share out the row tiles that hold such rows): out needs no
    zero fill ahead of the kernel, which would cost a pass over it a call though the
    groups usually cover every row.
    TMA: lhs and rhs tiles through device-side tensor descriptors (Hopper's bulk tensor
    copies; the launch passes their global scratch), built once a program: a persistent
    program builds two for all its tiles. lhs rows of other groups are then read and
    multiplied too: an output row depends on its own lhs row only, and theirs are never
    stored. Needs K and N rows 16-byte aligned (the bridge decides).
    HOST_DESCRIPTORS (with TMA): lhs_ptr and rhs_ptr are those descriptors, encoded by the
    launch (boxes [BLOCK_M, BLOCK_K] and [1, BLOCK_K, BLOCK_N], or [1, BLOCK_N, BLOCK_K]
    when TRANSPOSE_RHS): no program writes or fences one, and no scratch is allocated.
    WARP_SPECIALIZE (with TMA, not PERSISTENT): Triton splits the k loop into a producer
    warpgroup that issues the tile loads and consumer warpgroups that multiply (on
    Hopper, launched with 4 warps: 12, two consumers of BLOCK_M / 2 rows each; the launch
    passes the count). Its partitioning refuses an early exit, so surplus slots run an
    empty loop and store nothing instead of returning.
    """
    tl.static_assert(not (PERSISTENT and WARP_SPECIALIZE),
                     "gmm_kernel: a persistent walk is not warp-specialized")  # fmt: skip
    tl.static_assert(TMA or not HOST_DESCRIPTORS, "gmm_kernel: HOST_DESCRIPTORS needs TMA")
    N_TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    ROW_TILES: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
    lhs_desc, rhs_desc = None, None
    if PERSISTENT:
        if not ACCUMULATE:
            _zero_rows_outside_groups(
                out_ptr, group_start_ptr, group_end_ptr, num_groups, M, N, BLOCK_M, BLOCK_N
            )
        if TMA:  # once for every tile of the walk
            lhs_desc, rhs_desc = _gmm_descriptors(
                lhs_ptr, rhs_ptr, num_groups, M, K, N, BLOCK_M, BLOCK_K, BLOCK_N, TRANSPOSE_RHS,
                HOST_DESCRIPTORS,
            )  # fmt: skip
        tiles = tl.load(num_chunks_ptr) * N_TILES
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _gmm_output_tile(
                lhs_ptr, rhs_ptr, init_ptr, out_ptr, lhs_desc, rhs_desc, group_start_ptr,
                group_end_ptr, chunk_group_ptr, chunk_row_start_ptr, tile // N_TILES,
                tile % N_TILES, True, M, K, N, BLOCK_M, BLOCK_K, BLOCK_N, TRANSPOSE_RHS,
                ACCUMULATE, INPUT_PRECISION, TMA, False,
            )  # fmt: skip
    else:
        slot = tl.program_id(0) // N_TILES
        pid_n = tl.program_id(0) % N_TILES
        if not ACCUMULATE:
            if slot < ROW_TILES:
                _zero_unwritten_rows(
                    out_ptr, group_start_ptr, group_end_ptr, num_groups, slot, pid_n,
                    M, N, BLOCK_M, BLOCK_N,
                )  # fmt: skip
        real = slot < tl.load(num_chunks_ptr)
        if not WARP_SPECIALIZE:
            if not real:
                return
        if TMA:  # after a surplus slot's return: it writes no descriptor
            lhs_desc, rhs_desc = _gmm_descriptors(
                lhs_ptr, rhs_ptr, num_groups, M, K, N, BLOCK_M, BLOCK_K, BLOCK_N, TRANSPOSE_RHS,
                HOST_DESCRIPTORS,
            )  # fmt: skip
        _gmm_output_tile(
            lhs_ptr, rhs_ptr, init_ptr, out_ptr, lhs_desc, rhs_desc, group_start_ptr,
            group_end_ptr, chunk_group_ptr, chunk_row_start_ptr, slot, pid_n, real,
            M, K, N, BLOCK_M, BLOCK_K, BLOCK_N, TRANSPOSE_RHS, ACCUMULATE, INPUT_PRECISION,
            TMA, WARP_SPECIALIZE,
        )  # fmt: skip


@triton.jit
def _tgmm_rows_by_descriptor(
    acc, lhs_ptr, rhs_ptr, row_begin, row_end, k0, n0, K: tl.constexpr, N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """acc += lhs[rows, k0 : k0 + BLOCK_K]^T @ rhs[rows, n0 : n0 + BLOCK_N] over the rows
    [row_begin, row_end) of one group, lhs token-major [M, K] and rhs [M, N], through
    tensor descriptors over the group's own rows: a tile's rows past the group's end (and
    k or columns past K or N) read 0, so nothing is masked. The descriptors' base is the
    group's first row: 16-byte aligned where rows of K and N elements span multiples of
    16 bytes (the bridge checks). An empty group runs no step (its descriptors, of one
    row lest a dimension be 0, are never read)."""
    rows = row_end - row_begin
    first = row_begin.to(tl.int64)
    lhs = tl.make_tensor_descriptor(lhs_ptr + first * K, shape=[tl.maximum(rows, 1), K],
                                    strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])  # fmt: skip
    rhs = tl.make_tensor_descriptor(rhs_ptr + first * N, shape=[tl.maximum(rows, 1), N],
                                    strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])  # fmt: skip
    for row in tl.range(0, rows, BLOCK_M, warp_specialize=WARP_SPECIALIZE):
        a = lhs.load([row, k0])
        b = rhs.load([row, n0])
        acc = tl.dot(tl.trans(a), b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _tgmm_rows_by_pointer(
    acc, lhs_ptr, rhs_ptr, row_begin, row_end, ks, in_k, cols, in_cols, M: tl.constexpr,
    K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, LHS_TOKEN_MAJOR: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += lhs[ks, rows] @ rhs[rows, cols] over the rows [row_begin, row_end) of one
    group by masked loads: rows outside the group, and ks and cols past K and N, read 0."""
    offs_m = tl.arange(0, BLOCK_M)
    # Steps walk BLOCK_M-aligned row blocks, from the block holding the group's first
    # row: aligned starts let the [K, M] layout load rows as wide vectors, at the cost
    # of at most one extra, partly masked, step per group.
    first_row = (row_begin // BLOCK_M) * BLOCK_M
    first_rows = first_row.to(tl.int64) + offs_m
    if LHS_TOKEN_MAJOR:
        lhs_ptrs = lhs_ptr + first_rows[None, :] * K + ks[:, None]
        lhs_step = BLOCK_M * K
    else:
        lhs_ptrs = lhs_ptr + ks.to(tl.int64)[:, None] * M + first_rows[None, :]
        lhs_step = BLOCK_M
    rhs_ptrs = rhs_ptr + first_rows[:, None] * N + cols[None, :]

    # Shapes are constexpr: where BLOCK_K divides K (BLOCK_N divides N) the k (column)
    # mask is all-true, and compiling it away leaves only the row mask in the loop.
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    EVEN_N: tl.constexpr = N % BLOCK_N == 0
    for row in range(first_row, row_end, BLOCK_M):
        rows = row + offs_m
        in_rows = (rows >= row_begin) & (rows < row_end)
        if EVEN_K:
            a = tl.load(lhs_ptrs, mask=in_rows[None, :], other=0.0)
        else:
            a = tl.load(lhs_ptrs, mask=in_k[:, None] & in_rows[None, :], other=0.0)
        if EVEN_N:
            b = tl.load(rhs_ptrs, mask=in_rows[:, None], other=0.0)
        else:
            b = tl.load(rhs_ptrs, mask=in_rows[:, None] & in_cols[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        lhs_ptrs += lhs_step
        rhs_ptrs += BLOCK_M * N
    return acc


@triton.jit
def tgmm_kernel(
    lhs_ptr,
    rhs_ptr,
    init_ptr,
    group_start_ptr,
    group_end_ptr,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LHS_TOKEN_MAJOR: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """One [BLOCK_K, BLOCK_N] tile of one group's output; grid (cdiv(K, BLOCK_K),
    cdiv(N, BLOCK_N), G).

    lhs: [K, M], or [M, K] when LHS_TOKEN_MAJOR (the layout of gmm's lhs, so the weight
    gradient needs no transpose); rhs: [M, N]; init, out: [G, K, N] (out aliases init).
    group_start, group_end: int32 [G], rows of each group, clipped to [0, M].
    out[g] = init[g] * ACCUMULATE + sum over rows r of g of lhs[:, r] outer rhs[r, :];
    an empty group writes init[g] (or zeros): every element of out is written.
    TMA (LHS_TOKEN_MAJOR only): lhs and rhs tiles through device-side tensor descriptors
    over each group's rows (`_tgmm_rows_by_descriptor`); the launch passes their global
    scratch. WARP_SPECIALIZE (with TMA): the row loop split into a producer warpgroup and
    consumers, as in `gmm_kernel`.
    """
    tl.static_assert(LHS_TOKEN_MAJOR or not TMA, "tgmm_kernel: TMA needs a token-major lhs")
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.program_id(2)
    row_begin = tl.load(group_start_ptr + group)
    row_end = tl.load(group_end_ptr + group)

    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_k = ks < K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if TMA:
        acc = _tgmm_rows_by_descriptor(
            acc, lhs_ptr, rhs_ptr, row_begin, row_end, pid_k * BLOCK_K, pid_n * BLOCK_N,
            K, N, BLOCK_M, BLOCK_K, BLOCK_N, INPUT_PRECISION, WARP_SPECIALIZE,
        )  # fmt: skip
    else:
        acc = _tgmm_rows_by_pointer(
            acc, lhs_ptr, rhs_ptr, row_begin, row_end, ks, in_k, cols, in_cols,
            M, K, N, BLOCK_M, BLOCK_K, BLOCK_N, LHS_TOKEN_MAJOR, INPUT_PRECISION,
        )  # fmt: skip

    out_offsets = group.to(tl.int64) * (K * N) + ks[:, None] * N + cols[None, :]
    _store_tile(out_ptr, init_ptr, out_offsets, in_k[:, None] & in_cols[None, :], acc,
                ACCUMULATE)  # fmt: skip


@triton.jit
def _tiles_before(
    group_start_ptr, group_end_ptr, group, BLOCK_M: tl.constexpr, GROUP_CHUNK: tl.constexpr
):
    """Entries of the tile list before local group `group`'s first: cdiv(rows, BLOCK_M)
    of each earlier local group (`GroupMetadata`), summed GROUP_CHUNK groups at a time."""
    total = group * 0
    for base in range(0, group, GROUP_CHUNK):
        groups = base + tl.arange(0, GROUP_CHUNK)
        earlier = groups < group
        rows = tl.load(group_end_ptr + groups, mask=earlier, other=0) - tl.load(
            group_start_ptr + groups, mask=earlier, other=0
        )
        total += tl.sum((rows + BLOCK_M - 1) // BLOCK_M, 0)
    return total


@triton.jit
def _tgmm_walk_rows(
    lhs_ptr, rhs_ptr, tile, chunk_group_ptr, chunk_row_start_ptr, group_end_ptr,
    lhs_offsets, rhs_offsets, in_k, in_cols, K: tl.constexpr, N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """(group, last, a, b) of entry `tile` of the list: its group, whether it is the
    group's last, and its lhs [BLOCK_M, BLOCK_K] and rhs [BLOCK_M, BLOCK_N] rows (rows
    past the group's end, and ks and cols past K and N, read 0). lhs_offsets,
    rhs_offsets: the tiles' element offsets from their first row (loop-invariant, so a
    step adds one scalar row base to them instead of computing every address)."""
    group = tl.load(chunk_group_ptr + tile)
    row0 = tl.load(chunk_row_start_ptr + tile)
    row_end = tl.load(group_end_ptr + group)
    in_rows = tl.arange(0, BLOCK_M) < row_end - row0
    first = row0.to(tl.int64)
    a = tl.load(lhs_ptr + first * K + lhs_offsets,
                mask=in_rows[:, None] & in_k[None, :], other=0.0)  # fmt: skip
    b = tl.load(rhs_ptr + first * N + rhs_offsets,
                mask=in_rows[:, None] & in_cols[None, :], other=0.0)  # fmt: skip
    return group, row0 + BLOCK_M >= row_end, a, b


@triton.jit
def tgmm_walk_kernel(
    lhs_ptr,
    rhs_ptr,
    init_ptr,
    group_start_ptr,
    group_end_ptr,
    chunk_group_ptr,
    chunk_row_start_ptr,
    num_groups,
    out_ptr,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUP_CHUNK: tl.constexpr,
):
    """`tgmm_kernel`'s product over a token-major lhs, walked: grid (cdiv(K, BLOCK_K),
    cdiv(N, BLOCK_N), SPLITS) (`tgmm_walk_grid`). Program (k tile, n tile, split s) owns
    that [BLOCK_K, BLOCK_N] tile of the local groups [s * G // SPLITS, (s + 1) * G //
    SPLITS) and walks their rows in one loop over their entries of the tile list
    (`GroupMetadata` with this BLOCK_M: each group's rows from its first, BLOCK_M at a
    time), storing a group's tile at its last entry and starting the next from zero, so
    the loads of the next group's rows are in flight while a group ends; a program per
    (k tile, n tile, group) starts each group with a load nothing hides.

    lhs: [M, K]; rhs: [M, N]; init, out: [G, K, N] (out aliases init); group_start,
    group_end: int32 [G], rows of each local group; chunk_group, chunk_row_start: the
    tile list (only its real entries are read). out[g] = init[g] * ACCUMULATE + lhs[rows
    of g]^T @ rhs[rows of g]; an empty group writes zeros, or keeps init. GROUP_CHUNK:
    groups summed at once to find a split's first entry (a power of two).
    Shared memory (sm_90, Triton 3.6 and 3.9): the a and b tiles are pipelined two
    buffers deep whatever the launch's num_stages (further stages hold the steps' index
    loads), and the store in the loop passes the output tile through scratch of its own
    beside them (8 KiB at 64 x 128 x 128, 32 KiB at 128 x 128 x 256 in bf16; 128 KiB more
    for a float32 output there, past an H100's limit): `GroupedMatmulConfig.
    shared_memory_bytes` counts neither, and a launch that does not fit is refused when
    it compiles (`jax_bridge.launch.kernel_needs`).
    """
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    first_group = split * num_groups // SPLITS
    end_group = (split + 1) * num_groups // SPLITS
    first = _tiles_before(group_start_ptr, group_end_ptr, first_group, BLOCK_M, GROUP_CHUNK)
    end = _tiles_before(group_start_ptr, group_end_ptr, end_group, BLOCK_M, GROUP_CHUNK)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_k = ks < K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    tile_offsets = ks[:, None] * N + cols[None, :]
    out_mask = in_k[:, None] & in_cols[None, :]
    # int32: BLOCK_M rows of K or N elements, far below 2**31.
    offs_m = tl.arange(0, BLOCK_M)
    lhs_offsets = offs_m[:, None] * K + ks[None, :]
    rhs_offsets = offs_m[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for tile in range(first, end):
        group, last, a, b = _tgmm_walk_rows(
            lhs_ptr, rhs_ptr, tile, chunk_group_ptr, chunk_row_start_ptr, group_end_ptr,
            lhs_offsets, rhs_offsets, in_k, in_cols, K, N, BLOCK_M,
        )  # fmt: skip
        acc = tl.dot(tl.trans(a), b, acc, input_precision=INPUT_PRECISION)
        if last:
            offsets = group.to(tl.int64) * (K * N) + tile_offsets
            _store_tile(out_ptr, init_ptr, offsets, out_mask, acc, ACCUMULATE)
            # A zero accumulator at a branch's end: Triton starts the next product without
            # one (the MMA's use-accumulator flag) instead of selecting zeros into it.
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if not ACCUMULATE:  # empty groups own no entry: their tile is zeros
        zeros = tl.zeros((BLOCK_K, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        for group in range(first_group, end_group):
            if tl.load(group_end_ptr + group) == tl.load(group_start_ptr + group):
                offsets = tl.cast(group, tl.int64) * (K * N) + tile_offsets
                tl.store(out_ptr + offsets, zeros, mask=out_mask)


def gmm_grid(num_slots: int, n: int, block_n: int, programs: int | None = None) -> tuple[int]:
    """Launch grid of `gmm_kernel`: one program per (tile slot, n tile), n tiles fastest;
    or, for a persistent launch, `programs` (at most one a tile).

    Programs start in grid order, so the ones running at once are every column tile of a
    few consecutive slots: they share their lhs rows, and a group's weights are read by
    its consecutive slots while they are in L2. Slots fastest (every slot of column tile 0,
    then of tile 1, ...) streams all of lhs once per column tile instead: at m 8192, k
    2048, n 1408 over 64 groups, 11 x 34 MB of lhs beside the 369 MB of weights, which
    matches the kernel's 270 us on an H100 at HBM speed (2026-11-27, slots fastest).
    """
    tiles = num_slots * triton.cdiv(n, block_n)
    return (tiles if programs is None else max(1, min(programs, tiles)),)


def tgmm_grid(num_groups: int, k: int, n: int, block_k: int, block_n: int) -> tuple[int, int, int]:
    """Launch grid of `tgmm_kernel`: one program per (k tile, n tile, group)."""
    return (triton.cdiv(k, block_k), triton.cdiv(n, block_n), num_groups)


def tgmm_walk_splits(num_groups: int, k: int, n: int, block_k: int, block_n: int,
                     resident: int) -> int:  # fmt: skip
    """SPLITS of `tgmm_walk_kernel` where the GPU holds `resident` programs at once: the
    fewest whose waves come within 5% of the best balance. A split's programs take
    1 / SPLITS of the work and k tiles x n tiles x SPLITS programs run in
    ceil(programs / resident) waves, so the time goes as waves / SPLITS (at most a split a
    group): at 176 tiles and 264 resident, 3 splits run 2 full waves (2/3) where 1 or 2
    leave SMs idle (1); at 256 tiles and 132, 1 split's 2 waves are within 2% of the best."""
    tiles = triton.cdiv(k, block_k) * triton.cdiv(n, block_n)
    cost = {s: triton.cdiv(tiles * s, resident) / s for s in range(1, max(num_groups, 1) + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= 1.05 * best)


def tgmm_walk_grid(k: int, n: int, block_k: int, block_n: int, splits: int) -> tuple[int, int, int]:
    """Launch grid of `tgmm_walk_kernel`: one program per (k tile, n tile, split)."""
    return (triton.cdiv(k, block_k), triton.cdiv(n, block_n), splits)
