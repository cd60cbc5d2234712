"""The splash mask algebra (`pallas_tpu.splash.masks`) against dense arrays built here.

Every expected array is built independently of the package: `np.tril` / `np.triu` for
causal, local and prefix-LM masks, broadcasting of the documented rules for chunks and
documents, explicit loops for the predicates of `PredicateMask`,
and `jax_bridge.allowed_mask` (the project's attention oracle) for documents. Nothing
here calls a mask's own `evaluate` except through the public `mask[:, :]` slicing.
"""

from __future__ import annotations

import dataclasses
import operator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jm

from jax_bridge.attention.reference import allowed_mask
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.host.context_parallel import load_balanced_positions
from pallas_tpu.splash import masks

MAX_LEN = 64
lengths = st.integers(1, MAX_LEN)
offsets = st.integers(-8, 8)
window_sides = st.one_of(st.none(), st.integers(0, 12))


# ---- independent dense builders (positions are the identity; see `permuted`)


def dense_causal(q_len: int, kv_len: int, offset: int = 0) -> np.ndarray:
    """q + offset >= kv: the lower triangle shifted up by `offset`."""
    return np.tril(np.ones((q_len, kv_len), bool), k=offset)


def dense_local(q_len, kv_len, left, right, offset=0) -> np.ndarray:
    """q + offset - left <= kv <= q + offset + right (a None side unbounded)."""
    allowed = np.ones((q_len, kv_len), bool)
    if right is not None:
        allowed &= np.tril(allowed, k=offset + right)
    if left is not None:
        allowed &= np.triu(allowed, k=offset - left)
    return allowed


def dense_chunked(q_len: int, kv_len: int, chunk: int) -> np.ndarray:
    """Causal inside consecutive chunks of `chunk` positions (explicit loops)."""
    allowed = np.zeros((q_len, kv_len), bool)
    for i in range(q_len):
        for j in range(kv_len):
            allowed[i, j] = i // chunk == j // chunk and j <= i
    return allowed


def dense_documents(cu_q, cu_kv, q_len, kv_len, left, right) -> np.ndarray:
    """Documents aligned bottom-right: j_rel >= i_rel - left and j_rel <= i_rel + right,
    rel = position - document end; padding after the last document attends nothing."""
    allowed = np.zeros((q_len, kv_len), bool)
    for d in range(len(cu_q) - 1):
        i_rel = np.arange(cu_q[d], cu_q[d + 1]) - cu_q[d + 1]
        j_rel = np.arange(cu_kv[d], cu_kv[d + 1]) - cu_kv[d + 1]
        block = np.ones((len(i_rel), len(j_rel)), bool)
        if left is not None:
            block &= j_rel[None, :] >= i_rel[:, None] - left
        if right is not None:
            block &= j_rel[None, :] <= i_rel[:, None] + right
        allowed[cu_q[d] : cu_q[d + 1], cu_kv[d] : cu_kv[d + 1]] = block
    return allowed


def dense_prefix_lm(q_len: int, kv_len: int, prefix: int, offset: int = 0) -> np.ndarray:
    """The causal triangle (q + offset >= kv) plus every column left of `prefix`."""
    return dense_causal(q_len, kv_len, offset) | (np.arange(kv_len) < prefix)[None, :]


@dataclasses.dataclass(frozen=True)
class Modular:
    """A scattered, rule-less pattern for PredicateMask: (a * q + b * kv) % m < r.
    Hashable and equal by value, so equal predicates share process_mask's cache."""

    a: int
    b: int
    m: int
    r: int

    def __call__(self, q, kv):
        return (self.a * q + self.b * kv) % self.m < self.r

    def dense(self, q_len: int, kv_len: int) -> np.ndarray:
        """Explicit loops, independent of numpy broadcasting."""
        allowed = np.zeros((q_len, kv_len), bool)
        for i in range(q_len):
            for j in range(kv_len):
                allowed[i, j] = (self.a * i + self.b * j) % self.m < self.r
        return allowed


modular_predicates = st.builds(
    Modular, st.integers(0, 5), st.integers(0, 5), st.integers(1, 7), st.integers(0, 7)
)


def permuted(dense: np.ndarray, q_sequence=None, kv_sequence=None) -> np.ndarray:
    """The dense mask seen through row orders: row i is position q_sequence[i]."""
    rows = np.arange(dense.shape[0]) if q_sequence is None else np.asarray(q_sequence)
    cols = np.arange(dense.shape[1]) if kv_sequence is None else np.asarray(kv_sequence)
    return dense[np.ix_(rows, cols)]


