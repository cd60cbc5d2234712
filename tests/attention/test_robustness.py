"""What a user hits beyond the happy path, on every attention backend.

* A poisoned document (NaN or Inf in its q, k or v) or poisoned padding leaves every other
  document's output and gradients exactly as in the clean run.
* Non-finite sinks follow one documented rule on every backend.
* FlashAttention's conventions: window sides of -1, huge windows, softcap 0.0, cu_seqlens
  as lists or int64.
* Differentiating the gradient is refused with an error naming the op.
* vmap over a batched q with shared k/v.
Oracles: the clean run of the same backend, and the package's dense `attention_reference`
run in float64. Comparisons go through the attention helpers' `assert_close` with the
problem's `attention_tolerance` (recorded by tests/margins.py): clean rows of a poisoned
run must match the clean run to within it (the same backend, so normally exactly).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import attention_reference, flash_attention, unpack, varlen_attention
from tests.attention.helpers import assert_close, attention_tolerance

IMPLEMENTATIONS = ("xla", "triton", "pallas")
LENGTHS = (23, 0, 1, 30, 17)  # documents, one empty and one of length 1
TOTAL = 80  # 71 real tokens and 9 of padding


def _cu() -> jnp.ndarray:
    return jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (TOTAL, 4, 32))
    k = jax.random.normal(keys[1], (TOTAL, 2, 32))
    v = jax.random.normal(keys[2], (TOTAL, 2, 32))
    sinks = jax.random.normal(keys[3], (4,))
    weights = jax.random.normal(keys[4], (TOTAL, 4, 32))
    return q, k, v, sinks, weights


def _f64(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _tolerance(q, k, sinks=None) -> float:
    cu = np.asarray(_cu())
    return attention_tolerance(q, k, cu_q=cu, cu_k=cu, sinks=sinks)


def _value_and_grads(implementation, q, k, v, sinks, weights, **options):
    cu = _cu()

    def loss(q, k, v, sinks):
        out, lse = varlen_attention(
            q,
            k,
            v,
            cu,
            cu,
            sinks=sinks,
            return_lse=True,
            implementation=implementation,
            **options,
        )
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * weights) + jnp.sum(finite_lse[:, :24] ** 2), out

    (_, out), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads


# The poisoned document is the fourth (rows [24, 54)); padding rows are [71, 80).
POISON_ROWS = {"document": [30, 53], "padding": [71, 79]}
CLEAN_ROWS = np.r_[0:24, 54:71]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("where", sorted(POISON_ROWS))
@pytest.mark.parametrize(
    "array, value, causal",
    [("q", np.nan, True), ("k", np.inf, False), ("v", np.nan, False), ("v", np.inf, True)],
)
def test_a_poisoned_document_or_padding_does_not_reach_the_others(
    implementation, where, array, value, causal
):
    q, k, v, sinks, weights = _inputs()
    options = dict(causal=causal, sliding_window=(12, None) if causal else None)
    clean_out, clean_grads = _value_and_grads(implementation, q, k, v, sinks, weights, **options)
    arrays = {"q": q, "k": k, "v": v}
    arrays[array] = arrays[array].at[jnp.asarray(POISON_ROWS[where])].set(value)
    out, grads = _value_and_grads(
        implementation, arrays["q"], arrays["k"], arrays["v"], sinks, weights, **options
    )
    np.testing.assert_array_equal(out[CLEAN_ROWS], clean_out[CLEAN_ROWS])
    tol = _tolerance(q, k, sinks)
    for name, got, want in zip("qkv", grads[:3], clean_grads[:3], strict=False):
        assert_close(got[CLEAN_ROWS], _f64(want[CLEAN_ROWS]), tol, f"d{name} clean rows")
    if where == "padding":  # padding attends nothing and is attended by nothing
        np.testing.assert_array_equal(out[71:], 0.0)
        assert_close(grads[3], _f64(clean_grads[3]), tol, "d_sinks")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_flash_attention_padding_filled_with_nan_stays_out(implementation):
    rng = np.random.default_rng(1)
    lengths = np.array([9, 14])
    tokens = jnp.asarray(rng.standard_normal((int(lengths.sum()), 2, 32)), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    padded = unpack(tokens, cu, 2, 16, fill_value=np.nan)  # [2, 16, 2, 32], NaN padding
    ids = jnp.asarray((np.arange(16)[None] < lengths[:, None]).astype(np.int32))
    out = flash_attention(
        padded, padded, padded, q_segment_ids=ids, causal=True, implementation=implementation
    )
    real = np.asarray(ids, bool)
    assert np.isfinite(np.asarray(out)[real]).all()
    np.testing.assert_array_equal(np.asarray(out)[~real], 0.0)
    grad = jax.grad(
        lambda x: jnp.sum(
            jnp.where(
                real[..., None, None],
                flash_attention(
                    x, x, x, q_segment_ids=ids, causal=True, implementation=implementation
                ),
                0.0,
            )
        )
    )(padded)
    assert np.isfinite(np.asarray(grad)[real]).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_non_finite_sinks_follow_one_rule(implementation):
    q, k, v, _, _ = _inputs(3)
    cu = _cu()
    sinks = jnp.array([0.25, jnp.nan, jnp.inf, -jnp.inf])
    out, lse = varlen_attention(
        q, k, v, cu, cu, sinks=sinks, return_lse=True, implementation=implementation
    )
    assert np.isnan(np.asarray(out[:, 1])).all() and np.isnan(np.asarray(lse[1])).all()
    np.testing.assert_array_equal(out[:, 2], 0.0)
    np.testing.assert_array_equal(lse[2], np.inf)
    # -inf is no sink at all; a finite sink matches the dense reference.
    plain = varlen_attention(q, k, v, cu, cu, implementation=implementation)
    tol = _tolerance(q, k, sinks[:1])
    assert_close(out[:, 3], _f64(plain[:, 3]), tol, "-inf sink vs none")
    with jax.enable_x64(True):
        wide = [jnp.asarray(_f64(x)) for x in (q, k, v, sinks)]
        expected = _f64(
            attention_reference(*wide[:3], np.asarray(cu), np.asarray(cu), sinks=wide[3])
        )
    assert_close(out[:, 0], expected[:, 0], tol, "finite sink vs float64 reference")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_flash_attention_conventions_are_accepted(implementation):
    q, k, v, _, _ = _inputs(4)
    cu = _cu()
    run = lambda **kw: varlen_attention(q, k, v, **kw, implementation=implementation)
    unbounded = run(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    for window in [(-1, -1), (2**40, 2**31 - 1)]:
        got = run(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, sliding_window=window)
        np.testing.assert_array_equal(got, unbounded)
    no_cap = run(cu_seqlens_q=cu, cu_seqlens_k=cu)
    np.testing.assert_array_equal(
        run(cu_seqlens_q=cu, cu_seqlens_k=cu, logits_soft_cap=0.0), no_cap
    )
    as_list = [int(x) for x in cu]
    np.testing.assert_array_equal(run(cu_seqlens_q=as_list, cu_seqlens_k=as_list), no_cap)
    as_int64 = np.asarray(cu, np.int64)
    np.testing.assert_array_equal(run(cu_seqlens_q=as_int64, cu_seqlens_k=as_int64), no_cap)


def test_conventions_that_are_still_errors():
    q, k, v, _, _ = _inputs(5)
    cu = _cu()
    with pytest.raises(ValueError, match="varlen_attention: sliding_window entries"):
        varlen_attention(q, k, v, cu, cu, sliding_window=(-2, None))
    # It sizes the kernels' tile ranges: a traced side is refused as not static.
    with pytest.raises(TypeError, match="sliding_window entries must be static Python ints"):
        jax.jit(lambda left: varlen_attention(q, k, v, cu, cu, sliding_window=(left, 0)))(2)
    with pytest.raises(ValueError, match="cu_seqlens_q holds values that do not fit int32"):
        too_big = np.asarray(cu, np.int64) + 2**32
        varlen_attention(q, k, v, too_big, cu)
    with pytest.raises(TypeError, match="cu_seqlens_q must hold integers"):
        varlen_attention(q, k, v, np.asarray(cu, np.float32), cu)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_differentiating_the_gradient_names_the_op(implementation):
    q, k, v, _, _ = _inputs(6)
    cu = _cu()
    f = lambda q: jnp.sum(varlen_attention(q, k, v, cu, cu, implementation=implementation))
    with pytest.raises(NotImplementedError, match="varlen_attention: higher-order derivatives"):
        jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(q)
    with pytest.raises(NotImplementedError, match="varlen_attention: higher-order"):
        jax.jacfwd(jax.grad(lambda x: f(q.at[0, 0, 0].set(x))))(1.0)
    assert np.isfinite(np.asarray(jax.grad(f)(q))).all()  # first order still works


def test_differentiating_flash_attentions_gradient_names_it():
    """flash_attention is varlen_attention on packed rows; the refusal, raised when the
    gradient is differentiated (after the call returned), names the op the user called."""
    q, k, v, _, _ = _inputs(6)
    padded = lambda x: x.reshape(2, 40, *x.shape[1:])
    f = lambda q: jnp.sum(flash_attention(q, padded(k), padded(v), causal=True) ** 2)
    with pytest.raises(NotImplementedError, match=r"^flash_attention: higher-order derivatives"):
        jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(padded(q))


def test_segment_ids_past_int32_are_refused_not_wrapped():
    """int64 ids that int32 cannot hold would wrap (2**32 + 1 to 1: two documents merged):
    refused naming the argument, as cu_seqlens are."""
    q, k, v, _, _ = _inputs(5)
    padded = lambda x: x.reshape(2, 40, *x.shape[1:])
    ids = np.repeat([[1, 2**32 + 1], [2, 3]], 20, axis=1)
    with pytest.raises(ValueError, match="flash_attention: q_segment_ids holds values that do"):
        flash_attention(padded(q), padded(k), padded(v), q_segment_ids=ids)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_queries_with_shared_keys(implementation):
    q, k, v, _, _ = _inputs(7)
    cu = _cu()
    batch = jnp.stack([q, q[::-1] * 0.5])
    f = lambda q: varlen_attention(q, k, v, cu, cu, causal=True, implementation=implementation)
    got = jax.vmap(f)(batch)
    for i in range(2):
        assert_close(got[i], _f64(f(batch[i])), _tolerance(batch[i], k), f"batch {i}")
    grads = jax.vmap(jax.grad(lambda q: jnp.sum(f(q) ** 2)))(batch)
    single = _f64(jax.grad(lambda q: jnp.sum(f(q) ** 2))(batch[1]))
    assert_close(grads[1], single, _tolerance(batch[1], k), "dq batch 1")
