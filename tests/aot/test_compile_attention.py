"""varlen_attention and flash_attention, forward and backward, compiled for H100, A100,
TPU v5e and v6e by each target's compilers, for every backend and dtype the target has.

Two feature sets per compile cover every feature: (causal, GQA, sinks, return_lse) and
(sliding window, soft cap, ALiBi where the backend has it). The packed batch has several
documents, so the document masking (the varlen form of segment ids) is compiled too;
flash_attention takes segment ids directly.
"""

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import flash_attention, varlen_attention
from tests.aot.helpers import backends_of, compile_checked, spec, target_params

TOKENS, Q_HEADS, KV_HEADS, HEAD_DIM = 1024, 4, 2, 128
DOCUMENTS = 5  # cu_seqlens has DOCUMENTS + 1 entries


def _loss(out) -> jax.Array:
    leaves = jax.tree.leaves(out)
    return sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0).astype(jnp.float32)) for x in leaves)


def _features(implementation: str):
    """The two feature sets, as keyword arguments (ALiBi only where the backend has it)."""
    first = dict(causal=True, return_lse=True)
    second = dict(sliding_window=(256, 0), logits_soft_cap=30.0)
    return first, second, implementation != "pallas"


def _varlen_program(implementation: str):
    first, second, alibi = _features(implementation)

    def program(q, k, v, cu, sinks, slopes):
        def loss(q, k, v, sinks):
            a = varlen_attention(
                q, k, v, cu, cu, sinks=sinks, implementation=implementation, **first
            )
            b = varlen_attention(
                q,
                k,
                v,
                cu,
                cu,
                alibi_slopes=slopes if alibi else None,
                implementation=implementation,
                **second,
            )
            return _loss(a) + _loss(b)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    return program


@pytest.mark.parametrize(("target", "dtype"), target_params())
def test_varlen_attention_compiles(target, dtype):
    for implementation in backends_of(target):
        compile_checked(
            _varlen_program(implementation),
            spec((TOKENS, Q_HEADS, HEAD_DIM), dtype),
            spec((TOKENS, KV_HEADS, HEAD_DIM), dtype),
            spec((TOKENS, KV_HEADS, HEAD_DIM), dtype),
            spec((DOCUMENTS + 1,), jnp.int32),
            spec((Q_HEADS,), jnp.float32),
            spec((Q_HEADS,), jnp.float32),
            target=target,
            implementation=implementation,
            min_kernels=4,  # two forward and two backward launches at least
        )


def _flash_program(implementation: str):
    def program(q, k, v, segment_ids, sinks):
        def loss(q, k, v, sinks):
            out = flash_attention(
                q,
                k,
                v,
                q_segment_ids=segment_ids,
                causal=True,
                sinks=sinks,
                implementation=implementation,
            )
            return _loss(out)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    return program


@pytest.mark.parametrize(("target", "dtype"), target_params(dtypes=("bfloat16",)))
def test_flash_attention_compiles(target, dtype):
    batch, seq = 2, 512
    for implementation in backends_of(target):
        compile_checked(
            _flash_program(implementation),
            spec((batch, seq, Q_HEADS, HEAD_DIM), dtype),
            spec((batch, seq, KV_HEADS, HEAD_DIM), dtype),
            spec((batch, seq, KV_HEADS, HEAD_DIM), dtype),
            spec((batch, seq), jnp.int32),
            spec((Q_HEADS,), jnp.float32),
            target=target,
            implementation=implementation,
            min_kernels=2,
        )
