"""Host-side tensor descriptors: Hopper's bulk tensor copies (TMA) with descriptors the
launch encodes once, instead of each program writing its own to global memory.

A kernel that calls `tl.make_tensor_descriptor` builds the descriptor on the device, in
every program: 128 bytes written to its global scratch, then a proxy fence before the
first copy may read them (and the launch allocates that scratch, `kernel_needs`). A kernel
can instead take a descriptor as a parameter (Triton's host `TensorDescriptor`): the
compiled kernel then receives the 128-byte `CUtensorMap` by value (a grid constant),
followed by the tensor's shape (int32 a dimension) and row strides (int64 a dimension),
and nothing is written or fenced on the device. jaxlib's Triton call encodes such a
descriptor over an operand's buffer at launch (`create_tma_descriptor_parameter`, from
jaxlib 0.11.2), with what Triton's compile metadata says of it (`tensordesc_meta`: the
swizzle, the element type, the box), as Triton's own launcher does.

`HostDescriptor(array, block_shape)` marks a `triton_call` argument so: the kernel's
parameter is then a tensor descriptor over the whole array, loading `block_shape` tiles,
reading 0 past its ends. On Triton's interpreter it is Triton's host `TensorDescriptor`
over the array; on a GPU the call lowers through this module's primitive, which builds
jaxlib's kernel call itself (jax_triton types every array operand as a pointer), and which
`host_descriptors_launchable()` says the installed jaxlib can launch.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir, xla

from jax_bridge.launch.interpreter import no_interpreted_launch
from jax_bridge.launch.jax_triton_compat import is_array_operand, python_scalar
from jax_bridge.launch.kernel_needs import needs_of, pass_kernel_needs
from triton_kernels.config import descriptor_type

# Triton's metadata numbers a descriptor's element type as its device-side code does;
# the host's CUtensorMapDataType, which jaxlib encodes, numbers three of them otherwise:
# bfloat16 (10 there, 9 here), float64 (9, 8) and float32 flushing to zero (8, 10).
_HOST_ELEMENT_TYPE = {8: 10, 9: 8, 10: 9}
_OOB_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements past the tensor read 0


@dataclasses.dataclass(frozen=True, eq=False)
class HostDescriptor:
    """A `triton_call` argument the kernel takes as a tensor descriptor over all of
    `array` (row-major), loading `[block_shape]` boxes; elements past its ends read 0.

    Attributes:
      array: a JAX (or NumPy) array of rank 1 to 5, every dimension at least 1; its rows
        (the last dimension) must span a multiple of 16 bytes where it has more than one.
      block_shape: the box a load reads, one power of two per dimension (at most 256),
        its rows (the last) a multiple of 16 bytes.
    """

    array: Any
    block_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape, block = tuple(self.array.shape), tuple(self.block_shape)
        object.__setattr__(self, "block_shape", block)
        if not 1 <= len(shape) <= 5 or len(block) != len(shape):
            raise ValueError(
                f"HostDescriptor: an array of rank 1 to 5 and a block_shape of its rank, got "
                f"shape {shape} and block_shape {block}"
            )
        if min(shape) < 1:
            raise ValueError(f"HostDescriptor: every dimension at least 1, got shape {shape}")
        if any(not isinstance(b, int) or b < 1 or b > 256 or b & (b - 1) for b in block):
            raise ValueError(f"HostDescriptor: block_shape of powers of two up to 256, got {block}")
        itemsize = np.dtype(self.array.dtype).itemsize
        if len(shape) > 1 and shape[-1] * itemsize % 16:
            raise ValueError(
                f"HostDescriptor: rows of shape[-1] elements must span a multiple of 16 "
                f"bytes, got {shape[-1] * itemsize} ({shape[-1]} x "
                f"{np.dtype(self.array.dtype).name})"
            )
        if block[-1] * itemsize % 16:
            raise ValueError(
                f"HostDescriptor: a box's rows must span a multiple of 16 bytes, got "
                f"block_shape[-1] = {block[-1]} of {itemsize}-byte elements"
            )


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= int(size)
    return tuple(reversed(strides))


def interpreter_descriptor(array: np.ndarray, block_shape: Sequence[int]) -> Any:
    """Triton's host `TensorDescriptor` over a C-contiguous host array, as Triton's
    interpreter takes it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from jax_bridge.launch.interpreter import HostTensor

    return TensorDescriptor(
        HostTensor(array), list(array.shape), list(row_major_strides(array.shape)),
        list(block_shape),
    )  # fmt: skip


