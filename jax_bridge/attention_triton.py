"""JAX wiring of the varlen FlashAttention-2 Triton kernels (forward and backward).

The public op (`jax_bridge.attention`) validates its inputs and owns the custom_vjp; the
two functions here launch the kernels of `triton_kernels.flash_attention_fwd/_bwd`
through `triton_call`, on a GPU or, on a CPU, through Triton's interpreter.

Packed rows that belong to no sequence (past `cu_seqlens[-1]`) are covered too: the
kernels see two extra sequences, the query tail with no keys and the key tail with no
queries, so such query rows get output 0 and lse -inf (or the sink), such key rows get
zero gradients, and every output element is written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention_sinks import sink_gradient
from jax_bridge.attention_spec import AttentionSpec
from jax_bridge.numerics import cdiv
from jax_bridge.sequences import prepare_chunk_indices
from jax_bridge.triton_launch import gpu_launch_target, triton_call
from triton_kernels.flash_attention_bwd import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
)
from triton_kernels.flash_attention_config import (
    AttentionKernelConfig,
    block_d,
    default_attention_config,
    preprocess_block_t,
)
from triton_kernels.flash_attention_fwd import attention_forward_kernel

BackwardConfig = AttentionKernelConfig | tuple[AttentionKernelConfig, AttentionKernelConfig]


def target_compute_capability() -> int | None:
    """The compute capability the kernels are launched for; None on the interpreter."""
    on_gpu, compute_capability = gpu_launch_target()
    if not on_gpu:
        return None
    if compute_capability is not None:  # lowering for cuda without a GPU
        return compute_capability
    major, _, minor = str(jax.devices()[0].compute_capability).partition(".")
    return int(major) * 10 + int(minor or 0)


def _config(
    config: AttentionKernelConfig | None, head_dim: int, dtype: jnp.dtype, kind: str
) -> AttentionKernelConfig:
    if config is not None:
        if not isinstance(config, AttentionKernelConfig):
            raise TypeError(f"config must be an AttentionKernelConfig, got {type(config).__name__}")
        return config
    dtype_name = jnp.dtype(dtype).name
    return default_attention_config(head_dim, dtype_name, target_compute_capability(), kind)


def _dot_precision(config: AttentionKernelConfig, dtype: jnp.dtype) -> str:
    """The kernels' DOT_PRECISION (see `flash_attention_fwd._dot`)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return config.fp32_dot_precision
    if dtype == jnp.bfloat16 and target_compute_capability() is None:
        return "upcast"  # the interpreter's tl.dot cannot multiply bfloat16 tiles
    return "ieee"  # ignored: 16-bit tiles go to the tensor cores as they are


def _with_tail_sequences(
    cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, total_q: int, total_k: int
) -> tuple[jax.Array, jax.Array]:
    """cu_seqlens of batch + 2 sequences: the given ones, the query tail (no keys) and
    the key tail (no queries). Every packed row then belongs to exactly one sequence.

    The public op checks cu_seqlens only under checkify. Here they are made non-decreasing
    and clipped to [0, total] first, so that invalid ones (decreasing, negative, past the
    end) under plain jit give garbage results but never out-of-bounds reads or writes.
    """
    cu_q = jnp.clip(jax.lax.cummax(jnp.asarray(cu_seqlens_q, jnp.int32)), 0, total_q)
    cu_k = jnp.clip(jax.lax.cummax(jnp.asarray(cu_seqlens_k, jnp.int32)), 0, total_k)
    cu_q = jnp.concatenate([cu_q, jnp.full((2,), total_q, jnp.int32)])
    cu_k = jnp.concatenate([cu_k, cu_k[-1:], jnp.full((1,), total_k, jnp.int32)])
    return cu_q, cu_k


def _tiles(cu_seqlens: jax.Array, total: int, block: int) -> jax.Array:
    """int32 [cdiv(total, block) + batch, 2]: (sequence, tile) of every row tile; -1 past them."""
    return prepare_chunk_indices(cu_seqlens, block, total_tokens=total).astype(jnp.int32)


def _per_head(x: jax.Array | None) -> jax.Array:
    # Kernels read optional per-head vectors only behind a constexpr flag; absent ones
    # are a 1-element placeholder.
    return jnp.zeros((1,), jnp.float32) if x is None else jnp.asarray(x, jnp.float32)


# Windows wider than any sequence mask nothing more; clamping keeps them int32 scalars.
_WIDEST_WINDOW = 2**30


def _spec_arguments(spec: AttentionSpec) -> tuple[tuple, dict]:
    """The kernels' runtime scalars (scale, cap, windows) and their constexpr flags."""
    scalars = (
        np.float32(spec.softmax_scale),
        np.float32(spec.logits_soft_cap or 1.0),
        min(spec.window_left or 0, _WIDEST_WINDOW),
        min(spec.window_right or 0, _WIDEST_WINDOW),
    )
    flags = dict(
        HAS_WINDOW_LEFT=spec.window_left is not None,
        HAS_WINDOW_RIGHT=spec.window_right is not None,
        HAS_SOFT_CAP=spec.logits_soft_cap is not None,
    )
    return scalars, flags


