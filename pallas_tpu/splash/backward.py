"""The splash attention backward kernels: dQ (forward traversal) and dK/dV.

Both recompute p = exp(s - lse) per tile from the forward's lse and use the row term
delta = rowsum(dout * out) - dlse (computed outside, in plain jnp):
  ds = p * (dp - delta),  dp = dout @ v.T,  then through the soft cap and the scale.
A row the forward found fully masked has lse = -inf; it is passed here as +inf so that
p = exp(s - inf) = 0 (exp(-inf - -inf) would be NaN) and the row contributes nothing.

dQ: grid (h, qi, j) like the forward, accumulating dq [block_q_dq, head_dim] in scratch.
dK/dV: grid (ki, h, j) with q block data_next[h', j, ki]; tiles are transposed,
[block_kv, block_q], so dk/dv accumulate rows. GQA: the q heads of one kv head are
consecutive along the grid's head axis; the scratch is zeroed at the group's first head
and written at its last (deterministic, no atomics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_tpu.splash import common
from pallas_tpu.splash.config import NUM_SUBLANES, KernelOptions, SegmentIds
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo


def _rows(x: jax.Array) -> jax.Array:
    """[heads, q_len] -> [heads, 8, q_len] (q on lanes, sublane copies)."""
    return jnp.broadcast_to(
        x.astype(jnp.float32)[:, None, :], (x.shape[0], NUM_SUBLANES, x.shape[1])
    )


def _row_inputs(lse: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """lse with -inf (fully masked rows) turned into +inf, and delta, as [h, 8, q_len]."""
    return _rows(jnp.where(lse == -jnp.inf, jnp.inf, lse)), _rows(delta)


def _probabilities(s: jax.Array, lse: jax.Array, mask: jax.Array | None) -> jax.Array:
    """exp(s - lse), exactly 0 where `mask` (bool, the tile's allowed pairs) is False: a
    select, so that a non-finite logit or lse of another document's row or column never
    reaches a masked entry. A tile without a mask (a full block, no segment ids) holds
    one document's pairs only: its NaNs are that document's own, as in the reference."""
    p = jnp.exp(s - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _ds(st: common.BodyStatic, s_scaled, p, dp, delta, mask: jax.Array | None) -> jax.Array:
    """d loss / d (scaled logits) for one tile, times the softmax scale; exactly 0 at
    masked pairs (a select, not a product: their dp, delta or logits may be another
    document's non-finite values)."""
    ds = common.soft_cap_grad(p * (dp - delta), s_scaled, st.options.logits_soft_cap)
    scale = st.options.softmax_scale
    ds = ds * scale if scale != 1.0 else ds
    return ds if mask is None else jnp.where(mask, ds, 0.0)


def _dq_step(st, kv_block, nonfinite, refs, dq_acc_ref, partial_block: bool) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs = refs
    opts = st.options
    tile = common.TileView(st.trav, 0, st.trav.block_kv)
    k = k_ref[...]
    scaled, s = common.logits(q_ref[...], k, opts.softmax_scale, opts.logits_soft_cap)
    mask = common.tile_mask(mask_refs, tile, st.rule, kv_block, partial_block=partial_block)
    # lse/delta arrive as [8, bq] rows; the tile wants [bq, 1] columns.
    lse, delta = lse_ref[0][:, None], delta_ref[0][:, None]
    p = _probabilities(s, lse, mask)
    v = v_ref[...]
    dp = jax.lax.dot_general(
        do_ref[...].astype(v.dtype), v, common.NT_DIMS, preferred_element_type=jnp.float32
    )
    ds = _ds(st, scaled, p, dp, delta, mask)
    dq_acc_ref[...] += common.tile_product(ds, k, common.NN_DIMS, nonfinite, partial_block)


def _dq_kernel(*refs, st):
    prefetch, nf_ref, refs = common.split_prefetch(refs, st.has_block_mask)
    *inputs, dq_ref, dq_acc_ref = refs
    ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))

    @pl.when(ids[2] == 0)
    def _():
        dq_acc_ref[...] = jnp.zeros_like(dq_acc_ref)

    kv_block = st.trav.kv_block(*ids, *prefetch)
    nonfinite = functools.partial(
        common.nonfinite_entry, nf_ref, st.trav.kv_head(*ids, *prefetch), kv_block
    )
    body = functools.partial(_dq_step, st, kv_block, nonfinite, tuple(inputs), dq_acc_ref)
    common.run_by_kind(st.trav.kind(*ids, *prefetch), st.has_block_mask, body)

    @pl.when(ids[2] == st.grid_width - 1)
    def _():
        dq_ref[...] = dq_acc_ref[...].astype(dq_ref.dtype)


