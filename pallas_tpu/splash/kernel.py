"""Splash attention as a differentiable JAX function: the custom_vjp and the factories.

`make_splash_mha(mask, ...)` / `make_splash_mqa(mask, ...)` process the mask once (the
forward/dQ and dK/dV MaskInfos) and return a `SplashAttentionKernel`, a pytree whose
children are the MaskInfo and ElementMask arrays and whose static part is the options:
it can be passed through `jax.jit`, and `jax.vmap` over a batch axis of q/k/v works.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tpu.splash import mask_info as mask_info_lib
from pallas_tpu.splash.backward import splash_backward_dkv, splash_backward_dq
from pallas_tpu.splash.config import BlockSizes, KernelOptions, SegmentIds
from pallas_tpu.splash.forward import splash_forward
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo


class _Masks(NamedTuple):
    """The mask arrays of the three traversals (pytree leaves: non-differentiable)."""

    fwd: MaskInfo
    dq: MaskInfo
    dkv: MaskInfo
    element: ElementMask | None


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static half of a kernel (hashable: part of the pytree's aux data)."""

    options: KernelOptions  # block sizes resolved for (q_len, kv_len)
    q_len: int
    kv_len: int
    is_mqa: bool
    save_residuals: bool
    is_dynamic_mask: bool | None = None
    head_shards: int = 1
    q_seq_shards: int = 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(options: KernelOptions, masks: _Masks, q, k, v, segment_ids, sinks):
    """(out, lse) for q: [hq, q_len, d], k/v: [hkv, kv_len, d / dv]."""
    return splash_forward(
        q, k, v, masks.fwd, masks.element, segment_ids=segment_ids, sinks=sinks, options=options
    )


def _attention_fwd(options, masks, q, k, v, segment_ids, sinks):
    out, lse = _attention(options, masks, q, k, v, segment_ids, sinks)
    return (out, lse), (masks, q, k, v, segment_ids, sinks, out, lse)


