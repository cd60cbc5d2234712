"""Every attention backend against the package's dense reference, through the public ops.

Each test runs `varlen_attention(..., implementation=impl)` (or `flash_attention`) for
every entry of `IMPLEMENTATIONS` and compares, under one `jax.jit`, the output, the
log-sum-exp and the gradients of q, k, v and the sinks (with and without an lse
cotangent) to `jax.grad` of `jax_bridge.attention.reference.dense_attention` in float32
(the padded layout: `jax.nn.dot_product_attention` with a dense mask, and the packed
reference with the documents packed by hand).

Tolerances: one table per input dtype, in `tests/attention/helpers.py`: float32 1e-5
(exact products everywhere, only summation order differs), float16 2e-3 and bfloat16
1.6e-2 (four units of roundoff of the dtype: the result's rounding plus the kernels'
roundings of probabilities and score gradients to the input dtype), for outputs and
gradients alike; the float32 lse to 1e-5 for every dtype.

Inputs are fresh random numbers (never zeros or ones), with empty sequences on either
side, length-1 sequences, queries longer and shorter than keys, and packed rows past
cu_seqlens[-1]. The Triton launcher on the CPU starts outputs as NaN, so the explicit
finiteness check in `assert_close` proves that every element was written. Rows that see
no key must give exactly 0 (and dq 0), keys no query sees exactly zero dk and dv.

Adding a backend is one entry in `IMPLEMENTATIONS`. "pallas" (the splash kernels, in
Pallas' interpret mode here) has no ALiBi: cases using it are skipped for that backend,
and `tests/attention/test_pallas.py` checks the clear error instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_bridge import attention_reference, flash_attention, varlen_attention
from jax_bridge.attention.reference import dense_attention
from jax_bridge.attention.spec import AttentionSpec
from tests.attention.helpers import (
    assert_close,
    assert_lse_close,
    attention_tolerance,
    cu_seqlens,
    dense_segment_attention,
    make_inputs,
    oracle_value_and_grads,
    padded_inputs,
    unattended,
    upcast,
    value_and_grads,
)

IMPLEMENTATIONS = ["xla", "triton", "pallas"]
every_implementation = pytest.mark.parametrize("impl", IMPLEMENTATIONS)

# Per-sequence (len_q, len_k): a long one spanning several 16-row Triton tiles, empty
# sequences on the key side, the query side and both, length 1, k longer than q, q
# longer than k (under causal its first rows see nothing), queries without keys.
LENGTHS = ((29, 40), (0, 3), (1, 1), (17, 17), (5, 0), (0, 0), (20, 11), (3, 9))


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance problem; `options` are varlen_attention's keyword arguments."""

    options: tuple[tuple[str, Any], ...] = ()
    heads: tuple[int, int] = (4, 2)
    head_dim: int = 32
    sinks: bool = False
    alibi: bool = False
    lse_in_loss: bool = True
    dtype: Any = jnp.float32
    lengths: tuple[tuple[int, int], ...] = LENGTHS
    pad: tuple[int, int] = (0, 0)
    sink_values: tuple[float, ...] | None = None  # explicit sinks (overrides `sinks`)


def case(options=None, **fields) -> Case:
    return Case(options=tuple(sorted((options or {}).items())), **fields)


