"""Block-sparse attention (FlexAttention for JAX): the public op, its backend table and
the custom_vjp.

One mask algebra (`pallas_tpu.splash.masks`) describes the attention pattern; each
backend skips the empty blocks of its `MaskInfo`: `xla` (plain JAX over the list of
non-empty blocks, any platform), `pallas` (the splash kernels; TPU, or Pallas' interpret
mode elsewhere) and `triton` (GPUs, or Triton's interpreter elsewhere; per-tile lists of
the blocks to visit, `tile_lists`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_bridge.block_sparse import pallas, triton, xla
from jax_bridge.block_sparse.checks import (
    OP,
    check_alibi,
    check_block_sizes,
    check_config,
    check_mask,
    check_qkv,
    check_scale_and_cap,
    check_score_mod,
)
from jax_bridge.block_sparse.common import apply_sink_limits, row_delta, sink_gradient
from jax_bridge.block_sparse.masks import (
    has_traced_member,
    kv_heads_of,
    split_mask,
    traced_head_groups,
)
from jax_bridge.block_sparse.options import BlockSparseOptions
from jax_bridge.block_sparse.score_mod import ScoreMod
from jax_bridge.core.autodiff import first_order_only, refuse_forward_mode
from jax_bridge.core.backend import BackendTable
from jax_bridge.core.precision import canonicalize_precision
from jax_bridge.core.validation import check_bool, check_head_dim, check_per_head, naming_op
from jax_bridge.core.vma import cotangent_like
from pallas_tpu.splash.config import BlockSizes
from pallas_tpu.splash.masks import Mask
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig

__all__ = ["BACKENDS", "BlockSparseOptions", "block_sparse_attention"]

BACKENDS = BackendTable(OP, {"xla": xla, "pallas": pallas, "triton": triton})
# What `refuse_forward_mode` offers instead.
_REVERSE_MODE_ONLY = "Reverse mode works (jax.grad, jax.vjp, jax.jacrev), first order only."


def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Mask,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
    block_sizes: BlockSizes | None = None,
    config: AttentionConfigs | AttentionKernelConfig | None = None,
    precision: Any = None,
    implementation: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention whose pattern is a splash mask, computing only its non-empty blocks.

    Args:
      q: [batch, q_len, num_q_heads, head_dim] (`jax.nn.dot_product_attention`'s layout).
      k, v: [batch, kv_len, num_kv_heads, head_dim]; num_q_heads % num_kv_heads == 0
        (GQA: query head h reads kv head h // (num_q_heads // num_kv_heads)). float16,
        bfloat16 or float32, all one dtype. head_dim: 16..256 for Triton.
      mask: a `pallas_tpu.splash` mask of shape (q_len, kv_len) shared by every head
        (CausalMask, LocalMask, ChunkedCausalMask, PrefixLMMask, DocumentMask, FullMask,
        NumpyMask, PredicateMask, `|` / `&` of them), or a `MultiHeadMask` with one such
        mask per query head. A DocumentMask may hold traced `cu_seqlens` / segment ids
        (built under `jax.jit`); inside a MultiHeadMask each such member (one object)
        runs as its own call on its heads, and the static members' heads as one more.
        Traced document arrays are not checked (a static DocumentMask is): invalid
        cu_seqlens give a wrong mask, not an error. Masks are top-left aligned
        (`CausalMask(offset=kv_len - q_len)` for decoding) except DocumentMask, which is
        bottom-right inside each document, as `varlen_attention`.
      softmax_scale: multiplies q.k; default 1 / sqrt(head_dim). A static finite float,
        not 0 (uniform attention: almost always a bug); negative is allowed.
      logits_soft_cap: scores become cap * tanh(s / cap) before masking; None or 0: off,
        else positive and finite. (The Triton kernels' tanh loses relative precision
        when cap >> |s|: leave a cap that never binds off.)
      sinks: [num_q_heads] learnable logits that join every row's softmax denominator and
        carry no value; they receive a gradient.
      alibi_slopes: [num_q_heads]; adds -slope[h] * |q_index - kv_index| to the scores
        (after the soft cap, before the score hook), the indices being the mask's rows
        and columns. Treated as constants: zero gradient. XLA and Triton run it; Pallas
        refuses it.
      return_lse: (a bool) also return the natural-log log-sum-exp of each row.
      score_mod: a `ScoreMod` (FlexAttention's score_mod): score' = fn(score, batch,
        query head, q position, kv position) on every scaled, soft-capped (ALiBi-shifted)
        score before the mask; gradients flow through it. XLA and Triton (which needs its
        `triton_fn`) run it; Pallas refuses it.
      block_sizes: a splash `BlockSizes`. XLA reads block_q / block_kv, multiples of 8
        (default 128, or less for short sequences); Pallas every field (multiples of 128,
        default up to 512); Triton (block_q, block_kv), (block_q_dq, block_kv_dq) and
        (block_q_dkv, block_kv_dkv), powers of two >= 16 (default: the varlen kernels'
        tiles for the GPU). Sequences are padded to whole blocks either way.
      config: the Triton kernels' launch configuration (tile, warps, stages), as
        `varlen_attention` takes it: an `AttentionConfigs` (each kernel's
        `AttentionKernelConfig`; None fields: the default) or one `AttentionKernelConfig`
        for all three kernels. A kernel's tile given by both `block_sizes` and `config`
        must agree. `overlap_softmax` overlaps the forward's full tiles and every dK/dV
        tile, `head_major` accumulates dK^T and dV^T (`AttentionKernelConfig`); `tma`,
        `warp_specialize`, `host_descriptors` and `dq_atomic` are the varlen kernels' and
        refused on every backend; XLA ignores the rest (tiles, warps, stages: its blocks
        are `block_sizes`'); Pallas refuses a config (`block_sizes`).
      precision: float32 matmul precision (`jax_bridge.core.precision`; None: HIGHEST).
        The Pallas kernels use the TPU's default dot precision.
      implementation: "auto" (Triton on GPUs, Pallas on TPU, XLA elsewhere), "xla",
        "pallas" (off a TPU in Pallas' interpret mode: slow) or "triton" (off a GPU in
        Triton's interpreter: slow).

    Returns:
      out [batch, q_len, num_q_heads, head_dim] in q's dtype; with `return_lse` also lse
      float32 [batch, num_q_heads, q_len]. A row that sees no key gets 0 and lse -inf
      (with sinks: lse = the sink). A NaN sink makes its head NaN; a +inf sink takes all
      of the probability (out 0, lse +inf). A NaN or Inf in k or v reaches only the rows
      that see its token (XLA and Pallas: NaN in the features it touches; Triton: those
      features where the row sees the token through a full block, the whole row where it
      is at the mask's edge, in a partial block).

    Differentiation: reverse mode for q, k, v and sinks (lse too is differentiable);
    forward mode and higher-order derivatives are not supported.

    Raises:
      TypeError / ValueError naming this op and the argument, at trace time.
    """
    impl = BACKENDS.resolve(implementation)
    block_sizes = check_block_sizes(block_sizes, impl)
    config = check_config(config, block_sizes, impl)
    check_qkv(q, k, v)
    _, q_len, num_q_heads, head_dim = q.shape
    kv_len = k.shape[1]
    check_head_dim(OP, head_dim, BACKENDS[impl].HEAD_DIMS, impl)
    check_mask(mask, q_len, kv_len, num_q_heads)
    scale, cap = check_scale_and_cap(softmax_scale, logits_soft_cap, head_dim)
    return_lse = check_bool(OP, return_lse, "return_lse")
    check_score_mod(score_mod, impl)
    sinks = check_per_head(OP, sinks, "sinks", num_q_heads)
    alibi_slopes = check_alibi(alibi_slopes, num_q_heads, impl)
    if alibi_slopes is not None:
        alibi_slopes = jax.lax.stop_gradient(alibi_slopes)
    options = BlockSparseOptions(
        implementation=impl,
        precision=canonicalize_precision(precision, OP),
        mask=mask,
        softmax_scale=scale,
        logits_soft_cap=cap,
        block_sizes=block_sizes,
        config=config,
        score_mod=score_mod,
    )
    if has_traced_member(mask):
        out, lse = _by_head_groups(options, q, k, v, mask, sinks, alibi_slopes)
    else:
        out, lse = _one_call(options, q, k, v, mask, sinks, alibi_slopes)
    return (out, lse) if return_lse else out


