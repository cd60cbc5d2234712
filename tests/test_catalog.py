"""The catalog describes the launches the bridge makes.

The static report and the tuner's pruning compile `triton_kernels.catalog` variants; a
variant whose constexprs differ from the bridge's launch would price a kernel that never
runs. Here the bridge's `triton_call` is replaced by a recorder (`tests.launches`: no
kernel runs), and each recorded launch of a causal GQA call is compared with the
catalog's variant for the same kernel, problem and tile config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import AttentionConfigs, block_sparse_attention, varlen_attention
from jax_bridge.attention import triton as attention_triton
from jax_bridge.block_sparse import triton as block_sparse_triton
from jax_bridge.launch.target import interpreting
from pallas_tpu.splash import CausalMask
from tests.launches import record_launches
from triton_kernels.block_sparse.config import block_sparse_config
from triton_kernels.catalog import (
    ATTENTION_KERNELS,
    BLOCK_SPARSE_KERNELS,
    CAUSAL,
    attention_variant,
    block_sparse_variant,
    default_variants,
    launched_loop_work,
)
from triton_kernels.flash_attention.backward import attention_backward_row_stats_kernel
from triton_kernels.flash_attention.config import KINDS, default_attention_config

# The catalog's heads (8 query, 2 key/value: GQA) and a head_dim the report uses.
Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def _inputs(key, q_shape, kv_shape):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, q_shape, jnp.bfloat16)
    k = jax.random.normal(kk, kv_shape, jnp.bfloat16)
    v = jax.random.normal(kv, kv_shape, jnp.bfloat16)
    return q, k, v


@pytest.mark.parametrize("dq_atomic", [False, True], ids=["dq-kernel", "dq-atomic"])
def test_varlen_launches_are_the_catalog_variants(monkeypatch, dq_atomic):
    """With `dq_atomic` no dQ kernel runs: the row statistics' pass (no matmul, not in
    the catalog) and the dK/dV variant that accumulates dQ instead."""
    recorded = record_launches(monkeypatch, attention_triton)
    q, k, v = _inputs(jax.random.key(0), (96, Q_HEADS, HEAD_DIM), (96, KV_HEADS, HEAD_DIM))
    cu = jnp.asarray([0, 40, 96], jnp.int32)
    configs = AttentionConfigs(dq_atomic=dq_atomic)

    def loss(q, k, v):
        out = varlen_attention(
            q, k, v, cu, cu, causal=True, config=configs, implementation="triton"
        )
        return out.astype(jnp.float32).sum()

    with interpreting():  # the interpreter's tiles, on a GPU host too
        jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    launches = {launch.kernel: launch.constexprs for launch in recorded}
    kinds = ("forward", "backward_dkdv") if dq_atomic else KINDS
    expected = {ATTENTION_KERNELS[kind] for kind in kinds}
    if dq_atomic:
        expected.add(attention_backward_row_stats_kernel)
    assert set(launches) == expected
    for kind in kinds:
        # the bridge's own tiles here (Triton's interpreter), in the catalog's variant
        config = default_attention_config(HEAD_DIM, "bfloat16", None, kind, features=CAUSAL)
        variant = attention_variant(
            kind, HEAD_DIM, 90, features=CAUSAL, config=config, dq_atomic=dq_atomic
        )
        assert launches[variant.kernel] == dict(variant.constexprs), kind


@pytest.mark.parametrize("soft_cap", [None, 30.0], ids=["plain", "soft_cap"])
def test_block_sparse_launches_are_the_catalog_variants(monkeypatch, soft_cap):
    recorded = record_launches(monkeypatch, block_sparse_triton)
    length = 64
    q, k, v = _inputs(
        jax.random.key(1), (1, length, Q_HEADS, HEAD_DIM), (1, length, KV_HEADS, HEAD_DIM)
    )
    mask = CausalMask((length, length))

    def loss(q, k, v):
        out = block_sparse_attention(
            q, k, v, mask, logits_soft_cap=soft_cap, implementation="triton"
        )
        return out.astype(jnp.float32).sum()

    with interpreting():  # the interpreter's tiles, on a GPU host too
        jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    # Each kernel launches twice: the catalog's variant, then CAREFUL (the programs whose
    # results the first found non-finite, again), with the same constexprs otherwise.
    launches = {}
    for launch in recorded:
        launches.setdefault(launch.kernel, []).append(launch.constexprs)
    assert set(launches) == set(BLOCK_SPARSE_KERNELS.values())
    for kind in KINDS:
        capped = soft_cap is not None
        config = block_sparse_config(HEAD_DIM, "bfloat16", None, kind, soft_cap=capped)
        # FIND_BAD_ROWS follows the target: the interpreter finds them as sm_90 does
        variant = block_sparse_variant(kind, HEAD_DIM, 90, config=config, soft_cap=capped)
        first, careful = launches[variant.kernel]
        assert first == dict(variant.constexprs), kind
        assert careful == first | dict(CAREFUL=True), kind


@pytest.mark.parametrize("compute_capability", [80, 90])
def test_every_catalog_kernel_owes_its_loop_a_known_tile(compute_capability):
    """`launched_loop_work` (a kernel known by the name its PTX gives and its launch's
    constexprs: the preflight's kernels, and every catalog variant's `loop_work_flops`)
    knows the loop of every default variant, and names the tile its description does."""
    variants = default_variants(compute_capability, head_dims=(64, 128, 256))
    for variant in variants:
        tile, flops = launched_loop_work(variant.kernel.__name__, variant.constexprs)
        assert flops == variant.loop_work_flops > 0, variant.name
        assert f" {tile}" in variant.description, (variant.name, tile)
    assert {v.kernel.__name__ for v in variants} >= {
        *(k.__name__ for k in (*ATTENTION_KERNELS.values(), *BLOCK_SPARSE_KERNELS.values())),
        "gmm_kernel", "tgmm_kernel",
    }  # fmt: skip
    assert launched_loop_work(attention_backward_row_stats_kernel.__name__, {}) is None


def test_head_major_dkdv_is_listed_without_descriptor_twins():
    """At d=256 on sm_90 the report lists dK/dV's head-major default (and persistent, and
    with dQ by atomics) but no twin of it by descriptors, which spills in its loop at
    every tile tried (a flagged row would fail `bench report --head-dim 256`); at d=128
    the descriptor twins stay."""
    names = [v.name for v in default_variants(90, head_dims=(256,))]
    assert {"attention_backward_dkdv_head_major", "attention_backward_dkdv_persistent_head_major",
            "attention_backward_dkdv_head_major_dq_atomic"} <= set(names)  # fmt: skip
    assert not any(name.startswith("attention_backward_dkdv_tma") for name in names)
    assert "attention_backward_dq_tma" in names
    names = [v.name for v in default_variants(90, head_dims=(128,))]
    assert {"attention_backward_dkdv_tma", "attention_backward_dkdv_tma_host"} <= set(names)
