"""Varlen FlashAttention-2 backward kernels: dQ (with the row statistics), then dK/dV;
or the row statistics, then dK/dV accumulating dQ too (DQ_ATOMIC).

Same layout, tile lists and conventions (the optional per-sequence diagonal shift
`shift_ptr` included) as `flash_attention_fwd` (read its docstring).
With P = exp(S - lse) (lse includes the sink, so P is the true probability) and
delta = rowsum(dO * O) = sum_j P_j dP_j:

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q

and with a soft cap `S = cap * tanh(scale * QK^T / cap)`, dS is further multiplied by
`1 - tanh^2`. ALiBi only shifts S, so it needs no gradient term. A row with lse = -inf
(nothing allowed) has P = 0 and contributes nothing.

The dQ kernel runs first: each of its programs owns a query tile, so it also derives the
tile's row statistics (delta, and lse in log2 units) and writes them for the dK/dV kernel,
which would otherwise need a kernel of their own (a pass over O and dO: 51 us of a 1.3 ms
fwd+bwd of 16 x 1k documents on an H100) ahead of both. The dK/dV kernel keeps one key
tile stationary and, for GQA/MQA, loops over every query head of its group itself: each
dK/dV row is written by exactly one program, with no atomics, so the result is
deterministic. The sinks' gradient needs only lse and delta; the JAX bridge computes it.

Or (DQ_ATOMIC, FlashAttention-2's own backward) the dK/dV kernel accumulates dQ too: each
of its steps adds dS K, over its own keys, to a float32 dQ by atomic adds. That skips the
dQ kernel's recomputation of QK^T and dO V^T (7 tile products a (query tile, key tile)
pair become 5) for the atomics' traffic and an order of float32 sums that varies between
runs; `attention_backward_row_stats_kernel` then writes the row statistics.
"""

import triton
import triton.language as tl

from triton_kernels.flash_attention.forward import (
    HOST_TMA,
    LOG2E,
    _alibi_slope_log2,
    _chunk_bounds,
    _column_phases,
    _diagonal_shift,
    _key_cursors,
    _key_value_tiles,
    _load_rows,
    _score_constants,
    _scores_log2,
    _sequence_keys,
    _sequence_of,
    _sequence_rows,
    _tile_ptrs,
)
from triton_kernels.flash_attention.steps import (
    _dkdv_accumulators,
    _dkdv_dq_step,
    _dkdv_step,
    _dq_step,
)


@triton.jit
def _load_row_stats(lse_log2_ptrs, delta_ptrs, ok, CHECK: tl.constexpr):
    """(lse_log2, delta) of some query rows, as the dQ kernel (or the row statistics'
    pass) wrote them.

    Rows outside `ok` (when CHECK) read lse_log2 = +inf and delta = 0, as a row with
    nothing allowed does: exp2(s - lse_log2) = 0 for every score.
    """
    if CHECK:
        lse_log2 = tl.load(lse_log2_ptrs, mask=ok, other=float("inf"))
        delta = tl.load(delta_ptrs, mask=ok, other=0.0)
    else:
        lse_log2 = tl.load(lse_log2_ptrs)
        delta = tl.load(delta_ptrs)
    return lse_log2, delta


