"""The varlen FlashAttention-2 Triton kernels against the dense oracle, on CPU.

Every launch runs through Triton's interpreter (slow), so shapes stay small: a few dozen
tokens per sequence, 16x16 tiles, so that every sequence still spans several query and key
tiles and every loop phase (masked edges, unmasked middle) runs. On this path outputs start
as NaN, so "no NaN in the result" proves every element was written.

The blockwise XLA implementation (`jax_bridge.attention.xla`) has the same signatures; the
tests marked with the `impl` parameter run it too, at the same tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_bridge.attention.reference import dense_attention
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.attention.triton import attention_backward_triton, attention_forward_triton
from jax_bridge.attention.xla import attention_backward_xla, attention_forward_xla
from triton_kernels.flash_attention.config import (
    AttentionKernelConfig,
    default_attention_config,
)

# Relative tolerances (of the largest reference magnitude) for out and for gradients.
TOLERANCES = {
    jnp.float32: (1e-5, 1e-5),
    jnp.float16: (2e-3, 2e-3),
    jnp.bfloat16: (2e-2, 5e-2),
}

# Both implementations behind `jax_bridge.varlen_attention`: (forward, backward).
IMPLEMENTATIONS = {
    "triton": (attention_forward_triton, attention_backward_triton),
    # Jitted: one compile per shape is cheaper than eager dispatch of its many ops.
    "xla": (
        jax.jit(attention_forward_xla, static_argnames="spec"),
        jax.jit(attention_backward_xla, static_argnames="spec"),
    ),
}
both_implementations = pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))

# Sequence lengths with an empty sequence, a length-1 sequence, queries shorter and
# longer than keys, and queries with no keys at all (fully masked rows).
LENS_Q = (37, 0, 1, 20, 5, 18)
LENS_K = (50, 3, 1, 20, 0, 9)


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(lens_q, lens_k, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    total_q, total_k = int(sum(lens_q)), int(sum(lens_k))
    q = jnp.asarray(rng.standard_normal((total_q, num_q_heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((total_k, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((total_k, num_kv_heads, head_dim)), dtype)
    d_out = jnp.asarray(rng.standard_normal((total_q, num_q_heads, head_dim)), dtype)
    sinks = jnp.asarray(rng.standard_normal(num_q_heads), jnp.float32)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, num_q_heads), jnp.float32)
    return q, k, v, d_out, sinks, slopes


def _f32(x):
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32))


def _assert_close(actual, expected, tolerance, name):
    actual, expected = _f32(actual), _f32(expected)
    assert not np.isnan(actual).any(), f"{name}: NaN (an element was never written?)"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(
        actual, expected, rtol=tolerance, atol=tolerance * scale, err_msg=name
    )


def _assert_lse(lse, expected):
    lse, expected = _f32(lse), _f32(expected)
    assert not np.isnan(lse).any(), "lse: NaN"
    masked = np.isneginf(expected)
    np.testing.assert_array_equal(np.isneginf(lse), masked, err_msg="lse: -inf rows")
    np.testing.assert_allclose(lse[~masked], expected[~masked], rtol=1e-5, atol=1e-5)


def check_against_reference(
    spec: AttentionSpec,
    *,
    lens_q=LENS_Q,
    lens_k=LENS_K,
    heads=(4, 2),
    head_dim=64,
    dtype=jnp.float32,
    use_sinks=False,
    use_alibi=False,
    sinks=None,
    pad=(0, 0),
    config=None,
    backward_config=None,
    seed=0,
    impl="triton",
):
    """Forward and backward of one implementation against the float32 oracle and its vjp.

    sinks: explicit sink values (overrides use_sinks). pad: (query rows, key rows) of
    packed padding after cu_seqlens[-1], which must get out 0 and zero gradients.
    config, backward_config: Triton launch configurations (impl="triton" only).
    """
    q, k, v, d_out, random_sinks, slopes = _inputs(lens_q, lens_k, *heads, head_dim, dtype, seed)
    if sinks is None and use_sinks:
        sinks = random_sinks
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    slopes = slopes if use_alibi else None
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    real_q, real_k = q.shape[0], k.shape[0]
    if pad != (0, 0):
        grow = lambda x, n: jnp.concatenate([x, jnp.ones((n, *x.shape[1:]), x.dtype)])
        q, d_out = grow(q, pad[0]), grow(d_out, pad[0])
        k, v = grow(k, pad[1]), grow(v, pad[1])
    out_tol, grad_tol = TOLERANCES[dtype]
    forward, backward = IMPLEMENTATIONS[impl]
    options = dict(sinks=sinks, alibi_slopes=slopes)
    fwd_options, bwd_options = dict(options), dict(options)
    if impl == "triton":
        fwd_options["config"], bwd_options["config"] = config, backward_config
    else:
        assert config is None and backward_config is None

    out, lse = forward(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), spec, **fwd_options)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (heads[0], q.shape[0])

    def reference(q, k, v, sinks):
        return dense_attention(q, k, v, cu_q, cu_k, spec, sinks=sinks, alibi_slopes=slopes)

    (ref_out, ref_lse), vjp = jax.vjp(
        reference, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), sinks
    )
    _assert_close(out, ref_out, out_tol, "out")
    _assert_lse(lse, ref_lse)
    # A row with nothing allowed (and no sink) outputs exactly 0.
    no_keys = np.isneginf(_f32(ref_lse)).T  # [total_q, Hq]
    assert np.all(_f32(out)[no_keys] == 0.0)

    grads = backward(
        q, k, v, out, lse, d_out, jnp.asarray(cu_q), jnp.asarray(cu_k), spec, **bwd_options
    )
    ref_grads = vjp((jnp.asarray(d_out, jnp.float32), jnp.zeros_like(ref_lse)))
    for name, grad, ref_grad, primal in zip(
        "qkv", grads[:3], ref_grads[:3], (q, k, v), strict=True
    ):
        assert grad.dtype == primal.dtype and grad.shape == primal.shape
        _assert_close(grad, ref_grad, grad_tol, f"d{name}")
    if sinks is None:
        assert grads[3] is None
    else:
        _assert_close(grads[3], ref_grads[3], grad_tol, "d_sinks")
    # Padding rows: output 0 and zero gradients, exactly.
    assert np.all(_f32(out)[real_q:] == 0)
    for tail in (grads[0][real_q:], grads[1][real_k:], grads[2][real_k:]):
        assert np.all(_f32(tail) == 0)


SCALE = 0.125  # 1 / sqrt(64)


# --- options, one at a time and combined (float32, GQA 2:1, head_dim 64) -----------------


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(SCALE),
        AttentionSpec(SCALE, causal=True),
        AttentionSpec(SCALE, window_left=6),
        AttentionSpec(SCALE, window_right=3),
        AttentionSpec(SCALE, window_left=20, window_right=4),
        AttentionSpec(SCALE, causal=True, window_left=17),
        AttentionSpec(SCALE, window_left=0, window_right=0),
        AttentionSpec(SCALE, logits_soft_cap=2.5),
    ],
    ids=["full", "causal", "left", "right", "both", "causal-left", "diagonal", "softcap"],
)
def test_masks_and_soft_cap(spec):
    check_against_reference(spec)


@both_implementations
@pytest.mark.parametrize("causal", [False, True])
def test_sinks(impl, causal):
    check_against_reference(AttentionSpec(SCALE, causal=causal), use_sinks=True, impl=impl)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi(causal):
    check_against_reference(AttentionSpec(SCALE, causal=causal), use_alibi=True)


@both_implementations
def test_everything_at_once(impl):
    spec = AttentionSpec(SCALE, causal=True, window_left=11, logits_soft_cap=3.0)
    check_against_reference(spec, use_sinks=True, use_alibi=True, impl=impl)


# --- head layouts and head dims -------------------------------------------------------------


@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 2)], ids=["mha", "mqa", "gqa4"])
def test_head_groups(heads):
    check_against_reference(AttentionSpec(SCALE, causal=True), heads=heads)


@both_implementations
@pytest.mark.parametrize("head_dim", [32, 40, 80])
def test_head_dims_not_a_power_of_two(impl, head_dim):
    spec = AttentionSpec(head_dim**-0.5, causal=True, logits_soft_cap=5.0)
    check_against_reference(spec, head_dim=head_dim, heads=(2, 1), use_sinks=True, impl=impl)


# --- 16-bit inputs --------------------------------------------------------------------------


@both_implementations
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(impl, dtype):
    check_against_reference(AttentionSpec(SCALE, causal=True), dtype=dtype, impl=impl)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_all_options(dtype):
    spec = AttentionSpec(96**-0.5, window_left=9, window_right=2, logits_soft_cap=4.0)
    check_against_reference(
        spec, dtype=dtype, head_dim=96, heads=(4, 2), use_sinks=True, use_alibi=True
    )


# --- sequences ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lens_q, lens_k",
    [
        ((1, 1, 1), (1, 1, 1)),  # every sequence length 1
        ((40, 3), (7, 33)),  # q longer than k in one, shorter in the other
        ((0, 0, 16), (5, 0, 16)),  # empty sequences first; one exact tile
    ],
    ids=["ones", "ragged", "empties"],
)
def test_sequence_shapes(lens_q, lens_k):
    check_against_reference(
        AttentionSpec(SCALE, causal=True, window_left=5), lens_q=lens_q, lens_k=lens_k
    )


@both_implementations
@settings(max_examples=4)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4).filter(
        lambda lens: sum(q for q, _ in lens) > 0 and sum(k for _, k in lens) > 0
    ),
    causal=st.booleans(),
    window_left=st.none() | st.integers(0, 24),
    window_right=st.none() | st.integers(0, 8),
    use_sinks=st.booleans(),
)
def test_random_sequences(impl, lens, causal, window_left, window_right, use_sinks):
    spec = AttentionSpec(SCALE, causal=causal, window_left=window_left, window_right=window_right)
    check_against_reference(
        spec,
        lens_q=[q for q, _ in lens],
        lens_k=[k for _, k in lens],
        heads=(2, 1),
        use_sinks=use_sinks,
        impl=impl,
    )


@both_implementations
@pytest.mark.parametrize("use_sinks", [False, True], ids=["plain", "sinks"])
def test_rows_past_the_last_sequence(impl, use_sinks):
    """Packed rows after cu_seqlens[-1] belong to no sequence: out 0, lse -inf (or the
    sink), zero gradients; the real rows are unaffected (the oracle covers padding)."""
    check_against_reference(
        AttentionSpec(SCALE, causal=True),
        lens_q=(20, 9),
        lens_k=(17, 30),
        heads=(2, 1),
        use_sinks=use_sinks,
        pad=(7, 5),
        impl=impl,
    )


@both_implementations
def test_sinks_of_minus_infinity(impl):
    """A sink of -inf is no sink: a row with nothing allowed gets out 0 and lse -inf (not
    NaN), and its d_sinks is finite. Query rows of the length-5 sequence have no keys."""
    sinks = np.array([-np.inf, 0.5], np.float32)
    check_against_reference(
        AttentionSpec(SCALE, causal=True, window_left=4),
        heads=(2, 1),
        sinks=sinks,
        pad=(3, 0),
        impl=impl,
    )


def test_empty_query_axis():
    q, k, v, d_out, _, _ = _inputs((0, 0), (3, 2), 2, 2, 32, jnp.float32)
    cu_q, cu_k = jnp.asarray(_cu((0, 0))), jnp.asarray(_cu((3, 2)))
    out, lse = attention_forward_triton(q, k, v, cu_q, cu_k, AttentionSpec(SCALE))
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)
    dq, dk, dv, d_sinks = attention_backward_triton(
        q, k, v, out, lse, d_out, cu_q, cu_k, AttentionSpec(SCALE)
    )
    assert dq.shape == q.shape and d_sinks is None
    assert np.all(np.asarray(dk) == 0) and np.all(np.asarray(dv) == 0)


# --- launch configuration, jit and grad -------------------------------------------------


def test_config_overrides():
    """Other tilings (unequal, larger than a sequence) give the same result."""
    check_against_reference(
        AttentionSpec(SCALE, causal=True, window_left=13),
        config=AttentionKernelConfig(block_m=32, block_n=16),
        backward_config=(
            AttentionKernelConfig(block_m=16, block_n=64),
            AttentionKernelConfig(block_m=64, block_n=32),
        ),
    )


def test_jit_and_grad_through_custom_vjp():
    """The two functions wired as a custom_vjp work under jax.jit with traced cu_seqlens."""
    spec = AttentionSpec(SCALE, causal=True)
    lens_q, lens_k = (9, 0, 21), (12, 4, 21)
    q, k, v, d_out, sinks, _ = _inputs(lens_q, lens_k, 2, 1, 32, jnp.float32)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    @jax.custom_vjp
    def attention(q, k, v, sinks, cu_q, cu_k):
        return attention_forward_triton(q, k, v, cu_q, cu_k, spec, sinks=sinks)[0]

    def forward(q, k, v, sinks, cu_q, cu_k):
        out, lse = attention_forward_triton(q, k, v, cu_q, cu_k, spec, sinks=sinks)
        return out, (q, k, v, sinks, cu_q, cu_k, out, lse)

    def backward(residuals, d_out):
        q, k, v, sinks, cu_q, cu_k, out, lse = residuals
        dq, dk, dv, d_sinks = attention_backward_triton(
            q, k, v, out, lse, d_out, cu_q, cu_k, spec, sinks=sinks
        )
        return dq, dk, dv, d_sinks, None, None

    attention.defvjp(forward, backward)
    loss = lambda f: lambda q, k, v, s, *cu: jnp.sum(f(q, k, v, s, *cu) * d_out)
    grads = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2, 3)))(
        q, k, v, sinks, jnp.asarray(cu_q), jnp.asarray(cu_k)
    )
    reference = lambda q, k, v, s, *_: dense_attention(q, k, v, cu_q, cu_k, spec, sinks=s)[0]
    expected = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, grad, ref in zip(("dq", "dk", "dv", "d_sinks"), grads, expected, strict=True):
        _assert_close(grad, ref, TOLERANCES[jnp.float32][1], name)


# --- the configuration function (pure Python) --------------------------------------------


@pytest.mark.parametrize("kind", ["forward", "backward_dkdv", "backward_dq"])
@pytest.mark.parametrize("compute_capability", [None, 80, 86, 89, 90, 100])
def test_default_configs_are_valid(kind, compute_capability):
    for head_dim in (16, 32, 64, 80, 96, 128, 192, 256):
        for dtype_name in ("float16", "bfloat16", "float32"):
            config = default_attention_config(head_dim, dtype_name, compute_capability, kind)
            assert isinstance(config, AttentionKernelConfig)
            # Exact fp32 products everywhere by default (tf32 is an explicit opt-in).
            assert config.fp32_dot_precision == "ieee"
            if compute_capability is None:  # small interpreter tiles
                assert (config.block_m, config.block_n) == (16, 16)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(block_m=24, block_n=16), ValueError),
        (dict(block_m=8, block_n=16), ValueError),
        (dict(block_m=16, block_n=16, num_warps=3), ValueError),
        (dict(block_m=16, block_n=16, num_stages=0), ValueError),
        (dict(block_m=16, block_n=16, fp32_dot_precision="tf32x3"), ValueError),
        (dict(block_m=16.0, block_n=16), TypeError),
    ],
)
def test_config_validation(kwargs, error):
    with pytest.raises(error):
        AttentionKernelConfig(**kwargs)


@pytest.mark.parametrize(
    "args",
    [(64, "float64", 90, "forward"), (512, "float16", 90, "forward"), (64, "float16", 90, "bwd")],
)
def test_default_config_rejects(args):
    with pytest.raises(ValueError):
        default_attention_config(*args)
