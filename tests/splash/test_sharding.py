"""Splash kernels split over heads and q blocks inside `jax.shard_map` (4 fake CPU
devices) equal the unsharded kernel, forward and gradients: both are compared with the
float64 dense reference within the problem's `splash_tolerance` (tests/splash/helpers.py),
so they agree within twice that whatever either's summation order.

The kernel object goes into shard_map as an argument with `manual_sharding_spec`. The
plain Pallas interpreter cannot type its constants under check_vma=True (a JAX limitation
off-TPU), so these tests turn the check off; `tests/test_shard_map.py` runs
`varlen_attention(implementation="pallas")` under the default check through the TPU
interpreter.
"""

from __future__ import annotations

import functools

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
from tests.attention.helpers import assert_close
from tests.devices import first_devices
from tests.splash.helpers import oracle_value_and_grad, splash_tolerance
from tests.splash.reference import attention_reference

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
    mesh = Mesh(np.array(first_devices(4)).reshape(shards), ("h", "q"))
    seed = 10 * sorted(_masks()).index(name) + head_shards  # fresh inputs per case
    keys = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(key, (HEADS, TOKENS, DIM)) for key in keys)
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
    # Fixed (not a function of the output): no path's rounding feeds its own backward.
    cotangent = jax.random.normal(jax.random.key(9), (HEADS, TOKENS, DIM))
    reference = lambda *a: attention_reference(*a, np.asarray(mask[:, :, :]))[0]
    (_, oracle_out), oracle_grads = oracle_value_and_grad(
        functools.partial(_loss_and_out, reference, cotangent), q, k, v, argnums=(0, 1, 2)
    )
    tol = splash_tolerance(q, k, v)
    for path, attend in (("sharded", functools.partial(sharded, kernel)), ("whole", whole)):
        step = jax.value_and_grad(
            functools.partial(_loss_and_out, attend, cotangent), (0, 1, 2), has_aux=True
        )
        (_, out), grads = jax.jit(step)(q, k, v)
        assert_close(out, oracle_out, tol, f"{path} out")
        for axis, got, want in zip("qkv", grads, oracle_grads, strict=True):
            assert_close(got, want, tol, f"{path} d{axis}")


def _loss_and_out(attend, cotangent, q, k, v):
    """(sum(out * cotangent), out) of out = attend(q, k, v)."""
    out = attend(q, k, v)
    return jnp.sum(out * cotangent), out


def test_q_sharded_kernel_refuses_whole_sequences():
    mask = _masks()["causal"]
    kernel = make_splash_mha(mask, block_sizes=BLOCKS, interpret=True, q_seq_shards=2)
    q = jax.random.normal(jax.random.key(0), (HEADS, TOKENS, DIM))
    with pytest.raises(ValueError, match="q_seq_shards > 1 runs inside shard_map"):
        kernel(q, q, q)
