"""The model: a decoder-only MoE transformer in Flax Linen, generic over its two kernels.

Layers are scanned (`nn.scan` over blocks of `config.block_pattern`, parameters stacked on
a leading block axis) and each layer is rematerialised (`nn.remat`). Attention and the
expert feed-forward are delegated to a `Kernels` pair, so one module tree (and one
initialisation) serves our model (kernels.py: `varlen_attention` / `ring_attention` and
routed grouped matmuls) and its dense twin (`jax.nn.dot_product_attention` with a dense
mask, a per-expert loop). Parameters are float32 masters; `loss_fn` casts them to bfloat16
for the forward, and keeps the logits and the loss in float32.

Shapes: tokens [B, S]; hidden states [B, S, hidden]; q [B, S, num_q_heads, head_dim];
k, v [B, S, num_kv_heads, head_dim].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from examples.train_lm.config import ModelConfig
from examples.train_lm.data import NO_TARGET
from jax_bridge import prepare_position_ids, prepare_sequence_ids

COMPUTE_DTYPE = jnp.bfloat16


class Layout(NamedTuple):
    """Where the documents are, per row of the batch (all [B, ...], int32)."""

    cu_seqlens: jax.Array  # [B, max_documents + 1]
    segment_ids: jax.Array  # [B, S]: document index + 1 in its row; 0 is padding
    positions: jax.Array  # [B, S]: position in its document; 0 in padding


def layout_of(cu_seqlens: jax.Array, seq_len: int) -> Layout:
    """Segment ids and positions from cu_seqlens by the host-side layer (jit-friendly)."""
    ids = jax.vmap(lambda cu: prepare_sequence_ids(cu, seq_len))(cu_seqlens)
    positions = jax.vmap(lambda cu: prepare_position_ids(cu, seq_len))(cu_seqlens)
    return Layout(cu_seqlens, ids + 1, jnp.maximum(positions, 0))  # -1 past the end -> 0 / 0


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How a layer attends and runs its experts (kernels.py builds both flavours).

    attend(q, k, v, sinks [Hq] | None, layout, window) -> [B, S, Hq, head_dim]: causal
      within each document; `window` None (global) or w (the w previous keys and itself).
    experts(x [B, S, hidden], router [hidden, E], w_up [E, hidden, ffn],
      w_down [E, ffn, hidden], top_k) -> [B, S, hidden]: top-k routed, softmax over the
      k chosen logits, gelu feed-forward per expert.
    """

    attend: Callable[..., jax.Array]
    experts: Callable[..., jax.Array]


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding (rotate-half form) of x [B, S, H, D] at positions [B, S]."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * frequencies  # [B, S, 1, half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _dense(features, name: str, axis=-1) -> nn.DenseGeneral:
    return nn.DenseGeneral(features, axis=axis, use_bias=False, name=name)


class Attention(nn.Module):
    config: ModelConfig
    kernels: Kernels
    window: int | None

    @nn.compact
    def __call__(self, x: jax.Array, layout: Layout) -> jax.Array:
        c = self.config
        q = _dense((c.num_q_heads, c.head_dim), "q")(x)
        k = _dense((c.num_kv_heads, c.head_dim), "k")(x)
        v = _dense((c.num_kv_heads, c.head_dim), "v")(x)
        q, k = (rotary(t, layout.positions, c.rope_base) for t in (q, k))
        sinks = self.param("sinks", nn.initializers.zeros, (c.num_q_heads,)) if c.sinks else None
        out = self.kernels.attend(q, k, v, sinks, layout, self.window)
        return _dense(c.hidden, "o", axis=(-2, -1))(out)


class MoE(nn.Module):
    config: ModelConfig
    kernels: Kernels

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2, out_axis=-1)
        router = self.param("router", init, (c.hidden, c.num_experts))
        w_up = self.param("w_up", init, (c.num_experts, c.hidden, c.ffn))
        w_down = self.param("w_down", init, (c.num_experts, c.ffn, c.hidden))
        return self.kernels.experts(x, router, w_up, w_down, c.top_k).astype(x.dtype)


