"""The Pallas backend: the splash kernels of `pallas_tpu.splash` over the op's layout.

The mask (a 2-D mask for every head, or one per query head) is padded to whole splash
blocks (multiples of 128, `masks.pad_mask`: padded rows attend nothing and padded
columns are attended by nothing) and processed by `make_splash_mha` into the forward,
dQ and dK/dV MaskInfos; the kernels never load an empty block. A DocumentMask of traced
arrays is processed under jit (static shapes, no re-trace for new documents) and keeps
its in-kernel element rule; so do computable masks whose lengths are already multiples
of the blocks. A padded computable mask, `|` / `&` combinations, NumpyMask and
PredicateMask have their distinct partial blocks materialised by the mask processing.

q / k / v [B, L, H, D] become [H, L, D] per batch entry (GQA is the kernels' own: query
head h reads kv head h // group). The batch is a grid axis of each kernel where no block
is partial and no TPU interpreter runs inside a mesh (`batches_in_grid`), else a loop of
kernels (`_over_batch`). Compiled by Mosaic where
the program is lowered for a TPU, in Pallas' interpret mode elsewhere (slow, for tests).
float32 products run at the TPU's default dot precision (`precision` is not used).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_bridge.block_sparse.common import row_delta
from jax_bridge.block_sparse.masks import join_mask, pad_mask
from jax_bridge.block_sparse.options import BlockSparseOptions
from pallas_tpu.splash.backward import splash_backward_dkv, splash_backward_dq
from pallas_tpu.splash.common import batches_in_grid
from pallas_tpu.splash.config import BlockSizes
from pallas_tpu.splash.kernel import SplashAttentionKernel, make_splash_mha
from pallas_tpu.splash.masks import MultiHeadMask

HEAD_DIMS = (1, 2**16)  # whole head_dim per tile: no kernel limit beyond VMEM


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The padded lengths and the kernel (its MaskInfos) of one call."""

    q_len: int
    kv_len: int
    kernel: SplashAttentionKernel


def _plan(options: BlockSparseOptions, mask_arrays, q_len: int, kv_len: int) -> _Plan:
    given, *padded = (options.block_sizes or BlockSizes()).for_padding(q_len, kv_len)
    shape = tuple(padded)
    mask = join_mask(options.mask, mask_arrays)
    if isinstance(mask, MultiHeadMask):
        padded = MultiHeadMask([pad_mask(m, shape) for m in mask.masks])
    else:
        padded = pad_mask(mask, shape)
    kernel = make_splash_mha(
        padded,
        block_sizes=given,
        interpret=None,  # Mosaic where lowered for a TPU, else interpreted
        softmax_scale=options.softmax_scale,
        attn_logits_soft_cap=options.logits_soft_cap,
        save_residuals=True,
    )
    return _Plan(shape[0], shape[1], kernel)


def _heads_first(x: jax.Array, length: int) -> jax.Array:
    """[B, L, H, D] -> [B, H, length, D], zero padded on the sequence axis."""
    x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
    return x.transpose(0, 2, 1, 3)


def _over_batch(fn, in_grid: bool, *xs: jax.Array):
    """`fn` over the leading (batch) axis of `xs`: by `jax.vmap` where that makes the
    batch a grid axis of the kernels (`batches_in_grid`), else one example at a time by
    `jax.lax.map`, the loop vmap would otherwise build, with its carry typed from `fn`'s
    outputs (varying over a `shard_map`'s axes as they do)."""
    if in_grid:
        return jax.vmap(fn)(*xs)
    return jax.lax.map(lambda args: fn(*args), xs)


def forward(q, k, v, sinks, alibi, mask_arrays, options: BlockSparseOptions):
    """(out [B, Lq, Hq, Dv] in q's dtype, lse float32 [B, Hq, Lq]); alibi is always None
    (the op refuses ALiBi here: the splash kernels have none)."""
    del alibi
    q_len = q.shape[1]
    plan = _plan(options, mask_arrays, q_len, k.shape[1])
    kernel = plan.kernel

    def one(q, k, v):
        out, (lse,) = kernel(q, k, v, sinks=sinks)
        return out, lse

    out, lse = _over_batch(
        one,
        batches_in_grid((kernel.masks.fwd,), kernel.masks.element),
        _heads_first(q, plan.q_len),
        _heads_first(k, plan.kv_len),
        _heads_first(v, plan.kv_len),
    )
    return out[:, :, :q_len].transpose(0, 2, 1, 3), lse[:, :, :q_len]


def backward(
    q, k, v, out, lse, d_out, d_lse, sinks, alibi, mask_arrays, options: BlockSparseOptions
):
    """(dq, dk, dv) by the splash dQ and dK/dV kernels; d_lse: lse's cotangent float32
    [B, Hq, Lq] or None."""
    del sinks, alibi  # the sinks act through lse alone; no ALiBi here
    delta = row_delta(out, d_out, d_lse)
    q_len, kv_len = q.shape[1], k.shape[1]
    plan = _plan(options, mask_arrays, q_len, kv_len)
    masks, kernel_options = plan.kernel.masks, plan.kernel.config.options
    rows = ((0, 0), (0, 0), (0, plan.q_len - q_len))
    # Padded rows: no keys (lse -inf, the kernels' fully masked convention), no delta.
    lse = jnp.pad(lse, rows, constant_values=-jnp.inf)
    delta = jnp.pad(delta, rows)

    def one(q, k, v, d_out, lse, delta):
        args = (q, k, v, d_out, lse, delta)
        dq = splash_backward_dq(*args, masks.dq, masks.element, options=kernel_options)
        dk, dv = splash_backward_dkv(*args, masks.dkv, masks.element, options=kernel_options)
        return dq, dk, dv

    dq, dk, dv = _over_batch(
        one,
        batches_in_grid((masks.dq, masks.dkv), masks.element),
        _heads_first(q, plan.q_len),
        _heads_first(k, plan.kv_len),
        _heads_first(v, plan.kv_len),
        _heads_first(d_out, plan.q_len),
        lse,
        delta,
    )
    unpad = lambda x, n: x[:, :, :n].transpose(0, 2, 1, 3)
    return unpad(dq, q_len), unpad(dk, kv_len), unpad(dv, kv_len)