CAUSAL = {"causal": True}
# Every constexpr path of the kernels (each window side, the soft cap, sinks, ALiBi, GQA,
# padded head dims, 16-bit inputs) appears at least once, alone or combined.
CASES = {
    # masks, the soft cap, sinks and ALiBi
    "full": case(),
    "causal": case(CAUSAL, lse_in_loss=False),
    "window_left_soft_cap": case({"sliding_window": (6, None), "logits_soft_cap": 2.5}),
    "window_right_alibi": case({"sliding_window": (None, 3)}, alibi=True, lse_in_loss=False),
    "window_both_sinks": case({"sliding_window": (20, 4)}, sinks=True),
    "causal_window_left": case({"causal": True, "sliding_window": (17, None)}),
    "diagonal_only": case({"sliding_window": (0, 0)}),
    "right_window_zero_sinks_scale": case(
        {"sliding_window": (None, 0), "softmax_scale": 0.3}, heads=(2, 1), sinks=True
    ),
    "causal_sinks": case(CAUSAL, sinks=True, lse_in_loss=False),
    "causal_alibi": case(CAUSAL, alibi=True),
    "everything": case(
        {"causal": True, "sliding_window": (11, None), "logits_soft_cap": 3.0},
        sinks=True,
        alibi=True,
    ),
    # head layouts and head dims (not powers of two too)
    "mha_d64": case(heads=(4, 4), head_dim=64, lse_in_loss=False),
    "mqa": case(CAUSAL, heads=(4, 1)),
    "gqa4_d80_window_sinks": case(
        {"causal": True, "sliding_window": (16, None)}, heads=(8, 2), head_dim=80, sinks=True
    ),
    # three query heads a kv head: the dK/dV kernel steps its (tile, head) pairs on
    # instead of masking the step (power-of-two groups)
    "gqa3_causal_window_alibi_sinks": case(
        {"causal": True, "sliding_window": (12, None)}, heads=(6, 2), alibi=True, sinks=True
    ),
    "d40_causal_soft_cap_sinks": case(
        {"causal": True, "logits_soft_cap": 5.0}, heads=(2, 1), head_dim=40, sinks=True
    ),
    # 16-bit inputs
    "fp16_causal_window_sinks": case(
        {"causal": True, "sliding_window": (32, None)}, dtype=jnp.float16, sinks=True
    ),
    "bf16_causal_window_sinks": case(
        {"causal": True, "sliding_window": (32, None)}, dtype=jnp.bfloat16, sinks=True
    ),
    "fp16_d48_all_options": case(
        {"sliding_window": (9, 2), "logits_soft_cap": 4.0},
        dtype=jnp.float16,
        head_dim=48,
        sinks=True,
        alibi=True,
    ),
    "bf16_d48_all_options": case(
        {"sliding_window": (9, 2), "logits_soft_cap": 4.0},
        dtype=jnp.bfloat16,
        head_dim=48,
        sinks=True,
        alibi=True,
    ),
    # sequence shapes
    "every_sequence_length_one": case(
        {"causal": True, "sliding_window": (5, None)}, lengths=((1, 1), (1, 1), (1, 1))
    ),
    "q_longer_then_shorter": case(
        {"causal": True, "sliding_window": (5, None)}, lengths=((40, 7), (3, 33))
    ),
    "empty_sequences_first_one_exact_tile": case(
        {"causal": True, "sliding_window": (5, None)}, lengths=((0, 5), (0, 0), (16, 16))
    ),
    # packed rows past cu_seqlens[-1]: out 0, lse -inf (or the sink), zero gradients
    "rows_past_the_last_sequence": case(
        CAUSAL, heads=(2, 1), lengths=((20, 17), (9, 30)), pad=(7, 5)
    ),
    "rows_past_the_last_sequence_sinks": case(
        CAUSAL, heads=(2, 1), lengths=((20, 17), (9, 30)), pad=(7, 5), sinks=True
    ),
    # A sink of -inf is no sink: rows with nothing allowed get out 0 and lse -inf, not NaN.
    "sink_of_minus_infinity": case(
        {"causal": True, "sliding_window": (4, None)},
        heads=(2, 1),
        pad=(3, 0),
        sink_values=(-np.inf, 0.5),
    ),
}


def skip_unsupported(impl: str, alibi: bool) -> None:
    if impl == "pallas" and alibi:
        pytest.skip("the Pallas splash kernels have no ALiBi (refused with a ValueError)")


