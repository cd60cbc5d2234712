"""Convert between a padded batch ``[batch, seq, ...]`` and a packed token axis ``[T, ...]``.

Each direction is one gather of token rows followed by a select that writes the fill
value; there is no loop over the batch. Index work is O(T log batch) for lengths and
O(batch * seq) for an arbitrary mask (which must be scanned). Sizes that shape an output
are static ints.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.validation import (
    check_cu_seqlens_and_host,
    check_lengths,
    check_mask,
    check_static_int,
    check_token_capacity,
    host_value,
    is_traced,
    naming_op,
    require_all,
)
from jax_bridge.host.cu_seqlens import prepare_cu_seqlens_from_mask, prepare_token_indices

# Private cores are jitted so that eager calls compile one fused program per shape; under
# an outer jit they inline. fill_value is a traced operand so new values never recompile.


@jax.jit
def _cu_seqlens_of_lengths(lengths: jax.Array) -> jax.Array:
    """``[batch] -> [batch + 1]`` int32 offsets with a leading 0."""
    lengths = lengths.astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])


def _gather_rows(rows: jax.Array, source: jax.Array, real: jax.Array, fill_value: Any) -> jax.Array:
    """``rows[source]`` (``[n, ...]``) with the slots where ``real: [n]`` is False set to
    ``fill_value``. Source indices of those slots are arbitrary: they are clipped into range,
    which also keeps inputs whose value checks were dropped under jit from reading out of
    bounds."""
    if rows.shape[0] == 0:  # nothing to gather from; every slot is padding
        return jnp.full((source.shape[0], *rows.shape[1:]), fill_value, rows.dtype)
    gathered = jnp.take(rows, source, axis=0, mode="clip")
    real = real.reshape(real.shape + (1,) * (rows.ndim - 1))
    return jnp.where(real, gathered, jnp.asarray(fill_value, rows.dtype))


@functools.partial(jax.jit, static_argnames=("total_tokens",))
def _pack_by_lengths(
    x: jax.Array, cu_seqlens: jax.Array, fill_value: Any, total_tokens: int
) -> jax.Array:
    # O(total_tokens) index work: each packed slot finds its (row, position) by binary
    # search over cu_seqlens; the tail has row = position = -1.
    row_pos = prepare_token_indices(cu_seqlens, total_tokens)
    source = row_pos[:, 0] * x.shape[1] + row_pos[:, 1]
    flat_x = x.reshape((-1, *x.shape[2:]))
    return _gather_rows(flat_x, source, row_pos[:, 0] >= 0, fill_value)


@functools.partial(jax.jit, static_argnames=("total_tokens",))
def _pack_by_mask(x: jax.Array, mask: jax.Array, fill_value: Any, total_tokens: int) -> jax.Array:
    # An arbitrary mask has to be scanned: O(batch * seq) index work. Row-major flattening
    # keeps batch-then-position order.
    flat_mask = mask.reshape(-1) != 0
    source = jnp.flatnonzero(flat_mask, size=total_tokens, fill_value=0)
    real = jnp.arange(total_tokens) < jnp.sum(flat_mask, dtype=jnp.int32)
    flat_x = x.reshape((-1, *x.shape[2:]))
    return _gather_rows(flat_x, source, real, fill_value)


@functools.partial(jax.jit, static_argnames=("max_len",))
def _unpack(packed: jax.Array, cu_seqlens: jax.Array, fill_value: Any, max_len: int) -> jax.Array:
    batch = cu_seqlens.shape[0] - 1
    position = jnp.arange(max_len, dtype=cu_seqlens.dtype)
    real = position[None, :] < (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    source = cu_seqlens[:-1, None] + position[None, :]
    out = _gather_rows(packed, source.reshape(-1), real.reshape(-1), fill_value)
    return out.reshape((batch, max_len, *packed.shape[1:]))


def _check_fill_value(fill_value: Any) -> None:
    """`fill_value` one scalar (Python, NumPy or a 0-d array, traced or not), as pack and
    unpack document it: a ValueError naming its shape otherwise."""
    if jnp.ndim(fill_value) != 0:
        raise ValueError(f"fill_value must be a scalar, got shape {tuple(jnp.shape(fill_value))}.")


@naming_op("pack")
def pack(
    x: jax.Array,
    lengths_or_mask: Any,
    *,
    total_tokens: int | None = None,
    fill_value: Any = 0,
) -> tuple[jax.Array, jax.Array]:
    """Gather the real tokens of a padded batch into one packed axis.

    Args:
      x: ``[batch, seq, ...]`` padded batch.
      lengths_or_mask: either ``[batch]`` integer lengths (row ``b``'s real tokens are its
        first ``len_b``, ``0 <= len_b <= seq``), or a ``[batch, seq]`` bool/integer mask
        (nonzero = real token; left-, right- or arbitrarily padded). Tokens are packed
        row by row, in their order within the row.
      total_tokens: static length ``T`` of the packed axis, ``>=`` the number of real
        tokens. Default: the exact count when ``lengths_or_mask`` is concrete, else
        ``batch * seq`` (always large enough) when it is traced.
      fill_value: scalar for the slots past the real tokens (may be traced).

    Returns:
      ``packed: [T, ...]`` with ``x``'s dtype (rows from ``cu_seqlens[-1]`` on are
      ``fill_value``) and ``cu_seqlens: [batch + 1]`` int32 describing the real tokens.
      Differentiable w.r.t. ``x``.
    """
    x = jnp.asarray(x)
    _check_fill_value(fill_value)
    if x.ndim < 2:
        raise ValueError(f"x must have shape [batch, seq, ...], got shape {tuple(x.shape)}.")
    batch, seq = x.shape[:2]
    ndim = lengths_or_mask.ndim if is_traced(lengths_or_mask) else np.ndim(lengths_or_mask)
    if ndim == 1:
        lengths = check_lengths(lengths_or_mask, "lengths_or_mask", max_len=seq)
        if lengths.shape[0] != batch:
            raise ValueError(
                f"lengths_or_mask as lengths must have shape ({batch},) to match x, "
                f"got {tuple(lengths.shape)}."
            )
        cu_seqlens = _cu_seqlens_of_lengths(lengths)
    elif ndim == 2:
        mask = check_mask(lengths_or_mask, "lengths_or_mask", shape=(batch, seq))
        cu_seqlens = prepare_cu_seqlens_from_mask(mask)
    else:
        raise ValueError(
            f"lengths_or_mask must be lengths [batch] or a mask [batch, seq], got rank {ndim}."
        )
    # The real tokens, counted on the host where the input is concrete: under an outer
    # jax.jit cu_seqlens is traced even then.
    host = host_value(lengths_or_mask)
    real = None if host is None else int(np.sum(host) if ndim == 1 else np.count_nonzero(host))
    if total_tokens is None:
        total_tokens = batch * seq if real is None else real
    else:
        total_tokens = check_static_int(total_tokens, "total_tokens")
        check_token_capacity(cu_seqlens[-1] if real is None else real, total_tokens, "total_tokens")
    if ndim == 1:
        packed = _pack_by_lengths(x, cu_seqlens, fill_value, total_tokens)
    else:
        packed = _pack_by_mask(x, mask, fill_value, total_tokens)
    return packed, cu_seqlens


@naming_op("unpack")
def unpack(
    packed: jax.Array,
    cu_seqlens: Any,
    batch: int,
    max_len: int,
    *,
    fill_value: Any = 0,
) -> jax.Array:
    """Place packed tokens back into a right-padded batch.

    Args:
      packed: ``[T, ...]`` packed tokens; ``T >= cu_seqlens[-1]``, rows past it are ignored.
      cu_seqlens: ``[batch + 1]`` offsets of the sequences in ``packed``.
      batch: static number of sequences; must equal ``cu_seqlens.shape[0] - 1``.
      max_len: static padded length ``S``; every sequence must have ``len_b <= S``.
      fill_value: scalar for the padding positions (may be traced).

    Returns:
      ``[batch, S, ...]`` with ``out[b, s] = packed[cu_seqlens[b] + s]`` for ``s < len_b``
      and ``fill_value`` elsewhere; ``packed``'s dtype. ``unpack(*pack(x, lengths),
      batch, S)`` equals ``x`` on the real tokens. Differentiable w.r.t. ``packed``.
    """
    packed = jnp.asarray(packed)
    _check_fill_value(fill_value)
    if packed.ndim < 1:
        raise ValueError("packed must have shape [T, ...], got a scalar.")
    # host: a concrete input, so the checks below raise at once even under jax.jit
    cu_seqlens, host = check_cu_seqlens_and_host(cu_seqlens)
    batch = check_static_int(batch, "batch")
    max_len = check_static_int(max_len, "max_len")
    if batch != cu_seqlens.shape[0] - 1:
        raise ValueError(
            f"batch={batch} does not match cu_seqlens of shape {tuple(cu_seqlens.shape)} "
            "(expected batch + 1 entries)."
        )
    cu = cu_seqlens if host is None else host
    check_token_capacity(cu[-1], packed.shape[0], "packed.shape[0]")
    require_all(
        cu[1:] - cu[:-1] <= max_len,
        f"max_len={max_len} is shorter than the longest sequence in cu_seqlens.",
    )
    return _unpack(packed, cu_seqlens, fill_value, max_len)
