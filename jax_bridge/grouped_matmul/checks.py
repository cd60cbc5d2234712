"""Argument checks for `grouped_matmul` and `transposed_grouped_matmul`.

Shapes, ranks and dtypes are checked at trace time. Values (`group_sizes`,
`group_offset`) are checked now when they are concrete; when traced they become
`checkify` checks (see `jax_bridge.core.validation`), dropped under a plain `jax.jit`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.validation import as_int32, check_array, is_traced, require, require_all
from jax_bridge.grouped_matmul.metadata import group_ends
from triton_kernels.grouped_matmul.config import check_tiling

TilingArg = tuple[int, int, int] | Callable[[int, int, int], tuple[int, int, int] | None] | None


def check_operands(lhs: Any, rhs: Any, *, lhs_doc: str, rhs_doc: str) -> None:
    """Ranks from the shape docs (e.g. "[m, k]"), floating dtypes, and one dtype for both."""
    check_array("lhs", lhs, lhs_doc, floating=True)
    check_array("rhs", rhs, rhs_doc, floating=True)
    if lhs.dtype != rhs.dtype:
        raise TypeError(
            f"lhs and rhs must have the same dtype, got lhs {lhs.dtype} and rhs {rhs.dtype}; "
            "cast one of them."
        )


def check_dimension(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: {what} is {actual}, but must be {expected}.")


def check_preferred_element_type(dtype: Any, operand_dtype: Any = None) -> np.dtype:
    """The result dtype: a floating dtype, or None for the default.

    None means the operands' dtype promoted to at least float32, because products
    accumulate in float32 (bf16 operands give float32, float64 operands under x64 give
    float64); without `operand_dtype`, float32, the public default. (`jnp.dtype(None)` is
    float64, which is why None must not reach it.)
    """
    if dtype is None:
        if operand_dtype is None:
            return np.dtype(np.float32)
        return np.dtype(jnp.promote_types(jnp.float32, operand_dtype))
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"preferred_element_type must be a dtype, got {dtype!r}.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"preferred_element_type must be a floating dtype, got {dtype}.")
    return dtype


def check_triton_dtypes(op: str, operand_dtype: Any, out_dtype: Any) -> None:
    """The Triton kernels multiply 16- and 32-bit floats only: float64 is a TypeError.

    (Triton's float64 dot is unsupported on the GPU and silently wrong through the
    interpreter.) The XLA implementation supports float64 under `jax_enable_x64`.
    """
    for what, dtype in (("operands", operand_dtype), ("preferred_element_type", out_dtype)):
        if np.dtype(dtype) == np.float64:
            raise TypeError(
                f'{op}: float64 is unsupported on the Triton path (implementation="triton"), '
                f'got {what} of dtype {np.dtype(dtype)}; use implementation="xla" or float32.'
            )


# The Triton kernels index within one group's weights ([k, n]) in int32; row and group
# offsets are int64.
MAX_TRITON_GROUP_ELEMENTS = 2**31 - 1


def check_triton_group_elements(op: str, k: int, n: int) -> None:
    """ValueError where one group's [k, n] weights (or weight gradient) hold more elements
    than the Triton kernels index in int32 (`MAX_TRITON_GROUP_ELEMENTS`)."""
    if k * n > MAX_TRITON_GROUP_ELEMENTS:
        raise ValueError(
            f"{op}: one group's weights are k x n = {k} x {n} = {k * n} elements, more than "
            f"the Triton kernels index within a group ({MAX_TRITON_GROUP_ELEMENTS}); use "
            'implementation="xla", or split n.'
        )


def check_group_offset(
    group_offset: Any, *, num_groups: int, num_groups_total: int
) -> jax.Array | None:
    """None, or the offset as an int32 scalar; `0 <= offset <= total - num_groups`.

    Accepts a Python int or an integer array of shape () or (1,), possibly traced.
    """
    if group_offset is None:
        return None
    if isinstance(group_offset, bool):
        raise TypeError("group_offset must be an int or an int32 scalar array, got a bool.")
    if isinstance(group_offset, numbers.Integral):
        offset = np.int32(group_offset)
    else:
        offset = group_offset if is_traced(group_offset) else np.asarray(group_offset)
        if not jnp.issubdtype(offset.dtype, jnp.integer):
            raise TypeError(f"group_offset must have an integer dtype, got {offset.dtype}.")
        if offset.shape not in ((), (1,)):
            raise ValueError(f"group_offset must be a scalar or shape (1,), got {offset.shape}.")
        offset = offset.reshape(())
    limit = num_groups_total - num_groups
    require(
        (offset >= 0) & (offset <= limit),
        f"group_offset must lie in [0, {limit}] (len(group_sizes) - num_groups).",
    )
    return jnp.asarray(offset, jnp.int32)


def check_group_sizes(
    group_sizes: Any, *, m: int, num_groups: int, has_offset: bool, m_of: str = "the rows of lhs",
    groups_of: str = "rhs",
) -> jax.Array:  # fmt: skip
    """int32 [num_groups_total] (== num_groups without an offset), >= 0, sum <= m
    (`m_of`: where m is, `groups_of`: what holds num_groups, for the messages)."""
    sizes = group_sizes if is_traced(group_sizes) else np.asarray(group_sizes)
    if sizes.ndim != 1:
        raise ValueError(
            f"group_sizes must have shape [num_groups_total], got shape {tuple(sizes.shape)}."
        )
    # Lists and int64 sizes (e.g. from jnp.bincount under x64) convert when they fit.
    sizes = as_int32(sizes, "group_sizes")
    if has_offset:
        if sizes.shape[0] < num_groups:
            raise ValueError(
                f"group_sizes has {sizes.shape[0]} groups, fewer than the {num_groups} "
                f"groups of {groups_of}."
            )
    elif sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes must have one entry per group ({num_groups}), got {sizes.shape[0]} "
            f"(pass group_offset when {groups_of} holds a slice of the groups)."
        )
    require_all(sizes >= 0, "group_sizes must be non-negative.")
    if is_traced(sizes):
        # An int32 sum wraps (two sizes near 2**31 add up to a small one); summed by
        # `group_ends`, saturating at m + 1, it cannot, and it passes m only if the sum does
        # (m + 1 kept in int32: for an lhs of 2**31 - 1 rows a sum past m goes unseen).
        total = group_ends(sizes, min(m + 1, 2**31 - 1))[-1]
    else:
        total = np.sum(sizes, dtype=np.int64)
    require(total <= m, f"group_sizes must sum to at most {m}, {m_of}.")
    return jnp.asarray(sizes)


def check_groups(
    group_sizes: Any, group_offset: Any, *, m: int, num_groups: int, m_of: str = "the rows of lhs",
    groups_of: str = "rhs",
) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """(group_sizes as int32 [num_groups_total], group_offset as an int32 scalar or None);
    `m_of` and `groups_of` as `check_group_sizes`'."""
    sizes = check_group_sizes(
        group_sizes, m=m, num_groups=num_groups, has_offset=group_offset is not None, m_of=m_of,
        groups_of=groups_of,
    )  # fmt: skip
    offset = check_group_offset(
        group_offset, num_groups=num_groups, num_groups_total=sizes.shape[0]
    )
    return sizes, offset


def check_existing_out(existing_out: Any, *, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if existing_out is None:
        return
    if tuple(existing_out.shape) != tuple(shape):
        raise ValueError(
            f"existing_out must have shape {tuple(shape)}, got {tuple(existing_out.shape)}."
        )
    if existing_out.dtype != dtype:
        raise TypeError(
            f"existing_out must have dtype preferred_element_type ({dtype}), "
            f"got {existing_out.dtype}."
        )


def check_tiling_arg(tiling: Any) -> None:
    """A tuple is checked now; a callable when it is called (`resolve_tiling`)."""
    if tiling is None or callable(tiling):
        return
    check_tiling(tiling)


def resolve_tiling(tiling: TilingArg, m: int, k: int, n: int) -> tuple[int, int, int] | None:
    """The tiling to use for sizes (m, k, n); None lets the launch configuration choose.
    A callable's bad answer is refused naming the call that gave it."""
    if not callable(tiling):
        return None if tiling is None else check_tiling(tiling)
    answer = tiling(m, k, n)
    if answer is None:
        return None
    try:
        return check_tiling(answer)
    except (TypeError, ValueError) as err:
        raise type(err)(f"tiling({m}, {k}, {n}) returned {answer!r}: {err}") from None
