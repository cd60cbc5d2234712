"""Tests for pack / unpack (jax_bridge.host.packing).

The oracle is a numpy loop over (batch, position); gradients are checked against
``jax.grad`` of a dense 0/1 selection-matrix reference built by that loop. Hypothesis
examples run through functions compiled once for a fixed shape.
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

from jax_bridge.host.packing import pack, unpack

BATCH, SEQ = 5, 7
FEATURE_SHAPES = [(), (3,), (2, 2)]
FILL = -7.5

lengths_arrays = hnp.arrays(np.int32, (BATCH,), elements=st.integers(0, SEQ))
masks = hnp.arrays(np.bool_, (BATCH, SEQ))
feature_shapes = st.sampled_from(FEATURE_SHAPES)
seeds = st.integers(0, 2**32 - 1)


def random_x(seed, feature_shape, batch=BATCH, seq=SEQ, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((batch, seq, *feature_shape)).astype(dtype)


def mask_from_lengths(lengths, seq):
    return np.arange(seq)[None, :] < np.asarray(lengths)[:, None]


def cu_from_mask(mask):
    return np.concatenate([[0], np.cumsum(mask.sum(axis=1))])


def ref_pack(x, mask, total_tokens, fill_value):
    rows = [x[b, s] for b in range(x.shape[0]) for s in range(x.shape[1]) if mask[b, s]]
    out = np.full((total_tokens, *x.shape[2:]), fill_value, x.dtype)
    for t, row in enumerate(rows):
        out[t] = row
    cu = np.concatenate([[0], np.cumsum(mask.sum(axis=1))])
    return out, cu


def ref_unpack(packed, cu, max_len, fill_value):
    batch = len(cu) - 1
    out = np.full((batch, max_len, *packed.shape[1:]), fill_value, packed.dtype)
    for b in range(batch):
        for s in range(cu[b + 1] - cu[b]):
            out[b, s] = packed[cu[b] + s]
    return out


# Traced lengths/mask: the packed length defaults to the static bound BATCH * SEQ.
pack_traced = jax.jit(functools.partial(pack, fill_value=FILL))
unpack_fixed = jax.jit(functools.partial(unpack, batch=BATCH, max_len=SEQ, fill_value=FILL))


# ---------------------------------------------------------------- properties


@given(lengths=lengths_arrays, feature_shape=feature_shapes, seed=seeds)
def test_pack_lengths_matches_loop(lengths, feature_shape, seed):
    x = random_x(seed, feature_shape)
    packed, cu = pack_traced(x, lengths)
    want, want_cu = ref_pack(x, mask_from_lengths(lengths, SEQ), BATCH * SEQ, FILL)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(cu, want_cu)
    assert cu.dtype == jnp.int32


@given(mask=masks, feature_shape=feature_shapes, seed=seeds)
def test_pack_mask_keeps_masked_in_tokens_in_order(mask, feature_shape, seed):
    x = random_x(seed, feature_shape)
    packed, cu = pack_traced(x, mask)
    n = int(mask.sum())
    # Row-major boolean indexing is exactly "masked-in tokens, row by row, in order".
    np.testing.assert_array_equal(packed[:n], x[mask])
    assert np.all(np.asarray(packed[n:]) == np.float32(FILL))
    np.testing.assert_array_equal(cu_from_mask(mask), cu)


@given(lengths=lengths_arrays, feature_shape=feature_shapes, seed=seeds)
def test_unpack_inverts_pack(lengths, feature_shape, seed):
    x = random_x(seed, feature_shape)
    padded = unpack_fixed(*pack_traced(x, lengths))
    keep = mask_from_lengths(lengths, SEQ).reshape(BATCH, SEQ, *([1] * len(feature_shape)))
    np.testing.assert_array_equal(padded, np.where(keep, x, np.float32(FILL)))


@given(lengths=lengths_arrays, feature_shape=feature_shapes, seed=seeds)
def test_pack_inverts_unpack(lengths, feature_shape, seed):
    cu = cu_from_mask(mask_from_lengths(lengths, SEQ)).astype(np.int32)
    packed = np.random.default_rng(seed).standard_normal((BATCH * SEQ, *feature_shape))
    packed = packed.astype(np.float32)
    padded = unpack_fixed(packed, cu)
    np.testing.assert_array_equal(padded, ref_unpack(packed, cu, SEQ, FILL))
    repacked, recu = pack_traced(padded, lengths)
    n = cu[-1]
    np.testing.assert_array_equal(repacked[:n], packed[:n])
    np.testing.assert_array_equal(recu, cu)


# ---------------------------------------------------------------- fixed cases, jit == eager

EAGER_CASES = [
    ([3, 0, 4], 5, (3,)),
    ([0], 3, ()),
    ([1], 1, (2, 2)),
    ([2, 1, 0, 0, 6], 6, ()),
    ([0, 0], 4, (3,)),
]


@pytest.mark.parametrize(("lengths", "seq", "feature_shape"), EAGER_CASES)
def test_eager_exact_size_and_jit_agree_with_loop(lengths, seq, feature_shape):
    batch = len(lengths)
    x = random_x(len(lengths) * 31 + seq, feature_shape, batch, seq)
    mask = mask_from_lengths(lengths, seq)
    total = sum(lengths)
    want, want_cu = ref_pack(x, mask, total, 0)
    for lengths_or_mask in (np.asarray(lengths, np.int32), mask):
        packed, cu = pack(x, lengths_or_mask)
        np.testing.assert_array_equal(packed, want)
        np.testing.assert_array_equal(cu, want_cu)
        jit_pack = jax.jit(functools.partial(pack, total_tokens=total + 2, fill_value=FILL))
        jit_packed, jit_cu = jit_pack(x, jnp.asarray(lengths_or_mask))
        eager_packed, _ = pack(x, lengths_or_mask, total_tokens=total + 2, fill_value=FILL)
        np.testing.assert_array_equal(jit_packed, eager_packed)
        np.testing.assert_array_equal(jit_packed, ref_pack(x, mask, total + 2, FILL)[0])
        np.testing.assert_array_equal(jit_cu, want_cu)
    padded = unpack(want, want_cu, batch, seq, fill_value=FILL)
    jit_unpack = jax.jit(functools.partial(unpack, batch=batch, max_len=seq, fill_value=FILL))
    np.testing.assert_array_equal(jit_unpack(want, jnp.asarray(want_cu, jnp.int32)), padded)
    np.testing.assert_array_equal(padded, ref_unpack(want, want_cu, seq, FILL))


@pytest.mark.parametrize("transform", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
@pytest.mark.parametrize(("lengths", "seq", "feature_shape"), EAGER_CASES)
def test_concrete_lengths_or_mask_inside_a_transform_give_the_exact_size(
    transform, lengths, seq, feature_shape
):
    """Lengths or a mask the transformed function closes over are concrete: the packed
    axis is the exact count there too (not batch * seq), as eagerly; unpack and pack
    with too small sizes raise at once, naming the op."""
    batch = len(lengths)
    x = random_x(len(lengths) * 17 + seq, feature_shape, batch, seq)
    mask = mask_from_lengths(lengths, seq)
    want, want_cu = ref_pack(x, mask, sum(lengths), 0)
    for lengths_or_mask in (np.asarray(lengths, np.int32), mask):
        packed, cu = transform(lambda x, given=lengths_or_mask: pack(x, given))(x)
        np.testing.assert_array_equal(packed, want)
        np.testing.assert_array_equal(cu, want_cu)
        if sum(lengths):
            with pytest.raises(ValueError, match=f"pack: total_tokens={sum(lengths) - 1}"):
                transform(
                    lambda x, given=lengths_or_mask: pack(x, given, total_tokens=sum(lengths) - 1)
                )(x)
    unpacked = transform(lambda p: unpack(p, want_cu, batch, seq, fill_value=FILL))(want)
    np.testing.assert_array_equal(unpacked, ref_unpack(want, want_cu, seq, FILL))
    if max(lengths) > 0:
        with pytest.raises(ValueError, match=f"unpack: max_len={max(lengths) - 1}"):
            transform(lambda p: unpack(p, want_cu, batch, max(lengths) - 1))(want)
        with pytest.raises(ValueError, match=r"unpack: packed.shape\[0\]"):
            transform(lambda p: unpack(p[:-1], want_cu, batch, seq))(want)


def test_left_padded_mask_packs_the_trailing_tokens():
    lengths = np.array([2, 0, 5, 1])
    seq = 5
    x = random_x(3, (2,), len(lengths), seq)
    left_mask = np.arange(seq)[None, :] >= seq - lengths[:, None]
    packed, cu = pack(x, left_mask)
    want = np.concatenate([x[b, seq - n :] for b, n in enumerate(lengths)])
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(cu, [0, 2, 2, 7, 8])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_dtypes_are_preserved(dtype):
    x = (random_x(5, (3,), 3, 4) * 10).astype(dtype)
    packed, cu = pack(x, np.array([4, 1, 0]), total_tokens=7)
    assert packed.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(packed, np.float32),
        ref_pack(np.asarray(x, np.float32), mask_from_lengths([4, 1, 0], 4), 7, 0)[0],
    )
    assert unpack(packed, cu, 3, 4).dtype == dtype


def test_empty_batch_and_empty_rows():
    x = random_x(0, (2,), 0, 4)
    packed, cu = pack(x, np.zeros(0, np.int32), total_tokens=2, fill_value=FILL)
    np.testing.assert_array_equal(packed, np.full((2, 2), FILL, np.float32))
    np.testing.assert_array_equal(cu, [0])
    padded = unpack(np.zeros((0, 2), np.float32), [0, 0], 1, 3, fill_value=FILL)
    np.testing.assert_array_equal(padded, np.full((1, 3, 2), FILL, np.float32))


# ---------------------------------------------------------------- gradients


def selection_matrix(mask, total_tokens):
    """``[total_tokens, batch * seq]`` 0/1 matrix with ``P @ x_flat`` = the packed tokens."""
    sel = np.zeros((total_tokens, mask.size), np.float32)
    for t, flat in enumerate(np.flatnonzero(mask)):
        sel[t, flat] = 1.0
    return sel


def _exact_matmul(a, b):
    """a @ b in exact float32 products: XLA:GPU's default for float32 is TF32."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("by", ["lengths", "mask"])
