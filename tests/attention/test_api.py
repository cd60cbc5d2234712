"""Tests for `varlen_attention` (XLA and Triton paths), its custom_vjp and `flash_attention`.

Oracles: the dense `dense_attention` (tests/attention_reference.py) for the packed
layout, and `jax.nn.dot_product_attention` with a dense segment mask for the padded one.
Every case draws fresh random inputs from its own seed. Shapes stay small (a few hundred
tokens) but span several 128-row tiles so that tiles straddle sequence boundaries; one
test drives the XLA implementation with 16-row blocks to exercise many blocks per tile.

Tolerances are the issue's, for outputs and gradients alike: float32 1e-5 and float16
2e-3, relative to each array's scale (`assert_close`). Both implementations multiply
float32 exactly by default (XLA: Precision.HIGHEST; Triton: "ieee" dots), so no test
needs a TF32 allowance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.extend import core as jax_core

from jax_bridge.attention.api import varlen_attention
from jax_bridge.attention.padded import flash_attention, segment_ids_to_cu_seqlens
from jax_bridge.attention.reference import allowed_mask, dense_attention
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.attention.xla import attention_backward_xla, attention_forward_xla

# Per-sequence (len_q, len_k): empty sequences on either side and both, length 1, q
# longer than k (under causal its first rows see nothing), k longer than q.
LENGTHS = [(37, 37), (0, 4), (1, 1), (90, 60), (5, 0), (0, 0), (64, 100), (3, 9)]


def cu_seqlens(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_inputs(seed, lengths, num_q_heads, num_kv_heads, head_dim, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    cu_q = cu_seqlens([lq for lq, _ in lengths])
    cu_k = cu_seqlens([lk for _, lk in lengths])

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    q = draw(cu_q[-1], num_q_heads, head_dim)
    k = draw(cu_k[-1], num_kv_heads, head_dim)
    v = draw(cu_k[-1], num_kv_heads, head_dim)
    sinks = jnp.asarray(rng.normal(0.0, 1.0, num_q_heads), jnp.float32)
    slopes = jnp.asarray(rng.uniform(0.01, 0.3, num_q_heads), jnp.float32)
    return rng, q, k, v, cu_q, cu_k, sinks, slopes


def assert_close(actual, expected, tol, name=""):
    """Elementwise |a - e| <= tol * (|e| + max|e|): relative to the array's scale."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, name
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    scale = float(np.max(np.abs(expected), initial=0.0)) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=name)


def assert_grads_close(grads, ref_grads, tol):
    """(dq, dk, dv[, d_sinks]) against the oracle's gradients."""
    assert len(grads) == len(ref_grads)
    for name, g, ref in zip(("dq", "dk", "dv", "d_sinks"), grads, ref_grads, strict=False):
        assert g.dtype == ref.dtype or name == "d_sinks", name
        assert_close(g, ref, tol, name)


def assert_lse_close(actual, expected, tol):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert_close(actual[finite], expected[finite], tol, "lse")


# Each case: (num_q_heads, num_kv_heads, head_dim, options, sinks, alibi, lse in loss).
CASES = {
    "plain": (4, 4, 64, {}, False, False, False),
    "mqa_causal": (4, 1, 64, {"causal": True}, False, False, True),
    "gqa4_d80_causal_window_sinks": (
        8,
        2,
        80,
        {"causal": True, "sliding_window": (16, None)},
        True,
        False,
        False,
    ),
    "gqa2_d96_window_softcap_alibi": (
        4,
        2,
        96,
        {"sliding_window": (8, 3), "logits_soft_cap": 5.0},
        False,
        True,
        True,
    ),
    "everything": (
        4,
        4,
        64,
        {"causal": True, "sliding_window": (20, None), "logits_soft_cap": 4.0},
        True,
        True,
        True,
    ),
    "right_window_only_sinks_scale": (
        2,
        1,
        64,
        {"sliding_window": (None, 0), "softmax_scale": 0.3},
        True,
        False,
        True,
    ),
    "diagonal_only": (4, 2, 64, {"sliding_window": (0, 0)}, False, False, False),
}


def _spec(head_dim, options):
    return AttentionSpec.create(head_dim, **options)


