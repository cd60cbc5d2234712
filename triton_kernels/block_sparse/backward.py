"""Block-sparse FlashAttention-2 backward kernels: dQ (query tile stationary) and dK/dV
(key tile stationary).

Layout, tile lists, mask modes and isolation as `block_sparse.forward` (read its
docstring). The row statistics, float32 `[batch, NUM_Q_HEADS, q_len]`, come from the
dQ kernel (which holds each query tile's dO, and loads its O once): lse_log2 = log2(e) *
lse with +inf for a row with nothing allowed (so exp2(s2 - lse_log2) is the
probability, 0 for such a row), and delta = rowsum(dO * O) - d_lse. With P = exp(S - lse):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q

and with a soft cap dS is further multiplied by 1 - tanh^2, with a score hook by its
derivative (ALiBi only shifts S: no term). In partial tiles P and dS are selected to 0
where masked (never multiplied by 0), so a non-finite dP or tanh there stays out.

The dK/dV kernel keeps one key tile of one kv head stationary and, for GQA, walks the
lists of every query head of its group itself: each dK/dV row is written by exactly one
program, with no atomics, so the result is deterministic.
"""

import triton
import triton.language as tl

from triton_kernels.block_sparse.forward import (
    _allowed,
    _flag_redo,
    _hook_head,
    _isolated_operand,
    _key_value_tile,
    _list_base,
    _modified_scores,
    _nonfinite_rows,
    _poison_rows,
    _program_redo,
    _row_flag_bits,
    _rows_seeing,
)
from triton_kernels.flash_attention.backward import _load_row_stats, _row_statistics
from triton_kernels.flash_attention.forward import (
    _alibi_slope_log2,
    _load_rows,
    _score_constants,
    _tile_ptrs,
    _tile_scores,
)
from triton_kernels.flash_attention.steps import _dkdv_accumulators, _dkdv_step, _dq_step


