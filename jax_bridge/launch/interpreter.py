"""Runs a `@triton.jit` kernel on host numpy arrays through Triton's interpreter.

Triton's interpreter expects torch-like tensors. `HostTensor` is the smallest adapter
over a numpy array that satisfies it: the data already lives on the host, so the
device<->host staging calls are no-ops and the kernel reads and writes the numpy buffer
in place through `data_ptr()`.

bfloat16 arithmetic is made to match a GPU here, in one place, for every kernel: the
interpreter stores bfloat16 as raw uint16 bits, so its `tl.dot` multiplies bit patterns,
and it truncates float32 -> bfloat16 casts where the GPU rounds to nearest even
(`cvt.rn.bf16.f32`). During a launch `tl.dot` sees bfloat16 operands as the float32
values they hold (exact: a float32 product of two bfloat16 values is exact, which is
what the tensor cores compute) and the casts round to nearest even. float32 operands
are multiplied as the tensor cores take them at the dot's `input_precision`: "ieee"
exactly, "tf32" with their 13 low mantissa bits dropped (the tensor core's truncation,
the coarser of the two roundings a GPU may apply), "tf32x3" as Triton's F32DotTC pass
splits them (a rounded TF32 part and a TF32 remainder, three products), so that a call at
`Precision.DEFAULT` or `HIGH` is as accurate here as on the device, not more.

Scalars used as Python integers (a loaded row count as a `range` bound) work on every
Triton we support: see `_language_patched_once`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import triton
import triton.experimental.gluon
import triton.language as tl
from triton._C.libtriton import ir as triton_ir
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from jax_bridge.launch import program_conflicts
from jax_bridge.launch.builder_patches import builder_patched

# Triton imports gluon lazily the first time it specialises a tensor argument, and gluon
# asserts at import that `tl`'s helpers are JITFunctions; importing it above, before any
# swap below, keeps that assertion true.

# numpy dtype name -> Triton element type of the pointer the kernel sees.
_TRITON_DTYPES: dict[str, tl.dtype] = {
    "float16": tl.float16,
    "bfloat16": tl.bfloat16,
    "float32": tl.float32,
    "float64": tl.float64,
    "int8": tl.int8,
    "int16": tl.int16,
    "int32": tl.int32,
    "int64": tl.int64,
    "uint8": tl.uint8,
    "uint16": tl.uint16,
    "uint32": tl.uint32,
    "uint64": tl.uint64,
    "bool": tl.int1,
}


def triton_dtype(dtype: Any) -> tl.dtype:
    """The Triton element type for a numpy/JAX dtype."""
    name = np.dtype(dtype).name
    if name not in _TRITON_DTYPES:
        raise TypeError(f"no Triton element type for dtype {name}")
    return _TRITON_DTYPES[name]


class HostTensor:
    """A numpy array dressed as the tensor Triton's interpreter launches on."""

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("HostTensor needs a C-contiguous array")
        self.array = array
        self.dtype = triton_dtype(array.dtype)

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> HostTensor:
        return self

    def cpu(self) -> HostTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *_args, **_kwargs) -> HostTensor:
        return self

    def set_(self, *_args) -> HostTensor:
        return self

    def copy_(self, _other) -> HostTensor:
        return self


# Keyed by the Python function: hashing a JITFunction walks its dependencies, which
# fails while some of them are swapped for interpretable copies.
_interpreted: dict[Callable[..., Any], InterpretedFunction] = {}
# The interpreter keeps global state (grid index, patched language): one launch at a time.
_launch_lock = threading.Lock()


@contextlib.contextmanager
def no_interpreted_launch() -> Iterator[None]:
    """Within: no kernel runs in Triton's interpreter in this process. An interpreted
    launch patches `triton.language` (its tensors' operators among it) for as long as it
    runs, and JAX runs the interpreter's callbacks on threads of its own, so an op still
    in flight can be interpreting while this thread compiles a kernel for a GPU: Triton's
    code generator would then meet the patched language (an error such as "'block_argument'
    object has no attribute 'dtype'"). What compiles a kernel for a GPU holds this
    (`report.compile_offline`, jax_triton's kernel build once `pass_kernel_needs` ran)."""
    with _launch_lock:
        yield


