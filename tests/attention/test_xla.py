"""What is specific to the blockwise XLA backend (`jax_bridge.attention.xla`).

Against the dense reference (`dense_attention`) and its `jax.grad` in float64: small
blocks (many blocks per tile, tiles straddling sequences) and the default 128-row blocks
over sequences longer than a block; structurally, that no intermediate of forward+backward
grows like total_q * total_k; and that ALiBi distances stay exact past 2^24.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import varlen_attention
from jax_bridge.attention.reference import dense_attention
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.attention.xla import (
    _Rows,
    _scores,
    attention_backward_xla,
    attention_forward_xla,
)
from tests.attention.helpers import (
    assert_close,
    assert_lse_close,
    attention_tolerance,
    make_inputs,
    oracle_value_and_grads,
)
from tests.jaxprs import all_eqns

LENGTHS = [(37, 37), (0, 4), (1, 1), (90, 60), (5, 0), (0, 0), (64, 100), (3, 9)]


@pytest.mark.parametrize("blocks", [(16, 16), (16, 32), (128, 128)], ids=str)
def test_block_sizes_match_reference(blocks):
    """16-row blocks: tiles straddle several sequences and walk several key blocks;
    128-row blocks (the default): sequences longer than a block cross block edges."""
    inputs = make_inputs(21, LENGTHS, 4, 2, 32)
    q, k, v, cu_q, cu_k, sinks, slopes = (
        inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k", "sinks", "slopes")
    )
    spec = AttentionSpec.create(32, causal=True, sliding_window=(24, None), logits_soft_cap=3.0)
    sizes = {"block_q": blocks[0], "block_k": blocks[1]}
    out, lse = jax.jit(functools.partial(attention_forward_xla, spec=spec, **sizes))(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), sinks=sinks, alibi_slopes=slopes
    )
    d_out, d_lse = inputs["d_out"], inputs["d_lse"]
    reference = lambda q, k, v, s: dense_attention(q, k, v, cu_q, cu_k, spec, s, slopes)
    ref_out, ref_lse, ref_grads = oracle_value_and_grads(reference, q, k, v, sinks, d_out, d_lse)
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k, sinks=sinks, slopes=slopes)
    assert_close(out, ref_out, tol, "out")
    assert_lse_close(lse, ref_lse, tol)

    grads = jax.jit(functools.partial(attention_backward_xla, spec=spec, **sizes))(
        q,
        k,
        v,
        out,
        lse,
        d_out,
        jnp.asarray(cu_q),
        jnp.asarray(cu_k),
        sinks=sinks,
        alibi_slopes=slopes,
        d_lse=d_lse,
    )
    for name, grad, ref in zip(("dq", "dk", "dv", "d_sinks"), grads, ref_grads, strict=True):
        assert_close(grad, ref, tol, name)


def _all_shapes(jaxpr):
    """Shapes of every value a jaxpr computes, nested jaxprs (loops, jit, vjp) included."""
    return [getattr(var.aval, "shape", ()) for eqn in all_eqns(jaxpr) for var in eqn.outvars]


def test_memory_is_linear_in_tokens():
    """No intermediate of forward+backward grows like total_q * total_k (traced only)."""
    total = 4096
    q = jax.ShapeDtypeStruct((total, 2, 64), jnp.float32)
    cu = jax.ShapeDtypeStruct((9,), jnp.int32)

    def fwd_bwd(q, k, v, cu):
        out, pullback = jax.vjp(
            lambda q, k, v: varlen_attention(q, k, v, cu, cu, causal=True, implementation="xla"),
            q,
            k,
            v,
        )
        return pullback(out)

    shapes = list(_all_shapes(jax.make_jaxpr(fwd_bwd)(q, q, q, cu).jaxpr))
    assert shapes and max(int(np.prod(shape)) for shape in shapes) <= 4 * total * 64


def test_alibi_distance_is_exact_past_float32_integers():
    """Packed indices above 2^24 (not all representable in float32): |diag - j| is taken
    in int32, so neighbouring keys differ by exactly one slope. q and k are zero: the
    scores are the ALiBi terms alone."""
    base = 2**24 + 1  # odd: float32(base) would round to 2^24
    keys = base + jnp.arange(8, dtype=jnp.int32)
    rows = _Rows(
        lo=jnp.zeros((2,), jnp.int32),
        hi=jnp.full((2,), 2**30, jnp.int32),
        diag=jnp.array([base, base + 2], jnp.int32),
    )
    zeros_q, zeros_k = jnp.zeros((1, 2, 16)), jnp.zeros((1, 8, 16))
    s, _, _ = _scores(
        zeros_q,
        zeros_k,
        rows,
        keys,
        AttentionSpec(1.0),
        jnp.full((1,), 0.75),  # a slope that is not 1: its product must be there too
        jax.lax.Precision.HIGHEST,
    )
    distances = np.abs(np.array([[0], [2]]) - np.arange(8)[None, :])
    expected = (-0.75 * distances).astype(np.float32)  # exact: 0.75 * d fits float32
    np.testing.assert_array_equal(np.asarray(s[0]), expected)
