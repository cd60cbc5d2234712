"""The public attention API: argument checking, options, dispatch and autodiff wiring.

What every backend computes is `test_conformance.py`'s business (against the package
reference); here: bad arguments raise naming the argument (and, for head_dim, the
implementation), the max_seqlen hints are validated but unused, `precision=` accepts
jax's forms and its default is exact float32 (bit for bit `"highest"`, and within the tolerance
of a float64 numpy loop), vmap works with XLA, cu_seqlens and ALiBi get the documented
cotangents, "auto" runs XLA on a CPU, and `flash_attention`'s padded layout (against
`jax.nn.dot_product_attention` with a dense segment mask, and the segment ids ->
cu_seqlens conversion against `allowed_mask`).
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

from jax_bridge import AttentionConfigs, AttentionKernelConfig, flash_attention, varlen_attention
from jax_bridge.attention.api import BACKENDS
from jax_bridge.attention.padded import segment_ids_to_cu_seqlens
from jax_bridge.attention.reference import allowed_mask
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.backend import compiling_for_platform
from pallas_tpu.splash import BlockSizes
from tests.attention.helpers import (
    assert_close,
    attention_tolerance,
    dense_segment_attention,
    exact_dot_product_attention,
    make_inputs,
    padded_inputs,
)

LENGTHS = [(20, 20), (0, 4), (1, 1), (30, 21), (5, 0), (3, 9)]


def _inputs(seed, num_q_heads=2, num_kv_heads=1, head_dim=32, lengths=LENGTHS):
    inputs = make_inputs(seed, lengths, num_q_heads, num_kv_heads, head_dim)
    return (*(inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k")), inputs)


def test_max_seqlen_hints_are_validated_but_unused():
    q, k, v, cu_q, cu_k, _ = _inputs(8)
    plain = varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
    for hint in (30, 1000):
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
    q, k, v, cu_q, cu_k, _ = _inputs(9)
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    fn = lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
    batched = jax.vmap(fn)(qs, ks, vs)
    for b in range(2):
        assert_close(batched[b], fn(qs[b], ks[b], vs[b]), 1e-6, f"batch {b}")


def test_gradient_wiring_cu_seqlens_and_alibi():
    """cu_seqlens get float0 cotangents, ALiBi slopes a zero gradient."""
    q, k, v, cu_q, cu_k, inputs = _inputs(6, 2, 2)
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)

    def loss(q, cu_q, slopes):
        out = varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes, implementation="xla")
        return jnp.sum(out**2)

    dq, d_cu, d_slopes = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)(
        q, cu_q, inputs["slopes"]
    )
    assert d_cu.dtype == jax.dtypes.float0 and d_cu.shape == cu_q.shape
    np.testing.assert_array_equal(np.asarray(d_slopes), 0.0)
    assert float(jnp.max(jnp.abs(dq))) > 0


def test_auto_runs_xla_on_cpu(monkeypatch):
    """On a CPU "auto" runs the XLA backend's forward, and no other backend's."""
    q, k, v, cu_q, cu_k, _ = _inputs(7)
    calls = []

    def counting(name, forward):
        return lambda *args, **kwargs: calls.append(name) or forward(*args, **kwargs)

    for name in BACKENDS.backends:
        monkeypatch.setattr(BACKENDS[name], "forward", counting(name, BACKENDS[name].forward))
    with compiling_for_platform("cpu"):  # "auto" as on a CPU, whatever this host is
        varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert calls == ["xla"]


# ---------------------------------------------------------------------------- precision


def _float64_attention(q, k, v, cu_q, cu_k):
    """Causal varlen attention in float64 numpy, one sequence and head at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = np.zeros_like(q)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for h in range(q.shape[1]):
            s = q[qs, h] @ k[ks, h // group].T / np.sqrt(q.shape[2])
            diag = np.arange(len_q)[:, None] + len_k - len_q
            s = np.where(np.arange(len_k)[None, :] <= diag, s, -np.inf)
            seen = np.isfinite(s).any(axis=1)
            p = np.exp(s - np.where(seen, s.max(axis=1, initial=-np.inf), 0)[:, None])
            p /= np.where(seen, p.sum(axis=1), 1.0)[:, None]
            out[qs, h] = p @ v[ks, h // group]
    return out


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_default_precision_is_exact_float32(impl):
    """float32 inputs: the default equals precision="highest" bit for bit (on the
    interpreter for Triton) and a float64 numpy loop to `attention_tolerance`."""
    q, k, v, cu_q, cu_k, _ = _inputs(12)
    run = functools.partial(varlen_attention, causal=True, implementation=impl)
    default = np.asarray(run(q, k, v, cu_q, cu_k))
    highest = np.asarray(run(q, k, v, cu_q, cu_k, precision="highest"))
    np.testing.assert_array_equal(default, highest)
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    assert_close(default, _float64_attention(q, k, v, cu_q, cu_k), tol, "out")


@pytest.mark.parametrize(
    "precision",
    [
        jax.lax.Precision.HIGHEST,
        "highest",
        "float32",
        "HIGHEST",
        ("highest", "highest"),
        (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST),
    ],
    ids=["enum", "name", "float32", "upper", "pair", "mixed_pair"],
)
def test_precision_forms_meaning_highest_agree_bit_for_bit(precision):
    q, k, v, cu_q, cu_k, _ = _inputs(13)
    run = functools.partial(varlen_attention, causal=True, implementation="xla")
    np.testing.assert_array_equal(
        np.asarray(run(q, k, v, cu_q, cu_k, precision=precision)),
        np.asarray(run(q, k, v, cu_q, cu_k)),
    )


@pytest.mark.parametrize(
    "precision", [jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH, "tensorfloat32", "default"]
)
def test_faster_precisions_run_on_the_xla_path(precision):
    """Accepted on a CPU (where XLA may still multiply exactly): TF32-level agreement."""
    q, k, v, cu_q, cu_k, _ = _inputs(14)
    run = functools.partial(varlen_attention, causal=True, implementation="xla")
    out = run(q, k, v, cu_q, cu_k, precision=precision)
    assert_close(out, run(q, k, v, cu_q, cu_k), 2e-3, "out")


@pytest.mark.parametrize("precision", ["bf16", "tf32", 3, ("highest",), jnp.float32])
def test_bad_precision_raises_naming_the_op(precision):
    q, k, v, cu_q, cu_k, _ = _inputs(15)
    with pytest.raises(ValueError, match="varlen_attention: precision"):
        varlen_attention(q, k, v, cu_q, cu_k, precision=precision, implementation="xla")


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
    "no_kv_heads": (
        {"k": jnp.zeros((5, 0, 32)), "v": jnp.zeros((5, 0, 32))},
        ValueError,
        "k and v must have at least one head",
    ),
    "kv_shape_mismatch": ({"v": jnp.zeros((4, 2, 32))}, ValueError, "v must have the shape of k"),
    "q_rank": ({"q": jnp.zeros((6, 128))}, ValueError, "q must have shape"),
    "v_rank": ({"v": jnp.zeros((5, 64))}, ValueError, "v must have shape [total_k, num_kv"),
    "int_q": ({"q": jnp.zeros((6, 4, 32), jnp.int32)}, TypeError, "q must be float16"),
    "float64_v": ({"v": np.zeros((5, 2, 32), np.float64)}, TypeError, "v must be float16"),
    "mixed_dtypes": ({"k": jnp.zeros((5, 2, 32), jnp.bfloat16)}, TypeError, "k is bfloat16"),
    "head_dim_too_large_for_triton": (
        {
            "q": jnp.zeros((6, 4, 264)),
            "k": jnp.zeros((5, 2, 264)),
            "v": jnp.zeros((5, 2, 264)),
            "implementation": "triton",
        },
        ValueError,
        "head_dim must be in [16, 256] for implementation='triton', got 264",
    ),
    "head_dim_too_small_for_triton": (
        {
            "q": jnp.zeros((6, 4, 8)),
            "k": jnp.zeros((5, 2, 8)),
            "v": jnp.zeros((5, 2, 8)),
            "implementation": "triton",
        },
        ValueError,
        "head_dim must be in [16, 256] for implementation='triton', got 8",
    ),
    "config_type": ({"config": (16, 16)}, TypeError, "varlen_attention: config for implementation"),
    "return_lse_str": ({"return_lse": "no"}, TypeError, "return_lse must be a bool"),
    "cu_int64_overflow": (
        {"cu_seqlens_q": np.array([0, 2, 2**40], np.int64)},
        ValueError,
        "cu_seqlens_q holds values that do not fit int32",
    ),
    "cu_float": (
        {"cu_seqlens_k": jnp.array([0.0, 3, 5])},
        TypeError,
        "cu_seqlens_k must hold integers",
    ),
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
    "window_negative": ({"sliding_window": (-2, None)}, ValueError, "sliding_window"),
    "window_float": ({"sliding_window": (2.5, None)}, ValueError, "sliding_window"),
    "window_scalar": ({"sliding_window": 4}, ValueError, "sliding_window"),
    "soft_cap": ({"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
    "soft_cap_inf": ({"logits_soft_cap": float("inf")}, ValueError, "logits_soft_cap"),
    "softmax_scale": ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    "softmax_scale_zero": (
        {"softmax_scale": 0.0},
        ValueError,
        "varlen_attention: softmax_scale must be a finite non-zero number",
    ),
    "max_seqlen_small": ({"max_seqlen_q": 3}, ValueError, "max_seqlen_q=3"),
    "max_seqlen_type": ({"max_seqlen_k": 2.0}, TypeError, "max_seqlen_k"),
    "implementation": ({"implementation": "cuda"}, ValueError, "implementation"),
    "pallas_alibi": (
        {"implementation": "pallas", "alibi_slopes": jnp.full((4,), 0.5)},
        ValueError,
        "alibi_slopes",
    ),
    "pallas_triton_config": (
        {"implementation": "pallas", "config": AttentionConfigs()},
        TypeError,
        "BlockSizes",
    ),
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
    assert str(info.value).startswith("varlen_attention: ")


def test_flash_attention_conventions_are_accepted():
    """int64 cu_seqlens that fit, a window side of -1 (unbounded) and a soft cap of 0.0
    (off) mean what int32 offsets, None and None mean."""
    q, k, v, cu_q, cu_k, _ = _inputs(17)
    run = functools.partial(varlen_attention, implementation="xla")
    plain = np.asarray(run(q, k, v, cu_q, cu_k, sliding_window=(None, 2)))
    conventions = run(
        q,
        k,
        v,
        cu_q.astype(np.int64),
        cu_k.astype(np.int64),
        sliding_window=(-1, 2),
        logits_soft_cap=0.0,
    )
    np.testing.assert_array_equal(np.asarray(conventions), plain)


def test_xla_ignores_a_config_of_either_accelerator():
    """A program written for TPUs (`implementation="auto"` with splash `BlockSizes`) or
    GPUs (an `AttentionConfigs`) also runs where "auto" means XLA: same numbers as no
    config. Triton still refuses a `BlockSizes` (it needs its own launch configs)."""
    q, k, v, cu_q, cu_k, _ = _inputs(18)
    run = functools.partial(varlen_attention, q, k, v, cu_q, cu_k, causal=True)
    plain = np.asarray(run(implementation="xla"))
    for config in (BlockSizes(block_q=128), AttentionConfigs(), AttentionKernelConfig(16, 16)):
        np.testing.assert_array_equal(np.asarray(run(implementation="xla", config=config)), plain)
    with pytest.raises(TypeError, match="varlen_attention: config for implementation='triton'"):
        run(implementation="triton", config=BlockSizes())


@pytest.mark.parametrize("head_dim", [8, 300])
def test_xla_takes_head_dims_triton_does_not(head_dim):
    """The head-dim limits are per backend: XLA runs 8 and 300 (checked against the
    reference); Triton's limits are `jax_bridge.attention.triton.HEAD_DIMS`."""
    from jax_bridge import attention_reference
    from jax_bridge.attention import triton, xla

    assert xla.HEAD_DIMS[0] <= head_dim <= xla.HEAD_DIMS[1]
    assert not triton.HEAD_DIMS[0] <= head_dim <= triton.HEAD_DIMS[1]
    q, k, v, cu_q, cu_k, _ = _inputs(16, 2, 1, head_dim, lengths=[(9, 7), (4, 12)])
    out = varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
    ref = attention_reference(q, k, v, cu_q, cu_k, causal=True)
    assert_close(out, ref, attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k), "out")


def test_a_traced_max_seqlen_hint_is_refused_for_what_it_is():
    with pytest.raises(TypeError, match="max_seqlen_q is a hint checked against cu_seqlens"):
        jax.jit(lambda n: varlen_attention(_Q, _KV, _KV, _CU_Q, _CU_K, max_seqlen_q=n))(4)


def test_traced_bad_cu_seqlens_is_a_checkify_error():
    fn = checkify.checkify(
        lambda cu: varlen_attention(_Q, _KV, _KV, cu, _CU_K, implementation="xla"),
        errors=checkify.user_checks,
    )
    err, _ = jax.jit(fn)(jnp.array([0, 4, 3], jnp.int32))
    assert "cu_seqlens_q must be non-decreasing" in str(err.get())
    err, _ = jax.jit(fn)(_CU_Q)
    assert err.get() is None


def test_valid_calls_pass_checkify_index_checks():
    """`checkify.all_checks` (index checks included) reports nothing on a valid XLA call,
    forward and gradient, with padding rows past cu_seqlens[-1] and for an empty batch;
    the checked run gives the unchecked numbers."""
    q, k, v, cu_q, cu_k, _ = _inputs(21, lengths=[(9, 7), (0, 3), (5, 5)])
    q, k, v = (jnp.pad(x, [(0, 3), (0, 0), (0, 0)]) for x in (q, k, v))

    def loss(q, k, v, cu_q, cu_k):
        out = varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="xla")
        return jnp.sum(out * out)

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    err, checked = checkify.checkify(value_and_grad, errors=checkify.all_checks)(
        q, k, v, cu_q, cu_k
    )
    assert err.get() is None
    for got, want in zip(
        jax.tree.leaves(checked), jax.tree.leaves(value_and_grad(q, k, v, cu_q, cu_k)), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    empty = jnp.array([0], jnp.int32)
    err, _ = checkify.checkify(value_and_grad, errors=checkify.all_checks)(q, k, v, empty, empty)
    assert err.get() is None


def test_unsigned_cu_seqlens_under_checkify():
    """uint32 cu_seqlens: no false "do not fit int32" under jit (a signed bound compared
    with unsigned values wrapped around), the int32 numbers, and a value past 2^31 - 1
    still reported."""
    q, k, v, cu_q, _, _ = _inputs(22, lengths=[(6, 6), (10, 10)])
    f = lambda cu: varlen_attention(q, k, v, cu, cu, implementation="xla")
    checked = checkify.checkify(jax.jit(f), errors=checkify.user_checks)
    err, out = checked(jnp.asarray(cu_q, jnp.uint32))
    assert err.get() is None
    np.testing.assert_array_equal(out, f(cu_q))
    err, _ = checked(jnp.array([0, 6, 2**31 + 6], jnp.uint32))
    assert "cu_seqlens_q holds values that do not fit int32" in str(err.get())


# ------------------------------------------------------------------------ flash_attention
# The padded layout's own behaviour (its numerics per backend: test_conformance.py).


def test_flash_attention_without_segment_ids():
    q, k, v, _ = padded_inputs(0, 2, 40, 40, 4, 2)
    ref = exact_dot_product_attention(q, k, v, is_causal=True)
    tol = _padded_tolerance(q, k)
    assert_close(flash_attention(q, k, v, causal=True, implementation="xla"), ref, tol)
    ref = exact_dot_product_attention(q, k, v, scale=0.2)
    tol = _padded_tolerance(q, k, softmax_scale=0.2)
    assert_close(flash_attention(q, k, v, softmax_scale=0.2, implementation="xla"), ref, tol)


def _padded_tolerance(q, k, **bound_args) -> float:
    """`attention_tolerance` of padded [B, S, H, D] inputs: the batch rows flattened into one
    packed axis (pairs across batch rows enter the score bound: an upper bound)."""
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    return attention_tolerance(
        flat(q), flat(k), cu_q=[0, q.shape[1]], cu_k=[0, k.shape[1]], **bound_args
    )


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
    q, k, v, _ = padded_inputs(2, 2, 24, 30, 2, 2)
    out = flash_attention(
        q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, causal=causal, implementation="xla"
    )
    ref = dense_segment_attention(q, k, v, q_ids, kv_ids, causal=causal)
    assert_close(out, ref, _padded_tolerance(q, k))
    np.testing.assert_array_equal(np.asarray(out)[1, 10:14], 0.0)  # id 4 has no keys


def test_flash_attention_rejects_non_contiguous_ids():
    q, k, v, _ = padded_inputs(4, 1, 8, 8, 2, 2)
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
    q, k, v, _ = padded_inputs(5, 2, 8, 6, 2, 2)
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
    # Checks of the packed call it makes name the op the user called.
    three_heads = padded_inputs(5, 2, 8, 6, 2, 3)[1]
    with pytest.raises(ValueError, match=r"^flash_attention: q's num_q_heads \(2\) must be a mul"):
        flash_attention(q, three_heads, three_heads, q_segment_ids=np.ones((2, 8), np.int32),
                        kv_segment_ids=np.ones((2, 6), np.int32))  # fmt: skip
    with pytest.raises(ValueError, match=r"^flash_attention: implementation must be one of"):
        flash_attention(q, k, v, implementation="bogus")
    with pytest.raises(TypeError, match=r"^flash_attention: sinks must"):
        flash_attention(q, k, v, sinks=np.ones(2, np.int32))


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
