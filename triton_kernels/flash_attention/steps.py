"""The tile steps of every attention kernel in the package, varlen and block-sparse alike.

The two families differ in how a program finds its tiles (ranges from `cu_seqlens`, or
lists from a mask) and how it masks a partial tile (window arithmetic on positions, or an
element mask); given one tile's scores, they do the same arithmetic, written once here:

* `_online_softmax_step`: the forward's update of (acc, m, l) with one key tile;
* `_dq_step`: dq += dS K with one key tile (dQ kernels: a query tile is stationary);
* `_dkdv_step`: dv += P^T dO and dk += dS^T Q with one query tile (dK/dV kernels: a key
  tile is stationary; its tiles are transposed, rows are keys and columns queries), or
  with HEAD_MAJOR dv^T += dO^T P and dk^T += Q^T dS (tiles as the forward's, rows are
  queries; dk, dv [head dim, keys]: FlashAttention-3's swapped dK/dV products, whose
  MMAs' rows are the head dim, which 8 warps split without repeating a product where
  the key tile alone is too short for two warpgroups);
  `_dkdv_dq_step` also returns the query tile's dQ share, dS K, for a dK/dV kernel that
  accumulates dQ itself (FlashAttention-2's backward, by atomic adds).

Scores are in the log2 domain (`s * log2(e)` folded into the scale), -inf where masked;
lse_log2 is log2(e) * lse with +inf for a row with nothing allowed, so exp2(s2 -
lse_log2) is the probability, 0 for such a row. dS is the gradient of the scaled q.k,
unscaled: the kernels multiply dq and dk by the softmax scale once, at the end.

MASKED (masked scores may be -inf) and PARTIAL (the tile has an element mask `allowed`
that selects dS, and P where a product reads it, so that a non-finite score, dP or tanh
where masked stays out: the block-sparse kernels, which do not mask their scores) are
compile-time: a full tile pays for neither.
"""

