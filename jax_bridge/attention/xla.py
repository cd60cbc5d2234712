"""Blockwise varlen attention in plain JAX: the CPU default and the fallback elsewhere.

Semantics are those of `jax_bridge.attention.spec` (bottom-right aligned masks, soft cap
then ALiBi, sinks in the denominator, fully masked rows -> 0 / lse -inf).

Layout of the computation
-------------------------
The packed query axis is cut into chunks of `block_q` rows of ONE sequence each: the
(sequence, chunk) work items of `prepare_chunk_indices`, as the Triton kernels use them
(`chunk_bound(total_q, block_q, batch)` of them, a static bound). Every query row `i` may attend
exactly one contiguous interval of the packed key axis, `[lo[i], hi[i])`: its own
sequence's keys, narrowed by causality and the window. Both ends are non-decreasing in `i`
within a sequence, so a chunk's rows together need only the union of their intervals. A
`lax.scan` walks the chunks; for each one a `lax.while_loop` walks that interval in blocks
of `block_k` keys with an online softmax. The trip count is data dependent, so work
follows the real (ragged, causal) pattern and never a dense `[T, T]` score matrix: memory
is O(T * block). Because a chunk is one sequence's, keys (and in the backward, rows) of
other sequences are selected to zero before any product: NaN or Inf in one document or in
padding never reaches another, even through a zero probability.

The backward pass is the FlashAttention-2 recurrence written out (no autodiff through the
loops): one pass over query chunks accumulates dq, one pass over key chunks accumulates
dk and dv; each key row `j` is attended by a contiguous interval of query rows, by the same
monotonicity argument. Probabilities are recomputed from the saved log-sum-exp.

Everything is computed in float32 (inputs are upcast tile by tile); results are cast back
to the input dtype. Matmuls run at the call's `precision` (default HIGHEST: exact).

Backend contract (see `jax_bridge.attention.api`): `HEAD_DIMS`, `forward`, `backward`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_bridge.attention.options import AttentionOptions
from jax_bridge.attention.sinks import row_delta, sink_gradient
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.numerics import cdiv
from jax_bridge.core.vma import varying_like
from jax_bridge.host.cu_seqlens import prepare_chunk_indices, token_indices

HEAD_DIMS = (1, 2**16)  # no kernel limit: any head_dim a matmul takes
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128

_F32 = jnp.float32


class _Rows(NamedTuple):
    """Per packed query row (all [rows]): attended key interval and ALiBi anchor.

    lo, hi: int32 packed key indices; the row attends keys lo <= j < hi (lo == hi: none).
    diag:   int32 packed key index aligned with the row (bottom-right), for ALiBi. Kept
            integer (float32 is exact only up to 2^24): only |diag - j| becomes float.
    """

    lo: jax.Array
    hi: jax.Array
    diag: jax.Array


def _block_size(requested: int, total: int) -> int:
    """A tile no larger than needed: small inputs do not pay for a 128-row tile."""
    return max(8, min(requested, cdiv(max(total, 1), 8) * 8))


def _sequence_of(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token index, owning sequence, is-real) for `num_tokens` packed slots.

    Tokens at or past `cu_seqlens[-1]` are not real; their sequence is clipped into range so
    gathers stay in bounds (callers mask them out).
    """
    batch = cu_seqlens.shape[0] - 1
    seq = token_indices(cu_seqlens, num_tokens, column=0)  # -1 past cu_seqlens[-1]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    return token, jnp.clip(seq, 0, max(batch - 1, 0)), seq >= 0


def _shift_of(
    seq: jax.Array, len_q: jax.Array, len_k: jax.Array, shift: jax.Array | None
) -> jax.Array:
    """Key position aligned with query 0 of each token's sequence (bottom-right: len_k - len_q)."""
    return len_k - len_q if shift is None else shift[seq]


