"""Every block-sparse implementation against the dense float64 oracle.

Each case runs `block_sparse_attention` (float32, jitted value and gradients of q, k, v
and sinks) and `block_sparse_attention_reference` in float64 under `jax.enable_x64` on
the same inputs; the tolerance is the attention tests' (tests/attention/helpers.py:
C * u * (S + sqrt(L)) relative to |expected| + max|expected|). Shapes are small and
uneven (padding to blocks is part of what is tested); the XLA path runs small blocks
so that masks have many empty, partial and full blocks. Outputs and gradients are
checked finite everywhere (every element written).
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from jax_bridge import (
    ScoreMod,
    block_sparse_attention,
    block_sparse_attention_reference,
    load_balanced_positions,
    varlen_attention,
)
from jax_bridge.block_sparse.api import BACKENDS
from jax_bridge.block_sparse.checks import check_block_sizes
from jax_bridge.block_sparse.masks import block_counts
from jax_bridge.core.backend import compiling_for_platform
from pallas_tpu.splash import (
    BlockSizes,
    CausalMask,
    ChunkedCausalMask,
    DocumentMask,
    FullMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    PredicateMask,
    PrefixLMMask,
)
from tests.attention.helpers import (
    U32,
    C,
    assert_close,
    assert_equal_to_rounding,
    assert_lse_close,
    score_bound,
)
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig

IMPLEMENTATIONS = ["xla", "pallas", "triton"]
XLA_BLOCKS = BlockSizes(block_q=32, block_kv=16)


def _blocks(implementation: str):
    return XLA_BLOCKS if implementation == "xla" else None


def _inputs(seed, length, num_q_heads=2, num_kv_heads=1, head_dim=16, batch=1, kv_length=None):
    rng = np.random.default_rng(seed)
    kv_length = length if kv_length is None else kv_length
    draw = lambda *shape: jax.device_put(rng.standard_normal(shape).astype(np.float32))
    q = draw(batch, length, num_q_heads, head_dim)
    k, v = (
        draw(batch, kv_length, num_kv_heads, head_dim),
        draw(batch, kv_length, num_kv_heads, head_dim),
    )
    sinks = draw(num_q_heads)
    weights = (draw(batch, length, num_q_heads, head_dim), draw(batch, num_q_heads, length))
    return q, k, v, sinks, weights


def _loss(fn, mask, weights, kwargs):
    """A scalar touching out and lse with random weights (lse's -inf rows excluded)."""

    def loss(q, k, v, sinks):
        out, lse = fn(q, k, v, mask, sinks=sinks, return_lse=True, **kwargs)
        finite = jnp.isfinite(lse)
        w_out, w_lse = (w.astype(out.dtype) for w in weights)
        value = jnp.sum(out * w_out) + jnp.sum(jnp.where(finite, lse * w_lse, 0.0))
        return value, (out, lse)

    return loss


def _tolerance(q, k, kwargs, sinks) -> float:
    tokens_first = lambda x: x[0]  # [L, H, D] of batch entry 0; the bound is per pair
    bound = score_bound(tokens_first(q), tokens_first(k), kwargs.get("softmax_scale"), sinks)
    longest = max(q.shape[1], k.shape[1], q.shape[-1])
    alibi = kwargs.get("alibi_slopes")
    if alibi is not None:  # |score| grows by up to slope * the longest distance
        bound += float(np.max(np.abs(alibi))) * max(q.shape[1], k.shape[1])
    return C * U32 * (bound + np.sqrt(longest))


def _wide(x):
    return jax.device_put(np.asarray(x, np.float64))


def _oracle(mask, q, k, v, sinks, weights, kwargs):
    """(out, lse, [dq, dk, dv(, d sinks)]) of the reference in float64, as numpy."""
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    with jax.enable_x64(True):
        wide_weights = tuple(_wide(w) for w in weights)
        oracle = jax.jit(  # one program, not one per operation
            jax.value_and_grad(
                _loss(block_sparse_attention_reference, mask, wide_weights, kwargs),
                argnums,
                has_aux=True,
            )
        )
        wide_sinks = None if sinks is None else _wide(sinks)
        (_, (out, lse)), grads = oracle(_wide(q), _wide(k), _wide(v), wide_sinks)
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def check(implementation, mask, q, k, v, sinks, weights, *, use_sinks=True, **kwargs):
    """The op's out, lse and gradients against the float64 oracle (at the backend's test
    tiles unless kwargs give block_sizes)."""
    sinks = sinks if use_sinks else None
    op_kwargs = {"block_sizes": _blocks(implementation), **kwargs, "implementation": implementation}
    argnums = (0, 1, 2, 3) if use_sinks else (0, 1, 2)
    grad = jax.value_and_grad(
        _loss(block_sparse_attention, mask, weights, op_kwargs), argnums, has_aux=True
    )
    grad = jax.jit(grad)
    (_, (out, lse)), grads = grad(q, k, v, sinks)
    want_out, want_lse, want_grads = _oracle(mask, q, k, v, sinks, weights, kwargs)
    tol = _tolerance(q, k, kwargs, sinks)
    assert out.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, want_out, tol, f"{implementation} out")
    assert_lse_close(lse, want_lse, tol, f"{implementation} lse")
    for name, got, want in zip("qkvs", grads, want_grads, strict=False):
        assert_close(got, want, tol, f"{implementation} d{name}")
    return out, lse