def interpreted(kernel: triton.JITFunction) -> InterpretedFunction:
    """An interpretable copy of `kernel`, cached per kernel."""
    if kernel.fn not in _interpreted:
        _interpreted[kernel.fn] = InterpretedFunction(kernel.fn)
    return _interpreted[kernel.fn]


@contextlib.contextmanager
def _device_functions_interpreted(*kernels: triton.JITFunction) -> Iterator[None]:
    """Swaps every `@triton.jit` function the kernel can reach for an interpretable copy.

    Without `TRITON_INTERPRET=1` at import time, helper functions (a project's own and
    Triton's `tl.max`, `tl.sum`, ...) stay compiled-only `JITFunction`s, which refuse to be
    called from interpreted code. The swap covers the namespaces (module dicts) of the
    kernel, of every reachable helper and of `triton.language`, and is undone on exit so
    the same kernels still compile for a GPU in this process.
    """
    # An interpreted *device* function patches `triton.language` for the interpreter and
    # never undoes it, which would break later GPU compilation in this process: every
    # language namespace is snapshotted here and restored on exit.
    language = [tl, tl.core, tl.math, tl.standard, tl.core.tensor, tl.core.dtype]
    language += [
        getattr(tl.core, n) for n in ("condition", "tensor_descriptor_base") if hasattr(tl.core, n)
    ]
    snapshots = [(obj, dict(vars(obj))) for obj in language]
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    seen: set[int] = set()
    pending = [k.fn.__globals__ for k in kernels] + [vars(tl), vars(tl.standard), vars(tl.math)]
    while pending:
        namespace = pending.pop()
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        for name, value in list(namespace.items()):
            if isinstance(value, triton.JITFunction):
                swapped.append((namespace, name, value))
                namespace[name] = interpreted(value)
                pending.append(value.fn.__globals__)
    try:
        yield
    finally:
        for namespace, name, value in reversed(swapped):
            namespace[name] = value
        for obj, saved in snapshots:
            _restore_attributes(obj, saved)


def _restore_attributes(obj: Any, saved: dict[str, Any]) -> None:
    # Names the interpreter added stay: its cached rewritten functions look them up.
    current = vars(obj)
    for name, value in saved.items():
        if current.get(name) is not value:
            setattr(obj, name, value)


def _as_float32(handle: Any) -> np.ndarray:
    """The values of an interpreter tensor, bfloat16 bit patterns decoded to float32."""
    if handle.dtype.scalar == tl.bfloat16:
        return handle.data.view(ml_dtypes.bfloat16).astype(np.float32)
    return handle.data