def _loss_and_grads(attention, q, k, v, sinks, d_out, d_lse, use_lse):
    """(out, lse, grads) of sum(out * d_out) [+ sum(finite lse * d_lse)] via one jit."""

    def loss(q, k, v, sinks):
        out, lse = attention(q, k, v, sinks)
        value = jnp.sum(out.astype(jnp.float32) * d_out)
        if use_lse:
            value += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return value, (out, lse)

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    return out, lse, grads


@pytest.mark.parametrize("case", list(CASES))
def test_xla_forward_and_gradients_match_reference(case):
    num_q_heads, num_kv_heads, head_dim, options, use_sinks, use_alibi, use_lse = CASES[case]
    seed = list(CASES).index(case)
    rng, q, k, v, cu_q, cu_k, sinks, slopes = make_inputs(
        seed, LENGTHS, num_q_heads, num_kv_heads, head_dim
    )
    sinks = sinks if use_sinks else None
    slopes = slopes if use_alibi else None
    spec = _spec(head_dim, options)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((num_q_heads, q.shape[0])), jnp.float32)

    def ours(q, k, v, s):
        return varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            sinks=s,
            alibi_slopes=slopes,
            return_lse=True,
            implementation="xla",
            **options,
        )

    def dense(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec, s, slopes)

    out, lse, grads = _loss_and_grads(ours, q, k, v, sinks, d_out, d_lse, use_lse)
    ref_out, ref_lse, ref_grads = _loss_and_grads(dense, q, k, v, sinks, d_out, d_lse, use_lse)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, ref_out, 1e-5, "out")
    assert_lse_close(lse, ref_lse, 1e-5)
    assert_grads_close(grads, ref_grads, 1e-5)


# float16 to 2e-3 as the issue asks (bfloat16: two ulps of its 8-bit mantissa). Gradients
# meet the same bound: they accumulate in float32 and are rounded to the input dtype once;
# the oracle sees the same rounded inputs. (Observed: at most ~0.16 of the bound.)
@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 2e-3), (jnp.bfloat16, 1.6e-2)])
def test_xla_half_precision(dtype, tol):
    rng, q, k, v, cu_q, cu_k, sinks, _ = make_inputs(11, LENGTHS, 4, 2, 64, dtype)
    options = {"causal": True, "sliding_window": (32, None)}
    spec = _spec(64, options)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def ours(q, k, v, s):
        return varlen_attention(
            q, k, v, cu_q, cu_k, sinks=s, return_lse=True, implementation="xla", **options
        )

    def dense(q, k, v, s):  # the oracle sees the same rounded inputs, upcast
        up = lambda x: x.astype(jnp.float32)
        return dense_attention(up(q), up(k), up(v), cu_q, cu_k, spec, s)

    out, lse, grads = _loss_and_grads(ours, q, k, v, sinks, d_out, None, False)
    ref_out, ref_lse, ref_grads = _loss_and_grads(dense, q, k, v, sinks, d_out, None, False)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads[:3])
    assert_close(out, ref_out, tol, "out")
    assert_lse_close(lse, ref_lse, 1e-3)
    assert_grads_close(grads, ref_grads, tol)


def test_xla_small_blocks_many_blocks_per_tile():
    """16-row blocks: tiles straddle several sequences and walk several key blocks."""
    rng, q, k, v, cu_q, cu_k, sinks, slopes = make_inputs(21, LENGTHS, 4, 2, 32)
    spec = _spec(32, {"causal": True, "sliding_window": (24, None), "logits_soft_cap": 3.0})
    blocks = {"block_q": 16, "block_k": 16}
    out, lse = jax.jit(functools.partial(attention_forward_xla, spec=spec, **blocks))(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), sinks=sinks, alibi_slopes=slopes
    )
    ref_out, ref_lse = jax.jit(
        lambda q, k, v: dense_attention(q, k, v, cu_q, cu_k, spec, sinks, slopes)
    )(q, k, v)
    assert_close(out, ref_out, 1e-5, "out")
    assert_lse_close(lse, ref_lse, 1e-5)

    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
    grads = jax.jit(functools.partial(attention_backward_xla, spec=spec, **blocks))(
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

    def loss(q, k, v, s):
        o, l = dense_attention(q, k, v, cu_q, cu_k, spec, s, slopes)
        return jnp.sum(o * d_out) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * d_lse)

    ref_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    assert_grads_close(grads, ref_grads, 1e-5)