def check_case(impl: str, c: Case, seed: int, config: Any = None) -> None:
    """The forward and gradients of one backend on one case against the oracle
    (`config`: the op's, for a backend's own variants)."""
    skip_unsupported(impl, c.alibi)
    options = dict(c.options)
    inputs = make_inputs(seed, c.lengths, *c.heads, c.head_dim, c.dtype, pad=c.pad)
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    sinks = inputs["sinks"] if c.sinks else None
    if c.sink_values is not None:
        sinks = jnp.asarray(c.sink_values, jnp.float32)
    slopes = inputs["slopes"] if c.alibi else None
    d_lse = inputs["d_lse"] if c.lse_in_loss else None
    spec = AttentionSpec.create(c.head_dim, **options)

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
            config=config,
            implementation=impl,
            **options,
        )

    def reference(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec, s, slopes)

    out, lse, grads = value_and_grads(ours, q, k, v, sinks, inputs["d_out"], d_lse)
    ref_out, ref_lse, ref_grads = oracle_value_and_grads(
        reference, q, k, v, sinks, inputs["d_out"], d_lse
    )
    tol = attention_tolerance(
        q, k, cu_q=cu_q, cu_k=cu_k, softmax_scale=spec.softmax_scale, sinks=sinks, slopes=slopes
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.shape == (c.heads[0], q.shape[0])
    assert_close(out, ref_out, tol, "out")
    assert_lse_close(lse, ref_lse, tol)
    assert len(grads) == len(ref_grads) == (3 if sinks is None else 4)
    for name, grad, ref_grad, primal in zip(
        ("dq", "dk", "dv", "d_sinks"), grads, ref_grads, (q, k, v, sinks), strict=False
    ):
        assert grad.dtype == primal.dtype and grad.shape == primal.shape, name
        assert_close(grad, ref_grad, tol, name)

    # Exact zeros where the semantics say so (padding rows included).
    no_keys, no_queries = unattended(cu_q, cu_k, q.shape[0], k.shape[0], spec)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[no_keys], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[no_keys], 0.0)
    for grad in grads[1:3]:
        np.testing.assert_array_equal(np.asarray(grad, np.float32)[no_queries], 0.0)


@every_implementation
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_reference(impl, name):
    check_case(impl, CASES[name], seed=list(CASES).index(name))


@every_implementation
@settings(max_examples=3)
@given(
    lengths=st.lists(
        st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=3
    ).filter(lambda ls: sum(q for q, _ in ls) > 0 and sum(k for _, k in ls) > 0),
    causal=st.booleans(),
    window_left=st.none() | st.integers(0, 24),
    window_right=st.none() | st.integers(0, 8),
    use_sinks=st.booleans(),
    lse_in_loss=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_sequences_match_reference(
    impl, lengths, causal, window_left, window_right, use_sinks, lse_in_loss, seed
):
    options = {"causal": causal, "sliding_window": (window_left, window_right)}
    c = case(
        options,
        heads=(2, 1),
        lengths=tuple(lengths),
        sinks=use_sinks,
        lse_in_loss=lse_in_loss,
    )
    check_case(impl, c, seed)


@every_implementation
@pytest.mark.parametrize("sinks_kind", [None, "minus_inf"])
def test_fully_masked_rows(impl, sinks_kind):
    """Causal with len_q > len_k, an empty key side and trailing padding rows: output 0,
    lse -inf (a sink of -inf joins nothing, so -inf again; finite sinks: the
    `rows_past_the_last_sequence_sinks` case), zero dq there, d_sinks 0 for a sink of
    -inf, and the oracle's values elsewhere."""
    lengths = [(6, 2), (3, 0), (4, 4)]
    inputs = make_inputs(3, lengths, 2, 1, 32, pad=(3, 2))
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    sinks = {
        None: None,
        "finite": inputs["sinks"],
        "minus_inf": inputs["sinks"].at[0].set(-jnp.inf),
    }[sinks_kind]
    spec = AttentionSpec.create(32, causal=True)

    def ours(q, k, v, s):
        return varlen_attention(
            q, k, v, cu_q, cu_k, causal=True, sinks=s, return_lse=True, implementation=impl
        )

    def reference(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec, s)

    d_out, d_lse = inputs["d_out"], inputs["d_lse"]
    out, lse, grads = value_and_grads(ours, q, k, v, sinks, d_out, d_lse)
    masked = np.zeros(q.shape[0], bool)
    masked[[0, 1, 2, 3, 6, 7, 8, 13, 14, 15]] = True  # 6 - 2 unseen; no keys; padding
    np.testing.assert_array_equal(np.asarray(out)[masked], 0.0)
    assert np.all(np.abs(np.asarray(out)[~masked]).sum(-1) > 0)
    expected = -np.inf if sinks is None else np.asarray(sinks)[:, None]
    np.testing.assert_array_equal(np.asarray(lse)[:, masked], np.broadcast_to(expected, (2, 10)))
    assert np.all(np.isfinite(np.asarray(lse)[:, ~masked]))
    np.testing.assert_array_equal(np.asarray(grads[0])[masked], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1])[-2:], 0.0)  # padding keys
    if sinks_kind == "minus_inf":
        assert float(grads[3][0]) == 0.0

    ref_out, ref_lse, ref_grads = oracle_value_and_grads(reference, q, k, v, sinks, d_out, d_lse)
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k, sinks=sinks)
    assert_close(out, ref_out, tol, "out")
    assert_lse_close(lse, ref_lse, tol)
    for name, grad, ref in zip(("dq", "dk", "dv", "d_sinks"), grads, ref_grads, strict=False):
        assert_close(grad, ref, tol, name)


