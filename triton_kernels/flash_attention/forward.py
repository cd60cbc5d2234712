"""Varlen FlashAttention-2 forward kernel, and the tile helpers the backward kernels share.

Layout (packed, variable-length): `q: [total_q, NUM_Q_HEADS, HEAD_DIM]`,
`k, v: [total_k, NUM_KV_HEADS, HEAD_DIM]`, all contiguous; sequence b owns query rows
`[cu_seqlens_q[b], cu_seqlens_q[b+1])` and key rows `[cu_seqlens_k[b], cu_seqlens_k[b+1])`.
The semantics (bottom-right aligned causal/windows, soft cap, ALiBi, sinks, fully masked
rows) are those of `jax_bridge.attention.spec`; an optional per-sequence diagonal shift
(`shift_ptr`, below) moves the diagonal.

Conventions of every kernel here and in `flash_attention_bwd`:

* Work is (tile of one sequence, head). Tiles are listed ahead of the kernel (by
  `attention_schedule_kernel`, or XLA for many sequences) as
  `chunk_indices: int32 [num_chunks, 2]` = (sequence id, tile index within the sequence),
  real rows first; rows past them hold -1. num_chunks is a static bound (empty sequences
  add none), not `batch * cdiv(max_seqlen, BLOCK)`. A program owns one row (surplus
  programs exit at once) or, with PERSISTENT, walks every P-th row.
* Scores live in the log2 domain (`s * log2(e)`, folded into the scale) so the online
  softmax uses exp2; the log-sum-exp the kernels exchange is natural-log.
* Query i of sequence b sits at key position `diag(i) = i + s`, with `s = shift[b]` when
  the kernel is given a shift and `s = len_k - len_q` (bottom-right) otherwise; causal,
  windows and ALiBi's |diag(i) - j| all use it. `shift_ptr` is an int32 [batch] array of
  shifts, or a placeholder of any other element type (the bridge passes a 1-element
  float32 array) for none: the choice is a compile-time specialisation on the pointer's
  type (`_diagonal_shift`), so the unshifted kernels compile exactly as they would
  without the parameter. Any shift is allowed (negative, past len_k: rows then see no
  key) as long as `diag(i) - window_left` and `diag(i) + window_right + 1` fit in int32.
* For a row r with centre `c(r) = r + shift`, the allowed columns are
  `[c - below, c + above] ∩ [0, n_cols)`. In the forward/dQ kernels rows are queries,
  columns keys, `shift = s`, below/above = window left/right. In the dK/dV kernel rows
  are keys, columns queries, `shift = -s`, below/above = window right/left.
  `_column_phases` splits a row tile's column range into masked edges and an unmasked
  middle whose tiles are allowed for every row and lie inside the sequence; for every
  shift each phase is empty or inside [0, n_cols), so no tile outside the sequence is
  visited, and a row tile that sees no column visits at most one (masked) tile.
* The head dim is padded to BLOCK_D (a power of two) inside the kernel by masked loads,
  never in HBM; padded columns load as 0 and are never stored.
"""

import triton
import triton.language as tl

from triton_kernels.flash_attention.steps import _online_softmax_step