def _one_call(options: BlockSparseOptions, q, k, v, mask, sinks, alibi):
    """(out, lse) of one call whose mask every backend takes whole."""
    if q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0:
        return _no_work(q, v, sinks)
    static_mask, mask_arrays = split_mask(mask)
    options = dataclasses.replace(options, mask=static_mask)
    refuse_forward_mode(OP, q, k, v, sinks, works=_REVERSE_MODE_ONLY)
    with naming_op(OP):  # the mask's blocks are classified while the backend traces
        return _attention(options, q, k, v, sinks, alibi, mask_arrays)


def _by_head_groups(options: BlockSparseOptions, q, k, v, mask, sinks, alibi):
    """(out, lse) of a MultiHeadMask holding traced DocumentMasks: one call per distinct
    traced member (its heads) and one for the static members' heads, each with the
    heads' own q, k, v, sinks and slopes; the score hook still sees the caller's head
    numbers (`hook_heads`). Differentiated by JAX through the gathers and scatters."""
    out = jnp.zeros((*q.shape[:3], v.shape[-1]), q.dtype)
    lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    group_size = q.shape[2] // k.shape[2]
    take = lambda x, heads: None if x is None else x[heads]
    for heads, head_mask in traced_head_groups(mask):
        kv_heads = kv_heads_of(heads, group_size)
        call = dataclasses.replace(options, hook_heads=tuple(int(h) for h in heads))
        o, l = _one_call(
            call, q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads], head_mask,
            take(sinks, heads), take(alibi, heads),
        )  # fmt: skip
        out, lse = out.at[:, :, heads].set(o), lse.at[:, heads].set(l)
    return out, lse


