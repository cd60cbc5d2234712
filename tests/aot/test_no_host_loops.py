"""No `while` loop in the XLA work around the Triton kernels, compiled for an H100.

XLA:GPU runs a `while` loop with a host round trip per iteration (the loop condition is
read back to decide whether to launch the body again): measured on an H100, the
searchsorted loop of the chunk indices alone took 16 x 1k-document varlen attention from
345 to 627 us. Index work (sequence ids, chunk indices, group metadata, a traced
document's block classes) must be loop-free: scatter-adds, cumsums, sorts, gathers.

Each op is compiled once, forward and backward in one program (the gradient's program
holds the forward), in bfloat16 with small shapes; a traced `DocumentMask`'s constructor
(its per-token arrays) is in the program with the op.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from jax_bridge import (
    block_sparse_attention,
    compile_for,
    flash_attention,
    init_moe_params,
    moe_feed_forward,
    transposed_grouped_matmul,
    varlen_attention,
)
from jax_bridge.aot.common import while_loops
from pallas_tpu.splash import CausalMask, DocumentMask
from tests.aot.helpers import spec

TARGET = "h100"
TOKENS, HEADS, HEAD_DIM, DOCUMENTS = 256, 2, 64, 4
BF16 = jnp.bfloat16


def _compile(fn, *args) -> str:
    return compile_for(fn, *args, target=TARGET).as_text()


def _sum(out) -> jax.Array:
    """A loss whose cotangent is a constant: XLA may fold whatever the backward derives
    from it (see test_block_sparse_backward_flags_are_not_constant_folded)."""
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))


def _qkv(batch: tuple[int, ...] = ()) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (spec((*batch, TOKENS, HEADS, HEAD_DIM), BF16),) * 3


# ------------------------------------------------------------------ compiled programs


@pytest.fixture(scope="module")
def varlen_hlo() -> str:
    def program(q, k, v, cu):
        def loss(q, k, v):
            out = varlen_attention(
                q, k, v, cu, cu, causal=True, return_lse=True, implementation="triton"
            )
            return jnp.sum(out[0].astype(jnp.float32)) + jnp.sum(
                jnp.where(out[1] > -1e30, out[1], 0)
            )

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    return _compile(program, *_qkv(), spec((DOCUMENTS + 1,), jnp.int32))


@pytest.fixture(scope="module")
def flash_hlo() -> str:
    """flash_attention with segment ids: the runs are paired by a search (padded.py)."""

    def program(q, k, v, ids):
        def loss(q, k, v):
            out = flash_attention(q, k, v, q_segment_ids=ids, causal=True, implementation="triton")
            return _sum(out)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    return _compile(program, *_qkv((1,)), spec((1, TOKENS), jnp.int32))


@pytest.fixture(scope="module")
def grouped_matmul_hlo() -> str:
    """The MoE block (router top-k, route, two gmms, unroute) and a standalone tgmm, with
    their gradients: gmm and tgmm forward and backward, and the routing."""
    hidden, ffn, experts, rows = 64, 128, 4, 128
    params = init_moe_params(
        jax.random.key(0), hidden=hidden, ffn=ffn, num_experts=experts, dtype=BF16
    )
    params = jax.tree.map(lambda x: spec(x.shape, x.dtype), params)

    def program(x, params, lhs, grad_out, group_sizes):
        def loss(x, params, lhs, grad_out):
            out = moe_feed_forward(x, params, top_k=2, implementation="triton")
            w = transposed_grouped_matmul(lhs.T, grad_out, group_sizes, implementation="triton")
            return _sum(out) + _sum(w)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, params, lhs, grad_out)

    return _compile(
        program,
        spec((rows, hidden), BF16),
        params,
        spec((rows, hidden), BF16),
        spec((rows, ffn), BF16),
        spec((experts,), jnp.int32),
    )


def _document(cu: jax.Array) -> DocumentMask:
    return DocumentMask(cu, shape=(TOKENS, TOKENS), causal=True)


def _block_sparse_program(q, k, v, cu):
    """A static mask and a DocumentMask of traced cu_seqlens (the training case)."""

    def loss(q, k, v):
        static = block_sparse_attention(
            q, k, v, CausalMask((TOKENS, TOKENS)), implementation="triton"
        )
        traced = block_sparse_attention(q, k, v, _document(cu), implementation="triton")
        return _sum(static) + _sum(traced)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


_BLOCK_SPARSE_ARGS = (*_qkv((1,)), spec((DOCUMENTS + 1,), jnp.int32))


@pytest.fixture(scope="module")
def block_sparse_hlo() -> str:
    return _compile(_block_sparse_program, *_BLOCK_SPARSE_ARGS)


# ------------------------------------------------------------------------------ tests


def test_varlen_attention_forward_and_backward_have_no_loop(varlen_hlo):
    assert "triton_kernel_call" in varlen_hlo
    assert while_loops(varlen_hlo) == []


def test_flash_attention_with_segment_ids_has_no_loop(flash_hlo):
    assert "triton_kernel_call" in flash_hlo
    assert while_loops(flash_hlo) == []


def test_grouped_matmul_moe_block_and_tgmm_have_no_loop(grouped_matmul_hlo):
    assert "triton_kernel_call" in grouped_matmul_hlo
    assert while_loops(grouped_matmul_hlo) == []


def test_block_sparse_attention_has_no_loop(block_sparse_hlo):
    """Static and traced-document masks (the DocumentMask built in the program too),
    forward and backward."""
    assert "triton_kernel_call" in block_sparse_hlo
    assert while_loops(block_sparse_hlo) == []


def test_block_sparse_finds_non_finite_rows_in_its_kernels_on_an_h100(block_sparse_hlo):
    """On an H100 the kernels find the non-finite rows the partial tiles must read as
    zeros (v's in the forward, k's in dQ) and the dQ kernel flags q's and the cotangent's
    for dK/dV: no pass of XLA over an operand (a reduce, and once a select and a copy)."""
    assert "is-finite(" not in block_sparse_hlo


@pytest.mark.slow
def test_block_sparse_backward_flags_are_not_constant_folded_on_an_a100():
    """On an A100 (sm_80: there the dQ kernel's flags spill) XLA flags the non-finite rows
    of q and of the cotangent d_out for dK/dV. The cotangent of `sum(out)` is a broadcast
    constant, and XLA constant-folded its flags (at 8192 tokens x 8 heads its evaluator
    spent minutes on that reduce). Behind a barrier, the cotangent's are computed too."""
    text = compile_for(_block_sparse_program, *_BLOCK_SPARSE_ARGS, target="a100").as_text()
    backward = re.findall(r'is-finite\(.*op_name="[^"]*transpose\(jvp\(\)\)/is_finite', text)
    assert len(backward) >= 2, backward


def test_loop_regex_finds_a_searchsorted_loop():
    """The check can fail: jnp.searchsorted's default method compiles to a `while`."""
    text = _compile(
        lambda a, v: jnp.searchsorted(a, v, side="right"),
        spec((9,), jnp.int32),
        spec((33,), jnp.int32),
    )
    assert len(while_loops(text)) == 1 and "searchsorted" in while_loops(text)[0]


# XLA kernels in an optimized HLO's entry computation (our kernels are custom calls; a
# bitcast, tuple or parameter launches nothing).
_XLA_KERNEL = re.compile(
    r"^\s*(?:ROOT )?%\S+ = .* (fusion|sort|gather|scatter|concatenate|copy|reduce|reduce-window"
    r"|while|convert|broadcast|select|add|compare)\(",
    re.MULTILINE,
)


def _xla_kernels(text: str) -> list[str]:
    entry = text[text.index("\nENTRY") :]
    return [match.group(1) for match in _XLA_KERNEL.finditer(entry)]


def test_varlen_attention_launches_no_xla_kernel_around_its_own():
    """Forward and backward (a VJP with the output cotangent given) compiled for an H100
    are our five kernels alone: the tile lists come from the schedule kernel and the row
    statistics from dQ. Each small XLA kernel costs ~3 us on an H100; seven of them (the
    lists' concatenations, comparison, sort and gather) took ~50 us of a 320 us forward."""

    def program(q, k, v, cu, d_out):
        def attention(q, k, v):
            return varlen_attention(q, k, v, cu, cu, causal=True, implementation="triton")

        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out)

    q = spec((TOKENS, HEADS, HEAD_DIM), BF16)
    text = _compile(program, q, q, q, spec((DOCUMENTS + 1,), jnp.int32), q)
    assert text.count('custom_call_target="triton_kernel_call"') == 5
    assert _xla_kernels(text) == []


