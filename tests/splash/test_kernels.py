"""The splash kernels (forward, dQ, dK/dV) and the custom_vjp, in Pallas interpret mode.

The kernels are fed MaskInfos from JAX's own splash `process_mask` (an independent
producer of the same format), so these tests check the kernels alone; the factory tests
at the end go through the project's `process_mask`. Every numeric comparison is against
the dense reference in `reference.py` run in float64 (gradients by jax.grad of it), within
the problem's `splash_tolerance` (tests/splash/helpers.py); the isolation of fully masked
rows (out 0, lse -inf or the sink) is asserted exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as jsk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as jmi

from pallas_tpu.splash import masks as our_masks
from pallas_tpu.splash.config import BlockSizes, KernelOptions, SegmentIds
from pallas_tpu.splash.kernel import SplashAttentionKernel, make_splash_mha, make_splash_mqa
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo
from tests.attention.helpers import assert_close
from tests.jaxprs import all_eqns, dot_precisions
from tests.splash.helpers import (
    assert_grads,
    assert_out_and_lse,
    oracle_forward,
    oracle_value_and_grad,
    splash_tolerance,
)
from tests.splash.reference import attention_reference

BLOCKS_128 = BlockSizes(block_q=128, block_kv=128)


def _ours(processed) -> tuple[MaskInfo, ElementMask | None]:
    """JAX's (MaskInfo, mask_function) as our MaskInfo and ElementMask."""
    info, rule = processed
    ours = MaskInfo(
        info.data_next, info.mask_next, info.block_mask, info.partial_mask_blocks, info.q_sequence
    )
    element = None if rule is None else ElementMask(rule, np.asarray(info.q_sequence))
    return ours, element


def _kernel(
    mask: jm.Mask,
    blocks: BlockSizes = BLOCKS_128,
    *,
    shrink_grid: bool = True,
    is_mqa: bool = False,
    element_mask: ElementMask | None = None,
    drop_partial_blocks: bool = False,
    **options,
) -> SplashAttentionKernel:
    """A kernel (save_residuals=True) over JAX-processed MaskInfos of `mask`.

    drop_partial_blocks: remove partial_mask_blocks so that `element_mask` is evaluated.
    """
    _, q_len, kv_len = mask.shape
    b = blocks.resolve(q_len, kv_len)
    fwd, element = _ours(jmi.process_mask(mask, (b.block_q, b.block_kv), shrink_grid=shrink_grid))
    dq, _ = _ours(jmi.process_mask(mask, (b.block_q_dq, b.block_kv_dq), shrink_grid=shrink_grid))
    dkv, _ = _ours(
        jmi.process_mask_dkv(mask, (b.block_q_dkv, b.block_kv_dkv), shrink_grid=shrink_grid)
    )
    if drop_partial_blocks:
        strip = lambda info: info._replace(mask_next=None, partial_mask_blocks=None)
        fwd, dq, dkv = strip(fwd), strip(dq), strip(dkv)
    return SplashAttentionKernel.from_mask_infos(
        fwd,
        dq,
        dkv,
        element_mask or element,
        q_len=q_len,
        kv_len=kv_len,
        options=KernelOptions(block_sizes=b, interpret=True, **options),
        is_mqa=is_mqa,
        save_residuals=True,
    )


