"""One launch function over `jax_triton` 0.3 and 0.4, whose `triton_call` APIs differ.

`pyproject.toml` accepts any `jax-triton>=0.3.1`, and pip serves 0.4 on Python >= 3.12.
The package keeps jax_triton 0.3's calling convention (`call_jax_triton` below); this shim
maps it onto whichever version is installed, deciding once, from the installed version.

What differs (0.3.1 -> 0.4.0):

* `out_shape=` is renamed `out_type=` (the old name is deprecated).
* `input_output_aliases=` and `zeroed_outputs=` are deprecated in favour of `jax.Ref`
  arguments (`jax.new_ref`), which the kernel mutates in place and which are not part of
  `out_type`.
* The kernel's parameters changed under aliasing: in 0.3 every output, aliased or not, has
  its own pointer parameter after the inputs; in 0.4 an aliased output has none (the
  input's buffer is used directly), so a 0.3 kernel cannot be launched with 0.4 aliases.
* In 0.3 the input index of `input_output_aliases` counts array operands only (scalars
  before it shift it); in 0.4 it counts all operands. Here it always counts `args`.
* Python `float` scalars were fp64 in 0.3 and are fp32 (when representable) in 0.4;
  `np.float32` scalars are fp32 in both but deprecated in 0.4 (passed as `float` there).

On 0.4 each output the kernel must find initialised becomes a `Ref` bound, by parameter
name, to that output's pointer parameter: a zeroed output starts as zeros; an aliased output
starts as a copy of its input. The input's own pointer then still sees the unmodified input,
whereas in 0.3 both pointers share one buffer: kernels that read through the input pointer
what they wrote through the output pointer are not supported (none here do). An output that
is both aliased and zeroed has no single meaning across versions and is rejected.

An output may also start as a given array (`initial_outputs`: poisoned outputs, for
tests): on 0.4 its Ref starts as that array; on 0.3 the array is an input the output
aliases, which the kernel takes as an extra pointer parameter after its inputs, through a
wrapper that ignores it (`poisoned_outputs.with_ignored_pointers`).

`jax_triton` is imported lazily: it does not import against a CPU-only jaxlib.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.launch.kernel_needs import pass_kernel_needs
from jax_bridge.launch.poisoned_outputs import as_ignored_inputs

Grid = int | tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


@functools.cache
def jax_triton_api_version() -> tuple[int, int] | None:
    """The installed jax-triton's (major, minor), or None when it is not installed."""
    try:
        version = importlib.metadata.version("jax-triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"cannot parse the jax-triton version {version!r}")
    return int(match[1]), int(match[2])


def python_scalar(arg: Any, *, keep_float32: bool) -> Any:
    """NumPy scalars as the Python scalars jax_triton types (it would take them for arrays)."""
    if isinstance(arg, np.float32) and keep_float32:
        return arg
    if isinstance(arg, np.generic) and arg.ndim == 0:
        return arg.item()
    return arg


def is_array_operand(arg: Any) -> bool:
    """Whether a launch argument is an array (or a descriptor of one), not a scalar."""
    return not isinstance(arg, bool | int | float | np.generic)


def _check(
    args: tuple[Any, ...],
    n_outputs: int,
    input_output_aliases: dict[int, int],
    zeroed_outputs: tuple[int, ...],
    initial_outputs: dict[int, jax.Array],
) -> None:
    for arg_index, out_index in input_output_aliases.items():
        if not 0 <= arg_index < len(args) or not is_array_operand(args[arg_index]):
            raise ValueError(f"input_output_aliases: argument {arg_index} is not an array input")
        if not 0 <= out_index < n_outputs:
            raise ValueError(f"input_output_aliases: there is no output {out_index}")
    if len(set(input_output_aliases.values())) != len(input_output_aliases):
        raise ValueError("input_output_aliases: two inputs alias the same output")
    if any(not 0 <= i < n_outputs for i in zeroed_outputs):
        raise ValueError(f"zeroed_outputs {zeroed_outputs}: there are {n_outputs} outputs")
    if both := set(zeroed_outputs) & set(input_output_aliases.values()):
        raise ValueError(f"outputs {sorted(both)} are both aliased and zeroed")
    if any(not 0 <= i < n_outputs for i in initial_outputs):
        raise ValueError(f"initial_outputs {sorted(initial_outputs)}: {n_outputs} outputs")
    if both := set(initial_outputs) & {*zeroed_outputs, *input_output_aliases.values()}:
        raise ValueError(f"outputs {sorted(both)} start as given and aliased or zeroed")


def call_jax_triton(
    *args: Any,
    kernel: Any,
    out_shapes: tuple[jax.ShapeDtypeStruct, ...],
    grid: Grid,
    num_warps: int,
    num_stages: int,
    compute_capability: int | None,
    input_output_aliases: dict[int, int],
    zeroed_outputs: tuple[int, ...],
    name: str,
    initial_outputs: dict[int, jax.Array] | None = None,
    **constexprs: Any,
) -> tuple[jax.Array, ...]:
    """Launches `kernel` through the installed jax_triton with 0.3 semantics.

    The kernel's parameters are `args` (arrays and scalars) in order, then one pointer per
    entry of `out_shapes`, then the `constexprs`. `input_output_aliases` maps an index into
    `args` to an output index: that output starts as the input (on 0.3 it shares its
    buffer). Outputs in `zeroed_outputs` start as zeros, those in `initial_outputs` (output
    index: array of its shape) as the array given. Returns one array per output.
    """
    version = jax_triton_api_version()
    if version is None:
        raise ImportError("launching Triton kernels from JAX on a GPU needs jax-triton")
    initial_outputs = dict(initial_outputs or {})
    _check(args, len(out_shapes), input_output_aliases, zeroed_outputs, initial_outputs)
    # Neither version passes a kernel's own warp count, nor 0.3 its global scratch.
    pass_kernel_needs()
    launch = _launch_v03 if version < (0, 4) else _launch_v04
    options = dict(
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        compute_capability=compute_capability,
        name=name,
    )
    return launch(
        args, kernel, out_shapes, input_output_aliases, zeroed_outputs, initial_outputs,
        options, constexprs,
    )  # fmt: skip


def _launch_v03(
    args: tuple[Any, ...],
    kernel: Any,
    out_shapes: tuple[jax.ShapeDtypeStruct, ...],
    input_output_aliases: dict[int, int],
    zeroed_outputs: tuple[int, ...],
    initial_outputs: dict[int, jax.Array],
    options: dict[str, Any],
    constexprs: dict[str, Any],
) -> tuple[jax.Array, ...]:
    import jax_triton

    # 0.3 passes an aliased input as a parameter of its own.
    kernel, args, input_output_aliases = as_ignored_inputs(
        kernel, args, input_output_aliases, initial_outputs
    )
    args = tuple(python_scalar(a, keep_float32=True) for a in args)
    # 0.3 counts only array operands in the input index of an alias.
    array_index = {i: sum(map(is_array_operand, args[:i])) for i in input_output_aliases}
    outs = jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=out_shapes,
        input_output_aliases={array_index[i]: o for i, o in input_output_aliases.items()},
        zeroed_outputs=tuple(zeroed_outputs),
        **options,
        **constexprs,
    )
    return tuple(outs)