def _no_work(q, v, sinks):
    """No query or no key: every row sees only its sink (or nothing)."""
    out = jnp.zeros((*q.shape[:3], v.shape[-1]), q.dtype)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    if sinks is not None:
        lse = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape)
    return out, lse


# ------------------------------------------------------------------- custom_vjp wiring
#
# Backend contract: every module in `BACKENDS` exports
#   HEAD_DIMS: (smallest, largest) head_dim it runs;
#   forward(q, k, v, sinks, alibi, mask_arrays, options) -> (out, lse float32 [B, Hq, Lq]);
#   backward(q, k, v, out, lse, d_out, d_lse, sinks, alibi, mask_arrays, options)
#     -> (dq, dk, dv)
# with arrays as documented on `block_sparse_attention`, already validated, q_len and
# kv_len >= 1; `mask_arrays` the int arrays of `masks.split_mask` (`join_mask` rebuilds
# the mask from them and options.mask); d_lse the lse cotangent (or None), which enters
# as delta = rowsum(dO * O) - d_lse (`common.row_delta`: the XLA and Pallas backends call
# it, Triton's dQ kernel computes it while it holds dO). The sinks' gradient and their
# non-finite limits live here.


def _forward(options: BlockSparseOptions, q, k, v, sinks, alibi, mask_arrays):
    backend = BACKENDS[options.implementation]
    out, lse = backend.forward(q, k, v, sinks, alibi, mask_arrays, options)
    return (out, lse) if sinks is None else apply_sink_limits(out, lse, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(options: BlockSparseOptions, q, k, v, sinks, alibi, mask_arrays):
    return _forward(options, q, k, v, sinks, alibi, mask_arrays)


def _attention_fwd(options: BlockSparseOptions, q, k, v, sinks, alibi, mask_arrays):
    refuse_forward_mode(OP, q, k, v, sinks, works=_REVERSE_MODE_ONLY)  # jax.hessian
    forward = first_order_only(functools.partial(_forward, options), OP)
    out, lse = forward(q, k, v, sinks, alibi, mask_arrays)
    return (out, lse), (q, k, v, out, lse, sinks, alibi, mask_arrays)


def _attention_bwd(options: BlockSparseOptions, residuals, cotangents):
    q, k, v, out, lse, sinks, alibi, mask_arrays = residuals
    d_out, d_lse = cotangents
    backward = functools.partial(BACKENDS[options.implementation].backward, options=options)
    with naming_op(OP):  # traced after the call returned: its checks still name it
        dq, dk, dv = first_order_only(backward, OP)(
            q, k, v, out, lse, d_out, d_lse, sinks, alibi, mask_arrays
        )
    d_sinks = d_alibi = None
    if sinks is not None:
        delta = row_delta(out, d_out, d_lse)
        d_sinks = cotangent_like(sink_gradient(sinks, lse, delta).astype(sinks.dtype), sinks)
    if alibi is not None:  # constants (the op stops their gradient)
        d_alibi = cotangent_like(jnp.zeros_like(alibi), alibi)
    # Inside shard_map a cotangent must vary exactly where its primal does.
    dq, dk, dv = (cotangent_like(d.astype(x.dtype), x) for d, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, d_sinks, d_alibi, tuple(None for _ in mask_arrays)


_attention.defvjp(_attention_fwd, _attention_bwd)
