"""The Triton backend of varlen attention: the FlashAttention-2 kernels of
`triton_kernels.flash_attention`, launched through `triton_call` (on a GPU, or on a CPU
through Triton's interpreter).

Backend contract (see `jax_bridge.attention.api`): `HEAD_DIMS`, `forward`, `backward`.

The kernels' work lists (which sequence and tile each program owns, over sequences that
cover every packed row) are `jax_bridge.attention.schedule`'s.

An optional per-sequence diagonal shift (`shift`, int32 [B]: query 0 of sequence b at key
position shift[b] instead of the bottom-right len_k - len_q) reaches the kernels as their
`shift_ptr`; without one they get a float32 placeholder instead, which compiles the
bottom-right kernels, unchanged (the kernels choose by the pointer's element type).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention.options import AttentionOptions
from jax_bridge.attention.schedule import (
    TileSchedule,
    call_walks_tile_lists,
    programs,
    tile_schedule,
)
from jax_bridge.attention.sinks import row_delta, sink_gradient
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.numerics import cdiv
from jax_bridge.core.precision import triton_input_precision
from jax_bridge.launch.host_descriptors import HostDescriptor
from jax_bridge.launch.target import (
    follow_lowering_platform,
    launch_target,
    require_tensor_descriptors,
    tensor_descriptors_available,
)
from jax_bridge.launch.triton_call import float32_or_placeholder, triton_call
from triton_kernels.flash_attention.backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_row_stats_kernel,
)
from triton_kernels.flash_attention.config import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    AttentionFeatures,
    AttentionKernelConfig,
    block_d,
    default_attention_config,
    row_stats_config,
)
from triton_kernels.flash_attention.constexprs import attention_constexprs, attention_num_warps
from triton_kernels.flash_attention.forward import attention_forward_kernel

HEAD_DIMS = (MIN_HEAD_DIM, MAX_HEAD_DIM)


def _features(spec: AttentionSpec, sinks: Any, alibi_slopes: Any) -> AttentionFeatures:
    """The call's options that change the kernels' code (and so their best tiles)."""
    return AttentionFeatures(
        causal=spec.causal,
        window_left=spec.window_left is not None,
        window_right=spec.window_right is not None,
        soft_cap=spec.logits_soft_cap is not None,
        alibi=alibi_slopes is not None,
        sinks=sinks is not None,
    )


def _config(
    options: AttentionOptions,
    q: jax.Array,
    k: jax.Array,
    kind: str,
    features: AttentionFeatures,
    persistent: bool,
) -> AttentionKernelConfig:
    """The launch configuration of kernel `kind` for q [Tq, Hq, D] and k [Tk, Hkv, D]:
    the caller's, or the default."""
    config = None if options.config is None else getattr(options.config, kind)
    if config is not None:
        return config
    capability = launch_target().compute_capability
    return default_attention_config(
        q.shape[2], jnp.dtype(q.dtype).name, capability, kind, features=features,
        persistent=persistent, descriptors=tensor_descriptors_available(),
        dq_atomic=_dq_atomic(options),
    )  # fmt: skip


def _launch(
    kind: str,
    config: AttentionKernelConfig,
    features: AttentionFeatures,
    q: jax.Array,
    k: jax.Array,
    options: AttentionOptions,
    persistent: bool,
    has_d_lse: bool = False,
) -> dict:
    """The launch keywords of kernel `kind` under `config`: warps, stages, name and the
    constexprs (`attention_constexprs`; dK/dV's DQ_ATOMIC from `options.config`). A
    config with `tma` is refused here unless the hardware allows it (the options each
    kernel can take, and a head_dim descriptors can load, were checked where the configs
    were built: `AttentionConfigs`, `api._check_config`)."""
    head_dim = q.shape[2]
    if config.tma:
        require_tensor_descriptors("varlen_attention")
    constexprs = attention_constexprs(
        kind, config, features, num_q_heads=q.shape[1], num_kv_heads=k.shape[1],
        head_dim=head_dim, softmax_scale=options.spec.softmax_scale,
        input_precision=triton_input_precision(options.precision, q.dtype), persistent=persistent,
        has_d_lse=has_d_lse, dq_atomic=_dq_atomic(options),
    )  # fmt: skip
    return dict(
        num_warps=attention_num_warps(config, persistent),
        num_stages=config.num_stages,
        name=_KERNEL_NAMES[kind],
        **constexprs,
    )