def _pointer_params(kernel: Any) -> list[str]:
    """Names of the kernel's non-constexpr parameters (through Autotuner/Heuristics)."""
    fn = kernel
    while not hasattr(fn, "params"):
        fn = fn.fn
    return [p.name for p in fn.params if not p.is_constexpr]


def _launch_v04(
    args: tuple[Any, ...],
    kernel: Any,
    out_shapes: tuple[jax.ShapeDtypeStruct, ...],
    input_output_aliases: dict[int, int],
    zeroed_outputs: tuple[int, ...],
    initial_outputs: dict[int, jax.Array],
    options: dict[str, Any],
    constexprs: dict[str, Any],
) -> tuple[jax.Array, ...]:
    import jax_triton

    params = _pointer_params(kernel)
    if len(params) != len(args) + len(out_shapes):
        raise ValueError(
            f"kernel {params} takes {len(params)} non-constexpr parameters, but "
            f"{len(args)} inputs and {len(out_shapes)} outputs were given"
        )
    refs = {o: jax.new_ref(jnp.asarray(args[i])) for i, o in input_output_aliases.items()}
    for o in zeroed_outputs:
        refs[o] = jax.new_ref(jnp.zeros(out_shapes[o].shape, out_shapes[o].dtype))
    for o, initial in initial_outputs.items():
        refs[o] = jax.new_ref(initial)
    out_params = params[len(args) :]
    outs = iter(
        jax_triton.triton_call(
            *(python_scalar(a, keep_float32=False) for a in args),
            kernel=kernel,
            out_type=tuple(s for o, s in enumerate(out_shapes) if o not in refs),
            **options,
            **{out_params[o]: ref for o, ref in refs.items()},
            **constexprs,
        )
    )
    return tuple(refs[o][...] if o in refs else next(outs) for o in range(len(out_shapes)))