def _attention_bwd(options, residuals, cotangents):
    masks, q, k, v, segment_ids, sinks, out, lse = residuals
    dout, dlse = cotangents
    # lse = log(sum exp s) gives d lse / d s = p, so a cotangent on lse enters exactly
    # like -delta: ds = p * (dp - (rowsum(dout * out) - dlse)).
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = delta - dlse.astype(jnp.float32)
    grads = (q, k, v, dout, lse, delta)
    dq = splash_backward_dq(
        *grads, masks.dq, masks.element, segment_ids=segment_ids, options=options
    )
    dk, dv = splash_backward_dkv(
        *grads, masks.dkv, masks.element, segment_ids=segment_ids, options=options
    )
    dsinks = None
    if sinks is not None:
        # d out / d sink = -exp(sink - lse) * out and d lse / d sink = exp(sink - lse).
        # lse >= sink; lse = -inf only with a -inf sink, whose weight is 0.
        finite = jnp.isfinite(lse)
        weight = jnp.where(finite, jnp.exp(sinks.astype(jnp.float32)[:, None] - lse), 0.0)
        dsinks = (-jnp.sum(weight * delta, axis=-1)).astype(sinks.dtype)
    return None, dq, dk, dv, None, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_inputs(config: _Config, q, k, v, segment_ids, sinks) -> None:
    kv_rank = 2 if config.is_mqa else 3
    if q.ndim != 3 or k.ndim != kv_rank or v.ndim != kv_rank:
        raise ValueError(
            f"expected q [heads, q_len, head_dim] and {kv_rank}-d k, v "
            f"({'MQA' if config.is_mqa else 'MHA'}), got {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape[-1] != q.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"incompatible q {q.shape}, k {k.shape}, v {v.shape}")
    q_len = config.q_len // config.q_seq_shards
    if (q.shape[1], k.shape[-2]) != (q_len, config.kv_len):
        raise ValueError(
            f"the kernel was built for q_len={config.q_len} in {config.q_seq_shards} q "
            f"shard(s) (a shard holds {q_len}; q_seq_shards > 1 runs inside shard_map "
            f"with manual_sharding_spec) and kv_len={config.kv_len}; got "
            f"{q.shape[1]} and {k.shape[-2]}"
        )
    if not config.is_mqa and q.shape[0] % k.shape[0]:
        raise ValueError(f"num_q_heads={q.shape[0]} is not a multiple of {k.shape[0]} kv heads")
    if sinks is not None and sinks.shape != (q.shape[0],):
        raise ValueError(f"sinks must be [num_q_heads]={(q.shape[0],)}, got {sinks.shape}")
    if segment_ids is not None and (
        segment_ids.q.shape != (q_len,) or segment_ids.kv.shape != (config.kv_len,)
    ):
        raise ValueError(
            f"segment ids must be q [{q_len}], kv [{config.kv_len}]; got "
            f"{segment_ids.q.shape}, {segment_ids.kv.shape}"
        )


@jax.jit
def _call(kernel: SplashAttentionKernel, q, k, v, segment_ids, sinks):
    config = kernel.config
    _check_inputs(config, q, k, v, segment_ids, sinks)
    if config.is_mqa:  # one shared kv head: the GQA path with a group of all q heads
        k, v = k[None], v[None]
    out, lse = _attention(config.options, kernel.masks, q, k, v, segment_ids, sinks)
    return (out, (lse,)) if config.save_residuals else out


@jax.tree_util.register_pytree_node_class
class SplashAttentionKernel:
    """A processed mask plus static options; call it as `kernel(q, k, v, ...)`.

    Attributes:
      masks: MaskInfos for the forward, dQ and dK/dV traversals and the ElementMask.
      config: static options (block sizes resolved, scale, soft cap, MQA, residuals).
    """

    def __init__(self, masks: _Masks, config: _Config):
        self.masks = masks
        self.config = config

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        segment_ids: SegmentIds | None = None,
        sinks: jax.Array | None = None,
    ):
        """Attention of q: [num_q_heads, q_len, head_dim] over k: [num_kv_heads, kv_len,
        head_dim] (MQA: [kv_len, head_dim]) and v (head_dim_v may differ).

        Returns out [num_q_heads, q_len, head_dim_v] in q.dtype, or with
        save_residuals (out, (lse,)), lse float32 [num_q_heads, q_len].
        """
        return _call(self, q, k, v, segment_ids, sinks)

    @classmethod
    def from_mask_infos(
        cls,
        fwd: MaskInfo,
        dq: MaskInfo,
        dkv: MaskInfo,
        element_mask: ElementMask | None = None,
        *,
        q_len: int,
        kv_len: int,
        options: KernelOptions,
        is_mqa: bool = False,
        save_residuals: bool = False,
        head_shards: int = 1,
        q_seq_shards: int = 1,
    ) -> SplashAttentionKernel:
        """A kernel over MaskInfos processed elsewhere (e.g. per shard).

        `fwd` and `dq` are forward-traversal infos built with (block_q, block_kv) and
        (block_q_dq, block_kv_dq), `dkv` a dK/dV-traversal info built with
        (block_q_dkv, block_kv_dkv), all from `options.block_sizes` resolved against
        (q_len, kv_len).
        """
        blocks = options.block_sizes.resolve(q_len, kv_len)
        options = dataclasses.replace(options, block_sizes=blocks)
        if element_mask is not None:
            element_mask = jax.tree_util.tree_map(jnp.asarray, element_mask)
        masks = _Masks(_as_arrays(fwd), _as_arrays(dq), _as_arrays(dkv), element_mask)
        config = _Config(
            options,
            q_len,
            kv_len,
            is_mqa,
            save_residuals,
            fwd.is_dynamic_mask,
            head_shards,
            q_seq_shards,
        )
        return cls(masks, config)

    def manual_sharding_spec(self, head_axis: str | None, q_axis: str | None):
        """PartitionSpecs of this kernel's arrays for `jax.shard_map` (the kernel is
        passed as an argument): per-block arrays split over heads (`head_axis`, matching
        `head_shards`) and q blocks (`q_axis`, matching `q_seq_shards`); q-side token
        arrays over `q_axis`; partial blocks and kv-side arrays replicated."""
        spec = jax.sharding.PartitionSpec
        per_block, q_tokens, whole = spec(head_axis, q_axis, None), spec(q_axis), spec()

        def info(i: MaskInfo) -> MaskInfo:
            return MaskInfo(
                *(None if a is None else per_block for a in (i.data_next, i.mask_next)),
                per_block,
                None if i.partial_mask_blocks is None else whole,
                None if i.q_sequence is None else q_tokens,
            )

        element = self.masks.element
        if element is not None:
            element = ElementMask(
                element.rule,
                q_tokens,
                None if element.kv_sequence is None else whole,
                None if element.q_document is None else q_tokens,
                None if element.kv_document is None else whole,
            )
        masks = _Masks(info(self.masks.fwd), info(self.masks.dq), info(self.masks.dkv), element)
        return SplashAttentionKernel(masks, self.config)

    def tree_flatten(self):
        return (self.masks,), self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        (masks,) = children
        return cls(_Masks(*masks), config)


