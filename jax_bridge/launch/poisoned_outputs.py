"""Outputs that start poisoned: NaN (floating), the dtype's minimum (integer), True (bool).

Triton's interpreter path always starts a kernel's outputs so (`triton_call`), so that a
kernel which forgets to write an element shows it. On a GPU an output starts as whatever
its fresh buffer held, often zeros, which is also what a fully masked row must give: a
kernel that skips such a row passes a GPU test by luck. Within `poisoned_outputs()` the
GPU path starts those outputs poisoned too: each becomes an input of the launch, filled by
XLA, which the output aliases. It costs a fill pass over each such output a call: for
tests, never for timing.

Outputs that start zeroed (`zeroed_outputs`) or as an input (`input_output_aliases`) are
left as they are: the kernel relies on them.

jax_triton 0.4 binds an output's initial value to the output's own parameter (a
`jax.Ref`, as it does for zeroed outputs). jax_triton 0.3 gives every aliased input a
parameter of its own, ahead of the outputs, so under 0.3 the kernel is launched through a
wrapper (`with_ignored_pointers`) that takes those extra pointers and calls the kernel
without them; Triton inlines the call.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

_poisoning = jax.make_user_context(False)  # part of jit's cache key


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True) -> Iterator[None]:
    """Within: on a GPU, the outputs of kernels launched by functions traced inside (jit
    caches them apart) start poisoned, as on Triton's interpreter, where they always do."""
    with _poisoning(bool(enabled)):
        yield


def poisoning_outputs() -> bool:
    """True within `poisoned_outputs()`."""
    return bool(_poisoning.value)


def poison_value(dtype: Any) -> Any:
    """What an output element of `dtype` starts as: NaN (floating, complex), the dtype's
    minimum (integer), True (bool)."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):  # jnp knows bfloat16 is floating; np does not
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).min


def poisoned_host_array(shape: jax.ShapeDtypeStruct) -> np.ndarray:
    """A host array of `shape` filled with its dtype's `poison_value`."""
    return np.full(shape.shape, poison_value(shape.dtype), np.dtype(shape.dtype))


def poisoned_array(shape: jax.ShapeDtypeStruct) -> jax.Array:
    """A JAX array of `shape` filled with its dtype's `poison_value`."""
    return jnp.full(shape.shape, poison_value(shape.dtype), shape.dtype)


def as_ignored_inputs(
    kernel: triton.JITFunction,
    args: Sequence[Any],
    input_output_aliases: dict[int, int],
    initial_outputs: dict[int, jax.Array],
) -> tuple[triton.JITFunction, tuple[Any, ...], dict[int, int]]:
    """(kernel, args, aliases) of a launch whose outputs start as `initial_outputs`
    (output index: array) where every aliased input is a parameter of its own (jax_triton
    0.3, and the launches of host-side descriptors): each array is an input after `args`,
    aliased by its output, which the kernel takes through `with_ignored_pointers`."""
    if not initial_outputs:
        return kernel, tuple(args), dict(input_output_aliases)
    aliases = {**input_output_aliases, **{len(args) + j: o for j, o in enumerate(initial_outputs)}}
    kernel = with_ignored_pointers(kernel, len(args), len(initial_outputs))
    return kernel, (*args, *initial_outputs.values()), aliases


@functools.cache
def with_ignored_pointers(
    kernel: triton.JITFunction, num_inputs: int, num_ignored: int
) -> triton.JITFunction:
    """A kernel that takes `kernel`'s first `num_inputs` parameters, then `num_ignored`
    pointers it never reads, then the rest of `kernel`'s parameters (outputs, constexprs
    with their defaults), and calls `kernel` with all but the ignored ones.

    Triton builds a JIT function from its source, so the wrapper's source is generated and
    registered with `linecache` under a name of its own (Triton reads it once, here).
    """
    if not isinstance(kernel, triton.JITFunction):
        raise TypeError(f"with_ignored_pointers: kernel must be a triton.jit function: {kernel!r}")
    names = [p.name for p in kernel.params]
    if any(p.is_constexpr for p in kernel.params[:num_inputs]):
        raise ValueError(f"{kernel.__name__}: a constexpr among its first {num_inputs} parameters")
    ignored = [f"ignored_pointer_{i}" for i in range(num_ignored)]
    if clash := {*ignored, "inner_kernel"} & set(names):
        raise ValueError(f"{kernel.__name__}: parameters {sorted(clash)} clash with the wrapper's")
    scope: dict[str, Any] = {"inner_kernel": kernel, "tl": tl}
    declared = []
    for p in kernel.params:
        if not p.is_constexpr:
            declared.append(p.name)
        elif p.has_default:
            scope[f"default_{p.name}"] = p.default
            declared.append(f"{p.name}: tl.constexpr = default_{p.name}")
        else:
            declared.append(f"{p.name}: tl.constexpr")
    declared[num_inputs:num_inputs] = ignored
    passed = [p.name if not p.is_constexpr else f"{p.name}={p.name}" for p in kernel.params]
    name = f"{kernel.__name__}_poisoned"
    source = f"def {name}({', '.join(declared)}):\n    inner_kernel({', '.join(passed)})\n"
    # Named by what it wraps, not by a counter: the name is in the TTIR, which keys the
    # PTX cache across processes.
    wrapped = f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"
    filename = f"<ragged-kernels wrapper of {wrapped}, {num_inputs} inputs, {num_ignored} ignored>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), scope)
    wrapper = scope[name]
    wrapper.__module__ = kernel.fn.__module__
    return triton.jit(wrapper)