@triton.jit
def _row_statistics(
    o_ptrs, do, lse_ptrs, d_lse_ptrs, delta_ptrs, lse_log2_ptrs, row_ok, d_ok,
    EVEN_D: tl.constexpr, HAS_D_LSE: tl.constexpr,
):  # fmt: skip
    """(lse_log2, delta) of a query tile's rows, in float32, also stored for the dK/dV
    kernel (rows in `row_ok` only).

    delta = rowsum(dO * O) - d_lse: d lse_i / d s_ij = p_ij, so an lse cotangent enters
    the backward exactly as a shift of delta. lse_log2 = log2(e) * lse, with +inf for a row
    with nothing allowed (lse = -inf): exp2(s - lse_log2) is then the probability, and 0
    for every score of such a row, with no per-tile conversion. Rows outside `row_ok` get
    lse_log2 = +inf and delta = 0, as a row with nothing allowed.
    """
    o = _load_rows(o_ptrs, row_ok, d_ok, True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_D_LSE:
        delta -= tl.load(d_lse_ptrs, mask=row_ok, other=0.0)
    lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(delta_ptrs, delta, mask=row_ok)
    tl.store(lse_log2_ptrs, lse_log2, mask=row_ok)
    return lse_log2, delta


@triton.jit
def _dkdv_query_tiles(
    dk,
    dv,
    k,
    v,
    q_seq,
    do_seq,
    lse_log2_seq_ptr,
    delta_seq_ptr,
    dq_seq,
    alibi_slopes_ptr,
    first_head,
    total_q,
    start,
    end,
    start2,
    end2,
    keys,
    shift,
    len_q,
    len_k,
    window_left,
    window_right,
    qk_scale_log2,
    scale_over_cap,
    cap_log2,
    Q_STRIDE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TWO_RANGES: tl.constexpr,
    TMA: tl.constexpr = False,
    DQ_ATOMIC: tl.constexpr = False,
    OVERLAP_SOFTMAX: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):
    """Accumulates dk, dv ([BLOCK_N, BLOCK_D], float32, unscaled; with HEAD_MAJOR
    [BLOCK_D, BLOCK_N], `steps._dkdv_step`) over query tiles [start, end)
    (and, with TWO_RANGES, then [start2, end2)) of the GROUP query heads first_head,
    first_head + 1, ... that share this kv head.

    One flat loop over (query tile, head) pairs, heads innermost: a loop over heads
    around the tile loop would keep its own state live across three tile loops, which
    costs registers the stationary dk, dv and the pipeline need. q_seq, do_seq: row 0 of the
    sequence at head first_head, as pointers or, with TMA, as tensor descriptors over its
    [len_q, GROUP * HEAD_DIM] rows (rows past len_q load as 0), or (TMA == HOST_TMA)
    (the launch's descriptor over all of q or dO, the sequence's first row, head
    first_head's first column), whose masked tiles zero the rows past len_q themselves
    (unmasked tiles lie inside the sequence, `_column_phases`); lse_log2_seq_ptr,
    delta_seq_ptr: row 0 of the sequence in head first_head's row ([NUM_Q_HEADS, total_q]).
    With DQ_ATOMIC, each step also adds its query tile's dQ share (dS K over this program's
    keys, unscaled) to dq_seq (float32, laid out as q's rows, row 0 of the sequence at
    head first_head; with TMA a descriptor over the sequence's rows, as q_seq) by atomic
    adds (with TMA one bulk tensor reduction), in the query rows of the sequence only;
    the masked loop (APPLY_MASK) then also masks keys past len_k.
    The tile is transposed: rows are this program's keys, columns are queries, so
    the window's right bound is the lower one and `shift` is minus the query-side one
    (`len_q - len_k` without a given shift). WARP_SPECIALIZE (with TMA): Triton splits
    the loop into a producer warpgroup (the Q and dO copies) and consumer warpgroups (the
    rest, each over its share of the keys). HEAD_MAJOR: the tile's scores as the
    forward's (rows are queries, the window's bounds and shift as the forward's).
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # An empty range may have end < start (`_column_phases`): no tiles, not fewer.
    first_tiles = tl.maximum(tl.cdiv(end - start, BLOCK_M), 0)
    tiles = first_tiles
    if TWO_RANGES:
        tiles += tl.maximum(tl.cdiv(end2 - start2, BLOCK_M), 0)
    num_steps = tiles * GROUP
    # Step s visits query tile s // GROUP of head s % GROUP. For a power-of-two group
    # those are a shift and a mask; otherwise (g, m) are carried and stepped on, which
    # costs fewer instructions than a division by a general constant.
    STEP_BY_MASK: tl.constexpr = (GROUP & (GROUP - 1)) == 0
    g = start * 0
    m = start
    gap = start2 - (start + first_tiles * BLOCK_M)
    if TWO_RANGES:
        m = tl.where(first_tiles > 0, start, start2)
    for step in tl.range(0, num_steps, warp_specialize=WARP_SPECIALIZE):
        if STEP_BY_MASK:
            g = step % GROUP
            tile = step // GROUP
            m = start + tile * BLOCK_M
            if TWO_RANGES:  # the second range's tiles sit `gap` further on
                m += tl.where(tile < first_tiles, 0, gap)
        cols = m + offs_m  # query positions within the sequence
        col_ok = cols < len_q
        # Inline, not a helper: as a call it costs the non-TMA kernel spills under
        # register-heavy options with GQA groups that are not powers of two; and the
        # launch descriptors' branch, as a call a tile (`forward._key_rows`' zeroing,
        # which loads and zeroes one tile before the next), spills 96 / 116 B in the
        # 64x128 loop under Triton 3.6 against 40 / 52 B with both loads first.
        if TMA == HOST_TMA:  # (descriptor, the sequence's row 0, head first_head's column)
            q = q_seq[0].load([q_seq[1] + m, q_seq[2] + g * HEAD_DIM])
            do = do_seq[0].load([do_seq[1] + m, do_seq[2] + g * HEAD_DIM])
            if APPLY_MASK:  # another sequence's rows, perhaps not finite: P is 0 there,
                # and 0 * inf in P^T dO or dS^T Q would still reach dK and dV
                q = tl.where(col_ok[:, None], q, 0.0)
                do = tl.where(col_ok[:, None], do, 0.0)
        elif TMA:
            q = q_seq.load([m, g * HEAD_DIM])
            do = do_seq.load([m, g * HEAD_DIM])
        else:
            tile = m.to(tl.int64) * Q_STRIDE + g * HEAD_DIM  # row m, head first_head + g
            q_ptrs = _tile_ptrs(q_seq + tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
            do_ptrs = _tile_ptrs(do_seq + tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
            q = _load_rows(q_ptrs, col_ok, d_ok, APPLY_MASK, BLOCK_D == HEAD_DIM)
            do = _load_rows(do_ptrs, col_ok, d_ok, APPLY_MASK, BLOCK_D == HEAD_DIM)
        # Row m of head first_head + g ([NUM_Q_HEADS, total_q]), as a scalar offset and
        # then the tile's per-thread constant ones: Triton 3.6 loads these vectors as one
        # 4-byte cp.async per element, and with offsets computed per element in int64
        # (`g * total_q + cols`) spent ~150 instructions an iteration on their addresses
        # (dK/dV 32x128 at d=128: 648 -> 492 warp-instructions per MFLOP; 3.9: 540 ->
        # 528). int32: g * total_q < GROUP * total_q <= q's rows x heads, and a q of 2**31
        # rows x heads would take 64 GiB at head_dim 16 in 16 bits, before k, v, dO, dq.
        stats = g * total_q + m
        lse2, delta = _load_row_stats(
            (lse_log2_seq_ptr + stats) + offs_m,
            (delta_seq_ptr + stats) + offs_m,
            col_ok,
            APPLY_MASK,
        )
        slope_log2 = _alibi_slope_log2(alibi_slopes_ptr, first_head + g, HAS_ALIBI)
        if HEAD_MAJOR:  # masked tiles mask keys past len_k too (DQ_ATOMIC's need)
            qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
            s2_t, t_t = _scores_log2(
                qk, cols, keys, -shift, len_k, window_left, window_right,
                qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
                APPLY_MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI,
            )  # fmt: skip
        else:
            qk_t = tl.dot(k, tl.trans(q), None, input_precision=INPUT_PRECISION)
            s2_t, t_t = _scores_log2(
                qk_t, keys, cols, shift, len_q, window_right, window_left,
                qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
                APPLY_MASK, HAS_WINDOW_RIGHT, HAS_WINDOW_LEFT, HAS_SOFT_CAP, HAS_ALIBI,
            )  # fmt: skip
            if DQ_ATOMIC and APPLY_MASK:  # keys past len_k (see `_dkdv_tile`)
                s2_t = tl.where((keys < len_k)[:, None], s2_t, float("-inf"))
        if DQ_ATOMIC:
            dk, dv, dq = _dkdv_dq_step(
                dk, dv, s2_t, t_t, 1.0, q, do, k, v, lse2, delta, True, False, HAS_SOFT_CAP,
                False, INPUT_PRECISION, OVERLAP_SOFTMAX, HEAD_MAJOR,
            )  # fmt: skip
            # Every other sequence's rows, and the next head's dims, stay untouched: a
            # non-finite dS there (Inf in this sequence's V) must not reach them (the
            # descriptor's rows end with the sequence; its block is one head wide).
            if TMA:
                dq_seq.atomic_add([m, g * HEAD_DIM], dq)
            else:
                dq_tile = m.to(tl.int64) * Q_STRIDE + g * HEAD_DIM
                dq_ptrs = _tile_ptrs(dq_seq + dq_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
                tl.atomic_add(dq_ptrs, dq, mask=col_ok[:, None] & d_ok[None, :], sem="relaxed")
        else:
            dk, dv = _dkdv_step(
                dk, dv, s2_t, t_t, 1.0, q, do, v, lse2, delta, True, False, HAS_SOFT_CAP,
                False, INPUT_PRECISION, OVERLAP_SOFTMAX, HEAD_MAJOR,
            )  # fmt: skip
        if not STEP_BY_MASK:
            g += 1
            next_tile = g == GROUP
            m = tl.where(next_tile, m + BLOCK_M, m)
            g = tl.where(next_tile, 0, g)
            if TWO_RANGES:  # past the first range's last tile: the second's first
                m = tl.where(m == start + first_tiles * BLOCK_M, start2, m)
    return dk, dv


@triton.jit
def _stationary_keys(
    k_ptr, v_ptr, k_start, len_k, n0, kv_head, offs_n, offs_d, key_ok, d_ok,
    KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS_ALIGNED: tl.constexpr, BY_DESCRIPTOR: tl.constexpr,
):  # fmt: skip
    """k, v [BLOCK_N, BLOCK_D]: this program's key tile (rows n0... of the sequence from
    k_start, at kv head `kv_head`), rows past len_k and padded dims 0: by masked loads, or
    (BY_DESCRIPTOR) through descriptors over the sequence's rows, for a warp-specialized
    loop (a load by pointers feeding its dots stops Triton's partitioning)."""
    if BY_DESCRIPTOR:
        k_seq, v_seq = _sequence_keys(
            k_ptr, v_ptr, k_start, len_k, kv_head, KV_STRIDE, HEAD_DIM, BLOCK_N, True
        )
        k, v = k_seq.load([n0, 0]), v_seq.load([n0, 0])
    else:
        kv_tile = (k_start + n0).to(tl.int64) * KV_STRIDE + kv_head * HEAD_DIM
        k_ptrs = _tile_ptrs(k_ptr + kv_tile, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
        v_ptrs = _tile_ptrs(v_ptr + kv_tile, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
        k = _load_rows(k_ptrs, key_ok, d_ok, True, BLOCK_D == HEAD_DIM)
        v = _load_rows(v_ptrs, key_ok, d_ok, True, BLOCK_D == HEAD_DIM)
    return k, v


@triton.jit
def _query_phases(
    n0, len_k, start, full_start, full_end, end, HAS_WINDOW_RIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):  # fmt: skip
    """(band_start, band_end, middle_start): the masked tiles first, in one loop: the
    band a right bound leaves on the diagonal, [start, full_start) (empty without one:
    start == 0, full_start <= 0), and the edge, [full_end, end); then the unmasked middle,
    [middle_start, full_end). With the two masked ranges as loops of their own around the
    middle, Triton 3.6 compiles every causal dK/dV kernel to serialized wgmma (ptxas
    C7515: non-wgmma instructions defining accumulator registers within a pipeline stage).
    """
    band_start, band_end = start, full_start
    if not HAS_WINDOW_RIGHT:  # one masked range
        band_start, band_end = full_end, end
    middle_start = full_start
    if DQ_ATOMIC:
        # A sequence's last key tile may hold rows past len_k: zero keys, never stored,
        # whose P = exp2(-lse_log2) is not 0 (inf where lse < -88, or < -10 once dS is in
        # 16 bits), and dS K would carry inf * 0 into real dQ rows. Such a tile visits all
        # its query tiles in the masked loop, which then masks its keys too.
        past_keys = n0 + BLOCK_N > len_k
        if HAS_WINDOW_RIGHT:
            band_end = tl.where(past_keys, full_end, band_end)
        else:
            band_start = tl.where(past_keys, full_start, band_start)
        middle_start = tl.where(past_keys, full_end, full_start)
    return band_start, band_end, middle_start


@triton.jit
def _dkdv_tile(
    q_ptr,
    k_ptr,
    v_ptr,
    d_out_ptr,
    lse_log2_ptr,
    delta_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    chunk_indices_ptr,
    alibi_slopes_ptr,
    total_q,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    shift_ptr,
    dk_ptr,
    dv_ptr,
    dq_accum_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    chunk,
    seq,
    kv_head,
    OVERLAP_SOFTMAX: tl.constexpr = False,
    live=True,
    WARP_SPECIALIZE: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):
    """dk, dv of tile-list row `chunk` (sequence `seq`), for kv head `kv_head`; a program
    that is not `live` (WARP_SPECIALIZE's surplus programs, seq 0) visits no query tile
    and stores nothing. WARP_SPECIALIZE: one warp-specialized loop over every query tile,
    masked, K and V by descriptors (`forward._forward_keys` says why one loop)."""
    tile_index, q_start, len_q, k_start, len_k = _chunk_bounds(
        chunk_indices_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, chunk, seq
    )
    if WARP_SPECIALIZE:
        tile_index = tl.where(live, tile_index, 0)
        len_k = tl.where(live, len_k, 0)
    GROUP: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM

    n0 = tile_index * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    keys = n0 + offs_n  # key positions within the sequence
    key_ok = keys < len_k
    d_ok = offs_d < HEAD_DIM
    ROWS_ALIGNED: tl.constexpr = (HEAD_DIM * k_ptr.dtype.element_ty.primitive_bitwidth) % 128 == 0
    k, v = _stationary_keys(
        k_ptr, v_ptr, k_start, len_k, n0, kv_head, offs_n, offs_d, key_ok, d_ok,
        KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, WARP_SPECIALIZE,
    )  # fmt: skip
    dk, dv = _dkdv_accumulators(BLOCK_N, BLOCK_D, HEAD_MAJOR)

    qk_scale_log2, scale_over_cap, cap_log2 = _score_constants(
        softmax_scale, logits_soft_cap, HAS_SOFT_CAP
    )

    # Key j is seen by queries i with j - window_right <= diag(i) <= j + window_left,
    # diag(i) = i + s: the key's centre on the query axis is j - s.
    shift = -_diagonal_shift(shift_ptr, seq, len_q, len_k)
    key_last = tl.minimum(n0 + BLOCK_N, len_k) - 1
    start, full_start, full_end, end = _column_phases(
        n0, key_last, shift, len_q, window_right, window_left,
        HAS_WINDOW_RIGHT, HAS_WINDOW_LEFT, BLOCK_M,
    )  # fmt: skip
    first_head = kv_head * GROUP
    if TMA == HOST_TMA:  # the launch's descriptors over all of q and dO
        q_seq = (q_ptr, q_start, first_head * HEAD_DIM)
        do_seq = (d_out_ptr, q_start, first_head * HEAD_DIM)
    else:
        q_rows = q_ptr + q_start.to(tl.int64) * Q_STRIDE + first_head * HEAD_DIM
        do_rows = d_out_ptr + q_start.to(tl.int64) * Q_STRIDE + first_head * HEAD_DIM
        if TMA:  # over the GROUP heads of this kv head, this sequence's rows only
            q_seq = _sequence_rows(q_rows, len_q, GROUP * HEAD_DIM, Q_STRIDE, BLOCK_M, HEAD_DIM)
            do_seq = _sequence_rows(do_rows, len_q, GROUP * HEAD_DIM, Q_STRIDE, BLOCK_M,
                                    HEAD_DIM)  # fmt: skip
        else:
            q_seq, do_seq = q_rows, do_rows
    lse_log2_seq_ptr = lse_log2_ptr + first_head.to(tl.int64) * total_q + q_start
    delta_seq_ptr = delta_ptr + first_head.to(tl.int64) * total_q + q_start
    dq_seq = dq_accum_ptr + q_start.to(tl.int64) * Q_STRIDE + first_head * HEAD_DIM
    # Added to through the copy engine (with HOST_TMA too: only a descriptor bounded by
    # the sequence keeps a non-finite dS K out of the next sequence's rows).
    if TMA and DQ_ATOMIC:
        dq_seq = _sequence_rows(dq_seq, len_q, GROUP * HEAD_DIM, Q_STRIDE, BLOCK_M, HEAD_DIM)
    if WARP_SPECIALIZE:  # every tile masked, in the band's loop; no middle
        band_start, band_end, middle_start = start, tl.where(live, end, start), end
    else:
        band_start, band_end, middle_start = _query_phases(
            n0, len_k, start, full_start, full_end, end, HAS_WINDOW_RIGHT, BLOCK_N, DQ_ATOMIC
        )
    dk, dv = _dkdv_query_tiles(
        dk, dv, k, v, q_seq, do_seq, lse_log2_seq_ptr, delta_seq_ptr, dq_seq,
        alibi_slopes_ptr, first_head, total_q, band_start, band_end, full_end, end, keys,
        shift, len_q, len_k, window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2,
        Q_STRIDE, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, ROWS_ALIGNED, True,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION,
        HAS_WINDOW_RIGHT and not WARP_SPECIALIZE, TMA, DQ_ATOMIC, OVERLAP_SOFTMAX,
        WARP_SPECIALIZE, HEAD_MAJOR,
    )  # fmt: skip
    if not WARP_SPECIALIZE:
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, q_seq, do_seq, lse_log2_seq_ptr, delta_seq_ptr, dq_seq,
            alibi_slopes_ptr, first_head, total_q, middle_start, full_end, full_end, full_end,
            keys, shift, len_q, len_k, window_left, window_right, qk_scale_log2,
            scale_over_cap, cap_log2, Q_STRIDE, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D,
            ROWS_ALIGNED, False, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI,
            INPUT_PRECISION, False, TMA, DQ_ATOMIC, OVERLAP_SOFTMAX, False, HEAD_MAJOR,
        )  # fmt: skip

    dk = (dk * softmax_scale).to(dk_ptr.dtype.element_ty)
    dv = dv.to(dv_ptr.dtype.element_ty)
    if HEAD_MAJOR:
        dk, dv = tl.trans(dk), tl.trans(dv)
    # Keys past len_k and padded dims are never stored.
    mask = key_ok[:, None] & d_ok[None, :]
    kv_tile = (k_start + n0).to(tl.int64) * KV_STRIDE + kv_head * HEAD_DIM
    dk_ptrs = _tile_ptrs(dk_ptr + kv_tile, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    dv_ptrs = _tile_ptrs(dv_ptr + kv_tile, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    tl.store(dk_ptrs, dk, mask=mask)
    tl.store(dv_ptrs, dv, mask=mask)


@triton.jit
def attention_backward_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    d_out_ptr,
    lse_log2_ptr,
    delta_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    chunk_indices_ptr,
    alibi_slopes_ptr,
    total_q,
    num_chunks,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    shift_ptr,
    dk_ptr,
    dv_ptr,
    dq_accum_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    TMA: tl.constexpr = False,
    DQ_ATOMIC: tl.constexpr = False,
    OVERLAP_SOFTMAX: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):
    """dk, dv of one [BLOCK_N]-row key tile of one sequence, for one kv head.

    Grid: (P, NUM_KV_HEADS) over the (sequence, key tile) rows of `chunk_indices` (from
    cu_seqlens_k), as the forward kernel walks its query tiles (PERSISTENT included).
    lse_log2_ptr, delta_ptr: float32 [NUM_Q_HEADS, total_q], as the dQ kernel (or, with
    DQ_ATOMIC, `attention_backward_row_stats_kernel`) writes them (`_row_statistics`);
    dk_ptr, dv_ptr: [total_k, NUM_KV_HEADS, HEAD_DIM] in k's dtype. TMA: the streamed Q
    and dO tiles come through tensor descriptors; HOST_TMA: through descriptors the launch
    encodes, q_ptr and d_out_ptr (over all of q and dO, [total_q, NUM_Q_HEADS * HEAD_DIM],
    boxes of [BLOCK_M, HEAD_DIM]; not WARP_SPECIALIZE). DQ_ATOMIC: the kernel also accumulates
    dQ, unscaled (dS K; the caller multiplies by the softmax scale), into dq_accum_ptr:
    float32 [total_q, NUM_Q_HEADS, HEAD_DIM], zeros at launch, by atomic adds (no dQ
    kernel then: FlashAttention-2's backward; the order of the float32 sums varies from
    run to run); without it dq_accum_ptr is never touched (a placeholder).
    OVERLAP_SOFTMAX: each query tile's dP = V dO^T is issued before P's exp2s, which run
    beside its wgmma (`steps._dkdv_products`' DP_FIRST). WARP_SPECIALIZE (with TMA, not
    PERSISTENT, not DQ_ATOMIC): Triton splits the query loop into a producer warpgroup
    that copies Q and dO and consumer warpgroups of BLOCK_N / 2 keys each (on Hopper,
    launched with 4 warps: 12; the launch passes the count), FlashAttention-3's split, in
    one loop whose every tile is masked; its surplus programs run an empty loop instead of
    returning. HEAD_MAJOR: dK and dV accumulate as [BLOCK_D, BLOCK_N] tiles, dK^T = Q^T
    dS and dV^T = dO^T P (`steps._dkdv_step`). Other arguments (shift_ptr included) as
    the forward kernel.
    """
    tl.static_assert(not (TMA == HOST_TMA and WARP_SPECIALIZE),
                     "the launch's descriptors are not warp-specialized")  # fmt: skip
    kv_head = tl.program_id(1)
    chunk = tl.program_id(0)
    if PERSISTENT:
        seq = _sequence_of(chunk_indices_ptr, chunk, num_chunks)
        # Program p walks rows p, p + P, p + 2P, ... (P programs on axis 0) until one
        # without work: the grid need not cover the list's empty rows.
        while seq >= 0:
            _dkdv_tile(
                q_ptr, k_ptr, v_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, cu_seqlens_q_ptr,
                cu_seqlens_k_ptr, chunk_indices_ptr, alibi_slopes_ptr, total_q, softmax_scale,
                logits_soft_cap, window_left, window_right, shift_ptr, dk_ptr, dv_ptr, dq_accum_ptr,
                NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW_LEFT,
                HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION, TMA, DQ_ATOMIC,
                chunk, seq, kv_head, OVERLAP_SOFTMAX, True, False, HEAD_MAJOR,
            )  # fmt: skip
            chunk += tl.num_programs(0)
            seq = _sequence_of(chunk_indices_ptr, chunk, num_chunks)
    else:  # one row a program; surplus programs of the static bound exit at once (or,
        # warp-specialized, run an empty loop)
        seq = tl.load(chunk_indices_ptr + 2 * chunk)
        live = seq >= 0
        if WARP_SPECIALIZE:
            seq = tl.maximum(seq, 0)
        elif not live:
            return
        _dkdv_tile(
            q_ptr, k_ptr, v_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, cu_seqlens_q_ptr,
            cu_seqlens_k_ptr, chunk_indices_ptr, alibi_slopes_ptr, total_q, softmax_scale,
            logits_soft_cap, window_left, window_right, shift_ptr, dk_ptr, dv_ptr, dq_accum_ptr,
            NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW_LEFT,
            HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION, TMA, DQ_ATOMIC, chunk,
            seq, kv_head, OVERLAP_SOFTMAX, live, WARP_SPECIALIZE, HEAD_MAJOR,
        )  # fmt: skip


@triton.jit
def _dq_key_tiles(
    dq,
    q,
    do,
    lse2,
    delta,
    k_seq,
    v_seq,
    start,
    end,
    rows,
    shift,
    len_k,
    window_left,
    window_right,
    qk_scale_log2,
    scale_over_cap,
    cap_log2,
    slope_log2,
    KV_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """Accumulates dq ([BLOCK_M, BLOCK_D], float32, unscaled) over key tiles [start, end);
    k_seq, v_seq: pointers or descriptors, as the forward's key loop takes them."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_at, v_at = _key_cursors(k_seq, v_seq, start, KV_STRIDE, TMA)
    for n in range(start, end, BLOCK_N):
        cols = n + offs_n
        k, v, k_at, v_at = _key_value_tiles(
            k_at, v_at, n, cols < len_k, offs_n, offs_d, d_ok,
            KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, APPLY_MASK, TMA,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
        s2, t = _scores_log2(
            qk, rows, cols, shift, len_k, window_left, window_right,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
            APPLY_MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI,
        )  # fmt: skip
        dq = _dq_step(
            dq, s2, t, 1.0, do, k, v, lse2, delta, True, False, HAS_SOFT_CAP, False,
            INPUT_PRECISION,
        )  # fmt: skip
    return dq


@triton.jit
def _dq_tile(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    d_out_ptr,
    lse_ptr,
    d_lse_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    chunk_indices_ptr,
    alibi_slopes_ptr,
    total_q,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    shift_ptr,
    dq_ptr,
    delta_ptr,
    lse_log2_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_D_LSE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    chunk,
    seq,
    head,
):
    """dq, and the row statistics, of tile-list row `chunk` (sequence `seq`), for query
    head `head`."""
    tile_index, q_start, len_q, k_start, len_k = _chunk_bounds(
        chunk_indices_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, chunk, seq
    )
    kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM

    m0 = tile_index * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + offs_m  # query positions within the sequence
    row_ok = rows < len_q
    d_ok = offs_d < HEAD_DIM
    ROWS_ALIGNED: tl.constexpr = (HEAD_DIM * q_ptr.dtype.element_ty.primitive_bitwidth) % 128 == 0
    q_tile = (q_start + m0).to(tl.int64) * Q_STRIDE + head * HEAD_DIM
    q_ptrs = _tile_ptrs(q_ptr + q_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    do_ptrs = _tile_ptrs(d_out_ptr + q_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    q = _load_rows(q_ptrs, row_ok, d_ok, True, BLOCK_D == HEAD_DIM)
    do = _load_rows(do_ptrs, row_ok, d_ok, True, BLOCK_D == HEAD_DIM)
    o_ptrs = _tile_ptrs(out_ptr + q_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    stats = head.to(tl.int64) * total_q + q_start + m0 + offs_m  # [NUM_Q_HEADS, total_q]
    lse2, delta = _row_statistics(
        o_ptrs, do, lse_ptr + stats, d_lse_ptr + stats, delta_ptr + stats,
        lse_log2_ptr + stats, row_ok, d_ok, BLOCK_D == HEAD_DIM, HAS_D_LSE,
    )  # fmt: skip

    qk_scale_log2, scale_over_cap, cap_log2 = _score_constants(
        softmax_scale, logits_soft_cap, HAS_SOFT_CAP
    )
    slope_log2 = _alibi_slope_log2(alibi_slopes_ptr, head, HAS_ALIBI)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    shift = _diagonal_shift(shift_ptr, seq, len_q, len_k)
    row_last = tl.minimum(m0 + BLOCK_M, len_q) - 1
    start, full_start, full_end, end = _column_phases(
        m0, row_last, shift, len_k, window_left, window_right,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_N,
    )  # fmt: skip
    k_seq, v_seq = _sequence_keys(
        k_ptr, v_ptr, k_start, len_k, kv_head, KV_STRIDE, HEAD_DIM, BLOCK_N, TMA
    )
    # Without a left window start == 0 and full_start == min(0, end) <= 0: no first phase.
    if HAS_WINDOW_LEFT:
        dq = _dq_key_tiles(
            dq, q, do, lse2, delta, k_seq, v_seq, start, full_start, rows, shift, len_k,
            window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
            KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION, TMA,
        )  # fmt: skip
    dq = _dq_key_tiles(
        dq, q, do, lse2, delta, k_seq, v_seq, full_start, full_end, rows, shift, len_k,
        window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
        KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION, TMA,
    )  # fmt: skip
    dq = _dq_key_tiles(
        dq, q, do, lse2, delta, k_seq, v_seq, full_end, end, rows, shift, len_k,
        window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
        KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION, TMA,
    )  # fmt: skip

    # Rows past len_q and padded dims are never stored.
    mask = row_ok[:, None] & d_ok[None, :]
    dq_ptrs = _tile_ptrs(dq_ptr + q_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    tl.store(dq_ptrs, (dq * softmax_scale).to(dq_ptr.dtype.element_ty), mask=mask)


@triton.jit
def attention_backward_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    d_out_ptr,
    lse_ptr,
    d_lse_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    chunk_indices_ptr,
    alibi_slopes_ptr,
    total_q,
    num_chunks,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    shift_ptr,
    dq_ptr,
    delta_ptr,
    lse_log2_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_D_LSE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """dq of one [BLOCK_M]-row query tile of one sequence, for one query head, and the
    tile's row statistics for the dK/dV kernel.

    Grid: (P, NUM_Q_HEADS), tiles as in the forward kernel (PERSISTENT included); the
    tiles cover every query row, so every row statistic is written.
    out_ptr: [total_q, NUM_Q_HEADS, HEAD_DIM], the forward's output; lse_ptr: float32
    [NUM_Q_HEADS, total_q], its natural-log lse; d_lse_ptr: float32 [NUM_Q_HEADS, total_q],
    lse's cotangent (read only if HAS_D_LSE). dq_ptr: [total_q, NUM_Q_HEADS, HEAD_DIM] in
    q's dtype; delta_ptr, lse_log2_ptr: float32 [NUM_Q_HEADS, total_q] (`_row_statistics`).
    TMA: K and V as the forward kernel loads them (its key loop's helpers), HOST_TMA
    included: k_ptr and v_ptr are then the launch's descriptors over all of K and V.
    Other arguments as the dK/dV kernel.
    """
    head = tl.program_id(1)
    chunk = tl.program_id(0)
    if PERSISTENT:
        seq = _sequence_of(chunk_indices_ptr, chunk, num_chunks)
        # Program p walks rows p, p + P, p + 2P, ... (P programs on axis 0) until one
        # without work: the grid need not cover the list's empty rows.
        while seq >= 0:
            _dq_tile(
                q_ptr, k_ptr, v_ptr, out_ptr, d_out_ptr, lse_ptr, d_lse_ptr, cu_seqlens_q_ptr,
                cu_seqlens_k_ptr, chunk_indices_ptr, alibi_slopes_ptr, total_q, softmax_scale,
                logits_soft_cap, window_left, window_right, shift_ptr, dq_ptr, delta_ptr,
                lse_log2_ptr, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
                HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_D_LSE,
                INPUT_PRECISION, TMA, chunk, seq, head,
            )  # fmt: skip
            chunk += tl.num_programs(0)
            seq = _sequence_of(chunk_indices_ptr, chunk, num_chunks)
    else:  # one row a program; surplus programs of the static bound exit at once
        seq = tl.load(chunk_indices_ptr + 2 * chunk)
        if seq < 0:
            return
        _dq_tile(
            q_ptr, k_ptr, v_ptr, out_ptr, d_out_ptr, lse_ptr, d_lse_ptr, cu_seqlens_q_ptr,
            cu_seqlens_k_ptr, chunk_indices_ptr, alibi_slopes_ptr, total_q, softmax_scale,
            logits_soft_cap, window_left, window_right, shift_ptr, dq_ptr, delta_ptr,
            lse_log2_ptr, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_D_LSE,
            INPUT_PRECISION, TMA, chunk, seq, head,
        )  # fmt: skip


@triton.jit
def attention_backward_row_stats_kernel(
    out_ptr,
    d_out_ptr,
    lse_ptr,
    d_lse_ptr,
    total_q,
    delta_ptr,
    lse_log2_ptr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_D_LSE: tl.constexpr,
):
    """The row statistics (`_row_statistics`: delta, and lse in log2 units) of BLOCK_M
    packed query rows of one head, for a dK/dV kernel that accumulates dQ itself
    (DQ_ATOMIC: no dQ kernel runs to write them).

    Grid: (cdiv(total_q, BLOCK_M), NUM_Q_HEADS). Rows are packed rows, whatever their
    sequence: a row in none has the forward's lse of -inf, hence lse_log2 = +inf.
    out_ptr, d_out_ptr: [total_q, NUM_Q_HEADS, HEAD_DIM]; lse_ptr, d_lse_ptr (read only if
    HAS_D_LSE), delta_ptr, lse_log2_ptr: float32 [NUM_Q_HEADS, total_q].
    """
    head = tl.program_id(1)
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = m0 + offs_m < total_q
    d_ok = offs_d < HEAD_DIM
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    ROWS_ALIGNED: tl.constexpr = (HEAD_DIM * out_ptr.dtype.element_ty.primitive_bitwidth) % 128 == 0
    tile = m0.to(tl.int64) * Q_STRIDE + head * HEAD_DIM
    o_ptrs = _tile_ptrs(out_ptr + tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    do_ptrs = _tile_ptrs(d_out_ptr + tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    do = _load_rows(do_ptrs, row_ok, d_ok, True, BLOCK_D == HEAD_DIM)
    stats = head.to(tl.int64) * total_q + m0 + offs_m
    _row_statistics(
        o_ptrs, do, lse_ptr + stats, d_lse_ptr + stats, delta_ptr + stats,
        lse_log2_ptr + stats, row_ok, d_ok, BLOCK_D == HEAD_DIM, HAS_D_LSE,
    )  # fmt: skip