LOG2E = tl.constexpr(1.4426950408889634)
# The TMA constexpr of the varlen kernels where their streamed arrays (K and V; dK/dV's Q
# and dO) are the launch's descriptors (the value True is the kernel's own, per
# sequence): `_sequence_keys`, `backward._dkdv_tile`.
HOST_TMA = tl.constexpr(2)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """tanh in float32 via exp2 (no libdevice, so it also runs in the interpreter)."""
    # e = exp(-2|x|) lies in (0, 1]: no overflow, and tanh(|x|) = (1 - e) / (1 + e).
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _column_phases(
    row_first,
    row_last,
    shift,
    n_cols,
    below,
    above,
    HAS_BELOW: tl.constexpr,
    HAS_ABOVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Column tiles a tile of rows [row_first, row_last] must visit, in three phases.

    Returns (start, full_start, full_end, end): the tiles starting in [start, full_start)
    and [full_end, end) need the element mask; every tile in [full_start, full_end) is
    allowed for all rows of the tile and lies inside [0, n_cols). start, full_start and
    full_end are multiples of BLOCK unless a phase is empty; columns outside
    [start, end) are masked for every row, so they are never visited.

    For any shift, each of the three ranges is either empty (its start >= its end) or
    inside [0, n_cols]: start >= 0, and full_start <= full_end <= end <= n_cols unless
    end < 0 (every row's window ends left of column 0), when full_start = full_end =
    end. Windows entirely right of the columns (lo >= n_cols) give full_start = end =
    n_cols and start > n_cols - BLOCK: at most one masked tile.
    """
    lo = row_first * 0
    full_lo = row_first * 0
    hi = n_cols + row_first * 0
    full_hi = n_cols + row_first * 0
    if HAS_BELOW:
        lo = tl.maximum(row_first + shift - below, 0)
        full_lo = tl.maximum(row_last + shift - below, 0)
    if HAS_ABOVE:
        hi = tl.minimum(row_last + shift + above + 1, n_cols)
        full_hi = tl.maximum(tl.minimum(row_first + shift + above + 1, n_cols), 0)
    # lo, full_lo, full_hi >= 0 here, so // rounds down.
    start = (lo // BLOCK) * BLOCK
    full_start = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, start), hi)
    full_end = tl.maximum(tl.minimum((full_hi // BLOCK) * BLOCK, hi), full_start)
    return start, full_start, full_end, hi


@triton.jit
def _chunk_bounds(chunk_indices_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, chunk, seq):
    """(tile index, q_start, len_q, k_start, len_k) of program `chunk`, whose sequence
    `seq` (chunk_indices[chunk, 0]) the caller has checked to be >= 0."""
    tile_index = tl.load(chunk_indices_ptr + 2 * chunk + 1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    len_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    len_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    return tile_index, q_start, len_q, k_start, len_k


@triton.jit
def _sequence_of(chunk_indices_ptr, chunk, num_chunks):
    """The sequence of tile-list row `chunk`: -1 for a row without work or past the
    list's `num_chunks` rows."""
    return tl.load(chunk_indices_ptr + 2 * chunk, mask=chunk < num_chunks, other=-1)


@triton.jit
def _diagonal_shift(shift_ptr, seq, len_q, len_k):
    """Key position of query 0 of sequence `seq`: `shift[seq]` when `shift_ptr` points to
    int32 (a shift is given), else the bottom-right `len_k - len_q`. The test is on the
    pointer's type, so each case compiles to its own kernel."""
    if shift_ptr.dtype.element_ty == tl.int32:
        shift = tl.load(shift_ptr + seq)
    else:
        shift = len_k - len_q
    return shift


@triton.jit
def _score_constants(softmax_scale, logits_soft_cap, HAS_SOFT_CAP: tl.constexpr):
    """(qk_scale_log2, scale_over_cap, cap_log2): the scale arguments of `_scores_log2`."""
    qk_scale_log2 = softmax_scale * LOG2E
    scale_over_cap = softmax_scale
    cap_log2 = LOG2E
    if HAS_SOFT_CAP:
        scale_over_cap = softmax_scale / logits_soft_cap
        cap_log2 = logits_soft_cap * LOG2E
    return qk_scale_log2, scale_over_cap, cap_log2


@triton.jit
def _alibi_slope_log2(alibi_slopes_ptr, head, HAS_ALIBI: tl.constexpr):
    """log2(e) * the ALiBi slope of query head `head` (0 without ALiBi)."""
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(alibi_slopes_ptr + head).to(tl.float32) * LOG2E
    return slope_log2


@triton.jit
def _tile_scores(qk, qk_scale_log2, scale_over_cap, cap_log2, HAS_SOFT_CAP: tl.constexpr):
    """(s2, t): log2(e) * the (soft-capped) scaled scores of raw products `qk`, and
    tanh(scale * qk / cap) for the soft cap's gradient (qk itself without a cap)."""
    t = qk
    if HAS_SOFT_CAP:
        t = _tanh(qk * scale_over_cap)
        s2 = t * cap_log2
    else:
        s2 = qk * qk_scale_log2
    return s2, t


@triton.jit
def _initial_rows(sinks_ptr, head, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """(m, l) [BLOCK_M] of an online softmax before any key. The sink is one more logit of
    every row, with no value: start at it (m = sink, l = exp2(sink - m) = 1, acc = 0).
    A sink of -inf is no sink: m = -inf, l = 0."""
    if HAS_SINKS:
        sink_log2 = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink_log2
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _final_rows(acc, m_i, l_i):
    """(out, natural-log lse) of an online softmax's rows. A row with no allowed key (and
    no sink, or a sink of -inf) has l = 0: output 0, lse -inf."""
    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    # A reciprocal a row and a multiply an element: divided an element at a time, each
    # division took four instructions (the sm_90 forward's epilogue at 128x128, d=128:
    # 518 -> 334 warp-instructions a program under Triton 3.6), which a short document's
    # few key tiles do not amortize.
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(has_mass, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    return out, lse


@triton.jit
def _scores_log2(
    qk,
    rows,
    cols,
    shift,
    n_cols,
    below,
    above,
    qk_scale_log2,
    scale_over_cap,
    cap_log2,
    slope_log2,
    APPLY_MASK: tl.constexpr,
    HAS_BELOW: tl.constexpr,
    HAS_ABOVE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """Scores of one tile in the log2 domain, and tanh of the soft cap (for its gradient).

    qk: [R, C] raw dot products of rows `rows: [R]` with columns `cols: [C]`.
    Returns (s2, t): s2 = log2(e) * (soft-capped scaled score - ALiBi), -inf where masked
    (only when APPLY_MASK); t = tanh(scale * qk / cap) when HAS_SOFT_CAP, else qk.
    """
    s2, t = _tile_scores(qk, qk_scale_log2, scale_over_cap, cap_log2, HAS_SOFT_CAP)
    centre = rows + shift  # a row's column of offset 0 (offset: column - centre)
    if HAS_ALIBI:
        s2 -= tl.abs(cols[None, :] - centre[:, None]).to(tl.float32) * slope_log2
    if APPLY_MASK:
        # -below <= offset <= above as the row's column range [centre - below, centre +
        # above]: its bounds once a row, one comparison an element a side (with an
        # offset an element compared twice, a masked forward step at sm_90, d=128 took
        # 1165 / 928 warp-instructions under Triton 3.6 / 3.9, now 894 / 866; cutting the
        # range at n_cols as well spilled on sm_80 under 3.6). The sums stay within
        # int32 wherever the offsets did (positions and windows below 2**30).
        allowed = cols[None, :] < n_cols
        if HAS_ABOVE:
            allowed &= cols[None, :] <= (centre + above)[:, None]
        if HAS_BELOW:
            allowed &= cols[None, :] >= (centre - below)[:, None]
        s2 = tl.where(allowed, s2, float("-inf"))
    return s2, t


@triton.jit
def _tile_ptrs(base, rows, offs_d, STRIDE: tl.constexpr, ROWS_ALIGNED: tl.constexpr):
    """Pointers [R, BLOCK_D] to rows `rows` (element stride STRIDE) from `base`.

    With ROWS_ALIGNED, the compiler is told every row starts 16-byte aligned. That holds
    when HEAD_DIM * itemsize is a multiple of 16 and the buffers are 16-byte aligned, which
    jax_triton assumes of every array (XLA aligns them further). A launch through
    jax_triton knows the buffers' alignment; an offline compile (the static report) does
    not, and would otherwise see scalar, unpipelined loads.
    """
    ptrs = base + rows[:, None] * STRIDE + offs_d[None, :]
    if ROWS_ALIGNED:
        ptrs = tl.multiple_of(ptrs, [1, 16])
    return ptrs


@triton.jit
def _load_rows(ptrs, row_ok, d_ok, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Loads a [R, BLOCK_D] tile; masked rows (when CHECK_ROWS) and padded dims read 0."""
    if CHECK_ROWS:
        if EVEN_D:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tile


@triton.jit
def _sequence_rows(rows_ptr, length, WIDTH: tl.constexpr, STRIDE: tl.constexpr,
                   BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """A tensor descriptor over `length` rows of WIDTH elements from `rows_ptr`, `STRIDE`
    elements apart (WIDTH: one head, or a GQA group's heads side by side), loaded
    [BLOCK, HEAD_DIM] at a time (one head of BLOCK rows); rows past `length` load as 0.
    An empty sequence gets one row: a descriptor has no zero extent, and nothing is
    loaded from it (key loops are empty; `_overlapped_key_tiles` loads an empty phase's
    tiles past the rows; the warp-specialized forward's Q tile of a surplus program, row
    0 of a non-empty q, is never stored)."""
    return tl.make_tensor_descriptor(
        rows_ptr, shape=[tl.maximum(length, 1), WIDTH], strides=[STRIDE, 1],
        block_shape=[BLOCK, HEAD_DIM],
    )  # fmt: skip


@triton.jit
def _sequence_keys(k_ptr, v_ptr, k_start, len_k, kv_head, KV_STRIDE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """A sequence's keys and values at head `kv_head`, as key loops take them: pointers
    to its row 0, or (TMA) descriptors over its rows only, so that the copy engine
    zero-fills rows past len_k, which are another sequence's (or past the array). Built
    per tile: a program's tiles may belong to different sequences (PERSISTENT).
    TMA == HOST_TMA: k_ptr and v_ptr are the launch's descriptors over all of K and V
    ([total_k, NUM_KV_HEADS * HEAD_DIM], boxes of [BLOCK_N, HEAD_DIM]), and the cursors
    (descriptor, the sequence's first row, the head's first column): `_key_rows` zeroes
    a masked tile's rows past len_k itself (unmasked tiles lie inside the sequence)."""
    if TMA == HOST_TMA:
        k_seq = (k_ptr, k_start, kv_head * HEAD_DIM)
        v_seq = (v_ptr, k_start, kv_head * HEAD_DIM)
    else:
        k_rows = k_ptr + k_start.to(tl.int64) * KV_STRIDE + kv_head * HEAD_DIM
        v_rows = v_ptr + k_start.to(tl.int64) * KV_STRIDE + kv_head * HEAD_DIM
        if TMA:
            k_seq = _sequence_rows(k_rows, len_k, HEAD_DIM, KV_STRIDE, BLOCK_N, HEAD_DIM)
            v_seq = _sequence_rows(v_rows, len_k, HEAD_DIM, KV_STRIDE, BLOCK_N, HEAD_DIM)
        else:
            k_seq, v_seq = k_rows, v_rows
    return k_seq, v_seq


@triton.jit
def _key_cursors(k_seq, v_seq, start, KV_STRIDE: tl.constexpr, TMA: tl.constexpr):
    """Where a key loop from row `start` reads: the descriptors themselves (TMA), or
    pointers to row `start` of the sequence (then stepped by the loop)."""
    if TMA:
        k_at, v_at = k_seq, v_seq
    else:
        k_at = k_seq + start.to(tl.int64) * KV_STRIDE
        v_at = v_seq + start.to(tl.int64) * KV_STRIDE
    return k_at, v_at


@triton.jit
def _key_rows(
    at, n, col_ok, offs_n, offs_d, d_ok, KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_ALIGNED: tl.constexpr,
    APPLY_MASK: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """(tile, next cursor): the [BLOCK_N, BLOCK_D] tile of K or V rows n + offs_n, through
    the descriptor `at` (TMA; rows outside the sequence read 0; it is also the next
    cursor), through the launch's descriptor (TMA == HOST_TMA: `at` is (descriptor,
    first row, first column); rows failing col_ok read 0 where APPLY_MASK) or from the
    pointer `at` to row n (rows failing col_ok read 0 where APPLY_MASK; the next cursor
    points BLOCK_N rows on)."""
    if TMA == HOST_TMA:
        tile, at_next = at[0].load([at[1] + n, at[2]]), at
        if APPLY_MASK:  # another sequence's rows, perhaps not finite, must not reach P V
            tile = tl.where(col_ok[:, None], tile, 0.0)
    elif TMA:
        tile, at_next = at.load([n, 0]), at
    else:
        ptrs = _tile_ptrs(at, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
        tile = _load_rows(ptrs, col_ok, d_ok, APPLY_MASK, BLOCK_D == HEAD_DIM)
        at_next = at + BLOCK_N * KV_STRIDE
    return tile, at_next


@triton.jit
def _key_value_tiles(
    k_at, v_at, n, col_ok, offs_n, offs_d, d_ok, KV_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, APPLY_MASK: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """(K, V, next k_at, next v_at): `_key_rows` of both at key rows n + offs_n."""
    k, k_next = _key_rows(k_at, n, col_ok, offs_n, offs_d, d_ok, KV_STRIDE, HEAD_DIM,
                          BLOCK_N, BLOCK_D, ROWS_ALIGNED, APPLY_MASK, TMA)  # fmt: skip
    v, v_next = _key_rows(v_at, n, col_ok, offs_n, offs_d, d_ok, KV_STRIDE, HEAD_DIM,
                          BLOCK_N, BLOCK_D, ROWS_ALIGNED, APPLY_MASK, TMA)  # fmt: skip
    return k, v, k_next, v_next


@triton.jit
def _forward_key_tiles(
    acc,
    m_i,
    l_i,
    q,
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
    HAS_SINKS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr,
    TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """Online-softmax update of (acc [M, BLOCK_D], m_i [M], l_i [M]) over key tiles [start, end).

    k_seq/v_seq: the sequence's keys and values at this program's kv head: pointers to
    key row 0, or with TMA tensor descriptors over its [len_k, HEAD_DIM] rows (whose
    rows past len_k load as 0, as the masked loads do). The invariant is
    `_online_softmax_step`'s. WARP_SPECIALIZE (with TMA): Triton splits the loop into a
    producer warpgroup (the K and V copies, read from the loop-invariant descriptors) and
    consumer warpgroups (the rest).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_at, v_at = _key_cursors(k_seq, v_seq, start, KV_STRIDE, TMA)
    for n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        cols = n + offs_n
        if WARP_SPECIALIZE:  # its producer takes loads of loop-invariant descriptors only
            k, v = k_seq.load([n, 0]), v_seq.load([n, 0])
        else:
            k, v, k_at, v_at = _key_value_tiles(
                k_at, v_at, n, cols < len_k, offs_n, offs_d, d_ok,
                KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, APPLY_MASK, TMA,
            )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
        acc, m_i, l_i = _softmax_key_tile(
            acc, m_i, l_i, qk, v, rows, cols, shift, len_k, window_left, window_right,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, APPLY_MASK,
            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION,
            RAW_SCORE_MAX,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _softmax_key_tile(
    acc, m_i, l_i, qk, v, rows, cols, shift, len_k, window_left, window_right,
    qk_scale_log2, scale_over_cap, cap_log2, slope_log2, APPLY_MASK: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr,
):  # fmt: skip
    """(acc, m_i, l_i) updated with key tile `cols` from its raw products qk = q.k^T
    [M, BLOCK_N] and its values v: the tile's log2 scores (masked where APPLY_MASK), then
    `_online_softmax_step`."""
    if RAW_SCORE_MAX:  # masked raw products; the scale joins exp2's argument
        qk, _ = _scores_log2(
            qk, rows, cols, shift, len_k, window_left, window_right, 1.0, 1.0, 1.0, 0.0,
            APPLY_MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, False, False,
        )  # fmt: skip
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, qk, v, qk_scale_log2, True, APPLY_MASK, INPUT_PRECISION
        )
    else:
        s2, _ = _scores_log2(
            qk, rows, cols, shift, len_k, window_left, window_right,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
            APPLY_MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI,
        )  # fmt: skip
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, s2, v, 1.0, False, APPLY_MASK, INPUT_PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def _overlapped_key_tiles(
    acc, m_i, l_i, q, k_seq, v_seq, start, end, rows, shift, len_k, window_left,
    window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
    KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS_ALIGNED: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, RAW_SCORE_MAX: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """`_forward_key_tiles` over the unmasked key tiles [start, end), each tile's QK^T
    issued before the previous tile's softmax (FlashAttention-3's intra-warpgroup
    overlap): the wgmma of tile j + 1 runs on the tensor cores while the warps compute
    tile j's exp2s, which the plain loop does one after the other (it waits for QK^T
    before its softmax). Costs the next tile's scores in registers: ptxas keeps the order
    only where they fit (`OVERLAPPED_FORWARD_TILE`). Same numbers as the plain loop: the
    same steps in the same order.

    No branch: an `if` around the first and last tiles (an empty phase) makes ptxas
    serialize every wgmma of the kernel (C7515: registers of an accumulator defined
    inside a pipeline stage). They run unconditionally instead and an empty phase keeps
    (acc, m_i, l_i); its loads read nothing: by pointers every row is masked, by
    descriptors the tiles lie past the sequence's rows, which the copy engine fills
    with zeros without reading (at row 0 an empty sequence's one-row descriptor would
    read the next sequence's first row, or past the array).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    some = start < end
    nowhere = tl.maximum(len_k, 1)  # past the rows of the sequence's descriptors
    k_at, v_at = _key_cursors(k_seq, v_seq, start, KV_STRIDE, TMA)
    k, k_at = _key_rows(
        k_at, tl.where(some, start, nowhere), start + offs_n < end, offs_n, offs_d, d_ok,
        KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True, TMA,
    )  # fmt: skip
    qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
    # Invariant: qk holds the products of tile n - BLOCK_N, v_at points at its values.
    for n in tl.range(start + BLOCK_N, end, BLOCK_N):
        k, k_at = _key_rows(k_at, n, None, offs_n, offs_d, d_ok, KV_STRIDE, HEAD_DIM,
                            BLOCK_N, BLOCK_D, ROWS_ALIGNED, False, TMA)  # fmt: skip
        qk_next = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
        v, v_at = _key_rows(v_at, n - BLOCK_N, None, offs_n, offs_d, d_ok, KV_STRIDE,
                            HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False, TMA)  # fmt: skip
        acc, m_i, l_i = _softmax_key_tile(
            acc, m_i, l_i, qk, v, rows, n - BLOCK_N + offs_n, shift, len_k, window_left,
            window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False,
            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION,
            RAW_SCORE_MAX,
        )  # fmt: skip
        qk = qk_next
    last = tl.where(some, start + (end - 1 - start) // BLOCK_N * BLOCK_N, nowhere)
    v, v_at = _key_rows(
        v_at, last, last + offs_n < end, offs_n, offs_d, d_ok,
        KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True, TMA,
    )  # fmt: skip
    acc_last, m_last, l_last = _softmax_key_tile(
        acc, m_i, l_i, qk, v, rows, last + offs_n, shift, len_k, window_left, window_right,
        qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION,
        RAW_SCORE_MAX,
    )  # fmt: skip
    acc = tl.where(some, acc_last, acc)
    return acc, tl.where(some, m_last, m_i), tl.where(some, l_last, l_i)


@triton.jit
def _forward_keys(
    acc, m_i, l_i, q, k_seq, v_seq, start, full_start, full_end, end, rows, shift, len_k,
    window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
    KV_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS_ALIGNED: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, INPUT_PRECISION: tl.constexpr, RAW_SCORE_MAX: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, OVERLAP_SOFTMAX: tl.constexpr = False,
):  # fmt: skip
    """`_forward_key_tiles` over the key tiles [start, end) of a query tile, in its phases
    (`_column_phases`): the masked tiles of [start, full_start) and [full_end, end), the
    unmasked ones between (OVERLAP_SOFTMAX: by `_overlapped_key_tiles`).
    WARP_SPECIALIZE: one warp-specialized loop over [start, end),
    every tile masked: Triton 3.6 and 3.9 partition a kernel of one loop only (with two
    or three, their Hopper pass fails on the values flowing between them), and an `if`
    around the mask would leave the loop unspecialized.
    """
    if WARP_SPECIALIZE:
        acc, m_i, l_i = _forward_key_tiles(
            acc, m_i, l_i, q, k_seq, v_seq, start, end, rows, shift, len_k,
            window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
            KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_SINKS,
            INPUT_PRECISION, RAW_SCORE_MAX, TMA, True,
        )  # fmt: skip
    else:
        # Without a left window start == 0 and full_start == min(0, end) <= 0 (negative
        # when no key is allowed), so the first phase is empty.
        if HAS_WINDOW_LEFT:
            acc, m_i, l_i = _forward_key_tiles(
                acc, m_i, l_i, q, k_seq, v_seq, start, full_start, rows, shift, len_k,
                window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
                KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
                HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_SINKS,
                INPUT_PRECISION, RAW_SCORE_MAX, TMA,
            )  # fmt: skip
        if OVERLAP_SOFTMAX:
            acc, m_i, l_i = _overlapped_key_tiles(
                acc, m_i, l_i, q, k_seq, v_seq, full_start, full_end, rows, shift, len_k,
                window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
                KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, HAS_WINDOW_LEFT,
                HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, INPUT_PRECISION, RAW_SCORE_MAX, TMA,
            )  # fmt: skip
        else:
            acc, m_i, l_i = _forward_key_tiles(
                acc, m_i, l_i, q, k_seq, v_seq, full_start, full_end, rows, shift, len_k,
                window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
                KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False,
                HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_SINKS,
                INPUT_PRECISION, RAW_SCORE_MAX, TMA,
            )  # fmt: skip
        acc, m_i, l_i = _forward_key_tiles(
            acc, m_i, l_i, q, k_seq, v_seq, full_end, end, rows, shift, len_k,
            window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
            KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_SINKS,
            INPUT_PRECISION, RAW_SCORE_MAX, TMA,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _forward_tile(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    chunk_indices_ptr,
    sinks_ptr,
    alibi_slopes_ptr,
    total_q,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    shift_ptr,
    out_ptr,
    lse_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr,
    TMA: tl.constexpr,
    chunk,
    seq,
    head,
    live=True,
    WARP_SPECIALIZE: tl.constexpr = False,
    OVERLAP_SOFTMAX: tl.constexpr = False,
):
    """out, lse of tile-list row `chunk` (sequence `seq`), for query head `head`; a
    program that is not `live` (WARP_SPECIALIZE's surplus programs, seq 0) visits no key
    and stores nothing."""
    tile_index, q_start, len_q, k_start, len_k = _chunk_bounds(
        chunk_indices_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, chunk, seq
    )
    if WARP_SPECIALIZE:
        tile_index = tl.where(live, tile_index, 0)
        len_q = tl.where(live, len_q, 0)
    kv_head = head // (NUM_Q_HEADS // NUM_KV_HEADS)
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM

    m0 = tile_index * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + offs_m  # query positions within the sequence
    row_ok = rows < len_q
    d_ok = offs_d < HEAD_DIM
    # Rows start 16-byte aligned when a row of HEAD_DIM elements spans a multiple of 16 bytes.
    ROWS_ALIGNED: tl.constexpr = (HEAD_DIM * q_ptr.dtype.element_ty.primitive_bitwidth) % 128 == 0
    q_tile = (q_start + m0).to(tl.int64) * Q_STRIDE + head * HEAD_DIM
    if WARP_SPECIALIZE:  # a load by pointers feeding a dot stops Triton's partitioning
        q_rows = q_ptr + q_start.to(tl.int64) * Q_STRIDE + head * HEAD_DIM
        q = _sequence_rows(q_rows, len_q, HEAD_DIM, Q_STRIDE, BLOCK_M, HEAD_DIM).load([m0, 0])
    else:
        q_ptrs = _tile_ptrs(q_ptr + q_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
        q = _load_rows(q_ptrs, row_ok, d_ok, True, BLOCK_D == HEAD_DIM)

    qk_scale_log2, scale_over_cap, cap_log2 = _score_constants(
        softmax_scale, logits_soft_cap, HAS_SOFT_CAP
    )
    slope_log2 = _alibi_slope_log2(alibi_slopes_ptr, head, HAS_ALIBI)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i = _initial_rows(sinks_ptr, head, BLOCK_M, HAS_SINKS)

    shift = _diagonal_shift(shift_ptr, seq, len_q, len_k)
    row_last = tl.minimum(m0 + BLOCK_M, len_q) - 1
    start, full_start, full_end, end = _column_phases(
        m0, row_last, shift, len_k, window_left, window_right,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_N,
    )  # fmt: skip
    if WARP_SPECIALIZE:
        end = tl.where(live, end, start)
    k_seq, v_seq = _sequence_keys(
        k_ptr, v_ptr, k_start, len_k, kv_head, KV_STRIDE, HEAD_DIM, BLOCK_N, TMA
    )
    acc, m_i, l_i = _forward_keys(
        acc, m_i, l_i, q, k_seq, v_seq, start, full_start, full_end, end, rows, shift, len_k,
        window_left, window_right, qk_scale_log2, scale_over_cap, cap_log2, slope_log2,
        KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED,
        HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_ALIBI, HAS_SINKS, INPUT_PRECISION,
        RAW_SCORE_MAX, TMA, WARP_SPECIALIZE, OVERLAP_SOFTMAX,
    )  # fmt: skip

    out, lse = _final_rows(acc, m_i, l_i)
    # Rows past len_q and padded dims are never stored.
    out_mask = row_ok[:, None] & d_ok[None, :]
    out_ptrs = _tile_ptrs(out_ptr + q_tile, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    lse_row = head.to(tl.int64) * total_q + q_start + m0
    tl.store(lse_ptr + lse_row + offs_m, lse, mask=row_ok)


@triton.jit
def attention_forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    chunk_indices_ptr,
    sinks_ptr,
    alibi_slopes_ptr,
    total_q,
    num_chunks,
    softmax_scale,
    logits_soft_cap,
    window_left,
    window_right,
    shift_ptr,
    out_ptr,
    lse_ptr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr,
    PERSISTENT: tl.constexpr,
    TMA: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    OVERLAP_SOFTMAX: tl.constexpr = False,
):
    """out, lse of one [BLOCK_M]-row query tile of one sequence, for one query head.

    Grid: (P, NUM_Q_HEADS). Without PERSISTENT, P = num_chunks and program (c, h) owns
    tile `chunk_indices[c]`; with it, P may be smaller and program (p, h) takes rows p,
    p + P, ... until a row without work (the list holds its real rows first).

    Args:
      q_ptr: [total_q, NUM_Q_HEADS, HEAD_DIM]; k_ptr, v_ptr: [total_k, NUM_KV_HEADS, HEAD_DIM].
      cu_seqlens_q_ptr, cu_seqlens_k_ptr: int32 [batch + 1].
      chunk_indices_ptr: int32 [num_chunks, 2] (sequence, query tile), real rows first;
        -1 rows: no work. num_chunks: its rows.
      sinks_ptr, alibi_slopes_ptr: float32 [NUM_Q_HEADS] (read only if HAS_SINKS/HAS_ALIBI).
      total_q: rows of q (the lse row stride).
      softmax_scale, logits_soft_cap: float32; window_left, window_right: int32 (read
        only if HAS_SOFT_CAP / HAS_WINDOW_*; causal is window_right = 0).
      shift_ptr: int32 [batch]: key position of each sequence's query 0; a pointer of
        another element type (a placeholder, never read): bottom-right, len_k - len_q.
      out_ptr: [total_q, NUM_Q_HEADS, HEAD_DIM] in q's dtype; lse_ptr: float32
        [NUM_Q_HEADS, total_q], natural log.
      RAW_SCORE_MAX: the row max is taken on raw q.k (valid only for softmax_scale > 0
        without soft cap or ALiBi; the bridge decides).
      PERSISTENT: programs walk the tile list (for lists mostly of empty rows: one block
        launch a row would cost more than the work; the loop costs a few registers).
      TMA: K and V tiles are loaded through device-side tensor descriptors (Hopper's bulk
        tensor copies; the launch must pass the global scratch they are written to).
        Needs HEAD_DIM == BLOCK_D and 16-byte aligned rows (the bridge decides).
        HOST_TMA: through descriptors the launch encodes, k_ptr and v_ptr (over all of
        K and V as [total_k, NUM_KV_HEADS * HEAD_DIM], boxes of [BLOCK_N, HEAD_DIM]):
        no program builds one, and masked tiles zero the rows past their sequence
        (`_key_rows`). Not with WARP_SPECIALIZE.
      WARP_SPECIALIZE (with TMA, not PERSISTENT): Triton splits the key loop into a
        producer warpgroup (the Q, K and V copies) and consumer warpgroups (on Hopper,
        launched with 4 warps: 12, two consumers of BLOCK_M / 2 rows; the launch passes
        the count). Its partitioning takes one loop without early exits: every key tile
        is masked (`_forward_keys`), Q comes by descriptor too, and surplus programs run
        an empty loop instead of returning.
      OVERLAP_SOFTMAX: the unmasked key tiles' QK^T issued a tile ahead of the softmax
        (`_overlapped_key_tiles`).
    """
    tl.static_assert(not (TMA == HOST_TMA and WARP_SPECIALIZE),
                     "the launch's descriptors are not warp-specialized")  # fmt: skip
    head = tl.program_id(1)
    chunk = tl.program_id(0)
    if PERSISTENT:
        seq = _sequence_of(chunk_indices_ptr, chunk, num_chunks)
        # Program p walks rows p, p + P, p + 2P, ... (P programs on axis 0) until one
        # without work: the grid need not cover the list's empty rows.
        while seq >= 0:
            _forward_tile(
                q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, chunk_indices_ptr,
                sinks_ptr, alibi_slopes_ptr, total_q, softmax_scale, logits_soft_cap, window_left,
                window_right, shift_ptr, out_ptr, lse_ptr, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP,
                HAS_SINKS, HAS_ALIBI, INPUT_PRECISION, RAW_SCORE_MAX, TMA, chunk, seq, head,
                True, False, OVERLAP_SOFTMAX,
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
        _forward_tile(
            q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, chunk_indices_ptr, sinks_ptr,
            alibi_slopes_ptr, total_q, softmax_scale, logits_soft_cap, window_left, window_right,
            shift_ptr, out_ptr, lse_ptr, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N,
            BLOCK_D, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_SOFT_CAP, HAS_SINKS, HAS_ALIBI,
            INPUT_PRECISION, RAW_SCORE_MAX, TMA, chunk, seq, head, live, WARP_SPECIALIZE,
            OVERLAP_SOFTMAX,
        )  # fmt: skip