def _all_shapes(jaxpr):
    """Shapes of every value a jaxpr computes, nested jaxprs (loops, jit, vjp) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield getattr(var.aval, "shape", ())
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
                if isinstance(inner, jax_core.Jaxpr):
                    yield from _all_shapes(inner)


def test_xla_memory_is_linear_in_tokens():
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


@pytest.mark.parametrize("sinks_kind", [None, "finite", "minus_inf"])
def test_fully_masked_rows(sinks_kind):
    """Causal with len_q > len_k, an empty key side and trailing padding rows: output 0,
    lse -inf (the sink's logit with sinks; a sink of -inf joins nothing, so -inf again),
    and finite gradients equal to the oracle's everywhere."""
    lengths = [(6, 2), (3, 0), (4, 4)]
    rng, q, k, v, cu_q, cu_k, sinks, _ = make_inputs(3, lengths, 2, 1, 32)
    # Three trailing query rows past cu_seqlens_q[-1] (padding) and two key rows.
    q = jnp.concatenate([q, jnp.ones((3, 2, 32))])
    k = jnp.concatenate([k, jnp.ones((2, 1, 32))])
    v = jnp.concatenate([v, jnp.ones((2, 1, 32))])
    sinks = {None: None, "finite": sinks, "minus_inf": sinks.at[0].set(-jnp.inf)}[sinks_kind]
    spec = _spec(32, {"causal": True})
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((2, q.shape[0])), jnp.float32)

    def ours(q, k, v, s):
        return varlen_attention(
            q, k, v, cu_q, cu_k, causal=True, sinks=s, return_lse=True, implementation="xla"
        )

    def dense(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec, s)

    out, lse, grads = _loss_and_grads(ours, q, k, v, sinks, d_out, d_lse, True)
    masked = np.zeros(q.shape[0], bool)
    masked[[0, 1, 2, 3, 6, 7, 8, 13, 14, 15]] = True  # 6 - 2 unseen; empty keys; padding
    np.testing.assert_array_equal(np.asarray(out)[masked], 0.0)
    assert np.all(np.abs(np.asarray(out)[~masked]).sum(-1) > 0)
    expected = -np.inf if sinks is None else np.asarray(sinks)[:, None]
    np.testing.assert_array_equal(np.asarray(lse)[:, masked], np.broadcast_to(expected, (2, 10)))
    assert np.all(np.isfinite(np.asarray(lse)[:, ~masked]))
    np.testing.assert_array_equal(np.asarray(grads[0])[masked], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1])[-2:], 0.0)  # padding keys
    if sinks_kind == "minus_inf":
        assert float(grads[3][0]) == 0.0

    ref_out, ref_lse, ref_grads = _loss_and_grads(dense, q, k, v, sinks, d_out, d_lse, True)
    assert_close(out, ref_out, 1e-5, "out")
    assert_lse_close(lse, ref_lse, 1e-5)
    assert_grads_close(grads, ref_grads, 1e-5)  # also checks that they are finite


def test_alibi_distance_is_exact_past_float32_integers():
    """Packed indices above 2^24 (not all representable in float32): |diag - j| is taken
    in int32, so neighbouring keys differ by exactly one slope."""
    from jax_bridge.attention.xla import _Rows, _scores

    base = 2**24 + 1  # odd: float32(base) would round to 2^24
    keys = base + jnp.arange(8, dtype=jnp.int32)
    rows = _Rows(
        lo=jnp.zeros((2,), jnp.int32),
        hi=jnp.full((2,), 2**30, jnp.int32),
        diag=jnp.array([base, base + 2], jnp.int32),
    )
    zeros_q, zeros_k = jnp.zeros((1, 2, 16)), jnp.zeros((1, 8, 16))
    s, _, _ = _scores(zeros_q, zeros_k, rows, keys, AttentionSpec(1.0), jnp.ones((1,)))
    expected = -np.abs(np.array([[0], [2]]) - np.arange(8)[None, :]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(s[0]), expected)


def test_max_seqlen_hints_are_validated_but_unused():
    _, q, k, v, cu_q, cu_k, _, _ = make_inputs(8, LENGTHS[:4], 2, 2, 32)
    plain = varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
    for hint in (90, 1000):
        hinted = varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_seqlen_q=hint,
            max_seqlen_k=hint,
            causal=True,
            implementation="xla",
        )
        np.testing.assert_array_equal(np.asarray(hinted), np.asarray(plain))