def tf32_truncated(x: np.ndarray) -> np.ndarray:
    """float32 values with their 13 low mantissa bits dropped (TF32's 10 remain), as a
    tensor core reads a float32 operand; non-finite values kept as they are."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32) & np.uint32(0xFFFFE000)
    return np.where(np.isfinite(x), bits.view(np.float32), x)


def _tf32_rounded(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32, nearest with ties away from zero (`cvt.rna.tf32`)."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32) + np.uint32(0x1000)
    return np.where(np.isfinite(x), (bits & np.uint32(0xFFFFE000)).view(np.float32), x)


def _float32_product(a: np.ndarray, b: np.ndarray, precision: str) -> np.ndarray:
    """a @ b in float32 as the tensor cores compute it at `precision` ("IEEE", "TF32",
    "TF32X3"; anything else is exact)."""
    if precision == "TF32":
        return np.matmul(tf32_truncated(a), tf32_truncated(b))
    if precision == "TF32X3":
        # Triton's split: big = rna(x), small = x - big; the two small products first, a
        # NaN among them (an infinite operand's small part is inf - inf) taken as 0, then
        # big x big.
        a_big, b_big = _tf32_rounded(a), _tf32_rounded(b)
        with np.errstate(invalid="ignore"):
            a_small, b_small = tf32_truncated(a - a_big), tf32_truncated(b - b_big)
            small = np.matmul(a_small, b_big) + np.matmul(a_big, b_small)
        return np.where(np.isnan(small), 0.0, small) + np.matmul(a_big, b_big)
    return np.matmul(a, b)


def _gpu_dot(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        scalars = (a.dtype.scalar, b.dtype.scalar)
        if tl.bfloat16 in scalars:
            product = np.matmul(_as_float32(a), _as_float32(b), dtype=d.data.dtype)
        elif scalars == (tl.float32, tl.float32):
            product = _float32_product(a.data, b.data, input_precision.name.upper())
        else:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        return triton_interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    return create_dot


def _round_to_bfloat16(original: Callable[..., Any]) -> Callable[..., Any]:
    def cast(self, src, dst_type, *rest):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(ml_dtypes.bfloat16).view(np.uint16)  # nearest even
            return triton_interpreter.TensorHandle(bits, tl.bfloat16)
        return original(self, src, dst_type, *rest)

    return cast


def _descriptor_reduce(self, kind, desc, value, indices):
    """A tensor descriptor's `atomic_add` (Hopper's bulk tensor reduction), which the
    interpreters of Triton 3.6 and 3.9 lack: element-wise atomic adds of `value` into the
    descriptor's block at `indices`, its elements outside the descriptor's shape left
    alone, as the copy engine leaves them. Other reductions are not needed here."""
    if kind != triton_ir.DESCRIPTOR_REDUCE_KIND.ADD:
        raise NotImplementedError(f"interpreted descriptor reduction {kind} (only ADD)")
    pointers, inside = desc.materialize_pointers(indices)
    element = value.dtype.scalar
    add = triton_ir.ATOMIC_OP.FADD if element.is_floating() else triton_ir.ATOMIC_OP.ADD
    if not isinstance(inside, triton_interpreter.TensorHandle):  # Triton 3.6: an array
        inside = triton_interpreter.TensorHandle(inside, tl.int1)
    relaxed, gpu = triton_ir.MEM_SEMANTIC.RELAXED, triton_ir.MEM_SYNC_SCOPE.GPU
    return self.create_atomic_rmw(add, pointers, value, inside, relaxed, gpu)


@contextlib.contextmanager
def _gpu_arithmetic() -> Iterator[None]:
    """Within: the interpreter's bfloat16 and float32 dots and its float32 -> bfloat16
    casts act like a GPU's, it adds through tensor descriptors, and its arithmetic on IEEE
    special values raises no floating-point warning, as on a GPU (numpy's `errstate`: it
    would warn of each NaN or Inf an input holds, from every op it passes through; a
    reduction of a row that is all NaN still warns, from numpy's own `warnings`)."""
    builder = triton_interpreter.InterpreterBuilder
    # `create_fp_trunc` and friends are lambdas calling `self.cast_impl`: patched with it.
    patches = {
        "create_dot": _gpu_dot(builder.create_dot),
        "cast_impl": _round_to_bfloat16(builder.cast_impl),
        "create_fp_to_fp": _round_to_bfloat16(builder.create_fp_to_fp),
        "create_descriptor_reduce": _descriptor_reduce,
    }
    with builder_patched(patches), np.errstate(all="ignore"):
        yield


def run_interpreted(
    kernel: triton.JITFunction,
    grid: tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]],
    args: Sequence[np.ndarray | int | float | bool],
    outputs: Sequence[np.ndarray],
    constexprs: dict[str, Any],
) -> None:
    """Runs `kernel[grid](*args, *outputs, **constexprs)` on the CPU, writing `outputs` in place.

    Args:
      kernel: a `@triton.jit` function whose parameters are the inputs, then the outputs,
        then the constexprs.
      grid: launch grid, or a function of the constexprs returning it.
      args: host arrays (C-contiguous), Triton `TensorDescriptor`s over `HostTensor`s
        and Python scalars, in parameter order.
      outputs: preallocated host arrays the kernel writes.
      constexprs: values of the kernel's `tl.constexpr` parameters.
    """
    if callable(grid):
        grid = grid(constexprs)
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple | list) else (grid,)))
    if any(g == 0 for g in grid):
        return
    wrap = lambda a: HostTensor(a) if isinstance(a, np.ndarray) else a
    launch_args = [wrap(a) for a in args] + [HostTensor(o) for o in outputs]
    # A device function passed as a constexpr (a user's predicate) is called from
    # interpreted code too: it and what it reaches are swapped like the kernel's helpers.
    functions = [v for v in constexprs.values() if isinstance(v, triton.JITFunction)]
    constexprs = {
        name: interpreted(v) if isinstance(v, triton.JITFunction) else v
        for name, v in constexprs.items()
    }
    with (
        _launch_lock,
        _device_functions_interpreted(kernel, *functions),
        _gpu_arithmetic(),
        _language_patched_once(),
        _conflicts_checked(kernel, args, outputs),
    ):
        interpreted(kernel)[grid](*launch_args, **constexprs)


