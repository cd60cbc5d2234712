"""`PrefixLMMask` and `PredicateMask`: properties against dense arrays, and the kernels.

Invariants, for random shapes, block sizes, prefix lengths, offsets and row orders:
  - a PrefixLMMask is `CausalMask | (kv < prefix)` element-wise, and is classified from
    its row intervals into the same block classes as its dense values;
  - a PredicateMask of the causal predicate yields CausalMask's block structure, with the
    same element values in every partial block (loaded instead of evaluated);
  - `&` / `|` with a DocumentMask agree with the dense evaluation, down to every MaskInfo
    invariant the kernels rely on (`check_mask_info`);
  - a PredicateMask is never evaluated on more than a bounded piece at a time.
Dense expectations come from independent builders (tests/splash/test_masks.py).
The kernel checks run forward and gradients in interpret mode against the float64 dense
reference, one per new mask, on 256-token shapes.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

import pallas_tpu
from pallas_tpu.splash import mask_info as mi
from pallas_tpu.splash import masks
from pallas_tpu.splash.config import BlockSizes
from pallas_tpu.splash.kernel import make_splash_mha
from tests.splash.test_kernels import _check, _inputs
from tests.splash.test_mask_info import check_mask_info, dense_classes
from tests.splash.test_masks import (
    dense_causal,
    dense_documents,
    dense_prefix_lm,
    documents_fitting,
    modular_predicates,
    offsets,
    permuted,
    sequences,
)

# ---- strategies


@st.composite
def blocked_shapes(draw):
    """((q_len, kv_len), (block_q, block_kv)): lengths that the blocks divide, up to ~48."""
    block_q, block_kv = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([1, 4, 8]))
    q_blocks = draw(st.integers(1, max(48 // block_q, 1)))
    kv_blocks = draw(st.integers(1, max(48 // block_kv, 1)))
    return (q_blocks * block_q, kv_blocks * block_kv), (block_q, block_kv)


@st.composite
def prefix_lm_masks(draw, shape):
    """(PrefixLMMask, dense): prefix in [0, kv_len + 2], any offset, maybe permuted rows."""
    q_len, kv_len = shape
    prefix, offset = draw(st.integers(0, kv_len + 2)), draw(offsets)
    q_seq, kv_seq = draw(sequences(q_len)), draw(sequences(kv_len))
    mask = masks.PrefixLMMask(shape, prefix, offset, q_sequence=q_seq, kv_sequence=kv_seq)
    return mask, permuted(dense_prefix_lm(q_len, kv_len, prefix, offset), q_seq, kv_seq)


@st.composite
def document_masks(draw, shape):
    """(DocumentMask, dense) of random documents fitting `shape`, maybe causal / windowed."""
    cu_q, cu_kv = draw(documents_fitting(shape))
    causal = draw(st.booleans())
    left = draw(st.one_of(st.none(), st.integers(0, 12)))
    mask = masks.DocumentMask(cu_q, cu_kv, shape=shape, causal=causal, window=(left, None))
    return mask, dense_documents(cu_q, cu_kv, *shape, left, 0 if causal else None)


def _causal_predicate(offset: int):
    def causal(q, kv):
        return q + offset >= kv

    return causal


def _assert_mask_info(mask, dense, block_shape) -> None:
    """Every MaskInfo invariant (forward and dK/dV, grid shrunk or not) against `dense`."""
    for is_dkv, process in ((False, mi.process_mask), (True, mi.process_mask_dkv)):
        for shrink in (True, False):
            info, element = process(mask, block_shape, shrink_grid=shrink)
            check_mask_info(
                info, element, dense[None], block_shape, head_shards=1, q_seq_shards=1,
                is_dkv=is_dkv,
            )  # fmt: skip


# ---- PrefixLMMask


@given(st.tuples(st.integers(1, 64), st.integers(1, 64)), st.data())
def test_prefix_lm_is_causal_or_prefix_elementwise(shape, data):
    mask, dense = data.draw(prefix_lm_masks(shape))
    np.testing.assert_array_equal(mask[:, :], dense)
    # The same mask as an algebra expression: the causal part | the prefix columns.
    positions = {"q_sequence": mask.q_sequence, "kv_sequence": mask.kv_sequence}
    causal = masks.CausalMask(shape, mask.offset, **positions)
    prefix = masks.PredicateMask(
        shape, lambda q, kv: kv < mask.prefix_length, name="prefix", **positions
    )
    np.testing.assert_array_equal((causal | prefix)[:, :], dense)
    # Row intervals (what classification reads) describe exactly the dense rows.
    lo, hi = mask.row_intervals()
    kv = np.arange(shape[1]) if mask.kv_sequence is None else mask.kv_sequence
    from_intervals = (lo[:, :1] <= kv[None, :]) & (kv[None, :] <= hi[:, :1])
    np.testing.assert_array_equal(from_intervals, dense)


@given(blocked_shapes(), st.data())
def test_prefix_lm_classes_from_intervals_equal_dense_classes(case, data):
    shape, block_shape = case
    mask, dense = data.draw(prefix_lm_masks(shape))
    got = np.asarray(mi.classify_blocks(mask, block_shape))
    np.testing.assert_array_equal(got, dense_classes(dense[None], *block_shape)[0])


@given(blocked_shapes(), st.integers(0, 60), offsets)
def test_prefix_lm_mask_info_is_evaluated_in_the_kernel(case, prefix, offset):
    """A lone PrefixLMMask needs no partial blocks: the kernel evaluates its rule."""
    shape, block_shape = case
    mask = masks.PrefixLMMask(shape, prefix, offset)
    info, element = mi.process_mask(mask, block_shape)
    assert element is not None and info.partial_mask_blocks is None
    _assert_mask_info(mask, dense_prefix_lm(*shape, prefix, offset), block_shape)


def test_prefix_lm_edges_are_causal_and_full():
    shape = (24, 40)
    for offset in (-3, 0, 5):
        np.testing.assert_array_equal(
            masks.PrefixLMMask(shape, 0, offset)[:, :], masks.CausalMask(shape, offset)[:, :]
        )
        for prefix in (40, 41, 2**30):
            assert masks.PrefixLMMask(shape, prefix, offset)[:, :].all()


# ---- PredicateMask


@given(blocked_shapes(), offsets, st.data())
def test_causal_predicate_gives_causal_mask_info(case, offset, data):
    """Same block classes and traversal as CausalMask; partial blocks loaded (deduplicated)
    instead of evaluated, holding the causal values."""
    shape, block_shape = case
    q_seq = data.draw(sequences(shape[0]))
    causal = masks.CausalMask(shape, offset, q_sequence=q_seq)
    predicate = masks.PredicateMask(shape, _causal_predicate(offset), q_sequence=q_seq)
    dense = permuted(dense_causal(*shape, offset), q_seq)
    np.testing.assert_array_equal(predicate[:, :], dense)
    for process in (mi.process_mask, mi.process_mask_dkv):
        for shrink in (True, False):
            want, _ = process(causal, block_shape, shrink_grid=shrink)
            got, element = process(predicate, block_shape, shrink_grid=shrink)
            assert element is None
            np.testing.assert_array_equal(got.block_mask, want.block_mask)
            np.testing.assert_array_equal(got.data_next, want.data_next)
            if got.partial_mask_blocks is not None:  # deduplicated: no block stored twice
                flat = np.asarray(got.partial_mask_blocks).reshape(len(got.partial_mask_blocks), -1)
                assert len(np.unique(flat, axis=0)) == len(flat)
    _assert_mask_info(predicate, dense, block_shape)


@given(blocked_shapes(), modular_predicates, st.data())
def test_predicate_classes_equal_dense_classes(case, predicate, data):
    shape, block_shape = case
    q_seq, kv_seq = data.draw(sequences(shape[0])), data.draw(sequences(shape[1]))
    mask = masks.PredicateMask(shape, predicate, q_sequence=q_seq, kv_sequence=kv_seq)
    dense = permuted(predicate.dense(*shape), q_seq, kv_seq)
    np.testing.assert_array_equal(mask[:, :], dense)
    got = np.asarray(mi.classify_blocks(mask, block_shape))
    np.testing.assert_array_equal(got, dense_classes(dense[None], *block_shape)[0])


@given(blocked_shapes(), modular_predicates, st.integers(1, 40))
def test_predicate_is_evaluated_a_bounded_piece_at_a_time(case, predicate, budget):
    """With the chunk budget lowered, no predicate call sees more than max(budget, one
    block row) elements for classification, or max(budget, one block) for partial blocks,
    and the results do not change."""
    shape, block_shape = case
    largest, partial = [], []  # elements a call saw; those of partial blocks' calls
    materialising = []  # non-empty while the partial blocks are materialised

    def recording(q, kv):
        size = int(np.prod(np.broadcast_shapes(np.shape(q), np.shape(kv))))
        (partial if materialising else largest).append(size)
        return predicate(q, kv)

    def packing(*args, **kwargs):
        materialising.append(True)
        try:
            return packed_partial_blocks(*args, **kwargs)
        finally:
            materialising.pop()

    packed_partial_blocks = mi._packed_partial_blocks
    mask = masks.PredicateMask(shape, recording)
    want = np.asarray(mi.classify_blocks(masks.PredicateMask(shape, predicate), block_shape))
    block_row, block = block_shape[0] * shape[1], block_shape[0] * block_shape[1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mi, "DENSE_CHUNK_ELEMENTS", budget)
        patch.setattr(mi, "_packed_partial_blocks", packing)
        largest.clear()
        np.testing.assert_array_equal(mi.classify_blocks(mask, block_shape), want)
        assert max(largest) <= max(budget, block_row)
        largest.clear()
        info, _ = mi.process_mask(mask, block_shape, shrink_grid=False)
        assert max(largest) <= max(budget, block_row)
        assert max(partial, default=0) <= max(budget, block)
        assert bool(partial) == bool((want == mi.PARTIAL).any())
    dense = predicate.dense(*shape)
    check_mask_info(
        info, None, dense[None], block_shape, head_shards=1, q_seq_shards=1, is_dkv=False
    )


def test_predicate_mask_equality_and_names():
    shape = (8, 8)
    causal = _causal_predicate(0)
    a = masks.PredicateMask(shape, causal, name="a")
    # The name is a label: the same predicate is the same mask (one process_mask entry).
    assert a == masks.PredicateMask(shape, causal, name="b")
    assert hash(a) == hash(masks.PredicateMask(shape, causal))
    assert a != masks.PredicateMask(shape, _causal_predicate(0))  # another function object
    assert a != masks.PredicateMask((8, 9), lambda q, kv: q >= kv)
    assert masks.PredicateMask(shape, causal).name == "causal"
    assert "'a'" in repr(a)
    assert masks.PrefixLMMask(shape, 3) == masks.PrefixLMMask(shape, 3)
    assert masks.PrefixLMMask(shape, 3) != masks.PrefixLMMask(shape, 4)
    assert masks.PrefixLMMask(shape, 0) != masks.CausalMask(shape)  # equal values, other rule
    opaque = object.__new__(type("JITFunction", (), {"__call__": lambda self, *a: None}))
    with_triton = masks.PredicateMask(shape, causal, triton_predicate=opaque)
    assert with_triton.triton_predicate is opaque and with_triton != a
    np.testing.assert_array_equal(with_triton[:, :], a[:, :])


def test_predicate_may_broadcast_and_use_jax_numpy():
    shape = (6, 10)
    columns = masks.PredicateMask(shape, lambda q, kv: kv < 4)  # [1, m]: broadcasts
    np.testing.assert_array_equal(columns[:, :], np.broadcast_to(np.arange(10) < 4, shape))
    jnp_causal = masks.PredicateMask(shape, lambda q, kv: jnp.asarray(q) >= jnp.asarray(kv))
    np.testing.assert_array_equal(jnp_causal[:, :], dense_causal(*shape))


# ---- compositions with DocumentMask


@given(blocked_shapes(), st.data())
def test_compositions_with_documents_agree_with_dense(case, data):
    shape, block_shape = case
    document, document_dense = data.draw(document_masks(shape))
    prefix = data.draw(st.integers(0, shape[1] + 2))
    prefix_lm = masks.PrefixLMMask(shape, prefix)
    prefix_dense = dense_prefix_lm(*shape, prefix)
    predicate = data.draw(modular_predicates)
    predicate_mask = masks.PredicateMask(shape, predicate)
    predicate_dense = predicate.dense(*shape)
    both = prefix_dense & document_dense
    cases = [
        (prefix_lm & document, both),
        (prefix_lm | document, prefix_dense | document_dense),
        (document & predicate_mask, document_dense & predicate_dense),
        ((prefix_lm & document) | predicate_mask, both | predicate_dense),
    ]
    for mask, dense in cases:
        np.testing.assert_array_equal(mask[:, :], dense)
        got = np.asarray(mi.classify_blocks(mask, block_shape))
        np.testing.assert_array_equal(got, dense_classes(dense[None], *block_shape)[0])
    # The intervals path: PrefixLM & Document is classified without any dense array.
    assert (prefix_lm & document).row_intervals() is not None
    mask, dense = data.draw(st.sampled_from(cases))
    _assert_mask_info(mask, dense, block_shape)


# ---- bad inputs


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: masks.PrefixLMMask((4, 4), -1), ValueError, "PrefixLMMask: prefix_length"),
        (lambda: masks.PrefixLMMask((4, 4), 2**30 + 1), ValueError, "prefix_length"),
        (lambda: masks.PrefixLMMask((4, 4), 1.5), TypeError, "PrefixLMMask: prefix_length"),
        (lambda: masks.PrefixLMMask((4, 4), True), TypeError, "prefix_length"),
        (lambda: masks.PrefixLMMask((4, 4), 1, offset=0.5), TypeError, "offset"),
        (lambda: masks.PrefixLMMask((4, 4, 4), 1), ValueError, "PrefixLMMask: shape"),
        (lambda: masks.PredicateMask((4, 4), 3), TypeError, "PredicateMask: predicate"),
        (
            lambda: masks.PredicateMask((4, 4), lambda q, kv: q - kv, name="diff"),
            TypeError,
            "PredicateMask 'diff': predicate must return bool, got int",
        ),
        (
            lambda: masks.PredicateMask((4, 4), lambda q, kv: None, name="none"),
            TypeError,
            "'none': predicate must return bool, got NoneType",
        ),
        (
            lambda: masks.PredicateMask((4, 4), lambda q, kv: np.ones(3, bool), name="three"),
            ValueError,
            "PredicateMask 'three': predicate returned shape",
        ),
        (
            lambda: masks.PredicateMask((4, 4), lambda q, kv: q >= kv, triton_predicate=1),
            TypeError,
            "triton_predicate",
        ),
        (
            lambda: masks.PredicateMask((4, 4), lambda q, kv: q >= kv, q_sequence=np.arange(3)),
            ValueError,
            "q_sequence",
        ),
    ],
)
def test_bad_inputs_name_the_mask_and_argument(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_predicate_errors_surface_in_process_mask_too():
    """A predicate that is well-behaved on the construction probe but not on blocks."""

    def small_only(q, kv):
        result = q >= kv
        return result if result.size <= 4 else result.astype(np.int8)

    mask = masks.PredicateMask((8, 8), small_only, name="small_only")
    with pytest.raises(TypeError, match="'small_only': predicate must return bool, got int8"):
        mi.process_mask(mask, (4, 4))


def test_reexported_from_the_package_roots():
    for name in ("PrefixLMMask", "PredicateMask"):
        assert name in pallas_tpu.__all__ and name in pallas_tpu.splash.__all__
        assert getattr(pallas_tpu, name) is getattr(masks, name)


# ---- the kernels, in interpret mode (forward and gradients against the dense reference)

BLOCKS = BlockSizes(block_q=128, block_kv=128)


def test_kernel_with_prefix_lm_mask():
    """The rule is evaluated in the kernel: 384 tokens, prefix 160 (block (0, 1) partial
    through the prefix alone), offset 0, two heads sharing one kv head."""
    t = 384
    mask = masks.PrefixLMMask((t, t), 160)
    kernel = make_splash_mha(
        masks.MultiHeadMask([mask] * 2), block_sizes=BLOCKS, interpret=True, save_residuals=True
    )
    assert kernel.masks.element is not None
    assert kernel.masks.fwd.partial_mask_blocks is None
    q, k, v = _inputs(21, 2, 1, t, t)
    _check(kernel, dense_prefix_lm(t, t, 160)[None], q, k, v)


def test_kernel_with_predicate_and_composed_masks():
    """Partial blocks loaded from MaskInfo: head 0 a PredicateMask (a strided pattern plus
    the diagonal, so no row is empty), head 1 PrefixLMMask & DocumentMask."""
    t = 256

    def strided(q, kv):
        return ((q + kv) % 3 == 0) | (q == kv)

    cu = np.array([0, 90, 200, 256])
    heads = [
        masks.PredicateMask((t, t), strided),
        masks.PrefixLMMask((t, t), 140) & masks.DocumentMask(cu),
    ]
    kernel = make_splash_mha(
        masks.MultiHeadMask(heads), block_sizes=BLOCKS, interpret=True, save_residuals=True
    )
    assert kernel.masks.element is None
    assert kernel.masks.fwd.partial_mask_blocks is not None
    dense = np.stack([np.asarray(m[:, :]) for m in heads])
    i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    np.testing.assert_array_equal(dense[0], ((i + j) % 3 == 0) | (i == j))
    doc = np.searchsorted(cu, np.arange(t), side="right")
    np.testing.assert_array_equal(
        dense[1], dense_prefix_lm(t, t, 140) & (doc[:, None] == doc[None, :])
    )
    q, k, v = _inputs(22, 2, 2, t, t)
    _check(kernel, dense, q, k, v)
