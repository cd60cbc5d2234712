"""Load-balanced context-parallel order, checked against a numpy chunk construction."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_bridge.host.context_parallel import (
    inverse_load_balanced_positions,
    load_balanced_positions,
    reorder_sequence,
)

cp_sizes = st.integers(1, 6)
chunk_lens = st.integers(0, 3)


def numpy_balanced_order(seq_len: int, cp_size: int) -> np.ndarray:
    """Original positions in balanced order: rank r takes chunks r and 2cp-1-r."""
    chunks = np.split(np.arange(seq_len), 2 * cp_size)
    return np.concatenate([np.concatenate([chunks[r], chunks[-1 - r]]) for r in range(cp_size)])


@given(cp_size=cp_sizes, chunk_len=chunk_lens)
def test_positions_match_the_chunk_construction(cp_size, chunk_len):
    seq_len = 2 * cp_size * chunk_len
    positions = load_balanced_positions(seq_len, cp_size)
    inverse = inverse_load_balanced_positions(seq_len, cp_size)

    assert positions.dtype == inverse.dtype == np.int32
    assert positions.shape == inverse.shape == (seq_len,)
    np.testing.assert_array_equal(positions, numpy_balanced_order(seq_len, cp_size))
    np.testing.assert_array_equal(np.sort(positions), np.arange(seq_len))
    np.testing.assert_array_equal(positions[inverse], np.arange(seq_len))
    np.testing.assert_array_equal(inverse[positions], np.arange(seq_len))

    # Each rank's causal work, sum over its tokens of (position + 1), is the same.
    work_per_rank = (positions.reshape(cp_size, -1) + 1).sum(axis=1)
    assert (work_per_rank == work_per_rank[0]).all()


@given(
    cp_size=cp_sizes,
    chunk_len=st.integers(1, 3),
    rank=st.integers(1, 3),
    seq_dim_choice=st.integers(0, 2),
    negative=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_reorder_gives_each_rank_its_two_chunks(
    cp_size, chunk_len, rank, seq_dim_choice, negative, seed
):
    seq_dim = seq_dim_choice % rank
    seq_len = 2 * cp_size * chunk_len
    shape = [2, 3, 2][:rank]
    shape[seq_dim] = seq_len
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    dim_arg = seq_dim - rank if negative else seq_dim

    balanced = np.asarray(reorder_sequence(x, cp_size, seq_dim=dim_arg))
    np.testing.assert_array_equal(
        balanced, np.take(x, numpy_balanced_order(seq_len, cp_size), axis=seq_dim)
    )
    chunks = np.split(x, 2 * cp_size, axis=seq_dim)
    for r, rank_slice in enumerate(np.split(balanced, cp_size, axis=seq_dim)):
        expected = np.concatenate([chunks[r], chunks[2 * cp_size - 1 - r]], axis=seq_dim)
        np.testing.assert_array_equal(rank_slice, expected)

    back = reorder_sequence(balanced, cp_size, seq_dim=dim_arg, to_contiguous=True)
    np.testing.assert_array_equal(np.asarray(back), x)


@given(cp_size=cp_sizes, seed=st.integers(0, 2**32 - 1))
def test_to_contiguous_is_the_exact_inverse_both_ways(cp_size, seed):
    x = np.random.default_rng(seed).integers(-100, 100, size=(3, 4 * cp_size), dtype=np.int32)
    there = reorder_sequence(x, cp_size)
    assert there.dtype == np.int32
    np.testing.assert_array_equal(reorder_sequence(there, cp_size, to_contiguous=True), x)
    here = reorder_sequence(x, cp_size, to_contiguous=True)
    np.testing.assert_array_equal(reorder_sequence(here, cp_size), x)


def test_cp_size_one_is_the_identity():
    x = np.random.default_rng(0).standard_normal((2, 6, 3)).astype(np.float32)
    np.testing.assert_array_equal(load_balanced_positions(6, 1), np.arange(6))
    np.testing.assert_array_equal(reorder_sequence(x, 1), x)


def test_jit_equals_eager():
    x = np.random.default_rng(1).standard_normal((2, 12, 5)).astype(np.float32)
    reorder = jax.jit(reorder_sequence, static_argnames=("cp_size", "seq_dim", "to_contiguous"))
    np.testing.assert_array_equal(reorder(x, cp_size=3), reorder_sequence(x, 3))
    roundtrip = jax.jit(
        lambda x: reorder_sequence(reorder_sequence(x, 2, seq_dim=-1), 2, -1, to_contiguous=True)
    )
    y = x[:, :, :4]
    np.testing.assert_array_equal(roundtrip(y), y)


def test_gradient_flows_back_through_the_inverse_permutation():
    x = np.random.default_rng(2).standard_normal((1, 8)).astype(np.float32)
    weights = np.random.default_rng(3).standard_normal((1, 8)).astype(np.float32)
    grad = jax.grad(lambda x: (reorder_sequence(x, 2) * weights).sum())(x)
    # d/dx_p of sum_i w_i x_{positions[i]} is w at the index holding p.
    np.testing.assert_allclose(grad, weights[:, inverse_load_balanced_positions(8, 2)])


reorder_8x2 = functools.partial(reorder_sequence, np.zeros((8, 2)), 2)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (functools.partial(reorder_sequence, np.zeros((2, 8)), 0), ValueError, "cp_size"),
        (functools.partial(reorder_sequence, np.zeros((2, 8)), -2), ValueError, "cp_size"),
        (functools.partial(reorder_sequence, np.zeros((2, 8)), 2.0), TypeError, "cp_size"),
        (functools.partial(reorder_sequence, np.zeros((2, 8)), True), TypeError, "cp_size"),
        (functools.partial(reorder_sequence, np.zeros((2, 6)), 2), ValueError, r"x\.shape\[1\]"),
        (
            functools.partial(reorder_sequence, np.zeros((8, 2)), 2, seq_dim=2),
            ValueError,
            "seq_dim",
        ),
        (
            functools.partial(reorder_sequence, np.zeros((8, 2)), 2, seq_dim=-3),
            ValueError,
            "seq_dim",
        ),
        (functools.partial(reorder_sequence, np.zeros(()), 1, seq_dim=0), ValueError, "seq_dim"),
        (functools.partial(reorder_sequence, np.zeros((8,)), 1, seq_dim=0.0), TypeError, "seq_dim"),
        (
            functools.partial(reorder_sequence, np.zeros((8,)), 1, 0, to_contiguous="no"),
            TypeError,
            "reorder_sequence: to_contiguous must be a bool",
        ),
        (functools.partial(load_balanced_positions, 10, 3), ValueError, "seq_len"),
        (functools.partial(load_balanced_positions, -4, 1), ValueError, "seq_len"),
        (functools.partial(inverse_load_balanced_positions, 8, 0), ValueError, "cp_size"),
    ],
)
def test_bad_input_is_rejected(call, error, match):
    with pytest.raises(error, match=match):
        call()
