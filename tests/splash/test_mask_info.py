"""`MaskInfo` from `process_mask*`: invariants against dense masks, and agreement with JAX.

The invariants are those the kernels rely on, checked by walking the grid the way a kernel
does: every non-empty block of the dense mask is visited exactly once (forward grid
(h, qi, j) -> kv block data_next; dK/dV grid (ki, h, j) -> q block data_next, relative to
the q shard), its class is right (2 only when no element is masked), and partial blocks
are reproduced bit for bit, from `partial_mask_blocks[mask_next]` or from the returned
`ElementMask`. Dense expectations come from the masks' dense values (checked against
independent builders in test_masks.py), never from the package's classifier.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as jmi

from jax_bridge.host.context_parallel import load_balanced_positions
from pallas_tpu.splash import mask_info as mi
from pallas_tpu.splash import masks
from tests.splash.test_masks import algebra, dense_documents, segment_ids_of

EMPTY, PARTIAL, FULL = 0, 1, 2


# ---- the dense side


def dense_classes(dense: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """int [heads, q_blocks, kv_blocks]: 0 no element, 2 every element, 1 otherwise."""
    heads, q_len, kv_len = dense.shape
    blocks = dense.reshape(heads, q_len // block_q, block_q, kv_len // block_kv, block_kv)
    any_, all_ = blocks.any(axis=(2, 4)), blocks.all(axis=(2, 4))
    return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))


def dense_blocks(dense: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """bool [heads, q_blocks, kv_blocks, block_q, block_kv]: the dense mask in tiles."""
    heads, q_len, kv_len = dense.shape
    tiled = dense.reshape(heads, q_len // block_q, block_q, kv_len // block_kv, block_kv)
    return tiled.transpose(0, 1, 3, 2, 4)


def evaluate_element(element: mi.ElementMask, q_len: int, kv_len: int) -> np.ndarray:
    """bool [q_len, kv_len]: rule(q_sequence[i], kv_sequence[j]) & same document."""
    q = np.asarray(element.q_sequence)
    kv = np.arange(kv_len) if element.kv_sequence is None else np.asarray(element.kv_sequence)
    allowed = np.asarray(element(q[:, None], kv[None, :]), bool)
    if element.q_document is not None:
        q_doc, kv_doc = np.asarray(element.q_document), np.asarray(element.kv_document)
        allowed = allowed & (q_doc[:, None] == kv_doc[None, :])
    return np.broadcast_to(allowed, (q_len, kv_len))


# ---- walking the grid like a kernel


def visits(info, heads: int, q_blocks: int, q_seq_shards: int, is_dkv: bool):
    """Every non-empty grid step of every head, as arrays (head, qi, ki, class, mask_id).

    block_mask's first axis has one row per head, per head shard, or one for all heads:
    head h reads row h * rows // heads. Forward: step (row, qi, j) loads kv block
    data_next. dK/dV: step (row, j, ki) loads q block data_next, counted from the start
    of the q shard that row j belongs to (the compacted q axis holds q_seq_shards equal
    slices, one per shard).
    """
    block_mask, data_next = np.asarray(info.block_mask), np.asarray(info.data_next)
    mask_next = None if info.mask_next is None else np.asarray(info.mask_next)
    rows, steps_q, _ = block_mask.shape
    assert block_mask.shape == data_next.shape
    assert mask_next is None or mask_next.shape == block_mask.shape
    out = []
    for head in range(heads):
        row = head * rows // heads
        a, b = np.nonzero(block_mask[row])
        index = data_next[row, a, b].astype(np.int64)
        if is_dkv:
            shard = a // (steps_q // q_seq_shards)
            qi, ki = shard * (q_blocks // q_seq_shards) + index, b
        else:
            qi, ki = a, index
        mask_id = None if mask_next is None else mask_next[row, a, b].astype(np.int64)
        out.append((head, qi, ki, block_mask[row, a, b], mask_id))
    return out


def check_mask_info(info, element, dense, block_shape, *, head_shards, q_seq_shards, is_dkv):
    """Asserts every invariant of one MaskInfo against the dense [heads, q, kv] mask."""
    heads, q_len, kv_len = dense.shape
    block_q, block_kv = block_shape
    q_blocks, kv_blocks = q_len // block_q, kv_len // block_kv
    classes = dense_classes(dense, block_q, block_kv)
    tiles = dense_blocks(dense, block_q, block_kv)
    rows = info.block_mask.shape[0]
    assert rows in (1, head_shards, heads) and heads % rows == 0
    assert rows == heads or rows % head_shards == 0
    element_dense = None if element is None else evaluate_element(element, q_len, kv_len)
    pmb = None if info.partial_mask_blocks is None else np.asarray(info.partial_mask_blocks)
    for head, qi, ki, block_class, mask_id in visits(info, heads, q_blocks, q_seq_shards, is_dkv):
        # Exactly once: the visited pairs are distinct and are the non-empty blocks.
        pairs = qi * kv_blocks + ki
        assert len(np.unique(pairs)) == len(pairs), f"head {head}: a block visited twice"
        expected = np.flatnonzero(classes[head] != EMPTY)
        np.testing.assert_array_equal(np.sort(pairs), expected, err_msg=f"head {head}")
        np.testing.assert_array_equal(block_class, classes[head, qi, ki])
        partial = block_class == PARTIAL
        if not partial.any():
            continue
        want = tiles[head, qi[partial], ki[partial]]
        if pmb is not None:
            got = pmb[mask_id[partial]]
            np.testing.assert_array_equal(got.swapaxes(1, 2) if is_dkv else got, want)
        else:
            assert element_dense is not None, "a partial block with neither source"
            element_tiles = dense_blocks(element_dense[None], block_q, block_kv)[0]
            np.testing.assert_array_equal(element_tiles[qi[partial], ki[partial]], want)
    if element is not None:
        np.testing.assert_array_equal(np.asarray(info.q_sequence), np.asarray(element.q_sequence))


def visited_set(info, heads, q_blocks, q_seq_shards, is_dkv) -> set[tuple[int, int, int]]:
    return {
        (head, int(q), int(k))
        for head, qi, ki, _, _ in visits(info, heads, q_blocks, q_seq_shards, is_dkv)
        for q, k in zip(qi, ki, strict=True)
    }


# ---- strategies


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def mask_info_cases(draw):
    """(mask, dense [heads, q, kv], block_shape, head_shards, q_seq_shards): a 2-D mask
    or a MultiHeadMask whose heads reuse a small pool of masks (so shards may share)."""
    block_q, block_kv = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([1, 4, 8]))
    q_blocks = draw(st.integers(1, max(48 // block_q, 1)))
    kv_blocks = draw(st.integers(1, max(48 // block_kv, 1)))
    shape = (q_blocks * block_q, kv_blocks * block_kv)
    heads = draw(st.integers(1, 4))
    pool = [draw(algebra(shape, depth=2)) for _ in range(draw(st.integers(1, min(3, heads))))]
    choice = draw(st.lists(st.integers(0, len(pool) - 1), min_size=heads, max_size=heads))
    if heads == 1 and draw(st.booleans()):
        mask = pool[choice[0]][0]
    else:
        mask = masks.MultiHeadMask([pool[i][0] for i in choice])
    dense = np.stack([pool[i][1] for i in choice])
    head_shards = draw(st.sampled_from(divisors(heads)))
    q_seq_shards = draw(st.sampled_from(divisors(q_blocks)))
    return mask, dense, (block_q, block_kv), head_shards, q_seq_shards


def smallest_int(bound: int) -> np.dtype:
    for dtype in (np.int8, np.int16, np.int32):
        if bound <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise AssertionError(bound)


# ---- invariants


@given(mask_info_cases(), st.booleans())
def test_invariants_forward_and_dkv(case, downcast):
    mask, dense, block_shape, head_shards, q_seq_shards = case
    heads, q_len, _ = dense.shape
    shards = {"head_shards": head_shards, "q_seq_shards": q_seq_shards}
    for is_dkv, process in ((False, mi.process_mask), (True, mi.process_mask_dkv)):
        seen = []
        for shrink in (True, False):
            info, element = process(
                mask, block_shape, shrink_grid=shrink, downcast_smem_data=downcast, **shards
            )
            check_mask_info(info, element, dense, block_shape, **shards, is_dkv=is_dkv)
            check_dtypes(info, downcast, dense.shape, block_shape, q_seq_shards, is_dkv)
            seen.append(visited_set(info, heads, q_len // block_shape[0], q_seq_shards, is_dkv))
        assert seen[0] == seen[1]
        if not shrink:  # unshrunk: block_mask is the class of every block, in place
            rows = info.block_mask.shape[0]
            expected = dense_classes(dense, *block_shape)
            for head in range(heads):
                np.testing.assert_array_equal(info.block_mask[head * rows // heads], expected[head])


def check_dtypes(info, downcast, shape, block_shape, q_seq_shards, is_dkv):
    """int32 without downcasting; otherwise never wider than the smallest of int8/16/32
    holding the static bound of the values (and every value fits)."""
    _, q_len, kv_len = shape
    q_local = q_len // block_shape[0] // q_seq_shards
    bounds = {
        "block_mask": FULL,
        "data_next": q_local if is_dkv else kv_len // block_shape[1],
        "mask_next": 0 if info.partial_mask_blocks is None else len(info.partial_mask_blocks),
    }
    for name, bound in bounds.items():
        array = getattr(info, name)
        if array is None:
            continue
        array = np.asarray(array)
        if not downcast:
            assert array.dtype == np.int32, name
            continue
        assert array.dtype in (np.int8, np.int16, np.int32), name
        assert array.dtype.itemsize <= smallest_int(bound).itemsize, (name, array.dtype, bound)
        assert array.size == 0 or array.max() <= np.iinfo(array.dtype).max


@given(mask_info_cases())
def test_classify_blocks_matches_the_dense_mask(case):
    mask, dense, block_shape, _, _ = case
    heads = mask.masks if isinstance(mask, masks.MultiHeadMask) else (mask,)
    for head, head_dense in zip(heads, dense, strict=True):
        got = np.asarray(mi.classify_blocks(head, block_shape))
        np.testing.assert_array_equal(got, dense_classes(head_dense[None], *block_shape)[0])


def test_downcast_widens_past_int8():
    """300 kv blocks: data_next needs int16; 40000 needs int32 (block 1 keeps it small)."""
    for kv_len, dtype in ((300, np.int16), (40000, np.int32)):
        info, _ = mi.process_mask(masks.FullMask((1, kv_len)), (1, 1), shrink_grid=False)
        assert info.data_next.dtype == dtype and info.block_mask.dtype == np.int8
        assert int(info.data_next.max()) == kv_len - 1


# ---- agreement with JAX's process_mask


def block_random(shape, seed: int, tile: int = 8) -> np.ndarray:
    """bool mask of 8x8 tiles that are empty, full or random: every block class occurs."""
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, 3, (-(-shape[0] // tile), -(-shape[1] // tile)))
    coarse = np.kron(tiles, np.ones((tile, tile), int))[: shape[0], : shape[1]]
    return np.where(coarse == 1, rng.random(shape) < 0.5, coarse == 2)


def build(spec, shape, lib):
    """One mask from a small spec tuple, with our masks (lib=masks) or JAX's (lib=jm)."""
    kind, *args = spec
    if kind == "causal":
        return lib.CausalMask(shape, args[0])
    if kind == "local":
        return lib.LocalMask(shape, args[0], args[1])
    if kind == "chunked":
        return lib.ChunkedCausalMask(shape, args[0])
    if kind == "full":
        return lib.FullMask(shape)
    if kind == "numpy":
        return lib.NumpyMask(block_random(shape, args[0]))
    left, right = build(args[0], shape, lib), build(args[1], shape, lib)
    return left | right if kind == "or" else left & right


