"""Splash attention as a differentiable JAX function: the custom_vjp and the factories.

`make_splash_mha(mask, ...)` / `make_splash_mqa(mask, ...)` process the mask once (the
forward/dQ and dK/dV MaskInfos) and return a `SplashAttentionKernel`, a pytree whose
children are the MaskInfo and ElementMask arrays and whose static part is the options:
it can be passed through `jax.jit`, and `jax.vmap` over a batch axis of q/k/v works.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import ad_checkpoint

from pallas_tpu.splash import mask_info as mask_info_lib
from pallas_tpu.splash import masks as mask_lib
from pallas_tpu.splash.backward import splash_backward_dkv, splash_backward_dq
from pallas_tpu.splash.config import DEFAULT_MASK_VALUE, BlockSizes, KernelOptions, SegmentIds
from pallas_tpu.splash.forward import splash_forward
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo

# The largest `mask_value` accepted. JAX's kernels give a masked logit the value
# mask_value, so its weight exp(mask_value - row_max) underflows to exactly 0 in float32
# once row_max - mask_value > 104; ours give it weight 0 always. At or below this bound
# the two agree on every row whose largest allowed logit exceeds mask_value + 104 (any
# realistic row); above it they would differ, so it is refused.
MASK_VALUE_BOUND = -1e6


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
    mask_heads: int | None = None  # the mask's head count (None: one 2-D mask for all)
    residual_checkpoint_name: str | None = None


def _forward(options: KernelOptions, checkpoint, masks: _Masks, q, k, v, segment_ids, sinks):
    out, lse = splash_forward(
        q, k, v, masks.fwd, masks.element, segment_ids=segment_ids, sinks=sinks, options=options
    )
    if checkpoint is not None:  # JAX's residual_checkpoint_name: remat policies see them
        out = ad_checkpoint.checkpoint_name(out, checkpoint)
        lse = ad_checkpoint.checkpoint_name(lse, checkpoint)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(options: KernelOptions, checkpoint, masks: _Masks, q, k, v, segment_ids, sinks):
    """(out, lse) for q: [hq, q_len, d], k/v: [hkv, kv_len, d / dv]."""
    return _forward(options, checkpoint, masks, q, k, v, segment_ids, sinks)


def _attention_fwd(options, checkpoint, masks, q, k, v, segment_ids, sinks):
    out, lse = _forward(options, checkpoint, masks, q, k, v, segment_ids, sinks)
    return (out, lse), (masks, q, k, v, segment_ids, sinks, out, lse)


def _attention_bwd(options, checkpoint, residuals, cotangents):
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


def _check_dtypes(q, k, v, segment_ids) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"splash attention: {name} must be a float array, got {x.dtype}")
    if segment_ids is not None:
        for name, ids in (("segment_ids.q", segment_ids.q), ("segment_ids.kv", segment_ids.kv)):
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"splash attention: {name} must be integer ids, got {ids.dtype}")


def _check_heads(config: _Config, q) -> None:
    """q's heads against the mask's (kept even when equal head masks share one MaskInfo
    row): inside shard_map a head shard holds mask_heads / head_shards of them."""
    if config.mask_heads is None:
        return
    want = config.mask_heads // config.head_shards
    if q.shape[0] != want:
        shards = (
            f" split into {config.head_shards} head shards of {want} (head_shards > 1 "
            "runs inside shard_map with manual_sharding_spec)"
            if config.head_shards > 1
            else ""
        )
        raise ValueError(
            f"splash attention: q has {q.shape[0]} heads, the mask {config.mask_heads}{shards}"
        )


def _check_inputs(config: _Config, q, k, v, segment_ids, sinks) -> None:
    kv_rank = 2 if config.is_mqa else 3
    if q.ndim != 3 or k.ndim != kv_rank or v.ndim != kv_rank:
        raise ValueError(
            f"expected q [heads, q_len, head_dim] and {kv_rank}-d k, v "
            f"({'MQA' if config.is_mqa else 'MHA'}), got {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape[-1] != q.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"incompatible q {q.shape}, k {k.shape}, v {v.shape}")
    _check_dtypes(q, k, v, segment_ids)
    _check_heads(config, q)
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
    checkpoint = config.residual_checkpoint_name
    out, lse = _attention(config.options, checkpoint, kernel.masks, q, k, v, segment_ids, sinks)
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
        mask_heads: int | None = None,
        residual_checkpoint_name: str | None = None,
    ) -> SplashAttentionKernel:
        """A kernel over MaskInfos processed elsewhere (e.g. per shard).

        `fwd` and `dq` are forward-traversal infos built with (block_q, block_kv) and
        (block_q_dq, block_kv_dq), `dkv` a dK/dV-traversal info built with
        (block_q_dkv, block_kv_dkv), all from `options.block_sizes` resolved against
        (q_len, kv_len). `mask_heads`: the mask's head count, checked against q's (None:
        unchecked); `residual_checkpoint_name`: the `checkpoint_name` of out and lse.
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
            mask_heads,
            residual_checkpoint_name,
        )
        return cls(masks, config)

    def manual_sharding_spec(self, head_axis: Any, q_axis: Any = None):
        """PartitionSpecs of this kernel's arrays for `jax.shard_map` (the kernel is
        passed as an argument): per-block arrays split over heads (`head_axis`, matching
        `head_shards`) and q blocks (`q_axis`, matching `q_seq_shards`); q-side token
        arrays over `q_axis`; partial blocks and kv-side arrays replicated.

        JAX's form, `manual_sharding_spec(NamedSharding(mesh, P(heads, q)))`, works too:
        its spec gives the two axes, whose mesh sizes must equal head_shards and
        q_seq_shards (ValueError otherwise; the kv sequence cannot be sharded).
        """
        if isinstance(head_axis, jax.sharding.NamedSharding):
            head_axis, q_axis = self._axes_of(head_axis)
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

    def _axes_of(self, sharding: jax.sharding.NamedSharding) -> tuple[Any, Any]:
        """(head axis, q axis) of JAX's NamedSharding form, checked against the shards."""
        spec = tuple(sharding.spec)
        if len(spec) > 2:
            raise ValueError(
                "manual_sharding_spec: the sharding's spec must be (heads, q_sequence); "
                f"sharding the kv sequence is not supported, got {sharding.spec}"
            )
        head_axis, q_axis = (*spec, None, None)[:2]
        for axis, shards, name in (
            (head_axis, self.config.head_shards, "head_shards"),
            (q_axis, self.config.q_seq_shards, "q_seq_shards"),
        ):
            names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
            size = math.prod(sharding.mesh.shape[a] for a in names)
            if size != shards:
                raise ValueError(
                    f"manual_sharding_spec: mesh axes {names} have {size} devices but the "
                    f"kernel was made with {name}={shards}; make it with {name}={size}"
                )
        return head_axis, q_axis

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