def _as_arrays(info: MaskInfo) -> MaskInfo:
    """Device arrays for the leaves; is_dynamic_mask (a Python bool) goes static."""
    fields = info._replace(is_dynamic_mask=None)
    return MaskInfo(*(None if x is None else jnp.asarray(x) for x in fields))


def make_splash_mha(
    mask: Any,
    *,
    block_sizes: BlockSizes | None = None,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    interpret: bool | None = False,
    softmax_scale: float = 1.0,
    attn_logits_soft_cap: float | None = None,
    save_residuals: bool = False,
    downcast_smem_data: bool = True,
    shrink_grid: bool = True,
) -> SplashAttentionKernel:
    """Splash attention for k, v [num_kv_heads, kv_len, head_dim] (MHA and GQA).

    Args:
      mask: [num_heads, q_len, kv_len] (a MultiHeadMask) or one 2-D mask for every
        head; any mask `process_mask` accepts.
      block_sizes: BlockSizes or None (defaults, see BlockSizes.resolve).
      head_shards, q_seq_shards, downcast_smem_data, shrink_grid: passed to the mask
        processing.
      interpret: True runs the Pallas kernels in interpret mode (CPU), False compiles
        them with Mosaic (JAX splash's default), None follows the platform the program
        is compiled for: Mosaic for TPU devices (real or compile-only), the interpreter
        elsewhere.
      softmax_scale: multiplies q . k; attn_logits_soft_cap: c in c * tanh(s / c).
      save_residuals: the kernel returns (out, (lse,)) instead of out.

    Raises:
      ValueError: a mask that is not 2-d or 3-d, or bad block sizes (naming the field).
    """
    shape = tuple(np.shape(mask))
    if len(shape) not in (2, 3):
        raise ValueError(f"mask must be [num_heads, q_len, kv_len] or 2-D, got shape {shape}")
    q_len, kv_len = shape[-2:]
    blocks = (block_sizes or BlockSizes()).resolve(q_len, kv_len)
    process = dict(
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )
    fwd_shape = (blocks.block_q, blocks.block_kv)
    fwd, element = mask_info_lib.process_mask(mask, fwd_shape, **process)
    dq_shape = (blocks.block_q_dq, blocks.block_kv_dq)
    dq = fwd if dq_shape == fwd_shape else mask_info_lib.process_mask(mask, dq_shape, **process)[0]
    dkv_shape = (blocks.block_q_dkv, blocks.block_kv_dkv)
    dkv, _ = mask_info_lib.process_mask_dkv(mask, dkv_shape, **process)
    return SplashAttentionKernel.from_mask_infos(
        fwd,
        dq,
        dkv,
        element,
        q_len=q_len,
        kv_len=kv_len,
        options=KernelOptions(softmax_scale, attn_logits_soft_cap, blocks, interpret),
        save_residuals=save_residuals,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
    )


def make_splash_mqa(mask: Any, **kwargs: Any) -> SplashAttentionKernel:
    """Splash attention for one shared k, v [kv_len, head_dim] (multi-query attention).

    Takes exactly `make_splash_mha`'s arguments.
    """
    kernel = make_splash_mha(mask, **kwargs)
    config = dataclasses.replace(kernel.config, is_mqa=True)
    return SplashAttentionKernel(kernel.masks, config)