def test_pack_gradients_match_dense_reference(by):
    rng = np.random.default_rng(11)
    if by == "mask":
        mask = rng.random((4, 6)) < 0.5
        mask[1] = False
        lengths_or_mask = mask
    else:
        lengths_or_mask = np.array([2, 0, 6, 1], np.int32)
        mask = mask_from_lengths(lengths_or_mask, 6)
    x = rng.standard_normal((4, 6, 3)).astype(np.float32)
    total = int(mask.sum()) + 3
    weights = rng.standard_normal((total, 3)).astype(np.float32)
    sel = selection_matrix(mask, total)

    def loss(x, fill):
        return jnp.sum(weights * pack(x, lengths_or_mask, total_tokens=total, fill_value=fill)[0])

    def ref_loss(x, fill):
        packed = _exact_matmul(sel, x.reshape(-1, 3)) + (1.0 - sel.sum(1, keepdims=True)) * fill
        return jnp.sum(weights * packed)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, np.float32(0.3))
    want = jax.grad(ref_loss, argnums=(0, 1))(x, np.float32(0.3))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got[0])[~mask] == 0)


def test_unpack_gradients_match_dense_reference():
    rng = np.random.default_rng(12)
    lengths = np.array([3, 0, 1, 5])
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    packed = rng.standard_normal((11, 2)).astype(np.float32)
    weights = rng.standard_normal((4, 6, 2)).astype(np.float32)
    # Unpacking is the transpose of packing the right-padded positions.
    sel = selection_matrix(mask_from_lengths(lengths, 6), 11).T

    def loss(packed, fill):
        return jnp.sum(weights * unpack(packed, cu, 4, 6, fill_value=fill))

    def ref_loss(packed, fill):
        padded = _exact_matmul(sel, packed) + (1.0 - sel.sum(1, keepdims=True)) * fill
        return jnp.sum(weights * padded.reshape(4, 6, 2))

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(packed, np.float32(-1.0))
    want = jax.grad(ref_loss, argnums=(0, 1))(packed, np.float32(-1.0))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got[0])[cu[-1] :] == 0)


