"""The per-sequence diagonal shift of the attention backends, against the dense oracle.

The backend contract (`jax_bridge.attention.api`) takes an optional `shift`, int32
[batch]: query i of sequence b sits at key position `i + shift[b]` instead of the
bottom-right `i + len_k - len_q`. Causal, sliding windows, ALiBi's |diag(i) - j| and the
kernels' loop bounds all follow it. Ring attention's pieces of one document need it;
`varlen_attention` never passes it, so the backends are driven directly here:

* forward: `backend.forward(..., shift=...)` against `dense_attention(..., shift=...)`:
  out and lse on every row, -inf lse rows exactly where the oracle has them;
* backward: `backend.backward(..., shift=...)` fed the backend's own out and lse and a
  random d_out (and a random d_lse in some cases) against `jax.grad` of the oracle;
* rows that see no key give out 0 and dq 0 exactly, keys no query sees dk = dv = 0.

Each case packs sequences whose shifts are negative, zero, positive, past len_k and
far out on either side (whole sequences, or some of their tiles, then see nothing, so
the Triton kernels' tile bounds must clamp and visit no tile out of range), with empty
sequences on either side and a length-1 one. Inputs are fresh random numbers; the
Triton launcher on the CPU starts every output as NaN, so the finiteness checks prove
every element was written. Tolerances are `tests/attention/helpers.py`'s
`attention_tolerance` (from the float64 oracle's scale). Every backend call runs under
`jax.jit` with the shift traced, as ring attention calls it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge.attention import pallas, triton, xla
from jax_bridge.attention.api import AttentionOptions
from jax_bridge.attention.reference import allowed_mask, dense_attention
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.precision import canonicalize_precision
from tests.attention.helpers import (
    assert_close,
    assert_equal_to_rounding,
    assert_lse_close,
    attention_tolerance,
    make_inputs,
    oracle_value_and_grads,
)

BACKENDS = {"xla": xla, "triton": triton}

# Per-sequence (len_q, len_k) and shift. With the interpreter's 16-row tiles: a
# sequence spanning several query and key tiles whose first rows see nothing under
# causal (negative shift), one whose shift is past len_k, one with no queries, one
# with no keys, length 1, one shifted far left (every row's window ends before key 0),
# one in the middle, and one whose windows partly leave the keys on the right.
LENGTHS = ((20, 33), (7, 5), (0, 4), (9, 0), (1, 1), (12, 12), (3, 9), (35, 40))
SHIFTS = (-5, 9, 2, -2, 0, -30, 3, 17)
# Windows far out on both sides: the whole of sequences 0, 1 and 5 sees nothing.
FAR_SHIFTS = (-60, 70, 2, -2, 0, 25, -7, 30)


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: `spec` holds AttentionSpec.create's keyword arguments."""

    spec: tuple[tuple[str, Any], ...] = ()
    shifts: tuple[int, ...] = SHIFTS
    lengths: tuple[tuple[int, int], ...] = LENGTHS
    heads: tuple[int, int] = (4, 2)
    head_dim: int = 32
    sinks: bool = False
    alibi: bool = False
    d_lse: bool = False
    dtype: Any = jnp.float32
    pad: tuple[int, int] = (0, 0)


def case(spec=None, **fields) -> Case:
    return Case(spec=tuple(sorted((spec or {}).items())), **fields)


CAUSAL = {"causal": True}
CASES = {
    "causal": case(CAUSAL, d_lse=True),
    "non_causal_alibi": case(alibi=True, head_dim=16),
    "window_left": case({"sliding_window": (5, None)}),
    "window_both_soft_cap": case({"sliding_window": (6, 3), "logits_soft_cap": 2.5}),
    "window_right_sinks": case({"sliding_window": (None, 2)}, sinks=True, d_lse=True),
    "causal_window_everything_mqa": case(
        {"causal": True, "sliding_window": (8, None), "logits_soft_cap": 3.0},
        heads=(4, 1),
        sinks=True,
        alibi=True,
        d_lse=True,
    ),
    "window_both_far_out_of_range": case({"sliding_window": (3, 2)}, shifts=FAR_SHIFTS),
    "causal_far_out_of_range_alibi": case(CAUSAL, shifts=FAR_SHIFTS, alibi=True, heads=(2, 2)),
    "zero_shifts_causal": case(CAUSAL, shifts=(0,) * len(LENGTHS)),
    "rows_past_the_last_sequence": case(
        {"sliding_window": (4, 1)},
        lengths=((20, 17), (9, 30)),
        shifts=(-3, 25),
        heads=(2, 1),
        pad=(5, 3),
    ),
    "bf16_causal_window": case(
        {"causal": True, "sliding_window": (16, None)}, dtype=jnp.bfloat16, sinks=True
    ),
}