def test_vmap_over_a_batch_with_xla():
    """vmap works with the XLA implementation (not with Triton on a GPU: no batching rule)."""
    _, q, k, v, cu_q, cu_k, _, _ = make_inputs(9, LENGTHS[:4], 2, 1, 32)
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    fn = lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
    batched = jax.vmap(fn)(qs, ks, vs)
    for b in range(2):
        assert_close(batched[b], fn(qs[b], ks[b], vs[b]), 1e-6, f"batch {b}")


def test_jit_with_traced_cu_seqlens_matches_reference():
    _, q, k, v, cu_q, cu_k, sinks, _ = make_inputs(5, LENGTHS, 4, 2, 64)
    fn = jax.jit(
        lambda q, k, v, a, b, s: varlen_attention(
            q, k, v, a, b, causal=True, sinks=s, return_lse=True, implementation="xla"
        )
    )
    spec = _spec(64, {"causal": True})
    # A second layout with the same shapes runs the same compiled function.
    # It leaves 3 query and 4 key rows past cu_seqlens[-1]: padding, attending nothing.
    other = [(50, 40), (140, 10), (0, 150), (7, 7)]
    other_q, other_k = cu_seqlens([a for a, _ in other]), cu_seqlens([b for _, b in other])
    other_q = np.concatenate([other_q, np.full(4, other_q[-1], np.int32)])
    other_k = np.concatenate([other_k, np.full(4, other_k[-1], np.int32)])
    for a, b in ((cu_q, cu_k), (other_q, other_k)):
        out, lse = fn(q, k, v, jnp.asarray(a), jnp.asarray(b), sinks)
        # The oracle gives padding rows (past a[-1]) output 0 and lse = the sink.
        ref_out, ref_lse = dense_attention(q, k, v, a, b, spec, sinks)
        assert_close(out, ref_out, 1e-5, "out")
        assert_lse_close(lse, ref_lse, 1e-5)
        np.testing.assert_array_equal(np.asarray(out[a[-1] :]), 0.0)
    assert fn._cache_size() == 1


def test_gradient_wiring_cu_seqlens_and_alibi():
    """cu_seqlens get float0 cotangents, ALiBi slopes a zero gradient."""
    _, q, k, v, cu_q, cu_k, _, slopes = make_inputs(6, LENGTHS[:4], 2, 2, 32)
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)

    def loss(q, cu_q, slopes):
        out = varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes, implementation="xla")
        return jnp.sum(out**2)

    dq, d_cu, d_slopes = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)(q, cu_q, slopes)
    assert d_cu.dtype == jax.dtypes.float0 and d_cu.shape == cu_q.shape
    np.testing.assert_array_equal(np.asarray(d_slopes), 0.0)
    assert float(jnp.max(jnp.abs(dq))) > 0


def test_empty_token_axes():
    q = jnp.zeros((0, 2, 32))
    k = v = jnp.ones((5, 2, 32))
    cu = jnp.zeros((3,), jnp.int32)
    out, lse = varlen_attention(q, k, v, cu, jnp.array([0, 2, 5], jnp.int32), return_lse=True)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)
    q = jnp.ones((4, 2, 32))
    out, lse = varlen_attention(
        q, k[:0], v[:0], jnp.array([0, 4], jnp.int32), cu[:2], return_lse=True
    )
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))


def test_auto_runs_xla_on_cpu():
    _, q, k, v, cu_q, cu_k, _, _ = make_inputs(7, LENGTHS[:3], 2, 2, 32)
    auto = varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    xla = varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))


# ------------------------------------------------------------------------------- errors

_Q = jnp.zeros((6, 4, 32))
_KV = jnp.zeros((5, 2, 32))
_CU_Q = jnp.array([0, 2, 6], jnp.int32)
_CU_K = jnp.array([0, 3, 5], jnp.int32)