@every_implementation
def test_with_64_bit_types_on(impl):
    """Under `jax_enable_x64` (as float64 oracles run) the op keeps its dtypes: Pallas's
    GQA head map had divided an int32 head index by an int64 group size."""
    with jax.enable_x64(True):
        check_case(impl, case(CAUSAL, heads=(4, 2), sinks=True, lengths=LENGTHS[:4]), seed=64)


@every_implementation
def test_traced_cu_seqlens_under_jit(impl):
    """One compiled function serves two layouts of the same shapes (the second leaves 3
    query and 4 key rows past cu_seqlens[-1], which attend nothing)."""
    inputs = make_inputs(5, LENGTHS, 4, 2, 32)
    q, k, v, sinks = (inputs[n] for n in ("q", "k", "v", "sinks"))
    fn = jax.jit(
        lambda q, k, v, a, b, s: varlen_attention(
            q, k, v, a, b, causal=True, sinks=s, return_lse=True, implementation=impl
        )
    )
    spec = AttentionSpec.create(32, causal=True)
    other = [(30, 40), (22, 10), (0, 23), (20, 4)]
    other_q, other_k = cu_seqlens([a for a, _ in other]), cu_seqlens([b for _, b in other])
    other_q = np.concatenate([other_q, np.full(4, other_q[-1], np.int32)])
    other_k = np.concatenate([other_k, np.full(4, other_k[-1], np.int32)])
    assert other_q[-1] == q.shape[0] - 3 and other_k[-1] == k.shape[0] - 4
    for a, b in ((inputs["cu_q"], inputs["cu_k"]), (other_q, other_k)):
        out, lse = fn(q, k, v, jnp.asarray(a), jnp.asarray(b), sinks)
        ref_out, ref_lse = dense_attention(q, k, v, a, b, spec, sinks)
        tol = 2 * attention_tolerance(q, k, cu_q=a, cu_k=b, sinks=sinks)  # float32 oracle
        assert_close(out, ref_out, tol, "out")
        assert_lse_close(lse, ref_lse, tol)
        np.testing.assert_array_equal(np.asarray(out[a[-1] :]), 0.0)
    assert fn._cache_size() == 1


