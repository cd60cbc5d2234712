"""Block-sparse FlashAttention-2 forward kernel, and the tile helpers the backward shares.

Layout: `q: [batch, q_len, NUM_Q_HEADS, HEAD_DIM]`, `k, v: [batch, kv_len, NUM_KV_HEADS,
HEAD_DIM]`, contiguous; lse float32 `[batch, NUM_Q_HEADS, q_len]` (natural log).

Work comes as per-tile lists built on the host (or in the graph, for traced documents)
from the mask's block classification, one set per head group (heads sharing one 2-D
mask; group g's heads are `group_heads[g, :]`, -1 padded):

* `counts: int32 [G, n_tiles, 2]`: (full tiles, all tiles) of each stationary tile
  (a query tile in the forward and dQ kernels, a key tile in dK/dV);
* `tiles: int32 [G, n_tiles, width]`: the other side's tiles it visits, its full ones
  first, then its partial ones;
* `codes: int32 [G, n_tiles, width]`: for a partial tile in TABLE mode, its element mask
  in `table: int8 [P, BLOCK_M, BLOCK_N]` (the distinct partial blocks, stored once).

Full tiles are computed with no element mask and no bounds checks (they lie inside both
sequences); only partial ones evaluate the mask, in one of four modes (`MASK_MODE`):

* TABLE (0): the deduplicated partial blocks (any static mask: NumpyMask, `|`, `&`);
* TOKENS (1): per-token document ids and positions, `q_doc[i] == kv_doc[j]` and a window
  `q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right`, or'ed with `kv_pos[j] < prefix`
  inside the document (DocumentMask, Causal, Local, ChunkedCausal, PrefixLM);
* PREDICATE (2): a user's `@triton.jit` predicate of (q position, kv position);
* INTERVALS (3): query row i allows the kv rows `lo[i] <= j <= hi[i]`, int32 per query
  token in the places of TOKENS' q_doc (lo) and q_pos (hi): the masks whose rows allow
  one run of kv rows each (documents, causal, local, chunked). Only the stationary
  query side is loaded (the forward and dQ kernels load it once, outside their loops);
  the kv side is the tile's own row numbers: the varlen kernels' window arithmetic, where
  TOKENS loads two per-key vectors a tile (on sm_90 at 128x128, 64 registers a thread,
  which spill).

Padded rows and columns are masked in every mode (ids -1 / -2 never match; the table's
padding is False; the predicate is bounded by q_len / kv_len).

Isolation: a masked score is a select to -inf, never a product with 0. In a partial tile
the value-side products (P.V here, dS.K, dS^T.Q and P^T.dO in the backward) would meet
a non-finite row of their right operand with a masked (zero) weight, and 0 * NaN is NaN:
NaN or Inf in one document must never reach another. So every kernel runs twice. The
first launch reads the operands as given, which is exact where they are finite, and
flags each program whose result holds a NaN or an infinity (`_flag_redo`: a masked 0 *
NaN leaves one). The second, CAREFUL, launch computes again only the flagged programs:
its partial tiles read those rows as zeros (a copy of the operand whose non-finite rows
the bridge zeroed, or, on sm_90 (FIND_BAD_ROWS), the forward (V) and dQ (K) kernels find
and zero them in the tiles they load; dK/dV loads the flagged rows of q and dO as zeros,
from flags the dQ kernel writes (sm_90) or XLA computes (sm_80..89)), and the rows that
may see such a row are made NaN instead (`_poison_rows` in dQ's loop, and in the
forward's without FIND_BAD_ROWS; the forward's loop with it and dK/dV's only note that
one was met, and `_rows_seeing_bad_values` / `backward._keys_seeing_bad_rows` find those
rows after the loops). Full tiles read the operands as given in both launches. The
isolation's work (a V tile through registers, half the partial tile's instructions on
sm_90) is paid only where the data holds non-finite values.

ALiBi (HAS_ALIBI): -slope[head] * |q position - kv position| added to every scaled,
soft-capped score. Score hook: an optional `@triton.jit` SCORE_MOD(score, batch, head,
q position, kv position) applied after it (natural units), before the mask;
the backward multiplies dS by SCORE_MOD_GRAD of the same arguments (None: an additive
hook, derivative 1).

Scores live in the log2 domain (`s * log2(e)` folded into the scale).
"""

