"""Host-side tensor descriptors (`jax_bridge.launch.host_descriptors`): a `triton_call`
argument the kernel takes as a tensor descriptor the launch encodes.

On Triton's interpreter the descriptor is Triton's host `TensorDescriptor`: its loads are
checked against the array (zeros past its ends), under jit and vmap. For a GPU, what can
be checked without one: the parameters handed to jaxlib, kind by kind, against the
parameters the compiled kernel declares in its PTX (the descriptor's 128-byte map, its
shape as int32s and strides as int64s, pointers, scalars; Triton compiles it here for
sm_90), and, where jaxlib can pass them (0.11.2), that a kernel taking them lowers for
cuda without the global scratch device-side descriptors need.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bridge.launch import host_descriptors, kernel_needs
from jax_bridge.launch.host_descriptors import HostDescriptor, host_descriptors_launchable
from jax_bridge.launch.lowering import lower_for_cuda
from jax_bridge.launch.report import compile_offline
from jax_bridge.launch.triton_call import triton_call
from tests.devices import first_devices, skip_unless_host_descriptors_launch


@triton.jit
def _scaled_tiles(a, scale, b, count, out_a, out_b, BM: tl.constexpr, BN: tl.constexpr):
    """out_a[tile p] = scale * a's [BM, BN] box at (p * BM, 0) (past a's ends: 0);
    out_b[p] = b's [1, BM, BN] box at (p % count, 0, 0)."""
    p = tl.program_id(0)
    rows = p * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    offsets = rows[:, None] * BN + cols[None, :]
    tl.store(out_a + offsets, a.load([p * BM, 0]) * scale)
    tl.store(out_b + offsets, b.load([p % count, 0, 0]).reshape(BM, BN))


_BM, _BN, _PROGRAMS = 16, 32, 3


def _launch(a, b, scale=0.5):
    out = jax.ShapeDtypeStruct((_PROGRAMS * _BM, _BN), a.dtype)
    return triton_call(
        HostDescriptor(a, (_BM, _BN)), scale, HostDescriptor(b, (1, _BM, _BN)), b.shape[0],
        kernel=_scaled_tiles, out_shape=(out, out), grid=(_PROGRAMS,), BM=_BM, BN=_BN,
    )  # fmt: skip


def _expected(a: np.ndarray, b: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's outputs by numpy: boxes past the arrays' ends hold zeros."""
    padded_a = np.zeros((_PROGRAMS * _BM, _BN), np.float64)
    padded_a[: a.shape[0], : a.shape[1]] = a
    padded_b = np.zeros((b.shape[0], _BM, _BN), np.float64)
    padded_b[:, : b.shape[1], : b.shape[2]] = b
    return scale * padded_a, np.concatenate([padded_b[p % b.shape[0]] for p in range(_PROGRAMS)])


def test_descriptor_loads_read_the_array_and_zeros_past_it():
    """Boxes that run past the array (rows 40.. of a 2-D one, rows and columns of a 3-D
    one) read 0; every output element is written (outputs start NaN); under jit. On a
    Hopper GPU the launch encodes the descriptors (jaxlib), on a CPU Triton's interpreter
    takes them."""
    skip_unless_host_descriptors_launch()
    rng = np.random.default_rng()
    a = rng.standard_normal((40, 24)).astype(np.float32)  # last box: rows 32..47
    b = rng.standard_normal((2, 12, 20)).astype(np.float32)
    out_a, out_b = jax.jit(_launch)(jnp.asarray(a), jnp.asarray(b))
    want_a, want_b = _expected(a, b, 0.5)
    np.testing.assert_array_equal(np.asarray(out_a), want_a.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(out_b), want_b.astype(np.float32))


def test_descriptor_arguments_batch_under_vmap():
    """vmap over a descriptor's array: one launch per batch element, each over its own."""
    skip_unless_host_descriptors_launch()
    rng = np.random.default_rng()
    a = rng.standard_normal((3, 40, 32)).astype(np.float32)
    b = rng.standard_normal((2, 16, 32)).astype(np.float32)
    out_a, out_b = jax.vmap(_launch, in_axes=(0, None))(jnp.asarray(a), jnp.asarray(b))
    for i in range(3):
        want_a, want_b = _expected(a[i], b, 0.5)
        np.testing.assert_array_equal(np.asarray(out_a[i]), want_a.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(out_b[i]), want_b.astype(np.float32))


def test_outputs_vary_inside_shard_map_where_a_descriptors_array_does():
    """Inside shard_map a launch's outputs are typed varying along the axes its inputs
    vary on, descriptors' arrays among them: returned with a replicated out_spec they
    are refused, never one device's copy passed off as the whole."""
    skip_unless_host_descriptors_launch()
    mesh = Mesh(np.array(first_devices(2)), ("x",))
    rng = np.random.default_rng()
    a = jnp.asarray(rng.standard_normal((2, 40, 32)), jnp.float32)  # one block a device
    b = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)  # replicated

    def local(a, b):
        return _launch(a[0], b)

    both = (P("x"), P("x"))
    out_a, out_b = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P()), out_specs=both)(a, b)
    for i in range(2):
        want_a, want_b = _expected(np.asarray(a[i]), np.asarray(b), 0.5)
        np.testing.assert_array_equal(np.asarray(out_a[i * 48 : (i + 1) * 48]), want_a)
        np.testing.assert_array_equal(np.asarray(out_b[i * 48 : (i + 1) * 48]), want_b)
    replicated = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P(), P()))
    with pytest.raises(ValueError, match=r"vary|replicated"):
        replicated(a, b)