BAD_CALLS = {
    # name: (overrides, exception, text the message must contain)
    "heads_not_divisible": (
        {"k": jnp.zeros((5, 3, 32)), "v": jnp.zeros((5, 3, 32))},
        ValueError,
        "num_kv_heads",
    ),
    "head_dim_mismatch": (
        {"k": jnp.zeros((5, 2, 64)), "v": jnp.zeros((5, 2, 64))},
        ValueError,
        "head_dim",
    ),
    "kv_shape_mismatch": ({"v": jnp.zeros((4, 2, 32))}, ValueError, "v must have the shape of k"),
    "q_rank": ({"q": jnp.zeros((6, 128))}, ValueError, "q must have shape"),
    "int_q": ({"q": jnp.zeros((6, 4, 32), jnp.int32)}, TypeError, "q must be float16"),
    "float64_v": ({"v": np.zeros((5, 2, 32), np.float64)}, TypeError, "v must be float16"),
    "mixed_dtypes": ({"k": jnp.zeros((5, 2, 32), jnp.bfloat16)}, TypeError, "k is bfloat16"),
    "head_dim_too_large": (
        {"q": jnp.zeros((6, 4, 264)), "k": jnp.zeros((5, 2, 264)), "v": jnp.zeros((5, 2, 264))},
        ValueError,
        "head_dim must be in [16, 256]",
    ),
    "head_dim_too_small": (
        {"q": jnp.zeros((6, 4, 8)), "k": jnp.zeros((5, 2, 8)), "v": jnp.zeros((5, 2, 8))},
        ValueError,
        "head_dim must be in",
    ),
    "cu_int64": (
        {"cu_seqlens_q": np.array([0, 2, 6], np.int64)},
        TypeError,
        "cu_seqlens_q must be int32",
    ),
    "cu_float": ({"cu_seqlens_k": jnp.array([0.0, 3, 5])}, TypeError, "cu_seqlens_k must be int32"),
    "cu_rank": (
        {"cu_seqlens_q": jnp.zeros((1, 3), jnp.int32)},
        ValueError,
        "cu_seqlens_q must have shape",
    ),
    "cu_batch_mismatch": ({"cu_seqlens_k": jnp.array([0, 5], jnp.int32)}, ValueError, "same batch"),
    "cu_decreasing": (
        {"cu_seqlens_k": jnp.array([0, 4, 3], jnp.int32)},
        ValueError,
        "cu_seqlens_k must be non-decreasing",
    ),
    "cu_nonzero_start": (
        {"cu_seqlens_q": jnp.array([1, 2, 6], jnp.int32)},
        ValueError,
        "cu_seqlens_q must start at 0",
    ),
    "cu_too_long": (
        {"cu_seqlens_q": jnp.array([0, 2, 7], jnp.int32)},
        ValueError,
        "cu_seqlens_q[-1]",
    ),
    "sinks_shape": ({"sinks": jnp.zeros((2,))}, ValueError, "sinks must have shape"),
    "sinks_int": ({"sinks": jnp.zeros((4,), jnp.int32)}, TypeError, "sinks must have a float"),
    "alibi_shape": (
        {"alibi_slopes": jnp.zeros((4, 1))},
        ValueError,
        "alibi_slopes must have shape",
    ),
    "window_length": ({"sliding_window": (1, 2, 3)}, ValueError, "sliding_window"),
    "window_negative": ({"sliding_window": (-1, None)}, ValueError, "sliding_window"),
    "window_float": ({"sliding_window": (2.5, None)}, ValueError, "sliding_window"),
    "window_scalar": ({"sliding_window": 4}, ValueError, "sliding_window"),
    "soft_cap": ({"logits_soft_cap": 0.0}, ValueError, "logits_soft_cap"),
    "soft_cap_inf": ({"logits_soft_cap": float("inf")}, ValueError, "logits_soft_cap"),
    "softmax_scale": ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    "max_seqlen_small": ({"max_seqlen_q": 3}, ValueError, "max_seqlen_q=3"),
    "max_seqlen_type": ({"max_seqlen_k": 2.0}, TypeError, "max_seqlen_k"),
    "implementation": ({"implementation": "cuda"}, ValueError, "implementation"),
    "pallas_on_cpu": ({"implementation": "pallas"}, ValueError, "implementation"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_naming_them(name):
    overrides, error, text = BAD_CALLS[name]
    args = {"q": _Q, "k": _KV, "v": _KV, "cu_seqlens_q": _CU_Q, "cu_seqlens_k": _CU_K}
    args.update(overrides)
    positional = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    with pytest.raises(error) as info:
        varlen_attention(*positional, **args)
    assert text in str(info.value)


def test_traced_bad_cu_seqlens_is_a_checkify_error():
    fn = checkify.checkify(
        lambda cu: varlen_attention(_Q, _KV, _KV, cu, _CU_K, implementation="xla"),
        errors=checkify.user_checks,
    )
    err, _ = jax.jit(fn)(jnp.array([0, 4, 3], jnp.int32))
    assert "cu_seqlens_q must be non-decreasing" in str(err.get())
    err, _ = jax.jit(fn)(_CU_Q)
    assert err.get() is None


# ------------------------------------------------------------------------ flash_attention


def _dense_segment_attention(q, k, v, q_ids, kv_ids, causal=False, **kwargs):
    """jax.nn.dot_product_attention with the equivalent dense mask; padding rows -> 0.

    `causal` builds the per-document mask with bottom-right alignment: the document's
    query t (of n) may see its key u (of m) when u <= t + m - n.
    """
    mask = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] > 0)
    if causal:

        def rank_and_count(ids):  # position within the document and document length
            same = ids[:, :, None] == ids[:, None, :]
            before = np.tril(np.ones((ids.shape[1],) * 2, bool), -1)
            return (same & before).sum(-1), same.sum(-1)

        qt, qn = rank_and_count(q_ids)
        ku, km = rank_and_count(kv_ids)
        mask &= ku[:, None, :] <= qt[:, :, None] + km[:, None, :] - qn[:, :, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)[:, None], **kwargs)
    return jnp.where(jnp.asarray(mask.any(-1))[:, :, None, None], out, 0.0)


