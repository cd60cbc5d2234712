"""Code written for JAX's splash attention runs on `pallas_tpu.splash` with its import changed.

The acceptance test runs one realistic JAX-splash script body twice, with JAX's modules and
with ours (`splash_attention_kernel` / `splash_attention_mask` aliases), and compares every
output: JAX's splash is the independent oracle (the two agree bit for bit today; the
comparison allows the problem's `splash_tolerance`). The focused tests below cover each
name and keyword a port needs, most without running a kernel (Pallas' interpreter is slow).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu import splash_attention as jax_splash_package
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as jsk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jm
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_tpu.splash as ours
from pallas_tpu.splash import splash_attention_kernel as osk
from pallas_tpu.splash import splash_attention_mask as om
from pallas_tpu.splash.kernel import MASK_VALUE_BOUND
from tests.attention.helpers import assert_close
from tests.splash.helpers import splash_tolerance

HEADS, SEQ, DIM = 2, 256, 64


def _inputs() -> tuple[jax.Array, ...]:
    """The script's q, k, v and output cotangent, [batch, heads, seq, dim]."""
    keys = jax.random.split(jax.random.key(42), 5)
    # The JAX convention: the softmax scale is folded into q.
    batch = 1  # vmapped like a real batch; one entry keeps the interpreter's time down
    q = jax.random.normal(keys[0], (batch, HEADS, SEQ, DIM)) * DIM**-0.5
    k, v, cotangent = (jax.random.normal(key, (batch, HEADS, SEQ, DIM)) for key in keys[1:4])
    return q, k, v, cotangent


