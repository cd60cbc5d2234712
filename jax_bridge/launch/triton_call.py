"""The one function through which every op launches a Triton kernel from JAX.

`triton_call` follows `jax_triton.triton_call`: the kernel's parameters are the array and
scalar inputs in call order, then one pointer per output, then the constexprs. Where it
runs is `jax_bridge.launch.target.launch_target()`'s decision:

* on a GPU (or while lowering for cuda from any machine) it calls `jax_triton`, through
  `jax_triton_compat` (jax_triton 0.3 and 0.4 differ), imported lazily because
  `jax_triton` does not import against a CPU-only jaxlib;
* otherwise it runs the same kernel through Triton's interpreter inside
  `jax.pure_callback`, so ops work under `jax.jit` and `jax.grad` on a CPU.

On the interpreter path, outputs start as NaN (floating) or the dtype's minimum
(integer), never zero, so that a kernel which forgets to write an element shows it;
like on a GPU, only `zeroed_outputs` start at zero and aliased outputs start as their input.
On a GPU they start so within `poisoned_outputs()` (for tests: it costs a fill a call).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton

from jax_bridge.core.vma import varying_like
from jax_bridge.launch.host_callbacks import running_on_host
from jax_bridge.launch.host_descriptors import (
    HostDescriptor,
    call_with_descriptors,
    interpreter_descriptor,
)
from jax_bridge.launch.interpreter import run_interpreted
from jax_bridge.launch.poisoned_outputs import (
    as_ignored_inputs,
    poisoned_array,
    poisoned_host_array,
    poisoning_outputs,
)
from jax_bridge.launch.target import launch_target

Grid = int | tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


def float32_or_placeholder(x: jax.Array | None) -> jax.Array:
    """An optional float operand (sinks, ALiBi slopes) as float32, or, when absent, a
    1-element placeholder for a pointer the kernel reads only behind a constexpr flag."""
    return jnp.zeros((1,), jnp.float32) if x is None else jnp.asarray(x, jnp.float32)


def _value_key(value: Any) -> Any:
    """`value` as part of a launch key: scalars by type and exact repr (`1`, `1.0`
    and `True` are equal in Python, `0.0` and `-0.0` too, yet give different kernels),
    tuples item by item, functions and kernels by identity (a JITFunction's own hash walks
    its dependencies), anything else as itself."""
    if isinstance(value, bool | int | float | str | np.generic):
        return (type(value), repr(value))
    if isinstance(value, tuple | list):
        return (type(value), tuple(_value_key(v) for v in value))
    if callable(value):
        return ("identity", id(value))
    return value


def _grid_of(grid: Grid, constexprs: dict[str, Any]) -> tuple[int, ...]:
    """The launch grid as a tuple of ints (`grid` may be a function of the constexprs)."""
    if callable(grid):
        grid = grid(constexprs)
    return tuple(int(g) for g in (grid if isinstance(grid, tuple | list) else (grid,)))


# CUDA's largest grid: x up to 2**31 - 1 blocks, y and z up to 65535.
CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)


def _check_cuda_grid(grid: tuple[int, ...], name: str) -> None:
    """ValueError, at trace time, for a grid the GPU would refuse at run time (there
    `cuLaunchKernel` fails with CUDA_ERROR_INVALID_VALUE; the interpreter takes any)."""
    for axis, (size, limit) in enumerate(zip(grid, CUDA_GRID_LIMITS, strict=False)):
        if size > limit:
            raise ValueError(
                f"{name}: launch grid {grid} has {size} programs on axis {axis}, past "
                f"CUDA's limit of {limit} there (the op's arguments size that axis: split "
                "the call, e.g. the batch, into smaller ones)."
            )


@dataclasses.dataclass(frozen=True, eq=False)
class _HostLaunch:
    """The interpreter-path callback of one `triton_call`; called with its arrays, launches.

    Compared and hashed by what it launches (kernel, grid, output shapes, baked-in
    scalars, constexprs), so that eager calls with equal launches give equal
    `pure_callback` parameters and reuse JAX's compiled program for the primitive instead
    of compiling a new one per call. Holding the kernel and constexprs keeps the objects
    keyed by identity alive, so their ids cannot be reused by another object.

    grid: the launch grid as ints (a grid function is applied to the constexprs first: a
    fresh lambda per call must not make every launch a new one).

    scalars: (position, value) of each Python scalar among the kernel's inputs; the
    arrays travel through the callback and fill the other positions in order.

    descriptors: (position, block shape) of each input the kernel takes as a tensor
    descriptor over its array (`HostDescriptor`).
    """

    kernel: triton.JITFunction
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    grid: tuple[int, ...]
    scalars: tuple[tuple[int, Any], ...]
    num_inputs: int
    zeroed_outputs: tuple[int, ...]
    input_output_aliases: tuple[tuple[int, int], ...]
    constexprs: dict[str, Any]
    descriptors: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @functools.cached_property
    def _key(self) -> Any:
        key = (
            _value_key(self.kernel),
            self.out_shapes,
            self.grid,
            _value_key(self.scalars),
            self.descriptors,
            self.num_inputs,
            self.zeroed_outputs,
            self.input_output_aliases,
            tuple((name, _value_key(v)) for name, v in sorted(self.constexprs.items())),
        )
        try:
            hash(key)
        except TypeError:  # an unhashable constexpr: equal to itself only
            return ("identity", id(self))
        return key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostLaunch) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __call__(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        with running_on_host():  # Python's exit waits for it
            return self._launch(*arrays)

    def _launch(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        given = iter(np.ascontiguousarray(a) for a in arrays)
        scalars = dict(self.scalars)
        args = [scalars[i] if i in scalars else next(given) for i in range(self.num_inputs)]
        args = [a.item() if isinstance(a, np.generic) else a for a in args]
        outputs = [poisoned_host_array(s) for s in self.out_shapes]
        for i in self.zeroed_outputs:
            outputs[i][...] = 0
        # As on a GPU, an aliased input and its output are one buffer: a kernel reading
        # the input where another program has stored the output reads the stored value.
        for arg_index, out_index in self.input_output_aliases:
            outputs[out_index][...] = args[arg_index]
            args[arg_index] = outputs[out_index]
        for i, block_shape in self.descriptors:
            args[i] = interpreter_descriptor(args[i], block_shape)
        run_interpreted(self.kernel, self.grid, args, outputs, self.constexprs)
        return tuple(outputs)


def triton_call(
    *args: jax.Array | int | float | bool,
    kernel: triton.JITFunction,
    out_shape: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    grid: Grid,
    num_warps: int = 4,
    num_stages: int = 2,
    input_output_aliases: dict[int, int] | None = None,
    zeroed_outputs: Sequence[int] = (),
    name: str = "",
    **constexprs: Any,
) -> Any:
    """Launches `kernel` on `args`, returning its outputs as JAX arrays.

    Args:
      *args: the kernel's inputs in parameter order: JAX arrays (any shape; the kernel
        sees a pointer to their row-major data), `HostDescriptor`s of JAX arrays (the
        kernel sees a tensor descriptor over the array; on a GPU where
        `host_descriptors_launchable()`) and Python `int`/`float`/`bool` scalars.
      kernel: a `@triton.jit` function taking inputs, then output pointers, then constexprs.
      out_shape: one `jax.ShapeDtypeStruct` (the result is then one array) or a sequence
        of them (the result is then a tuple).
      grid: launch grid: an int, up to three ints, or a function of the constexprs
        (called with them alone, once a call: an autotuner's values never reach it).
      num_warps, num_stages: GPU launch configuration (ignored by the interpreter).
      input_output_aliases: {input index: output index}: the output starts as that input
        (on the GPU it shares its buffer); indices count `args` positions.
      zeroed_outputs: indices of outputs that start at zero.
      name: a label for the kernel call in the lowered program.
      **constexprs: values of the kernel's `tl.constexpr` parameters.

    A kernel call has no derivative of its own (neither `jax_triton`'s primitive nor
    `pure_callback` can be differentiated): ops make it differentiable with a
    `jax.custom_vjp` whose backward launches the backward kernels.
    """
    single = not isinstance(out_shape, Sequence)
    out_shapes = tuple(
        jax.ShapeDtypeStruct(s.shape, s.dtype) for s in ((out_shape,) if single else out_shape)
    )
    aliases = _checked_aliases(args, out_shapes, input_output_aliases)
    # A tuple of ints on both paths: it is a parameter of the launch, on which eager calls'
    # compiled programs are cached (a fresh grid lambda a call compiled every call anew).
    grid = _grid_of(grid, constexprs)
    # Arrays travel through the call (and are what vmap batches); scalars are baked in.
    is_scalar = [isinstance(a, bool | int | float | np.floating | np.integer) for a in args]
    descriptors = tuple(
        (i, a.block_shape) for i, a in enumerate(args) if isinstance(a, HostDescriptor)
    )
    blocks = dict(descriptors)
    arrays = [
        a.array if i in blocks else a
        for i, (a, scalar) in enumerate(zip(args, is_scalar, strict=True))
        if not scalar
    ]

    def rebuild(given: Sequence[Any]) -> list[Any]:
        given = iter(given)
        return [
            a if scalar else HostDescriptor(next(given), blocks[i]) if i in blocks else next(given)
            for i, (a, scalar) in enumerate(zip(args, is_scalar, strict=True))
        ]

    if launch_target().on_gpu:
        _check_cuda_grid(grid, name or kernel.__name__)
        launch = functools.partial(
            _gpu_launch,
            rebuild=rebuild,
            kernel=kernel,
            out_shapes=out_shapes,
            grid=grid,
            num_warps=num_warps,
            num_stages=num_stages,
            input_output_aliases=aliases,
            zeroed_outputs=tuple(zeroed_outputs),
            name=name or kernel.__name__,
            constexprs=constexprs,
        )
        outs = _batched_by_loop(launch)(*arrays)
    else:
        callback = _HostLaunch(
            kernel=kernel,
            out_shapes=out_shapes,
            grid=grid,
            scalars=tuple((i, a) for i, a in enumerate(args) if is_scalar[i]),
            num_inputs=len(args),
            zeroed_outputs=tuple(zeroed_outputs),
            input_output_aliases=tuple(aliases.items()),
            constexprs=constexprs,
            descriptors=descriptors,
        )
        outs = jax.pure_callback(callback, out_shapes, *arrays, vmap_method="sequential")
    return _typed_like_inputs(outs, args, single)


def _checked_aliases(
    args: Sequence[Any],
    out_shapes: tuple[jax.ShapeDtypeStruct, ...],
    input_output_aliases: dict[int, int] | None,
) -> dict[int, int]:
    """`input_output_aliases` as a dict, each naming an array argument of its output's
    shape (TypeError, ValueError otherwise)."""
    aliases = dict(input_output_aliases or {})
    for arg_index, out_index in aliases.items():
        if not isinstance(args[arg_index], jax.Array | np.ndarray):
            raise TypeError(f"input_output_aliases: argument {arg_index} is not an array")
        if args[arg_index].shape != out_shapes[out_index].shape:
            raise ValueError(
                f"input_output_aliases: argument {arg_index} has shape {args[arg_index].shape} "
                f"but output {out_index} has shape {out_shapes[out_index].shape}"
            )
    return aliases


def _gpu_launch(*arrays: jax.Array, rebuild, constexprs, **launch: Any) -> tuple[jax.Array, ...]:
    from jax_bridge.launch.jax_triton_compat import call_jax_triton

    target = launch_target()
    args = rebuild(arrays)
    initial_outputs = _poisoned_initial_outputs(**launch)
    if not any(isinstance(a, HostDescriptor) for a in args):
        return tuple(
            call_jax_triton(
                *args,
                compute_capability=target.compute_capability,
                initial_outputs=initial_outputs,
                **launch,
                **constexprs,
            )
        )
    launch["kernel"], args, launch["input_output_aliases"] = as_ignored_inputs(
        launch["kernel"], args, launch["input_output_aliases"], initial_outputs
    )
    return call_with_descriptors(
        args, compute_capability=target.compute_capability, constexprs=constexprs, **launch
    )


def _poisoned_initial_outputs(
    *,
    out_shapes: tuple[jax.ShapeDtypeStruct, ...],
    input_output_aliases: dict[int, int],
    zeroed_outputs: tuple[int, ...],
    **_: Any,
) -> dict[int, jax.Array]:
    """Within `poisoned_outputs()`: every output the kernel need not find initialised,
    poisoned (output index: array); otherwise none."""
    if not poisoning_outputs():
        return {}
    kept = {*zeroed_outputs, *input_output_aliases.values()}
    return {o: poisoned_array(s) for o, s in enumerate(out_shapes) if o not in kept}


def _batched_by_loop(launch: Callable[..., tuple[jax.Array, ...]]) -> Callable[..., Any]:
    """`launch` with a batching rule: under `jax.vmap`, one launch per batch element.

    jax_triton's kernel call has no batching rule of its own; a loop (`lax.map`) is always
    right, and ops that want one wide launch fold the batch into their token axis instead.
    """
    batched = jax.custom_batching.custom_vmap(launch)

    @batched.def_vmap
    def _rule(axis_size: int, in_batched: list[bool], *arrays: jax.Array):
        def one(i: jax.Array) -> tuple[jax.Array, ...]:
            return launch(*(a[i] if b else a for a, b in zip(arrays, in_batched, strict=True)))

        outs = jax.lax.map(one, jnp.arange(axis_size))
        return outs, (True,) * len(outs)

    return batched


def _typed_like_inputs(outs: Sequence[jax.Array], args: Sequence[Any], single: bool) -> Any:
    """The kernel's outputs, varying (inside shard_map) along every axis an input varies on.

    Neither `pure_callback` nor jax_triton's call knows that its results are computed from
    its (per-device) inputs, and types them invariant. Left so, shard_map's autodiff would
    keep one device's copy of a kernel output saved for the backward, and a custom_vjp
    would not sum a replicated input's per-device cotangents.
    """
    arrays = (a.array if isinstance(a, HostDescriptor) else a for a in args)
    outs = varying_like(tuple(outs), *(a for a in arrays if isinstance(a, jax.Array)))
    return outs[0] if single else outs