def _padded_inputs(seed, batch, q_seq, kv_seq, num_q_heads, num_kv_heads, head_dim=32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, q_seq, num_q_heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv_seq, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, kv_seq, num_kv_heads, head_dim)), jnp.float32)
    return rng, q, k, v


def test_flash_attention_without_segment_ids():
    _, q, k, v = _padded_inputs(0, 2, 40, 40, 4, 2)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_close(flash_attention(q, k, v, causal=True, implementation="xla"), ref, 1e-5)
    ref = jax.nn.dot_product_attention(q, k, v, scale=0.2)
    assert_close(flash_attention(q, k, v, softmax_scale=0.2, implementation="xla"), ref, 1e-5)


SELF_IDS = np.array(
    [[1] * 9 + [2] * 20 + [3] + [0] * 10, [5] * 13 + [0] * 4 + [6] * 22 + [7]], np.int32
)


def _value_and_grads(fn, q, k, v, d_out):
    """fn(q, k, v) and the gradients of sum(fn * d_out), in one compiled call."""

    def run(q, k, v):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(d_out)

    return jax.jit(run)(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_segment_ids_with_padding(causal):
    """Forward and gradients (through the packed custom_vjp) vs the dense masked call."""
    rng, q, k, v = _padded_inputs(1, 2, 40, 40, 4, 1)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    out, grads = _value_and_grads(
        lambda q, k, v: flash_attention(
            q, k, v, q_segment_ids=SELF_IDS, causal=causal, implementation="xla"
        ),
        q,
        k,
        v,
        d_out,
    )
    ref, ref_grads = _value_and_grads(
        lambda q, k, v: _dense_segment_attention(q, k, v, SELF_IDS, SELF_IDS, causal),
        q,
        k,
        v,
        d_out,
    )
    assert_close(out, ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(out)[SELF_IDS <= 0], 0.0)
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_cross_segment_ids(causal):
    """Different q and kv ids/lengths: padding on both sides, a document only on the kv
    side (id 9), one only on the q side (id 4: its queries see nothing)."""
    q_ids = np.array(
        [[1] * 5 + [2] * 10 + [0] * 9, [3] * 7 + [0] * 3 + [4] * 4 + [8] * 10], np.int32
    )
    kv_ids = np.array(
        [[0] * 2 + [1] * 8 + [9] * 3 + [2] * 11 + [0] * 6, [3] * 3 + [5] * 10 + [8] * 17], np.int32
    )
    _, q, k, v = _padded_inputs(2, 2, 24, 30, 2, 2)
    out = flash_attention(
        q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=causal, implementation="xla"
    )
    ref = _dense_segment_attention(q, k, v, q_ids, kv_ids, causal=causal)
    assert_close(out, ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(out)[1, 10:14], 0.0)  # id 4 has no keys


def test_flash_attention_matches_reference_with_every_option():
    """The padded wrapper and the packed oracle agree with sinks, ALiBi, windows, cap."""
    _, q, k, v = _padded_inputs(3, 2, 40, 40, 4, 2)
    rng = np.random.default_rng(3)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    slopes = jnp.asarray(rng.uniform(0.0, 0.2, 4), jnp.float32)
    options = {"causal": True, "sliding_window": (6, None), "logits_soft_cap": 3.0}
    out = flash_attention(
        q,
        k,
        v,
        q_segment_ids=SELF_IDS,
        sinks=sinks,
        alibi_slopes=slopes,
        implementation="xla",
        **options,
    )
    # The same documents packed by hand: each row's runs, padding runs as their own
    # (key-less) sequences.
    lengths = [(9, 9), (20, 20), (1, 1), (10, 0), (13, 13), (4, 0), (22, 22), (1, 1)]
    kv_order = np.concatenate([np.arange(30), np.arange(40, 53), np.arange(57, 80)])
    flat = lambda x: x.reshape(80, *x.shape[2:])
    ref, _ = dense_attention(
        flat(q),
        flat(k)[kv_order],
        flat(v)[kv_order],
        cu_seqlens([a for a, _ in lengths]),
        cu_seqlens([b for _, b in lengths]),
        _spec(32, options),
        sinks,
        slopes,
    )
    assert_close(out, ref.reshape(q.shape), 1e-5)


def test_flash_attention_rejects_non_contiguous_ids():
    _, q, k, v = _padded_inputs(4, 1, 8, 8, 2, 2)
    ids = np.array([[1, 1, 2, 2, 1, 1, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="q_segment_ids must hold each document as one"):
        flash_attention(q, k, v, q_segment_ids=ids)
    with pytest.raises(ValueError, match="kv_segment_ids must hold each document as one"):
        flash_attention(q, k, v, q_segment_ids=np.ones((1, 8), np.int32), kv_segment_ids=ids)
    with pytest.raises(ValueError, match="same order"):
        flash_attention(
            q,
            k,
            v,
            q_segment_ids=np.array([[1] * 4 + [2] * 4]),
            kv_segment_ids=np.array([[2] * 4 + [1] * 4]),
        )
    # Traced ids: the same check surfaces through checkify.
    fn = checkify.checkify(
        lambda ids: flash_attention(q, k, v, q_segment_ids=ids, implementation="xla"),
        errors=checkify.user_checks,
    )
    err, _ = jax.jit(fn)(jnp.asarray(ids))
    assert "contiguous run" in str(err.get())


def test_flash_attention_bad_arguments():
    _, q, k, v = _padded_inputs(5, 2, 8, 6, 2, 2)
    with pytest.raises(ValueError, match="kv_segment_ids is required"):
        flash_attention(q, k, v, q_segment_ids=np.ones((2, 8), np.int32))
    with pytest.raises(ValueError, match="q_segment_ids must have shape"):
        flash_attention(
            q,
            k,
            v,
            q_segment_ids=np.ones((2, 7), np.int32),
            kv_segment_ids=np.ones((2, 6), np.int32),
        )
    with pytest.raises(TypeError, match="kv_segment_ids must hold integer"):
        flash_attention(
            q, k, v, q_segment_ids=np.ones((2, 8), np.int32), kv_segment_ids=np.ones((2, 6))
        )
    with pytest.raises(ValueError, match="without q_segment_ids"):
        flash_attention(q, k, v, kv_segment_ids=np.ones((2, 6), np.int32))
    with pytest.raises(ValueError, match="k must have shape"):
        flash_attention(q, k[0], v)


def _contiguous_ids(draw, length):
    """Random documents as contiguous runs (ids increasing) with padding runs between."""
    ids, next_id = [], 1
    while len(ids) < length:
        run = draw(st.integers(1, length))
        if draw(st.booleans()):
            ids += [next_id] * run
            next_id += 1
        else:
            ids += [draw(st.integers(-1, 0))] * run
    return ids[:length]


@st.composite
def _segment_id_pairs(draw):
    """(q_ids [2, 12], kv_ids [2, 10]): kv reuses a random subset of the q documents in
    order, with random lengths, plus documents of its own."""
    q_rows, kv_rows = [], []
    for _ in range(2):
        q_row = _contiguous_ids(draw, 12)
        docs = sorted({i for i in q_row if i > 0} | set(draw(st.sets(st.integers(20, 25)))))
        kv_row = []
        for doc in docs:
            if draw(st.booleans()):
                kv_row += [doc] * draw(st.integers(1, 4)) + [0] * draw(st.integers(0, 1))
        kv_rows.append((kv_row + [0] * 10)[:10])
        q_rows.append(q_row)
    return np.array(q_rows, np.int32), np.array(kv_rows, np.int32)


@functools.cache
def _jitted_cu_seqlens():
    return jax.jit(segment_ids_to_cu_seqlens)


@given(_segment_id_pairs())
def test_segment_ids_to_cu_seqlens_reproduces_the_segment_mask(ids):
    """Sequences built from segment ids allow exactly the pairs the segment mask allows."""
    q_ids, kv_ids = ids
    cu_q, cu_k = _jitted_cu_seqlens()(q_ids, kv_ids)
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    assert cu_q.shape == cu_k.shape == (2 * (2 * 12 + 1) + 1,)
    assert cu_q[-1] == 24 and cu_k[-1] == 20
    assert np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= 0)
    allowed = allowed_mask(cu_q, cu_k, 24, 20, AttentionSpec(1.0))
    expected = np.zeros((24, 20), bool)
    for b in range(2):
        block = (q_ids[b][:, None] == kv_ids[b][None, :]) & (q_ids[b][:, None] > 0)
        expected[b * 12 : (b + 1) * 12, b * 10 : (b + 1) * 10] = block
    np.testing.assert_array_equal(allowed, expected)


# --------------------------------------------------------------------------- triton path
# Through Triton's interpreter on CPU: slow, so few and small cases.


@pytest.fixture(scope="module")
def triton_available():
    pytest.importorskip("jax_bridge.attention.triton")


TRITON_LENGTHS = [(20, 20), (0, 3), (9, 5), (1, 1), (13, 30)]


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"sliding_window": (6, 2), "logits_soft_cap": 3.0},
    ],
    ids=["causal", "window_softcap"],
)
def test_triton_forward_and_gradients_match_reference(triton_available, options):
    rng, q, k, v, cu_q, cu_k, sinks, slopes = make_inputs(30, TRITON_LENGTHS, 4, 2, 32)
    spec = _spec(32, options)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def ours(q, k, v, s):
        return varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            sinks=s,
            alibi_slopes=slopes,
            return_lse=True,
            implementation="triton",
            **options,
        )

    def dense(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec, s, slopes)

    out, lse, grads = _loss_and_grads(ours, q, k, v, sinks, d_out, None, False)
    ref_out, ref_lse, ref_grads = _loss_and_grads(dense, q, k, v, sinks, d_out, None, False)
    assert_close(out, ref_out, 1e-5, "out")
    assert_lse_close(lse, ref_lse, 1e-5)
    assert_grads_close(grads, ref_grads, 1e-5)


