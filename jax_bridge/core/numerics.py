"""Small numerics helpers: ceil-division, a -inf-safe log-sum-exp, a zero-safe divide,
a gradient dtype cast, and reshaping an axis into fixed-size chunks."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.validation import (
    check_chunk_size,
    check_static_int,
    host_value,
    naming_op,
    require_all,
)


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division ``ceil(a / b)`` for integers.

    Two Python/numpy ints give a Python int (so it can size static shapes); anything else
    goes through ``jnp`` and broadcasts like ``a // b``. Floats are a TypeError: rounding
    would make the result depend on float precision. A zero divisor is a ValueError (a
    ``checkify`` check where ``b`` is traced).
    """
    scalar_ints = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (a, b))
    if scalar_ints:
        if b == 0:
            raise ValueError("cdiv: divisor b must be non-zero.")
        return -(-int(a) // int(b))
    a_arr, b_arr = jnp.asarray(a), jnp.asarray(b)
    for name, arr in (("a", a_arr), ("b", b_arr)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"cdiv: {name} must be an integer or integer array, got {arr.dtype}.")
    # Checked at once where b is concrete (even under jax.jit), a checkify check if traced.
    host_b = host_value(b)
    require_all(b_arr != 0 if host_b is None else host_b != 0, "cdiv: divisor b must be non-zero.")
    # floor + 1 when inexact; unlike -(-a // b) this is also right for unsigned dtypes.
    quotient, remainder = jnp.divmod(a_arr, b_arr)
    return quotient + (remainder != 0).astype(quotient.dtype)


def _normalize_axes(axis: int | Sequence[int] | None, ndim: int, name: str) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, numbers.Integral):
            raise TypeError(f"{name} must be an int or a tuple of ints, got {axis!r}.")
        if not -ndim <= a < ndim:
            raise ValueError(f"{name}={a} is out of range for an array of rank {ndim}.")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has repeated axes: {axis!r}.")
    return tuple(sorted(out))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _log_sum_exp(x: jax.Array, axes: tuple[int, ...], keepdims: bool) -> jax.Array:
    # `initial` makes an empty reduction give -inf rather than an error.
    row_max = jnp.max(x, axis=axes, keepdims=True, initial=-jnp.inf)
    # A row with no finite maximum (all -inf, or containing +inf) is shifted by 0 instead:
    # subtracting -inf from -inf would produce NaN, while exp(-inf - 0) = 0 gives log(0) = -inf.
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    out = jnp.log(jnp.sum(jnp.exp(x - shift), axis=axes, keepdims=True)) + shift
    return out if keepdims else jnp.squeeze(out, axis=axes)


