"""Block-sparse attention in plain XLA that computes only the non-empty blocks.

Layout of the computation
-------------------------
Both sequences are padded to whole blocks (block_q x block_kv, `masks.xla_block_shape`).
A static mask becomes, on the host and cached, the list of its V non-empty (q block,
kv block) pairs with their kind (partial or full) and, for partial ones, the id of their
element mask in a table of the distinct partial blocks (`masks.static_block_list`).
The list is walked in steps of `pairs_per_step` pairs (a `lax.scan`, plus one shorter
step for the remainder, so exactly V pairs are gathered: `masks.block_counts`): a step
gathers its pairs' q and kv tiles, computes their scores, selects the element mask (all
True for full blocks) and folds the result into per-q-row running max / sum / output
(an online softmax across steps, scatter-max and scatter-add by q block).

The backward pass is the FlashAttention-2 recurrence over the same list (written out,
not autodiff through the scan): probabilities are recomputed from the saved lse, dq is
scatter-added by q block, dk and dv by kv block. Memory: O(tokens * heads * head_dim)
for the carries plus one step's tiles, O(pairs_per_step * block_q * block_kv * heads *
batch), independent of V; compute: V blocks forward, about 2.5x that backward.

A DocumentMask of traced `cu_seqlens` / segment ids has data-dependent block lists: its
blocks are classified in the graph (`classify_blocks`, O(tokens + blocks), no `while`),
and the list is all q_blocks * kv_blocks pairs (a static size) sorted non-empty first; the
element mask is evaluated from per-token document ids and positions, and each step is a
`lax.cond` that skips a step with no non-empty pair. Run time then follows the visited
blocks (plus the classification), but memory for the list is O(q_blocks * kv_blocks)
and, under `jax.vmap` (where cond becomes select), every block is computed.

Isolation: masking is a select, never a multiplication by a 0/1 mask. The value-side
products (P.V, dS.K, dS^T.Q, P^T.dO) of a step whose gathered values hold a NaN or Inf
use an isolating product (a zero weight never meets a non-finite value; rows with a
non-zero weight on one still get it): NaN in one document never reaches another.

Everything is computed in float32 (tiles upcast after the gather), at the call's
`precision`; results are cast back to the input dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_bridge.block_sparse.common import row_delta
from jax_bridge.block_sparse.masks import (
    EMPTY,
    FULL,
    PARTIAL,
    head_groups,
    is_traced_document,
    join_mask,
    pad_mask,
    padded_shape,
    static_block_list,
    xla_block_shape,
)
from jax_bridge.block_sparse.options import BlockSparseOptions
from jax_bridge.core.vma import varying_like
from pallas_tpu.splash.mask_info import classify_blocks

HEAD_DIMS = (1, 2**16)  # no kernel limit: any head_dim a matmul takes

_F32 = jnp.float32
# Score elements (batch * pairs * heads * block_q * block_kv) per step: 16 MiB of float32.
_STEP_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class _Work:
    """The pairs one head group visits and how to mask them.

    q_block, kv_block: int32 [V]; kind: int8 [V] (EMPTY only in a traced list);
    partial_id: int32 [V]; allowed(q_block, kv_block, kind, partial_id) -> bool
    [n, block_q, block_kv] for n pairs; dynamic: the list is a traced document's (steps
    without a non-empty pair are skipped at run time).
    """

    q_block: Any
    kv_block: Any
    kind: Any
    partial_id: Any
    allowed: Callable[..., jax.Array]
    dynamic: bool

    @property
    def pairs(self) -> tuple[Any, Any, Any, Any]:
        return (self.q_block, self.kv_block, self.kind, self.partial_id)


def _static_work(mask, shape, block_shape) -> _Work:
    blocks = static_block_list(pad_mask(mask, shape), block_shape)
    # Behind a barrier XLA cannot constant-fold the element masks gathered from these
    # lists (seconds of compile time per call, on every platform, for nothing at run time).
    arrays = (blocks.q_block, blocks.kv_block, blocks.kind, blocks.partial_id)
    *lists, table = lax.optimization_barrier(
        tuple(jnp.asarray(x) for x in (*arrays, blocks.partial_blocks))
    )

    def allowed(q_block, kv_block, kind, partial_id):
        del q_block, kv_block
        kind = kind[:, None, None]
        return (kind == FULL) | ((kind == PARTIAL) & table[partial_id])

    return _Work(*lists, allowed=allowed, dynamic=False)


def _document_work(mask, shape, block_shape) -> _Work:
    """All pairs, non-empty first; element masks from the documents' per-token arrays."""
    padded = pad_mask(mask, shape)
    bq, bk = block_shape
    classes = classify_blocks(padded, block_shape)  # traced int8 [nq, nk]
    num_kv = classes.shape[1]
    flat = classes.ravel()
    order = jnp.argsort(flat == EMPTY, stable=True).astype(jnp.int32)
    q_rel, kv_rel, q_doc, kv_doc = (jnp.asarray(x) for x in padded.element_arrays())
    rule = padded.rule

    def allowed(q_block, kv_block, kind, partial_id):
        del partial_id
        rows = q_block[:, None] * bq + jnp.arange(bq)
        cols = kv_block[:, None] * bk + jnp.arange(bk)
        ok = q_doc[rows][:, :, None] == kv_doc[cols][:, None, :]
        if rule is not None:
            ok = ok & rule(q_rel[rows][:, :, None], kv_rel[cols][:, None, :])
        return ok & (kind != EMPTY)[:, None, None]

    pairs = (order // num_kv, order % num_kv, flat[order], jnp.zeros_like(order))
    return _Work(*pairs, allowed=allowed, dynamic=True)


def _run(step, carry, work: _Work, pairs_per_step: int, operands: tuple):
    """Folds `step(carry, pairs)` over the list: a scan of whole steps, then the rest.

    operands: the arrays `step` reads. Inside `shard_map` the carry starts varying along
    their mesh axes (and the list's), as the steps' results do.
    """
    carry = varying_like(carry, *operands, *(x for x in work.pairs if isinstance(x, jax.Array)))
    if work.dynamic:
        body = lambda c, xs: lax.cond(jnp.any(xs[2] != EMPTY), step, lambda c, _: c, c, xs)
    else:
        body = step
    total = work.kind.shape[0]
    steps, rest = divmod(total, pairs_per_step)
    if steps:
        xs = tuple(jnp.asarray(x)[: steps * pairs_per_step].reshape(steps, -1) for x in work.pairs)
        carry = lax.scan(lambda c, x: (body(c, x), None), carry, xs)[0]
    if rest:
        carry = body(carry, tuple(jnp.asarray(x)[steps * pairs_per_step :] for x in work.pairs))
    return carry


# ------------------------------------------------------------------------- products


def _dot(spec: str, a, b, precision) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=_F32)


