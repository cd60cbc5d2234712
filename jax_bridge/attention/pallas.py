"""The Pallas backend of varlen attention: the splash kernels of `pallas_tpu.splash`.

The packed batch becomes one block-sparse problem: a `DocumentMask` of the (traced)
cu_seqlens, causal / windowed inside each document, processed under jit into a forward
and a dK/dV `MaskInfo` in O(tokens + blocks) with static shapes, so batches whose
document boundaries change every step never re-trace. Empty blocks (other documents,
outside the window) are never loaded; partial blocks are masked in the kernel from
per-token document ids and positions.

Compiled by Mosaic wherever the program is lowered for a TPU (a TPU host, or compile-only
TPU devices from any host); a program lowered for another platform runs the same kernels
in Pallas' interpret mode (slow, for tests). Backend contract (see
`jax_bridge.attention.api`): `HEAD_DIMS`, `forward`, `backward`, plus `check_supported`
for the options these kernels do not have.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_bridge.attention.options import AttentionOptions
from jax_bridge.attention.sinks import row_delta, sink_gradient
from pallas_tpu.splash.backward import splash_backward_dkv, splash_backward_dq
from pallas_tpu.splash.config import BlockSizes, KernelOptions
from pallas_tpu.splash.forward import splash_forward
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo, process_mask, process_mask_dkv
from pallas_tpu.splash.masks import DocumentMask

HEAD_DIMS = (1, 2**16)  # whole head_dim per tile: no kernel limit beyond VMEM


def check_supported(options: AttentionOptions, has_alibi: bool, op: str) -> None:
    """Refuses, at trace time, what the splash kernels do not compute."""
    if has_alibi:
        raise ValueError(
            f"{op}: alibi_slopes is not supported by implementation='pallas' (the splash "
            "kernels have no position bias); use implementation='xla' or 'triton'."
        )
    if options.config is not None and not isinstance(options.config, BlockSizes):
        raise TypeError(
            f"{op}: implementation='pallas' takes config=BlockSizes(...) (splash tiles), "
            f"got {type(options.config).__name__}."
        )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Padded lengths, kernel options and the traversals of one call."""

    q_len: int
    kv_len: int
    kernel: KernelOptions
    forward_info: MaskInfo
    dq_info: MaskInfo
    dkv_info: MaskInfo
    element: ElementMask
    dkv_element: ElementMask


def _plan(options: AttentionOptions, cu_q, cu_k, total_q: int, total_k: int) -> _Plan:
    # Pad both sequences to a multiple of every block: padded tokens belong to no
    # document, so they attend nothing and nothing attends them.
    given = options.config or BlockSizes()
    requested, q_len, kv_len = given.for_padding(total_q, total_k)
    blocks = requested.resolve(q_len, kv_len)
    spec = options.spec
    # Invalid cu_seqlens under plain jit give garbage, never out-of-range documents.
    cu_q = jnp.clip(jax.lax.cummax(cu_q.astype(jnp.int32)), 0, total_q)
    cu_k = jnp.clip(jax.lax.cummax(cu_k.astype(jnp.int32)), 0, total_k)
    mask = DocumentMask(
        cu_q, cu_k, shape=(q_len, kv_len), window=(spec.window_left, spec.window_right)
    )
    forward_info, element = process_mask(mask, (blocks.block_q, blocks.block_kv))
    dq_info, _ = process_mask(mask, (blocks.block_q_dq, blocks.block_kv_dq))
    dkv_info, dkv_element = process_mask_dkv(mask, (blocks.block_q_dkv, blocks.block_kv_dkv))
    kernel = KernelOptions(
        softmax_scale=spec.softmax_scale,
        logits_soft_cap=spec.logits_soft_cap,
        block_sizes=blocks,
        interpret=None,  # Mosaic where the program is lowered for a TPU, else interpreted
    )
    return _Plan(q_len, kv_len, kernel, forward_info, dq_info, dkv_info, element, dkv_element)


def _refuse_shift(shift) -> None:
    # The splash DocumentMask aligns every document bottom-right; a per-document shift
    # would need its relative positions offset (kernels and block classification).
    if shift is not None:
        raise NotImplementedError(
            "implementation='pallas' aligns every document bottom-right and does not take a "
            "per-sequence shift yet (ring_attention with a sliding_window needs one); use "
            "implementation='xla' or 'triton'."
        )


def _heads_first(x: jax.Array, rows: int) -> jax.Array:
    """[T, H, D] -> [H, rows, D], zero padded on the token axis."""
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, 0))).transpose(1, 0, 2)


def _pad_last(x: jax.Array, rows: int, value: float) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1])), constant_values=value)


def _no_keys(q, v, sinks):
    """No kv token at all: every row sees only its sink (or nothing)."""
    out = jnp.zeros((*q.shape[:2], v.shape[-1]), q.dtype)
    lse = jnp.full((q.shape[1], q.shape[0]), -jnp.inf, jnp.float32)
    if sinks is not None:
        lse = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], lse.shape)
    return out, lse


def forward(q, k, v, cu_q, cu_k, sinks, alibi, options: AttentionOptions, shift=None):
    """(out [Tq, Hq, D], lse float32 [Hq, Tq])."""
    check_supported(options, alibi is not None, "varlen_attention")
    _refuse_shift(shift)
    total_q, total_k = q.shape[0], k.shape[0]
    if total_q == 0 or total_k == 0:
        return _no_keys(q, v, sinks)
    plan = _plan(options, cu_q, cu_k, total_q, total_k)
    out, lse = splash_forward(
        _heads_first(q, plan.q_len),
        _heads_first(k, plan.kv_len),
        _heads_first(v, plan.kv_len),
        plan.forward_info,
        plan.element,
        sinks=sinks,
        options=plan.kernel,
    )
    return out[:, :total_q].transpose(1, 0, 2), lse[:, :total_q]


def backward(q, k, v, out, lse, d_out, d_lse, cu_q, cu_k, sinks, alibi, options, shift=None):
    """(dq, dk, dv, d_sinks) of `forward` (which refused what these kernels lack); an lse
    cotangent enters as a shift of delta."""
    _refuse_shift(shift)
    total_q, total_k = q.shape[0], k.shape[0]
    delta = row_delta(out, d_out, d_lse)
    d_sinks = None if sinks is None else sink_gradient(sinks, lse, delta)
    if total_q == 0 or total_k == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), d_sinks
    plan = _plan(options, cu_q, cu_k, total_q, total_k)
    # Padded rows: no keys (lse -inf, the kernels' fully masked convention) and no delta.
    args = (
        _heads_first(q, plan.q_len),
        _heads_first(k, plan.kv_len),
        _heads_first(v, plan.kv_len),
        _heads_first(d_out, plan.q_len),
        _pad_last(lse, plan.q_len, -jnp.inf),
        _pad_last(delta, plan.q_len, 0.0),
    )
    dq = splash_backward_dq(*args, plan.dq_info, plan.element, options=plan.kernel)
    dk, dv = splash_backward_dkv(*args, plan.dkv_info, plan.dkv_element, options=plan.kernel)
    unpad = lambda x, total: x[:, :total].transpose(1, 0, 2)
    return unpad(dq, total_q), unpad(dk, total_k), unpad(dv, total_k), d_sinks