def _query_rows(
    cu_q: jax.Array, cu_k: jax.Array, num_rows: int, spec: AttentionSpec, shift: jax.Array | None
) -> _Rows:
    """Key interval of every query slot in `[0, num_rows)` (slots past the data: empty)."""
    if cu_q.shape[0] == 1:  # no sequences: nothing attends anything
        zeros = jnp.zeros((num_rows,), jnp.int32)
        return _Rows(zeros, zeros, zeros)
    token, seq, real = _sequence_of(cu_q, num_rows)
    len_q = cu_q[seq + 1] - cu_q[seq]
    len_k = cu_k[seq + 1] - cu_k[seq]
    diag = token - cu_q[seq] + _shift_of(seq, len_q, len_k, shift)  # key aligned with the query
    # lo <= hi always: diag - left <= diag + right + 1 and clipping is monotone.
    lo = 0 if spec.window_left is None else jnp.clip(diag - spec.window_left, 0, len_k)
    hi = len_k if spec.window_right is None else jnp.clip(diag + spec.window_right + 1, 0, len_k)
    # Slots that are not real get the empty interval at cu_k[-1]: that keeps lo and hi
    # non-decreasing over the whole axis, which the tile bounds rely on.
    end = cu_k[-1]
    lo = jnp.where(real, cu_k[seq] + lo, end).astype(jnp.int32)
    hi = jnp.where(real, cu_k[seq] + hi, end).astype(jnp.int32)
    return _Rows(lo, hi, (cu_k[seq] + diag).astype(jnp.int32))