CAUSAL, LOCAL = ("causal", 0), ("local", (5, 2), 0)
CHUNKED, NUMPY = ("chunked", 12), ("numpy", 1)
# (head mask specs, shape, block shape, head_shards, q_seq_shards)
JAX_CASES = [
    ([CAUSAL], (64, 64), (8, 8), 1, 1),
    ([CAUSAL] * 4, (64, 64), (16, 8), 2, 2),
    ([("causal", -5)], (48, 64), (8, 16), 1, 3),
    ([("causal", 9)], (64, 32), (16, 16), 1, 4),
    ([LOCAL] * 2, (64, 64), (8, 8), 2, 4),
    ([("local", (None, 3), 2)], (64, 64), (4, 16), 1, 2),
    ([("local", (7, None), -1)], (32, 64), (8, 8), 1, 1),
    ([CHUNKED] * 2, (64, 64), (8, 4), 1, 2),
    ([NUMPY], (64, 64), (8, 8), 1, 2),
    ([NUMPY, ("numpy", 2)], (64, 48), (16, 8), 2, 1),
    ([("full",)] * 2, (32, 32), (8, 8), 1, 1),
    ([CAUSAL, LOCAL, CHUNKED, NUMPY], (64, 64), (8, 8), 1, 2),
    ([CAUSAL, CAUSAL, LOCAL, LOCAL], (64, 64), (16, 16), 2, 1),
    ([CAUSAL, LOCAL, CAUSAL, LOCAL], (64, 64), (8, 16), 2, 2),
    ([("or", CAUSAL, NUMPY)], (64, 64), (8, 8), 1, 1),
    ([("and", LOCAL, ("or", CHUNKED, ("numpy", 3)))] * 2, (64, 64), (8, 8), 2, 2),
    ([("and", ("full",), CAUSAL), ("or", LOCAL, CHUNKED)], (64, 64), (4, 8), 1, 4),
    ([("and", CAUSAL, ("causal", -9))], (64, 64), (8, 8), 1, 1),
]


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("case", JAX_CASES, ids=[f"case{i}" for i in range(len(JAX_CASES))])
def test_agrees_with_jax_process_mask(case, is_dkv):
    specs, shape, block_shape, head_shards, q_seq_shards = case
    ours = masks.MultiHeadMask([build(s, shape, masks) for s in specs])
    theirs = jm.MultiHeadMask(tuple(build(s, shape, jm) for s in specs))
    for shrink in (True, False):
        options = {"head_shards": head_shards, "q_seq_shards": q_seq_shards, "shrink_grid": shrink}
        process = mi.process_mask_dkv if is_dkv else mi.process_mask
        got, element = process(ours, block_shape, **options)
        want, _ = (jmi.process_mask_dkv if is_dkv else jmi.process_mask)(
            theirs, block_shape, **options
        )
        assert got.block_mask.shape == want.block_mask.shape
        np.testing.assert_array_equal(got.block_mask, want.block_mask)
        used = np.asarray(want.block_mask) != EMPTY
        np.testing.assert_array_equal(got.data_next[used], want.data_next[used])
        assert (got.mask_next is None) == (want.mask_next is None)
        if want.mask_next is not None:
            np.testing.assert_array_equal(got.mask_next[used], want.mask_next[used])
        assert (got.partial_mask_blocks is None) == (want.partial_mask_blocks is None)
        if want.partial_mask_blocks is not None:
            np.testing.assert_array_equal(got.partial_mask_blocks, want.partial_mask_blocks)
        assert (got.q_sequence is None) == (want.q_sequence is None)
        dense = np.stack([m[:, :] for m in ours.masks])
        shards = {"head_shards": head_shards, "q_seq_shards": q_seq_shards}
        check_mask_info(got, element, dense, block_shape, **shards, is_dkv=is_dkv)


