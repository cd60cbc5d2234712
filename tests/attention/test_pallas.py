"""What is specific to the Pallas (splash) backend of varlen attention.

The shared numerics live in `test_conformance.py` (which runs "pallas" with the other
backends); here: the splash tile sizes as `config=`, the document MaskInfo built from
traced cu_seqlens (no re-trace when documents change, empty blocks skipped), `jax.vmap`,
and the options the splash kernels refuse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import attention_reference, varlen_attention
from pallas_tpu.splash import BlockSizes, DocumentMask, process_mask
from tests.attention.helpers import (
    assert_close,
    assert_lse_close,
    attention_tolerance,
    cu_seqlens,
    make_inputs,
    oracle_value_and_grads,
    value_and_grads,
)

LENGTHS = ((150, 150), (0, 0), (1, 1), (97, 120), (40, 9))


def _inputs(seed=0, lengths=LENGTHS, heads=(4, 2), head_dim=32):
    return make_inputs(seed, lengths, *heads, head_dim, pad=(6, 3))


@pytest.mark.parametrize(
    "blocks",
    [
        BlockSizes(block_q=128, block_kv=256),
        BlockSizes(block_q=256, block_kv=128, block_q_dkv=128, block_kv_dkv=128),
    ],
)
def test_block_sizes_as_config(blocks):
    x = _inputs(1)
    q, k, v, cu_q, cu_k = (x[n] for n in ("q", "k", "v", "cu_q", "cu_k"))

    def attention(impl, config=None):
        return lambda q, k, v, _: varlen_attention(
            q, k, v, cu_q, cu_k, causal=True, implementation=impl, config=config,
            return_lse=True,
        )  # fmt: skip

    def reference(q, k, v, _):
        return attention_reference(q, k, v, cu_q, cu_k, causal=True, return_lse=True)

    out, lse, grads = value_and_grads(attention("pallas", blocks), q, k, v, None, x["d_out"])
    want_out, want_lse, want_grads = oracle_value_and_grads(reference, q, k, v, None, x["d_out"])
    tol = attention_tolerance(q, k, cu_q=cu_q, cu_k=cu_k)
    assert_close(out, want_out, tol, "out")
    assert_lse_close(lse, want_lse, tol)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close(grad, want, tol, name)


def test_new_documents_do_not_retrace():
    x = _inputs(2)
    q, k, v = x["q"], x["k"], x["v"]
    traces = []

    @jax.jit
    def run(cu_q, cu_k):
        traces.append(1)
        return varlen_attention(q, k, v, cu_q, cu_k, causal=True, implementation="pallas")

    rng = np.random.default_rng(5)
    for _ in range(3):
        cut = np.sort(rng.integers(0, min(q.shape[0], k.shape[0]) + 1, 4))
        cu = np.concatenate([[0], cut]).astype(np.int32)
        out = run(jnp.asarray(cu), jnp.asarray(cu))
        ref = attention_reference(q, k, v, cu, cu, causal=True)
        assert_close(out, ref, attention_tolerance(q, k, cu_q=cu, cu_k=cu), "out")
    assert len(traces) == 1


def test_forward_skips_blocks_of_other_documents():
    """Blocks the document mask leaves empty are never computed: NaN planted in a kv
    block that no query of the first document's blocks may see stays out of them, and the
    forward MaskInfo marks every cross-document block empty."""
    lengths = ((256, 256), (256, 256))
    x = _inputs(3, lengths=lengths)
    cu = cu_seqlens([256, 256])
    info, _ = jax.jit(
        lambda c: process_mask(DocumentMask(c, shape=(512, 512), causal=True), (128, 128))
    )(jnp.asarray(cu))
    block_mask = np.asarray(info.block_mask[0])
    assert (block_mask[:2, 2:] == 0).all() and (block_mask[2:, :2] == 0).all()
    assert (np.diag(block_mask) == 1).all() and block_mask[1, 0] == 2
    v = x["v"].at[256:512].set(jnp.nan)
    out = varlen_attention(
        x["q"],
        x["k"],
        v,
        cu,
        cu,
        causal=True,
        implementation="pallas",
        config=BlockSizes(block_q=128, block_kv=128),
    )
    assert np.isfinite(np.asarray(out[:256])).all()


def test_vmap_over_packed_batches():
    xs = [_inputs(seed) for seed in (4, 5)]
    q, k, v = (jnp.stack([x[n] for x in xs]) for n in ("q", "k", "v"))
    cu = xs[0]["cu_q"], xs[0]["cu_k"]
    out = jax.vmap(
        lambda q, k, v: varlen_attention(
            q, k, v, *cu, sliding_window=(30, 2), implementation="pallas"
        )
    )(q, k, v)
    for b in range(2):
        ref = attention_reference(q[b], k[b], v[b], *cu, sliding_window=(30, 2))
        tol = attention_tolerance(q[b], k[b], cu_q=cu[0], cu_k=cu[1])
        assert_close(out[b], ref, tol, f"batch {b}")


def test_refused_options_name_themselves():
    x = _inputs(6)
    args = (x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"])
    with pytest.raises(ValueError, match=r"alibi_slopes.*pallas"):
        varlen_attention(*args, alibi_slopes=x["slopes"], implementation="pallas")
    with pytest.raises(ValueError, match="block_kv"):
        varlen_attention(*args, config=BlockSizes(block_kv=100), implementation="pallas")
