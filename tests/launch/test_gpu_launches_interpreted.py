"""Each op as a GPU runs it, without one. Traced for sm_90 (and sm_80) with the defaults
a GPU gets (Hopper's tiles and warps; dK/dV's tensor descriptors where the installed jaxlib
allocates their scratch, as the device's does) and its outputs poisoned, as the suite
runs on a GPU, the launches jax_triton 0.3 would be handed are run by Triton's interpreter
with a GPU's buffers (`tests/launch/recording.py`): outputs and gradients against each
op's float64 oracle, with its conformance suite's helpers.

What no interpreter shows stays for the device: timing, races between programs, the
compiled code's own numerics (`bench/gpu_check.sh`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import block_sparse_attention, cuda_lowering, grouped_matmul, poisoned_outputs
from jax_bridge.launch.jax_triton_compat import jax_triton_api_version
from pallas_tpu.splash.masks import CausalMask, LocalMask
from tests.attention.helpers import assert_close as assert_attention_close
from tests.attention.helpers import assert_lse_close, tolerance
from tests.attention.test_conformance import case, check_case
from tests.block_sparse import test_conformance as block_sparse_suite
from tests.grouped_matmul.helpers import assert_close, gmm_float64, normal, tgmm_float64
from tests.grouped_matmul.test_conformance import check_gmm
from tests.launch.recording import interpret_gpu_launches

pytestmark = pytest.mark.skipif(
    jax_triton_api_version() != (0, 3), reason="stands in for jax_triton 0.3's launch"
)
CAPABILITIES = pytest.mark.parametrize("capability", [90, 80], ids=["sm_90", "sm_80"])


@pytest.fixture
def on_a_gpu(monkeypatch, capability):
    """Ops traced within lower for cuda at `capability`, outputs poisoned, and compute on
    this host (the interpreter); yields the recorder of the launches (their kernels and
    tiles)."""
    gpu = interpret_gpu_launches(monkeypatch)
    with cuda_lowering(capability), poisoned_outputs():
        yield gpu


def _names(gpu) -> set[str]:
    return {kernel.__name__ for kernel in gpu.kernels}


@CAPABILITIES
def test_varlen_attention(on_a_gpu, capability):
    """bf16, causal, GQA 8q/2kv, d=128: a document over a 128-row tile, empty documents
    on either side, length 1, rows past the last document."""
    lengths = ((150, 150), (0, 3), (1, 1), (40, 40), (5, 0), (0, 0), (20, 33))
    c = case({"causal": True}, heads=(8, 2), head_dim=128, dtype=jnp.bfloat16,
             lengths=lengths, pad=(6, 2))  # fmt: skip
    check_case("triton", c, seed=capability)
    assert _names(on_a_gpu) == {
        f"attention_{kernel}_kernel_poisoned"
        for kernel in ("schedule", "forward", "backward_dq", "backward_dkdv")
    }


@CAPABILITIES
def test_varlen_attention_at_head_dim_256(on_a_gpu, capability):
    """bf16, causal, GQA 4q/2kv, d=256 (Gemma's): the tiles a GPU takes there (sm_90: the
    forward's 64-key steps, dQ's 128 query rows, dK/dV head-major; sm_80: dK/dV's 32 keys
    at 4 warps) over a document past one 128-row tile, empty and length-1 documents, rows
    past the last."""
    lengths = ((150, 150), (0, 3), (1, 1), (33, 40), (0, 0))
    c = case({"causal": True}, heads=(4, 2), head_dim=256, dtype=jnp.bfloat16,
             lengths=lengths, pad=(6, 2))  # fmt: skip
    check_case("triton", c, seed=capability)
    tiles = on_a_gpu.tiles
    if capability == 90:
        assert tiles["attention_forward_kernel_poisoned"] == (128, 64, 8)
        assert tiles["attention_backward_dq_kernel_poisoned"] == (128, 32, 8)
        assert tiles["attention_backward_dkdv_kernel_poisoned"] == (32, 64, 8)
    else:
        assert tiles["attention_backward_dkdv_kernel_poisoned"] == (32, 32, 4)


@pytest.mark.parametrize(
    "capability, head_dim, tiles",
    [
        (86, 128, {"forward": (128, 64, 8), "backward_dq": (128, 32, 8),
                   "backward_dkdv": (64, 64, 8)}),
        (86, 64, {"forward": (128, 128, 8), "backward_dq": (128, 64, 8),
                  "backward_dkdv": (32, 128, 8)}),
        (120, 128, {"forward": (128, 32, 8), "backward_dkdv": (64, 64, 8)}),
        (86, 256, {"forward": (32, 32, 4), "backward_dq": (32, 32, 4),
                   "backward_dkdv": (32, 16, 4)}),
    ],
    ids=["sm_86-d128", "sm_86-d64", "sm_120-d128", "sm_86-d256"],
)  # fmt: skip
def test_varlen_attention_on_small_shared_memory_gpus(on_a_gpu, capability, head_dim, tiles):
    """bf16, causal, GQA 4q/2kv, at the light tiles of the GPUs of 99 KiB of shared
    memory a block (RTX 30xx-50xx, L4, L40S): sm_86's forward 64-key steps at d=128 and
    128-key ones at d=64, dQ's 64-key steps at d=64, dK/dV's 64 query rows at d=128 (sm_120
    too), and at d=256 the tiles of 32 query rows at 4 warps, over a document past one
    128-row tile, empty and length-1 documents, rows past the last."""
    lengths = ((150, 150), (0, 3), (1, 1), (70, 40), (0, 0))
    c = case({"causal": True}, heads=(4, 2), head_dim=head_dim, dtype=jnp.bfloat16,
             lengths=lengths, pad=(6, 2))  # fmt: skip
    check_case("triton", c, seed=capability + head_dim)
    for kind, tile in tiles.items():
        assert on_a_gpu.tiles[f"attention_{kind}_kernel_poisoned"] == tile, kind


@pytest.mark.parametrize(
    "capability, head_dim, tile",
    [(90, 256, (16, 64, 8)), (80, 128, (64, 64, 8)), (80, 64, (64, 64, 4))],
    ids=["sm_90-d256", "sm_80-d128", "sm_80-d64"],
)  # fmt: skip
def test_varlen_attention_with_dq_by_atomics(on_a_gpu, capability, head_dim, tile):
    """`AttentionConfigs(dq_atomic=True)`, causal with sinks, GQA 4q/2kv, where the dK/dV
    kernel that adds dQ takes its own tiles (sm_90, d=256: head-major, 16x64; sm_80, 64
    query rows at d=128, and at d=64 at 4 warps): its atomic dQ against the float64
    oracle."""
    from jax_bridge import AttentionConfigs

    lengths = ((150, 150), (0, 3), (1, 1), (70, 40), (0, 0))
    c = case({"causal": True}, heads=(4, 2), head_dim=head_dim, dtype=jnp.bfloat16,
             lengths=lengths, pad=(6, 2), sinks=True)  # fmt: skip
    check_case("triton", c, seed=capability, config=AttentionConfigs(dq_atomic=True))
    tiles = on_a_gpu.tiles
    assert tiles["attention_backward_dkdv_kernel_poisoned"] == tile
    assert "attention_backward_dq_kernel_poisoned" not in tiles


@CAPABILITIES
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_block_sparse_attention(on_a_gpu, capability, mask):
    """bf16 forward, dq and dk/dv at the default block sizes over 2 x 300 tokens (partial
    blocks at both ends), GQA 4q/2kv, d=64, with sinks."""
    _check_block_sparse(capability, mask, head_dim=64, length=300)
    assert {"block_sparse_forward_kernel_poisoned", "block_sparse_dkdv_kernel_poisoned"} <= (
        _names(on_a_gpu)
    )


@CAPABILITIES
def test_block_sparse_attention_at_head_dim_256(on_a_gpu, capability):
    """As `test_block_sparse_attention`, causal over 2 x 200 tokens at d=256, where a GPU
    takes its own tiles (sm_90: dQ's 128 query rows, dK/dV head-major; sm_80: dK/dV's 32
    keys at 4 warps)."""
    _check_block_sparse(capability, "causal", head_dim=256, length=200)
    tiles = on_a_gpu.tiles
    if capability == 90:
        assert tiles["block_sparse_dq_kernel_poisoned"] == (128, 32, 8)
        assert tiles["block_sparse_dkdv_kernel_poisoned"] == (32, 64, 8)
    else:
        assert tiles["block_sparse_dkdv_kernel_poisoned"] == (32, 32, 4)


def _check_block_sparse(capability: int, mask: str, head_dim: int, length: int) -> None:
    """block_sparse_attention's output, lse and gradients (sinks too) in bf16, GQA
    4q/2kv, 2 sequences of `length`, against its float64 oracle."""
    q, k, v, sinks, weights = block_sparse_suite._inputs(
        capability, length, 4, 2, head_dim, batch=2
    )
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    shape = (length, length)
    mask = CausalMask(shape) if mask == "causal" else LocalMask(shape, (70, 0))
    loss = block_sparse_suite._loss(
        block_sparse_attention, mask, weights, {"implementation": "triton"}
    )
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
        q, k, v, sinks
    )
    want_out, want_lse, want_grads = block_sparse_suite._oracle(mask, q, k, v, sinks, weights, {})
    tol = block_sparse_suite._tolerance(q, k, {}, sinks) + tolerance(jnp.bfloat16)
    assert_attention_close(out, want_out, tol, "out")
    assert_lse_close(lse, want_lse, tol)
    for name, got, want in zip("qkvs", grads, want_grads, strict=True):
        assert_attention_close(got, want, tol, f"d{name}")


@CAPABILITIES
def test_grouped_matmul(on_a_gpu, capability):
    """bf16 in and out at the default tiles: gmm forward, its input gradient (gmm against
    the transposed weights) and weight gradient (tgmm), with an empty group, a group of
    one row and rows past the groups."""
    rng = np.random.default_rng(capability)
    m, k, n = 333, 192, 160
    sizes = jnp.asarray([150, 0, 1, 130, 40], jnp.int32)  # 321 rows < m
    lhs, rhs = normal(rng, (m, k), jnp.bfloat16), normal(rng, (5, k, n), jnp.bfloat16)
    weight = normal(rng, (m, n), jnp.bfloat16)

    def loss(lhs, rhs):
        out = grouped_matmul(
            lhs, rhs, sizes, preferred_element_type=jnp.bfloat16, implementation="triton"
        )
        return jnp.sum(out.astype(jnp.float32) * weight.astype(jnp.float32)), out

    (_, out), (d_lhs, d_rhs) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(lhs, rhs)
    assert out.dtype == jnp.bfloat16
    check_gmm(out, lhs, rhs, sizes)
    d_lhs_64 = gmm_float64(weight, rhs, sizes, transpose_rhs=True)
    assert_close(d_lhs, d_lhs_64, name="d_lhs vs the float64 loop")
    d_rhs_64 = tgmm_float64(lhs.T, weight, sizes, num_groups=5)
    assert_close(d_rhs, d_rhs_64, name="d_rhs vs the float64 loop")
    assert {"gmm_kernel_poisoned", "tgmm_kernel_poisoned"} <= _names(on_a_gpu)