def _isolating(spec: str, weights, values, precision) -> jax.Array:
    """weights . values by `spec` (values' and the output's last axis: the features),
    where a zero weight never meets a non-finite value: the clean product, except rows
    that give a non-zero weight to a non-finite value, which get the raw one."""
    finite = jnp.isfinite(values)
    clean = _dot(spec, weights, jnp.where(finite, values, 0.0), precision)
    operands, out = spec.split("->")
    w_sub, v_sub = operands.split(",")
    bad = jnp.any(~finite, axis=-1).astype(_F32)
    touch_spec = f"{w_sub},{v_sub[:-1]}->{out[:-1]}"
    touches = _dot(touch_spec, (weights != 0).astype(_F32), bad, precision) > 0
    raw = _dot(spec, weights, values, precision)
    return jnp.where(touches[..., None], raw, clean)


def _product(spec: str, weights, values, precision) -> jax.Array:
    """The plain product, or the isolating one when the values hold a NaN or Inf."""
    plain = lambda w, x: _dot(spec, w, x, precision)
    isolating = lambda w, x: _isolating(spec, w, x, precision)
    return lax.cond(jnp.all(jnp.isfinite(values)), plain, isolating, weights, values)


def _scores(q_tiles, k_tiles, options: BlockSparseOptions, positions, derivative: bool = False):
    """(scores, capped scores, d scores / d capped) float32 [B, n, Hk, G, bq, bk]: scaled,
    soft-capped, shifted by ALiBi, then through the score hook. The hook's derivative
    (for the backward, when `derivative`) is 1.0 without a hook and None when not asked
    for.

    positions: (heads, q_block [n], kv_block [n], block_shape) of the step.
    """
    scaled = _dot("bcqhgd,bckhd->bchgqk", q_tiles, k_tiles, options.precision)
    scaled = scaled * options.softmax_scale
    cap = options.logits_soft_cap
    capped = scaled if cap is None else cap * jnp.tanh(scaled / cap)
    heads, q_block, kv_block, (bq, bk) = positions
    hook, alibi = options.score_mod, heads.alibi
    if hook is None and alibi is None:
        return capped, capped, 1.0
    q_pos = (q_block[:, None] * bq + jnp.arange(bq, dtype=jnp.int32))[None, :, None, None, :, None]
    kv_pos = (kv_block[:, None] * bk + jnp.arange(bk, dtype=jnp.int32))[None, :, None, None, None]
    biased = capped
    if alibi is not None:
        distance = jnp.abs(q_pos - kv_pos).astype(_F32)
        biased = capped - alibi[None, None, :, :, None, None] * distance
    if hook is None:
        return biased, capped, 1.0
    batch = jnp.arange(capped.shape[0], dtype=jnp.int32)[:, None, None, None, None, None]
    head = jnp.asarray(heads.index, jnp.int32)[None, None, :, :, None, None]
    apply = lambda c: hook.apply(c, batch, head, q_pos, kv_pos)
    if not derivative:
        return apply(biased), capped, None
    # The hook is elementwise in the score: a jvp with ones is its derivative.
    scores, d_hook = jax.jvp(apply, (biased,), (jnp.ones_like(biased),))
    return scores, capped, d_hook


