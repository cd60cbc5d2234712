"""Splash kernels split over heads and q blocks inside `jax.shard_map` (4 fake CPU
devices) equal the unsharded kernel, forward and gradients.

The kernel object goes into shard_map as an argument with `manual_sharding_spec`. The
plain Pallas interpreter cannot type its constants under check_vma=True (a JAX limitation
off-TPU), so these tests turn the check off; `tests/test_shard_map.py` runs
`varlen_attention(implementation="pallas")` under the default check through the TPU
interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_tpu.splash import (
    BlockSizes,
    CausalMask,
    DocumentMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    make_splash_mha,
)

HEADS, TOKENS, DIM = 4, 512, 32
BLOCKS = BlockSizes(block_q=128, block_kv=128)


def _masks():
    rng = np.random.default_rng(0)
    random = rng.random((TOKENS, TOKENS)) < 0.3
    random[:, 0] = True  # no empty row
    shape = (TOKENS, TOKENS)
    return {
        "causal": MultiHeadMask([CausalMask(shape)] * HEADS),
        "per_head_mixture": MultiHeadMask(
            [CausalMask(shape), CausalMask(shape), LocalMask(shape, (100, 0), 0), NumpyMask(random)]
        ),
        "documents": MultiHeadMask(
            [DocumentMask(np.array([0, 100, 300, 512]), causal=True)] * HEADS
        ),
    }


@pytest.mark.parametrize("name", ["causal", "per_head_mixture", "documents"])
@pytest.mark.parametrize("shards", [(2, 2), (4, 1), (1, 4)])
def test_sharded_kernel_equals_unsharded(name, shards):
    head_shards, q_seq_shards = shards
    mask = _masks()[name]
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shards), ("h", "q"))
    q, k, v = (jax.random.normal(jax.random.key(i), (HEADS, TOKENS, DIM)) for i in range(3))
    whole = make_splash_mha(mask, block_sizes=BLOCKS, interpret=True)
    kernel = make_splash_mha(
        mask, block_sizes=BLOCKS, interpret=True, head_shards=head_shards, q_seq_shards=q_seq_shards
    )
    sharded = jax.shard_map(
        lambda kernel, q, k, v: kernel(q, k, v),
        mesh=mesh,
        in_specs=(kernel.manual_sharding_spec("h", "q"), P("h", "q"), P("h"), P("h")),
        out_specs=P("h", "q"),
        check_vma=False,
    )
    cotangent = jax.random.normal(jax.random.key(9), (HEADS, TOKENS, DIM))

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) * cotangent)

    got, got_grads = jax.jit(
        jax.value_and_grad(
            lambda q, k, v: loss(lambda *a: sharded(kernel, *a), q, k, v), argnums=(0, 1, 2)
        )
    )(q, k, v)
    want, want_grads = jax.value_and_grad(lambda q, k, v: loss(whole, q, k, v), argnums=(0, 1, 2))(
        q, k, v
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(sharded(kernel, q, k, v), whole(q, k, v), atol=1e-6)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got_grad, want_grad, atol=1e-5)


def test_q_sharded_kernel_refuses_whole_sequences():
    mask = _masks()["causal"]
    kernel = make_splash_mha(mask, block_sizes=BLOCKS, interpret=True, q_seq_shards=2)
    q = jax.random.normal(jax.random.key(0), (HEADS, TOKENS, DIM))
    with pytest.raises(ValueError, match="q_seq_shards > 1 runs inside shard_map"):
        kernel(q, q, q)
