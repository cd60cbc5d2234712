"""block_sparse_attention, forward and backward, compiled in bfloat16 for H100, A100, TPU
v5e and v6e by each target's compilers, with the target's own kernels (Triton on GPUs,
the splash kernels on TPUs: what "auto" picks there) and, on GPUs, the XLA path too
(~6 s each). The XLA path is left out for TPUs: XLA:TPU spends ~24 s on it at this size.

One program covers the three ways a partial tile is masked: a prefix-LM mask inside
documents of traced cu_seqlens (evaluated from per-token arrays), a NumpyMask (its
deduplicated partial blocks) and per-head masks; with GQA, sinks, a soft cap, the lse
and (but for the splash kernels) ALiBi.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import block_sparse_attention
from pallas_tpu.splash import DocumentMask, MultiHeadMask, NumpyMask, PrefixLMMask
from tests.aot.helpers import GPU_TARGETS, backends_of, compile_checked, spec, target_params

LENGTH, Q_HEADS, KV_HEADS, HEAD_DIM = 512, 4, 2, 128


def _program(implementation: str):
    shape = (LENGTH, LENGTH)
    blocks = np.random.default_rng(0).random((LENGTH // 128, LENGTH // 128)) < 0.3
    numpy_mask = NumpyMask(
        np.kron(blocks, np.tri(128, dtype=bool)).astype(bool) | np.eye(LENGTH, dtype=bool)
    )
    per_head = MultiHeadMask([PrefixLMMask(shape, 100), numpy_mask] * 2)

    def program(q, k, v, cu, sinks):
        def loss(q, k, v, sinks):
            documents = DocumentMask(cu, shape=shape, causal=True)
            options = dict(sinks=sinks, implementation=implementation)
            out, lse = block_sparse_attention(
                q, k, v, documents, logits_soft_cap=30.0, return_lse=True, **options
            )
            total = jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
            # ALiBi where the backend has it (not the splash kernels)
            slopes = None if implementation == "pallas" else jnp.linspace(0.05, 0.2, Q_HEADS)
            out = block_sparse_attention(q, k, v, per_head, alibi_slopes=slopes, **options)
            return total + jnp.sum(out.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    return program


@pytest.mark.parametrize(("target", "dtype"), target_params(dtypes=("bfloat16",)))
def test_block_sparse_attention_compiles(target, dtype):
    on_gpu = target in GPU_TARGETS
    for implementation in backends_of(target, ("xla", "triton") if on_gpu else ("pallas",)):
        compile_checked(
            _program(implementation),
            spec((1, LENGTH, Q_HEADS, HEAD_DIM), dtype),
            spec((1, LENGTH, KV_HEADS, HEAD_DIM), dtype),
            spec((1, LENGTH, KV_HEADS, HEAD_DIM), dtype),
            spec((6,), jnp.int32),
            spec((Q_HEADS,), jnp.float32),
            target=target,
            implementation=implementation,
            # forward, dQ and dK/dV of each of the two calls (none on the XLA path)
            min_kernels=0 if implementation == "xla" else 6,
        )
