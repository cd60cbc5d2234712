"""Poisoned outputs on the GPU path: within `poisoned_outputs()` every output a kernel need
not find initialised starts as NaN / the integer minimum / True, as on the interpreter.

No GPU here: the launch jax_triton 0.3 is handed is replayed through Triton's interpreter
with 0.3's buffer semantics (an aliased output starts as its input; other outputs as old
memory), the lowered program is read for the fills, and the wrapper 0.3 needs is compiled
for sm_90 with the launch needs of the kernel it wraps."""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from jax_bridge import cuda_lowering, lower_for_cuda, poisoned_outputs, triton_call
from jax_bridge.launch import jax_triton_compat as compat
from jax_bridge.launch.interpreter import run_interpreted
from jax_bridge.launch.poisoned_outputs import poison_value, with_ignored_pointers
from tests.launch.recording import interpret_gpu_launches, record_triton_kernels
from tests.launch.test_jax_triton_compat import (
    OUT_SHAPES,
    axpy_kernel,
    fake_jax_triton_04,
    kernel_call,
)
from tests.launch.test_kernel_needs import _copy, _descriptor_copy, _matmul

N = 16


@triton.jit
def _half_written(x_ptr, scale, count_ptr, out_ptr, index_ptr, flag_ptr, total_ptr,
                  BLOCK: tl.constexpr, OFFSET: tl.constexpr = 0.0):  # fmt: skip
    """Writes every other element of out, index and flag, and adds into total (zeroed)."""
    offs = tl.arange(0, BLOCK)
    even = offs % 2 == 0
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * scale + OFFSET, mask=even)
    tl.store(index_ptr + offs, offs + tl.load(count_ptr), mask=even)
    tl.store(flag_ptr + offs, x > 0, mask=even)
    tl.atomic_add(total_ptr, tl.sum(x))


_SHAPES = (
    jax.ShapeDtypeStruct((N,), jnp.float32),
    jax.ShapeDtypeStruct((N,), jnp.int32),
    jax.ShapeDtypeStruct((N,), jnp.bool_),
    jax.ShapeDtypeStruct((1,), jnp.float32),  # zeroed
)


def _launch(x, count, **constexprs):
    return triton_call(x, 3.0, count, kernel=_half_written, out_shape=_SHAPES, grid=1,
                       zeroed_outputs=(3,), BLOCK=N, **constexprs)  # fmt: skip


def _inputs():
    rng = np.random.default_rng()
    x = rng.standard_normal(N).astype(np.float32)
    return x, np.asarray([rng.integers(1, 100)], np.int32)


def _expected_written(x, count, offset=0.0):
    even = np.arange(N) % 2 == 0
    return even, (x * 3.0 + offset, np.arange(N) + count[0], x > 0), np.sum(x)


@pytest.mark.parametrize("offset", [None, 0.5])
def test_the_wrapper_runs_its_kernel_and_ignores_its_extra_pointers(offset):
    """Interpreted: the wrapper's outputs are the kernel's (constexpr default taken or
    overridden); its ignored pointers, between inputs and outputs, are never read."""
    wrapper = with_ignored_pointers(_half_written, 3, 2)
    assert wrapper.arg_names == [
        "x_ptr", "scale", "count_ptr", "ignored_pointer_0", "ignored_pointer_1", "out_ptr",
        "index_ptr", "flag_ptr", "total_ptr", "BLOCK", "OFFSET",
    ]  # fmt: skip
    assert with_ignored_pointers(_half_written, 3, 2) is wrapper
    x, count = _inputs()
    constexprs = dict(BLOCK=N) if offset is None else dict(BLOCK=N, OFFSET=offset)
    outputs = [np.zeros(s.shape, s.dtype) for s in _SHAPES]
    ignored = [np.full(N, np.nan, np.float32), np.full(N, -1, np.int32)]
    run_interpreted(wrapper, (1,), [x, 3.0, count, *ignored], outputs, constexprs)
    even, written, total = _expected_written(x, count, offset or 0.0)
    for out, want in zip(outputs, written, strict=False):
        np.testing.assert_allclose(out[even], want[even], rtol=1e-6)
        assert not out[~even].any()  # left as they started
    np.testing.assert_allclose(outputs[3], [total], rtol=1e-5)