def _script(splash, mask_lib) -> dict[str, jax.Array]:
    """A JAX-splash training step and three forward variants, written against JAX's API
    only: `splash` / `mask_lib` are the kernel and mask modules, JAX's or ours."""
    q, k, v, cotangent = _inputs()
    shape = (SEQ, SEQ)
    mask = mask_lib.MultiHeadMask(
        [
            mask_lib.CausalMask(shape),
            mask_lib.LocalMask(shape, (64, 0), offset=0)
            | mask_lib.FullMask(_shape=shape) & mask_lib.CausalMask(shape, offset=-200),
        ]
    )
    block_sizes = splash.BlockSizes(
        block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128,
        block_q_dq=128, block_kv_dq=128,
    )  # fmt: skip
    assert block_sizes.has_backward_blocks and block_sizes.block_kv_compute == 128
    kernel = splash.make_splash_mha(
        mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1, interpret=True,
        residual_checkpoint_name="splash_out",
    )  # fmt: skip
    segments = jnp.repeat(jnp.arange(2, dtype=jnp.int32), SEQ // 2)
    segment_ids = splash.SegmentIds(q=segments, kv=segments)
    batched = jax.vmap(kernel, in_axes=(0, 0, 0, None))

    def loss(q, k, v):
        out = batched(q, k, v, segment_ids)
        return jnp.sum(out * cotangent), out

    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
    (_, out), (dq, dk, dv) = step(q, k, v)

    # Multi-query attention over a dense numpy mask, with the lse.
    dense = np.stack(
        [
            mask_lib.make_causal_mask(shape),
            mask_lib.make_local_attention_mask(shape, (32, 16), offset=0)
            | mask_lib.make_random_mask(shape, sparsity=0.9, seed=3),
        ]
    )
    mqa = splash.make_splash_mqa_single_device(
        dense, block_sizes=splash.BlockSizes.get_default(), save_residuals=True,
        mask_value=-1e30, interpret=True,
    )  # fmt: skip
    mqa_out, (mqa_lse,) = jax.jit(mqa)(q[0], k[0, 0], v[0, 0])

    # A mask that is only known on the device (a jax.Array).
    dynamic = splash.make_splash_mha(
        jnp.asarray(dense), block_sizes=block_sizes, head_shards=1, q_seq_shards=1,
        interpret=True,
    )  # fmt: skip
    dynamic_out = dynamic(q[0], k[0], v[0])

    reference = splash.make_masked_mha_reference(mask)
    ref_out = reference(q[0], k[0], v[0], segment_ids)
    return dict(
        out=out, dq=dq, dk=dk, dv=dv, mqa_out=mqa_out, mqa_lse=mqa_lse,
        dynamic_out=dynamic_out, ref_out=ref_out,
    )  # fmt: skip


def test_a_jax_splash_script_runs_with_only_its_import_changed():
    # JAX's kernel and reference multiply at XLA's default precision: TF32 on a GPU host.
    with jax.default_matmul_precision("float32"):
        want = _script(jsk, jm)
    got = _script(osk, om)
    q, k, v, _ = _inputs()
    tol = splash_tolerance(q[0], k[0], v[0])  # the scale is in q
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert_close(got[name], np.asarray(want[name], np.float64), tol, name)


# ---- names


def test_every_name_of_jax_splash_exists_with_the_same_role():
    public = [n for n in dir(jax_splash_package) if not n.startswith("_")]
    modules = {"splash_attention_kernel", "splash_attention_mask", "splash_attention_mask_info"}
    for name in public:
        if name in modules:
            continue
        assert hasattr(ours, name), name
        jax_module = (
            jm
            if hasattr(jm, name) and getattr(jm, name) is getattr(jax_splash_package, name)
            else jsk
        )
        alias = om if jax_module is jm else osk
        assert getattr(alias, name) is getattr(ours, name), name
    for name in ("LogicalOr", "LogicalAnd", "ChunkedCausalMask", "make_chunk_attention_mask"):
        assert getattr(om, name) is getattr(ours, name), name
    causal = ours.CausalMask((SEQ, SEQ))
    assert isinstance(causal | causal, ours.LogicalOr)
    assert isinstance(causal & causal, ours.LogicalAnd)
    assert set(om.__all__) <= set(dir(jm))
    assert set(osk.__all__) <= set(dir(jsk))


def test_full_mask_takes_jaxs_keyword():
    assert ours.FullMask(_shape=(8, 16)) == ours.FullMask((8, 16))
    assert ours.FullMask(_shape=(8, 16)).shape == jm.FullMask(_shape=(8, 16)).shape
    with pytest.raises(TypeError, match="FullMask: give the shape once"):
        ours.FullMask((8, 16), _shape=(8, 16))


@settings(max_examples=25, deadline=None)
@given(
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    offset=st.integers(-20, 20),
    left=st.one_of(st.none(), st.integers(0, 30)),
    right=st.one_of(st.none(), st.integers(0, 30)),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_dense_mask_helpers_equal_jaxs(q_len, kv_len, offset, left, right, chunk, seed):
    shape = (q_len, kv_len)
    pairs = [
        (om.make_causal_mask(shape, offset), jm.make_causal_mask(shape, offset)),
        (
            om.make_local_attention_mask(shape, (left, right), offset=offset),
            jm.make_local_attention_mask(shape, (left, right), offset=offset),
        ),
        (om.make_chunk_attention_mask(shape, chunk), jm.make_chunk_attention_mask(shape, chunk)),
    ]
    state = np.random.get_state()  # noqa: NPY002 (the global generator must stay untouched)
    ours_random = om.make_random_mask(shape, 0.7, seed)
    assert np.array_equal(np.random.get_state()[1], state[1])  # noqa: NPY002
    pairs.append((ours_random, jm.make_random_mask(shape, 0.7, seed)))
    for got, want in pairs:
        assert got.dtype == np.bool_ and got.shape == shape
        np.testing.assert_array_equal(got, want)
    # The dense helpers agree with the lazy masks of the same rule.
    np.testing.assert_array_equal(pairs[0][0], ours.CausalMask(shape, offset=offset)[:, :])


# ---- BlockSizes


def _common_fields(ours_blocks, jax_blocks) -> None:
    for field in dataclasses.fields(jax_blocks):
        assert getattr(ours_blocks, field.name) == getattr(jax_blocks, field.name), field.name


def test_block_sizes_mean_what_jaxs_do():
    _common_fields(ours.BlockSizes.get_default(), jsk.BlockSizes.get_default())
    for args, kwargs in (
        ((128, 256), {}),
        ((128, 256), dict(block_q_dkv=128, block_kv_dkv=256)),
        ((128, 256), dict(block_q_dkv=128, block_kv_dkv=256, use_fused_bwd_kernel=True)),
        ((128, 256), dict(block_q_dkv=128, block_kv_dkv=256, block_q_dq=128, block_kv_dq=128)),
    ):
        got, want = ours.BlockSizes(*args, **kwargs), jsk.BlockSizes(*args, **kwargs)
        _common_fields(got, want)
        assert got.has_backward_blocks == want.has_backward_blocks, kwargs
    with pytest.raises(ValueError, match="block_q_dq / block_kv_dq must be unset"):
        ours.BlockSizes(128, 128, block_q_dq=128, use_fused_bwd_kernel=True)
    with pytest.raises(ValueError, match=r"q_layout=.*head_dim-minor only"):
        ours.BlockSizes(128, 128, q_layout=ours.QKVLayout.SEQ_MINOR)
    with pytest.raises(ValueError, match="v_layout"):
        ours.BlockSizes(128, 128, v_layout=jsk.QKVLayout.SEQ_MINOR)
    assert int(ours.QKVLayout.HEAD_DIM_MINOR) == int(jsk.QKVLayout.HEAD_DIM_MINOR)


def test_fused_backward_runs_our_dq_kernel_over_the_dkv_blocks():
    blocks = ours.BlockSizes(256, 256, block_q_dkv=128, block_kv_dkv=256, use_fused_bwd_kernel=True)
    resolved = blocks.resolve(512, 512)
    assert (resolved.block_q_dq, resolved.block_kv_dq) == (128, 256)
    separate = ours.BlockSizes(256, 256, block_q_dkv=128, block_kv_dkv=256).resolve(512, 512)
    assert (separate.block_q_dq, separate.block_kv_dq) == (256, 256)


# ---- make_splash_mha's keywords and checks (trace-time: no kernel runs)


def _qkv(heads: int, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(heads), 3)
    return [jax.random.normal(key, (heads, SEQ, DIM)).astype(dtype) for key in keys]


@pytest.mark.parametrize("value", [-10.0, 0.0, float("nan"), MASK_VALUE_BOUND * 0.5])
def test_a_mask_value_with_another_meaning_is_refused(value):
    with pytest.raises(ValueError, match=r"mask_value=.* is refused.*<= -1e6"):
        ours.make_splash_mha(ours.CausalMask((SEQ, SEQ)), mask_value=value)


def test_very_negative_mask_values_are_accepted():
    for value in (jsk.DEFAULT_MASK_VALUE, -float("inf"), MASK_VALUE_BOUND):
        ours.make_splash_mha(ours.CausalMask((SEQ, SEQ)), mask_value=value)


@pytest.mark.parametrize("same_heads", [False, True])
def test_q_heads_must_equal_the_masks(same_heads):
    shape = (SEQ, SEQ)
    second = ours.CausalMask(shape) if same_heads else ours.LocalMask(shape, (64, 0), 0)
    kernel = ours.make_splash_mha(
        ours.MultiHeadMask([ours.CausalMask(shape), second]), interpret=True
    )
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="q has 4 heads, the mask 2"):
        jax.eval_shape(kernel, q, k, v)


def test_dtypes_are_checked_naming_the_argument():
    kernel = ours.make_splash_mha(ours.CausalMask((SEQ, SEQ)), interpret=True)
    q, k, v = _qkv(2)
    with pytest.raises(TypeError, match="q must be a float array, got int32"):
        jax.eval_shape(kernel, q.astype(jnp.int32), k, v)
    with pytest.raises(TypeError, match="v must be a float array"):
        jax.eval_shape(kernel, q, k, v.astype(jnp.int32))
    ids = jnp.zeros(SEQ)
    with pytest.raises(TypeError, match=r"segment_ids\.q must be integer ids, got float32"):
        jax.eval_shape(kernel, q, k, v, ours.SegmentIds(ids, ids.astype(jnp.int32)))


def test_a_traced_array_mask_builds_a_kernel_under_jit():
    """Beyond JAX (whose factory fails on a traced mask): the mask may be made in the
    jitted step; the dynamic MaskInfos are traced, shapes static. Traced only here; the
    port script runs a concrete jax.Array mask."""
    mask = jnp.asarray(np.stack([om.make_causal_mask((SEQ, SEQ))] * HEADS))
    q, k, v = _qkv(HEADS)

    def loss(q, mask):
        kernel = ours.make_splash_mha(mask, block_sizes=ours.BlockSizes(128, 128), interpret=True)
        return kernel(q, k, v).sum()

    grad = jax.eval_shape(jax.grad(loss), q, mask)
    assert (grad.shape, grad.dtype) == (q.shape, q.dtype)


def test_document_segment_ids_must_be_integer_traced_or_not():
    ids = np.repeat(np.arange(1, 3), SEQ // 2)
    match = r"from_segment_ids: q_segment_ids must be integer ids, got float32"
    with pytest.raises(TypeError, match=match):
        ours.DocumentMask.from_segment_ids(ids.astype(np.float32), ids)
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda q: ours.DocumentMask.from_segment_ids(q, ids).shape)(jnp.float32(ids))


def test_out_of_order_traced_segment_ids_give_an_empty_mask_not_a_wrong_one():
    """Concrete ids out of order raise; traced ones cannot, so every row attends nothing
    (row intervals all empty) instead of garbage searches. Valid traced ids keep the
    intervals of the concrete mask."""
    good = np.repeat(np.array([1, 2, 3, 0], np.int32), 8)
    bad = np.repeat(np.array([1, 2, 1, 0], np.int32), 8)
    with pytest.raises(ValueError, match="ascending positive document ids"):
        ours.DocumentMask.from_segment_ids(bad, causal=True)

    @jax.jit
    def intervals(ids):
        return ours.DocumentMask.from_segment_ids(ids, causal=True).row_intervals()

    lo, hi = intervals(good)
    want_lo, want_hi = ours.DocumentMask.from_segment_ids(good, causal=True).row_intervals()
    np.testing.assert_array_equal(lo, want_lo)
    np.testing.assert_array_equal(hi, want_hi)
    assert 0 < int((lo <= hi).sum()) < good.size  # documents see keys, padding none
    lo, hi = intervals(bad)
    assert np.all(np.asarray(lo) > np.asarray(hi))


def test_residual_checkpoint_name_lets_remat_keep_out_and_lse(capsys):
    q, k, v = _qkv(2)
    policy = jax.checkpoint_policies.save_only_these_names("splash_out")
    saved = {}
    for name in (None, "splash_out"):
        kernel = ours.make_splash_mha(
            ours.CausalMask((SEQ, SEQ)), interpret=True, residual_checkpoint_name=name
        )
        loss = jax.checkpoint(lambda q, kernel=kernel: kernel(q, k, v).sum(), policy=policy)
        jax.ad_checkpoint.print_saved_residuals(loss, q)
        saved[name] = capsys.readouterr().out
    # As JAX's: named, the forward's out [2, 256, 64] and lse [2, 256] are kept for the
    # backward (unnamed, the policy recomputes them); q is saved either way.
    lse = f"f32[{HEADS},{SEQ}]"
    assert lse not in saved[None] and lse in saved["splash_out"], saved
    out = f"f32[{HEADS},{SEQ},{DIM}]"
    assert saved["splash_out"].count(out) == saved[None].count(out) + 1, saved


def test_manual_sharding_spec_takes_jaxs_named_sharding():
    mask = ours.MultiHeadMask([ours.CausalMask((SEQ, SEQ))] * 2)
    kernel = ours.make_splash_mha(mask, block_sizes=ours.BlockSizes(128, 128), interpret=True)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("heads", "q"))
    is_spec = lambda x: isinstance(x, P)
    got = kernel.manual_sharding_spec(NamedSharding(mesh, P("heads", None)))
    want = kernel.manual_sharding_spec("heads", None)
    assert jax.tree.leaves(got, is_leaf=is_spec) == jax.tree.leaves(want, is_leaf=is_spec)
    sharded = ours.make_splash_mha(mask, block_sizes=ours.BlockSizes(128, 128), head_shards=2)
    refused = r"have 1 devices but the kernel was made with head_shards=2"
    with pytest.raises(ValueError, match=refused):
        sharded.manual_sharding_spec(NamedSharding(mesh, P("heads", "q")))
    with pytest.raises(ValueError, match="sharding the kv sequence is not supported"):
        kernel.manual_sharding_spec(NamedSharding(mesh, P("heads", "q", None)))


