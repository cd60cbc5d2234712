"""Segment ids <-> masks, checked against numpy loops written from the definitions."""

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_bridge.host.segment_ids import (
    SegmentMasks,
    is_segment_mask,
    mask_to_segment_ids,
    segment_ids_to_mask,
)


class Described(NamedTuple):
    q_ids: np.ndarray
    kv_ids: np.ndarray
    rebuilt: np.ndarray  # segment_ids_to_mask((q_ids, kv_ids))
    is_segment: bool


@functools.partial(jax.jit, static_argnames="per_head")
def _describe(mask, per_head):
    q_ids, kv_ids = mask_to_segment_ids(mask, per_head=per_head)
    rebuilt = segment_ids_to_mask((q_ids, kv_ids))
    return q_ids, kv_ids, rebuilt, is_segment_mask(mask, per_head=per_head)


def describe(mask: np.ndarray, per_head: bool = False) -> Described:
    """Everything the tests look at, under one jit: hypothesis draws shapes from small
    fixed sets, so each shape compiles once for the whole module."""
    q_ids, kv_ids, rebuilt, is_segment = _describe(mask, per_head=per_head)
    assert q_ids.dtype == kv_ids.dtype == jnp.int32
    return Described(np.asarray(q_ids), np.asarray(kv_ids), np.asarray(rebuilt), bool(is_segment))


# (Q, K) pairs: length-1 axes, non-square, and K > 512 so rows span several sort steps.
MASK_SHAPES_2D = [(1, 1), (1, 6), (7, 1), (8, 8), (13, 29), (24, 600)]
seeds = st.integers(0, 2**32 - 1)


# ---------------------------------------------------------------- numpy oracles


def loop_mask(q_ids: np.ndarray, kv_ids: np.ndarray) -> np.ndarray:
    """[Q], [K] -> [Q, K] by definition: equal ids, both positive."""
    mask = np.zeros((len(q_ids), len(kv_ids)), dtype=bool)
    for i, q in enumerate(q_ids):
        for j, kv in enumerate(kv_ids):
            mask[i, j] = q > 0 and kv > 0 and q == kv
    return mask