# ---------------------------------------------------------------- bad input


def test_bad_pack_inputs():
    x = random_x(1, (), 3, 4)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, seq"):
        pack(x[0, 0], np.array([1]))
    with pytest.raises(ValueError, match="lengths_or_mask must be <= 4"):
        pack(x, np.array([1, 5, 0]))
    with pytest.raises(ValueError, match="lengths_or_mask must be >= 0"):
        pack(x, np.array([1, -1, 0]))
    with pytest.raises(ValueError, match=r"lengths_or_mask.*shape \(3,\)"):
        pack(x, np.array([1, 1]))
    with pytest.raises(TypeError, match=r"lengths_or_mask.*integer"):
        pack(x, np.array([1.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"lengths_or_mask must have shape \(3, 4\)"):
        pack(x, np.ones((3, 5), bool))
    with pytest.raises(TypeError, match="lengths_or_mask must be bool or integer"):
        pack(x, np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="rank 3"):
        pack(x, np.ones((3, 4, 1), bool))
    with pytest.raises(ValueError, match="total_tokens=2"):
        pack(x, np.array([1, 2, 0]), total_tokens=2)
    with pytest.raises(ValueError, match=r"pack: fill_value must be a scalar, got shape \(2,\)"):
        pack(x, np.array([1, 2, 0]), fill_value=np.zeros(2))


def test_bad_unpack_inputs():
    packed = random_x(2, (2,), 1, 6)[0]
    cu = np.array([0, 2, 6])
    with pytest.raises(ValueError, match="batch=3"):
        unpack(packed, cu, 3, 4)
    with pytest.raises(ValueError, match="max_len=3"):
        unpack(packed, cu, 2, 3)
    with pytest.raises(ValueError, match=r"packed.shape\[0\]=5"):
        unpack(packed[:5], cu, 2, 4)
    with pytest.raises(TypeError, match="cu_seqlens"):
        unpack(packed, cu.astype(np.float32), 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        unpack(packed, np.array([0, 4, 2]), 2, 4)
    with pytest.raises(TypeError, match=r"max_len.*static"):
        jax.jit(unpack, static_argnums=2)(packed, cu, 2, 4)
    with pytest.raises(ValueError, match="packed must have shape"):
        unpack(np.float32(1.0), np.array([0]), 0, 1)


@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        (functools.partial(pack, total_tokens=12), (random_x(0, (), 3, 4), [1, 5, 0]), "<= 4"),
        (functools.partial(pack, total_tokens=12), (random_x(0, (), 3, 4), [1, -2, 0]), ">= 0"),
        (
            functools.partial(pack, total_tokens=2),
            (random_x(0, (), 3, 4), [1, 2, 0]),
            "total_tokens=2",
        ),
        (functools.partial(unpack, batch=2, max_len=3), (np.ones((6, 2)), [0, 2, 6]), "max_len=3"),
        (
            functools.partial(unpack, batch=2, max_len=6),
            (np.ones((6, 2)), [0, 4, 2]),
            "non-decreasing",
        ),
    ],
)
def test_traced_value_errors_are_reported_by_checkify(fn, args, match):
    err, _ = jax.jit(checkify.checkify(fn))(*(jnp.asarray(a) for a in args))
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        err.throw()