import triton
import triton.language as tl

from triton_kernels.flash_attention.forward import (
    LN2,
    LOG2E,
    _alibi_slope_log2,
    _final_rows,
    _initial_rows,
    _load_rows,
    _score_constants,
    _tile_ptrs,
    _tile_scores,
)
from triton_kernels.flash_attention.steps import _online_softmax_step

# MASK_MODE values (the bridge's `tile_lists` uses the same numbers).
TABLE = tl.constexpr(0)
TOKENS = tl.constexpr(1)
PREDICATE_MODE = tl.constexpr(2)
INTERVALS = tl.constexpr(3)


@triton.jit
def _modified_scores(
    s2,
    batch,
    head,
    q_idx,
    kv_idx,
    slope_log2,
    HAS_ALIBI: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_MOD_GRAD: tl.constexpr,
    KV_MAJOR: tl.constexpr,
    NEED_GRAD: tl.constexpr,
):
    """(s2', g): log2 scores s2 with ALiBi's -slope * |q - kv| and then the user's score
    hook (`ScoreMod`, which sees and returns natural units) applied, and with NEED_GRAD
    the hook's derivative in its score (1 for an additive hook, whose SCORE_MOD_GRAD is
    None; ALiBi only shifts the score). Without either: (s2, 1)."""
    g = 1.0
    if HAS_ALIBI or SCORE_MOD is not None:
        q = _q_side(q_idx, KV_MAJOR)
        kv = _kv_side(kv_idx, KV_MAJOR)
        if HAS_ALIBI:  # positions as floats first: one subtract and one fma per score
            # (exact below 2^24)
            s2 -= slope_log2 * tl.abs(q.to(tl.float32) - kv.to(tl.float32))
        if SCORE_MOD is not None:
            s = s2 * LN2
            if NEED_GRAD:
                if SCORE_MOD_GRAD is not None:
                    g = SCORE_MOD_GRAD(s, batch, head, q, kv)
            s2 = SCORE_MOD(s, batch, head, q, kv) * LOG2E
    return s2, g


@triton.jit
def _hook_head(hook_heads_ptr, head, SCORE_MOD: tl.constexpr):
    """Query head `head` as the score hook numbers it: the caller's number, from int32
    hook_heads_ptr [NUM_Q_HEADS] (read only with a hook)."""
    hook_head = head
    if SCORE_MOD is not None:
        hook_head = tl.load(hook_heads_ptr + head)
    return hook_head