def loop_ids(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[Q, K] -> ids as documented: rows numbered by first appearance, keys take the id
    of their first attending row, empty rows/columns -1."""
    id_of_pattern: dict[bytes, int] = {}
    q_ids = np.full(mask.shape[0], -1, dtype=np.int32)
    for i, row in enumerate(mask):
        if row.any():
            q_ids[i] = id_of_pattern.setdefault(row.tobytes(), len(id_of_pattern) + 1)
    kv_ids = np.full(mask.shape[1], -1, dtype=np.int32)
    for j in range(mask.shape[1]):
        attending = np.flatnonzero(mask[:, j])
        if attending.size:
            kv_ids[j] = q_ids[attending[0]]
    return q_ids, kv_ids


def brute_force_is_segment_mask(mask: np.ndarray) -> bool:
    """Any two non-empty rows attend the same keys or disjoint keys."""
    rows = [row for row in mask if row.any()]
    return all(
        np.array_equal(a, b) or not (a & b).any() for a, b in itertools.combinations(rows, 2)
    )


def assert_ids_equal(got, expected) -> None:
    for got_ids, expected_ids in zip(got, expected, strict=True):
        np.testing.assert_array_equal(got_ids, expected_ids)


def random_segment_mask(rng: np.random.Generator, q_len: int, kv_len: int) -> np.ndarray:
    """A segment mask with padding, built one of two ways: independent random ids for
    queries and keys, or a sorted block-diagonal mask with rows and columns shuffled."""
    num_segments = int(rng.integers(1, 6))
    q_ids = rng.integers(-1, num_segments + 1, size=q_len)
    kv_ids = rng.integers(-1, num_segments + 1, size=kv_len)
    if rng.random() < 0.5:
        mask = loop_mask(np.sort(q_ids), np.sort(kv_ids))
        return mask[rng.permutation(q_len)][:, rng.permutation(kv_len)]
    return loop_mask(q_ids, kv_ids)


# ---------------------------------------------------------------- segment_ids_to_mask


@given(
    seed=seeds,
    batch_shape=st.sampled_from([(), (3,), (2, 2)]),
    q_len=st.sampled_from([0, 1, 7]),
    kv_len=st.sampled_from([1, 9]),
    paired=st.booleans(),
    dtype=st.sampled_from([jnp.bool_, jnp.int32, jnp.float32]),
)
def test_segment_ids_to_mask_matches_loop(seed, batch_shape, q_len, kv_len, paired, dtype):
    rng = np.random.default_rng(seed)
    q_ids = rng.integers(-2, 4, size=(*batch_shape, q_len)).astype(np.int32)
    kv_ids = rng.integers(-2, 4, size=(*batch_shape, kv_len)).astype(np.int32)
    if not paired:
        kv_ids = q_ids
    got = np.asarray(segment_ids_to_mask((q_ids, kv_ids) if paired else q_ids, dtype=dtype))

    assert got.dtype == jnp.dtype(dtype)
    assert got.shape == (*batch_shape, q_ids.shape[-1], kv_ids.shape[-1])
    num_batches = int(np.prod(batch_shape))
    flat_q = q_ids.reshape(num_batches, q_ids.shape[-1])
    flat_kv = kv_ids.reshape(num_batches, kv_ids.shape[-1])
    flat_got = got.reshape(num_batches, q_ids.shape[-1], kv_ids.shape[-1])
    for q, kv, m in zip(flat_q, flat_kv, flat_got, strict=True):
        np.testing.assert_array_equal(m != 0, loop_mask(q, kv))
        # Padding attends nothing and is attended by nothing.
        assert not m[q <= 0].any() and not m[:, kv <= 0].any()


@given(seed=seeds, q_len=st.sampled_from([0, 1, 6]), kv_len=st.sampled_from([1, 5]))
def test_separate_masks_are_the_valid_sides(seed, q_len, kv_len):
    rng = np.random.default_rng(seed)
    q_ids = rng.integers(-1, 3, size=(2, q_len))
    kv_ids = rng.integers(-1, 3, size=(2, kv_len))
    out = segment_ids_to_mask((q_ids, kv_ids), dtype=jnp.float32, return_separate_masks=True)

    assert isinstance(out, SegmentMasks)
    # The documented order: a migrating user's `q_mask, kv_mask, mask = ...` binds right.
    q_valid, kv_valid, mask = (np.asarray(a) for a in out)
    assert out._fields == ("q_mask", "kv_mask", "attention_mask")
    assert q_valid.shape == q_ids.shape and kv_valid.shape == kv_ids.shape
    assert mask.dtype == q_valid.dtype == kv_valid.dtype == np.float32
    np.testing.assert_array_equal(q_valid, q_ids > 0)
    np.testing.assert_array_equal(kv_valid, kv_ids > 0)
    same = q_ids[:, :, None] == kv_ids[:, None, :]
    np.testing.assert_array_equal(mask, same * q_valid[:, :, None] * kv_valid[:, None, :])


def test_pair_leading_dims_broadcast():
    rng = np.random.default_rng(0)
    q_ids = rng.integers(0, 3, size=(1, 5))
    kv_ids = rng.integers(0, 3, size=(4, 6))
    got = np.asarray(segment_ids_to_mask((q_ids, kv_ids)))
    assert got.shape == (4, 5, 6)
    for b in range(4):
        np.testing.assert_array_equal(got[b], loop_mask(q_ids[0], kv_ids[b]))


def test_unsigned_ids_treat_zero_as_padding():
    ids = np.array([0, 2, 2, 0, 1], dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(segment_ids_to_mask(ids)), loop_mask(ids, ids))


@pytest.mark.parametrize(
    ("segment_ids", "error", "match"),
    [
        (np.array([1.0, 2.0]), TypeError, "segment_ids must hold integer"),
        (np.array([True, False]), TypeError, "segment_ids must hold integer"),
        (np.array(3), ValueError, "segment_ids must have shape"),
        ((np.arange(3), np.arange(3), np.arange(3)), ValueError, "pair"),
        ((np.arange(3), np.ones(3)), TypeError, "kv_segment_ids must hold integer"),
        ((np.zeros((2, 3), int), np.zeros((3, 3), int)), ValueError, "broadcastable"),
    ],
)
def test_segment_ids_to_mask_rejects_bad_input(segment_ids, error, match):
    with pytest.raises(error, match=match):
        segment_ids_to_mask(segment_ids)


def test_a_list_of_ints_is_one_id_array_and_a_sequence_of_arrays_a_pair():
    ids = [1, 2, 2, 0]
    expected = segment_ids_to_mask(np.asarray(ids))
    np.testing.assert_array_equal(segment_ids_to_mask(ids), expected)
    np.testing.assert_array_equal(segment_ids_to_mask(ids[:2]), expected[:2, :2])
    pair = segment_ids_to_mask([np.asarray(ids[:2]), np.asarray(ids)])
    np.testing.assert_array_equal(pair, expected[:2])


def test_segment_ids_to_mask_rejects_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        segment_ids_to_mask(np.arange(3), dtype="not a dtype")


# ---------------------------------------------------------------- mask_to_segment_ids


@given(seed=seeds, shape=st.sampled_from(MASK_SHAPES_2D))
def test_segment_masks_round_trip(seed, shape):
    mask = random_segment_mask(np.random.default_rng(seed), *shape)
    got = describe(mask)

    np.testing.assert_array_equal(got.rebuilt, mask)
    assert got.is_segment
    assert_ids_equal((got.q_ids, got.kv_ids), loop_ids(mask))


@given(seed=seeds, shape=st.sampled_from(MASK_SHAPES_2D), density=st.sampled_from([0.1, 0.5]))
def test_ids_of_any_mask_follow_the_numbering_rules(seed, shape, density):
    mask = np.random.default_rng(seed).random(shape) < density
    got = describe(mask)
    q_ids, kv_ids = got.q_ids, got.kv_ids

    assert_ids_equal((q_ids, kv_ids), loop_ids(mask))
    # The rules, stated directly: -1 exactly on empty rows/columns; positive ids first
    # appear in the order 1, 2, 3, ...; rows share an id iff their patterns are equal;
    # equal columns share an id.
    np.testing.assert_array_equal(q_ids == -1, ~mask.any(axis=1))
    np.testing.assert_array_equal(kv_ids == -1, ~mask.any(axis=0))
    positive = q_ids[q_ids > 0]
    _, first = np.unique(positive, return_index=True)
    np.testing.assert_array_equal(positive[np.sort(first)], np.arange(1, len(first) + 1))
    _, row_pattern = np.unique(mask[q_ids > 0], axis=0, return_inverse=True)
    pattern_id_pairs = set(zip(row_pattern.ravel(), positive, strict=True))
    assert len(pattern_id_pairs) == len(set(positive)) == len(set(row_pattern.ravel()))
    _, column_pattern = np.unique(mask, axis=1, return_inverse=True)
    assert len(set(zip(column_pattern.ravel(), kv_ids, strict=True))) == len(
        set(column_pattern.ravel())
    )
    assert got.is_segment == brute_force_is_segment_mask(mask)


def test_rows_differing_only_past_the_first_sort_step_get_distinct_ids():
    # 24 rows share their first 1000 columns and differ in one late column, in pairs.
    rng = np.random.default_rng(1)
    head = rng.random(1000) < 0.5
    mask = np.tile(np.concatenate([head, np.zeros(100, bool)]), (24, 1))
    mask[np.arange(24), 1000 + np.arange(24) // 2] = True
    np.testing.assert_array_equal(describe(mask).q_ids, np.arange(24) // 2 + 1)


@given(seed=seeds, heads_agree=st.booleans())
def test_batched_masks_match_each_slice(seed, heads_agree):
    rng = np.random.default_rng(seed)
    batch, heads, q_len, kv_len = 2, 3, 7, 9
    masks = np.stack(
        [
            np.stack([random_segment_mask(rng, q_len, kv_len) for _ in range(heads)])
            for _ in range(batch)
        ]
    )
    if heads_agree:
        masks[:] = masks[:, :1]

    slices, per_head, union = describe(masks[:, 0]), describe(masks, True), describe(masks)
    assert per_head.q_ids.shape == (batch, heads, q_len)
    assert per_head.kv_ids.shape == (batch, heads, kv_len)
    assert union.q_ids.shape == (batch, q_len) and union.kv_ids.shape == (batch, kv_len)
    for b in range(batch):
        assert_ids_equal((slices.q_ids[b], slices.kv_ids[b]), loop_ids(masks[b, 0]))
        assert_ids_equal((union.q_ids[b], union.kv_ids[b]), loop_ids(masks[b].any(axis=0)))
        for h in range(heads):
            assert_ids_equal((per_head.q_ids[b, h], per_head.kv_ids[b, h]), loop_ids(masks[b, h]))

    # Every head is a segment mask; one set of ids serves all heads only when they agree.
    np.testing.assert_array_equal(per_head.rebuilt, masks)
    assert per_head.is_segment and slices.is_segment
    heads_equal = all(np.array_equal(masks[:, h], masks[:, 0]) for h in range(heads))
    assert union.is_segment == heads_equal
    if heads_agree:
        np.testing.assert_array_equal(union.rebuilt, masks[:, 0])


def test_numeric_masks_count_nonzero_as_attend():
    rng = np.random.default_rng(2)
    mask = random_segment_mask(rng, 6, 5)
    weights = np.where(mask, rng.uniform(0.5, 2.0, mask.shape), 0.0).astype(np.float32)
    assert_ids_equal(mask_to_segment_ids(weights), loop_ids(mask))
    assert bool(is_segment_mask(weights.astype(np.int32) * 3))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0), (2, 0, 5), (2, 3, 4, 0)])
def test_empty_masks_are_all_padding(shape):
    mask = np.zeros(shape, dtype=bool)
    q_ids, kv_ids = mask_to_segment_ids(mask, per_head=len(shape) == 4)
    assert q_ids.shape == shape[:-1] and kv_ids.shape == (*shape[:-2], shape[-1])
    assert (np.asarray(q_ids) == -1).all() and (np.asarray(kv_ids) == -1).all()
    assert bool(is_segment_mask(mask))


def test_jit_equals_eager():
    rng = np.random.default_rng(3)
    mask = random_segment_mask(rng, 8, 8)
    mask[0, 0] = ~mask[0, 0]  # usually breaks the segment structure; either way must agree
    got = describe(mask)
    assert_ids_equal(mask_to_segment_ids(mask), (got.q_ids, got.kv_ids))
    np.testing.assert_array_equal(segment_ids_to_mask((got.q_ids, got.kv_ids)), got.rebuilt)
    assert bool(is_segment_mask(mask)) == got.is_segment == brute_force_is_segment_mask(mask)


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (np.ones(4, bool), ValueError, r"\[Q, K\]"),
        (np.ones((1, 1, 1, 2, 2), bool), ValueError, r"\[B, H, Q, K\]"),
        (np.array([["a", "b"]]), TypeError, "mask must be bool or numeric"),
    ],
)
def test_mask_to_segment_ids_rejects_bad_input(mask, error, match):
    with pytest.raises(error, match=match):
        mask_to_segment_ids(mask)


def test_per_head_needs_a_head_axis():
    with pytest.raises(ValueError, match="per_head"):
        mask_to_segment_ids(np.eye(3, dtype=bool)[None], per_head=True)


# ---------------------------------------------------------------- is_segment_mask


@given(seed=seeds, shape=st.sampled_from(MASK_SHAPES_2D[:5]), density=st.floats(0.05, 0.6))
def test_is_segment_mask_matches_brute_force(seed, shape, density):
    rng = np.random.default_rng(seed)
    mask = rng.random(shape) < density
    assert describe(mask).is_segment == brute_force_is_segment_mask(mask)

    # A segment mask stops being one when a query also attends a key of another segment.
    segment = random_segment_mask(rng, *shape)
    attending_rows = np.flatnonzero(segment.any(axis=1))
    if attending_rows.size:
        row = rng.choice(attending_rows)
        foreign_keys = np.flatnonzero(segment.any(axis=0) & ~segment[row])
        if foreign_keys.size:
            segment[row, rng.choice(foreign_keys)] = True
            assert not describe(segment).is_segment


@pytest.mark.parametrize("size", [1, 8])
def test_causal_and_banded_masks_are_not_segment_masks(size):
    causal = np.tril(np.ones((size, size), dtype=bool))
    band = causal & ~np.tril(causal, -2)  # attend self and the previous token
    # A single token is trivially one segment; anything longer has nested rows.
    assert describe(causal).is_segment == (size == 1) == brute_force_is_segment_mask(causal)
    assert describe(band).is_segment == (size == 1) == brute_force_is_segment_mask(band)


def test_single_segment_and_identity_are_segment_masks():
    for mask in (np.ones((13, 29), bool), np.eye(8, dtype=bool)):
        got = describe(mask)
        assert got.is_segment
        np.testing.assert_array_equal(got.rebuilt, mask)