@every_implementation
@pytest.mark.parametrize("use_sinks", [False, True], ids=["plain", "sinks"])
def test_empty_token_axes(impl, use_sinks):
    """No queries, or no keys: out 0, lse -inf (or the sink), zero gradients for q, k
    and v, and the oracle's gradient for the sinks."""
    inputs = make_inputs(6, [(4, 3), (2, 2)], 2, 2, 32)
    q, k, v, sinks = (inputs[n] for n in ("q", "k", "v", "sinks"))
    sinks = sinks if use_sinks else None
    empty = jnp.zeros((3,), jnp.int32)
    for q_, k_, cu_q, cu_k in (
        (q[:0], k, empty, jnp.asarray(inputs["cu_k"])),
        (q, k[:0], jnp.asarray(inputs["cu_q"]), empty),
    ):
        v_ = v[: k_.shape[0]]

        def ours(q, k, v, s, cu_q=cu_q, cu_k=cu_k):
            return varlen_attention(
                q, k, v, cu_q, cu_k, sinks=s, return_lse=True, implementation=impl
            )

        def reference(q, k, v, s, cu_q=cu_q, cu_k=cu_k):
            return attention_reference(
                q, k, v, np.asarray(cu_q), np.asarray(cu_k), sinks=s, return_lse=True
            )

        d_out = inputs["d_out"][: q_.shape[0]]
        d_lse = inputs["d_lse"][:, : q_.shape[0]]
        out, lse, grads = value_and_grads(ours, q_, k_, v_, sinks, d_out, d_lse)
        assert out.shape == q_.shape and lse.shape == (2, q_.shape[0])
        np.testing.assert_array_equal(np.asarray(out), 0.0)
        for grad, primal in zip(grads[:3], (q_, k_, v_), strict=True):
            assert grad.shape == primal.shape
            np.testing.assert_array_equal(np.asarray(grad), 0.0)
        if sinks is None and k_.shape[0] == 0:
            # (attention_reference cannot take zero keys without sinks: see the report.)
            assert np.all(np.isneginf(np.asarray(lse))) and len(grads) == 3
            continue
        _, ref_lse, ref_grads = oracle_value_and_grads(reference, q_, k_, v_, sinks, d_out, d_lse)
        tol = attention_tolerance(q_, k_, sinks=sinks)
        assert_lse_close(lse, ref_lse, tol)
        if sinks is not None:
            assert_close(grads[3], ref_grads[3], tol, "d_sinks")


# ------------------------------------------------------------------- flash_attention
# The padded layout with segment ids, on top of the packed op.

SELF_IDS = np.array(
    [[1] * 9 + [2] * 20 + [3] + [0] * 10, [5] * 13 + [0] * 4 + [6] * 22 + [7]], np.int32
)


def vjp_outputs(fn, q, k, v, d_out):
    """fn(q, k, v) and the gradients of sum(fn * d_out), in one compiled call."""

    def run(q, k, v):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(d_out.astype(out.dtype))

    return jax.jit(run)(q, k, v)


@every_implementation
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_segment_ids_with_padding(impl, causal):
    """Forward and gradients (through the packed custom_vjp) vs the dense masked call."""
    q, k, v, d_out = padded_inputs(1, 2, 40, 40, 2, 1)
    out, grads = vjp_outputs(
        lambda q, k, v: flash_attention(
            q, k, v, q_segment_ids=SELF_IDS, causal=causal, implementation=impl
        ),
        q,
        k,
        v,
        d_out,
    )
    ref, ref_grads = vjp_outputs(
        lambda q, k, v: dense_segment_attention(q, k, v, SELF_IDS, SELF_IDS, causal),
        q,
        k,
        v,
        d_out,
    )
    # The dense oracle computes in float32 (exact products, see helpers): twice the bound.
    tol = 2 * attention_tolerance(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]))
    assert_close(out, ref, tol, "out")
    np.testing.assert_array_equal(np.asarray(out)[SELF_IDS <= 0], 0.0)
    for name, grad, ref_grad in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, tol, name)


@every_implementation
def test_flash_attention_with_every_option_matches_packed_reference(impl):
    """The padded wrapper and the packed reference agree with sinks, ALiBi, windows, cap;
    its lse is the reference's, [batch, heads, q_seq] (padding: -inf, or the sink)."""
    q, k, v, _ = padded_inputs(3, 2, 40, 40, 2, 1)
    rng = np.random.default_rng(3)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    slopes = jnp.asarray(rng.uniform(0.0, 0.2, 2), jnp.float32)
    if impl == "pallas":  # no ALiBi there: the rest of the options still meet
        slopes = None
    options = {"causal": True, "sliding_window": (6, None), "logits_soft_cap": 3.0}
    out, lse = flash_attention(
        q,
        k,
        v,
        q_segment_ids=SELF_IDS,
        sinks=sinks,
        alibi_slopes=slopes,
        return_lse=True,
        precision=jax.lax.Precision.HIGHEST,
        implementation=impl,
        **options,
    )
    # The same documents packed by hand: each row's runs, padding runs as their own
    # (key-less) sequences.
    lengths = [(9, 9), (20, 20), (1, 1), (10, 0), (13, 13), (4, 0), (22, 22), (1, 1)]
    kv_order = np.concatenate([np.arange(30), np.arange(40, 53), np.arange(57, 80)])
    flat = lambda x: x.reshape(80, *x.shape[2:])
    ref, ref_lse = attention_reference(
        flat(q),
        flat(k)[kv_order],
        flat(v)[kv_order],
        cu_seqlens([a for a, _ in lengths]),
        cu_seqlens([b for _, b in lengths]),
        sinks=sinks,
        alibi_slopes=slopes,
        return_lse=True,
        **options,
    )
    tol = 2 * attention_tolerance(flat(q), flat(k), sinks=sinks, slopes=slopes)  # f32 oracle
    assert_close(out, ref.reshape(q.shape), tol, "out")
    assert lse.shape == (2, 2, 40)  # [batch, heads, q_seq]
    assert_lse_close(lse, ref_lse.reshape(2, 2, 40).transpose(1, 0, 2), tol)