# ---- dynamic (traced dense) masks


DYNAMIC_CASES = [
    (1, (32, 32), (8, 8), 1, 1),
    (2, (64, 32), (8, 16), 2, 2),
    (3, (48, 64), (16, 8), 1, 3),
    (4, (64, 64), (8, 8), 2, 4),
]


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("case", DYNAMIC_CASES)
def test_dynamic_mask_matches_static_processing(case, is_dkv):
    heads, shape, block_shape, head_shards, q_seq_shards = case
    dense = np.stack([block_random(shape, seed) for seed in range(heads)])
    if heads == 4:
        dense[1], dense[3] = dense[0], dense[2]  # head shards that share one mask
    shards = {"head_shards": head_shards, "q_seq_shards": q_seq_shards}
    dynamic = mi.process_dynamic_mask_dkv if is_dkv else mi.process_dynamic_mask

    @jax.jit
    def run(mask):
        info, _ = dynamic(mask, block_shape, **shards)
        return info._replace(is_dynamic_mask=None)

    got = jax.tree.map(np.asarray, run(jnp.asarray(dense)))
    static = masks.MultiHeadMask([masks.NumpyMask(d) for d in dense])
    want, _ = (mi.process_mask_dkv if is_dkv else mi.process_mask)(
        static, block_shape, shrink_grid=False, **shards
    )
    check_mask_info(got, None, dense, block_shape, **shards, is_dkv=is_dkv)
    rows = want.block_mask.shape[0]
    for head in range(heads):
        want_row, used = head * rows // heads, got.block_mask[head] != EMPTY
        np.testing.assert_array_equal(got.block_mask[head], want.block_mask[want_row])
        np.testing.assert_array_equal(got.data_next[head][used], want.data_next[want_row][used])
        partial = got.block_mask[head] == PARTIAL
        np.testing.assert_array_equal(
            got.partial_mask_blocks[got.mask_next[head][partial]],
            want.partial_mask_blocks[want.mask_next[want_row][partial]],
        )