def test_the_wrapper_refuses_parameters_named_like_its_own():
    @triton.jit
    def clash(x_ptr, inner_kernel, out_ptr):
        pass

    with pytest.raises(ValueError, match=r"clash: parameters \['inner_kernel'\] clash"):
        with_ignored_pointers(clash, 2, 1)


@pytest.mark.skipif(compat.jax_triton_api_version() != (0, 3), reason="0.3's launch")
@pytest.mark.parametrize("poisoned", [False, True])
def test_a_launch_for_the_gpu_starts_its_outputs_poisoned_within_the_context(poisoned, monkeypatch):
    """What jax_triton 0.3 is handed, run as a GPU would: within the context the elements
    the kernel leaves alone read as poison, outside as old memory; the written ones and
    the zeroed output are the same either way."""
    gpu = interpret_gpu_launches(monkeypatch)
    x, count = _inputs()
    with cuda_lowering(90), poisoned_outputs(poisoned):
        outputs = _launch(jnp.asarray(x), jnp.asarray(count))
    assert (gpu.kernels[0] is _half_written) is not poisoned
    even, written, total = _expected_written(x, count)
    for out, want, shape in zip(outputs, written, _SHAPES, strict=False):
        out = np.asarray(out)
        np.testing.assert_allclose(out[even], want[even], rtol=1e-6)
        left = poison_value(shape.dtype) if poisoned else gpu.old_memory(shape.dtype)
        np.testing.assert_array_equal(out[~even], np.full(out[~even].shape, left, shape.dtype))
    np.testing.assert_allclose(outputs[3], [total], rtol=1e-5)