def _as_mask(mask: Any) -> Any:
    """A Mask (kept), a jax.Array (kept: a dynamic mask) or an array-like of bools as
    NumpyMasks (3-D: one per head, as JAX; 2-D: one for every head)."""
    if isinstance(mask, (mask_lib.Mask, jax.Array)):
        return mask
    if not isinstance(mask, np.ndarray | list | tuple):
        raise TypeError(
            f"make_splash_mha: mask must be a pallas_tpu.splash Mask, a bool numpy array or a "
            f"bool jax.Array, got {type(mask).__module__}.{type(mask).__name__} (JAX's "
            "splash masks are not ours: pallas_tpu.splash has each under the same name)"
        )
    array = np.asarray(mask)
    if array.ndim == 3:
        return mask_lib.MultiHeadMask([mask_lib.NumpyMask(head) for head in array])
    if array.ndim == 2:
        return mask_lib.NumpyMask(array)
    raise ValueError(f"mask must be [num_heads, q_len, kv_len] or 2-D, got shape {array.shape}")


def _check_mask_value(mask_value: Any) -> None:
    value = float(mask_value)
    if not value <= MASK_VALUE_BOUND:  # NaN too
        raise ValueError(
            f"make_splash_mha: mask_value={mask_value} is refused: JAX's kernels give a "
            "masked logit this value, and one this high gives masked keys a weight; ours "
            "give them exactly none. Any mask_value <= -1e6 (JAX's default "
            "-0.7 * float32 max, -inf) means the same in both; leave it out."
        )


