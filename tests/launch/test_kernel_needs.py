"""What a compiled kernel needs from its launch, passed to jaxlib through jax_triton 0.3:
a kernel with device-side tensor descriptors (TMA) gets its global scratch, or a clear
error where jaxlib cannot take it; a warp-specialized kernel gets its own warp count; a
kernel that needs neither is built as before. Lowered for an H100 on any machine; run on
a Hopper GPU where there is one."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from jax_bridge import lower_for_cuda, triton_call
from jax_bridge.launch import kernel_needs
from jax_bridge.launch.jax_triton_compat import jax_triton_api_version
from tests.devices import needs_tensor_descriptors
from tests.launch.recording import RecordedKernels, record_triton_kernels

pytestmark = pytest.mark.skipif(
    jax_triton_api_version() != (0, 3), reason="jax_triton 0.4 passes the scratch itself"
)


@triton.jit
def _descriptor_copy(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
    """out = x through two device-side tensor descriptors (Hopper's bulk tensor copies)."""
    source = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[M, N])
    target = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[M, N])
    target.store([0, 0], source.load([0, 0]))


@triton.jit
def _warp_specialized_matmul(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr,
                             N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """out = a @ b, one [M, N] tile, its k loop warp-specialized: on Hopper a producer
    warpgroup loads the tiles through descriptors and two consumer warpgroups multiply."""
    a = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[M, BLOCK_K])
    b = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, N])
    acc = tl.zeros((M, N), tl.float32)
    for k in tl.range(0, K, BLOCK_K, warp_specialize=True):
        acc = tl.dot(a.load([0, k]), b.load([k, 0]), acc)
    offsets = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + offsets, acc)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    (m, k), n = a.shape, b.shape[1]
    return triton_call(
        a, b, kernel=_warp_specialized_matmul, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=1, num_warps=4, num_stages=3, M=m, K=k, N=n, BLOCK_K=64,
    )  # fmt: skip


@triton.jit
def _plain_copy(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
    offsets = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets))


def _copy(kernel, x: jax.Array, m: int, n: int) -> jax.Array:
    return triton_call(
        x, kernel=kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=1, M=m, N=n
    )


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> RecordedKernels:
    """jaxlib's TritonKernel recorded, on a jaxlib that takes the scratch."""
    return record_triton_kernels(monkeypatch, (0, 11, 2))


@pytest.mark.parametrize("shape", [(32, 32), (16, 128)])
def test_a_descriptor_kernel_gets_its_scratch_on_a_jaxlib_that_takes_it(shape, recorded) -> None:
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    text = lower_for_cuda(lambda x: _copy(_descriptor_copy, x, *shape), x)
    assert "triton_kernel_call" in text
    (call,) = recorded.calls
    # Two descriptors of 128 bytes each, aligned to 128: what Triton's metadata says.
    assert call[0] == "_descriptor_copy" and call[7:] == (256, 128)


def test_a_kernel_without_scratch_is_built_as_before(recorded) -> None:
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    lower_for_cuda(lambda x: _copy(_plain_copy, x, 32, 32), x)
    (call,) = recorded.calls
    assert call[0] == "_plain_copy" and len(call) == 7


def test_an_older_jaxlib_refuses_with_the_kernel_and_what_it_needs(recorded, monkeypatch):
    monkeypatch.setattr(kernel_needs, "jaxlib_version", lambda: (0, 10, 2))
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"'_descriptor_copy' needs 256 bytes.*0\.11"):
        lower_for_cuda(lambda x: _copy(_descriptor_copy, x, 32, 32), x)
    assert recorded.calls == []


def test_a_warp_specialized_kernel_gets_its_own_warp_count(recorded) -> None:
    """Asked for 4 warps, the kernel runs 12 on Hopper (a producer warpgroup and two
    consumers): jaxlib must launch 12, or the launch fails on the device."""
    a = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    lower_for_cuda(_matmul, a, b)
    (call,) = recorded.calls
    assert call[0] == "_warp_specialized_matmul" and call[1] == 12
    assert len(call) == 9  # and its descriptors' scratch