def segment_ids_of(cu: np.ndarray, length: int, padding: int) -> np.ndarray:
    """Document d's tokens get id d + 1; tokens after the last document get `padding`."""
    ids = np.full(length, padding, np.int32)
    for d in range(len(cu) - 1):
        ids[cu[d] : cu[d + 1]] = d + 1
    return ids


# ---- strategies


@st.composite
def sequences(draw, length: int):
    """None (identity), a random permutation, or the load-balanced context-parallel order."""
    kind = draw(st.sampled_from(["identity", "random", "balanced"]))
    if kind == "random":
        return np.asarray(draw(st.permutations(range(length))), np.int32)
    if kind == "balanced":
        cp_sizes = [cp for cp in (2, 4) if length % (2 * cp) == 0]
        if cp_sizes:
            return load_balanced_positions(length, draw(st.sampled_from(cp_sizes)))
    return None


@st.composite
def cu_seqlens(draw, max_docs: int = 6, max_len: int = MAX_LEN):
    """(cu_q, cu_kv, q_len, kv_len): random document lengths (empty ones too, q and kv
    lengths drawn separately) and trailing padding, lengths in 1..max_len."""
    docs = draw(st.integers(0, max_docs))
    per_doc = max(max_len // max(docs, 1) - 2, 0)
    q_lens = draw(st.lists(st.integers(0, per_doc), min_size=docs, max_size=docs))
    kv_lens = draw(st.lists(st.integers(0, per_doc), min_size=docs, max_size=docs))
    cu_q = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(kv_lens, dtype=np.int64)]).astype(np.int32)
    q_len = int(cu_q[-1]) + draw(st.integers(0 if cu_q[-1] else 1, 2))
    kv_len = int(cu_kv[-1]) + draw(st.integers(0 if cu_kv[-1] else 1, 2))
    return cu_q, cu_kv, q_len, kv_len


@st.composite
def document_windows(draw):
    """(causal, (left, right)) for a DocumentMask."""
    return draw(st.booleans()), (draw(window_sides), draw(window_sides))


def _window_of(causal: bool, window) -> tuple[int | None, int | None]:
    left, right = window
    return left, 0 if causal else right


@st.composite
def leaf_masks(draw, shape: tuple[int, int]):
    """(mask, dense) of one computable or numpy mask of `shape`, positions maybe permuted."""
    q_len, kv_len = shape
    kinds = ["causal", "local", "chunked", "full", "numpy", "document", "prefix_lm", "predicate"]
    kind = draw(st.sampled_from(kinds))
    if kind == "full":
        return masks.FullMask(shape), np.ones(shape, bool)
    if kind == "numpy":
        array = draw(st.lists(st.booleans(), min_size=q_len * kv_len, max_size=q_len * kv_len))
        array = np.asarray(array, bool).reshape(shape)
        return masks.NumpyMask(array), array.copy()
    q_seq, kv_seq = draw(sequences(q_len)), draw(sequences(kv_len))
    positions = {"q_sequence": q_seq, "kv_sequence": kv_seq}
    if kind == "causal":
        offset = draw(offsets)
        mask = masks.CausalMask(shape, offset, **positions)
        dense = dense_causal(q_len, kv_len, offset)
    elif kind == "local":
        left, right, offset = draw(window_sides), draw(window_sides), draw(offsets)
        mask = masks.LocalMask(shape, (left, right), offset, **positions)
        dense = dense_local(q_len, kv_len, left, right, offset)
    elif kind == "chunked":
        chunk = draw(st.integers(1, 16))
        mask = masks.ChunkedCausalMask(shape, chunk, **positions)
        dense = dense_chunked(q_len, kv_len, chunk)
    elif kind == "prefix_lm":
        prefix, offset = draw(st.integers(0, kv_len + 2)), draw(offsets)
        mask = masks.PrefixLMMask(shape, prefix, offset, **positions)
        dense = dense_prefix_lm(q_len, kv_len, prefix, offset)
    elif kind == "predicate":
        predicate = draw(modular_predicates)
        mask = masks.PredicateMask(shape, predicate, **positions)
        dense = predicate.dense(q_len, kv_len)
    else:
        cu_q, cu_kv = draw(documents_fitting(shape))
        causal, window = draw(document_windows())
        mask = masks.DocumentMask(
            cu_q, cu_kv, shape=shape, causal=causal, window=window, **positions
        )
        dense = dense_documents(cu_q, cu_kv, q_len, kv_len, *_window_of(causal, window))
    return mask, permuted(dense, q_seq, kv_seq)