def _inputs(seed, heads, kv_heads, q_len, kv_len, head_dim=64, head_dim_v=None, dtype=None):
    """Fresh normal q, k, v (k, v 2-D when kv_heads is None: MQA)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    kv_lead = () if kv_heads is None else (kv_heads,)
    q = jax.random.normal(keys[0], (heads, q_len, head_dim), dtype or jnp.float32)
    k = jax.random.normal(keys[1], (*kv_lead, kv_len, head_dim), dtype or jnp.float32)
    v = jax.random.normal(keys[2], (*kv_lead, kv_len, head_dim_v or head_dim), dtype or jnp.float32)
    return q, k, v


def _loss_weights(seed, out_shape):
    """Fresh normal cotangents of out and lse."""
    keys = jax.random.split(jax.random.key(seed + 1000), 2)
    return jax.random.normal(keys[0], out_shape), jax.random.normal(keys[1], out_shape[:2])


def _loss(out, lse, dout, dlse):
    """Linear in both outputs (the cotangents are fixed numbers, not functions of the run's
    own rounded out), so the lse cotangent path of the backward is exercised too."""
    wide = jnp.promote_types(out.dtype, jnp.float32)  # float64 in the oracle
    finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(wide) * dout) + jnp.sum(finite_lse * dlse)


def _check(kernel, dense, q, k, v, *, segment_ids=None, sinks=None, seed=0):
    """Kernel out, lse and grads (q, k, v, sinks) against the float64 dense reference,
    within `splash_tolerance` of the problem (tests/splash/helpers.py).

    Both sides run as one jitted value-and-grad each: compiling once is far cheaper than
    dispatching the interpreted kernels and the reference op by op.
    """
    opts = kernel.config.options
    scale = opts.softmax_scale
    dout, dlse = _loss_weights(seed, (q.shape[0], q.shape[1], v.shape[-1]))
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)

    def ours(q, k, v, sinks):
        o, (l,) = kernel(q, k, v, segment_ids=segment_ids, sinks=sinks)
        return _loss(o, l, dout, dlse), (o, l)

    def ref(q, k, v, sinks):
        ids = None if segment_ids is None else (segment_ids.q, segment_ids.kv)
        o, l = attention_reference(
            q, k, v, dense, segment_ids=ids, sinks=sinks,
            softmax_scale=scale, logits_soft_cap=opts.logits_soft_cap,
        )  # fmt: skip
        return _loss(o, l, dout, dlse), (o, l)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(ours, argnums, has_aux=True))(
        q, k, v, sinks
    )
    (_, oracle), oracle_grads = oracle_value_and_grad(ref, q, k, v, sinks, argnums=argnums)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    tol = splash_tolerance(q, k, v, softmax_scale=scale, sinks=sinks)
    assert_out_and_lse(out, lse, oracle, tol)
    for name, got in zip("qkvs"[: len(grads)], grads, strict=True):
        assert got.dtype == {"q": q, "k": k, "v": v, "s": sinks}[name].dtype, name
    assert_grads(grads, oracle_grads, tol)
    return out, lse


def _cotangent(q, v, seed):
    """A fresh normal, fixed cotangent of out: no path's rounding of its output feeds its
    own backward. Drawn in float32, once (under x64 the same key draws other numbers)."""
    return _loss_weights(seed, (q.shape[0], q.shape[1], v.shape[-1]))[0]


def _grads(fn, q, k, v, seed):
    """Gradients (q, k, v) of sum(fn(q, k, v) * `_cotangent`)."""
    cotangent = _cotangent(q, v, seed)
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * cotangent), (0, 1, 2)))(q, k, v)


def _grads_and_oracle(fns, dense, q, k, v, seed):
    """`_grads` for each of `fns`, and of the float64 reference."""
    grads = [_grads(fn, q, k, v, seed) for fn in fns]
    cotangent = _cotangent(q, v, seed)
    ref = lambda *a: attention_reference(*a, dense)[0]
    aux_loss = lambda *a: (jnp.sum(ref(*a) * cotangent), None)
    _, oracle = oracle_value_and_grad(aux_loss, q, k, v, argnums=(0, 1, 2))
    return grads, oracle


def _multi(head_masks) -> jm.MultiHeadMask:
    return jm.MultiHeadMask(list(head_masks))


def _random_mask(rng, shape, density=0.3):
    """Random bool mask with the diagonal set (no empty row)."""
    mask = rng.random(shape) < density
    mask[np.arange(min(shape)), np.arange(min(shape))] = True
    return mask


MASKS = {
    "causal": lambda t, rng: _multi([jm.CausalMask((t, t))] * 2),
    "local": lambda t, rng: _multi([jm.LocalMask((t, t), (96, 32), offset=0)] * 2),
    "full": lambda t, rng: _multi([jm.FullMask((t, t))] * 2),
    # Different per head: MaskInfo has one row per head, partial blocks are loaded.
    "random": lambda t, rng: _multi([jm.NumpyMask(_random_mask(rng, (t, t))) for _ in range(2)]),
}


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_matches_reference(kind):
    mask = MASKS[kind](256, np.random.default_rng(0))
    q, k, v = _inputs(1, 2, 2, 256, 256)
    _check(_kernel(mask), mask[:, :, :], q, k, v)


def test_gqa_segments_sinks_soft_cap_scale_and_block_shapes():
    """GQA 4:2, segment ids, sinks, soft cap, scale, head_dim_v != head_dim, and every
    traversal on its own block shape (compute slices smaller than memory blocks)."""
    t = 512
    mask = _multi([jm.CausalMask((t, t))] * 4)
    blocks = BlockSizes(
        block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=256, block_kv_dkv=256,
        block_kv_dkv_compute=128, block_q_dq=256, block_kv_dq=128,
    )  # fmt: skip
    kernel = _kernel(mask, blocks, softmax_scale=0.125, logits_soft_cap=2.0)
    q, k, v = _inputs(2, 4, 2, t, t, head_dim=64, head_dim_v=128)
    ids = jnp.asarray(np.repeat([0, 1, 2], [100, 250, 162]), jnp.int32)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    _check(kernel, mask[:, :, :], q, k, v, segment_ids=SegmentIds(ids, ids), sinks=sinks)


def test_mqa_and_rectangular():
    """One shared kv head, q_len != kv_len, a random mask with partial blocks."""
    dense = _random_mask(np.random.default_rng(3), (256, 512))
    mask = _multi([jm.NumpyMask(dense)] * 3)
    q, k, v = _inputs(3, 3, None, 256, 512)
    _check(_kernel(mask, is_mqa=True), mask[:, :, :], q, k, v)


def _documents(lengths):
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    local = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    return doc, local


@pytest.mark.parametrize("positions", ["global", "per_document"])
def test_element_mask_with_documents(positions):
    """Partial blocks evaluated in the kernel: causal within three packed documents.

    "global": kv positions default to the kv index; "per_document": positions restart
    at every document and both sides are given.
    """
    t = 512
    doc, local = _documents([100, 250, 162])
    dense = (doc[:, None] == doc[None, :]) & (np.arange(t)[:, None] >= np.arange(t)[None, :])
    mask = _multi([jm.NumpyMask(dense)] * 2)
    causal = jm.CausalMask((t, t)).mask_function
    if positions == "global":
        element = ElementMask(causal, np.arange(t, dtype=np.int32), None, doc, doc)
    else:
        element = ElementMask(causal, local, local, doc, doc)
    kernel = _kernel(mask, element_mask=element, drop_partial_blocks=True)
    assert kernel.masks.fwd.partial_mask_blocks is None
    _check(kernel, mask[:, :, :], *_inputs(4, 2, 2, t, t))


def test_document_term_alone():
    """ElementMask with rule None: the document term only (bidirectional documents)."""
    t = 256
    doc, _ = _documents([60, 130, 66])
    mask = _multi([jm.NumpyMask(doc[:, None] == doc[None, :])] * 2)
    element = ElementMask(None, np.arange(t, dtype=np.int32), None, doc, doc)
    kernel = _kernel(mask, element_mask=element, drop_partial_blocks=True)
    _check(kernel, mask[:, :, :], *_inputs(5, 2, 2, t, t))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(with_sinks):
    """Rows 5 and 128..255 attend nothing (the second: a whole empty block row).

    Without sinks: out 0, lse -inf, finite gradients. With: out 0, lse = sink.
    """
    t = 384
    dense = _random_mask(np.random.default_rng(6), (t, t))
    dense[5] = False
    dense[128:256] = False
    mask = _multi([jm.NumpyMask(dense)] * 2)
    sinks = jnp.asarray([0.3, -0.7]) if with_sinks else None
    q, k, v = _inputs(6, 2, 2, t, t)
    out, lse = _check(_kernel(mask), mask[:, :, :], q, k, v, sinks=sinks)
    empty_rows = np.r_[5, 128:256]
    assert not np.asarray(out)[:, empty_rows].any()
    want = -np.inf if sinks is None else np.asarray(sinks)[:, None]
    np.testing.assert_array_equal(np.asarray(lse)[:, empty_rows], np.broadcast_to(want, (2, 129)))


def test_shrink_grid_on_and_off_agree():
    """Both grids' gradients within the tolerance of the same float64 ones (so within
    twice of each other): skipping the empty grid steps changes no number beyond rounding."""
    mask = _multi([jm.LocalMask((512, 512), (64, 64), offset=0)] * 2)
    q, k, v = _inputs(7, 2, 2, 512, 512)
    shrunk, full = _kernel(mask), _kernel(mask, shrink_grid=False)
    assert shrunk.masks.fwd.data_next.shape[2] < full.masks.fwd.data_next.shape[2]
    assert shrunk.masks.dkv.data_next.shape[1] < full.masks.dkv.data_next.shape[1]
    fns = [lambda *a, kern=kern: kern(*a)[0] for kern in (shrunk, full)]
    grads, oracle = _grads_and_oracle(fns, mask[:, :, :], q, k, v, seed=7)
    for got in grads:
        assert_grads(got, oracle, splash_tolerance(q, k, v))


def test_bfloat16_inputs():
    mask = _multi([jm.CausalMask((256, 256))] * 2)
    q, k, v = _inputs(8, 2, 1, 256, 256, head_dim=128, dtype=jnp.bfloat16)
    _check(_kernel(mask, logits_soft_cap=10.0), mask[:, :, :], q, k, v)


def test_matches_jax_splash():
    """Same numbers as JAX's own splash attention (causal: no empty row, where JAX's
    finite mask value and our -inf agree)."""
    t = 512
    mask = _multi([jm.CausalMask((t, t))] * 2)
    q, k, v = _inputs(9, 2, 2, t, t, head_dim=128)
    jax_blocks = jsk.BlockSizes(
        block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
        block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128,
    )  # fmt: skip
    theirs = jsk.make_splash_mha(
        mask, block_sizes=jax_blocks, head_shards=1, q_seq_shards=1, interpret=True
    )
    ours = _kernel(mask)
    # Each within the tolerance of the float64 reference, so within twice of each other.
    forward = oracle_forward(q, k, v, mask[:, :, :])
    tol = splash_tolerance(q, k, v)
    out, (lse,) = ours(q, k, v)
    assert_out_and_lse(out, lse, forward, tol, "ours ")
    (got,), oracle = _grads_and_oracle([lambda *x: ours(*x)[0]], mask[:, :, :], q, k, v, 9)
    assert_grads(got, oracle, tol, "ours ")
    # JAX's kernel multiplies at XLA's default precision, which on a GPU host (the
    # interpreter's dots run there) is TF32; its backward is traced inside the grad.
    with jax.default_matmul_precision("float32"):
        assert_close(theirs(q, k, v), forward[0], tol, "jax splash out")
        want = _grads(theirs, q, k, v, seed=9)
    assert_grads(want, oracle, tol, "jax splash ")


def test_vmap_over_batch():
    mask = _multi([jm.CausalMask((256, 256))] * 2)
    kernel = _kernel(mask)
    q, k, v = (jnp.stack([x, x[:, ::-1]]) for x in _inputs(10, 2, 2, 256, 256))
    out, (lse,) = jax.vmap(kernel)(q, k, v)
    for b in range(2):
        oracle = oracle_forward(q[b], k[b], v[b], mask[:, :, :])
        assert_out_and_lse(out[b], lse[b], oracle, splash_tolerance(q[b], k[b], v[b]))


@pytest.mark.parametrize(
    ("blocks", "field"),
    [
        (BlockSizes(block_q=100), "block_q"),
        (BlockSizes(block_kv=0), "block_kv"),
        (BlockSizes(block_kv=256, block_kv_compute=384), "block_kv_compute"),
        (BlockSizes(block_q_dkv=384), "block_q_dkv"),  # does not divide q_len=512
        (BlockSizes(block_kv_dkv=256, block_kv_dkv_compute=192), "block_kv_dkv_compute"),
        (BlockSizes(block_kv_dq=1024), "block_kv_dq"),
    ],
)
def test_bad_block_sizes_name_the_field(blocks, field):
    with pytest.raises(ValueError, match=rf"BlockSizes\.{field}\b"):
        blocks.resolve(512, 512)
    with pytest.raises(ValueError, match=rf"BlockSizes\.{field}\b"):
        make_splash_mha(our_masks.CausalMask((512, 512)), block_sizes=blocks, interpret=True)


def test_block_size_defaults():
    b = BlockSizes().resolve(640, 2048)
    assert (b.block_q, b.block_kv, b.block_kv_compute) == (128, 512, 512)
    assert (b.block_q_dkv, b.block_kv_dkv, b.block_kv_dkv_compute) == (128, 512, 512)
    assert (b.block_q_dq, b.block_kv_dq) == (128, 512)
    assert dataclasses.replace(b, block_kv_compute=256).resolve(640, 2048).block_kv_compute == 256


def test_factory_with_project_masks():
    """make_splash_mha / make_splash_mqa through the project's own process_mask."""
    t = 256
    mha = make_splash_mha(
        our_masks.MultiHeadMask([our_masks.CausalMask((t, t))] * 2),
        block_sizes=BLOCKS_128, interpret=True, softmax_scale=0.5, save_residuals=True,
    )  # fmt: skip
    q, k, v = _inputs(11, 2, 1, t, t)
    out, (lse,) = mha(q, k, v)
    oracle = oracle_forward(q, k, v, np.tril(np.ones((t, t), bool))[None], softmax_scale=0.5)
    assert_out_and_lse(out, lse, oracle, splash_tolerance(q, k, v, softmax_scale=0.5), "mha ")

    dense = _random_mask(np.random.default_rng(12), (t, t))
    mqa = make_splash_mqa(
        our_masks.MultiHeadMask([our_masks.NumpyMask(dense)] * 2),
        block_sizes=BLOCKS_128, interpret=True,
    )  # fmt: skip
    k, v = k[0], v[0]
    tol = splash_tolerance(q, k, v)
    assert_close(mqa(q, k, v), oracle_forward(q, k, v, dense[None])[0], tol, "mqa out")
    (grads,), oracle = _grads_and_oracle([mqa], dense[None], q, k, v, seed=12)
    assert_grads(grads, oracle, tol)