class Layer(nn.Module):
    """Pre-norm residual layer: attention, then the expert feed-forward."""

    config: ModelConfig
    kernels: Kernels
    window: int | None

    @nn.compact
    def __call__(self, x: jax.Array, layout: Layout) -> jax.Array:
        x = x + Attention(self.config, self.kernels, self.window, name="attention")(
            RMSNorm(name="attention_norm")(x), layout
        )
        return x + MoE(self.config, self.kernels, name="moe")(RMSNorm(name="moe_norm")(x))


class Block(nn.Module):
    """One repeat of the block pattern; each layer is rematerialised in the backward."""

    config: ModelConfig
    kernels: Kernels

    @nn.compact
    def __call__(self, x: jax.Array, layout: Layout) -> tuple[jax.Array, None]:
        for i, window in enumerate(self.config.block_pattern):
            layer = nn.remat(Layer, prevent_cse=False)
            x = layer(self.config, self.kernels, window, name=f"layer_{i}")(x, layout)
        return x, None


class Transformer(nn.Module):
    config: ModelConfig
    kernels: Kernels

    @nn.compact
    def __call__(
        self, tokens: jax.Array, layout: Layout, extra_embedding: jax.Array | None = None
    ) -> jax.Array:
        """float32 logits [B, S, vocab]; `extra_embedding` [B, S, hidden] is added to the
        token embeddings (tests poison one document through it)."""
        c = self.config
        embed = self.param("embed", nn.initializers.normal(1.0), (c.vocab, c.hidden))
        x = embed[tokens]
        if extra_embedding is not None:
            x = x + extra_embedding.astype(x.dtype)
        # No constancy pass: it traces the body once more to find broadcast values, and
        # the kernels' checkify checks (effects DCE keeps, fed by the carry) read to newer
        # flax as a broadcast value depending on the body. Nothing here is broadcast out:
        # parameters are stacked on the block axis and the blocks return no outputs.
        blocks = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=c.num_blocks,
            check_constancy_invariants=False,
        )
        x, _ = blocks(c, self.kernels, name="blocks")(x, layout)
        x = RMSNorm(name="final_norm")(x)
        unembed = self.param("unembed", nn.initializers.normal(c.hidden**-0.5), (c.hidden, c.vocab))
        return jnp.einsum("bsh,hv->bsv", x, unembed, preferred_element_type=jnp.float32)


def init_params(config: ModelConfig, key: jax.Array, seq_len: int = 8) -> Any:
    """float32 parameters (the kernels are not called: an abstract trace decides shapes)."""

    model = Transformer(config, Kernels(_init_attend, _init_experts))
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    cu = jnp.array([[0, seq_len]], jnp.int32)
    return model.init(key, tokens, layout_of(cu, seq_len))["params"]


def _init_attend(q, k, v, sinks, layout, window):
    return q  # shapes only: init needs the parameters, not the values


def _init_experts(x, router, w_up, w_down, top_k):
    return x


def token_losses(
    params: Any,
    tokens: jax.Array,
    targets: jax.Array,
    cu_seqlens: jax.Array,
    *,
    config: ModelConfig,
    kernels: Kernels,
    extra_embedding: jax.Array | None = None,
    compute_dtype: Any = COMPUTE_DTYPE,
) -> jax.Array:
    """float32 [B, S] cross-entropy per token (0 where the target is NO_TARGET), computed
    in `compute_dtype` (bf16; the tests' oracle runs float32)."""
    layout = layout_of(cu_seqlens, tokens.shape[1])
    low = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    logits = Transformer(config, kernels).apply({"params": low}, tokens, layout, extra_embedding)
    valid = targets != NO_TARGET
    log_p = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_p, jnp.maximum(targets, 0)[..., None], -1)[..., 0]
    # where, not a product: a non-finite logit of a masked token must not reach the sum.
    return jnp.where(valid, -picked, 0.0)


def loss_fn(params: Any, batch: Any, **kwargs: Any) -> jax.Array:
    """Mean cross-entropy over the tokens that have a target (a float32 scalar)."""
    losses = token_losses(params, batch.tokens, batch.targets, batch.cu_seqlens, **kwargs)
    count = jnp.sum(batch.targets != NO_TARGET)
    return jnp.sum(losses) / jnp.maximum(count, 1).astype(jnp.float32)