@st.composite
def documents_fitting(draw, shape: tuple[int, int]):
    """(cu_q, cu_kv) of random documents whose ends fit inside `shape`."""
    docs = draw(st.integers(0, 5))
    ends = []
    for length in shape:
        cuts = draw(st.lists(st.integers(0, length), min_size=docs + 1, max_size=docs + 1))
        ends.append(np.concatenate([[0], np.sort(cuts)[:-1]]).astype(np.int32))
    return ends[0], ends[1]


@st.composite
def algebra(draw, shape: tuple[int, int], depth: int = 3):
    """(mask, dense): a leaf, or `|` / `&` of two smaller expressions (nested to `depth`)."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(leaf_masks(shape))
    left, left_dense = draw(algebra(shape, depth - 1))
    right, right_dense = draw(algebra(shape, depth - 1))
    if draw(st.booleans()):
        return left | right, left_dense | right_dense
    return left & right, left_dense & right_dense


shapes = st.tuples(lengths, lengths)


# ---- dense values of every mask kind


@given(shapes, offsets)
def test_causal_mask(shape, offset):
    q_len, kv_len = shape
    mask = masks.CausalMask(shape, offset)
    np.testing.assert_array_equal(mask[:, :], dense_causal(q_len, kv_len, offset))
    assert mask.shape == shape


@given(shapes, window_sides, window_sides, offsets)
def test_local_mask(shape, left, right, offset):
    q_len, kv_len = shape
    expected = dense_local(q_len, kv_len, left, right, offset)
    by_size = masks.LocalMask(shape, (left, right), offset)
    by_alias = masks.LocalMask(shape, window=(left, right), offset=offset)
    np.testing.assert_array_equal(by_size[:, :], expected)
    np.testing.assert_array_equal(by_alias[:, :], expected)


@given(shapes, st.integers(1, 20))
def test_chunked_causal_mask(shape, chunk):
    np.testing.assert_array_equal(
        masks.ChunkedCausalMask(shape, chunk)[:, :], dense_chunked(*shape, chunk)
    )


@given(shapes, st.data())
def test_full_and_numpy_masks(shape, data):
    np.testing.assert_array_equal(masks.FullMask(shape)[:, :], np.ones(shape, bool))
    flat = data.draw(
        st.lists(st.booleans(), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1])
    )
    array = np.asarray(flat, bool).reshape(shape)
    np.testing.assert_array_equal(masks.NumpyMask(array)[:, :], array)


@given(shapes, st.data())
def test_slices_are_rectangles_of_the_dense_mask(shape, data):
    mask, dense = data.draw(leaf_masks(shape))
    q_len, kv_len = shape
    r0, r1 = sorted(data.draw(st.lists(st.integers(0, q_len), min_size=2, max_size=2)))
    c0, c1 = sorted(data.draw(st.lists(st.integers(0, kv_len), min_size=2, max_size=2)))
    np.testing.assert_array_equal(mask[r0:r1, c0:c1], dense[r0:r1, c0:c1])


@given(cu_seqlens(), document_windows())
def test_document_mask_matches_independent_loops_and_the_oracle(documents, window):
    cu_q, cu_kv, q_len, kv_len = documents
    causal, (left, right) = window
    mask = masks.DocumentMask(
        cu_q, cu_kv, shape=(q_len, kv_len), causal=causal, window=(left, right)
    )
    expected = dense_documents(cu_q, cu_kv, q_len, kv_len, *_window_of(causal, (left, right)))
    np.testing.assert_array_equal(mask[:, :], expected)
    spec = AttentionSpec(1.0, causal=causal, window_left=left, window_right=right)
    np.testing.assert_array_equal(mask[:, :], allowed_mask(cu_q, cu_kv, q_len, kv_len, spec))


@given(cu_seqlens(), document_windows(), st.sampled_from([0, -1, -7]))
def test_documents_from_segment_ids_equal_cu_seqlens(documents, window, padding):
    cu_q, cu_kv, q_len, kv_len = documents
    causal, window = window
    by_cu = masks.DocumentMask(cu_q, cu_kv, shape=(q_len, kv_len), causal=causal, window=window)
    by_ids = masks.DocumentMask.from_segment_ids(
        segment_ids_of(cu_q, q_len, padding),
        segment_ids_of(cu_kv, kv_len, padding),
        causal=causal,
        window=window,
    )
    assert by_ids.shape == by_cu.shape == (q_len, kv_len)
    np.testing.assert_array_equal(by_ids[:, :], by_cu[:, :])


def test_document_mask_default_shape_and_shared_cu_seqlens():
    cu = np.array([0, 3, 3, 7])
    mask = masks.DocumentMask(cu, causal=True)
    assert mask.shape == (7, 7)
    np.testing.assert_array_equal(mask[:, :], dense_documents(cu, cu, 7, 7, None, 0))


# ---- the algebra


@given(shapes, st.data())
def test_or_and_follow_the_dense_arrays(shape, data):
    mask, dense = data.draw(algebra(shape))
    assert mask.shape == shape
    np.testing.assert_array_equal(mask[:, :], dense)


@given(shapes, st.data())
def test_permuted_sequences_index_the_unpermuted_mask(shape, data):
    q_len, kv_len = shape
    q_seq = np.asarray(data.draw(st.permutations(range(q_len))), np.int32)
    kv_seq = np.asarray(data.draw(st.permutations(range(kv_len))), np.int32)
    offset, chunk = data.draw(offsets), data.draw(st.integers(1, 9))
    left, right = data.draw(window_sides), data.draw(window_sides)
    cases = [
        (
            masks.CausalMask(shape, offset, q_sequence=q_seq, kv_sequence=kv_seq),
            dense_causal(*shape, offset),
        ),
        (
            masks.LocalMask(shape, (left, right), offset, q_sequence=q_seq, kv_sequence=kv_seq),
            dense_local(*shape, left, right, offset),
        ),
        (
            masks.ChunkedCausalMask(shape, chunk, q_sequence=q_seq, kv_sequence=kv_seq),
            dense_chunked(*shape, chunk),
        ),
    ]
    for mask, unpermuted in cases:
        np.testing.assert_array_equal(mask[:, :], permuted(unpermuted, q_seq, kv_seq))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_load_balanced_order_on_causal_and_document_masks(cp_size):
    length = 48
    order = load_balanced_positions(length, cp_size)
    causal = masks.CausalMask((length, length), q_sequence=order, kv_sequence=order)
    np.testing.assert_array_equal(
        causal[:, :], permuted(dense_causal(length, length), order, order)
    )
    cu = np.array([0, 5, 5, 30, 41])
    document = masks.DocumentMask(
        cu, shape=(length, length), causal=True, q_sequence=order, kv_sequence=order
    )
    expected = permuted(dense_documents(cu, cu, length, length, None, 0), order, order)
    np.testing.assert_array_equal(document[:, :], expected)


@pytest.mark.parametrize("expression", [bool, operator.not_, lambda m: m or m, lambda m: m and m])
def test_truth_value_raises(expression):
    mask = masks.CausalMask((4, 4))
    with pytest.raises(TypeError, match="truth value"):
        expression(mask)
    with pytest.raises(TypeError, match="truth value"):
        expression(mask | masks.FullMask((4, 4)))


@pytest.mark.parametrize("op", [operator.or_, operator.and_])
def test_combining_shapes_that_differ_raises(op):
    with pytest.raises(ValueError, match="shapes differ"):
        op(masks.CausalMask((4, 4)), masks.CausalMask((4, 5)))
    with pytest.raises(ValueError, match="shapes differ"):
        op(masks.NumpyMask(np.ones((3, 4), bool)), masks.FullMask((4, 4)))


def test_multi_head_mask_checks_its_heads():
    causal, full = masks.CausalMask((8, 8)), masks.FullMask((8, 8))
    multi = masks.MultiHeadMask([causal, full])
    assert multi.shape == (2, 8, 8)
    np.testing.assert_array_equal(multi[1, :, :], np.ones((8, 8), bool))
    np.testing.assert_array_equal(
        multi[:, :, :], np.stack([dense_causal(8, 8), np.ones((8, 8), bool)])
    )
    with pytest.raises(ValueError, match="nested"):
        masks.MultiHeadMask([causal, multi])
    with pytest.raises(ValueError, match="shapes differ"):
        masks.MultiHeadMask([causal, masks.FullMask((8, 4))])
    with pytest.raises(ValueError, match="at least one"):
        masks.MultiHeadMask([])
    with pytest.raises(TypeError):
        masks.MultiHeadMask([np.ones((8, 8), bool)])
    with pytest.raises(TypeError):
        _ = multi | causal


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: masks.LocalMask((4, 4)), "window_size"),
        (lambda: masks.LocalMask((4, 4), (1, 1), window=(1, 1)), "window_size"),
        (lambda: masks.LocalMask((4, 4), (-1, 0)), ">= 0"),
        (lambda: masks.ChunkedCausalMask((4, 4), 0), "positive"),
        (lambda: masks.CausalMask((4, 4, 4)), "shape"),
        (lambda: masks.CausalMask((4, 4), q_sequence=np.arange(3)), "q_sequence"),
        (lambda: masks.CausalMask((4, 4), kv_sequence=np.arange(4.0)), "kv_sequence"),
        (lambda: masks.CausalMask((4, 4), q_sequence=np.array([0, 1, 2, -3])), "positions"),
        (lambda: masks.CausalMask((6, 6), shard_count=2), "shard_count"),
        (lambda: masks.NumpyMask(np.ones((2, 2), np.int32)), "bool"),
        (lambda: masks.NumpyMask(np.ones(4, bool)), "2-D"),
    ],
)
def test_bad_constructor_arguments_raise(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("window", [5, (1, 2, 3)])
def test_a_window_not_of_two_sides_is_refused_naming_it(window):
    with pytest.raises(TypeError, match=r"LocalMask: window_size must be \(left, right\)"):
        masks.LocalMask((4, 4), window)


# ---- agreement with JAX's splash masks


@given(shapes, offsets, window_sides, window_sides, st.integers(1, 20), st.data())
def test_same_dense_values_as_jax_splash_masks(shape, offset, left, right, chunk, data):
    flat = data.draw(
        st.lists(st.booleans(), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1])
    )
    array = np.asarray(flat, bool).reshape(shape)
    pairs = [
        (masks.CausalMask(shape, offset), jm.CausalMask(shape, offset)),
        (masks.LocalMask(shape, (left, right), offset), jm.LocalMask(shape, (left, right), offset)),
        (masks.ChunkedCausalMask(shape, chunk), jm.ChunkedCausalMask(shape, chunk)),
        (masks.NumpyMask(array), jm.NumpyMask(array)),
        (masks.FullMask(shape), jm.FullMask(shape)),
    ]
    for ours, theirs in pairs:
        np.testing.assert_array_equal(ours[:, :], theirs[:, :])
    both_ours = pairs[0][0] | (pairs[1][0] & pairs[3][0])
    both_theirs = pairs[0][1] | (pairs[1][1] & pairs[3][1])
    np.testing.assert_array_equal(both_ours[:, :], both_theirs[:, :])


@pytest.mark.parametrize(
    "index", [(3, slice(None)), 3, (np.array([0, 2]), slice(None)), (slice(1, 3), 2), (-1, -2)]
)
def test_numpy_mask_indexes_as_jax_splash_does(index):
    """Any numpy index, as JAX's NumpyMask takes it (a port indexes masks so)."""
    array = np.random.default_rng(4).random((8, 8)) < 0.5
    np.testing.assert_array_equal(masks.NumpyMask(array)[index], jm.NumpyMask(array)[index])


def test_equal_masks_hash_equal():
    """Equal masks are one key for process_mask's cache and its unique-mask table."""
    shape = (16, 16)
    assert masks.CausalMask(shape, 1) == masks.CausalMask(shape, 1)
    assert hash(masks.CausalMask(shape, 1)) == hash(masks.CausalMask(shape, 1))
    assert masks.CausalMask(shape, 1) != masks.CausalMask(shape, 2)
    assert masks.LocalMask(shape, (2, 0)) != masks.CausalMask(shape)
    order = load_balanced_positions(16, 2)
    assert masks.CausalMask(shape, q_sequence=order) != masks.CausalMask(shape)
    array = np.eye(16, dtype=bool)
    assert masks.NumpyMask(array) == masks.NumpyMask(array.copy())
    assert hash(masks.NumpyMask(array)) == hash(masks.NumpyMask(array.copy()))
    cu = np.array([0, 4, 16])
    assert masks.DocumentMask(cu, causal=True) == masks.DocumentMask(cu.copy(), causal=True)
    assert masks.DocumentMask(cu, causal=True) != masks.DocumentMask(cu)
