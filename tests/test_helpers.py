"""jax_bridge.testing: the helpers users and tests share, on real random data."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from jax_bridge import attention_reference, flash_attention, varlen_attention
from jax_bridge.testing import (
    assert_allclose,
    generate_attention_inputs,
    get_memory_usage,
    random_document_lengths,
    timer,
)
from tests.devices import cpu_only

# ------------------------------------------------------------- generate_attention_inputs


def _check_cu_seqlens(cu: np.ndarray, total: int, num_docs: int) -> None:
    assert cu.dtype == np.int32 and cu.shape == (num_docs + 1,)
    assert cu[0] == 0 and cu[-1] == total
    assert np.all(np.diff(cu) > 0), cu  # strictly increasing: every document non-empty


@given(
    total=st.integers(1, 5000),
    fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_document_lengths_are_positive_and_sum_to_total(total, fraction, seed):
    num_docs = 1 + int(fraction * (total - 1))
    lengths = random_document_lengths(np.random.default_rng(seed), total, num_docs)
    assert lengths.dtype == np.int32 and lengths.shape == (num_docs,)
    assert lengths.min() >= 1 and lengths.sum() == total


# Few distinct shapes (each new one compiles JAX's random-number program, ~0.3 s on CPU);
# the seed and the document count vary freely, and so do the lengths they draw.
@given(
    batch=st.integers(1, 3),
    seq_len=st.sampled_from([1, 5, 48]),
    docs=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_inputs_shapes_and_cu_seqlens(batch, seq_len, docs, seed):
    docs = min(docs, seq_len)
    inputs = generate_attention_inputs(
        batch, seq_len, 4, 8, jnp.bfloat16, seed, num_kv_heads=2, layout="packed",
        docs_per_sequence=docs,
    )  # fmt: skip
    total = batch * seq_len
    assert inputs.layout == "packed" and inputs.segment_ids is None
    assert inputs.q.shape == (total, 4, 8) and inputs.k.shape == inputs.v.shape == (total, 2, 8)
    assert {x.dtype for x in (inputs.q, inputs.k, inputs.v)} == {jnp.dtype(jnp.bfloat16)}
    cu = np.asarray(inputs.cu_seqlens)
    _check_cu_seqlens(cu, total, batch * docs)
    assert inputs.num_docs == batch * docs and inputs.max_seqlen == np.diff(cu).max()


@pytest.mark.parametrize("padding", [False, True])
def test_padded_inputs_shapes_and_segment_ids(padding):
    inputs = generate_attention_inputs(
        3, 40, 6, 16, jnp.float32, jax.random.key(7), num_kv_heads=3, docs_per_sequence=3,
        padding=padding,
    )  # fmt: skip
    assert inputs.layout == "padded" and inputs.cu_seqlens is None
    assert inputs.q.shape == (3, 40, 6, 16) and inputs.k.shape == inputs.v.shape == (3, 40, 3, 16)
    assert inputs.q.dtype == jnp.float32
    ids = np.asarray(inputs.segment_ids)
    assert ids.dtype == np.int32 and ids.shape == (3, 40)
    for row in ids:
        valid = int((row > 0).sum())
        assert np.all(row[:valid] > 0) and np.all(row[valid:] == 0)  # padding only at the end
        assert valid >= 3 and (padding or valid == 40)
        assert np.all(np.diff(row[:valid]) >= 0) and set(row[:valid]) == {1, 2, 3}
    lengths = [np.bincount(row)[1:].max() for row in ids]
    assert inputs.num_docs == 9 and inputs.max_seqlen == max(lengths)


def test_inputs_are_deterministic_per_key_and_standard_normal():
    first, again, other = (
        generate_attention_inputs(2, 256, 4, 32, jnp.float32, seed, layout="packed")
        for seed in (1, 1, 2)
    )
    for name in ("q", "k", "v", "cu_seqlens"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.q, other.q)
    assert not np.array_equal(first.q, first.k)  # q, k, v from independent keys
    q = np.asarray(first.q)
    assert abs(q.mean()) < 0.05 and abs(q.std() - 1) < 0.05


def test_inputs_run_through_the_ops_in_both_layouts():
    packed = generate_attention_inputs(
        2, 64, 4, 16, jnp.float32, 0, num_kv_heads=2, layout="packed", docs_per_sequence=3
    )
    args = (packed.q, packed.k, packed.v, packed.cu_seqlens, packed.cu_seqlens)
    assert_allclose(
        varlen_attention(*args, causal=True),
        attention_reference(*args, causal=True),
        rtol=1e-5,
        atol=1e-5,
    )
    padded = generate_attention_inputs(2, 32, 4, 16, jnp.float32, 0, layout="padded", padding=True)
    out = flash_attention(padded.q, padded.k, padded.v, q_segment_ids=padded.segment_ids)
    assert out.shape == padded.q.shape and bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_heads": 3},  # does not divide 4 query heads
        {"layout": "ragged"},
        {"docs_per_sequence": 9},  # more documents than tokens per sequence
        {"docs_per_sequence": 0},
        {"head_dim": 0},
        {"head_dim": 8.0},
    ],
)
def test_inputs_reject_bad_arguments(kwargs):
    sizes = {"batch": 1, "seq_len": 8, "num_heads": 4, "head_dim": 8} | kwargs
    with pytest.raises(ValueError):
        generate_attention_inputs(**sizes)


def test_inputs_take_numpy_ints():
    inputs = generate_attention_inputs(np.int64(2), np.int32(8), 2, 4, jnp.float16, np.int64(5))
    assert inputs.q.shape == (2, 8, 2, 4) and inputs.q.dtype == jnp.float16


# ------------------------------------------------------------------------ assert_allclose


def test_assert_allclose_passes_within_tolerance_and_on_matching_nan_and_inf():
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((16, 8)).astype(np.float32)
    actual = expected * (1 + 1e-6 * rng.standard_normal(expected.shape)).astype(np.float32)
    assert_allclose(jnp.asarray(actual), expected, rtol=1e-5, atol=0)
    assert_allclose(
        jnp.asarray(actual, jnp.bfloat16), jnp.asarray(expected, jnp.bfloat16), rtol=1e-2, atol=0
    )
    special = np.array([np.nan, np.inf, -np.inf, 0.0])
    assert_allclose(special, special.copy(), rtol=0, atol=0)


def test_assert_allclose_reports_the_worst_element():
    rng = np.random.default_rng(1)
    expected = rng.standard_normal((4, 5, 6))
    actual = expected.copy()
    actual[0, 1, 2] += 0.01  # fails, but less than the next one
    actual[3, 4, 5] = expected[3, 4, 5] + 0.5
    with pytest.raises(AssertionError) as info:
        assert_allclose(actual, expected, rtol=1e-6, atol=1e-6, err_msg="layer 3 output")
    message = str(info.value)
    assert "2 of 120 elements" in message and "0 of them NaN" in message
    assert "worst at index (3, 4, 5)" in message
    assert (
        f"actual {actual[3, 4, 5].item()!r}" in message
        and f"expected {expected[3, 4, 5].item()!r}" in message
    )
    abs_error = float(re.search(r"abs error ([\d.e+-]+)", message).group(1))
    rel_error = float(re.search(r"rel error ([\d.e+-]+)", message).group(1))
    assert abs_error == pytest.approx(0.5, rel=1e-5)
    assert rel_error == pytest.approx(0.5 / abs(expected[3, 4, 5]), rel=1e-5)
    assert message.endswith("layer 3 output")


def test_with_zero_tolerance_the_largest_error_is_the_worst():
    """Every failing ratio error / tolerance is inf at rtol = atol = 0: the tie goes to
    the largest error."""
    rng = np.random.default_rng(2)
    expected = rng.standard_normal(7)
    actual = expected + np.array([0.1, 0, 4.0, 0, 0.2, 0, 0])
    with pytest.raises(AssertionError, match=r"worst at index \(2,\)"):
        assert_allclose(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("nan_in", ["actual", "expected"])
def test_assert_allclose_fails_on_nan_against_a_number(nan_in):
    values = np.arange(6.0).reshape(2, 3)
    other = values.copy()
    other[1, 0] = np.nan
    other[0, 2] += 100.0  # a huge finite error elsewhere: the NaN is still the worst
    actual, expected = (other, values) if nan_in == "actual" else (values, other)
    with pytest.raises(AssertionError) as info:
        assert_allclose(actual, expected, rtol=1e-3, atol=1e-3)
    message = str(info.value)
    assert "2 of 6 elements" in message and "1 of them NaN mismatches" in message
    assert "worst at index (1, 0)" in message and "nan" in message


def test_assert_allclose_compares_integers_past_float64s_exactly():
    # 2**62 and 2**62 + 1 are one float64: integers are compared as integers.
    with pytest.raises(AssertionError, match="1 of 1 elements"):
        assert_allclose(np.array([2**62]), np.array([2**62 + 1]), rtol=0, atol=0)
    assert_allclose(np.array([2**62]), np.array([2**62 + 1]), rtol=0, atol=1)


def test_assert_allclose_fails_on_opposite_infinities_and_on_shapes():
    with pytest.raises(AssertionError, match="1 of 2 elements"):
        assert_allclose(np.array([np.inf, 1.0]), np.array([-np.inf, 1.0]), rtol=1, atol=1)
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(3,\), expected \(1, 3\)"):
        assert_allclose(np.zeros(3), np.zeros((1, 3)), rtol=1, atol=1)


# ---------------------------------------------------------------------- timer, memory


def test_timer_measures_a_sleep():
    with timer() as clock:
        time.sleep(0.2)
    # A sleep only lower-bounds the time: on a loaded machine (xdist workers on 2 cores)
    # the wake-up can come seconds late. The upper bound tells a timer that counts the
    # sleep from one that counts something else entirely.
    assert 0.2 <= clock.seconds < 5.0


def test_timer_waits_for_the_values_it_is_handed():
    x = jax.random.normal(jax.random.key(0), (256, 256))
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(x))  # compiled outside the timed block
    with timer(x) as clock:
        with pytest.raises(RuntimeError):
            _ = clock.seconds  # only set when the block ends
        out = clock.block_on(matmul(x))
    assert out.shape == (256, 256) and 0 < clock.seconds < 5
    assert clock.block_on(1, 2) == (1, 2)


@cpu_only("a CPU device's memory is the host's RSS")
def test_memory_usage_on_cpu_is_the_host_rss():
    for device in (None, jax.devices()[0]):
        usage = get_memory_usage(device)
        assert usage and all(isinstance(v, int) and v > 0 for v in usage.values()), usage
        assert usage["host_peak_rss_bytes"] >= usage.get("host_rss_bytes", 0) > 0


_ALLOCATE_AND_MEASURE = """
import numpy as np
from jax_bridge.testing import get_memory_usage

before = get_memory_usage()
block = np.random.default_rng(0).random(64 * 2**20 // 8)  # 64 MiB, written: resident
after = get_memory_usage()
print(before.get("host_rss_bytes", -1), after.get("host_rss_bytes", -1))
print(after["host_peak_rss_bytes"])
"""


def test_memory_usage_follows_an_allocation():
    # A fresh process: in a test worker, garbage of earlier tests freed by another
    # thread between the two readings can hide the allocation (seen once in CI).
    result = subprocess.run(
        [sys.executable, "-c", _ALLOCATE_AND_MEASURE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        cwd=pathlib.Path(__file__).resolve().parents[1],
        check=True,
    )
    (before, after), (peak,) = (map(int, line.split()) for line in result.stdout.splitlines())
    if before < 0:
        pytest.skip("no /proc/self/status: only the peak is known")
    assert after - before > 32 * 2**20, (before, after)
    assert peak >= after