def test_xla_kernel_regex_finds_the_xla_tile_lists():
    """The check can fail: the lists built by XLA (the persistent launches' builder)
    compile to fusions and a sort."""
    from jax_bridge.attention.schedule import _with_tail_sequences, _xla_tiles
    from triton_kernels.flash_attention.config import AttentionFeatures

    def lists(cu):
        cu_q, _ = _with_tail_sequences(cu, cu, TOKENS, TOKENS)
        return _xla_tiles(cu_q, TOKENS, 64, AttentionFeatures(causal=True), query_side=True)

    kinds = _xla_kernels(_compile(lists, spec((DOCUMENTS + 1,), jnp.int32)))
    assert "fusion" in kinds and len(kinds) >= 3, kinds


def test_grouped_matmul_launches_no_xla_kernel_around_its_own():
    """gmm forward and backward (d_lhs: gmm, d_rhs: tgmm; a VJP with the output cotangent
    given), bf16 in and out, compiled for an H100: one metadata kernel (XLA merges the
    three launches' equal ones) and the three matmuls, nothing else. Its XLA builder took
    five small kernels (~20 us on an H100)."""
    from jax_bridge import grouped_matmul

    def program(lhs, rhs, sizes, d_out):
        def gmm(lhs, rhs):
            return grouped_matmul(
                lhs, rhs, sizes, preferred_element_type=BF16, implementation="triton"
            )

        out, vjp = jax.vjp(gmm, lhs, rhs)
        return out, vjp(d_out)

    rows, hidden, ffn, experts = 512, 128, 256, 8
    text = _compile(
        program,
        spec((rows, hidden), BF16),
        spec((experts, hidden, ffn), BF16),
        spec((experts,), jnp.int32),
        spec((rows, ffn), BF16),
    )
    assert text.count('custom_call_target="triton_kernel_call"') == 4
    assert _xla_kernels(text) == []
