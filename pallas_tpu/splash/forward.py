"""The splash attention forward kernel: block-sparse online softmax over a MaskInfo.

Grid (q head h, q block i, j): step j loads kv block data_next[h', i, j] and skips it
when block_mask is EMPTY. The running max m and sum l live in [block_q, 128] scratch
(every lane a copy: a natural TPU layout for a per-row scalar), the unnormalised output
in [block_q, head_dim_v] float32 scratch; the last step normalises and writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_tpu.splash import common
from pallas_tpu.splash.config import NUM_LANES, NUM_SUBLANES, KernelOptions, SegmentIds
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo

# The running max starts here, not at -inf: finite, so exp(s - m) and exp(m_prev - m)
# are never exp(-inf - -inf) = NaN while a row has seen only masked (-inf) logits, and
# no select is needed; below every real logit, so the first one replaces it.
_M_START = -0.7 * float(jnp.finfo(jnp.float32).max)


def _init(st: common.BodyStatic, h, sinks_ref, m_ref, l_ref, acc_ref) -> None:
    acc_ref[...] = jnp.zeros_like(acc_ref)
    if st.has_sinks:
        # The sink joins the softmax as one extra logit with no value: the running max
        # starts at it, with exp(sink - max) already summed (1; 0 for a -inf sink).
        sink = sinks_ref[0, h]
        m_start = jnp.maximum(sink, _M_START)
        m_ref[...] = jnp.full_like(m_ref, m_start)
        l_ref[...] = jnp.full_like(l_ref, jnp.exp(sink - m_start))
    else:
        m_ref[...] = jnp.full_like(m_ref, _M_START)
        l_ref[...] = jnp.zeros_like(l_ref)


def _accumulate(st, kv_block, nonfinite, refs, scratch, partial_block: bool) -> None:
    """Online-softmax update of (m, l, acc) with one kv block, slice by slice;
    `nonfinite()`: whether the block's values hold a NaN or Inf (read in partial blocks)."""
    q_ref, k_ref, v_ref, mask_refs = refs
    m_ref, l_ref, acc_ref = scratch
    opts, width = st.options, st.block_kv_compute
    q = q_ref[...]
    for start in range(0, st.trav.block_kv, width):  # static, unrolled
        tile = common.TileView(st.trav, start, width)
        kv = pl.ds(start, width)
        _, s = common.logits(q, k_ref[kv, :], opts.softmax_scale, opts.logits_soft_cap)
        mask = common.tile_mask(mask_refs, tile, st.rule, kv_block, partial_block=partial_block)
        s = common.apply_mask(s, mask)
        m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        # m_next >= _M_START is finite: masked logits give exp(-inf) = 0.
        p = jnp.exp(s - jnp.tile(m_next, (1, width // NUM_LANES)))
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
        m_ref[...] = m_next
        v = v_ref[kv, :]
        pv = common.tile_product(p, v, common.NN_DIMS, nonfinite, partial_block)
        acc_ref[...] = common.fit_lanes(alpha, acc_ref.shape[-1]) * acc_ref[...] + pv


def _finish(out_ref, lse_ref, m_ref, l_ref, acc_ref) -> None:
    """out = acc / l and lse = m + log l; a row with l == 0 gets out 0, lse -inf.

    l is 0 or at least 1: the row's largest logit (or finite sink) adds exp(m - m) = 1.
    So 1 / max(l, 1) is 1 / l, or 1 where acc is 0 too; and an empty row has a finite m
    and log 0 = -inf, so m + log l is its -inf with no select.
    """
    l = l_ref[...]
    inv = 1.0 / jnp.maximum(l, 1.0)
    out_ref[...] = (acc_ref[...] * common.fit_lanes(inv, acc_ref.shape[-1])).astype(out_ref.dtype)
    lse_ref[...] = m_ref[...] + jnp.log(l)


def _kernel(*refs, st):
    prefetch, nf_ref, refs = common.split_prefetch(refs, st.has_block_mask)
    q_ref, k_ref, v_ref, sinks_ref, mask_refs, *rest = refs
    out_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    j = ids[2]

    @pl.when(j == 0)
    def _():
        _init(st, ids[0], sinks_ref, m_ref, l_ref, acc_ref)

    kv_block = st.trav.kv_block(*ids, *prefetch)
    nonfinite = functools.partial(
        common.nonfinite_entry, nf_ref, st.trav.kv_head(*ids, *prefetch), kv_block
    )
    body = functools.partial(
        _accumulate,
        st,
        kv_block,
        nonfinite,
        (q_ref, k_ref, v_ref, mask_refs),
        (m_ref, l_ref, acc_ref),
    )
    common.run_by_kind(st.trav.kind(*ids, *prefetch), st.has_block_mask, body)

    @pl.when(j == st.grid_width - 1)
    def _():
        _finish(out_ref, lse_ref, m_ref, l_ref, acc_ref)


def _specs(trav: common.Traversal, head_dim: int, head_dim_v: int, num_q_heads: int):
    """BlockSpecs of (q, k, v, sinks) and of (out, lse)."""
    bq, bkv = trav.block_q, trav.block_kv
    q_map = lambda *a: (trav.head(*a), trav.q_block(*a), 0)
    kv_map = lambda *a: (trav.kv_head(*a), trav.kv_block(*a), 0)
    inputs = (
        pl.BlockSpec((None, bq, head_dim), q_map),
        pl.BlockSpec((None, bkv, head_dim), kv_map),
        pl.BlockSpec((None, bkv, head_dim_v), kv_map),
        # Whole [8, heads] sinks array in scalar memory (sublane-aligned: vmap-safe).
        pl.BlockSpec((NUM_SUBLANES, num_q_heads), lambda *a: (0, 0), memory_space=pltpu.SMEM),
    )
    outputs = (
        pl.BlockSpec((None, bq, head_dim_v), q_map),
        pl.BlockSpec((None, bq, NUM_LANES), q_map),
    )
    return inputs, outputs


def splash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask_info: MaskInfo,
    element_mask: ElementMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    sinks: jax.Array | None = None,
    options: KernelOptions,
) -> tuple[jax.Array, jax.Array]:
    """Block-sparse attention forward.

    Args:
      q: [num_q_heads, q_len, head_dim]; k: [num_kv_heads, kv_len, head_dim];
        v: [num_kv_heads, kv_len, head_dim_v]; num_q_heads % num_kv_heads == 0.
      mask_info: the forward traversal, built with (block_q, block_kv).
      element_mask: evaluated in partial blocks when mask_info has no
        partial_mask_blocks.
      segment_ids: q [q_len], kv [kv_len]; applied to every computed block.
      sinks: float [num_q_heads] extra softmax logit per head (no value).
      options: scale, soft cap, block sizes, interpret.

    Returns:
      out: [num_q_heads, q_len, head_dim_v] in q.dtype (0 for a fully masked row);
      lse: float32 [num_q_heads, q_len], natural log (-inf for a fully masked row).
    """
    num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len, head_dim_v = v.shape
    blocks = options.block_sizes.resolve(q_len, kv_len)
    trav = common.Traversal(True, blocks.block_q, blocks.block_kv, num_q_heads // num_kv_heads)
    common.check_mask_info(mask_info, trav, num_q_heads, q_len, kv_len)
    ops = common.mask_operands(True, element_mask, mask_info.partial_mask_blocks, segment_ids)
    st = common.BodyStatic(
        options=options,
        trav=trav,
        block_kv_compute=blocks.block_kv_compute,
        grid_width=mask_info.data_next.shape[2],
        rule=None if element_mask is None else element_mask.rule,
        has_block_mask=ops.has_block_mask,
        has_sinks=sinks is not None,
    )
    (q_spec, k_spec, v_spec, sinks_spec), out_specs = _specs(
        trav, head_dim, head_dim_v, num_q_heads
    )
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks.astype(jnp.float32), (NUM_SUBLANES, num_q_heads))
    prefetch = common.scalar_prefetch(mask_info, st.has_block_mask, (v,), trav.block_kv)
    out, lse = common.pallas_call(
        functools.partial(_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_q_heads, q_len // trav.block_q, st.grid_width),
            in_specs=[
                q_spec,
                k_spec,
                v_spec,
                sinks_spec if sinks is not None else None,
                common.mask_specs(ops, trav),
            ],
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((trav.block_q, NUM_LANES), jnp.float32),  # m
                pltpu.VMEM((trav.block_q, NUM_LANES), jnp.float32),  # l
                pltpu.VMEM((trav.block_q, head_dim_v), jnp.float32),  # acc
            ],
        ),
        out_shape=(
            common.out_struct((num_q_heads, q_len, head_dim_v), q.dtype, q, k, v),
            common.out_struct((num_q_heads, q_len, NUM_LANES), jnp.float32, q, k, v),
        ),
        # q heads are independent; the kv axis reduces, and the q axis stays in order
        # for data_next's prefetch schedule.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=options.interpret,
        like=(q, k, v),
        name="splash_forward",
    )(*prefetch, q, k, v, sinks, ops)
    return out, lse[..., 0]