@triton.jit
def _dq_tile_step(
    dq,
    q,
    do,
    k,
    v,
    lse2,
    delta,
    allowed,
    rows,
    cols,
    batch,
    head,
    qk_scale_log2,
    scale_over_cap,
    cap_log2,
    slope_log2,
    PARTIAL: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_MOD_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dq += dS K over one key tile (unscaled); in a partial tile k is the cleaned copy."""
    qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
    s2, t = _tile_scores(qk, qk_scale_log2, scale_over_cap, cap_log2, HAS_SOFT_CAP)
    s2, g = _modified_scores(
        s2, batch, head, rows, cols, slope_log2, HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD, False, True
    )
    return _dq_step(
        dq, s2, t, g, do, k, v, lse2, delta, allowed, PARTIAL, HAS_SOFT_CAP,
        SCORE_MOD_GRAD is not None, INPUT_PRECISION,
    )  # fmt: skip


@triton.jit
def _dq_full_tiles(
    dq, q, do, k_ptr, v_ptr, lse2, delta, tiles_ptr, base, full, kv_base, rows, batch, head,
    qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dq (unscaled) over the full tiles 0..full of the list at `base`, operands as given."""
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for t in range(0, full):
        cols, k, v = _key_value_tile(
            k_ptr, v_ptr, kv_base, tl.load(tiles_ptr + base + t), 0, offs_n, offs_d, d_ok,
            KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False,
        )  # fmt: skip
        dq = _dq_tile_step(
            dq, q, do, k, v, lse2, delta, True, rows, cols, batch, head,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False, HAS_SOFT_CAP, HAS_ALIBI,
            SCORE_MOD, SCORE_MOD_GRAD, INPUT_PRECISION,
        )  # fmt: skip
    return dq


@triton.jit
def _dq_partial_tiles(
    dq, q, do, k_ptr, v_ptr, k_clean_ptr, k_bad_ptr, lse2, delta, tiles_ptr, codes_ptr, base,
    full, total, kv_base, kv_head, rows, batch, head, table_ptr, q_doc_ptr, kv_doc_ptr,
    q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix, qk_scale_log2,
    scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, MASK_MODE: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_PREFIX: tl.constexpr, PREDICATE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_MOD_GRAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FIND_BAD_ROWS: tl.constexpr, CAREFUL: tl.constexpr,
):  # fmt: skip
    """dq (unscaled) over the partial tiles full..total of the list at `base`, masked by
    the element rule. CAREFUL: K's non-finite rows read as zeros (found in the tile with
    FIND_BAD_ROWS, else from the bridge's copy and flags) and the rows that see one are
    poisoned; otherwise K as given (exact where K is finite)."""
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for t in range(full, total):
        if CAREFUL and not FIND_BAD_ROWS:
            k_rows = k_clean_ptr
        else:
            k_rows = k_ptr
        cols, k, v = _key_value_tile(
            k_rows, v_ptr, kv_base, tl.load(tiles_ptr + base + t), kv_len, offs_n, offs_d,
            d_ok, KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
        )  # fmt: skip
        code = tl.load(codes_ptr + base + t)
        if CAREFUL:
            k, k_bad = _isolated_operand(
                k, k_bad_ptr, batch, kv_len, cols, kv_head, NUM_KV_HEADS, FIND_BAD_ROWS
            )
            if tl.max(k_bad.to(tl.int32), 0) > 0:  # rare: see the forward
                dq = _poison_rows(dq, _rows_seeing(_allowed(
                    rows, cols, offs_m, offs_n, code, table_ptr, q_doc_ptr, kv_doc_ptr,
                    q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix,
                    MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE, BLOCK_M, BLOCK_N,
                    False,
                ), k_bad))  # fmt: skip
        allowed = _allowed(
            rows, cols, offs_m, offs_n, code, table_ptr, q_doc_ptr, kv_doc_ptr, q_pos_ptr,
            kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix, MASK_MODE,
            HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE, BLOCK_M, BLOCK_N, False,
        )  # fmt: skip
        dq = _dq_tile_step(
            dq, q, do, k, v, lse2, delta, allowed, rows, cols, batch, head, qk_scale_log2,
            scale_over_cap, cap_log2, slope_log2, True, HAS_SOFT_CAP, HAS_ALIBI, SCORE_MOD,
            SCORE_MOD_GRAD, INPUT_PRECISION,
        )  # fmt: skip
    return dq


@triton.jit
def _store_row_flags(row_flags_ptr, q, do, batch, head, rows, q_len, NUM_Q_HEADS: tl.constexpr):
    """Stores the int8 flags of query rows `rows` (< q_len) of `head` that dK/dV reads
    (`_query_row_flags`): bit 0 where q's row holds a NaN or an infinity, bit 1 dO's."""
    flags = _nonfinite_rows(q).to(tl.int8) | (_nonfinite_rows(do).to(tl.int8) * 2)
    offsets = (batch * q_len + rows) * NUM_Q_HEADS + head
    tl.store(row_flags_ptr + offsets, flags, mask=rows < q_len)


@triton.jit
def block_sparse_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    d_out_ptr,
    out_ptr,
    lse_ptr,
    d_lse_ptr,
    alibi_slopes_ptr,
    hook_heads_ptr,
    k_clean_ptr,
    k_bad_ptr,
    items_ptr,
    group_heads_ptr,
    counts_ptr,
    tiles_ptr,
    codes_ptr,
    table_ptr,
    q_doc_ptr,
    kv_doc_ptr,
    q_pos_ptr,
    kv_pos_ptr,
    q_len,
    kv_len,
    n_tiles,
    width,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    prefix,
    redo_in_ptr,
    dq_in_ptr,
    row_flags_in_ptr,
    lse_log2_in_ptr,
    delta_in_ptr,
    dq_ptr,
    row_flags_ptr,
    lse_log2_ptr,
    delta_ptr,
    redo_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_WIDTH: tl.constexpr,
    MASK_MODE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREDICATE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_MOD_GRAD: tl.constexpr,
    HAS_D_LSE: tl.constexpr = False,
    FIND_BAD_ROWS: tl.constexpr = False,
    CAREFUL: tl.constexpr = False,
):
    """dQ of one [BLOCK_M]-row query tile of one head of one batch entry, and the row
    statistics the dK/dV kernel reads.

    Grid and lists as `block_sparse_forward_kernel`; d_out_ptr, out_ptr as q (the output's
    cotangent, the output); lse_ptr, d_lse_ptr: float32 [batch, NUM_Q_HEADS, q_len], the
    forward's lse and its cotangent (read only with HAS_D_LSE); lse_log2_ptr, delta_ptr:
    the same shape, written (`_row_statistics`: delta = rowsum(dO * O) - d_lse, from the
    tiles this kernel holds, instead of a pass over O and dO ahead of it); alibi_slopes_ptr: float32
    [NUM_Q_HEADS] (read with HAS_ALIBI); hook_heads_ptr: as the forward's; k_clean_ptr,
    k_bad_ptr: k with its non-finite rows zeroed, and int8 [batch, kv_len, NUM_KV_HEADS]
    flags of them (partial tiles read k there; neither read with FIND_BAD_ROWS, as the
    forward's v_clean_ptr); dq_ptr: as q. row_flags_ptr: with FIND_BAD_ROWS, int8
    [batch, q_len, NUM_Q_HEADS] written for the dK/dV kernel (`_store_row_flags`: bit 0
    where q's row holds a NaN or an infinity, bit 1 where dO's does; this kernel loads
    both rows anyway); without, not written (the bridge computes them). The first launch
    writes them, a CAREFUL one does not (the *_in_ptr: what its outputs alias; the
    statistics it writes again are the same).
    Two launches, redo_in_ptr and redo_ptr as the forward's: partial tiles read K as given
    in the first, and its non-finite rows as zeros in the second.
    """
    if _program_redo(redo_in_ptr, CAREFUL):
        return
    item = tl.program_id(0)
    tile = tl.load(items_ptr + 2 * item)
    group = tl.load(items_ptr + 2 * item + 1)
    head = tl.load(group_heads_ptr + group * GROUP_WIDTH + tl.program_id(1))
    if head < 0:
        return
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    ROWS_ALIGNED: tl.constexpr = (HEAD_DIM * q_ptr.dtype.element_ty.primitive_bitwidth) % 128 == 0
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows = tile * BLOCK_M + offs_m
    row_ok = rows < q_len
    q_base = (batch * q_len + tile * BLOCK_M) * Q_STRIDE + head * HEAD_DIM
    q_ptrs = _tile_ptrs(q_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    do_ptrs = _tile_ptrs(d_out_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    q = _load_rows(q_ptrs, row_ok, d_ok, True, EVEN_D)
    do = _load_rows(do_ptrs, row_ok, d_ok, True, EVEN_D)
    # The rows' flags for dK/dV: free here on sm_90; on sm_80..89 this spills (8-32 B, as
    # does computing them after the loop, from q and dO kept or loaded again).
    if FIND_BAD_ROWS and not CAREFUL:
        _store_row_flags(row_flags_ptr, q, do, batch, head, rows, q_len, NUM_Q_HEADS)
    stats = (batch * NUM_Q_HEADS + head) * q_len + rows
    o_ptrs = _tile_ptrs(out_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    lse2, delta = _row_statistics(
        o_ptrs, do, lse_ptr + stats, d_lse_ptr + stats, delta_ptr + stats,
        lse_log2_ptr + stats, row_ok, d_ok, EVEN_D, HAS_D_LSE,
    )  # fmt: skip
    kv_base = batch * kv_len * KV_STRIDE + kv_head * HEAD_DIM
    qk_scale_log2, scale_over_cap, cap_log2 = _score_constants(
        softmax_scale, logits_soft_cap, HAS_SOFT_CAP
    )
    slope_log2 = _alibi_slope_log2(alibi_slopes_ptr, head, HAS_ALIBI)
    hook_head = _hook_head(hook_heads_ptr, head, SCORE_MOD)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full, total, base = _list_base(counts_ptr, group, tile, n_tiles, width)
    dq = _dq_full_tiles(
        dq, q, do, k_ptr, v_ptr, lse2, delta, tiles_ptr, base, full, kv_base, rows, batch,
        hook_head, qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS, HEAD_DIM,
        BLOCK_N, BLOCK_D, ROWS_ALIGNED, HAS_SOFT_CAP, HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD,
        INPUT_PRECISION,
    )  # fmt: skip
    dq = _dq_partial_tiles(
        dq, q, do, k_ptr, v_ptr, k_clean_ptr, k_bad_ptr, lse2, delta, tiles_ptr, codes_ptr,
        base, full, total, kv_base, kv_head, rows, batch, hook_head, table_ptr, q_doc_ptr,
        kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix,
        qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_M,
        BLOCK_N, BLOCK_D, ROWS_ALIGNED, MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE,
        HAS_SOFT_CAP, HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD, INPUT_PRECISION, FIND_BAD_ROWS,
        CAREFUL,
    )  # fmt: skip
    if not CAREFUL:
        _flag_redo(redo_ptr, dq)
    dq *= softmax_scale
    dq_ptrs = _tile_ptrs(dq_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkdv_tile_step(
    dk,
    dv,
    k,
    v,
    q,
    do,
    lse2,
    delta,
    allowed,
    cols,
    keys,
    batch,
    head,
    qk_scale_log2,
    scale_over_cap,
    cap_log2,
    slope_log2,
    PARTIAL: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_MOD_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    """dv += P^T dO and dk += dS^T Q (unscaled) over one query tile; the tile is
    transposed: rows are keys, columns queries (positions `cols`). DP_FIRST: dP's product
    issued before P's exp2s (`steps._dkdv_products`). HEAD_MAJOR: dv^T += dO^T P and dk^T
    += Q^T dS, the tile (and `allowed`) as the forward's: rows are queries."""
    if HEAD_MAJOR:
        qk_t = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
    else:
        qk_t = tl.dot(k, tl.trans(q), None, input_precision=INPUT_PRECISION)
    s2_t, t_t = _tile_scores(qk_t, qk_scale_log2, scale_over_cap, cap_log2, HAS_SOFT_CAP)
    s2_t, g_t = _modified_scores(
        s2_t, batch, head, cols, keys, slope_log2, HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD,
        not HEAD_MAJOR, True,
    )  # fmt: skip
    return _dkdv_step(
        dk, dv, s2_t, t_t, g_t, q, do, v, lse2, delta, allowed, PARTIAL, HAS_SOFT_CAP,
        SCORE_MOD_GRAD is not None, INPUT_PRECISION, DP_FIRST, HEAD_MAJOR,
    )  # fmt: skip


@triton.jit
def _query_row_flags(row_flags_ptr, batch, head, cols, q_len, NUM_Q_HEADS: tl.constexpr):
    """(q_bad, do_bad) bool [len(cols)]: query rows `cols` of `head` whose q, or dO, holds
    a NaN or an infinity, from the dQ kernel's int8 flags (bit 0: q, bit 1: dO); False
    past q_len."""
    flags = _row_flag_bits(row_flags_ptr, batch, q_len, cols, head, NUM_Q_HEADS)
    return (flags & 1) != 0, (flags & 2) != 0


@triton.jit
def _dkdv_query_tile(q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, batch, head, q_tile, q_len,
                     q_ok, do_ok, offs_m, offs_d, d_ok, CHECK: tl.constexpr,
                     NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     ROWS_ALIGNED: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """(query positions, q, dO, lse_log2, delta) of query tile `q_tile` of `head`. With
    CHECK, rows outside q_ok (dO's: do_ok) load as 0, and the statistics of rows past
    q_len as those of a row with nothing allowed."""
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    cols = q_tile * BLOCK_M + offs_m
    q_base = (batch * q_len + q_tile * BLOCK_M) * Q_STRIDE + head * HEAD_DIM
    q = _load_rows(
        _tile_ptrs(q_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED), q_ok, d_ok,
        CHECK, EVEN_D,
    )  # fmt: skip
    do = _load_rows(
        _tile_ptrs(d_out_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED), do_ok, d_ok,
        CHECK, EVEN_D,
    )  # fmt: skip
    # A scalar offset, then the tile's: `_dkdv_query_tiles` (flash_attention) says why.
    stats = (batch * NUM_Q_HEADS + head) * q_len + q_tile * BLOCK_M
    lse2, delta = _load_row_stats(
        (lse_log2_ptr + stats) + offs_m, (delta_ptr + stats) + offs_m, cols < q_len, CHECK
    )
    return cols, q, do, lse2, delta


@triton.jit
def _dkdv_full_tiles(
    dk, dv, k, v, q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, tiles_ptr, base, full, keys,
    batch, head, hook_head, q_len, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS_ALIGNED: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DP_FIRST: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):  # fmt: skip
    """(dk, dv) (dk unscaled) over the full query tiles 0..full of query head `head`'s
    list at `base` (hook_head: its number for the score hook), operands as given."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for t in range(0, full):
        cols, q, do, lse2, delta = _dkdv_query_tile(
            q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, batch, head,
            tl.load(tiles_ptr + base + t), q_len, True, True, offs_m, offs_d, d_ok, False,
            NUM_Q_HEADS, HEAD_DIM, BLOCK_M, ROWS_ALIGNED, BLOCK_D == HEAD_DIM,
        )  # fmt: skip
        dk, dv = _dkdv_tile_step(
            dk, dv, k, v, q, do, lse2, delta, True, cols, keys, batch, hook_head,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False, HAS_SOFT_CAP,
            HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD, INPUT_PRECISION, DP_FIRST, HEAD_MAJOR,
        )  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_partial_tiles(
    dk, dv, any_bad, k, v, q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, row_flags_ptr, tiles_ptr,
    codes_ptr, base, full, total, keys, batch, head, hook_head, table_ptr, q_doc_ptr,
    kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix,
    qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS_ALIGNED: tl.constexpr, MASK_MODE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_PREFIX: tl.constexpr,
    PREDICATE: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_MOD_GRAD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    CAREFUL: tl.constexpr, DP_FIRST: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):  # fmt: skip
    """(dk, dv, any_bad) over the partial query tiles full..total of query head `head`'s
    list at `base`, masked by the element rule (transposed: rows are keys; with
    HEAD_MAJOR as the forward's). CAREFUL: q's and dO's non-finite rows
    (`_query_row_flags`) read as zeros, and any_bad notes that a tile held one
    (`_keys_seeing_bad_rows` finds the key rows that see it, after the loops); otherwise
    q and dO as given (exact where they are finite)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for t in range(full, total):
        q_tile = tl.load(tiles_ptr + base + t)
        rows = q_tile * BLOCK_M + offs_m
        in_len = rows < q_len
        if CAREFUL:
            q_bad, do_bad = _query_row_flags(row_flags_ptr, batch, head, rows, q_len, NUM_Q_HEADS)
            # Non-finite rows read as zeros: a masked (zero) weight never meets a NaN.
            q_ok = in_len & ~q_bad
            do_ok = in_len & ~do_bad
        else:
            q_ok = in_len
            do_ok = in_len
        cols, q, do, lse2, delta = _dkdv_query_tile(
            q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, batch, head, q_tile, q_len, q_ok, do_ok,
            offs_m, offs_d, d_ok, True, NUM_Q_HEADS, HEAD_DIM, BLOCK_M, ROWS_ALIGNED,
            BLOCK_D == HEAD_DIM,
        )  # fmt: skip
        code = tl.load(codes_ptr + base + t)
        if CAREFUL:
            any_bad |= tl.max((q_bad | do_bad).to(tl.int32), 0) > 0
        allowed = _allowed(
            cols, keys, offs_m, offs_n, code, table_ptr, q_doc_ptr, kv_doc_ptr,
            q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix,
            MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE, BLOCK_M, BLOCK_N,
            not HEAD_MAJOR,
        )  # fmt: skip
        dk, dv = _dkdv_tile_step(
            dk, dv, k, v, q, do, lse2, delta, allowed, cols, keys, batch, hook_head,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, True, HAS_SOFT_CAP,
            HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD, INPUT_PRECISION, DP_FIRST, HEAD_MAJOR,
        )  # fmt: skip
    return dk, dv, any_bad


@triton.jit
def _keys_seeing_bad_rows(
    row_flags_ptr, head_group_ptr, counts_ptr, tiles_ptr, codes_ptr, kv_head, kv_tile, keys,
    batch, n_tiles, width, table_ptr, q_doc_ptr, kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len,
    kv_len, window_left, window_right, prefix, GQA: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_PREFIX: tl.constexpr,
    PREDICATE: tl.constexpr,
):  # fmt: skip
    """(dk_bad, dv_bad) bool [BLOCK_N]: the rows of key tile `kv_tile` that may see a
    non-finite q row (dk_bad) or dO row (dv_bad) in the partial tiles of its GQA group's
    lists (full tiles read q and dO as given: NaN reaches their rows by itself). After the
    CAREFUL launch's loops, only where they met such a row: a NaN select on dk and dv
    inside them made ptxas serialize their wgmma (C7515, Triton 3.9, one query head a kv
    head), and [BLOCK_N] flags carried through them spilled (24-40 B a thread, 3.9)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dk_bad = keys < 0
    dv_bad = keys < 0
    for g in range(0, GQA):
        head = kv_head * GQA + g
        group = tl.load(head_group_ptr + head)
        full, total, base = _list_base(counts_ptr, group, kv_tile, n_tiles, width)
        for t in range(full, total):
            cols = tl.load(tiles_ptr + base + t) * BLOCK_M + offs_m
            q_bad, do_bad = _query_row_flags(row_flags_ptr, batch, head, cols, q_len, NUM_Q_HEADS)
            seen = _allowed(
                cols, keys, offs_m, offs_n, tl.load(codes_ptr + base + t), table_ptr, q_doc_ptr,
                kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right,
                prefix, MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE, BLOCK_M, BLOCK_N,
                True,
            )  # fmt: skip
            dk_bad |= _rows_seeing(seen, q_bad)
            dv_bad |= _rows_seeing(seen, do_bad)
    return dk_bad, dv_bad


@triton.jit
def block_sparse_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    d_out_ptr,
    lse_log2_ptr,
    delta_ptr,
    alibi_slopes_ptr,
    hook_heads_ptr,
    row_flags_ptr,
    items_ptr,
    head_group_ptr,
    counts_ptr,
    tiles_ptr,
    codes_ptr,
    table_ptr,
    q_doc_ptr,
    kv_doc_ptr,
    q_pos_ptr,
    kv_pos_ptr,
    q_len,
    kv_len,
    n_tiles,
    width,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    prefix,
    redo_in_ptr,
    dk_in_ptr,
    dv_in_ptr,
    dk_ptr,
    dv_ptr,
    redo_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_MODE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREDICATE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_MOD_GRAD: tl.constexpr,
    CAREFUL: tl.constexpr = False,
    OVERLAP_SOFTMAX: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):
    """dK, dV of one [BLOCK_N]-row key tile of one kv head of one batch entry.

    Grid: (len(items), NUM_KV_HEADS, batch); items: int32 [n] key tiles, heaviest first,
    every key tile once. head_group_ptr: int32 [NUM_Q_HEADS], each query head's group;
    the lists (counts, tiles, codes) are per key tile: the query tiles that visit it.
    row_flags_ptr: the query rows' non-finite flags (`_query_row_flags`, from the dQ
    kernel or the bridge): partial tiles load those rows of q (dO) as zeros (finding
    them in the loaded tiles instead, as the forward and dQ do on sm_90, spills here);
    alibi_slopes_ptr as the dQ kernel's.
    The table's blocks are [BLOCK_M queries, BLOCK_N keys], as the forward's.
    Two launches, redo_in_ptr and redo_ptr as the forward's (dk_in_ptr, dv_in_ptr: what a
    CAREFUL launch's dk, dv alias): partial tiles read q and dO as given in the first,
    and the flagged rows as zeros in the second. OVERLAP_SOFTMAX: every tile issues its
    dP before P's exp2s (`steps._dkdv_products`). HEAD_MAJOR: dK and dV accumulate as
    [BLOCK_D, BLOCK_N] tiles, dK^T = Q^T dS and dV^T = dO^T P (`steps._dkdv_step`).
    """
    if _program_redo(redo_in_ptr, CAREFUL):
        return
    kv_tile = tl.load(items_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    GQA: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    ROWS_ALIGNED: tl.constexpr = (HEAD_DIM * q_ptr.dtype.element_ty.primitive_bitwidth) % 128 == 0
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    keys = kv_tile * BLOCK_N + offs_n
    key_ok = keys < kv_len
    kv_base = (batch * kv_len + kv_tile * BLOCK_N) * KV_STRIDE + kv_head * HEAD_DIM
    k_ptrs = _tile_ptrs(k_ptr + kv_base, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    v_ptrs = _tile_ptrs(v_ptr + kv_base, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    k = _load_rows(k_ptrs, key_ok, d_ok, True, EVEN_D)
    v = _load_rows(v_ptrs, key_ok, d_ok, True, EVEN_D)
    qk_scale_log2, scale_over_cap, cap_log2 = _score_constants(
        softmax_scale, logits_soft_cap, HAS_SOFT_CAP
    )

    dk, dv = _dkdv_accumulators(BLOCK_N, BLOCK_D, HEAD_MAJOR)
    any_bad = kv_tile < 0  # False, as a scalar the loops can carry
    for g in range(0, GQA):
        head = kv_head * GQA + g
        group = tl.load(head_group_ptr + head)
        slope_log2 = _alibi_slope_log2(alibi_slopes_ptr, head, HAS_ALIBI)
        hook_head = _hook_head(hook_heads_ptr, head, SCORE_MOD)
        full, total, base = _list_base(counts_ptr, group, kv_tile, n_tiles, width)
        dk, dv = _dkdv_full_tiles(
            dk, dv, k, v, q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, tiles_ptr, base, full,
            keys, batch, head, hook_head, q_len, qk_scale_log2, scale_over_cap, cap_log2,
            slope_log2, NUM_Q_HEADS, HEAD_DIM, BLOCK_M, BLOCK_D, ROWS_ALIGNED, HAS_SOFT_CAP,
            HAS_ALIBI, SCORE_MOD, SCORE_MOD_GRAD, INPUT_PRECISION, OVERLAP_SOFTMAX, HEAD_MAJOR,
        )  # fmt: skip
        dk, dv, any_bad = _dkdv_partial_tiles(
            dk, dv, any_bad, k, v, q_ptr, d_out_ptr, lse_log2_ptr, delta_ptr, row_flags_ptr,
            tiles_ptr, codes_ptr, base, full, total, keys, batch, head, hook_head, table_ptr,
            q_doc_ptr, kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left,
            window_right, prefix, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
            NUM_Q_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROWS_ALIGNED, MASK_MODE, HAS_LEFT,
            HAS_RIGHT, HAS_PREFIX, PREDICATE, HAS_SOFT_CAP, HAS_ALIBI, SCORE_MOD,
            SCORE_MOD_GRAD, INPUT_PRECISION, CAREFUL, OVERLAP_SOFTMAX, HEAD_MAJOR,
        )  # fmt: skip
    if not CAREFUL:  # the sum is non-finite where either is (or, harmlessly, overflows)
        _flag_redo(redo_ptr, dk + dv)
    dk = (dk * softmax_scale).to(dk_ptr.dtype.element_ty)
    dv = dv.to(dv_ptr.dtype.element_ty)
    if HEAD_MAJOR:
        dk, dv = tl.trans(dk), tl.trans(dv)
    out_mask = key_ok[:, None] & d_ok[None, :]
    dk_ptrs = _tile_ptrs(dk_ptr + kv_base, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    dv_ptrs = _tile_ptrs(dv_ptr + kv_base, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    tl.store(dk_ptrs, dk, mask=out_mask)
    tl.store(dv_ptrs, dv, mask=out_mask)
    if CAREFUL and any_bad:  # find the key rows that see them and overwrite them with NaN
        dk_bad, dv_bad = _keys_seeing_bad_rows(
            row_flags_ptr, head_group_ptr, counts_ptr, tiles_ptr, codes_ptr, kv_head, kv_tile,
            keys, batch, n_tiles, width, table_ptr, q_doc_ptr, kv_doc_ptr, q_pos_ptr,
            kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix, GQA, NUM_Q_HEADS,
            BLOCK_M, BLOCK_N, MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE,
        )  # fmt: skip
        nan = tl.full([BLOCK_N, BLOCK_D], float("nan"), dk_ptr.dtype.element_ty)
        tl.debug_barrier()  # the stores above first, whichever threads made them
        tl.store(dk_ptrs, nan, mask=out_mask & dk_bad[:, None])
        tl.store(dv_ptrs, nan.to(dv_ptr.dtype.element_ty), mask=out_mask & dv_bad[:, None])
