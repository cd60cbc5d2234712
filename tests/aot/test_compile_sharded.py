"""Multi-device programs compiled for 4-device meshes of each target: ring attention with
each local kernel the target has, and the expert-parallel MoE block in both dispatch
modes, forward and backward, in bfloat16. The collectives must be in the program."""

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import (
    MoEParams,
    expert_parallel_moe_feed_forward,
    ring_attention,
    target_mesh,
)
from tests.aot.helpers import SUITE_TARGETS, backends_of, compile_checked, needs_libtpu, spec

DEVICES = 4
targets = pytest.mark.parametrize(
    "target",
    [pytest.param(t, marks=needs_libtpu if t.startswith("tpu") else ()) for t in SUITE_TARGETS],
)


@targets
def test_ring_attention_compiles_with_each_local_kernel(target):
    mesh = target_mesh(target, {"context": DEVICES})
    batch, seq, heads, head_dim = 1, 2048, 4, 128

    for implementation in backends_of(target):
        # The Pallas kernels take no sliding window inside the ring (documented).
        window = None if implementation == "pallas" else (512, 0)

        def program(q, k, v, segment_ids, sinks, implementation=implementation, window=window):
            def loss(q, k, v, sinks):
                out = ring_attention(
                    q,
                    k,
                    v,
                    mesh=mesh,
                    axis_name="context",
                    segment_ids=segment_ids,
                    causal=True,
                    sliding_window=window,
                    sinks=sinks,
                    implementation=implementation,
                )
                return jnp.sum(out.astype(jnp.float32))

            return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

        qkv = spec((batch, seq, heads, head_dim), jnp.bfloat16)
        report = compile_checked(
            program,
            qkv,
            qkv,
            qkv,
            spec((batch, seq), jnp.int32),
            spec((heads,), jnp.float32),
            target=target,
            implementation=implementation,
            mesh=mesh,
            min_kernels=2,
        )
        assert report.devices == DEVICES
        assert report.collectives.get("collective-permute", 0) > 0, report.collectives


@targets
@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
def test_expert_parallel_moe_compiles(target, dispatch):
    mesh = target_mesh(target, {"expert": DEVICES})
    tokens, hidden, ffn, experts = 1024, 256, 512, 8

    for implementation in backends_of(target, ("xla", "triton")):

        def program(x, params, implementation=implementation):
            def loss(x, params):
                out = expert_parallel_moe_feed_forward(
                    x,
                    params,
                    mesh=mesh,
                    axis_name="expert",
                    top_k=2,
                    dispatch=dispatch,
                    implementation=implementation,
                )
                return jnp.sum(out.astype(jnp.float32))

            return jax.grad(loss, argnums=(0, 1))(x, params)

        params = MoEParams(
            router=spec((hidden, experts), jnp.bfloat16),
            w_up=spec((experts, hidden, ffn), jnp.bfloat16),
            w_down=spec((experts, ffn, hidden), jnp.bfloat16),
        )
        report = compile_checked(
            program,
            spec((tokens, hidden), jnp.bfloat16),
            params,
            target=target,
            implementation=implementation,
            mesh=mesh,
            min_kernels=4,  # gmm up/down forward, and their gradients
        )
        assert report.devices == DEVICES
        kind = "all-to-all" if dispatch == "all_to_all" else "all-reduce"
        assert report.collectives.get(kind, 0) > 0, report.collectives