# ------------------------------------------------------------------- masks, one by one

L = 150  # not a multiple of any block: padding everywhere


def _random_block_mask(seed, q_len, kv_len, block_q=32, block_kv=16) -> np.ndarray:
    """Blocks drawn empty / full / partial (random elements), one row fully masked."""
    rng = np.random.default_rng(seed)
    dense = rng.random((q_len, kv_len)) < 0.5
    kinds = rng.integers(0, 3, (-(-q_len // block_q), -(-kv_len // block_kv)))
    for (i, j), kind in np.ndenumerate(kinds):
        rows, cols = slice(i * block_q, (i + 1) * block_q), slice(j * block_kv, (j + 1) * block_kv)
        if kind < 2:
            dense[rows, cols] = bool(kind)
    dense[7] = False
    return dense


def _every_fifth(q, kv):
    return (q - kv) % 5 == 0


@triton.jit
def _every_fifth_triton(q, kv):
    # q - kv may be negative: Triton's % keeps the dividend's sign, numpy's the divisor's;
    # both are 0 exactly on the multiples of 5.
    return (q - kv) % 5 == 0


def _relative_bias(s, batch, head, q, kv):
    """A per-head relative-position bias (ALiBi-like, additive) plus a per-batch offset."""
    return s - 0.25 * (head + 1) * jnp.abs(q - kv).astype(s.dtype) + 0.5 * batch


@triton.jit
def _relative_bias_triton(s, batch, head, q, kv):
    return s - 0.25 * (head + 1) * tl.abs(q - kv).to(tl.float32) + 0.5 * batch


def _square_cap(s, batch, head, q, kv):
    """A non-additive hook: s * |s| / (1 + |s|), derivative (|s|^2 + 2|s|) / (1 + |s|)^2."""
    del batch, head, q, kv
    return s * jnp.abs(s) / (1.0 + jnp.abs(s))


@triton.jit
def _square_cap_triton(s, batch, head, q, kv):
    return s * tl.abs(s) / (1.0 + tl.abs(s))


@triton.jit
def _square_cap_grad(s, batch, head, q, kv):
    a = tl.abs(s)
    return (a * a + 2.0 * a) / ((1.0 + a) * (1.0 + a))


SCORE_MODS = {
    "relative_bias": ScoreMod(_relative_bias, _relative_bias_triton),
    "square_cap": ScoreMod(_square_cap, _square_cap_triton, _square_cap_grad),
}


def _masks():
    docs = np.array([0, 30, 31, 90, 140], np.int32)  # a length-1 document; padding after 140
    return {
        "causal": CausalMask((L, L)),
        "sliding_window": LocalMask((L, L), window_size=(20, 3), offset=0),
        "chunked_causal": ChunkedCausalMask((L, L), chunk_size=40),
        "prefix_lm": PrefixLMMask((L, L), prefix_length=37),
        "documents": DocumentMask(docs, shape=(L, L), causal=True),
        # kv rows at positions other than their numbers: Triton's token rule, not intervals
        "causal_over_moved_keys": CausalMask(
            (L, L), kv_sequence=np.random.default_rng(3).permutation(L).astype(np.int32)
        ),
        "prefix_lm_and_documents": PrefixLMMask((L, L), prefix_length=50)
        & DocumentMask(docs, shape=(L, L)),
        "predicate": PredicateMask((L, L), _every_fifth),
        "predicate_in_kernel": PredicateMask(
            (L, L), _every_fifth, triton_predicate=_every_fifth_triton
        ),
        "random_blocks": NumpyMask(_random_block_mask(0, L, L)),
        "multi_head": MultiHeadMask(
            [CausalMask((L, L)), LocalMask((L, L), (8, 8), 0), FullMask((L, L)), CausalMask((L, L))]
        ),
    }


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(_masks()))
def test_mask_against_oracle(implementation, name):
    mask = _masks()[name]
    heads = 4 if name == "multi_head" else 2
    q, k, v, sinks, weights = _inputs(1, L, num_q_heads=heads, num_kv_heads=heads // 2)
    # Sinks and the soft cap alternate over the cases; every case runs GQA.
    use_sinks = name in ("causal", "documents", "random_blocks", "multi_head")
    cap = 3.0 if name in ("sliding_window", "predicate", "multi_head") else None
    out, lse = check(
        implementation,
        mask,
        q,
        k,
        v,
        sinks,
        weights,
        use_sinks=use_sinks,
        logits_soft_cap=cap,
        softmax_scale=0.7,
    )
    if name == "random_blocks":  # the fully masked row: 0 out, lse the sink
        np.testing.assert_array_equal(np.asarray(out[:, 7]), 0.0)
        np.testing.assert_allclose(np.asarray(lse[0, :, 7]), np.asarray(sinks))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_documents_under_jit(implementation):
    """cu_seqlens as data: one trace serves two document layouts."""
    q, k, v, sinks, weights = _inputs(2, L, num_q_heads=2, num_kv_heads=2)
    traces = []

    @jax.jit
    def run(cu, q, k, v, sinks):
        traces.append(1)
        mask = DocumentMask(cu, shape=(L, L), causal=True, window=(25, None))
        fn = _loss(
            block_sparse_attention,
            mask,
            weights,
            dict(implementation=implementation, block_sizes=_blocks(implementation)),
        )
        return jax.value_and_grad(fn, (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)

    for cu in (np.array([0, 50, 120, 150], np.int32), np.array([0, 10, 11, 100, 130], np.int32)):
        # Same number of documents in both layouts keeps one trace: pad the first with an
        # empty document.
        cu = np.pad(cu, (0, 5 - len(cu)), mode="edge")
        (_, (out, lse)), grads = run(cu, q, k, v, sinks)
        static = DocumentMask(cu, shape=(L, L), causal=True, window=(25, None))
        want_out, want_lse, want = _oracle(static, q, k, v, sinks, weights, {})
        tol = _tolerance(q, k, {}, sinks)
        assert_close(out, want_out, tol, "out")
        assert_lse_close(lse, want_lse, tol)
        for name, got, w in zip("qkvs", grads, want, strict=True):
            assert_close(got, w, tol, f"d{name}")
    assert len(traces) == 1


def test_traced_documents_refuse_mask_algebra():
    """A DocumentMask of traced arrays combined with & or | is refused where it is built,
    naming the combination and what to do instead (its blocks are classified in the graph
    for it alone): no backend would get past classifying it."""
    cu = jnp.array([0, 40, 41, 96, L], jnp.int32)
    window = LocalMask((L, L), (10, 0), 0)
    combined = {
        "LogicalAnd": lambda cu: DocumentMask(cu, shape=(L, L)) & window,
        "LogicalOr": lambda cu: CausalMask((L, L)) | DocumentMask(cu, shape=(L, L)),
    }
    for name, combine in combined.items():
        with pytest.raises(TypeError, match=f"{name}: a DocumentMask of traced arrays"):
            jax.jit(lambda cu, combine=combine: combine(cu).shape[0])(cu)


def _blocks_of(size: int, backward: int | None = None) -> BlockSizes:
    """Every block `size` rows; the backward kernels' `backward` where given."""
    backward = size if backward is None else backward
    sizes = dict(block_q=size, block_kv=size, block_kv_compute=size)
    sizes |= {name: backward for name in ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")}
    return BlockSizes(**sizes, block_q_dq=backward, block_kv_dq=backward)


def _check_traced_documents_in_order(implementation, cu, order):
    """Traced documents over the order `order` (blocks of 16): out, lse and every
    gradient against the float64 oracle of the same documents and order, concrete. Read
    in the natural order instead, the same inputs differ from it by O(1)."""
    q, k, v, sinks, weights = _inputs(4, len(order))
    shape = (len(order), len(order))

    def mask_of(cu):
        return DocumentMask(cu, shape=shape, causal=True, q_sequence=order, kv_sequence=order)

    def loss(cu, q, k, v, sinks):
        kwargs = dict(implementation=implementation, block_sizes=_blocks_of(16))
        return _loss(block_sparse_attention, mask_of(cu), weights, kwargs)(q, k, v, sinks)

    grad = jax.jit(jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True))
    (_, (out, lse)), grads = grad(cu, q, k, v, sinks)
    want_out, want_lse, want_grads = _oracle(mask_of(np.asarray(cu)), q, k, v, sinks, weights, {})
    tol = _tolerance(q, k, {}, sinks)
    assert_close(out, want_out, tol, f"{implementation} out")
    assert_lse_close(lse, want_lse, tol, f"{implementation} lse")
    for name, got, want in zip("qkvs", grads, want_grads, strict=True):
        assert_close(got, want, tol, f"{implementation} d{name}")


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_traced_documents_refuse_kv_orders_their_blocks_cannot_follow(implementation):
    """Traced documents over a load-balanced order: kv blocks must each hold one chunk of
    consecutive positions (4 shards of 128 rows: 16-row chunks). Blocks of 64 are refused
    naming the op, the block and the fix, in the forward and where only the backward's
    are 64; blocks of 16 run, and match the oracle. The order itself must be concrete:
    traced, it is refused naming the argument."""
    q = jnp.asarray(np.random.default_rng(3).standard_normal((1, 128, 2, 16)), jnp.float32)
    order = np.asarray(load_balanced_positions(128, 4))
    cu = jnp.array([0, 40, 128], jnp.int32)

    def loss(cu, q, blocks=None, q_order=order, kv_order=order):
        mask = DocumentMask(
            cu, shape=(128, 128), causal=True, q_sequence=q_order, kv_sequence=kv_order
        )
        out = block_sparse_attention(
            q, q, q, mask, implementation=implementation, block_sizes=blocks
        )
        return out.sum()

    def traced(**blocks_and_orders):
        return jax.jit(functools.partial(loss, **blocks_and_orders))

    refused = r"block_sparse_attention: .*kv_sequence whose kv blocks \(64 rows here\)"
    with pytest.raises(ValueError, match=refused):
        traced(blocks=_blocks_of(64)).trace(cu, q)
    backward_64 = jax.jit(jax.grad(functools.partial(loss, blocks=_blocks_of(16, backward=64)), 1))
    if implementation == "triton":  # XLA's backward walks the forward's blocks
        with pytest.raises(ValueError, match=refused):
            backward_64.trace(cu, q)
    _check_traced_documents_in_order(implementation, cu, order)
    with pytest.raises(TypeError, match="q_sequence must be concrete"):
        jax.jit(lambda cu, order: loss(cu, q, q_order=order))(cu, order)
    with pytest.raises(TypeError, match="kv_sequence must be concrete"):
        jax.jit(lambda cu, order: loss(cu, q, kv_order=order))(cu, order)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_of_traced_documents_and_remat(implementation):
    """`jax.vmap` over an extra leading axis whose entries carry their own traced
    cu_seqlens, and `jax.checkpoint` around the op: equal to the oracle, gradients too."""
    length = 40
    q, k, v, _, _ = _inputs(17, length, batch=3)
    cus = np.array([[0, 17, 40], [0, 1, 40], [0, 39, 39]], np.int32)  # length 1, padding
    kwargs = dict(implementation=implementation, block_sizes=_blocks(implementation))
    documents = lambda cu: DocumentMask(cu, shape=(length, length), causal=True)

    def one(cu, q, k, v):
        return block_sparse_attention(q[None], k[None], v[None], documents(cu), **kwargs)[0]

    loss = lambda q: jnp.sum(jax.vmap(jax.checkpoint(one))(jnp.asarray(cus), q, k, v) * q)
    out, dq = jax.jit(jax.value_and_grad(loss))(q)
    with jax.enable_x64(True):
        wide_k, wide_v = _wide(k), _wide(v)

        def oracle(q):
            entry = lambda i: block_sparse_attention_reference(
                q[i : i + 1], wide_k[i : i + 1], wide_v[i : i + 1], documents(cus[i])
            )
            return jnp.sum(jnp.concatenate([entry(i) for i in range(3)]) * q)

        want, want_dq = jax.value_and_grad(oracle)(_wide(q))
    tol = _tolerance(q, k, {}, None)
    assert_close(out, np.asarray(want), tol * q.size, "vmap loss")
    assert_close(dq, np.asarray(want_dq), tol, "vmap dq")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_traced_documents_per_head(implementation):
    """A MultiHeadMask of two traced DocumentMasks (causal; a window) and a static mask,
    under jit, with GQA (one member on a whole kv group, one on heads of two groups),
    sinks, and on XLA and Triton ALiBi and a head-dependent score hook: out, lse and
    every gradient against the float64 oracle on the same documents, static."""
    q, k, v, sinks, weights = _inputs(18, L, num_q_heads=6, num_kv_heads=3, batch=2)
    cu = np.array([0, 1, 64, 130], np.int32)  # a length-1 document, padding after 130

    def per_head(cu):
        causal = DocumentMask(cu, shape=(L, L), causal=True)
        window = DocumentMask(cu, shape=(L, L), window=(12, 3))
        local = LocalMask((L, L), (9, 0), 0)
        return MultiHeadMask([causal, causal, window, local, window, local])

    kwargs = dict(logits_soft_cap=8.0)
    if implementation != "pallas":
        slopes = np.random.default_rng(19).uniform(0.01, 0.2, 6).astype(np.float32)
        kwargs |= dict(alibi_slopes=jnp.asarray(slopes), score_mod=SCORE_MODS["relative_bias"])
    op_kwargs = dict(kwargs, implementation=implementation, block_sizes=_blocks(implementation))

    @jax.jit
    def run(cu, q, k, v, sinks):
        fn = _loss(block_sparse_attention, per_head(cu), weights, op_kwargs)
        return jax.value_and_grad(fn, (0, 1, 2, 3), has_aux=True)(q, k, v, sinks)

    (_, (out, lse)), grads = run(jnp.asarray(cu), q, k, v, sinks)
    want_out, want_lse, want = _oracle(per_head(cu), q, k, v, sinks, weights, kwargs)
    tol = _tolerance(q, k, kwargs, sinks)
    assert_close(out, want_out, tol, "out")
    assert_lse_close(lse, want_lse, tol)
    for name, got, w in zip("qkvs", grads, want, strict=True):
        assert_close(got, w, tol, f"d{name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_non_finite_sinks_follow_one_rule(implementation):
    """Sinks of -inf (no sink), +inf (all the probability: out 0, lse +inf), NaN (the
    head's rows NaN) and a finite one, one per head; the other heads are unaffected."""
    q, k, v, sinks, weights = _inputs(21, 40, num_q_heads=4, num_kv_heads=2)
    mask = CausalMask((40, 40))
    sinks = sinks.at[:3].set(jnp.asarray([-jnp.inf, jnp.inf, jnp.nan]))
    kwargs = dict(implementation=implementation, block_sizes=_blocks(implementation))
    out, lse = block_sparse_attention(q, k, v, mask, sinks=sinks, return_lse=True, **kwargs)
    plain, plain_lse = block_sparse_attention(q, k, v, mask, return_lse=True, **kwargs)
    out, lse, plain, plain_lse = map(np.asarray, (out, lse, plain, plain_lse))
    assert_equal_to_rounding(out[:, :, 0], plain[:, :, 0], "no sink")
    assert_equal_to_rounding(lse[:, 0], plain_lse[:, 0], "no sink lse")
    assert np.all(out[:, :, 1] == 0) and np.all(lse[:, 1] == np.inf)
    assert np.all(np.isnan(out[:, :, 2])) and np.all(np.isnan(lse[:, 2]))
    want, want_lse, _ = _oracle(mask, q, k, v, sinks.at[:3].set(0.0), weights, {})
    tol = _tolerance(q, k, {}, sinks[3:])
    assert_close(out[:, :, 3], want[:, :, 3], tol, "finite sink out")
    assert_lse_close(lse[:, 3], want_lse[:, 3], tol)


def test_return_lse_takes_a_numpy_bool_as_varlen_attention_does():
    """`return_lse` is a static switch checked as every op's (`check_bool`): NumPy's bools
    (what a config read from an array gives) pick the branch a Python bool picks."""
    q, k, v, _, _ = _inputs(22, 24)
    mask = CausalMask((24, 24))
    kwargs = dict(implementation="xla", block_sizes=_blocks("xla"))
    out, lse = block_sparse_attention(q, k, v, mask, return_lse=np.True_, **kwargs)
    want, want_lse = block_sparse_attention(q, k, v, mask, return_lse=True, **kwargs)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    alone = block_sparse_attention(q, k, v, mask, return_lse=np.False_, **kwargs)
    np.testing.assert_array_equal(alone, want)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_large_logits_keep_the_reference_accuracy(implementation):
    """Logits of ~1e4: the output's error against float64 stays within 4x the float32
    reference's own (both normalise by the row sum; scaling by exp(m - lse) in float32
    put lse's rounding into every output: 200x the reference's error)."""
    q, k, v, _, _ = _inputs(20, 64, num_q_heads=2, num_kv_heads=2)
    q = q * 1e4
    mask = CausalMask((64, 64))
    got = block_sparse_attention(q, k, v, mask, implementation=implementation)
    twin = block_sparse_attention_reference(q, k, v, mask)
    with jax.enable_x64(True):
        want = np.asarray(block_sparse_attention_reference(_wide(q), _wide(k), _wide(v), mask))
    error = lambda x: float(np.max(np.abs(np.asarray(x, np.float64) - want)))
    assert error(got) <= 4 * error(twin) + 1e-6, (error(got), error(twin))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_length_one_and_uneven_kv(implementation):
    q, k, v, sinks, weights = _inputs(3, 1, num_q_heads=2, num_kv_heads=1, kv_length=1)
    check(implementation, CausalMask((1, 1)), q, k, v, sinks, weights)
    q, k, v, sinks, weights = _inputs(4, 5, num_q_heads=2, num_kv_heads=2, kv_length=37, batch=2)
    check(implementation, CausalMask((5, 37), offset=32), q, k, v, sinks, weights, use_sinks=False)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nan_in_one_document_stays_there(implementation):
    cu = np.array([0, 40, 100, 150], np.int32)
    mask = DocumentMask(cu, shape=(L, L), causal=True)
    q, k, v, sinks, weights = _inputs(5, L, num_q_heads=2, num_kv_heads=1)
    fn = jax.jit(
        jax.value_and_grad(
            _loss(
                block_sparse_attention,
                mask,
                weights,
                dict(implementation=implementation, block_sizes=_blocks(implementation)),
            ),
            (0, 1, 2),
            has_aux=True,
        )
    )
    (_, (out, lse)), grads = fn(q, k, v, sinks)
    poison = lambda x, row, value: x.at[:, row].set(value)
    bad = (poison(q, 45, jnp.nan), poison(k, 50, jnp.inf), poison(v, 60, jnp.nan))
    (_, (bad_out, bad_lse)), bad_grads = fn(*bad, sinks)
    clean = np.r_[0:40, 100:150]  # the other documents
    # Inside the poisoned document every row from 60 on sees v[60] (and k[50]): NaN.
    assert np.isnan(np.asarray(bad_out)[:, 60:100]).all()
    # Equal up to rounding (XLA:GPU may round one compiled program's runs differently).
    close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    close(np.asarray(bad_out)[:, clean], np.asarray(out)[:, clean])
    close(np.asarray(bad_lse)[:, :, clean], np.asarray(lse)[:, :, clean])
    for got, want in zip(bad_grads, grads, strict=True):
        np.testing.assert_allclose(np.asarray(got)[:, clean], np.asarray(want)[:, clean], atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("hook", list(SCORE_MODS))
def test_score_mod_against_oracle(implementation, hook):
    """A score hook (additive, or with its own derivative) under a prefix-LM mask inside
    documents and under per-head masks, with GQA, sinks and a soft cap: out, lse and
    every gradient against the float64 oracle applying the JAX twin."""
    docs = DocumentMask(np.array([0, 70, 150], np.int32), shape=(L, L))
    masks = [
        PrefixLMMask((L, L), prefix_length=20) & docs,
        MultiHeadMask([CausalMask((L, L)), LocalMask((L, L), (9, 2), 0)]),
    ]
    q, k, v, sinks, weights = _inputs(11, L, num_q_heads=2, num_kv_heads=1, batch=2)
    for mask in masks:
        check(
            implementation, mask, q, k, v, sinks, weights,
            score_mod=SCORE_MODS[hook], logits_soft_cap=8.0,
        )  # fmt: skip


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_alibi_against_oracle(implementation):
    """ALiBi slopes (one per query head) with GQA, sinks and a soft cap: alone under
    documents with a prefix-LM mask, and before a non-additive score hook under per-head
    masks. Out, lse and every gradient against the float64 oracle."""
    docs = DocumentMask(np.array([0, 70, 150], np.int32), shape=(L, L))
    per_head = [CausalMask((L, L)), LocalMask((L, L), (9, 2), 0), FullMask((L, L))] * 2
    cases = [
        (PrefixLMMask((L, L), prefix_length=20) & docs, None),
        (MultiHeadMask(per_head), SCORE_MODS["square_cap"]),
    ]
    q, k, v, sinks, weights = _inputs(13, L, num_q_heads=6, num_kv_heads=2, batch=2)
    slopes = jnp.asarray(np.random.default_rng(14).uniform(0.01, 0.3, 6), jnp.float32)
    for mask, score_mod in cases:
        check(
            implementation, mask, q, k, v, sinks, weights,
            alibi_slopes=slopes, score_mod=score_mod, logits_soft_cap=8.0,
        )  # fmt: skip


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_alibi_matches_varlen_inside_documents(implementation):
    """Packed documents with a causal rule and ALiBi equal `varlen_attention`'s ALiBi
    (|i - j| within a document is the same distance in both ops), and the slopes get a
    zero gradient in both."""
    cu = np.array([0, 1, 45, 150], np.int32)  # a length-1 document
    mask = DocumentMask(cu, shape=(L, L), causal=True)
    q, k, v, _, _ = _inputs(15, L, num_q_heads=4, num_kv_heads=2)
    slopes = jnp.asarray(np.random.default_rng(16).uniform(0.05, 0.5, 4), jnp.float32)

    def ours(q, slopes):
        return block_sparse_attention(
            q, k, v, mask, alibi_slopes=slopes, implementation=implementation,
            block_sizes=_blocks(implementation),
        )  # fmt: skip

    def theirs(q, slopes):
        out = varlen_attention(
            q[0], k[0], v[0], jnp.asarray(cu), jnp.asarray(cu), max_seqlen_q=105,
            max_seqlen_k=105, causal=True, alibi_slopes=slopes, implementation="xla",
        )  # fmt: skip
        return out[None]

    got, want = ours(q, slopes), theirs(q, slopes)
    assert_close(got, want, _tolerance(q, k, dict(alibi_slopes=slopes), None), "vs varlen")
    d_slopes = jax.grad(lambda s: jnp.sum(ours(q, s) * q))(slopes)
    assert np.array_equal(np.asarray(d_slopes), np.zeros(4, np.float32))


def test_score_mod_is_checked():
    q, k, v, _, _ = _inputs(12, 20)
    mask = CausalMask((20, 20))
    jax_only = ScoreMod(_relative_bias)
    with pytest.raises(
        ValueError, match="block_sparse_attention: score_mod '_relative_bias' has no triton_fn"
    ):
        block_sparse_attention(q, k, v, mask, score_mod=jax_only, implementation="triton")
    with pytest.raises(ValueError, match="score_mod is not supported by implementation='pallas'"):
        block_sparse_attention(q, k, v, mask, score_mod=jax_only, implementation="pallas")
    with pytest.raises(TypeError, match=r"score_mod must be a jax_bridge\.ScoreMod"):
        block_sparse_attention(q, k, v, mask, score_mod=_relative_bias, implementation="xla")
    wrong = ScoreMod(lambda s, b, h, i, j: jnp.sum(s, axis=-1), name="reduces")
    with pytest.raises(ValueError, match="score_mod 'reduces' must return float scores"):
        block_sparse_attention(q, k, v, mask, score_mod=wrong, implementation="xla")


# ---------------------------------------------------------------- hypothesis: a mix

_LEAVES = st.sampled_from(["causal", "local", "chunked", "prefix", "documents", "numpy"])


def _leaf(kind, q_len, kv_len, rng):
    shape = (q_len, kv_len)
    if kind == "causal":
        return CausalMask(shape, offset=int(rng.integers(-5, 20)))
    if kind == "local":
        return LocalMask(shape, (int(rng.integers(0, 20)), int(rng.integers(0, 5))), 0)
    if kind == "chunked":
        return ChunkedCausalMask(shape, chunk_size=int(rng.integers(1, 40)))
    if kind == "prefix":
        return PrefixLMMask(shape, prefix_length=int(rng.integers(0, kv_len)))
    if kind == "documents":
        cuts = np.sort(rng.integers(0, min(q_len, kv_len), 3))
        return DocumentMask(
            np.r_[0, cuts].astype(np.int32), shape=shape, causal=bool(rng.integers(2))
        )
    return NumpyMask(rng.random(shape) < 0.3)


@hypothesis.settings(max_examples=3)
@hypothesis.given(
    left=_LEAVES,
    right=_LEAVES,
    combine=st.sampled_from(["|", "&", "heads"]),
    q_len=st.integers(1, 90),
    kv_len=st.integers(1, 90),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_mask_mix(left, right, combine, q_len, kv_len, seed):
    rng = np.random.default_rng(seed)
    a, b = _leaf(left, q_len, kv_len, rng), _leaf(right, q_len, kv_len, rng)
    mask = {"|": lambda: a | b, "&": lambda: a & b, "heads": lambda: MultiHeadMask([a, b])}[
        combine
    ]()
    q, k, v, sinks, weights = _inputs(seed, q_len, num_q_heads=2, num_kv_heads=1, kv_length=kv_len)
    for implementation in IMPLEMENTATIONS:
        check(implementation, mask, q, k, v, sinks, weights)


# ---------------------------------------------------------------- work and choice


def _dense_nonempty_blocks(dense: np.ndarray, block_q: int, block_kv: int) -> int:
    q_len, kv_len = dense.shape
    padded = np.zeros((-(-q_len // block_q) * block_q, -(-kv_len // block_kv) * block_kv), bool)
    padded[:q_len, :kv_len] = dense
    blocks = padded.reshape(padded.shape[0] // block_q, block_q, -1, block_kv)
    return int(blocks.any(axis=(1, 3)).sum())


@pytest.mark.parametrize("name", ["causal", "documents", "random_blocks", "multi_head"])
def test_xla_gathers_exactly_the_visited_blocks(name):
    mask = _masks()[name]
    counts = block_counts(mask, num_q_heads=2, block_sizes=XLA_BLOCKS)
    heads = mask.masks if isinstance(mask, MultiHeadMask) else [mask] * 2
    visited = sum(_dense_nonempty_blocks(np.asarray(m[:, :]), 32, 16) for m in heads)
    assert counts.visited == counts.gathered == visited
    assert counts.dense == len(heads) * 5 * 10 and counts.partial + counts.full == visited
    if name != "multi_head":  # a full head visits everything
        assert counts.visited < counts.dense


def test_auto_runs_xla_on_a_cpu_and_the_native_kernels_elsewhere():
    q, k, v, _, _ = _inputs(6, 20)
    mask = CausalMask((20, 20))
    with compiling_for_platform("cpu"):  # "auto" as on a CPU, whatever this host is
        auto = block_sparse_attention(q, k, v, mask)
    xla = block_sparse_attention(q, k, v, mask, implementation="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
    for platform, native in (("cuda", "triton"), ("tpu", "pallas"), ("cpu", "xla")):
        with compiling_for_platform(platform):
            assert BACKENDS.resolve("auto") == native


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(mask=CausalMask((20, 21))), ValueError, r"mask has shape \(20, 21\).*\(20, 20\)"),
        (
            dict(mask=MultiHeadMask([CausalMask((20, 20))] * 3)),
            ValueError,
            r"one mask per query head \(2\), got 3",
        ),
        (dict(mask=np.ones((20, 20), bool)), TypeError, r"mask must be a splash Mask"),
        (
            dict(k=jnp.zeros((1, 20, 3, 8)), v=jnp.zeros((1, 20, 3, 8))),
            ValueError,
            r"num_q_heads \(2\) must be a multiple",
        ),
        (dict(v=jnp.zeros((1, 20, 1, 8), jnp.bfloat16)), TypeError, r"share one dtype"),
        (dict(q=jnp.zeros((1, 20, 2, 8), jnp.int32)), TypeError, r"q must be float16"),
        (dict(q=jnp.zeros((20, 2, 8))), ValueError, r"q must have shape \[batch, seq_len"),
        (dict(k=jnp.zeros((20, 1, 8))), ValueError, r"k must have shape \[batch, kv_len, num_kv"),
        (
            dict(implementation="triton"),
            ValueError,
            r"head_dim must be in \[16, 256\] for implementation='triton', got 8",
        ),
        (dict(sinks=jnp.zeros(3)), ValueError, r"sinks must have shape \[num_q_heads\]"),
        (
            dict(alibi_slopes=jnp.ones((1, 2))),
            ValueError,
            r"alibi_slopes must have shape \[num_q_heads\] = \(2,\)",
        ),
        (dict(alibi_slopes=jnp.ones(2, jnp.int32)), TypeError, r"alibi_slopes must have a float"),
        (
            dict(alibi_slopes=jnp.ones(2), implementation="pallas"),
            ValueError,
            r"alibi_slopes is not supported by implementation='pallas'",
        ),
        (dict(softmax_scale=jnp.float32(1.0) + jnp.zeros(())), TypeError, r"softmax_scale"),
        (dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap must be positive"),
        (dict(logits_soft_cap=float("inf")), ValueError, r"logits_soft_cap must be positive and"),
        (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite non-zero"),
        (dict(softmax_scale=0.0), ValueError, r"softmax_scale must be a finite non-zero float"),
        (dict(return_lse="yes"), TypeError, r"return_lse must be a bool, got 'yes'"),
        (
            dict(block_sizes=BlockSizes(100, 100), implementation="xla"),
            ValueError,
            r"block_sizes.block_q=100 must be a multiple of 8 for implementation='xla'",
        ),
        (
            dict(k=jnp.zeros((1, 20, 1, 4))),
            ValueError,
            r"k's head_dim \(4\) must equal q's head_dim \(8\)",
        ),
        (dict(block_sizes=(32, 32)), TypeError, r"block_sizes must be"),
        (
            dict(block_sizes=BlockSizes(block_q=100), implementation="pallas"),
            ValueError,
            r"multiple of 128",
        ),
        (
            dict(block_sizes=BlockSizes(block_kv_dq=48), implementation="triton"),
            ValueError,
            r"block_kv_dq=48 must be a power of two >= 16",
        ),
        (dict(implementation="cuda"), ValueError, r"implementation must be one of"),
        (dict(config=(32, 32)), TypeError, r"config must be an AttentionConfigs, an Attention"),
        (
            dict(config=AttentionKernelConfig(16, 16), implementation="pallas"),
            ValueError,
            r"config is the Triton kernels' launch configuration; implementation='pallas'",
        ),
        (
            dict(config=AttentionConfigs(dq_atomic=True), implementation="triton"),
            ValueError,
            r"config.dq_atomic=True is varlen_attention's",
        ),
        (
            dict(config=AttentionKernelConfig(16, 16, tma=True), implementation="triton"),
            ValueError,
            r"config.tma=True: varlen_attention kernel options",
        ),
        (
            dict(
                config=AttentionConfigs(
                    forward=AttentionKernelConfig(64, 64, 4, 2, tma=True, warp_specialize=True)
                ),
                implementation="triton",
            ),
            ValueError,
            r"config.forward.tma=True, config.forward.warp_specialize=True: varlen_attention",
        ),
        (
            dict(
                config=AttentionConfigs(backward_dq=AttentionKernelConfig(32, 16)),
                block_sizes=BlockSizes(block_q_dq=32, block_kv_dq=32),
                implementation="triton",
            ),
            ValueError,
            r"block_sizes.block_kv_dq=32 and config.backward_dq \(32x16\) give the backward_dq",
        ),
    ],
)
def test_bad_inputs_name_the_op_and_argument(change, error, match):
    q, k, v, _, _ = _inputs(7, 20, head_dim=8)
    args = dict(q=q, k=k, v=v, mask=CausalMask((20, 20)))
    args.update(change)
    positional = [args.pop(n) for n in ("q", "k", "v", "mask")]
    with pytest.raises(error, match=f"block_sparse_attention: .*{match}"):
        block_sparse_attention(*positional, **args)


def test_xla_ignores_a_triton_config_and_keeps_its_own_blocks():
    """`config` is the Triton kernels' launch configuration: the XLA path computes the
    same numbers with or without it, its block_sizes being its own blocks (no tile
    agreement asked), while a varlen-only option is refused there too."""
    q, k, v, _, _ = _inputs(12, 40)
    mask = CausalMask((40, 40))
    config = AttentionKernelConfig(16, 64, 2, 1)
    blocks = BlockSizes(block_q=8, block_kv=16)
    plain = block_sparse_attention(q, k, v, mask, block_sizes=blocks, implementation="xla")
    given = block_sparse_attention(
        q, k, v, mask, block_sizes=blocks, config=config, implementation="xla"
    )
    np.testing.assert_array_equal(np.asarray(given), np.asarray(plain))
    with pytest.raises(ValueError, match=r"block_sparse_attention: config\.tma=True"):
        block_sparse_attention(q, k, v, mask, config=config.replace(tma=True), implementation="xla")


def test_negative_scale_is_valid_math_and_jax_blocks_pass_the_checks():
    """A negative softmax_scale attends to the least similar keys (jax.nn's attention
    takes it too): kept, and checked against the oracle. JAX-style BlockSizes (with its
    fused-backward flag and layouts) pass the Pallas block checks."""
    q, k, v, sinks, weights = _inputs(11, 24)
    check("xla", CausalMask((24, 24)), q, k, v, sinks, weights, softmax_scale=-0.6)
    assert check_block_sizes(BlockSizes.get_default(), "pallas") == BlockSizes.get_default()