# ---- DocumentMask from traced cu_seqlens / segment ids

DOC_LEN, DOC_COUNT = 64, 5
TRACES: dict[str, int] = {}


@functools.partial(jax.jit, static_argnames=("config",))
def traced_documents(cu_q, cu_kv, segment_ids, config):
    """The MaskInfo arrays and ElementMask of a traced DocumentMask (counts traces)."""
    TRACES[config.name] = TRACES.get(config.name, 0) + 1
    kwargs = {"causal": config.causal, "window": config.window}
    if config.from_segment_ids:
        mask = masks.DocumentMask.from_segment_ids(segment_ids, **kwargs)
    else:
        mask = masks.DocumentMask(cu_q, cu_kv, shape=(DOC_LEN, DOC_LEN), **kwargs)
    process = mi.process_mask_dkv if config.is_dkv else mi.process_mask
    info, element = process(mask, config.block_shape, q_seq_shards=config.q_seq_shards)
    return info.block_mask, info.data_next, info.mask_next, element


@dataclasses.dataclass(frozen=True)
class DocConfig:
    """A hashable static configuration of `traced_documents`."""

    name: str
    causal: bool
    window: tuple[int | None, int | None] | None
    from_segment_ids: bool
    is_dkv: bool
    block_shape: tuple[int, int]
    q_seq_shards: int