@pytest.mark.parametrize(
    "shape, dtype, block, message",
    [
        ((4, 8), np.float32, (4,), "rank 1 to 5 and a block_shape of its rank"),
        ((0, 8), np.float32, (4, 8), "every dimension at least 1"),
        ((4, 8), np.float32, (4, 12), "powers of two up to 256"),
        ((4, 8), np.float32, (4, 512), "powers of two up to 256"),
        ((4, 6), np.float16, (4, 8), "multiple of 16 bytes, got 12"),
        ((4, 8), np.float16, (4, 4), "a box's rows must span a multiple of 16 bytes"),
    ],
    ids=["rank", "empty", "not_power_of_two", "too_large", "row_bytes", "box_bytes"],
)
def test_a_descriptor_the_hardware_cannot_encode_is_refused(shape, dtype, block, message):
    with pytest.raises(ValueError, match=message):
        HostDescriptor(np.zeros(shape, dtype), block)


# ------------------------------------------------ parameters against the compiled kernel


class _KindsOfParameters:
    """Stands for jaxlib's gpu_triton: each parameter it creates is the kind of PTX
    parameter it fills ("map", "i8", "i32", "i64", "f32", "f64", "ptr")."""

    def create_tma_descriptor_parameter(self, **fields):
        assert fields["oob_fill"] == 0 and fields["shape"] and fields["block_shape"]
        return "map"

    def create_scalar_parameter(self, value, kind):
        return {"i32": "i32", "B": "i8", "i64": "i64", "fp32": "f32", "fp64": "f64"}[kind]

    def create_array_parameter(self, zeroed_bytes, divisibility):
        return "ptr"


_PTX_KINDS = [
    (r"\.align 64 \.b8 \w+\[128\]", "map"),
    (r"\.u64 \.ptr", "ptr"),
    (r"\.[us]8|\.pred", "i8"),
    (r"\.[us]32", "i32"),
    (r"\.[us]64", "i64"),
    (r"\.f32", "f32"),
    (r"\.f64", "f64"),
]


def _ptx_parameter_kinds(ptx: str) -> list[str]:
    """The kernel's parameters as declared by its PTX entry, less the global and profile
    scratch pointers Triton appends (jaxlib passes those itself)."""
    declared = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1)
    kinds = []
    for line in filter(None, (p.strip() for p in declared.split(","))):
        kinds.append(next(k for pattern, k in _PTX_KINDS if re.search(pattern, line)))
    return kinds[:-2]


