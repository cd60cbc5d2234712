"""Tests for the cu_seqlens index helpers (jax_bridge.host.cu_seqlens) and their validation.

Oracles are plain numpy loops over sequences; hypothesis drives the eager path on random
length lists (with empty and length-1 sequences), and a few fixed cases check jit == eager
with static sizes so that nothing recompiles per example.
"""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import checkify

from jax_bridge.core.validation import check_cu_seqlens
from jax_bridge.host import cu_seqlens as cu_seqlens_module
from jax_bridge.host.cu_seqlens import (
    FILL_INDEX,
    chunk_bound,
    count_at_or_below,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    prepare_position_ids,
    prepare_sequence_ids,
    prepare_token_indices,
)

# Many short sequences (lots of 0 and 1), a few long ones, or a single sequence.
MAX_BATCH = 24
MAX_TOKENS = 256
lengths_lists = st.one_of(
    st.lists(st.integers(0, 3), min_size=0, max_size=MAX_BATCH),
    st.lists(st.integers(0, 50), min_size=1, max_size=4),
    st.integers(0, 64).map(lambda n: [n]),
)
chunk_sizes = st.sampled_from([1, 3, 4, 8])


def cu_from_lengths(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def padded_cu(lengths):
    """cu_seqlens of ``lengths`` followed by empty sequences up to MAX_BATCH.

    Trailing empty sequences own no tokens and no chunks, so every id computed for the real
    tokens is unchanged; the fixed shape lets one compiled function serve every example.
    """
    return cu_from_lengths(list(lengths) + [0] * (MAX_BATCH - len(lengths)))


def ref_token_indices(lengths, total_tokens):
    out = np.full((total_tokens, 2), FILL_INDEX, dtype=np.int64)
    t = 0
    for seq, n in enumerate(lengths):
        for pos in range(n):
            out[t] = (seq, pos)
            t += 1
    return out


def ref_chunk_indices(lengths, chunk_size, num_chunks):
    rows = [(seq, c) for seq, n in enumerate(lengths) for c in range(-(-n // chunk_size))]
    out = np.full((num_chunks, 2), FILL_INDEX, dtype=np.int64)
    out[: len(rows)] = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    return out


# Compiled once per static configuration and reused across hypothesis examples.
lens_fixed = jax.jit(prepare_lens)
sequence_ids_fixed = jax.jit(functools.partial(prepare_sequence_ids, total_tokens=MAX_TOKENS))
position_ids_fixed = jax.jit(functools.partial(prepare_position_ids, total_tokens=MAX_TOKENS))
token_indices_fixed = jax.jit(functools.partial(prepare_token_indices, total_tokens=MAX_TOKENS))
chunk_offsets_fixed = jax.jit(prepare_chunk_offsets, static_argnums=1)
chunk_indices_fixed = jax.jit(
    functools.partial(prepare_chunk_indices, total_tokens=MAX_TOKENS), static_argnums=1
)
lens_from_mask_fixed = jax.jit(prepare_lens_from_mask)
cu_from_mask_fixed = jax.jit(prepare_cu_seqlens_from_mask)


# ---------------------------------------------------------------- properties


@given(lengths=lengths_lists)
def test_lens_invert_cumsum(lengths):
    lens = np.asarray(lens_fixed(padded_cu(lengths)))
    np.testing.assert_array_equal(lens[: len(lengths)], np.asarray(lengths, dtype=np.int64))
    assert np.all(lens[len(lengths) :] == 0)


@given(lengths=lengths_lists)
def test_position_ids_restart_at_each_boundary_and_count_up(lengths):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1])
    pos = np.asarray(position_ids_fixed(padded_cu(lengths)))
    starts = cu[:-1][np.asarray(lengths, dtype=np.int64) > 0]
    assert np.all(pos[starts] == 0)
    not_start = np.setdiff1d(np.arange(total), starts)
    assert np.all(pos[not_start] == pos[not_start - 1] + 1)
    assert np.all(pos[total:] == FILL_INDEX)


@given(lengths=lengths_lists)
def test_sequence_ids_equal_searchsorted(lengths):
    cu = padded_cu(lengths)
    total = int(cu[-1])
    expected = np.searchsorted(cu, np.arange(total), side="right") - 1
    got = np.asarray(sequence_ids_fixed(cu))
    np.testing.assert_array_equal(got[:total], expected)
    assert np.all(got[total:] == FILL_INDEX)


@given(lengths=lengths_lists)
def test_token_indices_match_loop_and_the_id_functions(lengths):
    cu = padded_cu(lengths)
    got = np.asarray(token_indices_fixed(cu))
    np.testing.assert_array_equal(got, ref_token_indices(lengths, MAX_TOKENS))
    np.testing.assert_array_equal(got[:, 0], sequence_ids_fixed(cu))
    np.testing.assert_array_equal(got[:, 1], position_ids_fixed(cu))


@given(lengths=lengths_lists, chunk_size=chunk_sizes)
def test_chunk_indices_enumerate_cdiv_chunks_per_sequence(lengths, chunk_size):
    got = np.asarray(chunk_indices_fixed(padded_cu(lengths), chunk_size))
    counts = [-(-n // chunk_size) for n in lengths]
    # The static bound from the docstring, with MAX_BATCH sequences.
    assert got.shape == (chunk_bound(MAX_TOKENS, chunk_size, MAX_BATCH), 2)
    np.testing.assert_array_equal(got, ref_chunk_indices(lengths, chunk_size, got.shape[0]))
    # Invariants: per sequence, chunk indices are 0..count-1 in order; empty ones absent.
    for seq, count in enumerate(counts):
        np.testing.assert_array_equal(got[got[:, 0] == seq, 1], np.arange(count))
    assert np.all(got[sum(counts) :] == FILL_INDEX)


@given(lengths=lengths_lists, chunk_size=chunk_sizes, empty=st.integers(0, 300))
def test_chunk_bound_holds_every_chunk_and_ignores_empty_sequences(lengths, chunk_size, empty):
    """However many empty sequences join, the bound holds every chunk, never exceeds
    the old `cdiv(total, C) + sequences`, and never exceeds the token count (tiles >= 1
    token each) once a sequence is non-empty."""
    total = sum(lengths)
    sequences = len(lengths) + empty
    bound = chunk_bound(total, chunk_size, sequences)
    assert bound >= sum(-(-n // chunk_size) for n in lengths)
    assert bound <= -(-total // chunk_size) + sequences or (total == 0 and bound == 1)
    assert bound <= max(total, 1)
    assert bound == chunk_bound(total, chunk_size, min(sequences, total))


@given(lengths=lengths_lists, chunk_size=chunk_sizes)
def test_chunk_offsets_are_cumsum_of_counts(lengths, chunk_size):
    counts = [-(-n // chunk_size) for n in lengths] + [0] * (MAX_BATCH - len(lengths))
    expected = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    np.testing.assert_array_equal(chunk_offsets_fixed(padded_cu(lengths), chunk_size), expected)


@given(mask=hnp.arrays(np.int8, (6, 9), elements=st.integers(0, 1)))
def test_lengths_and_cu_seqlens_from_mask(mask):
    lens = lens_from_mask_fixed(mask)
    assert lens.dtype == jnp.int32
    np.testing.assert_array_equal(lens, mask.sum(axis=1))
    cu = cu_from_mask_fixed(mask.astype(bool))
    assert cu.dtype == jnp.int32
    np.testing.assert_array_equal(cu, np.concatenate([[0], np.cumsum(mask.sum(axis=1))]))


@given(lengths=lengths_lists)
def test_eager_exact_sizes_match_reference(lengths):
    # Eager calls on concrete input return exact sizes; tiny shapes keep compiles cheap.
    lengths = lengths[:3]
    cu = cu_from_lengths(lengths)
    np.testing.assert_array_equal(
        prepare_token_indices(cu), ref_token_indices(lengths, int(cu[-1]))
    )
    n_chunks = sum(-(-n // 4) for n in lengths)
    np.testing.assert_array_equal(
        prepare_chunk_indices(cu, 4), ref_chunk_indices(lengths, 4, n_chunks)
    )


def test_empty_sequence_example_from_the_issue():
    cu = np.array([0, 3, 3, 7])
    np.testing.assert_array_equal(prepare_sequence_ids(cu), [0, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(prepare_position_ids(cu), [0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(prepare_chunk_indices(cu, 2), [[0, 0], [0, 1], [2, 0], [2, 1]])
    np.testing.assert_array_equal(prepare_chunk_offsets(cu, 2), [0, 2, 2, 4])


# ---------------------------------------------------------------- jit == eager

JIT_CASES = [[3, 0, 4], [0], [1], [5, 1, 0, 0, 9, 2], [], [0, 0, 17]]


@pytest.mark.parametrize("lengths", JIT_CASES)
def test_jit_matches_eager_and_reference(lengths):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1]) + 3  # a static size with a padded tail
    chunk = 4
    bound = max(1, (total + min(len(lengths), total) * (chunk - 1)) // chunk)
    calls = {
        "lens": (prepare_lens, {}),
        "sequence_ids": (prepare_sequence_ids, {"total_tokens": total}),
        "position_ids": (prepare_position_ids, {"total_tokens": total}),
        "token_indices": (prepare_token_indices, {"total_tokens": total}),
        "chunk_offsets": (prepare_chunk_offsets, {"chunk_size": chunk}),
        "chunk_bound": (prepare_chunk_indices, {"chunk_size": chunk, "total_tokens": total}),
        "chunk_fixed": (prepare_chunk_indices, {"chunk_size": chunk, "num_chunks": bound + 2}),
    }
    results = {}
    for name, (fn, kwargs) in calls.items():
        eager = fn(cu, **kwargs)
        jitted = jax.jit(functools.partial(fn, **kwargs))(jnp.asarray(cu))
        np.testing.assert_array_equal(jitted, eager, err_msg=name)
        assert jitted.dtype == eager.dtype, name
        results[name] = np.asarray(jitted)
    tokens = ref_token_indices(lengths, total)
    np.testing.assert_array_equal(results["token_indices"], tokens)
    np.testing.assert_array_equal(results["sequence_ids"], tokens[:, 0])
    np.testing.assert_array_equal(results["position_ids"], tokens[:, 1])
    np.testing.assert_array_equal(results["chunk_bound"], ref_chunk_indices(lengths, chunk, bound))
    np.testing.assert_array_equal(
        results["chunk_fixed"], ref_chunk_indices(lengths, chunk, bound + 2)
    )


@pytest.mark.parametrize("lengths", JIT_CASES)
def test_concrete_cu_seqlens_inside_jit_give_the_exact_sizes(lengths):
    """A cu_seqlens the jitted function closes over is concrete: the sizes default to the
    exact counts as eagerly, and sizes too small for it raise at once, naming the op."""
    cu = cu_from_lengths(lengths)
    total, chunks = int(cu[-1]), sum(-(-n // 4) for n in lengths)
    tokens = ref_token_indices(lengths, total)
    for fn, want in ((prepare_sequence_ids, tokens[:, 0]), (prepare_position_ids, tokens[:, 1]),
                     (prepare_token_indices, tokens)):  # fmt: skip
        np.testing.assert_array_equal(jax.jit(lambda fn=fn: fn(cu))(), want)
        if total:
            with pytest.raises(ValueError, match=f"{fn.__name__}: total_tokens={total - 1}"):
                jax.jit(lambda fn=fn: fn(cu, total - 1))()
    got = jax.jit(lambda: prepare_chunk_indices(cu, 4))()
    np.testing.assert_array_equal(got, ref_chunk_indices(lengths, 4, chunks))
    if chunks:
        with pytest.raises(ValueError, match=f"num_chunks={chunks - 1} is smaller"):
            jax.jit(lambda: prepare_chunk_indices(cu, 4, chunks - 1))()
    if total:
        with pytest.raises(ValueError, match=f"prepare_chunk_indices: total_tokens={total - 1}"):
            jax.jit(lambda: prepare_chunk_indices(cu, 4, total_tokens=total - 1))()


def test_mask_helpers_jit_match_eager():
    mask = np.random.default_rng(0).random((5, 11)) < 0.6
    mask[2] = False
    for fn in (prepare_lens_from_mask, prepare_cu_seqlens_from_mask):
        np.testing.assert_array_equal(jax.jit(fn)(mask), fn(mask))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("cu", "error", "match"),
    [
        (np.array([0.0, 2.0, 5.0]), TypeError, "cu_seqlens.*integer"),
        (np.array([False, True]), TypeError, "cu_seqlens.*integer"),
        (np.array([0, 2, 5], dtype=np.uint32), TypeError, "cu_seqlens.*signed"),
        (np.array([[0, 2, 5]]), ValueError, r"cu_seqlens.*\[batch \+ 1\]"),
        (np.array([], dtype=np.int32), ValueError, "cu_seqlens.*at least one"),
        (np.array([1, 3, 5]), ValueError, "cu_seqlens must start at 0"),
        (np.array([0, 5, 3, 6]), ValueError, "cu_seqlens must be non-decreasing"),
    ],
)
def test_bad_cu_seqlens_raise_eagerly(cu, error, match):
    for fn in (prepare_lens, prepare_sequence_ids, prepare_position_ids, prepare_token_indices):
        with pytest.raises(error, match=match):
            fn(cu)
    for fn in (prepare_chunk_offsets, prepare_chunk_indices):
        with pytest.raises(error, match=match):
            fn(cu, 4)


def test_dtype_and_rank_errors_raise_at_trace_time():
    with pytest.raises(TypeError, match="cu_seqlens"):
        jax.jit(functools.partial(prepare_position_ids, total_tokens=4))(jnp.zeros(3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        jax.jit(prepare_lens)(jnp.zeros((2, 3), jnp.int32))


@pytest.mark.parametrize(
    ("chunk_size", "error"),
    [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)],
)
def test_bad_chunk_size(chunk_size, error):
    cu = np.array([0, 3, 7])
    for fn in (prepare_chunk_offsets, prepare_chunk_indices):
        with pytest.raises(error, match="chunk_size"):
            fn(cu, chunk_size)


def test_static_sizes_required_and_checked():
    cu = np.array([0, 3, 7])
    with pytest.raises(ValueError, match="total_tokens must be given"):
        jax.jit(prepare_position_ids)(cu)
    with pytest.raises(ValueError, match="num_chunks or total_tokens"):
        jax.jit(prepare_chunk_indices, static_argnums=1)(cu, 2)
    with pytest.raises(TypeError, match=r"total_tokens.*static"):
        jax.jit(prepare_sequence_ids)(cu, jnp.int32(7))
    with pytest.raises(ValueError, match="total_tokens=6"):
        prepare_token_indices(cu, total_tokens=6)
    with pytest.raises(ValueError, match="num_chunks=3"):
        prepare_chunk_indices(cu, 2, num_chunks=3)
    with pytest.raises(ValueError, match="total_tokens must be >= 0"):
        prepare_chunk_indices(cu, 2, total_tokens=-1)


def test_bad_masks():
    with pytest.raises(TypeError, match="mask"):
        prepare_lens_from_mask(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"mask.*\[batch, seq\]"):
        prepare_lens_from_mask(np.ones(3, bool))
    with pytest.raises(TypeError, match="out_dtype"):
        prepare_cu_seqlens_from_mask(np.ones((2, 3), bool), out_dtype=jnp.float32)


@pytest.mark.parametrize(
    ("cu", "fn", "match"),
    [
        ([0, 5, 3, 6], functools.partial(prepare_position_ids, total_tokens=8), "non-decreasing"),
        ([2, 3, 6], functools.partial(prepare_sequence_ids, total_tokens=8), "start at 0"),
        ([0, 3, 9], functools.partial(prepare_token_indices, total_tokens=8), "total_tokens=8"),
        (
            [0, 3, 9],
            functools.partial(prepare_chunk_indices, chunk_size=2, num_chunks=4),
            "num_chunks=4",
        ),
        ([0, 5, 3, 6], functools.partial(prepare_chunk_offsets, chunk_size=2), "non-decreasing"),
    ],
)
def test_traced_value_errors_are_reported_by_checkify(cu, fn, match):
    checked = jax.jit(checkify.checkify(fn))
    err, _ = checked(jnp.asarray(cu, jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        err.throw()
    good_err, _ = checked(jnp.asarray([0, 1, 1, 2], jnp.int32))
    assert good_err.get() is None


def test_check_cu_seqlens_names_the_argument_it_was_given():
    out = check_cu_seqlens([0, 2, 2, 5], name="cu_seqlens_k")
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(out, [0, 2, 2, 5])
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        check_cu_seqlens([0, 2, 1], name="cu_seqlens_k")
    with pytest.raises(TypeError, match="cu_seqlens_k must have a signed integer"):
        check_cu_seqlens(np.array([0.0, 1.0]), name="cu_seqlens_k")


@functools.partial(jax.jit, static_argnums=1)
def _count_jitted(boundaries, length):
    return count_at_or_below(boundaries, length)


@given(
    boundaries=st.lists(st.integers(-3, 40), min_size=0, max_size=12),
    sort=st.booleans(),
    compare_all=st.booleans(),
)
def test_count_at_or_below_is_searchsorted_right_without_a_loop(boundaries, sort, compare_all):
    """Sorted: searchsorted(side="right"), as the index helpers used it; any order: the
    count it is defined as. Boundaries below 0 and at or past `length` included. Both
    forms: every pair compared (short lists) and the scatter-add and cumsum."""
    values = np.asarray(sorted(boundaries) if sort else boundaries, np.int32)
    length = 32 if compare_all else cu_seqlens_module.COMPARE_ALL_LIMIT // 12 + 1
    # Padded to a fixed size with boundaries past `length` (never counted): one compile.
    padded = np.concatenate([values, np.full(12 - len(values), length + 5, np.int32)])
    got = np.asarray(_count_jitted(jnp.asarray(padded), length))
    t = np.arange(length)
    np.testing.assert_array_equal(got, (values[None, :] <= t[:, None]).sum(1))
    if sort:
        np.testing.assert_array_equal(got, np.searchsorted(values, t, side="right"))
    assert got.dtype == np.int32