def _conflicts_checked(
    kernel: triton.JITFunction, args: Sequence[Any], outputs: Sequence[np.ndarray]
) -> contextlib.AbstractContextManager[None]:
    """`program_conflicts.checked_launch` over the launch's outputs, where checking is on."""
    if not program_conflicts.checking():
        return contextlib.nullcontext()
    # The outputs' parameter names as the kernel spells them (placeholders past its list).
    names = [*kernel.arg_names[len(args) :], *(f"output {i}" for i in range(len(outputs)))]
    buffers = [program_conflicts.Buffer(names[i], o) for i, o in enumerate(outputs)]
    # A descriptor's loads read its base array, an input like any other.
    bases = [a.base.array if isinstance(a, TensorDescriptor) else a for a in args]
    inputs = [
        program_conflicts.Buffer(name, a)
        for name, a in zip(kernel.arg_names, bases, strict=False)
        if isinstance(a, np.ndarray)
    ]
    return program_conflicts.checked_launch(kernel.fn.__name__, buffers, inputs)


def _index_of_scalar(self: tl.core.tensor) -> int:
    return int(self.handle.data.item())


@contextlib.contextmanager
def _language_patched_once() -> Iterator[None]:
    """Within: `triton.language` is patched for the interpreter once per launch, and a
    scalar tensor converts to a Python int as a GPU's loop bound would.

    Once: Triton's interpreter re-installs its language patches at every interpreted
    device-function call (`inspect.getmembers` over five namespaces, about a quarter of
    an attention kernel's interpreted run) and never undoes the nested ones. The patches
    are the same each time and `_device_functions_interpreted` restores every namespace
    when the launch ends, so a call whose language modules (`tl`, `tl.core`) are already
    patched in this launch skips it; its result was never used.

    Scalars: the interpreter holds every scalar (a program id, a loaded value) as a numpy
    array of shape [1]. Triton 3.6 converts one to an int (`range(start, end)` with
    runtime bounds) by `int(array)`, which numpy 2.5 refuses for any array of ndim > 0 (a
    deprecation since numpy 1.25); later Triton squeezes first. The conversion is set
    right after Triton's patches, through Triton's own patch scope, which restores it
    when the launch ends. For a size-1 array both spellings give the same int.
    """
    original = triton_interpreter._patch_lang
    patched: set[int] = set()

    def patch_lang(fn: Callable[..., Any]) -> Any:
        languages = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and languages <= patched:
            return None  # a device-function call: the launch's own scope restores
        patched.update(languages)
        scope = original(fn)
        scope.set_attr(tl.core.tensor, "__index__", _index_of_scalar)
        return scope

    triton_interpreter._patch_lang = patch_lang
    try:
        yield
    finally:
        triton_interpreter._patch_lang = original