_KERNEL_NAMES = {
    "forward": "varlen_attention_fwd",
    "backward_dq": "varlen_attention_bwd_dq",
    "backward_dkdv": "varlen_attention_bwd_dkdv",
}


def _dq_atomic(options: AttentionOptions) -> bool:
    """Whether the dK/dV kernel accumulates dQ (`AttentionConfigs.dq_atomic`)."""
    return options.config is not None and options.config.dq_atomic


def _check_shift(shift: jax.Array | None, cu_seqlens_q: jax.Array) -> jax.Array | None:
    """`shift` as int32 [B] (B = len(cu_seqlens_q) - 1), or None; its shape is checked
    because the kernels index it by sequence."""
    if shift is None:
        return None
    shift = jnp.asarray(shift)
    batch = cu_seqlens_q.shape[0] - 1
    if not jnp.issubdtype(shift.dtype, jnp.integer):
        raise TypeError(f"shift must be an integer array, got {shift.dtype}.")
    if shift.shape != (batch,):
        raise ValueError(f"shift must have shape [batch] = ({batch},), got {tuple(shift.shape)}.")
    return shift.astype(jnp.int32)


def _shift_pointer(shift: jax.Array | None) -> jax.Array:
    """The kernels' `shift_ptr`: int32 [B + 4] for a shift [B] (the two head and two tail
    sequences of the schedule have no keys or no queries: their entry, 0, changes
    nothing), or a float32 placeholder, never read, that selects the bottom-right
    kernels."""
    if shift is None:
        return jnp.zeros((1,), jnp.float32)
    two = jnp.zeros((2,), jnp.int32)
    return jnp.concatenate([two, shift, two])


def _spec_arguments(spec: AttentionSpec, shift: jax.Array | None = None) -> tuple:
    """The kernels' runtime arguments of the attention pattern (scale, cap, windows, then
    `shift_ptr`, see `_shift_pointer`); their constexpr switches are
    `AttentionFeatures.kernel_flags`."""
    return (
        np.float32(spec.softmax_scale),
        np.float32(spec.logits_soft_cap or 1.0),
        spec.window_left or 0,  # < UNBOUNDED_WINDOW (the spec's invariant): an int32
        spec.window_right or 0,
        _shift_pointer(shift),
    )


