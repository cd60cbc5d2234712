"""Clear refusals where JAX's own autodiff error would not name the op.

`first_order_only`: where an op's derivative cannot itself be differentiated.

An op's backward pass runs kernels (a Triton call, a `while_loop` with a data-dependent
trip count) that JAX cannot differentiate again. Left alone, `jax.grad` of a gradient
fails deep inside JAX with a message about `pure_callback` or `while_loop`;
`first_order_only` makes it fail at once with one that names the op.

`refuse_forward_mode`: where forward mode (`jax.jvp`) reaches a `custom_vjp` op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.interpreters.ad import JVPTracer


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


def refuse_forward_mode(op: str, *args: Any, works: str, why: str | None = None) -> None:
    """A NotImplementedError naming `op` when an argument carries a forward-mode tangent.

    The ops are `custom_vjp` functions, which JAX cannot push a tangent through; left
    alone, `jax.jvp` / `jax.jacfwd` / `jax.hessian` fail with JAX's generic "can't apply
    forward-mode autodiff (jvp) to a custom_vjp function". Call this with the op's array
    arguments before the custom_vjp (and in its forward rule, which forward-over-reverse
    reaches with tangent-carrying residuals). `jax.grad` / `jax.vjp` pass different tracers
    and are not affected. `works` says what the user can do instead, `why` why not (by
    default: `op` is a custom_vjp). A jvp of an already `jax.jit`-ed function never runs
    this Python and still gets JAX's message.
    """
    if any(isinstance(x, JVPTracer) for x in args):
        why = why or f"{op} defines its derivative for reverse mode only (a custom_vjp)"
        raise NotImplementedError(
            f"{op}: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian, which is "
            f"jacfwd of jacrev) is not supported: {why}. {works}"
        )
