"""grouped_matmul (gmm) and transposed_grouped_matmul (tgmm) with their gradients,
compiled for H100, A100, TPU v5e and v6e for every backend and dtype the target has."""

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import grouped_matmul, transposed_grouped_matmul
from tests.aot.helpers import backends_of, compile_checked, spec, target_params

ROWS, K, N, GROUPS = 1024, 256, 512, 8


def _program(implementation: str):
    def program(lhs, rhs, group_sizes, grad_out):
        def loss(lhs, rhs):
            out = grouped_matmul(lhs, rhs, group_sizes, implementation=implementation)
            return jnp.sum(out * out)

        # tgmm on its own too: the weight gradient of an MoE layer, [GROUPS, K, N].
        weights = transposed_grouped_matmul(
            lhs.T, grad_out, group_sizes, implementation=implementation
        )
        return jax.grad(loss, argnums=(0, 1))(lhs, rhs), weights

    return program


@pytest.mark.parametrize(("target", "dtype"), target_params())
def test_grouped_matmul_compiles(target, dtype):
    for implementation in backends_of(target, ("xla", "triton")):
        compile_checked(
            _program(implementation),
            spec((ROWS, K), dtype),
            spec((GROUPS, K, N), dtype),
            spec((GROUPS,), jnp.int32),
            spec((ROWS, N), dtype),
            target=target,
            implementation=implementation,
            min_kernels=4,  # gmm forward, its two gradients (gmm, tgmm), tgmm
        )