def _dkv_step(st, kv_block, nonfinite, refs, scratch, partial_block: bool) -> None:
    """Accumulates one q block's contribution to dk/dv, kv slice by kv slice;
    `nonfinite()`: whether the q block's q or dout holds a NaN or Inf (partial blocks)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs = refs
    dk_acc_ref, dv_acc_ref = scratch
    opts, width = st.options, st.block_kv_compute
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[:1, :], delta_ref[:1, :]  # [1, bq]: q on lanes, as in the tile
    for start in range(0, st.trav.block_kv, width):  # static, unrolled
        tile = common.TileView(st.trav, start, width)
        kv = pl.ds(start, width)
        v = v_ref[kv, :]
        # Transposed tile [width, bq]: s.T = k @ q.T.
        scaled, s = common.logits(k_ref[kv, :], q, opts.softmax_scale, opts.logits_soft_cap)
        mask = common.tile_mask(mask_refs, tile, st.rule, kv_block, partial_block=partial_block)
        p = _probabilities(s, lse, mask)
        dv_acc_ref[kv, :] += common.tile_product(p, do, common.NN_DIMS, nonfinite, partial_block)
        dp = jax.lax.dot_general(
            v, do.astype(v.dtype), common.NT_DIMS, preferred_element_type=jnp.float32
        )
        ds = _ds(st, scaled, p, dp, delta, mask)
        dk_acc_ref[kv, :] += common.tile_product(ds, q, common.NN_DIMS, nonfinite, partial_block)


def _dkv_kernel(*refs, st):
    prefetch, nf_ref, refs = common.split_prefetch(refs, st.has_block_mask)
    *inputs, dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs
    ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    group = st.trav.group
    member = ids[1] % group if group > 1 else 0  # position of this q head in its group

    @pl.when((ids[2] == 0) & (member == 0))
    def _():
        dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
        dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

    q_block = st.trav.q_block(*ids, *prefetch)
    nonfinite = functools.partial(
        common.nonfinite_entry, nf_ref, st.trav.head(*ids, *prefetch), q_block
    )
    body = functools.partial(
        _dkv_step, st, ids[0], nonfinite, tuple(inputs), (dk_acc_ref, dv_acc_ref)
    )
    common.run_by_kind(st.trav.kind(*ids, *prefetch), st.has_block_mask, body)

    # The dk/dv block index (kv head, ki) is constant over the group's heads and all
    # j, so this last write is the one that reaches memory.
    @pl.when((ids[2] == st.grid_width - 1) & (member == group - 1))
    def _():
        dk_ref[...] = dk_acc_ref[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _input_specs(trav: common.Traversal, head_dim: int, head_dim_v: int) -> list:
    """BlockSpecs of (q, k, v, dout, lse rows, delta rows); either traversal."""
    bq, bkv = trav.block_q, trav.block_kv
    q_map = lambda *a: (trav.head(*a), trav.q_block(*a), 0)
    kv_map = lambda *a: (trav.kv_head(*a), trav.kv_block(*a), 0)
    row_spec = pl.BlockSpec(
        (None, NUM_SUBLANES, bq), lambda *a: (trav.head(*a), 0, trav.q_block(*a))
    )
    return [
        pl.BlockSpec((None, bq, head_dim), q_map),
        pl.BlockSpec((None, bkv, head_dim), kv_map),
        pl.BlockSpec((None, bkv, head_dim_v), kv_map),
        pl.BlockSpec((None, bq, head_dim_v), q_map),
        row_spec,
        row_spec,
    ]


def _prepare(q, v, mask_info, element_mask, segment_ids, trav, block_kv_compute, options):
    """Checks, the static bundle and the mask operands of one backward kernel."""
    common.check_mask_info(mask_info, trav, q.shape[0], q.shape[1], v.shape[1])
    ops = common.mask_operands(
        trav.kv_in_lanes, element_mask, mask_info.partial_mask_blocks, segment_ids
    )
    grid_width = mask_info.data_next.shape[2 if trav.kv_in_lanes else 1]
    st = common.BodyStatic(
        options=options,
        trav=trav,
        block_kv_compute=block_kv_compute,
        grid_width=grid_width,
        rule=None if element_mask is None else element_mask.rule,
        has_block_mask=ops.has_block_mask,
    )
    return st, ops


def splash_backward_dq(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    mask_info: MaskInfo,
    element_mask: ElementMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    options: KernelOptions,
) -> jax.Array:
    """dQ over the forward traversal (mask_info built with (block_q_dq, block_kv_dq)).

    Args:
      q: [num_q_heads, q_len, head_dim]; k: [num_kv_heads, kv_len, head_dim];
        v: [num_kv_heads, kv_len, head_dim_v]; dout: [num_q_heads, q_len, head_dim_v].
      lse: float32 [num_q_heads, q_len] from the forward (-inf on fully masked rows).
      delta: float32 [num_q_heads, q_len] = rowsum(dout * out) - dlse.

    Returns:
      dq: [num_q_heads, q_len, head_dim] in q.dtype.
    """
    (num_q_heads, q_len, head_dim), (num_kv_heads, kv_len, head_dim_v) = q.shape, v.shape
    blocks = options.block_sizes.resolve(q_len, kv_len)
    trav = common.Traversal(
        True, blocks.block_q_dq, blocks.block_kv_dq, num_q_heads // num_kv_heads
    )
    st, ops = _prepare(q, v, mask_info, element_mask, segment_ids, trav, trav.block_kv, options)
    q_map = lambda *a: (trav.head(*a), trav.q_block(*a), 0)
    prefetch = common.scalar_prefetch(mask_info, st.has_block_mask, (k,), trav.block_kv)
    return common.pallas_call(
        functools.partial(_dq_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_q_heads, q_len // trav.block_q, st.grid_width),
            in_specs=[*_input_specs(trav, head_dim, head_dim_v), common.mask_specs(ops, trav)],
            out_specs=pl.BlockSpec((None, trav.block_q, head_dim), q_map),
            scratch_shapes=[pltpu.VMEM((trav.block_q, head_dim), jnp.float32)],
        ),
        out_shape=common.out_struct(q.shape, q.dtype, q, k, v, dout),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=options.interpret,
        like=(q, k, v, dout),
        name="splash_backward_dq",
    )(*prefetch, q, k, v, dout, *_row_inputs(lse, delta), ops)


def splash_backward_dkv(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    mask_info: MaskInfo,
    element_mask: ElementMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    options: KernelOptions,
) -> tuple[jax.Array, jax.Array]:
    """dK and dV over the dK/dV traversal (mask_info from the dK/dV processing, built
    with (block_q_dkv, block_kv_dkv); partial blocks [n, block_kv_dkv, block_q_dkv]).

    Args: as `splash_backward_dq`.

    Returns:
      dk: [num_kv_heads, kv_len, head_dim] in k.dtype, summed over each kv head's q heads;
      dv: [num_kv_heads, kv_len, head_dim_v] in v.dtype, likewise.
    """
    (num_q_heads, q_len, head_dim), (num_kv_heads, kv_len, head_dim_v) = q.shape, v.shape
    blocks = options.block_sizes.resolve(q_len, kv_len)
    trav = common.Traversal(
        False, blocks.block_q_dkv, blocks.block_kv_dkv, num_q_heads // num_kv_heads
    )
    st, ops = _prepare(
        q, v, mask_info, element_mask, segment_ids, trav, blocks.block_kv_dkv_compute, options
    )
    kv_map = lambda *a: (trav.kv_head(*a), trav.kv_block(*a), 0)
    bkv = trav.block_kv
    prefetch = common.scalar_prefetch(mask_info, st.has_block_mask, (q, dout), trav.block_q)
    return common.pallas_call(
        functools.partial(_dkv_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(kv_len // bkv, num_q_heads, st.grid_width),
            in_specs=[*_input_specs(trav, head_dim, head_dim_v), common.mask_specs(ops, trav)],
            out_specs=(
                pl.BlockSpec((None, bkv, head_dim), kv_map),
                pl.BlockSpec((None, bkv, head_dim_v), kv_map),
            ),
            scratch_shapes=[
                pltpu.VMEM((bkv, head_dim), jnp.float32),
                pltpu.VMEM((bkv, head_dim_v), jnp.float32),
            ],
        ),
        out_shape=(
            common.out_struct(k.shape, k.dtype, q, k, v, dout),
            common.out_struct(v.shape, v.dtype, q, k, v, dout),
        ),
        # kv blocks are independent; heads (GQA groups) and q blocks reduce into dk/dv.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=options.interpret,
        like=(q, k, v, dout),
        name="splash_backward_dkv",
    )(*prefetch, q, k, v, dout, *_row_inputs(lse, delta), ops)