@triton.jit
def _every_kind(x, a, n, one, scale, b, flag, out, B: tl.constexpr):
    """A parameter of each kind, descriptors among them (a 2-D and a 3-D one)."""
    i = tl.arange(0, B)
    t = a.load([0, 0]) + b.load([0, 0, 0]).reshape(B, B) * scale
    t = t + tl.load(x + i)[:, None] * (n + one) * tl.where(flag, 2, 1)
    tl.store(out + i[:, None] * B + i[None, :], t)


def _is_operand(arg) -> bool:
    return isinstance(arg, jax.Array | HostDescriptor)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_parameters_handed_to_jaxlib_are_those_the_compiled_kernel_declares(dtype):
    """For sm_90, Triton 3.x: a descriptor is one 128-byte map then its shape (int32 a
    dimension) and strides (int64 a dimension); a scalar equal to 1 is a constant (as
    jax_triton specializes it), not a parameter; arrays and outputs are pointers."""
    args = [
        jnp.zeros((16,), dtype),
        HostDescriptor(jnp.zeros((40, 16), dtype), (16, 16)),
        7, 1, np.float32(0.25),
        HostDescriptor(jnp.zeros((3, 16, 16), dtype), (1, 16, 16)),
        False,
    ]  # fmt: skip
    out = jax.ShapeDtypeStruct((16, 16), dtype)
    launch = host_descriptors._Launch(
        kernel=_every_kind, num_inputs=len(args),
        scalars=tuple((i, a) for i, a in enumerate(args) if not _is_operand(a)),
        descriptors=((1, (16, 16)), (5, (1, 16, 16))), out_shapes=(out,), grid=(1, 1, 1),
        num_warps=4, num_stages=2, compute_capability=90, input_output_aliases=(),
        zeroed_outputs=(), name="every_kind", constexprs=(("B", 16),),
    )  # fmt: skip
    arrays = [a.array if isinstance(a, HostDescriptor) else a for a in args if _is_operand(a)]
    avals_in = [jax.core.ShapedArray(a.shape, a.dtype) for a in arrays]
    avals_out = [jax.core.ShapedArray(out.shape, out.dtype)]
    types = host_descriptors._kernel_types(launch, avals_in, avals_out)
    constants = dict(host_descriptors._constants(launch))
    signature = {_every_kind.arg_names[i]: t for i, t in enumerate(types)}
    compiled = compile_offline(_every_kind, signature, constants, compute_capability=90)
    metas = kernel_needs.KernelNeeds.from_metadata(compiled.metadata._asdict()).descriptors
    assert len(metas) == 2
    handed = host_descriptors._kernel_parameters(
        _KindsOfParameters(), launch, types, metas, avals_in, avals_out
    )
    assert handed == _ptx_parameter_kinds(compiled.asm["ptx"])
    assert handed == ["ptr", "map", "i32", "i32", "i64", "i64", "i32", "f32",
                      "map", "i32", "i32", "i32", "i64", "i64", "i64", "i8", "ptr"]  # fmt: skip


def _lower_gmm_with_host_descriptors() -> str:
    from jax_bridge import GroupedMatmulConfig, grouped_matmul

    config = GroupedMatmulConfig(64, 64, 128, num_warps=8, tma=True, host_descriptors=True)
    lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def gmm(lhs, rhs, sizes):
        return grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton")

    return lower_for_cuda(gmm, lhs, rhs, sizes, compute_capability=90)