@pytest.mark.parametrize("interpret", [True, None], ids=["interpret", "follow_platform"])
def test_interpreted_kernels_multiply_exactly_on_any_host(interpret):
    """Interpreted on a GPU, XLA would take the kernels' float32 dots in TF32 at default
    precision: every dot of the interpreted forward and backward is traced HIGHEST."""
    kernel = make_splash_mha(
        our_masks.MultiHeadMask([our_masks.CausalMask((256, 256))] * 2),
        block_sizes=BLOCKS_128, interpret=interpret,
    )  # fmt: skip
    q, k, v = _inputs(15, 2, 2, 256, 256)
    loss = lambda q, k, v: kernel(q, k, v).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    pallas_calls = [e for e in all_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    interpreted = [e for e in pallas_calls if e.params["interpret"]]
    precisions = [p for e in interpreted for p in dot_precisions(e.params["jaxpr"])]
    # forward, dQ, dK/dV; following the platform, each once more in its TPU branch.
    assert len(interpreted) == 3 and len(pallas_calls) == 3 * (1 if interpret else 2)
    highest = jax.lax.Precision.HIGHEST
    assert all(p == (highest, highest) for p in precisions), precisions


def test_kernel_is_a_pytree_under_jit():
    kernel = _kernel(_multi([jm.CausalMask((256, 256))] * 2))
    leaves, treedef = jax.tree_util.tree_flatten(kernel)
    assert all(isinstance(x, jax.Array) for x in leaves)
    q, k, v = _inputs(13, 2, 2, 256, 256)
    out = jax.jit(lambda kern, q, k, v: kern(q, k, v)[0])(kernel, q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(kernel(q, k, v)[0]), rtol=0, atol=0)
    assert jax.tree_util.tree_unflatten(treedef, leaves).config == kernel.config


def test_bad_inputs_raise():
    kernel = _kernel(_multi([jm.CausalMask((256, 256))] * 2))
    q, k, v = _inputs(14, 2, 2, 256, 256)
    with pytest.raises(ValueError, match="q_len=256"):
        kernel(q[:, :128], k, v)
    with pytest.raises(ValueError, match="sinks"):
        kernel(q, k, v, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="3-d k, v"):
        kernel(q, k[0], v[0])


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: make_splash_mha(our_masks.CausalMask((256, 256)), block_sizes=(128, 128)),
         TypeError, "block_sizes must be a splash BlockSizes or None, got tuple"),
        (lambda: make_splash_mha(jm.MultiHeadMask([jm.CausalMask((256, 256))] * 2)),
         TypeError, "JAX's splash masks are not ours"),
        (lambda: make_splash_mha(jnp.tril(jnp.ones((256, 256), bool))),
         ValueError, r"a 2-D jax.Array: jnp.broadcast_to"),
        (lambda: make_splash_mha(our_masks.CausalMask((0, 256))),
         ValueError, "mask has an empty axis"),
        (lambda: jax.jit(lambda s: make_splash_mha(our_masks.CausalMask((256, 256)),
                                                   softmax_scale=s))(0.5),
         TypeError, "softmax_scale must be a static number"),
        (lambda: make_splash_mha(our_masks.CausalMask((256, 256)), attn_logits_soft_cap=True),
         TypeError, "logits_soft_cap must be a real number"),
    ],
)  # fmt: skip
def test_make_splash_mha_refuses_bad_arguments_naming_them(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_concrete_scalars_are_static_options():
    """A softmax scale or soft cap given as a concrete JAX or NumPy scalar is the Python
    float it holds: one kernel, hashable options, whatever was compiled before."""
    options = KernelOptions(jnp.float32(0.5), np.float64(2.0))
    assert options == KernelOptions(0.5, 2.0) and hash(options) == hash(KernelOptions(0.5, 2.0))
    assert type(options.softmax_scale) is float and type(options.logits_soft_cap) is float
    mask = our_masks.CausalMask((256, 256))
    kernel = make_splash_mha(mask, softmax_scale=1 / jnp.sqrt(64.0), interpret=True)
    assert kernel.config.options.softmax_scale == 0.125


def test_factory_with_document_mask():
    """Packed causal documents plus padding (rows 450.. attend nothing), evaluated in
    the kernel from the project's DocumentMask; GQA 2:1 and sinks on top."""
    mask = our_masks.DocumentMask(np.array([0, 100, 300, 450]), shape=(512, 512), causal=True)
    kernel = make_splash_mha(
        our_masks.MultiHeadMask([mask] * 2),
        block_sizes=BlockSizes(block_q=128, block_kv=256, block_kv_compute=128),
        interpret=True, save_residuals=True,
    )  # fmt: skip
    assert kernel.masks.element is not None
    q, k, v = _inputs(15, 2, 1, 512, 512)
    _check(kernel, np.asarray(mask[:, :])[None], q, k, v, sinks=jnp.asarray([0.0, 1.0]))