@triton.jit
def _q_side(x, KV_MAJOR: tl.constexpr):
    """A per-query vector as a tile axis: rows, or columns of a KV_MAJOR tile."""
    if KV_MAJOR:
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _kv_side(x, KV_MAJOR: tl.constexpr):
    """A per-key vector as a tile axis: columns, or rows of a KV_MAJOR tile."""
    if KV_MAJOR:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def _allowed(
    q_idx,
    kv_idx,
    q_local,
    kv_local,
    code,
    table_ptr,
    q_doc_ptr,
    kv_doc_ptr,
    q_pos_ptr,
    kv_pos_ptr,
    q_len,
    kv_len,
    window_left,
    window_right,
    prefix,
    MASK_MODE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREDICATE: tl.constexpr,
    TABLE_Q: tl.constexpr,
    TABLE_KV: tl.constexpr,
    KV_MAJOR: tl.constexpr,
):
    """The element mask of one partial tile: bool [len(q_idx), len(kv_idx)], or its
    transpose [len(kv_idx), len(q_idx)] when KV_MAJOR (the dK/dV kernel's tiles).

    q_idx, kv_idx: the tile's rows / columns in the (padded) sequences; q_local,
    kv_local: the same within the tile (0..TABLE_Q-1, 0..TABLE_KV-1: the table's block).
    """
    if MASK_MODE == TABLE:
        offsets = _q_side(q_local, KV_MAJOR) * TABLE_KV + _kv_side(kv_local, KV_MAJOR)
        ok = tl.load(table_ptr + code.to(tl.int64) * (TABLE_Q * TABLE_KV) + offsets) != 0
    elif MASK_MODE == INTERVALS:  # q_doc_ptr, q_pos_ptr: each row's lo, hi
        kv = _kv_side(kv_idx, KV_MAJOR)
        ok = (kv >= _q_side(tl.load(q_doc_ptr + q_idx), KV_MAJOR)) & (
            kv <= _q_side(tl.load(q_pos_ptr + q_idx), KV_MAJOR)
        )
    elif MASK_MODE == TOKENS:
        q_pos = _q_side(tl.load(q_pos_ptr + q_idx), KV_MAJOR)
        kv_pos = _kv_side(tl.load(kv_pos_ptr + kv_idx), KV_MAJOR)
        inside = (q_pos == q_pos) & (kv_pos == kv_pos)  # all True, tile-shaped
        if HAS_LEFT:
            inside &= kv_pos >= q_pos - window_left
        if HAS_RIGHT:
            inside &= kv_pos <= q_pos + window_right
        if HAS_PREFIX:
            inside |= kv_pos < prefix
        q_doc = _q_side(tl.load(q_doc_ptr + q_idx), KV_MAJOR)
        same = q_doc == _kv_side(tl.load(kv_doc_ptr + kv_idx), KV_MAJOR)
        ok = same & inside
    else:
        q_ok = q_idx < q_len
        kv_ok = kv_idx < kv_len
        q_pos = _q_side(tl.load(q_pos_ptr + q_idx, mask=q_ok, other=0), KV_MAJOR)
        kv_pos = _kv_side(tl.load(kv_pos_ptr + kv_idx, mask=kv_ok, other=0), KV_MAJOR)
        ok = PREDICATE(q_pos, kv_pos) & _q_side(q_ok, KV_MAJOR) & _kv_side(kv_ok, KV_MAJOR)
    return ok


@triton.jit
def _rows_seeing(allowed, bad):
    """bool [R]: the rows of a tile that may see a non-finite row of the other operand
    (allowed: bool [R, C]; bad: bool [C]): the reference's 0 * NaN-free value there is
    NaN."""
    return tl.max((allowed & bad[None, :]).to(tl.int32), 1) > 0


@triton.jit
def _poison_rows(x, rows):
    """x [R, C] with NaN rows where `rows` ([R] bool). An accumulator row poisoned stays
    NaN: every later update scales and adds to it."""
    return tl.where(rows[:, None], float("nan"), x)


@triton.jit
def _nonfinite_rows(x):
    """bool [R]: the rows of a tile x [R, C] that hold a NaN or an infinity."""
    finite = tl.abs(x.to(tl.float32)) < float("inf")  # False for NaN too
    return tl.min(finite.to(tl.int32), 1) == 0


@triton.jit
def _zero_rows(x, rows):
    """x [R, C] with `rows` ([R] bool) zeroed."""
    return tl.where(rows[:, None], tl.zeros_like(x), x)


@triton.jit
def _row_flag_bits(flags_ptr, batch, length, idx, head, HEADS: tl.constexpr):
    """int8 [len(idx)]: the flags (int8 [batch, length, HEADS]) of rows `idx` of `head`;
    0 past `length`."""
    offsets = (batch * length + idx) * HEADS + head
    return tl.load(flags_ptr + offsets, mask=idx < length, other=0)


@triton.jit
def _row_flags(flags_ptr, batch, length, idx, head, HEADS: tl.constexpr):
    """bool [len(idx)]: whether `_row_flag_bits` flags rows `idx` of `head`."""
    return _row_flag_bits(flags_ptr, batch, length, idx, head, HEADS) != 0


@triton.jit
def _list_base(counts_ptr, group, tile, n_tiles, width):
    """(full, total, offset of the tile's list) for stationary `tile` of head group `group`."""
    row = group.to(tl.int64) * n_tiles + tile
    full = tl.load(counts_ptr + 2 * row)
    total = tl.load(counts_ptr + 2 * row + 1)
    return full, total, row * width