DOC_CONFIGS = [
    DocConfig("causal", True, None, False, False, (8, 8), 1),
    DocConfig("window_dkv", False, (6, 3), False, True, (8, 16), 2),
    DocConfig("segments", True, (None, None), True, False, (16, 8), 4),
    DocConfig("plain_dkv", False, None, False, True, (4, 8), 1),
]


@st.composite
def fixed_count_documents(draw):
    """(cu_q, cu_kv): DOC_COUNT documents (some empty) ending at or before DOC_LEN."""
    cu = []
    for _ in range(2):
        cuts = draw(st.lists(st.integers(0, DOC_LEN), min_size=DOC_COUNT, max_size=DOC_COUNT))
        cu.append(np.concatenate([[0], np.sort(cuts)]).astype(np.int32))
    return cu[0], cu[1]


@pytest.mark.parametrize("config", DOC_CONFIGS, ids=[c.name for c in DOC_CONFIGS])
@given(documents=fixed_count_documents())
def test_traced_document_mask_matches_concrete(config, documents):
    cu_q, cu_kv = documents
    if config.from_segment_ids:
        cu_kv = cu_q  # one id array for q and kv
    segment_ids = segment_ids_of(cu_q, DOC_LEN, 0)
    block_mask, data_next, mask_next, element = traced_documents(cu_q, cu_kv, segment_ids, config)
    assert TRACES[config.name] == 1, "new documents of one shape must not retrace"
    window = (None, None) if config.window is None else config.window
    concrete = masks.DocumentMask(
        cu_q, cu_kv, shape=(DOC_LEN, DOC_LEN), causal=config.causal, window=window
    )
    left, right = window
    dense = dense_documents(cu_q, cu_kv, DOC_LEN, DOC_LEN, left, 0 if config.causal else right)
    np.testing.assert_array_equal(concrete[:, :], dense)
    np.testing.assert_array_equal(evaluate_element(element, DOC_LEN, DOC_LEN), dense)
    process = mi.process_mask_dkv if config.is_dkv else mi.process_mask
    want, _ = process(
        concrete, config.block_shape, q_seq_shards=config.q_seq_shards, shrink_grid=False
    )
    np.testing.assert_array_equal(block_mask, want.block_mask)
    used = want.block_mask != EMPTY
    np.testing.assert_array_equal(np.asarray(data_next)[used], want.data_next[used])
    info = mi.MaskInfo(data_next, mask_next, block_mask, None, element.q_sequence)
    check_mask_info(
        info, element, dense[None], config.block_shape,
        head_shards=1, q_seq_shards=config.q_seq_shards, is_dkv=config.is_dkv,
    )  # fmt: skip