def attention_forward_triton(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    spec: AttentionSpec,
    *,
    max_seqlen_q: int | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    config: AttentionKernelConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Varlen attention forward with the Triton kernel.

    Args:
      q: [total_q, Hq, D]; k, v: [total_k, Hkv, D] (Hq % Hkv == 0; float16, bfloat16 or
        float32; 16 <= D <= 256, any D).
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1].
      spec: the attention options.
      max_seqlen_q: accepted for API symmetry and ignored by the Triton path: the grid is
        sized by the query tiles (`cdiv(total_q, block_m) + B + 2`, surplus programs exit
        at once), not by the longest sequence.
      sinks, alibi_slopes: float32 [Hq] or None.
      config: the forward kernel's launch configuration (default: by head dim, dtype and
        target).

    Returns:
      out: [total_q, Hq, D] in q's dtype; lse: float32 [Hq, total_q] (natural log; -inf for
      rows with nothing allowed and no sink).
    """
    del max_seqlen_q
    total_q, num_q_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    out_shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((num_q_heads, total_q), jnp.float32),
    )
    if total_q == 0:
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((num_q_heads, 0), jnp.float32)
    config = _config(config, head_dim, q.dtype, "forward")
    cu_q, cu_k = _with_tail_sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    tiles = _tiles(cu_q, total_q, config.block_m)
    scalars, flags = _spec_arguments(spec)
    return triton_call(
        q,
        k,
        v,
        cu_q,
        cu_k,
        tiles,
        _per_head(sinks),
        _per_head(alibi_slopes),
        total_q,
        *scalars,
        kernel=attention_forward_kernel,
        out_shape=out_shapes,
        grid=(tiles.shape[0], num_q_heads),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name="varlen_attention_fwd",
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d(head_dim),
        HAS_SINKS=sinks is not None,
        HAS_ALIBI=alibi_slopes is not None,
        DOT_PRECISION=_dot_precision(config, q.dtype),
        **flags,
    )


def _backward_configs(
    config: BackwardConfig | None, head_dim: int, dtype: jnp.dtype
) -> tuple[AttentionKernelConfig, AttentionKernelConfig]:
    if isinstance(config, tuple):
        dkdv, dq = config
    else:
        dkdv = dq = config
    return (
        _config(dkdv, head_dim, dtype, "backward_dkdv"),
        _config(dq, head_dim, dtype, "backward_dq"),
    )


def attention_backward_triton(
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
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    config: BackwardConfig | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `attention_forward_triton` with respect to q, k, v and the sinks.

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_k, spec, sinks, alibi_slopes: as the forward.
      out: [total_q, Hq, D], lse: float32 [Hq, total_q]: the forward's results.
      d_out: [total_q, Hq, D]: the cotangent of `out` (the lse gets none).
      max_seqlen_q, max_seqlen_k: accepted for API symmetry and ignored by the Triton
        path (grids are sized by tiles, as in the forward).
      config: one AttentionKernelConfig for both the dK/dV and the dQ kernel, a pair
        (dkdv_config, dq_config), or None for the defaults.

    Returns:
      dq: [total_q, Hq, D] in q's dtype; dk, dv: [total_k, Hkv, D] in k's/v's dtype;
      d_sinks: float32 [Hq], or None without sinks. ALiBi slopes get no gradient.
    """
    del max_seqlen_q, max_seqlen_k
    total_q, num_q_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    if total_q == 0 or total_k == 0:  # nothing attends to anything
        d_sinks = None if sinks is None else jnp.zeros((num_q_heads,), jnp.float32)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), d_sinks
    dkdv_config, dq_config = _backward_configs(config, head_dim, q.dtype)
    lse = jnp.asarray(lse, jnp.float32)
    shape_constexprs = dict(NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim))

    block_t = preprocess_block_t(head_dim)
    delta = triton_call(
        out,
        d_out,
        total_q,
        kernel=attention_backward_preprocess_kernel,
        out_shape=jax.ShapeDtypeStruct((num_q_heads, total_q), jnp.float32),
        grid=(cdiv(total_q, block_t), num_q_heads),
        num_warps=4,
        num_stages=1,
        name="varlen_attention_bwd_preprocess",
        BLOCK_T=block_t,
        **shape_constexprs,
    )

    cu_q, cu_k = _with_tail_sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    scalars, flags = _spec_arguments(spec)
    common_inputs = (q, k, v, d_out, lse, delta, cu_q, cu_k)
    constexprs = dict(
        NUM_KV_HEADS=num_kv_heads,
        HAS_ALIBI=alibi_slopes is not None,
        **shape_constexprs,
        **flags,
    )

    key_tiles = _tiles(cu_k, total_k, dkdv_config.block_n)
    dk, dv = triton_call(
        *common_inputs,
        key_tiles,
        _per_head(alibi_slopes),
        total_q,
        *scalars,
        kernel=attention_backward_dkdv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(key_tiles.shape[0], num_kv_heads),
        num_warps=dkdv_config.num_warps,
        num_stages=dkdv_config.num_stages,
        name="varlen_attention_bwd_dkdv",
        BLOCK_M=dkdv_config.block_m,
        BLOCK_N=dkdv_config.block_n,
        DOT_PRECISION=_dot_precision(dkdv_config, q.dtype),
        **constexprs,
    )

    query_tiles = _tiles(cu_q, total_q, dq_config.block_m)
    dq = triton_call(
        *common_inputs,
        query_tiles,
        _per_head(alibi_slopes),
        total_q,
        *scalars,
        kernel=attention_backward_dq_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(query_tiles.shape[0], num_q_heads),
        num_warps=dq_config.num_warps,
        num_stages=dq_config.num_stages,
        name="varlen_attention_bwd_dq",
        BLOCK_M=dq_config.block_m,
        BLOCK_N=dq_config.block_n,
        DOT_PRECISION=_dot_precision(dq_config, q.dtype),
        **constexprs,
    )

    d_sinks = None if sinks is None else sink_gradient(sinks, lse, delta)
    return dq, dk, dv, d_sinks
