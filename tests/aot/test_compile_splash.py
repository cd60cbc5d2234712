"""The splash kernels (`make_splash_mha` / `make_splash_mqa`), forward and backward,
compiled by Mosaic for TPU v5e and v6e at every block size the defaults produce (512,
256 and 128: the largest that divides the sequence) in float32 and bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_tpu import splash
from tests.aot.helpers import TPU_TARGETS, compile_checked, spec, target_params

HEADS, HEAD_DIM = 2, 128
# Each length's default block: 512 -> 512, 768 -> 256, 384 -> 128.
DEFAULT_BLOCK_OF = {512: 512, 768: 256, 384: 128}


def _mha(length: int):
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * HEADS)
    kernel = splash.make_splash_mha(mask, attn_logits_soft_cap=20.0)
    assert kernel.config.options.block_sizes.block_q == DEFAULT_BLOCK_OF[length]
    return kernel


def _mqa(length: int):
    local = splash.LocalMask((length, length), window_size=(128, 0), offset=0)
    return splash.make_splash_mqa(splash.MultiHeadMask([local] * HEADS))


def _program(dtype):
    lengths = tuple(DEFAULT_BLOCK_OF)

    def program(*qkv):
        def loss(*qkv):
            total = 0.0
            for i, length in enumerate(lengths):
                q, k, v = qkv[3 * i : 3 * i + 3]
                segments = splash.SegmentIds(jnp.arange(length) // 100, jnp.arange(length) // 100)
                total += jnp.sum(_mha(length)(q, k, v, segments).astype(jnp.float32))
            q, k, v = qkv[-3:]
            total += jnp.sum(_mqa(lengths[0])(q, k, v).astype(jnp.float32))
            return total

        return jax.grad(loss, argnums=tuple(range(len(qkv))))(*qkv)

    args = [spec((HEADS, n, HEAD_DIM), dtype) for n in lengths for _ in "qkv"]
    n = lengths[0]
    args += [
        spec((HEADS, n, HEAD_DIM), dtype),
        spec((n, HEAD_DIM), dtype),
        spec((n, HEAD_DIM), dtype),
    ]
    return program, args


@pytest.mark.parametrize(("target", "dtype"), target_params(TPU_TARGETS))
def test_splash_kernels_compile_at_default_block_sizes(target, dtype):
    program, args = _program(dtype)
    compile_checked(
        program,
        *args,
        target=target,
        implementation="pallas",
        min_kernels=3 * (len(DEFAULT_BLOCK_OF) + 1),  # forward, dQ, dK/dV per call
    )


def test_default_block_table_matches_block_sizes():
    for length, block in DEFAULT_BLOCK_OF.items():
        resolved = splash.BlockSizes().resolve(length, length)
        assert (resolved.block_q, resolved.block_kv, resolved.block_q_dkv) == (block,) * 3
    assert np.all(np.array(list(DEFAULT_BLOCK_OF)) % 128 == 0)
