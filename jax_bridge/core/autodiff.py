"""A clear refusal where an op's derivative cannot itself be differentiated.

An op's backward pass runs kernels (a Triton call, a `while_loop` with a data-dependent
trip count) that JAX cannot differentiate again. Left alone, `jax.grad` of a gradient
fails deep inside JAX with a message about `pure_callback` or `while_loop`;
`first_order_only` makes it fail at once with one that names the op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def first_order_only(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    """`fn` unchanged, except that differentiating it raises a NotImplementedError naming `op`.

    Wrap an op's backward computation with it: a first-order gradient never
    differentiates the backward, a second-order one (grad of grad, `jax.hessian`) does.
    All arguments of `fn` must be arrays (or None); bind static ones first.
    """

    @jax.custom_jvp
    def wrapped(*args: Any) -> Any:
        return fn(*args)

    @wrapped.defjvp
    def _refuse(primals, tangents):
        raise NotImplementedError(
            f"{op}: higher-order derivatives are not supported: the gradient of {op} "
            "cannot itself be differentiated (grad of grad, jax.hessian, jacfwd of grad). "
            "First-order jax.grad / jax.vjp are supported."
        )

    return functools.wraps(fn)(wrapped)