def _options(impl: str, spec: AttentionSpec) -> AttentionOptions:
    return AttentionOptions(
        implementation=impl,
        precision=canonicalize_precision(None, "test_shift"),
        config=None,
        spec=spec,
    )


def _run_backend(impl, c: Case, seed: int, shift):
    """(inputs, spec, out, lse, grads) of backend `impl` with `shift` (None: none)."""
    inputs = make_inputs(seed, c.lengths, *c.heads, c.head_dim, c.dtype, pad=c.pad)
    spec = AttentionSpec.create(c.head_dim, **dict(c.spec))
    options = _options(impl, spec)
    backend = BACKENDS[impl]
    sinks = inputs["sinks"] if c.sinks else None
    slopes = inputs["slopes"] if c.alibi else None
    d_out = inputs["d_out"].astype(c.dtype)  # exact: d_out is rounded to the dtype
    d_lse = inputs["d_lse"] if c.d_lse else None
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    shift = None if shift is None else jnp.asarray(shift, jnp.int32)

    @jax.jit
    def run(q, k, v, cu_q, cu_k, sinks, slopes, d_out, d_lse, shift):
        out, lse = backend.forward(q, k, v, cu_q, cu_k, sinks, slopes, options, shift=shift)
        grads = backend.backward(
            q, k, v, out, lse, d_out, d_lse, cu_q, cu_k, sinks, slopes, options, shift=shift
        )
        return out, lse, grads

    out, lse, grads = run(q, k, v, cu_q, cu_k, sinks, slopes, d_out, d_lse, shift)
    return inputs, spec, out, lse, grads


def _oracle(inputs, spec, c: Case, shift):
    """(out, lse, grads) of the dense reference in float64: grads = (dq, dk, dv[, d_sinks])."""
    cu_q, cu_k = inputs["cu_q"], inputs["cu_k"]
    slopes = inputs["slopes"] if c.alibi else None
    sinks = inputs["sinks"] if c.sinks else None

    def reference(q, k, v, s):
        return dense_attention(q, k, v, cu_q, cu_k, spec, s, slopes, shift=shift)

    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    d_lse = inputs["d_lse"] if c.d_lse else None
    return oracle_value_and_grads(reference, q, k, v, sinks, inputs["d_out"], d_lse)


def _check(impl: str, c: Case, seed: int) -> None:
    shift = np.asarray(c.shifts, np.int32)
    inputs, spec, out, lse, grads = _run_backend(impl, c, seed, shift)
    ref_out, ref_lse, ref_grads = _oracle(inputs, spec, c, shift)
    tol = attention_tolerance(
        inputs["q"],
        inputs["k"],
        cu_q=inputs["cu_q"],
        cu_k=inputs["cu_k"],
        softmax_scale=spec.softmax_scale,
        sinks=inputs["sinks"] if c.sinks else None,
        slopes=inputs["slopes"] if c.alibi else None,
    )
    assert out.dtype == c.dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, tol, "out")
    assert_lse_close(lse, ref_lse, tol)
    dq, dk, dv, d_sinks = grads
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads[:3], strict=True):
        assert got.dtype == c.dtype, name
        assert_close(got, want, tol, name)
    if c.sinks:
        assert_close(d_sinks, ref_grads[3], tol, "d_sinks")
    else:
        assert d_sinks is None

    # Exact zeros where nothing is attended, whatever the shift.
    total_q, total_k = out.shape[0], dk.shape[0]
    allowed = allowed_mask(inputs["cu_q"], inputs["cu_k"], total_q, total_k, spec, shift)
    blind_rows, unseen_keys = ~allowed.any(axis=1), ~allowed.any(axis=0)
    assert blind_rows.any() and unseen_keys.any()  # every case has both
    for name, x, rows in (("out", out, blind_rows), ("dq", dq, blind_rows)):
        np.testing.assert_array_equal(np.asarray(x, np.float32)[rows], 0.0, err_msg=name)
    for name, x in (("dk", dk), ("dv", dv)):
        np.testing.assert_array_equal(np.asarray(x, np.float32)[unseen_keys], 0.0, err_msg=name)
    if not c.sinks:
        assert np.isneginf(np.asarray(lse)[:, blind_rows]).all()