@follow_lowering_platform
def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    sinks: jax.Array | None,
    alibi_slopes: jax.Array | None,
    options: AttentionOptions,
    shift: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Varlen attention forward with the Triton kernel.

    Args:
      q: [total_q, Hq, D]; k, v: [total_k, Hkv, D] (Hq % Hkv == 0; float16, bfloat16 or
        float32; 16 <= D <= 256, any D).
      cu_seqlens_q, cu_seqlens_k: int32 [B + 1].
      sinks, alibi_slopes: [Hq] or None.
      options: the call's static options (spec, precision, launch configs).
      shift: int32 [B] or None: query i of sequence b sits at key position i + shift[b]
        (None: the bottom-right i + len_k - len_q). Any value: rows whose window misses
        every key get output 0 and lse -inf (or the sink).

    Returns:
      out: [total_q, Hq, D] in q's dtype; lse: float32 [Hq, total_q] (natural log; -inf for
      rows with nothing allowed and no sink).

    The tile list has `chunk_bound(total_q, block_m, B + 4)` rows, launched as one program
    a row or, past 60 sequences, as `cdiv(total_q, block_m) + 64` persistent programs
    (`schedule.persistent`): never sized by the longest sequence, nor by the empty ones.
    """
    total_q, num_q_heads, _ = q.shape
    total_k = k.shape[0]
    shift = _check_shift(shift, cu_seqlens_q)
    if total_q == 0 or total_k == 0:  # no launch: every row attends nothing
        return jnp.zeros_like(q), _lse_without_keys(sinks, num_q_heads, total_q)
    features = _features(options.spec, sinks, alibi_slopes)
    persistent = call_walks_tile_lists(cu_seqlens_q)
    config = _config(options, q, k, "forward", features, persistent)
    schedule = tile_schedule(
        cu_seqlens_q, cu_seqlens_k, total_q, total_k, config.block_m, None, features
    )
    chunks = schedule.query_tiles
    scalars = _spec_arguments(options.spec, shift)
    return triton_call(
        q,
        *_streamed_operands("forward", config, k, v),
        schedule.cu_q,
        schedule.cu_k,
        chunks,
        float32_or_placeholder(sinks),
        float32_or_placeholder(alibi_slopes),
        total_q,
        chunks.shape[0],
        *scalars,
        kernel=attention_forward_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((num_q_heads, total_q), jnp.float32),
        ),
        grid=(programs(chunks.shape[0], total_q, config.block_m, persistent), num_q_heads),
        **_launch("forward", config, features, q, k, options, persistent),
    )


def _streamed_operands(
    kind: str, config: AttentionKernelConfig, first: jax.Array, second: jax.Array
) -> tuple:
    """The two arrays kernel `kind` streams tile by tile (the forward's and dQ's k and v,
    dK/dV's q and d_out) as it takes them: arrays, or (`host_descriptors`) descriptors
    the launch encodes over all of each, [rows, heads * D] in boxes of one head of a tile
    (`AttentionKernelConfig.descriptor_box`)."""
    if not config.host_descriptors:
        return first, second
    box = config.descriptor_box(kind, first.shape[2])
    return tuple(HostDescriptor(x.reshape(x.shape[0], -1), box) for x in (first, second))


def _lse_without_keys(sinks: jax.Array | None, num_q_heads: int, total_q: int) -> jax.Array:
    """float32 [Hq, total_q]: the log-sum-exp of rows with no key (the sink, or -inf)."""
    row = jnp.full((num_q_heads,), -jnp.inf, jnp.float32) if sinks is None else sinks
    return jnp.broadcast_to(row.astype(jnp.float32)[:, None], (num_q_heads, total_q))


@follow_lowering_platform
def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array | None,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    sinks: jax.Array | None,
    alibi_slopes: jax.Array | None,
    options: AttentionOptions,
    shift: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `forward` with respect to q, k, v and the sinks.

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes, options, shift: as the
        forward.
      out: [total_q, Hq, D], lse: float32 [Hq, total_q]: the forward's results.
      d_out: [total_q, Hq, D]; d_lse: float32 [Hq, total_q] or None: the cotangents.

    Returns:
      dq: [total_q, Hq, D] in q's dtype; dk, dv: [total_k, Hkv, D] in k's/v's dtype;
      d_sinks: float32 [Hq], or None without sinks. ALiBi slopes get no gradient.
    """
    total_q, num_q_heads, _ = q.shape
    total_k = k.shape[0]
    shift = _check_shift(shift, cu_seqlens_q)
    if total_q == 0 or total_k == 0:  # every probability is 0: only sinks have a gradient
        delta = row_delta(out, d_out, d_lse)
        d_sinks = None if sinks is None else sink_gradient(sinks, lse, delta)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), d_sinks
    features = _features(options.spec, sinks, alibi_slopes)
    persistent = call_walks_tile_lists(cu_seqlens_q)
    dq_config = _config(options, q, k, "backward_dq", features, persistent)
    dkdv_config = _config(options, q, k, "backward_dkdv", features, persistent)
    schedule = tile_schedule(
        cu_seqlens_q, cu_seqlens_k, total_q, total_k, dq_config.block_m, dkdv_config.block_n,
        features,
    )  # fmt: skip
    launch = _BackwardLaunch(
        q, k, v, d_out, alibi_slopes, options, features, persistent, schedule, shift
    )
    lse = jnp.asarray(lse, jnp.float32)
    if _dq_atomic(options):
        delta, lse_log2 = _row_statistics(out, d_out, lse, d_lse, num_q_heads)
        dk, dv, dq_accum = _dkdv(launch, dkdv_config, lse_log2, delta)
        dq = (dq_accum * np.float32(options.spec.softmax_scale)).astype(q.dtype)
    else:
        # dQ first: its programs also write the row statistics (delta, lse in log2 units)
        # that the dK/dV kernel reads.
        dq, delta, lse_log2 = _dq_and_row_statistics(launch, dq_config, out, lse, d_lse)
        dk, dv, _ = _dkdv(launch, dkdv_config, lse_log2, delta)
    d_sinks = None if sinks is None else sink_gradient(sinks, lse, delta)
    return dq, dk, dv, d_sinks