def _lower_varlen_forward_with_host_descriptors() -> str:
    from jax_bridge import AttentionConfigs, AttentionKernelConfig, varlen_attention

    forward = AttentionKernelConfig(128, 128, 8, 2, tma=True, host_descriptors=True)
    q = jax.ShapeDtypeStruct((1024, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1024, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)

    def attention(q, k, v, cu):
        return varlen_attention(q, k, v, cu, cu, causal=True, implementation="triton",
                                config=AttentionConfigs(forward=forward))  # fmt: skip

    return lower_for_cuda(attention, q, k, k, cu, compute_capability=90)


_LOWERINGS = pytest.mark.parametrize(
    "lower, kernel",
    [
        (_lower_gmm_with_host_descriptors, "gmm_kernel"),
        (_lower_varlen_forward_with_host_descriptors, "attention_forward_kernel"),
    ],
    ids=["gmm", "varlen-forward"],
)


@pytest.mark.skipif(
    not host_descriptors_launchable(), reason="jaxlib >= 0.11.2 passes host-side descriptors"
)
@_LOWERINGS
def test_a_kernel_taking_host_descriptors_lowers_for_cuda_without_scratch(
    lower, kernel, monkeypatch
):
    """gmm and the varlen forward with `host_descriptors` lower for an H100 to two Triton
    calls (a schedule kernel and theirs), theirs built without global scratch (no
    descriptor is written on the device) and declaring the two descriptors' maps."""
    built, given_scratch = _record_builds(monkeypatch)
    text = lower()
    assert text.count("@triton_kernel_call") == 2
    args = next(args for name, args in built if name.startswith(kernel))
    assert not any(name.startswith(kernel) for name in given_scratch)
    assert _ptx_parameter_kinds(args[3]).count("map") == 2


def _record_builds(monkeypatch) -> tuple[list, list]:
    """(the (name, args) of every kernel the launch layer builds from now on, the names of
    those it gives global scratch), in a fresh cache of host-descriptor kernels."""
    built, given_scratch = [], []
    real_build = kernel_needs._NeedsPassingLib.TritonKernel
    real_scratch = kernel_needs.kernel_with_scratch

    def building(self, name, *args):
        built.append((name, args))
        return real_build(self, name, *args)

    def with_scratch(lib, name, args, needs):
        given_scratch.append(name)
        return real_scratch(lib, name, args, needs)

    monkeypatch.setattr(kernel_needs._NeedsPassingLib, "TritonKernel", building)
    monkeypatch.setattr(kernel_needs, "kernel_with_scratch", with_scratch)
    host_descriptors._compiled.cache_clear()
    return built, given_scratch


@pytest.mark.skipif(
    not host_descriptors_launchable(), reason="jaxlib >= 0.11.2 passes host-side descriptors"
)
@pytest.mark.parametrize("dq_atomic", [False, True], ids=["dq-kernel", "dq-atomic"])
def test_the_dkdv_kernel_with_host_descriptors_builds_only_its_dq_descriptor(
    dq_atomic, monkeypatch
):
    """The varlen gradient with dK/dV's Q and dO through the launch's descriptors, lowered
    for an H100: the dK/dV kernel declares the two maps and needs no global scratch,
    unless it adds dQ by bulk reductions (`dq_atomic` with `tma`), whose descriptor over
    each sequence's rows it still writes there."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig, varlen_attention

    dkdv = AttentionKernelConfig(64, 128, 8, 2, tma=True, host_descriptors=True)
    config = AttentionConfigs(backward_dkdv=dkdv, dq_atomic=dq_atomic)
    q = jax.ShapeDtypeStruct((1024, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1024, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)

    def loss(q, k, v, cu):
        out = varlen_attention(q, k, v, cu, cu, causal=True, implementation="triton",
                               config=config)  # fmt: skip
        return out.astype(jnp.float32).sum()

    built, given_scratch = _record_builds(monkeypatch)
    lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, cu, compute_capability=90)
    dkdv_kernel = "attention_backward_dkdv"
    args = next(args for name, args in built if name.startswith(dkdv_kernel))
    assert _ptx_parameter_kinds(args[3]).count("map") == 2
    assert any(name.startswith(dkdv_kernel) for name in given_scratch) == dq_atomic


@pytest.mark.skipif(host_descriptors_launchable(), reason="this jaxlib passes them")
@_LOWERINGS
def test_without_jaxlib_support_the_launch_names_what_it_needs(lower, kernel):
    with pytest.raises(NotImplementedError, match=r"host-side tensor descriptors.*0\.11\.2"):
        lower()