def test_traced_document_mask_with_permuted_sequences():
    """Any q order; a kv order whose blocks are runs of consecutive positions (the
    load-balanced context-parallel order with blocks dividing its chunks)."""
    q_order = np.random.default_rng(0).permutation(DOC_LEN).astype(np.int32)
    kv_order = load_balanced_positions(DOC_LEN, 2)
    cu = np.array([0, 10, 10, 40, 57], np.int32)

    @jax.jit
    def build(cu):
        mask = masks.DocumentMask(
            cu, shape=(DOC_LEN, DOC_LEN), causal=True, q_sequence=q_order, kv_sequence=kv_order
        )
        info, element = mi.process_mask_dkv(mask, (8, 8))
        return info._replace(is_dynamic_mask=None), element

    info, element = build(cu)
    dense = dense_documents(cu, cu, DOC_LEN, DOC_LEN, None, 0)[np.ix_(q_order, kv_order)]
    np.testing.assert_array_equal(evaluate_element(element, DOC_LEN, DOC_LEN), dense)
    check_mask_info(info, element, dense[None], (8, 8), head_shards=1, q_seq_shards=1, is_dkv=True)


def test_traced_document_mask_with_scattered_kv_order_says_why():
    kv_order = np.random.default_rng(0).permutation(DOC_LEN).astype(np.int32)

    @jax.jit
    def build(cu):
        mask = masks.DocumentMask(cu, shape=(DOC_LEN, DOC_LEN), kv_sequence=kv_order)
        return mi.process_mask(mask, (8, 8))[0].block_mask

    with pytest.raises(ValueError, match="kv_sequence"):
        build(np.array([0, 10, 64], np.int32))