@dataclasses.dataclass(frozen=True)
class _BackwardLaunch:
    """What both backward kernels of one call take (the arrays, the call's options and
    its tile lists)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    d_out: jax.Array
    alibi_slopes: jax.Array | None
    options: AttentionOptions
    features: AttentionFeatures
    persistent: bool
    schedule: TileSchedule
    shift: jax.Array | None = None

    @property
    def scalars(self) -> tuple:
        return _spec_arguments(self.options.spec, self.shift)


def _dq_and_row_statistics(
    launch: _BackwardLaunch,
    config: AttentionKernelConfig,
    out: jax.Array,
    lse: jax.Array,
    d_lse: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The dQ kernel: (dq [total_q, Hq, D] in q's dtype, delta, lse_log2: float32 [Hq,
    total_q])."""
    q, k = launch.q, launch.k
    total_q, num_q_heads, _ = q.shape
    chunks = launch.schedule.query_tiles
    stats = jax.ShapeDtypeStruct((num_q_heads, total_q), jnp.float32)
    return triton_call(
        q,
        *_streamed_operands("backward_dq", config, k, launch.v),
        out,
        launch.d_out,
        lse,
        float32_or_placeholder(d_lse),
        launch.schedule.cu_q,
        launch.schedule.cu_k,
        chunks,
        float32_or_placeholder(launch.alibi_slopes),
        total_q,
        chunks.shape[0],
        *launch.scalars,
        kernel=attention_backward_dq_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats),
        grid=(programs(chunks.shape[0], total_q, config.block_m, launch.persistent), num_q_heads),
        **_launch(
            "backward_dq", config, launch.features, q, k, launch.options, launch.persistent,
            d_lse is not None,
        ),
    )  # fmt: skip


def _row_statistics(
    out: jax.Array, d_out: jax.Array, lse: jax.Array, d_lse: jax.Array | None, num_q_heads: int
) -> tuple[jax.Array, jax.Array]:
    """(delta, lse_log2): float32 [Hq, total_q] (`attention_backward_row_stats_kernel`),
    where no dQ kernel runs to write them."""
    total_q, _, head_dim = out.shape
    config = row_stats_config(head_dim, launch_target().compute_capability)
    stats = jax.ShapeDtypeStruct((num_q_heads, total_q), jnp.float32)
    return triton_call(
        out,
        d_out,
        lse,
        float32_or_placeholder(d_lse),
        total_q,
        kernel=attention_backward_row_stats_kernel,
        out_shape=(stats, stats),
        grid=(cdiv(total_q, config.block_m), num_q_heads),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name="varlen_attention_bwd_row_stats",
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_D=block_d(head_dim),
        HAS_D_LSE=d_lse is not None,
    )


def _dkdv(
    launch: _BackwardLaunch,
    config: AttentionKernelConfig,
    lse_log2: jax.Array,
    delta: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The dK/dV kernel: (dk, dv [total_k, Hkv, D] in k's / v's dtype, and with
    `AttentionConfigs.dq_atomic` the unscaled dQ, float32 [total_q, Hq, D]; else a
    placeholder float32 [1] the kernel never touches)."""
    q, k, v = launch.q, launch.k, launch.v
    total_k, num_kv_heads, _ = k.shape
    chunks = launch.schedule.key_tiles
    dq_atomic = _dq_atomic(launch.options)
    dq_accum = jax.ShapeDtypeStruct(q.shape if dq_atomic else (1,), jnp.float32)
    q_in, d_out_in = _streamed_operands("backward_dkdv", config, q, launch.d_out)
    return triton_call(
        q_in,
        k,
        v,
        d_out_in,
        lse_log2,
        delta,
        launch.schedule.cu_q,
        launch.schedule.cu_k,
        chunks,
        float32_or_placeholder(launch.alibi_slopes),
        q.shape[0],
        chunks.shape[0],
        *launch.scalars,
        kernel=attention_backward_dkdv_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            dq_accum,
        ),
        zeroed_outputs=(2,) if dq_atomic else (),
        grid=(programs(chunks.shape[0], total_k, config.block_n, launch.persistent), num_kv_heads),
        **_launch(
            "backward_dkdv", config, launch.features, q, k, launch.options, launch.persistent
        ),
    )