@functools.cache
def host_descriptors_launchable() -> bool:
    """Whether the installed jaxlib's Triton call takes host-side tensor descriptors (on a
    GPU; Triton's interpreter always does)."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return False
    return hasattr(gpu_triton, "create_tma_descriptor_parameter")


# ----------------------------------------------------------------------- the GPU launch

_call_p = Primitive("ragged_kernels_triton_descriptor_call")
_call_p.multiple_results = True
_call_p.def_impl(functools.partial(xla.apply_primitive, _call_p))


@_call_p.def_abstract_eval
def _abstract_eval(*_: Any, out_shapes: tuple[jax.ShapeDtypeStruct, ...], **__: Any):
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes]


@dataclasses.dataclass(frozen=True)
class _Launch:
    """The static part of one launch (the primitive's parameter): the kernel's inputs are
    `num_inputs` values, of which `scalars` (position, value) are baked in and
    `descriptors` (position, block shape) are tensor descriptors over array operands; the
    other inputs are array operands too, in order; then one pointer per output."""

    kernel: Any
    num_inputs: int
    scalars: tuple[tuple[int, Any], ...]
    descriptors: tuple[tuple[int, tuple[int, ...]], ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    compute_capability: int
    input_output_aliases: tuple[tuple[int, int], ...]  # (array operand, output)
    zeroed_outputs: tuple[int, ...]
    name: str
    constexprs: tuple[tuple[str, Any], ...]


def call_with_descriptors(
    args: Sequence[Any],
    *,
    kernel: Any,
    out_shapes: tuple[jax.ShapeDtypeStruct, ...],
    grid: tuple[int, ...],
    num_warps: int,
    num_stages: int,
    compute_capability: int | None,
    input_output_aliases: dict[int, int],
    zeroed_outputs: tuple[int, ...],
    name: str,
    constexprs: dict[str, Any],
) -> tuple[jax.Array, ...]:
    """Launches `kernel` on a GPU (or lowers it for one) with `args` as `triton_call`
    takes them, `HostDescriptor`s among them; `input_output_aliases` count `args`."""
    if not host_descriptors_launchable():
        raise NotImplementedError(
            f"Triton kernel {name!r} takes host-side tensor descriptors, which this "
            "jaxlib's Triton call cannot pass (create_tma_descriptor_parameter: jaxlib >= "
            "0.11.2)"
        )
    if compute_capability is None or compute_capability < 90:
        # Before Hopper Triton turns descriptors into pointers, with other parameters.
        raise ValueError(
            f"{name}: host-side tensor descriptors need a Hopper or later NVIDIA GPU (sm_90+), "
            f"not {compute_capability}"
        )
    args = [python_scalar(a, keep_float32=True) for a in args]  # as jax_triton 0.3 types them
    arrays, operand = [], {}
    for i, a in enumerate(args):
        if is_array_operand(a):
            operand[i] = len(arrays)
            arrays.append(a.array if isinstance(a, HostDescriptor) else a)
    launch = _Launch(
        kernel=kernel,
        num_inputs=len(args),
        scalars=tuple((i, a) for i, a in enumerate(args) if i not in operand),
        descriptors=tuple(
            (i, a.block_shape) for i, a in enumerate(args) if isinstance(a, HostDescriptor)
        ),
        out_shapes=out_shapes,
        grid=(*grid, *(1,) * (3 - len(grid))),
        num_warps=num_warps,
        num_stages=num_stages,
        compute_capability=compute_capability,
        input_output_aliases=tuple((operand[i], o) for i, o in input_output_aliases.items()),
        zeroed_outputs=tuple(zeroed_outputs),
        name=name,
        constexprs=tuple(sorted(constexprs.items())),
    )
    return tuple(_call_p.bind(*arrays, launch=launch, out_shapes=out_shapes))


def _kernel_types(launch: _Launch, avals_in: Sequence[Any], avals_out: Sequence[Any]) -> list[str]:
    """The Triton types of the kernel's parameters, inputs then outputs."""
    from jax_triton.triton_lib import get_triton_type

    scalars, blocks = dict(launch.scalars), dict(launch.descriptors)
    operands = iter(avals_in)
    types = []
    for i in range(launch.num_inputs):
        if i in scalars:
            types.append(get_triton_type(scalars[i]))
        elif i in blocks:
            pointer = get_triton_type(next(operands))  # "*bf16"
            types.append(descriptor_type(pointer.removeprefix("*"), blocks[i]))
        else:
            types.append(get_triton_type(next(operands)))
    return types + [get_triton_type(a) for a in avals_out]


def _constants(launch: _Launch) -> tuple[tuple[str, Any], ...]:
    """The kernel's compile-time constants: its constexprs and, as jax_triton specializes
    them, the scalars equal to 1 (which are then no parameter)."""
    ones = tuple((launch.kernel.arg_names[i], 1) for i, v in launch.scalars if v == 1)
    return (*launch.constexprs, *ones)


@functools.cache
def _compiled(
    kernel: Any, types: tuple[str, ...], constants: tuple[tuple[str, Any], ...],
    num_warps: int, num_stages: int, compute_capability: int, platform: str,
) -> Any:  # fmt: skip
    """jaxlib's kernel object of `kernel` with parameters of `types` ("constexpr" for the
    `constants`), built as jax_triton builds one (its TTIR-to-PTX step, which the launch
    layer wraps: PTX cache, warps, scratch, descriptors' metadata), but for its
    specialization: jax_triton's takes every operand for a pointer. Arrays are taken as
    16-byte aligned (XLA's buffers are), as jax_triton does."""
    from jax_triton import triton_lib
    from triton._C import libtriton
    from triton.compiler import code_generator, compiler

    fn = kernel
    backend = triton_lib.get_cuda_backend(0, compute_capability)
    options = backend.parse_options({
        "num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1,
        "optimize_epilogue": False, "debug": False, "enable_fp_fusion": True,
    })  # fmt: skip
    aligned = backend.parse_attr("D")
    signature = {fn.arg_names[i]: t for i, t in enumerate(types)}
    attrs = {(i,): aligned for i, t in enumerate(types) if t.startswith("*")}
    signature.update(dict.fromkeys(dict(constants), "constexpr"))
    with no_interpreted_launch():
        context = libtriton.ir.context()
        libtriton.ir.load_dialects(context)
        backend.load_dialects(context)
        source = compiler.ASTSource(
            fn, constexprs=dict(constants), signature=signature, attrs=attrs
        )
        module = code_generator.ast_to_ttir(
            fn, source, options=options, codegen_fns=backend.get_codegen_implementation(options),
            context=context, module_map=backend.get_module_map(),
        )  # fmt: skip
        ttir = str(module)
        result = triton_lib.compile_ttir_inplace(
            module, backend, options, compute_capability, platform
        )
    return triton_lib.triton_kernel_call_lib.TritonKernel(
        result.name, num_warps, 1, result.shared_mem_bytes, result.binary, ttir,
        compute_capability,
    )  # fmt: skip


def _descriptor_parameters(lib: Any, meta: dict[str, Any], shape: Sequence[int]) -> list[Any]:
    """jaxlib's parameters of one descriptor over a row-major array of `shape`: the
    encoded map (taking the operand's buffer), then the shape (int32) and the row strides
    (int64), as the compiled kernel declares them."""
    if meta.get("fp4_padded") or meta.get("is_im2col"):
        raise NotImplementedError(f"a host-side descriptor of this kind: {meta}")
    strides = row_major_strides(shape)
    element = int(meta["elem_type"])
    encoded = lib.create_tma_descriptor_parameter(
        elem_type=_HOST_ELEMENT_TYPE.get(element, element), swizzle=int(meta["swizzle"]),
        shape=[int(s) for s in shape], strides=list(strides),
        block_shape=[int(b) for b in meta["block_size"]], oob_fill=_OOB_ZERO,
    )  # fmt: skip
    return [
        encoded,
        *(lib.create_scalar_parameter(int(s), "i32") for s in shape),
        *(lib.create_scalar_parameter(int(s), "i64") for s in strides),
    ]


def _plain(value: Any, kind: str) -> bool | int | float:
    """A scalar as the Python type jaxlib's parameter of Triton type `kind` takes."""
    if kind == "B":
        return bool(value)
    return float(value) if kind.startswith("fp") else int(value)


def _kernel_parameters(
    lib: Any, launch: _Launch, types: list[str], descriptors: Sequence[dict],
    avals_in: Sequence[Any], avals_out: Sequence[Any],
) -> list[Any]:  # fmt: skip
    """jaxlib's parameters of the launch, in the kernel's order (jax_triton's rules for
    arrays and scalars: an int equal to 1 is a constant, not a parameter)."""
    scalars, blocks = dict(launch.scalars), dict(launch.descriptors)
    if len(descriptors) != len(blocks):
        raise RuntimeError(
            f"{launch.name}: the compiled kernel has {len(descriptors)} descriptor "
            f"parameters, the launch {len(blocks)}"
        )
    metas, operands = iter(descriptors), iter([*avals_in, *avals_out])
    num_in = launch.num_inputs
    params = []
    for i, kind in enumerate(types):
        if i in scalars:
            if scalars[i] != 1:
                params.append(lib.create_scalar_parameter(_plain(scalars[i], kind), kind))
        elif i in blocks:
            params += _descriptor_parameters(lib, next(metas), next(operands).shape)
        else:
            aval = next(operands)
            zeroed = i >= num_in and i - num_in in launch.zeroed_outputs
            size = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize if zeroed else 0
            params.append(lib.create_array_parameter(size, 16))  # as `_compiled` assumes
    return params


def _lowering(ctx: Any, *arrays: Any, launch: _Launch, out_shapes: Any) -> Any:
    from jax_triton import triton_lib

    del out_shapes  # the launch's own
    pass_kernel_needs()
    types = _kernel_types(launch, ctx.avals_in, ctx.avals_out)
    kernel = _compiled(
        launch.kernel, tuple(types), _constants(launch), launch.num_warps, launch.num_stages,
        launch.compute_capability, ctx.module_context.platforms[0],
    )  # fmt: skip
    needs = needs_of(kernel)
    if needs is None:
        raise RuntimeError(f"{launch.name}: no record of what the compiled kernel needs")
    lib = triton_lib.triton_kernel_call_lib
    params = _kernel_parameters(lib, launch, types, needs.descriptors, ctx.avals_in, ctx.avals_out)
    call = lib.TritonKernelCall(kernel, *launch.grid, params)
    rule = jax.ffi.ffi_lowering(
        "triton_kernel_call", api_version=2,
        backend_config=zlib.compress(call.to_proto(launch.name, b"")),
        operand_output_aliases=dict(launch.input_output_aliases),
    )  # fmt: skip
    return rule(ctx, *arrays)


mlir.register_lowering(_call_p, _lowering, platform="cuda")