# ---- bad input


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: mi.process_mask(masks.CausalMask((64, 64)), (24, 8)), ValueError, "block_q=24"),
        (lambda: mi.process_mask(masks.CausalMask((64, 64)), (8, 24)), ValueError, "block_kv=24"),
        (lambda: mi.process_mask(masks.CausalMask((64, 64)), (0, 8)), ValueError, "block_q=0"),
        (
            lambda: mi.process_mask(
                masks.MultiHeadMask([masks.CausalMask((8, 8))] * 3), (4, 4), head_shards=2
            ),
            ValueError,
            "head_shards=2",
        ),
        (
            lambda: mi.process_mask_dkv(masks.CausalMask((64, 64)), (8, 8), q_seq_shards=3),
            ValueError,
            "q_seq_shards=3",
        ),
        (lambda: mi.process_mask(np.ones((8, 8), bool), (4, 4)), TypeError, "Mask"),
        (lambda: mi.process_mask(jm.CausalMask((8, 8)), (4, 4)), TypeError, "Mask"),
        (lambda: mi.process_dynamic_mask(jnp.ones((8, 8), bool), (4, 4)), ValueError, "heads"),
        (
            lambda: mi.process_dynamic_mask(jnp.ones((1, 8, 8), jnp.int32), (4, 4)),
            ValueError,
            "bool",
        ),
        (
            lambda: mi.process_dynamic_mask(jnp.ones((1, 8, 8), bool), (3, 4)),
            ValueError,
            "block_q=3",
        ),
    ],
)
def test_bad_arguments_raise(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_check_empty_rows_names_the_row():
    mask = masks.CausalMask((16, 16), offset=-3)
    with pytest.raises(ValueError, match=r"q rows \[0, 1, 2\] of head mask 0"):
        mi.process_mask(mask, (4, 4), check_empty_rows=True)
    multi = masks.MultiHeadMask(
        [
            masks.FullMask((16, 16)),
            masks.NumpyMask(np.eye(16, dtype=bool)[::-1] & (np.arange(16) != 5)[:, None]),
        ]
    )
    with pytest.raises(ValueError, match=r"q rows \[5\] of head mask 1"):
        mi.process_mask_dkv(multi, (4, 4), check_empty_rows=True)
    mi.process_mask(masks.CausalMask((16, 16)), (4, 4), check_empty_rows=True)  # no empty row


@pytest.mark.parametrize(
    "cu_q, cu_kv, shape, message",
    [
        ([1, 4, 8], None, (8, 8), "start at 0"),
        ([0, 5, 3], None, (8, 8), "never decrease"),
        ([0, 4, 9], None, (8, 8), "end at most"),
        ([0, 4, 8], [0, 8], (8, 8), "one"),
        ([[0, 4, 8]], None, (8, 8), r"cu_seqlens_q must have shape \[num_docs \+ 1\]"),
        ([], None, (8, 8), r"cu_seqlens_q must have shape \[num_docs \+ 1\], got \(0,\)"),
        # unsigned: differences computed as such would wrap to positive and pass
        (np.array([0, 5, 3], np.uint32), None, (8, 8), "never decrease"),
    ],
)
def test_bad_cu_seqlens_raise(cu_q, cu_kv, shape, message):
    with pytest.raises(ValueError, match=message):
        masks.DocumentMask(
            np.asarray(cu_q), None if cu_kv is None else np.asarray(cu_kv), shape=shape
        )


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("cu", [np.array([0.0, 4.0, 8.0]), np.array([True, False])])
def test_cu_seqlens_of_a_non_integer_dtype_is_a_type_error_naming_it(cu, traced):
    cu = jnp.asarray(cu) if traced else cu
    expected = f"DocumentMask: cu_seqlens_q must have an integer dtype, got {cu.dtype}"

    def make(c):
        return masks.DocumentMask(c, shape=(8, 8)).shape

    with pytest.raises(TypeError, match=expected):
        jax.jit(make)(cu) if traced else make(cu)


def test_bad_segment_ids_and_traced_shape_raise():
    with pytest.raises(ValueError, match="ascending"):
        masks.DocumentMask.from_segment_ids(np.array([2, 2, 1, 1]))
    with pytest.raises(ValueError, match="ascending"):
        masks.DocumentMask.from_segment_ids(np.array([1, 0, 2, 2]))
    with pytest.raises(ValueError, match="shape"):
        jax.jit(lambda cu: masks.DocumentMask(cu).shape)(jnp.array([0, 4, 8]))


# ---- long sequences (a smoke test of the O(q + blocks) path; no timing asserted)


def test_long_causal_mask_at_128_blocks():
    length, block = 131072, 128
    blocks = length // block
    mask = masks.CausalMask((length, length))
    for is_dkv, process in ((False, mi.process_mask), (True, mi.process_mask_dkv)):
        info, element = process(mask, (block, block))
        ((_, qi, ki, block_class, _),) = visits(info, 1, blocks, 1, is_dkv)
        assert len(qi) == blocks * (blocks + 1) // 2
        assert np.all(ki <= qi) and len(np.unique(qi * blocks + ki)) == len(qi)
        np.testing.assert_array_equal(block_class == PARTIAL, qi == ki)
        assert info.partial_mask_blocks is None and element is not None


def test_long_document_mask_at_128_blocks():
    length, block, docs = 131072, 128, 64
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, length - 1000), docs - 1, replace=False))
    cu = np.concatenate([[0], cuts, [length - 1000]]).astype(np.int32)  # trailing padding
    info, _ = mi.process_mask(
        masks.DocumentMask(cu, shape=(length, length), causal=True),
        (block, block),
        shrink_grid=False,
    )
    # Independent block-level rule: (qi, ki) is non-empty iff some document d reaches it
    # with a kv token at or before one of its q tokens (equal q and kv documents).
    expected = np.zeros((length // block,) * 2, bool)
    for start, end in itertools.pairwise(cu):
        first, last = start // block, (end - 1) // block
        qi, ki = np.meshgrid(np.arange(first, last + 1), np.arange(first, last + 1), indexing="ij")
        earliest_kv = np.maximum(ki * block, start)
        latest_q = np.minimum(qi * block + block - 1, end - 1)
        expected[qi, ki] |= earliest_kv <= latest_q
    np.testing.assert_array_equal(info.block_mask[0] != EMPTY, expected)


def test_unsigned_cu_seqlens_mean_what_signed_ones_do():
    """As varlen_attention takes them: any integer dtype whose values fit."""
    unsigned = masks.DocumentMask(np.array([0, 3, 8], np.uint32), shape=(8, 8), causal=True)
    signed = masks.DocumentMask(np.array([0, 3, 8], np.int64), shape=(8, 8), causal=True)
    np.testing.assert_array_equal(unsigned[:, :], signed[:, :])
    assert unsigned[:, :].sum() == 3 * 4 // 2 + 5 * 6 // 2
