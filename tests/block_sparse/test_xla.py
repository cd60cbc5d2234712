"""What is specific to the XLA backend of block-sparse attention (its numbers are the
conformance suite's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import block_sparse_attention
from pallas_tpu.splash import CausalMask, DocumentMask
from tests.jaxprs import all_eqns, all_jaxprs


def _zero_size_values(jaxpr) -> list[str]:
    """Every value of `jaxpr` with no element: its constants and inputs, and every operand
    and result of its equations, nested jaxprs (loops, branches, jit, custom_vjp) included."""
    empty = lambda var: 0 in getattr(var.aval, "shape", ())
    found = [
        str(var.aval)
        for inner in all_jaxprs(jaxpr)
        for var in (*inner.constvars, *inner.invars)
        if empty(var)
    ]
    return found + [
        f"{eqn.primitive}: {var.aval}"
        for eqn in all_eqns(jaxpr)
        for var in (*eqn.invars, *eqn.outvars)
        if empty(var)
    ]


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced-documents"])
def test_a_call_over_every_head_holds_no_zero_size_array(traced):
    """Nothing without elements in the forward and backward programs when one mask
    covers every head: an empty index array (a scatter of `.at[:, :, :]`) is a
    zero-size constant, on which jaxlib 0.11.2's CPU compiler segfaults inside
    `shard_map` (Shardy's canonicalizer)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 48, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 48, 2, 32)), jnp.float32) for _ in "kv")
    cu = np.array([0, 20, 20, 45], np.int32)

    def loss(q, k, v, cu):
        mask = DocumentMask(cu, shape=(48, 48), window=(17, 0)) if traced else CausalMask((48, 48))
        return jnp.sum(block_sparse_attention(q, k, v, mask, implementation="xla") ** 2)

    closed = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v, jnp.asarray(cu))
    consts = [str(np.shape(c)) for c in closed.consts if np.size(c) == 0]
    assert not consts and not _zero_size_values(closed.jaxpr)
