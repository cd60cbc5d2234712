"""Global scratch through jax_triton 0.3: a kernel with device-side tensor descriptors
(TMA) gets its scratch passed to jaxlib, or a clear error where jaxlib cannot take it;
a kernel without scratch is built as before. Lowered for an H100 on any machine; run on
a Hopper GPU where there is one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from jax_bridge import lower_for_cuda, triton_call
from jax_bridge.launch import global_scratch
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
    monkeypatch.setattr(global_scratch, "jaxlib_version", lambda: (0, 10, 2))
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"'_descriptor_copy' needs 256 bytes.*0\.11"):
        lower_for_cuda(lambda x: _copy(_descriptor_copy, x, 32, 32), x)
    assert recorded.calls == []


def test_a_thread_that_compiled_another_kernel_passes_no_scratch() -> None:
    """The scratch recorded by a compile belongs to that kernel's name only."""
    lib = global_scratch._ScratchPassingLib(_Lib())
    global_scratch._compiled.last = ("other_kernel", global_scratch.GlobalScratch(256, 128))
    assert lib.TritonKernel("this_kernel", 1, 2) == ("this_kernel", 1, 2)
    assert global_scratch._compiled.last == (None, None)


class _Lib:
    @staticmethod
    def TritonKernel(*args):  # jaxlib's name
        return args


@needs_tensor_descriptors
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_descriptor_kernel_copies_on_a_hopper_gpu(dtype) -> None:
    x = jnp.asarray(np.random.default_rng().standard_normal((64, 64)), dtype)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda x: _copy(_descriptor_copy, x, 64, 64))(x)), np.asarray(x)
    )