import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(
    acc,
    m_i,
    l_i,
    x,
    v,
    x_scale,
    RAW: tl.constexpr,
    MASKED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """(acc, m_i, l_i) updated with one key tile.

    x: [M, N] the tile's log2 scores, or with RAW its raw products q.k, whose log2 scores
    are x * x_scale (x_scale > 0: the row max commutes with it, so it joins exp2's
    argument in one fused multiply-add per score); -inf where masked (MASKED).
    v: [N, BLOCK_D], the tile's values.

    Invariant: m_i is the running max of the log2 scores (or -inf), l_i = sum exp2(s2 -
    m_i), acc = sum exp2(s2 - m_i) * v, over the keys seen so far (and the sink, if any).
    """
    if RAW:
        m_new = tl.maximum(m_i, tl.max(x, 1) * x_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(x, 1))
    if MASKED:
        # A row with nothing allowed so far (and no sink, or a sink of -inf) keeps
        # m = -inf; shift by 0, not -inf, so that exp2 gives 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new  # finite: every row of an unmasked tile has allowed keys
    if RAW:
        p = tl.exp2(x * x_scale - m_shift[:, None])
    else:
        p = tl.exp2(x - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _probabilities(s2, lse2, KV_MAJOR: tl.constexpr):
    """P of one tile from its log2 scores and its query rows' lse_log2 (broadcast along
    the tile's query axis: rows, or columns when KV_MAJOR). Unselected: dS selects its
    own, and only dV's product needs P itself."""
    if KV_MAJOR:
        p = tl.exp2(s2 - lse2[None, :])
    else:
        p = tl.exp2(s2 - lse2[:, None])
    return p


@triton.jit
def _score_gradient(
    p,
    dp,
    delta,
    t,
    g,
    allowed,
    PARTIAL: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_HOOK_GRAD: tl.constexpr,
    KV_MAJOR: tl.constexpr,
):
    """dS = P * (dP - delta) of one tile, times the score hook's derivative g (with
    HAS_HOOK_GRAD) and the soft cap's 1 - tanh^2 (t: the tile's tanh); 0 where not
    `allowed`. delta broadcasts as lse_log2 in `_probabilities`."""
    if KV_MAJOR:
        ds = p * (dp - delta[None, :])
    else:
        ds = p * (dp - delta[:, None])
    if HAS_HOOK_GRAD:
        ds *= g
    if HAS_SOFT_CAP:
        ds *= 1.0 - t * t
    if PARTIAL:
        ds = tl.where(allowed, ds, 0.0)
    return ds


@triton.jit
def _dq_step(
    dq,
    s2,
    t,
    g,
    do,
    k,
    v,
    lse2,
    delta,
    allowed,
    PARTIAL: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_HOOK_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dq ([M, BLOCK_D] float32) += dS K with one key tile k, v [N, BLOCK_D], from the
    tile's log2 scores s2 and tanh t [M, N], the hook's derivative g, the query rows'
    dO [M, BLOCK_D], lse_log2 and delta [M]."""
    p = _probabilities(s2, lse2, False)
    dp = tl.dot(do, tl.trans(v), None, input_precision=INPUT_PRECISION)
    ds = _score_gradient(p, dp, delta, t, g, allowed, PARTIAL, HAS_SOFT_CAP, HAS_HOOK_GRAD, False)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)


@triton.jit
def _dkdv_accumulators(BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """(dk, dv) of a dK/dV kernel's key tile, zeros: float32 [BLOCK_N, BLOCK_D], or
    [BLOCK_D, BLOCK_N] with HEAD_MAJOR (`_dkdv_step`)."""
    if HEAD_MAJOR:
        dk = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
        dv = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    else:
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    return dk, dv


@triton.jit
def _dkdv_products(
    dk, dv, s2_t, t_t, g_t, q, do, v, lse2, delta, allowed,
    PARTIAL: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_HOOK_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DP_FIRST: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):  # fmt: skip
    """(dk, dv, dS^T in q's dtype, or with HEAD_MAJOR dS): the body of `_dkdv_step` (read
    its docstring). dV's product is issued before dP's, which it does not need;
    DP_FIRST: dP's before P's exp2s, which it does not need either, so that its wgmma
    runs beside them (costs dP's tile in registers while P is computed)."""
    if HEAD_MAJOR:  # [M, N] tiles; dk, dv: [BLOCK_D, N]
        if DP_FIRST:
            dp = tl.dot(do, tl.trans(v), None, input_precision=INPUT_PRECISION)
        p = _probabilities(s2_t, lse2, False)
        p_dv = p
        if PARTIAL:
            p_dv = tl.where(allowed, p, 0.0)
        dv = tl.dot(tl.trans(do), p_dv.to(do.dtype), dv, input_precision=INPUT_PRECISION)
        if not DP_FIRST:
            dp = tl.dot(do, tl.trans(v), None, input_precision=INPUT_PRECISION)
        ds = _score_gradient(
            p, dp, delta, t_t, g_t, allowed, PARTIAL, HAS_SOFT_CAP, HAS_HOOK_GRAD, False
        ).to(q.dtype)
        dk = tl.dot(tl.trans(q), ds, dk, input_precision=INPUT_PRECISION)
    else:
        if DP_FIRST:
            dp_t = tl.dot(v, tl.trans(do), None, input_precision=INPUT_PRECISION)
        p_t = _probabilities(s2_t, lse2, True)
        p_dv = p_t
        if PARTIAL:
            p_dv = tl.where(allowed, p_t, 0.0)
        dv = tl.dot(p_dv.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        if not DP_FIRST:
            dp_t = tl.dot(v, tl.trans(do), None, input_precision=INPUT_PRECISION)
        ds = _score_gradient(
            p_t, dp_t, delta, t_t, g_t, allowed, PARTIAL, HAS_SOFT_CAP, HAS_HOOK_GRAD, True
        ).to(q.dtype)
        dk = tl.dot(ds, q, dk, input_precision=INPUT_PRECISION)
    return dk, dv, ds


@triton.jit
def _dkdv_step(
    dk,
    dv,
    s2_t,
    t_t,
    g_t,
    q,
    do,
    v,
    lse2,
    delta,
    allowed,
    PARTIAL: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_HOOK_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DP_FIRST: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):
    """(dk, dv) ([N, BLOCK_D] float32) += (dS^T Q, P^T dO) with one query tile q, dO
    [M, BLOCK_D], from the transposed tile's log2 scores s2_t and tanh t_t [N, M] (rows:
    this program's keys, v [N, BLOCK_D]), the hook's derivative g_t and the queries'
    lse_log2 and delta [M]. DP_FIRST: see `_dkdv_products`. HEAD_MAJOR: (dk, dv)
    ([BLOCK_D, N]) += (Q^T dS, dO^T P), from the tile's scores and tanh as the forward's
    ([M, N]: rows are the queries)."""
    dk, dv, _ = _dkdv_products(
        dk, dv, s2_t, t_t, g_t, q, do, v, lse2, delta, allowed,
        PARTIAL, HAS_SOFT_CAP, HAS_HOOK_GRAD, INPUT_PRECISION, DP_FIRST, HEAD_MAJOR,
    )  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_dq_step(
    dk, dv, s2_t, t_t, g_t, q, do, k, v, lse2, delta, allowed,
    PARTIAL: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_HOOK_GRAD: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DP_FIRST: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,
):  # fmt: skip
    """`_dkdv_step`'s (dk, dv), and the query tile's share of dQ, dS K ([M, BLOCK_D]
    float32, unscaled; over this program's keys k [N, BLOCK_D] only), from the same dS."""
    dk, dv, ds = _dkdv_products(
        dk, dv, s2_t, t_t, g_t, q, do, v, lse2, delta, allowed,
        PARTIAL, HAS_SOFT_CAP, HAS_HOOK_GRAD, INPUT_PRECISION, DP_FIRST, HEAD_MAJOR,
    )  # fmt: skip
    if not HEAD_MAJOR:
        ds = tl.trans(ds)
    dq = tl.dot(ds, k, None, input_precision=INPUT_PRECISION)
    return dk, dv, dq