def _key_rows(
    cu_q: jax.Array, cu_k: jax.Array, num_keys: int, spec: AttentionSpec, shift: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Query interval `[qlo[j], qhi[j])` attending each key slot in `[0, num_keys)`.

    Key position j of a sequence is allowed for query i iff diag(i) - left <= j <=
    diag(i) + right with diag(i) = i + shift (len_k - len_q by default); solved for i this
    is an interval.
    """
    if cu_q.shape[0] == 1:
        zeros = jnp.zeros((num_keys,), jnp.int32)
        return zeros, zeros
    token, seq, real = _sequence_of(cu_k, num_keys)
    len_q = cu_q[seq + 1] - cu_q[seq]
    len_k = cu_k[seq + 1] - cu_k[seq]
    j = token - cu_k[seq] - _shift_of(seq, len_q, len_k, shift)  # key moved onto the query axis
    lo = 0 if spec.window_right is None else jnp.clip(j - spec.window_right, 0, len_q)
    hi = len_q if spec.window_left is None else jnp.clip(j + spec.window_left + 1, 0, len_q)
    end = cu_q[-1]
    lo = jnp.where(real, cu_q[seq] + lo, end).astype(jnp.int32)
    hi = jnp.where(real, cu_q[seq] + hi, end).astype(jnp.int32)
    return lo, hi


class _Chunks(NamedTuple):
    """The (sequence, chunk) work items of one packed axis, as the Triton kernels use them.

    Every chunk is `block` consecutive rows of ONE sequence, so everything it reads on the
    other axis can be selected by that sequence's range: a NaN or Inf in another document
    (or in padding) is never multiplied, not even by a zero probability. All [n] int32,
    n = chunk_bound(total, block, batch); surplus entries are empty (row_end == start == 0).
    """

    start: jax.Array  # first packed row of the chunk
    row_end: jax.Array  # end of its sequence on this axis: rows at or past it are not its
    other_lo: jax.Array  # its sequence's rows on the other axis: [other_lo, other_hi)
    other_hi: jax.Array


def _chunks(cu_this: jax.Array, cu_other: jax.Array, total: int, block: int) -> _Chunks:
    indices = prepare_chunk_indices(cu_this, block, total_tokens=total)
    if cu_this.shape[0] == 1:  # no sequences: every chunk is surplus (and cu[1] would be OOB)
        zeros = jnp.zeros((indices.shape[0],), jnp.int32)
        return _Chunks(zeros, zeros, zeros, zeros)
    seq, chunk = indices[:, 0], indices[:, 1]
    real = seq >= 0
    seq = jnp.maximum(seq, 0)
    pick = lambda x: jnp.where(real, x, 0).astype(jnp.int32)
    return _Chunks(
        start=pick(cu_this[seq] + chunk * block),
        row_end=pick(cu_this[seq + 1]),
        other_lo=pick(cu_other[seq]),
        other_hi=pick(cu_other[seq + 1]),
    )


def _interval_union(lo: jax.Array, hi: jax.Array, ok: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[start, start + length)`: the union of the rows' intervals `[lo, hi)` where `ok`.

    Rows are one sequence's, whose intervals are non-decreasing in both ends, so the union
    is an interval; rows with an empty interval are ignored (no row: length 0).
    """
    nonempty = ok & (hi > lo)
    start = jnp.min(jnp.where(nonempty, lo, jnp.iinfo(jnp.int32).max))
    length = jnp.maximum(jnp.max(jnp.where(nonempty, hi, 0)) - start, 0)
    return jnp.where(length > 0, start, 0), length


def _scatter_rows(tiles: jax.Array, rows: jax.Array, ok: jax.Array, init: jax.Array) -> jax.Array:
    """Writes chunk results back to packed rows.

    tiles: [n, H, block, ...]; rows, ok: [n, block] packed row of each tile row and whether
    it is the chunk's; init: [H, total, ...], kept where no chunk row lands.
    """
    total = init.shape[1]
    # Rows that are not the chunk's land in one spare row past the end, sliced off after:
    # every index is in bounds, so `checkify`'s index checks pass on a valid call (a
    # `mode="drop"` scatter to index `total` would be reported as out of bounds).
    index = jnp.where(ok, rows, total).reshape(-1)
    values = jnp.moveaxis(tiles, 1, 0).reshape(tiles.shape[1], -1, *tiles.shape[3:])
    padded = jnp.pad(init, [(0, 0), (0, 1)] + [(0, 0)] * (init.ndim - 2))
    return padded.at[:, index].set(values.astype(init.dtype))[:, :total]


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """Pads axis 0 with zeros to `rows`."""
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _heads_first(x: jax.Array, rows: int) -> jax.Array:
    """[T, H, D] -> float32 [H, rows, D], zero padded on the token axis."""
    return jnp.transpose(_pad_rows(x, rows), (1, 0, 2)).astype(_F32)


def _dot(
    a: jax.Array, b: jax.Array, contract: tuple[int, int], precision: lax.Precision
) -> jax.Array:
    """float32 matmul batched over axis 0, contracting a's axis contract[0] with b's contract[1]."""
    dims = (((contract[0],), (contract[1],)), ((0,), (0,)))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _scores(
    q_blk: jax.Array,
    k_blk: jax.Array,
    rows: _Rows,
    key_index: jax.Array,
    spec: AttentionSpec,
    slopes: jax.Array | None,
    precision: lax.Precision,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Masked logits of one (query block, key block) pair.

    Args:
      q_blk: [Hkv, G * BQ, D] (query head h = kv_head * G + g). k_blk: [Hkv, BK, D].
      rows: the block's query rows ([BQ] each). key_index: [BK] packed key indices.
      slopes: [Hq] ALiBi slopes or None. precision: of the q.k product.

    Returns:
      s: [Hq, BQ, BK] final logits, -inf where masked; mask: [BQ, BK] bool;
      tanh_sq: [Hq, BQ, BK] tanh(raw / cap)^2 for the soft-cap chain rule, or None.
    """
    bq = rows.lo.shape[0]
    s = _dot(q_blk, k_blk, (2, 2), precision) * spec.softmax_scale  # [Hkv, G * BQ, BK]
    s = s.reshape(-1, bq, s.shape[-1])  # [Hq, BQ, BK]
    tanh_sq = None
    if spec.logits_soft_cap is not None:
        t = jnp.tanh(s / spec.logits_soft_cap)
        s = spec.logits_soft_cap * t
        tanh_sq = t * t
    if slopes is not None:
        # Integer difference first: packed indices past 2^24 are not exact in float32.
        distance = jnp.abs(rows.diag[:, None] - key_index[None, :]).astype(_F32)
        s = s - slopes[:, None, None] * distance[None]
    mask = (key_index[None, :] >= rows.lo[:, None]) & (key_index[None, :] < rows.hi[:, None])
    s = jnp.where(mask[None], s, -jnp.inf)
    return s, mask, tanh_sq


def _grouped(x: jax.Array, num_kv: int) -> jax.Array:
    """[Hq, B, D] -> [Hkv, G * B, D] (query head h = kv_head * G + g)."""
    hq, b, d = x.shape
    return x.reshape(num_kv, (hq // num_kv) * b, d)


def attention_forward_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    spec: AttentionSpec,
    *,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    precision: lax.Precision = lax.Precision.HIGHEST,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    shift: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Blockwise varlen attention forward.

    Args:
      q: [total_q, Hq, D]; k, v: [total_k, Hkv, D] with Hq % Hkv == 0.
      cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] (validated by the caller).
      spec: the attention options. sinks, alibi_slopes: [Hq] or None.
      precision: of every matmul. block_q, block_k: tile sizes (static).
      shift: int32 [batch] or None: query 0 of sequence b sits at key position
        `shift[b]` (None: bottom-right, `len_k - len_q`).

    Returns:
      out: [total_q, Hq, D] in q's dtype; lse: float32 [Hq, total_q].
    """
    total_q, num_q, dim = q.shape
    total_k, num_kv, _ = k.shape
    lse_none = jnp.full((num_q,), -jnp.inf, _F32) if sinks is None else sinks.astype(_F32)
    lse_none = jnp.broadcast_to(lse_none[:, None], (num_q, total_q))
    if total_q == 0 or total_k == 0:
        return jnp.zeros_like(q), varying_like(lse_none, q, k, v)
    bq = _block_size(block_q, total_q)
    bk = _block_size(block_k, total_k)
    chunks = _chunks(cu_seqlens_q, cu_seqlens_k, total_q, bq)
    rows = _query_rows(cu_seqlens_q, cu_seqlens_k, total_q + bq, spec, shift)
    # Padding past the end (bq query rows, bk keys): a block starting below the end is
    # sliced whole (dynamic_slice would otherwise clamp its start and misalign it).
    qh = _heads_first(q, total_q + bq)
    kh = _heads_first(k, total_k + bk)
    vh = _heads_first(v, total_k + bk)
    slopes = None if alibi_slopes is None else alibi_slopes.astype(_F32)

    def chunk_body(_, chunk):
        row_index = chunk.start + jnp.arange(bq, dtype=jnp.int32)
        row_ok = row_index < chunk.row_end
        t_rows = _Rows(*(lax.dynamic_slice_in_dim(x, chunk.start, bq) for x in rows))
        start, length = _interval_union(t_rows.lo, t_rows.hi, row_ok)
        q_blk = _grouped(lax.dynamic_slice_in_dim(qh, chunk.start, bq, axis=1), num_kv)

        def block_body(state):
            n, m, l, acc = state
            k0 = start + n * bk
            key_index = k0 + jnp.arange(bk, dtype=jnp.int32)
            # Keys of other sequences are selected away, never multiplied by p = 0.
            key_ok = ((key_index >= chunk.other_lo) & (key_index < chunk.other_hi))[:, None]
            k_blk = jnp.where(key_ok, lax.dynamic_slice_in_dim(kh, k0, bk, axis=1), 0.0)
            v_blk = jnp.where(key_ok, lax.dynamic_slice_in_dim(vh, k0, bk, axis=1), 0.0)
            s, _, _ = _scores(q_blk, k_blk, t_rows, key_index, spec, slopes, precision)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # Rows with nothing allowed yet keep m = -inf; shifting them by 0 instead
            # makes every exp() an exact 0 rather than exp(-inf + inf) = NaN.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = _dot(_grouped(p, num_kv), v_blk, (2, 1), precision).reshape(num_q, bq, dim)
            return n + 1, m_new, l, alpha[..., None] * acc + pv

        init = (
            jnp.int32(0),
            jnp.full((num_q, bq), -jnp.inf, _F32),
            jnp.zeros((num_q, bq), _F32),
            jnp.zeros((num_q, bq, dim), _F32),
        )
        # Inside shard_map the carry must vary along the mesh axes its updates vary on.
        init = varying_like(init, q_blk, kh, vh, chunk.start)
        num_blocks = cdiv(length, bk)
        _, m, l, acc = lax.while_loop(lambda st: st[0] < num_blocks, block_body, init)
        return None, (*_normalize(m, l, acc, sinks), row_index, row_ok)

    _, (out, lse, row_index, row_ok) = lax.scan(chunk_body, None, chunks)
    out_init = varying_like(jnp.zeros((num_q, total_q, dim), q.dtype), out)
    out = _scatter_rows(out, row_index, row_ok, out_init)
    lse = _scatter_rows(lse, row_index, row_ok, varying_like(lse_none, lse))
    return jnp.swapaxes(out, 0, 1), lse


def _normalize(
    m: jax.Array, l: jax.Array, acc: jax.Array, sinks: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of a chunk from its running max m, sum l [Hq, BQ] and acc [Hq, BQ, D]."""
    if sinks is not None:
        # The sink joins the denominator with logit sinks[h] and no value.
        sink = sinks.astype(_F32)[:, None]
        m_all = jnp.maximum(m, sink)
        # A sink of -inf on a row with no key leaves m_all = -inf: shift by 0 instead
        # (as in the loop), so the exps are exact zeros rather than NaN.
        m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
        scale_old = jnp.exp(m - m_all)
        l_all = l * scale_old + jnp.exp(sink - m_all)
        has_mass = l_all > 0
        l_safe = jnp.where(has_mass, l_all, 1.0)
        out = acc * (scale_old / l_safe)[..., None]
        return out, jnp.where(has_mass, m_all + jnp.log(l_safe), -jnp.inf)
    has_keys = l > 0
    l_safe = jnp.where(has_keys, l, 1.0)
    return acc / l_safe[..., None], jnp.where(has_keys, m + jnp.log(l_safe), -jnp.inf)


class _Backward(NamedTuple):
    """What both backward passes read: padded, heads-first float32 arrays and statics.

    Query-side arrays carry `bq` extra rows (and key-side `bk`) so that a block starting
    below the real end can be sliced whole. Blocks are sliced with their sequence's range
    on that axis: rows outside it are selected to zero, so documents stay independent.
    """

    qh: jax.Array  # [Hq, total_q + bq, D]
    doh: jax.Array  # [Hq, total_q + bq, D]
    lse: jax.Array  # [Hq, total_q + bq]
    delta: jax.Array  # [Hq, total_q + bq]; rowsum(dO * O) - d_lse
    kh: jax.Array  # [Hkv, total_k + bk, D]
    vh: jax.Array  # [Hkv, total_k + bk, D]
    rows: _Rows  # of the total_q + bq query slots
    slopes: jax.Array | None
    spec: AttentionSpec
    precision: lax.Precision
    bq: int
    bk: int

    def query_block(self, r0: jax.Array, lo: jax.Array, hi: jax.Array) -> tuple:
        """(q, dO grouped [Hkv, G * BQ, D], lse, delta [Hq, BQ], rows) of rows r0 + [0, bq),
        rows outside `[lo, hi)` zeroed (lse and delta too: masked, but never NaN)."""
        num_kv = self.kh.shape[0]
        index = r0 + jnp.arange(self.bq, dtype=jnp.int32)
        ok = (index >= lo) & (index < hi)
        take = lambda x: jnp.where(
            ok[:, None] if x.ndim == 3 else ok, lax.dynamic_slice_in_dim(x, r0, self.bq, 1), 0.0
        )
        rows = _Rows(*(lax.dynamic_slice_in_dim(x, r0, self.bq) for x in self.rows))
        q, do = _grouped(take(self.qh), num_kv), _grouped(take(self.doh), num_kv)
        return q, do, take(self.lse), take(self.delta), rows

    def key_block(self, k0: jax.Array, lo: jax.Array, hi: jax.Array) -> tuple:
        """(k, v [Hkv, BK, D], packed key indices [BK]) of keys k0 + [0, bk), keys outside
        `[lo, hi)` zeroed."""
        index = k0 + jnp.arange(self.bk, dtype=jnp.int32)
        ok = ((index >= lo) & (index < hi))[:, None]
        take = lambda x: jnp.where(ok, lax.dynamic_slice_in_dim(x, k0, self.bk, axis=1), 0.0)
        return take(self.kh), take(self.vh), index

    def gradients_of_block(self, q_blk, do_blk, lse_blk, delta_blk, rows, k_blk, v_blk, keys):
        """(P, dS) [Hq, BQ, BK] of one block: probabilities (0 where masked) and dL/d score."""
        s, mask, tanh_sq = _scores(q_blk, k_blk, rows, keys, self.spec, self.slopes, self.precision)
        # Masked entries (including rows with lse = -inf) are forced to exactly 0.
        p = jnp.where(mask[None], jnp.exp(s - jnp.where(mask[None], lse_blk[..., None], 0.0)), 0.0)
        num_q, bq, bk = p.shape
        dp = _dot(do_blk, v_blk, (2, 2), self.precision).reshape(num_q, bq, bk)
        ds = p * (dp - delta_blk[..., None])
        # Through the soft cap: d(cap * tanh(x / cap)) / dx = 1 - tanh^2.
        return p, ds if tanh_sq is None else ds * (1.0 - tanh_sq)


def _dq_pass(b: _Backward, cu_q: jax.Array, cu_k: jax.Array, total_q: int) -> jax.Array:
    """float32 dq [Hq, total_q, D]: query chunks, each over its key interval."""
    num_q, _, dim = b.qh.shape
    num_kv = b.kh.shape[0]

    def dq_chunk(_, chunk):
        query = b.query_block(chunk.start, chunk.start, chunk.row_end)
        row_index = chunk.start + jnp.arange(b.bq, dtype=jnp.int32)
        row_ok = row_index < chunk.row_end
        start, length = _interval_union(query[4].lo, query[4].hi, row_ok)

        def body(state):
            n, dq = state
            k_blk, v_blk, keys = b.key_block(start + n * b.bk, chunk.other_lo, chunk.other_hi)
            _, ds = b.gradients_of_block(*query, k_blk, v_blk, keys)
            return n + 1, dq + _dot(_grouped(ds, num_kv), k_blk, (2, 1), b.precision)

        init = (jnp.int32(0), jnp.zeros((num_kv, (num_q // num_kv) * b.bq, dim), _F32))
        init = varying_like(init, query[0], b.kh, chunk.start)
        _, dq = lax.while_loop(lambda st: st[0] < cdiv(length, b.bk), body, init)
        return None, (dq.reshape(num_q, b.bq, dim) * b.spec.softmax_scale, row_index, row_ok)

    _, (dq, rows, ok) = lax.scan(dq_chunk, None, _chunks(cu_q, cu_k, total_q, b.bq))
    return _scatter_rows(dq, rows, ok, varying_like(jnp.zeros((num_q, total_q, dim), _F32), dq))


def _dkdv_pass(
    b: _Backward, cu_q: jax.Array, cu_k: jax.Array, total_k: int, shift: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """float32 (dk, dv) [Hkv, total_k, D]: key chunks, each over the query rows attending it."""
    num_kv, _, dim = b.kh.shape
    key_lo, key_hi = _key_rows(cu_q, cu_k, total_k + b.bk, b.spec, shift)

    def dkv_chunk(_, chunk):
        k_blk, v_blk, keys = b.key_block(chunk.start, chunk.start, chunk.row_end)
        key_ok = keys < chunk.row_end
        take = lambda x: lax.dynamic_slice_in_dim(x, chunk.start, b.bk)
        start, length = _interval_union(take(key_lo), take(key_hi), key_ok)

        def body(state):
            n, dk, dv = state
            query = b.query_block(start + n * b.bq, chunk.other_lo, chunk.other_hi)
            p, ds = b.gradients_of_block(*query, k_blk, v_blk, keys)
            # Contracting over the G * BQ axis sums the query heads sharing a kv head.
            dv = dv + _dot(_grouped(p, num_kv), query[1], (1, 1), b.precision)
            return n + 1, dk + _dot(_grouped(ds, num_kv), query[0], (1, 1), b.precision), dv

        zeros = jnp.zeros((num_kv, b.bk, dim), _F32)
        init = varying_like((jnp.int32(0), zeros, zeros), k_blk, b.qh, chunk.start)
        _, dk, dv = lax.while_loop(lambda st: st[0] < cdiv(length, b.bq), body, init)
        return None, (dk * b.spec.softmax_scale, dv, keys, key_ok)

    _, (dk, dv, keys, ok) = lax.scan(dkv_chunk, None, _chunks(cu_k, cu_q, total_k, b.bk))
    zeros = varying_like(jnp.zeros((num_kv, total_k, dim), _F32), dk)
    return _scatter_rows(dk, keys, ok, zeros), _scatter_rows(dv, keys, ok, zeros)


def attention_backward_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    spec: AttentionSpec,
    *,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    d_lse: jax.Array | None = None,
    precision: lax.Precision = lax.Precision.HIGHEST,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    shift: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `attention_forward_xla` from its saved output and log-sum-exp.

    Args:
      q, k, v, cu_seqlens_*, spec, sinks, alibi_slopes, precision, shift: as for the
        forward.
      out: [total_q, Hq, D] and lse: float32 [Hq, total_q], the forward's results.
      d_out: [total_q, Hq, D] cotangent of out.
      d_lse: float32 [Hq, total_q] cotangent of lse, or None for zero. Since
        d lse_i / d s_ij = p_ij, it enters exactly like a shift of delta_i below.

    Returns:
      (dq, dk, dv, d_sinks): like q, k, v and sinks (None without sinks). ALiBi slopes
      get no gradient.
    """
    total_q = q.shape[0]
    total_k = k.shape[0]
    # delta_i = sum_d dO_i * O_i  (minus d_lse_i): dS_ij = P_ij * (dP_ij - delta_i).
    delta = row_delta(out, d_out, d_lse)  # [Hq, total_q]
    d_sinks = None if sinks is None else sink_gradient(sinks, lse, delta).astype(sinks.dtype)
    if total_q == 0 or total_k == 0:
        # Without queries or keys every probability is 0: only the sinks carry gradient.
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), d_sinks
    bq = _block_size(block_q, total_q)
    bk = _block_size(block_k, total_k)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, bq)))
    b = _Backward(
        qh=_heads_first(q, total_q + bq),
        doh=_heads_first(d_out, total_q + bq),
        lse=pad(lse),
        delta=pad(delta),
        kh=_heads_first(k, total_k + bk),
        vh=_heads_first(v, total_k + bk),
        rows=_query_rows(cu_seqlens_q, cu_seqlens_k, total_q + bq, spec, shift),
        slopes=None if alibi_slopes is None else alibi_slopes.astype(_F32),
        spec=spec,
        precision=precision,
        bq=bq,
        bk=bk,
    )
    dq = jnp.swapaxes(_dq_pass(b, cu_seqlens_q, cu_seqlens_k, total_q), 0, 1)
    dkdv = _dkdv_pass(b, cu_seqlens_q, cu_seqlens_k, total_k, shift)
    dk, dv = (jnp.swapaxes(x, 0, 1) for x in dkdv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


# ----------------------------------------------------------------- backend contract
# Jitted so that eager calls compile their loops once per shape and options instead of
# re-tracing them on every call; under an outer jit they are simply inlined.


@functools.partial(jax.jit, static_argnames=("options",))
def forward(q, k, v, cu_q, cu_k, sinks, alibi, options: AttentionOptions, shift=None):
    """The backend contract's forward: `attention_forward_xla` under `options`."""
    return attention_forward_xla(
        q,
        k,
        v,
        cu_q,
        cu_k,
        options.spec,
        sinks=sinks,
        alibi_slopes=alibi,
        precision=options.precision,
        shift=shift,
    )


@functools.partial(jax.jit, static_argnames=("options",))
def backward(
    q, k, v, out, lse, d_out, d_lse, cu_q, cu_k, sinks, alibi, options: AttentionOptions, shift=None
):
    """The backend contract's backward: `attention_backward_xla` under `options`."""
    return attention_backward_xla(
        q,
        k,
        v,
        out,
        lse,
        d_out,
        cu_q,
        cu_k,
        options.spec,
        sinks=sinks,
        alibi_slopes=alibi,
        d_lse=d_lse,
        precision=options.precision,
        shift=shift,
    )