def _process(mask: Any, blocks: BlockSizes, **process: Any):
    """(fwd, dq, dkv MaskInfos, ElementMask) of a Mask, or of a jax.Array (dynamic)."""
    dynamic = isinstance(mask, jax.Array)
    forward = mask_info_lib.process_dynamic_mask if dynamic else mask_info_lib.process_mask
    dkv_fn = mask_info_lib.process_dynamic_mask_dkv if dynamic else mask_info_lib.process_mask_dkv
    fwd_shape = (blocks.block_q, blocks.block_kv)
    fwd, element = forward(mask, fwd_shape, **process)
    dq_shape = (blocks.block_q_dq, blocks.block_kv_dq)
    dq = fwd if dq_shape == fwd_shape else forward(mask, dq_shape, **process)[0]
    dkv, _ = dkv_fn(mask, (blocks.block_q_dkv, blocks.block_kv_dkv), **process)
    return fwd, dq, dkv, element


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
    mask_value: float = DEFAULT_MASK_VALUE,
    residual_checkpoint_name: str | None = None,
    downcast_smem_data: bool = True,
    shrink_grid: bool = True,
    is_mqa: bool = False,
) -> SplashAttentionKernel:
    """Splash attention for k, v [num_kv_heads, kv_len, head_dim] (MHA and GQA).

    Args:
      mask: [num_heads, q_len, kv_len]: a MultiHeadMask, a bool numpy array (one
        NumpyMask per head, as JAX) or a bool jax.Array (processed with
        `process_dynamic_mask`, under jit too); or one 2-D Mask / numpy array for every
        head (a jax.Array must be 3-D).
        q must have the mask's head count (checked; a 2-D mask fits any).
      block_sizes: BlockSizes or None (defaults, see BlockSizes.resolve: up to 512 per
        block; JAX's None means `BlockSizes.get_default()`, 128 everywhere).
      head_shards, q_seq_shards, downcast_smem_data, shrink_grid: passed to the mask
        processing.
      interpret: True runs the Pallas kernels in interpret mode (CPU), False compiles
        them with Mosaic (JAX splash's default), None follows the platform the program
        is compiled for: Mosaic for TPU devices (real or compile-only), the interpreter
        elsewhere.
      softmax_scale: multiplies q . k (JAX has no such argument: 1.0 is its meaning);
        attn_logits_soft_cap: c in c * tanh(s / c).
      save_residuals: the kernel returns (out, (lse,)) instead of out.
      mask_value: JAX's logit of a masked pair. Ours give masked pairs weight 0, which
        is JAX's meaning for any value <= MASK_VALUE_BOUND (-1e6; see there); a higher
        one is refused (ValueError). Fully masked rows differ: README.
      residual_checkpoint_name: `jax.ad_checkpoint.checkpoint_name` of the forward's out
        and lse, so a remat policy (`save_only_these_names`) can keep them.
      is_mqa: JAX's keyword; True is `make_splash_mqa`.

    Raises:
      ValueError: a mask that is not 2-d or 3-d (a jax.Array not 3-d), or has an empty
        axis; bad block sizes (naming the field); a mask_value above the bound.
      TypeError: a mask or block_sizes of another type (JAX's splash masks included); a
        traced softmax_scale or attn_logits_soft_cap.
    """
    _check_mask_value(mask_value)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            "make_splash_mha: block_sizes must be a splash BlockSizes or None, got "
            f"{type(block_sizes).__name__}"
        )
    mask = _as_mask(mask)
    shape = tuple(mask.shape)
    if len(shape) not in (2, 3) or (isinstance(mask, jax.Array) and len(shape) != 3):
        raise ValueError(
            "make_splash_mha: mask must be [num_heads, q_len, kv_len], or a 2-D Mask or numpy "
            "array for every head (a 2-D jax.Array: jnp.broadcast_to(mask, (num_heads, "
            f"*mask.shape))), got shape {shape}"
        )
    q_len, kv_len = shape[-2:]
    if not (q_len and kv_len):
        raise ValueError(f"make_splash_mha: mask has an empty axis, shape {shape}")
    blocks = (block_sizes or BlockSizes()).resolve(q_len, kv_len)
    fwd, dq, dkv, element = _process(
        mask,
        blocks,
        downcast_smem_data=downcast_smem_data,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        shrink_grid=shrink_grid,
    )
    return SplashAttentionKernel.from_mask_infos(
        fwd,
        dq,
        dkv,
        element,
        q_len=q_len,
        kv_len=kv_len,
        options=KernelOptions(softmax_scale, attn_logits_soft_cap, blocks, interpret),
        is_mqa=is_mqa,
        save_residuals=save_residuals,
        head_shards=head_shards,
        q_seq_shards=q_seq_shards,
        mask_heads=shape[0] if len(shape) == 3 else None,
        residual_checkpoint_name=residual_checkpoint_name,
    )


def make_splash_mqa(mask: Any, **kwargs: Any) -> SplashAttentionKernel:
    """Splash attention for one shared k, v [kv_len, head_dim] (multi-query attention).

    Takes exactly `make_splash_mha`'s arguments (is_mqa is forced True).
    """
    return make_splash_mha(mask, **{**kwargs, "is_mqa": True})


def make_splash_mha_single_device(mask: Any, **kwargs: Any) -> SplashAttentionKernel:
    """JAX's name: `make_splash_mha` with head_shards = q_seq_shards = 1 by default."""
    return make_splash_mha(mask, **{"head_shards": 1, "q_seq_shards": 1, **kwargs})


def make_splash_mqa_single_device(mask: Any, **kwargs: Any) -> SplashAttentionKernel:
    """JAX's name: `make_splash_mqa` with head_shards = q_seq_shards = 1 by default."""
    return make_splash_mqa(mask, **{"head_shards": 1, "q_seq_shards": 1, **kwargs})