def _axpy(x, init):
    """axpy_kernel through `triton_call`: out aliases init, sq is plain, count zeroed."""
    return triton_call(x, 2.0, init, kernel=axpy_kernel, out_shape=OUT_SHAPES, grid=1,
                       input_output_aliases={2: 0}, zeroed_outputs=(2,), BLOCK=N // 2)  # fmt: skip


def test_the_lowered_call_aliases_each_plain_output_to_a_fill_of_its_poison():
    """axpy's out aliases its input and count is zeroed, as without the context; sq, the
    plain output, now aliases a broadcast NaN."""
    x = jax.ShapeDtypeStruct((N // 2,), jnp.float32)
    with poisoned_outputs():
        text = lower_for_cuda(_axpy, x, x)
    operands, aliases, results = kernel_call(text)
    assert operands[aliases[results[0]]] == "%arg1"
    fill = operands[aliases[results[1]]]
    (constant,) = re.findall(rf"{fill} = stablehlo.broadcast_in_dim (%\w+)", text)
    assert re.search(rf"{constant} = stablehlo.constant dense<0x7FC00000> ", text)
    if compat.jax_triton_api_version() < (0, 4):
        assert results[2] not in aliases  # 0.3 zeroes it in the kernel call


def test_an_op_lowered_within_the_context_starts_every_plain_output_poisoned():
    """varlen attention's fwd+bwd for sm_90: every output of every kernel call aliases an
    operand (none is zeroed or aliased by default: all start poisoned)."""
    from jax_bridge import varlen_attention

    q = jax.ShapeDtypeStruct((128, 2, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)

    def fwd_bwd(q, k, v, cu):
        def loss(q, k, v):
            out = varlen_attention(q, k, v, cu, cu, causal=True, max_seqlen_q=128,
                                   max_seqlen_k=128, implementation="triton")  # fmt: skip
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    with poisoned_outputs():
        text = lower_for_cuda(fwd_bwd, q, q, q, cu)
    calls = re.findall(r"stablehlo\.custom_call @triton_kernel_call.*", text)
    assert len(calls) >= 4
    for call in calls:
        results = re.search(r"-> (\(.*\)|tensor<[^>]*>)$", call)[1]
        assert call.count("output_operand_alias<") == results.count("tensor<")


@pytest.mark.skipif(compat.jax_triton_api_version() != (0, 3), reason="0.3's wrapper")
@pytest.mark.parametrize("case", ["descriptors", "warp-specialized"])
def test_the_wrapper_gets_the_launch_needs_of_the_kernel_it_wraps(case, monkeypatch):
    """Compiled for sm_90 through the wrapper, a kernel keeps what its launch needs: the
    descriptors' global scratch, the 12 warps of a warp-specialized loop."""
    a = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    fn, args = {
        "descriptors": (lambda x: _copy(_descriptor_copy, x, 32, 32), (x,)),
        "warp-specialized": (_matmul, (a, b)),
    }[case]
    calls = {}
    for poisoned in (False, True):
        recorded = record_triton_kernels(monkeypatch, (0, 11, 2))
        with poisoned_outputs(poisoned):  # a new function: no lowering cached by jax
            lower_for_cuda(lambda *a: fn(*a), *args)
        (calls[poisoned],) = recorded.calls
    plain, wrapped = calls[False], calls[True]
    assert wrapped[0] == f"{plain[0]}_poisoned"
    assert wrapped[1] == plain[1] and wrapped[7:] == plain[7:]  # warps; scratch


def test_04_binds_a_poisoned_output_to_its_parameter_as_a_ref(monkeypatch):
    calls = []
    monkeypatch.setattr(compat, "jax_triton_api_version", lambda: (0, 4))
    monkeypatch.setitem(sys.modules, "jax_triton", fake_jax_triton_04(calls))
    monkeypatch.setattr(compat, "pass_kernel_needs", lambda: None)
    x = jnp.arange(N // 2, dtype=jnp.float32)
    with cuda_lowering(90), poisoned_outputs():
        out, sq, count = _axpy(x, x)
    (call,) = calls
    assert call["out_type"] == () and isinstance(call["kwargs"]["sq_ptr"], jax.Ref)
    assert np.isnan(sq).all()  # the stand-in kernel writes sq only as a result, not a Ref
    np.testing.assert_array_equal(out, 3 * x)
    np.testing.assert_array_equal(count, [1])


def test_the_suite_poisons_on_a_gpu_every_test_but_those_that_read_lowered_programs(
    monkeypatch,
):
    from tests import devices

    numeric = "tests/attention/test_conformance.py::test_forward_and_gradients_match_reference"
    assert not devices.poisons_outputs(numeric)  # here: the interpreter poisons them anyway
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert devices.poisons_outputs(numeric)
    assert devices.poisons_outputs("tests/moe/test_moe.py::test_moe_matches_reference[triton]")
    for inspecting in (
        "tests/attention/test_lowering.py::test_lowers_for_cuda[90]",
        "tests/launch/test_kernel_needs.py::test_a_kernel_without_scratch_is_built_as_before",
        "tests/aot/test_targets.py::test_plain_jit_over_a_gpu_mesh_compiles[h100]",
        "tests/test_bench_preflight.py::test_preflight",
    ):
        assert not devices.poisons_outputs(inspecting)


@pytest.mark.parametrize(
    "initial, match",
    [({3: 0}, r"initial_outputs \[3\]: 3 outputs"), ({0: 0}, r"\[0\] start as given and aliased"),
     ({2: 0}, r"\[2\] start as given and aliased or zeroed")],
)  # fmt: skip
def test_an_initial_value_for_no_output_or_an_aliased_or_zeroed_one_is_refused(initial, match):
    x = jnp.ones(N // 2, jnp.float32)
    with pytest.raises(ValueError, match=match):
        compat.call_jax_triton(
            x, 2.0, x, kernel=axpy_kernel, out_shapes=OUT_SHAPES, grid=(1,), num_warps=4,
            num_stages=2, compute_capability=90, input_output_aliases={2: 0},
            zeroed_outputs=(2,), name="axpy", initial_outputs=initial, BLOCK=N // 2,
        )  # fmt: skip
