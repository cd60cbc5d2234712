"""Dense references with JAX splash's signatures and meaning, for code ported from it.

`attention_reference` is one head; `make_masked_mha_reference(mask)` /
`make_masked_mqa_reference(mask)` return a jitted function over every head, as JAX's.
JAX's meaning is kept: a masked logit *becomes* `mask_value`, so a fully masked row
returns the average of v (and lse ~ mask_value) where the splash kernels return 0 and
-inf; rows with an allowed key agree with the kernels. Outputs are float32.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tpu.splash.config import DEFAULT_MASK_VALUE, SegmentIds

_BACKWARD_IMPLS = ("vanilla", "custom", "custom_vanilla")


def attention_reference(
    mask: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: SegmentIds | None,
    sinks: jax.Array | None = None,
    *,
    mask_value: float = DEFAULT_MASK_VALUE,
    save_residuals: bool = False,
    custom_type: str = "flash",
    attn_logits_soft_cap: float | None = None,
):
    """One head: mask bool [q_len, kv_len], q [q_len, d], k [kv_len, d], v [kv_len, dv],
    sinks a scalar or None. Returns out float32 [q_len, dv], with save_residuals
    (out, (lse [q_len],)). `custom_type` is accepted for JAX's signature (autodiff here)."""
    del custom_type
    f32 = jnp.float32
    logits = jnp.einsum("sd,td->st", q.astype(f32), k.astype(f32), precision="highest")
    if segment_ids is not None:
        mask = mask & (segment_ids.q[:, None] == segment_ids.kv[None, :])
    if attn_logits_soft_cap is not None:
        logits = attn_logits_soft_cap * jnp.tanh(logits / attn_logits_soft_cap)
    logits = jnp.where(mask, logits, mask_value)
    m = logits.max(axis=-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(f32))
    weights = jnp.exp(logits - m[:, None])
    total = weights.sum(axis=-1) + (0.0 if sinks is None else jnp.exp(sinks.astype(f32) - m))
    out = jnp.einsum("st,td->sd", weights / total[:, None], v.astype(f32), precision="highest")
    return (out, (m + jnp.log(total),)) if save_residuals else out


def _all_heads(mask, q, k, v, segment_ids, sinks, *, is_mqa, **options):
    """mask [heads, q_len, kv_len], q [heads, q_len, d]; k / v [kv_heads, kv_len, d] (q
    head h reads kv head h // (heads / kv_heads)) or, for MQA, [kv_len, d]."""
    if is_mqa:
        k, v = k[None], v[None]
    group = q.shape[0] // k.shape[0]
    k, v = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
    one_head = functools.partial(attention_reference, **options)
    sink_axis = None if sinks is None else 0
    return jax.vmap(one_head, in_axes=(0, 0, 0, 0, None, sink_axis))(
        mask, q, k, v, segment_ids, sinks
    )


def make_attention_reference(mask: Any, is_mqa: bool, backward_impl: str = "vanilla"):
    """JAX's factory: `fn(q, k, v, segment_ids=None, sinks=None, *, mask_value=...,
    save_residuals=False, attn_logits_soft_cap=None)` over every head of `mask` (a
    MultiHeadMask or bool array [heads, q_len, kv_len]). Gradients are autodiff of the
    dense math whatever `backward_impl` names (JAX's choices differ only in rounding)."""
    if backward_impl not in _BACKWARD_IMPLS:
        raise ValueError(f"backward_impl must be one of {_BACKWARD_IMPLS}, got {backward_impl!r}")
    if len(np.shape(mask)) != 3:
        raise ValueError(f"mask must be [heads, q_len, kv_len], got shape {np.shape(mask)}")
    dense = jnp.asarray(mask if isinstance(mask, jax.Array) else mask[:, :, :], jnp.bool_)

    @functools.partial(
        jax.jit, static_argnames=("mask_value", "save_residuals", "attn_logits_soft_cap")
    )
    def reference(
        q,
        k,
        v,
        segment_ids=None,
        sinks=None,
        *,
        mask_value=DEFAULT_MASK_VALUE,
        save_residuals=False,
        attn_logits_soft_cap=None,
    ):
        return _all_heads(
            dense,
            q,
            k,
            v,
            segment_ids,
            sinks,
            is_mqa=is_mqa,
            mask_value=mask_value,
            save_residuals=save_residuals,
            attn_logits_soft_cap=attn_logits_soft_cap,
        )

    return reference


def make_masked_mha_reference(mask: Any, backward_impl: str = "vanilla"):
    """`make_attention_reference` for k, v [kv_heads, kv_len, d] (MHA / GQA)."""
    return make_attention_reference(mask, False, backward_impl)


def make_masked_mqa_reference(mask: Any, backward_impl: str = "vanilla"):
    """`make_attention_reference` for one shared k, v [kv_len, d]."""
    return make_attention_reference(mask, True, backward_impl)