@triton.jit
def _forward_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
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
    RAW_SCORE_MAX: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """(acc, m_i, l_i) updated with one key tile (rows, cols: its positions, for ALiBi
    and the score hook); a PARTIAL tile's scores are masked by `allowed`. Full tiles of
    RAW_SCORE_MAX calls take the row max on raw q.k (`_online_softmax_step`)."""
    qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
    return _softmax_tile(
        acc, m_i, l_i, qk, v, allowed, rows, cols, batch, head, qk_scale_log2,
        scale_over_cap, cap_log2, slope_log2, PARTIAL, HAS_SOFT_CAP, HAS_ALIBI,
        RAW_SCORE_MAX, SCORE_MOD, INPUT_PRECISION,
    )  # fmt: skip


@triton.jit
def _softmax_tile(
    acc, m_i, l_i, qk, v, allowed, rows, cols, batch, head, qk_scale_log2, scale_over_cap,
    cap_log2, slope_log2, PARTIAL: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, RAW_SCORE_MAX: tl.constexpr, SCORE_MOD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`_forward_step` past its product: (acc, m_i, l_i) updated with a key tile's raw
    products qk = q.k^T [BLOCK_M, BLOCK_N] and its values v."""
    if RAW_SCORE_MAX and not PARTIAL:
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, qk, v, qk_scale_log2, True, False, INPUT_PRECISION
        )
    else:
        s2, _ = _tile_scores(qk, qk_scale_log2, scale_over_cap, cap_log2, HAS_SOFT_CAP)
        s2, _ = _modified_scores(
            s2, batch, head, rows, cols, slope_log2, HAS_ALIBI, SCORE_MOD, None, False, False
        )
        if PARTIAL:
            s2 = tl.where(allowed, s2, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, s2, v, 1.0, False, PARTIAL, INPUT_PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def _program_index():
    """This program's index in its (x, y, z) grid, x fastest."""
    yz = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    return yz * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def _program_redo(redo_in_ptr, CAREFUL: tl.constexpr):
    """Whether a CAREFUL launch's program has nothing to do: the first launch left its
    int8 flag in redo_in_ptr (one a program, `_program_index`) at 0. False otherwise."""
    idle = False
    if CAREFUL:
        idle = tl.load(redo_in_ptr + _program_index()) == 0
    return idle


@triton.jit
def _flag_redo(redo_ptr, x):
    """Sets this program's flag in redo_ptr (int8, zeroed ahead) where the tile x holds a
    NaN or an infinity: only a non-finite input (or an overflow) makes one, and then a
    partial tile may have met it with a masked, zero weight (0 * NaN)."""
    if _any_nonfinite(x):
        tl.store(redo_ptr + _program_index(), tl.full([], 1, tl.int8))


@triton.jit
def _any_nonfinite(x):
    """Whether the tile x holds a NaN or an infinity (a scalar)."""
    return tl.max(_nonfinite_rows(x).to(tl.int32), 0) > 0


@triton.jit
def _isolated_operand(
    x, flags_ptr, batch, kv_len, cols, kv_head, NUM_KV_HEADS: tl.constexpr,
    FIND_BAD_ROWS: tl.constexpr,
):  # fmt: skip
    """(x, bad): a CAREFUL partial tile's value-side operand x [BLOCK_N, BLOCK_D] (rows
    `cols`) with its non-finite rows zeroed, and those rows (bool [BLOCK_N]): found in x
    itself (FIND_BAD_ROWS), or x read from the bridge's copy (zeroed already) and the
    rows from its flags (int8 [batch, kv_len, NUM_KV_HEADS])."""
    if FIND_BAD_ROWS:
        bad = _nonfinite_rows(x)
        x = _zero_rows(x, bad)
    else:
        bad = _row_flags(flags_ptr, batch, kv_len, cols, kv_head, NUM_KV_HEADS)
    return x, bad


@triton.jit
def _key_value_tile(
    k_ptr, v_ptr, kv_base, kv_tile, kv_len, offs_n, offs_d, d_ok, KV_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """(cols, k, v): key tile `kv_tile`'s positions and its [BLOCK_N, BLOCK_D] rows of k
    and v (pointers at this batch entry's and kv head's row 0: kv_base on); with CHECK,
    rows past kv_len read 0 (a full tile lies inside the sequence)."""
    cols = kv_tile * BLOCK_N + offs_n
    k = _kv_rows(k_ptr, kv_base, kv_tile, cols < kv_len, offs_n, offs_d, d_ok, KV_STRIDE,
                 HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, CHECK)  # fmt: skip
    v = _kv_rows(v_ptr, kv_base, kv_tile, cols < kv_len, offs_n, offs_d, d_ok, KV_STRIDE,
                 HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, CHECK)  # fmt: skip
    return cols, k, v


@triton.jit
def _kv_rows(
    x_ptr, kv_base, kv_tile, row_ok, offs_n, offs_d, d_ok, KV_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """Key tile `kv_tile`'s [BLOCK_N, BLOCK_D] rows of k or v (x_ptr; `_key_value_tile`
    says where kv_base points); with CHECK, rows outside row_ok read 0."""
    kv_row = kv_base + (kv_tile * BLOCK_N).to(tl.int64) * KV_STRIDE
    ptrs = _tile_ptrs(x_ptr + kv_row, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
    return _load_rows(ptrs, row_ok, d_ok, CHECK, BLOCK_D == HEAD_DIM)


@triton.jit
def _forward_full_tiles(
    acc, m_i, l_i, q, k_ptr, v_ptr, tiles_ptr, base, full, kv_base, rows, batch, head,
    qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr, SCORE_MOD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    OVERLAP_SOFTMAX: tl.constexpr,
):  # fmt: skip
    """(acc, m_i, l_i) over the full tiles 0..full of the list at `base`: no element mask,
    no bounds (they lie inside both sequences), operands as given. head: as the score
    hook numbers it. OVERLAP_SOFTMAX: by `_overlapped_full_tiles`."""
    if OVERLAP_SOFTMAX:
        return _overlapped_full_tiles(
            acc, m_i, l_i, q, k_ptr, v_ptr, tiles_ptr, base, full, kv_base, rows, batch, head,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS, HEAD_DIM,
            BLOCK_N, BLOCK_D, ROWS_ALIGNED, HAS_SOFT_CAP, HAS_ALIBI, RAW_SCORE_MAX, SCORE_MOD,
            INPUT_PRECISION,
        )  # fmt: skip
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for t in range(0, full):
        cols, k, v = _key_value_tile(
            k_ptr, v_ptr, kv_base, tl.load(tiles_ptr + base + t), 0, offs_n, offs_d, d_ok,
            KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False,
        )  # fmt: skip
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, k, v, True, rows, cols, batch, head,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False, HAS_SOFT_CAP, HAS_ALIBI,
            RAW_SCORE_MAX, SCORE_MOD, INPUT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _overlapped_full_tiles(
    acc, m_i, l_i, q, k_ptr, v_ptr, tiles_ptr, base, full, kv_base, rows, batch, head,
    qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr, SCORE_MOD: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`_forward_full_tiles` with each tile's QK^T issued before the previous tile's
    softmax (OVERLAP_SOFTMAX), as the varlen forward's unmasked tiles
    (`flash_attention.forward._overlapped_key_tiles`, which says why, and why the first
    and last tiles run without a branch): the same steps in the same order, so the same
    numbers. An empty list (full == 0) loads no row (every row of tile 0 masked) and
    keeps (acc, m_i, l_i)."""
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    some = full > 0
    edge_rows = offs_n < tl.where(some, BLOCK_N, 0)  # the first and last tiles' loads
    kv_tile = tl.load(tiles_ptr + base, mask=some, other=0)
    k = _kv_rows(k_ptr, kv_base, kv_tile, edge_rows, offs_n, offs_d, d_ok, KV_STRIDE,
                 HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True)  # fmt: skip
    qk = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
    # Invariant: qk holds the products of the list's tile t - 1, `kv_tile`.
    for t in range(1, full):
        kv_next = tl.load(tiles_ptr + base + t)
        k = _kv_rows(k_ptr, kv_base, kv_next, None, offs_n, offs_d, d_ok, KV_STRIDE,
                     HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False)  # fmt: skip
        qk_next = tl.dot(q, tl.trans(k), None, input_precision=INPUT_PRECISION)
        v = _kv_rows(v_ptr, kv_base, kv_tile, None, offs_n, offs_d, d_ok, KV_STRIDE,
                     HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, False)  # fmt: skip
        acc, m_i, l_i = _softmax_tile(
            acc, m_i, l_i, qk, v, True, rows, kv_tile * BLOCK_N + offs_n, batch, head,
            qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False, HAS_SOFT_CAP,
            HAS_ALIBI, RAW_SCORE_MAX, SCORE_MOD, INPUT_PRECISION,
        )  # fmt: skip
        qk = qk_next
        kv_tile = kv_next
    v = _kv_rows(v_ptr, kv_base, kv_tile, edge_rows, offs_n, offs_d, d_ok, KV_STRIDE,
                 HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True)  # fmt: skip
    acc_last, m_last, l_last = _softmax_tile(
        acc, m_i, l_i, qk, v, True, rows, kv_tile * BLOCK_N + offs_n, batch, head,
        qk_scale_log2, scale_over_cap, cap_log2, slope_log2, False, HAS_SOFT_CAP, HAS_ALIBI,
        RAW_SCORE_MAX, SCORE_MOD, INPUT_PRECISION,
    )  # fmt: skip
    acc = tl.where(some, acc_last, acc)
    return acc, tl.where(some, m_last, m_i), tl.where(some, l_last, l_i)


@triton.jit
def _forward_partial_tiles(
    acc, m_i, l_i, q, k_ptr, v_ptr, v_clean_ptr, v_bad_ptr, tiles_ptr, codes_ptr, base, full,
    total, kv_base, kv_head, rows, batch, head, table_ptr, q_doc_ptr, kv_doc_ptr, q_pos_ptr,
    kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix, qk_scale_log2,
    scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, MASK_MODE: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_PREFIX: tl.constexpr, PREDICATE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, RAW_SCORE_MAX: tl.constexpr,
    SCORE_MOD: tl.constexpr, INPUT_PRECISION: tl.constexpr, FIND_BAD_ROWS: tl.constexpr,
    CAREFUL: tl.constexpr,
):  # fmt: skip
    """(acc, m_i, l_i, any_bad) over the partial tiles full..total of the list at `base`,
    masked by the element rule. CAREFUL: V's non-finite rows read as zeros (found in the
    tile with FIND_BAD_ROWS, then any_bad notes that one was; else from the bridge's copy
    and flags, and the rows that see one are poisoned here); otherwise V as given (exact
    where V is finite), and any_bad is False."""
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    any_bad = full < 0  # False, as a scalar the loop can carry
    for t in range(full, total):
        if CAREFUL and not FIND_BAD_ROWS:
            v_rows = v_clean_ptr
        else:
            v_rows = v_ptr
        cols, k, v = _key_value_tile(
            k_ptr, v_rows, kv_base, tl.load(tiles_ptr + base + t), kv_len, offs_n, offs_d,
            d_ok, KV_STRIDE, HEAD_DIM, BLOCK_N, BLOCK_D, ROWS_ALIGNED, True,
        )  # fmt: skip
        code = tl.load(codes_ptr + base + t)
        if CAREFUL:
            v, v_bad = _isolated_operand(
                v, v_bad_ptr, batch, kv_len, cols, kv_head, NUM_KV_HEADS, FIND_BAD_ROWS
            )
            if FIND_BAD_ROWS:
                any_bad |= tl.max(v_bad.to(tl.int32), 0) > 0
            else:
                if tl.max(v_bad.to(tl.int32), 0) > 0:  # rare; the mask is evaluated again
                    # here so that the common path keeps nothing extra live
                    acc = _poison_rows(acc, _rows_seeing(_allowed(
                        rows, cols, offs_m, offs_n, code, table_ptr, q_doc_ptr, kv_doc_ptr,
                        q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right,
                        prefix, MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE,
                        BLOCK_M, BLOCK_N, False,
                    ), v_bad))  # fmt: skip
        allowed = _allowed(
            rows, cols, offs_m, offs_n, code, table_ptr, q_doc_ptr, kv_doc_ptr, q_pos_ptr,
            kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix, MASK_MODE,
            HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE, BLOCK_M, BLOCK_N, False,
        )  # fmt: skip
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, k, v, allowed, rows, cols, batch, head, qk_scale_log2,
            scale_over_cap, cap_log2, slope_log2, True, HAS_SOFT_CAP, HAS_ALIBI, RAW_SCORE_MAX,
            SCORE_MOD, INPUT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i, any_bad


@triton.jit
def _rows_seeing_bad_values(
    v_ptr,
    tiles_ptr,
    codes_ptr,
    base,
    full,
    total,
    kv_base,
    tile,
    table_ptr,
    q_doc_ptr,
    kv_doc_ptr,
    q_pos_ptr,
    kv_pos_ptr,
    q_len,
    kv_len,
    window_left,
    window_right,
    prefix,
    MASK_MODE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREDICATE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr,
):
    """bool [BLOCK_M]: the rows of query tile `tile` that may see a non-finite value
    row in the partial tiles full..total of their list (full tiles read V as given: NaN
    reaches their rows by itself). With FIND_BAD_ROWS, after the forward's loop, only
    when it found such a row (the flags path poisons its accumulator in the loop, which
    serializes nothing on sm_80..89).

    The loop only notes that one exists: a NaN select on its accumulator made ptxas
    serialize its wgmma (C7515, Triton 3.9), and a per-row vector kept across it spilled
    (Triton 3.6). The mask is evaluated transposed here so that the compiler does not
    share (and keep live across the loop) the query-side loads that the loop makes."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = tile * BLOCK_M + offs_m
    KV_STRIDE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    seeing = offs_m < 0
    for t in range(full, total):
        kv_tile = tl.load(tiles_ptr + base + t)
        cols = kv_tile * BLOCK_N + offs_n
        kv_row = kv_base + (kv_tile * BLOCK_N).to(tl.int64) * KV_STRIDE
        v_ptrs = _tile_ptrs(v_ptr + kv_row, offs_n, offs_d, KV_STRIDE, ROWS_ALIGNED)
        v = _load_rows(v_ptrs, cols < kv_len, offs_d < HEAD_DIM, True, BLOCK_D == HEAD_DIM)
        v_bad = _nonfinite_rows(v)
        code = tl.load(codes_ptr + base + t)
        allowed_t = _allowed(
            rows, cols, offs_m, offs_n, code, table_ptr, q_doc_ptr, kv_doc_ptr, q_pos_ptr,
            kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix, MASK_MODE,
            HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE, BLOCK_M, BLOCK_N, True,
        )  # fmt: skip
        seeing |= tl.max((allowed_t & v_bad[:, None]).to(tl.int32), 0) > 0  # over keys
    return seeing


@triton.jit
def block_sparse_forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    v_clean_ptr,
    v_bad_ptr,
    sinks_ptr,
    alibi_slopes_ptr,
    hook_heads_ptr,
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
    out_in_ptr,
    lse_in_ptr,
    out_ptr,
    lse_ptr,
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
    HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    RAW_SCORE_MAX: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    FIND_BAD_ROWS: tl.constexpr = False,
    CAREFUL: tl.constexpr = False,
    OVERLAP_SOFTMAX: tl.constexpr = False,
):
    """out, lse of one [BLOCK_M]-row query tile of one head of one batch entry.

    Grid: (len(items), GROUP_WIDTH, batch). items: int32 [n, 2] (query tile, head group),
    heaviest first, every query tile of every group once; program (i, j, b) serves head
    group_heads[group, j] (exits at -1). v_clean_ptr: v with its non-finite rows zeroed;
    v_bad_ptr: int8 [batch, kv_len, NUM_KV_HEADS], 1 for those rows (neither read with
    FIND_BAD_ROWS: partial tiles find and zero those rows of the V tile they load, which
    saves the bridge a pass over V that writes a copy; spill-free on sm_90, it spills on
    sm_80); alibi_slopes_ptr:
    float32 [NUM_Q_HEADS] (read with HAS_ALIBI); hook_heads_ptr: int32 [NUM_Q_HEADS], the
    head numbers the score hook sees (`_hook_head`). The rest as the module docstring; q_len,
    kv_len: the real lengths; n_tiles, width: the lists' dims. RAW_SCORE_MAX: full tiles
    take the row max on raw q.k (valid only for softmax_scale > 0 without a soft cap,
    ALiBi or score hook; the bridge decides). SCORE_MOD: the user's
    `@triton.jit` score hook or None. OVERLAP_SOFTMAX: the full tiles each issue their
    QK^T before the previous tile's softmax (`_overlapped_full_tiles`).

    Two launches (`_program_redo`): the first (not CAREFUL) reads V as given in its
    partial tiles and sets redo_ptr's int8 flag (one a program, zeroed ahead) where its
    result holds a NaN or an infinity; the second (CAREFUL; redo_in_ptr: the first's
    flags; out, lse alias the first's, out_in_ptr and lse_in_ptr, never read) computes
    again only those programs, with V's non-finite rows isolated as above.
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
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    rows = tile * BLOCK_M + offs_m
    row_ok = rows < q_len
    q_base = (batch * q_len + tile * BLOCK_M) * Q_STRIDE + head * HEAD_DIM
    q_ptrs = _tile_ptrs(q_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    q = _load_rows(q_ptrs, row_ok, d_ok, True, EVEN_D)
    kv_base = batch * kv_len * KV_STRIDE + kv_head * HEAD_DIM
    qk_scale_log2, scale_over_cap, cap_log2 = _score_constants(
        softmax_scale, logits_soft_cap, HAS_SOFT_CAP
    )
    slope_log2 = _alibi_slope_log2(alibi_slopes_ptr, head, HAS_ALIBI)
    hook_head = _hook_head(hook_heads_ptr, head, SCORE_MOD)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i = _initial_rows(sinks_ptr, head, BLOCK_M, HAS_SINKS)

    full, total, base = _list_base(counts_ptr, group, tile, n_tiles, width)
    acc, m_i, l_i = _forward_full_tiles(
        acc, m_i, l_i, q, k_ptr, v_ptr, tiles_ptr, base, full, kv_base, rows, batch, hook_head,
        qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_N,
        BLOCK_D, ROWS_ALIGNED, HAS_SOFT_CAP, HAS_ALIBI, RAW_SCORE_MAX, SCORE_MOD, INPUT_PRECISION,
        OVERLAP_SOFTMAX,
    )  # fmt: skip
    acc, m_i, l_i, any_bad = _forward_partial_tiles(
        acc, m_i, l_i, q, k_ptr, v_ptr, v_clean_ptr, v_bad_ptr, tiles_ptr, codes_ptr, base,
        full, total, kv_base, kv_head, rows, batch, hook_head, table_ptr, q_doc_ptr,
        kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left, window_right, prefix,
        qk_scale_log2, scale_over_cap, cap_log2, slope_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_M,
        BLOCK_N, BLOCK_D, ROWS_ALIGNED, MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE,
        HAS_SOFT_CAP, HAS_ALIBI, RAW_SCORE_MAX, SCORE_MOD, INPUT_PRECISION, FIND_BAD_ROWS,
        CAREFUL,
    )  # fmt: skip
    if not CAREFUL:
        _flag_redo(redo_ptr, acc)

    out, lse = _final_rows(acc, m_i, l_i)
    out_ptrs = _tile_ptrs(out_ptr + q_base, offs_m, offs_d, Q_STRIDE, ROWS_ALIGNED)
    out_ok = row_ok[:, None] & d_ok[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_ok)
    lse_row = (batch * NUM_Q_HEADS + head) * q_len
    tl.store(lse_ptr + lse_row + rows, lse, mask=row_ok)
    if CAREFUL and any_bad:  # find the rows that see them again and overwrite them with NaN
        seeing = _rows_seeing_bad_values(
            v_ptr, tiles_ptr, codes_ptr, base, full, total, kv_base, tile, table_ptr,
            q_doc_ptr, kv_doc_ptr, q_pos_ptr, kv_pos_ptr, q_len, kv_len, window_left,
            window_right, prefix, MASK_MODE, HAS_LEFT, HAS_RIGHT, HAS_PREFIX, PREDICATE,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, ROWS_ALIGNED,
        )  # fmt: skip
        nan = tl.full([BLOCK_M, BLOCK_D], float("nan"), out_ptr.dtype.element_ty)
        tl.debug_barrier()  # the store above first, whichever threads made it
        tl.store(out_ptrs, nan, mask=out_ok & seeing[:, None])