@_log_sum_exp.defjvp
def _log_sum_exp_jvp(axes, keepdims, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    out = _log_sum_exp(x, axes, True)
    # The derivative is softmax(x) along `axes`. Where the result is not finite there is
    # no meaningful softmax; the weights are 0 there so no NaN can enter a gradient.
    finite = jnp.isfinite(out)
    weights = jnp.where(finite, jnp.exp(x - jnp.where(finite, out, 0.0)), 0.0)
    out_dot = jnp.sum(weights * x_dot, axis=axes, keepdims=True)
    if not keepdims:
        out, out_dot = jnp.squeeze(out, axis=axes), jnp.squeeze(out_dot, axis=axes)
    return out, out_dot


@naming_op("log_sum_exp")
def log_sum_exp(
    x: jax.Array, axis: int | Sequence[int] | None = -1, *, keepdims: bool = False
) -> jax.Array:
    """``log(sum(exp(x), axis))`` that stays finite-safe on masked rows.

    Args:
      x: floating array ``[...]``. 16-bit inputs are reduced in float32.
      axis: axis or axes to reduce (``None``: all).
      keepdims: keep reduced axes with size 1.

    Returns:
      ``x.dtype`` array of ``x``'s shape without (or, with ``keepdims``, size 1 on) ``axis``.
      A row that is entirely -inf (or empty) gives -inf, not NaN. The gradient is
      ``softmax(x)`` on rows with a finite result and exactly 0 on rows whose result is
      ±inf, so fully masked rows never produce NaN gradients.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must have a floating dtype, got {x.dtype}.")
    axes = _normalize_axes(axis, x.ndim, "axis")
    compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
    return _log_sum_exp(x.astype(compute_dtype), axes, bool(keepdims)).astype(x.dtype)


def safe_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """Elementwise ``a / b`` with 0 wherever ``b == 0`` (broadcasting like ``a / b``).

    Neither the value nor the gradient (w.r.t. ``a`` or ``b``) contains NaN for finite
    ``a``: the divisor is replaced by 1 before dividing where it is 0, so the discarded
    branch never computes 0/0 (which would leak NaN into the gradient through ``where``).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    b_is_zero = b == 0
    quotient = a / jnp.where(b_is_zero, jnp.ones_like(b), b)
    return jnp.where(b_is_zero, jnp.zeros_like(quotient), quotient)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _identity_dtype_convert(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x


def _identity_dtype_convert_fwd(x, dtype):
    return x, None


def _identity_dtype_convert_bwd(dtype, _, grad):
    return (grad.astype(dtype),)


_identity_dtype_convert.defvjp(_identity_dtype_convert_fwd, _identity_dtype_convert_bwd)


def identity_dtype_convert(dtype: Any) -> Callable[[jax.Array], jax.Array]:
    """A function that returns its input unchanged and casts its cotangent to ``dtype``.

    Use it to choose the precision a gradient flows back in, e.g. keep the cotangent of a
    bfloat16 activation in float32, or round a float32 cotangent to bfloat16 to halve
    the memory of what is saved/communicated: ``y = identity_dtype_convert(jnp.float32)(x)``.
    The forward value and dtype are untouched.

    Args:
      dtype: a floating dtype for the cotangent.

    Returns:
      ``convert(x)``: ``x: [...]`` floating -> ``x`` (same shape, dtype, values); ``jax.grad``
      through it yields ``dtype`` gradients for ``x`` when nothing between ``x`` and the
      differentiated inputs casts again.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"identity_dtype_convert: dtype must be a floating dtype, got {dtype}.")

    def convert(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        # JAX accepts a cotangent whose dtype differs from its primal only for inexact types.
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"identity_dtype_convert: x must be floating, got {x.dtype}.")
        return _identity_dtype_convert(x, dtype)

    return convert


@naming_op("chunk_array")
def chunk_array(x: jax.Array, chunk_size: int, axis: int = 0, *, fill_value: Any = 0) -> jax.Array:
    """Split ``axis`` of ``x`` into ``[num_chunks, chunk_size]``.

    Args:
      x: ``[..., n, ...]`` with ``n`` at ``axis``.
      chunk_size: static positive int ``C``.
      axis: the axis to split.
      fill_value: pads the end of ``axis`` from ``n`` up to ``num_chunks * C`` when ``C``
        does not divide ``n``; the padding is the tail of the last chunk.

    Returns:
      ``[..., num_chunks, C, ...]`` with ``num_chunks = cdiv(n, C)``; element ``i`` of the
      original axis sits at chunk ``i // C``, offset ``i % C``.
    """
    x = jnp.asarray(x)
    chunk_size = check_chunk_size(chunk_size)
    (axis,) = _normalize_axes(axis, x.ndim, "axis")
    n = x.shape[axis]
    num_chunks = cdiv(n, chunk_size)
    pad = num_chunks * chunk_size - n
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill_value)
    return x.reshape((*x.shape[:axis], num_chunks, chunk_size, *x.shape[axis + 1 :]))


@naming_op("unchunk_array")
def unchunk_array(x: jax.Array, axis: int = 0, length: int | None = None) -> jax.Array:
    """Inverse of :func:`chunk_array`: merge ``[num_chunks, C]`` at ``axis`` and drop padding.

    Args:
      x: ``[..., num_chunks, C, ...]`` with ``num_chunks`` at ``axis``. ``axis`` is read
        against the *unchunked* rank ``x.ndim - 1``, so the same ``axis`` value (negative
        ones included) round-trips with :func:`chunk_array`.
      length: static number of leading elements to keep on the merged axis (the original
        ``n``); ``None`` keeps all ``num_chunks * C`` including padding.

    Returns:
      ``[..., length, ...]``; ``unchunk_array(chunk_array(x, C, a), a, x.shape[a]) == x``.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"unchunk_array: x must have rank >= 2, got shape {tuple(x.shape)}.")
    (axis,) = _normalize_axes(axis, x.ndim - 1, "axis")
    num_chunks, chunk_size = x.shape[axis], x.shape[axis + 1]
    merged = x.reshape((*x.shape[:axis], num_chunks * chunk_size, *x.shape[axis + 2 :]))
    if length is None:
        return merged
    length = check_static_int(length, "length")
    if length > num_chunks * chunk_size:
        raise ValueError(
            f"length={length} exceeds the {num_chunks} * {chunk_size} elements on axis {axis}."
        )
    return jax.lax.slice_in_dim(merged, 0, length, axis=axis)