@pytest.mark.parametrize("impl", list(BACKENDS))
@pytest.mark.parametrize("name", list(CASES))
def test_shift_matches_the_dense_oracle(name, impl):
    _check(impl, CASES[name], seed=sorted(CASES).index(name))


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_bottom_right_shift_is_no_shift(impl):
    """shift = len_k - len_q gives the very numbers of shift=None (both windows bounded,
    ALiBi: everything that reads the diagonal)."""
    c = case({"sliding_window": (7, 2)}, alibi=True, sinks=True, heads=(2, 1), d_lse=True)
    bottom_right = np.asarray([lk - lq for lq, lk in c.lengths], np.int32)
    _, _, *shifted = _run_backend(impl, c, 7, bottom_right)
    _, _, *plain = _run_backend(impl, c, 7, None)
    for got, want in zip(jax.tree.leaves(shifted), jax.tree.leaves(plain), strict=True):
        assert_equal_to_rounding(got, want)  # two builds of a kernel, on a GPU


@pytest.mark.parametrize("impl", list(BACKENDS))
def test_no_sequences(impl):
    """batch = 0 (a [0] shift) with packed rows on both sides: nothing is attended."""
    c = case(CAUSAL, lengths=(), shifts=(), heads=(2, 1), pad=(5, 4))
    _, _, out, lse, (dq, dk, dv, _) = _run_backend(impl, c, 3, np.zeros((0,), np.int32))
    assert np.isneginf(np.asarray(lse)).all()
    for x in (out, dq, dk, dv):
        np.testing.assert_array_equal(np.asarray(x), 0.0)


def test_triton_rejects_a_shift_of_the_wrong_shape():
    inputs = make_inputs(5, ((4, 4), (3, 5)), 2, 1, 16)
    options = _options("triton", AttentionSpec.create(16, causal=True))
    args = [inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k")]
    with pytest.raises(ValueError, match=r"shift must have shape \[batch\] = \(2,\)"):
        triton.forward(*args, None, None, options, shift=jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="shift must be an integer array"):
        triton.forward(*args, None, None, options, shift=jnp.zeros((2,), jnp.float32))


def test_pallas_refuses_a_shift():
    inputs = make_inputs(6, ((4, 4), (3, 5)), 2, 1, 16)
    options = _options("pallas", AttentionSpec.create(16, causal=True))
    q, k, v, cu_q, cu_k = (inputs[n] for n in ("q", "k", "v", "cu_q", "cu_k"))
    shift = jnp.asarray([1, -1], jnp.int32)
    with pytest.raises(NotImplementedError, match="shift"):
        pallas.forward(q, k, v, cu_q, cu_k, None, None, options, shift=shift)
    out, lse = jnp.zeros_like(q), jnp.zeros((2, q.shape[0]), jnp.float32)
    with pytest.raises(NotImplementedError, match="shift"):
        pallas.backward(q, k, v, out, lse, out, None, cu_q, cu_k, None, None, options, shift=shift)


def test_shifted_kernels_lower_for_cuda():
    """jax_triton's real lowering (sm_90, bf16) compiles the shifted kernels: the forward
    and backward with a traced int32 shift hold their five kernel calls, and these are
    other kernels than the unshifted ones (the kernels specialise on the shift pointer)."""
    pytest.importorskip("jax_triton")
    from jax_bridge.launch.lowering import lower_for_cuda

    S = jax.ShapeDtypeStruct
    q = S((96, 4, 64), jnp.bfloat16)
    k = S((80, 2, 64), jnp.bfloat16)
    cu = S((3,), jnp.int32)
    options = _options("triton", AttentionSpec.create(64, causal=True, sliding_window=(32, None)))

    def attention(q, k, v, d_out, cu_q, cu_k, shift=None):
        out, lse = triton.forward(q, k, v, cu_q, cu_k, None, None, options, shift=shift)
        grads = triton.backward(
            q, k, v, out, lse, d_out, None, cu_q, cu_k, None, None, options, shift=shift
        )
        return out, lse, grads

    def kernel_calls(*shift):
        module = lower_for_cuda(attention, q, k, k, q, cu, cu, *shift, compute_capability=90)
        # The compiled kernel (compressed, with its launch) rides in the backend config.
        return re.findall(r'triton_kernel_call.*?backend_config = ("[^"]*")', module)

    shifted = kernel_calls(S((2,), jnp.int32))
    assert len(shifted) == 5
    plain = kernel_calls()
    assert len(plain) == 5
    # The two tile schedules know no shift; the other three are other kernels.
    assert sum(a == b for a, b in zip(shifted, plain, strict=True)) == 2