# ---- the dense reference keeps JAX's meaning (dense math only: fast)


def test_masked_reference_equals_jaxs_fully_masked_rows_included():
    shape = (SEQ, SEQ)
    dense = np.stack([jm.make_causal_mask(shape, offset=-3), jm.make_random_mask(shape, 0.5, 1)])
    q, k, v = _qkv(2)
    k1, v1 = k[:1], v[:1]  # GQA: one kv head for both q heads
    sinks = jnp.array([0.5, -1.0])
    segment_ids = ours.SegmentIds(*[jnp.repeat(jnp.arange(2, dtype=jnp.int32), SEQ // 2)] * 2)
    tol = splash_tolerance(q, k, v)
    options = dict(save_residuals=True, attn_logits_soft_cap=5.0)
    with jax.default_matmul_precision("float32"):  # JAX's default: TF32 on a GPU host
        want = jsk.make_masked_mha_reference(dense)(q, k1, v1, segment_ids, sinks, **options)
    for mask in (dense, ours.MultiHeadMask([ours.NumpyMask(m) for m in dense])):
        got = ours.make_masked_mha_reference(mask)(q, k1, v1, segment_ids, sinks, **options)
        assert_close(got[0], np.asarray(want[0], np.float64), tol, "out")
        assert_close(got[1][0], np.asarray(want[1][0], np.float64), tol, "lse")
    # Rows 0-2 of head 0 see nothing: JAX's meaning is the average of v, not 0.
    plain = ours.make_masked_mqa_reference(dense)(q, k[0], v[0])
    assert_close(plain[0, :3], np.broadcast_to(np.asarray(v[0]).mean(0), (3, DIM)), tol, "avg")