def test_triton_lse_cotangent_uses_xla_backward(triton_available):
    """A loss on lse still differentiates correctly with implementation="triton"."""
    rng, q, k, v, cu_q, cu_k, _, _ = make_inputs(31, TRITON_LENGTHS, 2, 1, 32)
    spec = _spec(32, {"causal": True})
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    d_lse = jnp.asarray(rng.standard_normal((2, q.shape[0])), jnp.float32)

    def ours(q, k, v, s):
        return varlen_attention(
            q, k, v, cu_q, cu_k, causal=True, return_lse=True, implementation="triton"
        )

    def dense(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec)

    _, _, grads = _loss_and_grads(ours, q, k, v, None, d_out, d_lse, True)
    _, _, ref_grads = _loss_and_grads(dense, q, k, v, None, d_out, d_lse, True)
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 2e-3), (jnp.bfloat16, 1.6e-2)])
def test_triton_half_precision_flash_attention(triton_available, dtype, tol):
    _, q, k, v = _padded_inputs(32, 2, 40, 40, 2, 1)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out = flash_attention(q, k, v, q_segment_ids=SELF_IDS, causal=True, implementation="triton")
    up = lambda x: x.astype(jnp.float32)
    ref = _dense_segment_attention(up(q), up(k), up(v), SELF_IDS, SELF_IDS, causal=True)
    assert out.dtype == dtype
    assert_close(out, ref, tol)
