"""The work lists of the Triton attention kernels (`jax_bridge.attention.schedule`).

Invariant, for both builders (the schedule kernel, and XLA past 64 sequences): the
extended cu_seqlens are the given ones made non-decreasing and clipped to [0, total],
framed by a head and a tail sequence on each axis; every tile of every extended sequence
is listed exactly once, then (-1, -1) rows; with a right bound (causal) rows go by
descending span (t + 1 for a query tile, n - t for a key tile), ties in packed order;
without one, in packed order. The oracle is a numpy loop and Python's sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_bridge.attention import schedule
from jax_bridge.host.cu_seqlens import chunk_bound
from triton_kernels.flash_attention.config import AttentionFeatures

BATCH = 6
TOTAL_Q, TOTAL_K = 90, 70
CAUSAL, PLAIN = AttentionFeatures(causal=True), AttentionFeatures()


def extended_boundaries(cu: np.ndarray, total: int, key_side: bool) -> np.ndarray:
    cu = np.clip(np.maximum.accumulate(cu), 0, total)
    if key_side:
        return np.concatenate([[0, 0], cu, [cu[-1], total]]).astype(np.int32)
    return np.concatenate([[0, cu[0]], cu, [total, total]]).astype(np.int32)


def oracle_tiles(ext: np.ndarray, block: int, rows: int, heaviest_first: bool, query_side: bool):
    counts = [-(-int(n) // block) for n in np.diff(ext)]
    tiles = [(s, t) for s, n in enumerate(counts) for t in range(n)]
    if heaviest_first:
        span = (lambda s, t: t + 1) if query_side else (lambda s, t: counts[s] - t)
        tiles.sort(key=lambda st_: -span(*st_))  # stable: ties keep packed order
    return np.array(tiles + [(-1, -1)] * (rows - len(tiles)), np.int32).reshape(rows, 2)


# Valid cu_seqlens (empty and length-1 sequences, rows past the last one), or any values.
def valid_cu(total: int):
    return st.lists(st.integers(0, total), min_size=BATCH + 1, max_size=BATCH + 1).map(sorted)


any_cu = st.lists(st.integers(-20, 120), min_size=BATCH + 1, max_size=BATCH + 1)
blocks = st.sampled_from([1, 3, 16, 32])
SCHEDULE_ARGUMENTS = dict(
    cu_q=st.one_of(valid_cu(TOTAL_Q), any_cu),
    cu_k=st.one_of(valid_cu(TOTAL_K), any_cu),
    query_block=blocks,
    key_block=blocks,
    causal=st.booleans(),
)


@functools.cache
def _kernel_schedule(query_block: int, key_block: int, causal: bool):
    features = CAUSAL if causal else PLAIN

    def lists(cu_q, cu_k):
        s = schedule.tile_schedule(cu_q, cu_k, TOTAL_Q, TOTAL_K, query_block, key_block, features)
        assert not s.persistent
        return s.cu_q, s.cu_k, s.query_tiles, s.key_tiles

    arrays = jax.jit(lists)
    return lambda cu_q, cu_k: schedule.TileSchedule(*arrays(cu_q, cu_k), persistent=False)


def check_lists(got, cu_q, cu_k, query_block, key_block, causal, totals=(TOTAL_Q, TOTAL_K)):
    """`got` (a TileSchedule) against the oracle, for packed lengths `totals`."""
    total_q, total_k = totals
    ext_q = extended_boundaries(np.asarray(cu_q), total_q, key_side=False)
    ext_k = extended_boundaries(np.asarray(cu_k), total_k, key_side=True)
    np.testing.assert_array_equal(got.cu_q, ext_q)
    np.testing.assert_array_equal(got.cu_k, ext_k)
    sequences = len(cu_q) + 3  # B + 4
    rows_q = chunk_bound(total_q, query_block, sequences)
    rows_k = chunk_bound(total_k, key_block, sequences)
    want_q = oracle_tiles(ext_q, query_block, rows_q, causal, query_side=True)
    want_k = oracle_tiles(ext_k, key_block, rows_k, causal, query_side=False)
    np.testing.assert_array_equal(got.query_tiles, want_q)
    np.testing.assert_array_equal(got.key_tiles, want_k)


@given(**SCHEDULE_ARGUMENTS)
def test_schedule_kernel_lists_every_tile_once_heaviest_first(
    cu_q, cu_k, query_block, key_block, causal
):
    cu_q, cu_k = np.array(cu_q, np.int32), np.array(cu_k, np.int32)
    got = _kernel_schedule(query_block, key_block, causal)(cu_q, cu_k)
    check_lists(got, cu_q, cu_k, query_block, key_block, causal)


@given(**SCHEDULE_ARGUMENTS)
def test_xla_lists_are_the_schedule_kernels(cu_q, cu_k, query_block, key_block, causal):
    """The builder for many sequences (persistent launches), on the same invariant."""
    features = CAUSAL if causal else PLAIN
    ext_q, ext_k = schedule._with_tail_sequences(jnp.asarray(cu_q), jnp.asarray(cu_k),
                                                 TOTAL_Q, TOTAL_K)  # fmt: skip
    got = schedule.TileSchedule(
        ext_q,
        ext_k,
        schedule._xla_tiles(ext_q, TOTAL_Q, query_block, features, query_side=True),
        schedule._xla_tiles(ext_k, TOTAL_K, key_block, features, query_side=False),
        persistent=True,
    )
    check_lists(got, cu_q, cu_k, query_block, key_block, causal)


def test_many_sequences_take_the_xla_lists_and_persistent_programs():
    """Past 64 extended sequences the kernel's one-program vectors would be long: XLA
    builds the lists, and the forward's list alone is built without a key list."""
    lengths = np.full(70, 3)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    got = schedule.tile_schedule(cu, cu, 210, 210, 16, None, CAUSAL)
    assert got.persistent and got.key_tiles is None
    ext = extended_boundaries(np.asarray(cu), 210, key_side=False)
    want = oracle_tiles(ext, 16, chunk_bound(210, 16, 74), True, query_side=True)
    np.testing.assert_array_equal(got.query_tiles, want)
    few = schedule.tile_schedule(cu[:8], cu[:8], 210, 210, 16, None, CAUSAL)
    assert not few.persistent and few.key_tiles is None


@pytest.mark.parametrize("batch", [0, 1, 60])
def test_schedule_kernel_at_the_batch_sizes_it_takes(batch):
    """No sequence, one, and the most the kernel takes (60: 64 extended sequences, 128
    slots), valid and garbage cu_seqlens, causal: the oracle's lists."""
    rng = np.random.default_rng(batch)
    lengths = rng.integers(0, 40, batch)
    valid = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    garbage = rng.integers(-30, 3000, batch + 1).astype(np.int32)
    total = int(valid[-1]) + 7
    for cu in (valid, garbage):
        got = schedule.tile_schedule(jnp.asarray(cu), jnp.asarray(cu), total, total, 16, 32, CAUSAL)
        assert not got.persistent
        check_lists(got, cu, cu, 16, 32, True, totals=(total, total))