@every_implementation
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_flash_attention_half_precision(impl, dtype):
    """16-bit padded inputs (their gradients: the varlen 16-bit cases above)."""
    q, k, v, _ = padded_inputs(32, 2, 40, 40, 2, 1)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out = flash_attention(q, k, v, q_segment_ids=SELF_IDS, causal=True, implementation=impl)
    ref = dense_segment_attention(upcast(q), upcast(k), upcast(v), SELF_IDS, SELF_IDS, causal=True)
    assert out.dtype == dtype
    assert_close(out, ref, attention_tolerance(q.reshape(80, 2, 32), k.reshape(80, 1, 32)), "out")


@every_implementation
def test_rows_before_the_first_sequence_attend_nothing(impl):
    """cu_seqlens that start past 0 (traced, so unchecked, under jit): the rows before
    them belong to no document, on every backend as rows past cu_seqlens[-1] do: output 0,
    lse -inf, zero dq, and zero dk/dv for keys before cu_seqlens_k[0]; the documents get
    the oracle's values of the same call without the leading rows. The Triton launcher on
    the CPU starts outputs as NaN, so exact zeros prove those rows were written."""
    lead_q, lead_k = 5, 3
    inputs = make_inputs(11, ((20, 17), (9, 12)), 2, 1, 32, pad=(lead_q, lead_k))
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    # The documents move up by the lead: the arrays' first rows become the leading ones.
    q, k, v = (jnp.roll(x, lead, axis=0) for x, lead in ((q, lead_q), (k, lead_k), (v, lead_k)))
    d_out, d_lse = (
        jnp.roll(x, lead_q, axis=a) for x, a in ((inputs["d_out"], 0), (inputs["d_lse"], 1))
    )
    spec = AttentionSpec.create(32, causal=True)

    def loss(q, k, v, cu_q, cu_k):
        out, lse = varlen_attention(
            q, k, v, cu_q, cu_k, causal=True, return_lse=True, implementation=impl
        )
        value = jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return value, (out, lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, (out, lse) = grad(q, k, v, jnp.asarray(cu_q + lead_q), jnp.asarray(cu_k + lead_k))

    ref_out, ref_lse, ref_grads = oracle_value_and_grads(
        lambda q, k, v, s: dense_attention(q, k, v, cu_q, cu_k, spec),
        q[lead_q:],
        k[lead_k:],
        v[lead_k:],
        None,
        d_out[lead_q:],
        d_lse[:, lead_q:],
    )
    tol = attention_tolerance(q[lead_q:], k[lead_k:], cu_q=cu_q, cu_k=cu_k)
    np.testing.assert_array_equal(np.asarray(out)[:lead_q], 0.0)
    np.testing.assert_array_equal(np.asarray(lse)[:, :lead_q], -np.inf)
    np.testing.assert_array_equal(np.asarray(grads[0])[:lead_q], 0.0)
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g)[:lead_k], 0.0)
    assert_close(out[lead_q:], ref_out, tol, "out")
    assert_lse_close(lse[:, lead_q:], ref_lse, tol)
    for name, g, ref, lead in zip(
        ("dq", "dk", "dv"), grads, ref_grads, (lead_q, lead_k, lead_k), strict=True
    ):
        assert_close(g[lead:], ref, tol, name)