# ------------------------------------------------------------------- one head group


@dataclasses.dataclass(frozen=True)
class _Heads:
    """One head group's query heads, as the `_group_view` axes [Hk, G]: their numbers as
    the score hook sees them (int32) and their ALiBi slopes (float32, or None)."""

    index: np.ndarray
    alibi: jax.Array | None


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """One head group's operands cut into blocks, float32.

    q: [B, nq, bq, Hk, G, D]; k, v: [B, nk, bk, Hk, D] (v's last axis Dv); d_out (the
    backward's) like q with Dv.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    d_out: jax.Array | None = None


def _tiles(q, k, v, block_shape, d_out=None) -> _Tiles:
    """q [B, Q, Hk, G, D], k / v [B, K, Hk, D] (padded) as `_Tiles`."""
    bq, bk = block_shape
    cut_q = lambda x: x.astype(_F32).reshape(x.shape[0], -1, bq, *x.shape[2:])
    cut_k = lambda x: x.astype(_F32).reshape(x.shape[0], -1, bk, *x.shape[2:])
    return _Tiles(cut_q(q), cut_k(k), cut_k(v), None if d_out is None else cut_q(d_out))


def _group_forward(t: _Tiles, sink, work: _Work, options, pairs_per_step: int, heads, block_shape):
    """(out f32 [B, nq, Hk, G, bq, Dv], lse f32 [B, nq, Hk, G, bq]) of one head group
    (heads: its `_Heads`).

    Invariant after every step: m is the running max of each row's visited scores
    (-inf: none yet), l = sum exp(s - m), acc = sum exp(s - m) v (both 0 when m = -inf).
    """
    batch, nq, bq, hk, g, _ = t.q.shape
    rows = (batch, nq, hk, g, bq)
    carry = (
        jnp.full(rows, -jnp.inf, _F32),
        jnp.zeros(rows, _F32),
        jnp.zeros((*rows, t.v.shape[-1]), _F32),
    )

    def step(carry, pairs):
        m, l, acc = carry
        q_block, kv_block = pairs[0], pairs[1]
        allowed = work.allowed(*pairs)[None, :, None, None]
        positions = (heads, q_block, kv_block, block_shape)
        s, _, _ = _scores(t.q[:, q_block], t.k[:, kv_block], options, positions)
        s = jnp.where(allowed, s, -jnp.inf)  # a select: NaN of masked pairs is dropped
        m_new = m.at[:, q_block].max(jnp.max(s, axis=-1))
        # A row with no finite max yet shifts by 0: exp(-inf - 0) = 0, never NaN.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - shift)
        p = jnp.where(allowed, jnp.exp(s - shift[:, q_block][..., None]), 0.0)
        l = alpha * l + jnp.zeros_like(l).at[:, q_block].add(jnp.sum(p, axis=-1))
        pv = _product("bchgqk,bckhd->bchgqd", p, t.v[:, kv_block], options.precision)
        acc = alpha[..., None] * acc + jnp.zeros_like(acc).at[:, q_block].add(pv)
        return m_new, l, acc

    m, l, acc = _run(step, carry, work, pairs_per_step, (t.q, t.k, t.v, sink, heads.alibi))
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    # out = acc / (l + the sink's mass on m's scale): the row sum itself, not exp(m - lse)
    # (lse's float32 rounding at large logits would scale the output). No key: acc = 0;
    # a +inf sink: total inf, out 0.
    total = l
    if sink is not None:
        sink = sink[None, None, :, :, None]
        lse = jnp.logaddexp(lse, sink)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        total = l + jnp.where(jnp.isfinite(m), jnp.exp(sink - m_safe), 0.0)
    factor = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return acc * factor[..., None], lse


def _group_backward(
    t: _Tiles, lse, delta, work: _Work, options, pairs_per_step: int, heads, block_shape
):
    """(dq like t.q, dk like t.k, dv like t.v) of one head group; lse, delta f32
    [B, nq, Hk, G, bq]; heads as `_group_forward`."""
    # A row that saw nothing (lse -inf) has no probabilities: exp(s - inf) = 0.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    cap, precision = options.logits_soft_cap, options.precision

    def step(carry, pairs):
        dq, dk, dv = carry
        q_block, kv_block = pairs[0], pairs[1]
        allowed = work.allowed(*pairs)[None, :, None, None]
        q, k, v, d_out = (t.q[:, q_block], t.k[:, kv_block], t.v[:, kv_block], t.d_out[:, q_block])
        positions = (heads, q_block, kv_block, block_shape)
        s, capped, d_hook = _scores(q, k, options, positions, derivative=True)
        p = jnp.where(allowed, jnp.exp(s - lse[:, q_block][..., None]), 0.0)
        dp = _dot("bcqhgd,bckhd->bchgqk", d_out, v, precision)
        ds = jnp.where(allowed, p * (dp - delta[:, q_block][..., None]) * d_hook, 0.0)
        if cap is not None:  # d(c tanh(x / c)) / dx = 1 - (capped / c)^2
            ds = ds * (1.0 - jnp.square(jnp.where(allowed, capped, 0.0) / cap))
        ds = ds * options.softmax_scale
        dq = dq.at[:, q_block].add(_product("bchgqk,bckhd->bcqhgd", ds, k, precision))
        dk = dk.at[:, kv_block].add(_product("bchgqk,bcqhgd->bckhd", ds, q, precision))
        dv = dv.at[:, kv_block].add(_product("bchgqk,bcqhgd->bckhd", p, d_out, precision))
        return dq, dk, dv

    carry = (jnp.zeros_like(t.q), jnp.zeros_like(t.k), jnp.zeros_like(t.v))
    operands = (t.q, t.k, t.v, t.d_out, lse, delta, heads.alibi)
    return _run(step, carry, work, pairs_per_step, operands)


# ------------------------------------------------------------------ the backend contract


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Block shape, padded lengths and head grouping of one call."""

    block_shape: tuple[int, int]
    q_len: int
    kv_len: int
    padded: tuple[int, int]
    group: int  # query heads per kv head

    @classmethod
    def make(cls, q, k, options: BlockSparseOptions) -> _Layout:
        q_len, kv_len = q.shape[1], k.shape[1]
        block_shape = xla_block_shape(q_len, kv_len, options.block_sizes)
        padded = padded_shape(q_len, kv_len, block_shape)
        return cls(block_shape, q_len, kv_len, padded, q.shape[2] // k.shape[2])

    def pad(self, x, side: int) -> jax.Array:
        """x [B, L, H, D] zero padded to the padded length of side 0 (q) or 1 (kv)."""
        return jnp.pad(x, ((0, 0), (0, self.padded[side] - x.shape[1]), (0, 0), (0, 0)))

    def work(self, mask) -> _Work:
        build = _document_work if is_traced_document(mask) else _static_work
        return build(mask, self.padded, self.block_shape)

    def pairs_per_step(self, batch: int, heads: int) -> int:
        bq, bk = self.block_shape
        return max(_STEP_ELEMENTS // (batch * heads * bq * bk), 1)


def _groups(mask, num_q_heads: int, group: int):
    """(heads, kv heads, 2-D mask) per head group; heads None: all heads, GQA-shaped."""
    groups = head_groups(mask, num_q_heads)
    if len(groups) == 1:
        return ((None, None, groups[0][1]),)
    return tuple((np.array(h), np.array(h) // group, m) for h, m in groups)


def _group_view(x, heads, kv_heads, group: int):
    """q-like [B, L, Hq, D] -> [B, L, Hk, G, D] for all heads, or [B, L, n, 1, D]."""
    if heads is None:
        return x.reshape(*x.shape[:2], -1, group, x.shape[-1])
    return x[:, :, heads][:, :, :, None]


def _heads(heads, num_q_heads: int, group: int, alibi, options: BlockSparseOptions) -> _Heads:
    """The `_Heads` of one group of `_groups` (heads None: all, GQA-shaped); the hook's
    head numbers are the caller's (`options.hook_heads`)."""
    if heads is None:
        index = np.arange(num_q_heads, dtype=np.int32).reshape(-1, group)
    else:
        index = np.asarray(heads, np.int32)[:, None]
    slopes = None if alibi is None else alibi.astype(_F32)[index]
    if options.hook_heads is not None:
        index = np.asarray(options.hook_heads, np.int32)[index]
    return _Heads(index, slopes)


def _rows_view(x, heads, layout: _Layout, hk: int):
    """[B, Hq, Q] -> [B, nq, Hk, G, bq] for the group's heads."""
    x = x if heads is None else x[:, heads]
    bq = layout.block_shape[0]
    return x.reshape(x.shape[0], hk, -1, layout.padded[0] // bq, bq).transpose(0, 3, 1, 2, 4)


def _rows_back(x) -> jax.Array:
    """[B, nq, Hk, G, bq] -> [B, Hk * G, Q]."""
    b, nq, hk, g, bq = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(b, hk * g, nq * bq)


def forward(q, k, v, sinks, alibi, mask_arrays, options: BlockSparseOptions):
    """(out [B, Lq, Hq, Dv] in q's dtype, lse float32 [B, Hq, Lq])."""
    layout = _Layout.make(q, k, options)
    mask = join_mask(options.mask, mask_arrays)
    batch, _, num_q_heads, _ = q.shape
    qp, kp, vp = layout.pad(q, 0), layout.pad(k, 1), layout.pad(v, 1)
    out = jnp.zeros((batch, layout.padded[0], num_q_heads, v.shape[-1]), _F32)
    lse = jnp.zeros((batch, num_q_heads, layout.padded[0]), _F32)
    for heads, kv_heads, head_mask in _groups(mask, num_q_heads, layout.group):
        group = layout.group if heads is None else 1
        q5 = _group_view(qp, heads, kv_heads, layout.group)
        k4, v4 = (x if heads is None else x[:, :, kv_heads] for x in (kp, vp))
        sink = None
        if sinks is not None:
            sink = sinks.astype(_F32) if heads is None else sinks.astype(_F32)[heads]
            sink = sink.reshape(q5.shape[2], group)
        tiles = _tiles(q5, k4, v4, layout.block_shape)
        steps = layout.pairs_per_step(batch, q5.shape[2] * group)
        o, l = _group_forward(
            tiles,
            sink,
            layout.work(head_mask),
            options,
            steps,
            _heads(heads, num_q_heads, layout.group, alibi, options),
            layout.block_shape,
        )
        o = o.transpose(0, 1, 4, 2, 3, 5).reshape(batch, layout.padded[0], -1, o.shape[-1])
        # Every head at once: the group's result is the whole output. (Set through
        # `.at[:, :, :]`, it was a scatter of an empty index array, a zero-size constant
        # that jaxlib 0.11.2's CPU compiler segfaults on inside `shard_map`.)
        if heads is None:
            out, lse = o, _rows_back(l)
        else:
            out, lse = out.at[:, :, heads].set(o), lse.at[:, heads].set(_rows_back(l))
    return out[:, : layout.q_len].astype(q.dtype), lse[:, :, : layout.q_len]


def backward(
    q, k, v, out, lse, d_out, d_lse, sinks, alibi, mask_arrays, options: BlockSparseOptions
):
    """(dq, dk, dv) of `forward`; d_lse: lse's cotangent float32 [B, Hq, Lq] or None."""
    del sinks  # the sinks act through lse alone
    delta = row_delta(out, d_out, d_lse)
    layout = _Layout.make(q, k, options)
    mask = join_mask(options.mask, mask_arrays)
    batch, _, num_q_heads, _ = q.shape
    qp, kp, vp, dop = (layout.pad(x, s) for x, s in ((q, 0), (k, 1), (v, 1), (d_out, 0)))
    rows = ((0, 0), (0, 0), (0, layout.padded[0] - layout.q_len))
    # Padded rows: no keys (lse -inf) and no delta.
    lse = jnp.pad(lse, rows, constant_values=-jnp.inf)
    delta = jnp.pad(delta, rows)
    dq = jnp.zeros(qp.shape, _F32)
    dk, dv = jnp.zeros(kp.shape, _F32), jnp.zeros(vp.shape, _F32)
    for heads, kv_heads, head_mask in _groups(mask, num_q_heads, layout.group):
        q5, do5 = (_group_view(x, heads, kv_heads, layout.group) for x in (qp, dop))
        k4, v4 = (x if heads is None else x[:, :, kv_heads] for x in (kp, vp))
        hk = q5.shape[2]
        tiles = _tiles(q5, k4, v4, layout.block_shape, d_out=do5)
        steps = layout.pairs_per_step(batch, hk * q5.shape[3])
        g_dq, g_dk, g_dv = _group_backward(
            tiles,
            _rows_view(lse, heads, layout, hk),
            _rows_view(delta, heads, layout, hk),
            layout.work(head_mask),
            options,
            steps,
            _heads(heads, num_q_heads, layout.group, alibi, options),
            layout.block_shape,
        )
        g_dq = g_dq.reshape(batch, layout.padded[0], -1, q.shape[-1])
        g_dk, g_dv = (x.reshape(batch, layout.padded[1], hk, x.shape[-1]) for x in (g_dk, g_dv))
        if heads is None:
            dq, dk, dv = g_dq, g_dk, g_dv
        else:  # kv heads shared by several groups accumulate
            dq = dq.at[:, :, heads].set(g_dq)
            dk, dv = dk.at[:, :, kv_heads].add(g_dk), dv.at[:, :, kv_heads].add(g_dv)
    unpad = lambda x, n, like: x[:, :n].astype(like.dtype)
    return unpad(dq, layout.q_len, q), unpad(dk, layout.kv_len, k), unpad(dv, layout.kv_len, v)