@triton.jit
def _deep_matmul(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """out = a @ b, one [M, N] tile over a k loop by pointers (its pipeline's stages of
    [M, BLOCK_K] and [BLOCK_K, N] tiles in shared memory)."""
    rows, cols, ks = tl.arange(0, M), tl.arange(0, N), tl.arange(0, BLOCK_K)
    acc = tl.zeros((M, N), tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * K + (k + ks)[None, :])
        b = tl.load(b_ptr + (k + ks)[:, None] * N + cols[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


@pytest.mark.parametrize("stages, fits", [(3, True), (8, False)])
def test_a_kernel_over_its_targets_shared_memory_is_refused_by_name(stages, fits) -> None:
    """jax_triton compiles to PTX only, so nothing else sees that a pipeline does not fit
    before the launch fails on the device: 128x128 tiles over 64-deep k steps hold 32 KiB
    a stage, 3 stages fit an H100's 227 KiB a CTA, 8 do not."""
    a = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16)

    def matmul(a, b):
        return triton_call(
            a, b, kernel=_deep_matmul, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32),
            grid=1, num_warps=8, num_stages=stages, M=128, K=1024, N=128, BLOCK_K=64,
        )  # fmt: skip

    if fits:
        assert "triton_kernel_call" in lower_for_cuda(matmul, a, b, compute_capability=90)
        return
    with pytest.raises(ValueError, match=r"'_deep_matmul' needs \d+ bytes of shared memory.*sm_90"):
        lower_for_cuda(matmul, a, b, compute_capability=90)


def test_a_thread_that_compiled_another_kernel_passes_nothing() -> None:
    """What a compile recorded belongs to that kernel's name only."""
    lib = kernel_needs._NeedsPassingLib(_Lib())
    kernel_needs._compiled.last = ("other_kernel", kernel_needs.KernelNeeds(256, 128, 12))
    assert lib.TritonKernel("this_kernel", 4, 1) == ("this_kernel", 4, 1)
    assert kernel_needs._compiled.last == (None, None)


def test_a_kernel_built_with_its_scratch_already_gets_only_its_warps() -> None:
    """jax_triton 0.4 builds a kernel with scratch from 9 arguments: the scratch is its
    own, the warp count the one asked for."""
    lib = kernel_needs._NeedsPassingLib(_Lib())
    args = (4, 1, 1024, "ptx", "ttir", 90, 256, 128)
    kernel_needs._compiled.last = ("k", kernel_needs.KernelNeeds(256, 128, 12))
    assert lib.TritonKernel("k", *args) == ("k", 12, *args[1:])


class _Lib:
    @staticmethod
    def TritonKernel(*args):  # jaxlib's name
        return args


@needs_tensor_descriptors
def test_a_warp_specialized_kernel_multiplies_on_a_hopper_gpu() -> None:
    rng = np.random.default_rng()
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((128, 256), (256, 128)))
    expected = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    # float32 sums of 256 exact bf16 products of size ~1 (sums ~16): rounding near 1e-5;
    # a tile multiplied wrongly or not written is off by ~10.
    np.testing.assert_allclose(np.asarray(jax.jit(_matmul)(a, b)), expected, rtol=1e-3, atol=1e-2)


@needs_tensor_descriptors
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_descriptor_kernel_copies_on_a_hopper_gpu(dtype) -> None:
    x = jnp.asarray(np.random.default_rng().standard_normal((64, 64)), dtype)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda x: _copy(_descriptor_copy, x, 64, 64))(x)), np.asarray(x)
    )


def test_kernel_builds_wait_for_an_interpreted_launch(monkeypatch):
    """A launch in Triton's interpreter patches `triton.language` while it runs, on
    whichever thread JAX runs its callback; a compile for a GPU beside it met the patched
    language (an AttributeError in Triton's code generator, seen once in the device
    stack's suite). The static report's compile and jax_triton's kernel build (once
    `pass_kernel_needs` ran) wait for `no_interpreted_launch` instead: neither starts
    while it is held, both do once it is released."""
    from jax_triton import triton_lib

    from examples.softmax import softmax_rows_kernel
    from jax_bridge.launch import report
    from jax_bridge.launch.interpreter import no_interpreted_launch

    kernel_needs.pass_kernel_needs()
    started = {"report": threading.Event(), "jax_triton": threading.Event()}
    compile_ = triton.compile

    def recording_compile(*args, **kwargs):
        started["report"].set()
        return compile_(*args, **kwargs)

    monkeypatch.setattr(report.triton, "compile", recording_compile)
    build = kernel_needs._apart_from_the_interpreter(lambda: started["jax_triton"].set())
    assert triton_lib.get_or_create_triton_kernel.__wrapped__ is not None
    signature = {"x_ptr": "*bf16", "num_cols": "i32", "out_ptr": "*bf16"}
    workers = [
        threading.Thread(target=build),
        threading.Thread(
            target=report.static_kernel_report,
            args=(softmax_rows_kernel, signature, {"BLOCK_COLS": 1024}),
        ),
    ]
    with no_interpreted_launch():
        for worker in workers:
            worker.start()
        assert not any(event.wait(1.0) for event in started.values())
    for worker in workers:
        worker.join(120)
    assert all(event.is_set() for event in started.values())
