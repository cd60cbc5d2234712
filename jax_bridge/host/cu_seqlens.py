"""Index helpers for packed variable-length sequences described by ``cu_seqlens``.

Conventions shared by every function here:

* ``cu_seqlens: [batch + 1]`` integer offsets starting at 0 and non-decreasing (checked by
  :func:`jax_bridge.core.validation.check_cu_seqlens`); sequence ``i`` owns packed tokens
  ``[cu_seqlens[i], cu_seqlens[i + 1])``. Empty sequences are legal and own no tokens or
  chunks.
* Outputs have the integer dtype of ``jnp.asarray(cu_seqlens)``.
* **Static sizes.** Outputs whose length depends on values take it as a static int:
  ``total_tokens`` (length of the packed token axis, ``>= cu_seqlens[-1]``) and
  ``num_chunks``. Calls on a concrete ``cu_seqlens`` (eager, or a constant a jitted
  function closes over) may omit them and get the exact size; traced calls (``jax.jit``
  with ``cu_seqlens`` an argument) must pass them or get a ValueError. Slots past the
  real tokens/chunks are filled with ``FILL_INDEX`` (-1).
* Everything is vectorised (scatter-adds, ``cumsum``, gathers), with no loop over sequences
  and no ``while`` in the compiled program: ``jnp.searchsorted``'s default method is a
  loop that, on a GPU, waits on the host every iteration; :func:`count_at_or_below`
  replaces it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.numerics import cdiv
from jax_bridge.core.validation import (
    check_chunk_size,
    check_cu_seqlens,
    check_cu_seqlens_and_host,
    check_mask,
    check_static_int,
    check_token_capacity,
    naming_op,
    require,
)

FILL_INDEX = -1
"""Value of every index slot past the real tokens or chunks."""


def _resolve_total_tokens(
    cu_seqlens: jax.Array, host: np.ndarray | None, total_tokens: int | None, caller: str
) -> int:
    """The static packed-axis length: given, or read from the concrete ``cu_seqlens[-1]``
    (`host`, `check_cu_seqlens_and_host`'s)."""
    if total_tokens is None:
        if host is None:
            raise ValueError(
                f"{caller}: total_tokens must be given as a static int when cu_seqlens is "
                "traced (e.g. under jax.jit); pass the packed axis length, e.g. x.shape[0]."
            )
        return int(host[-1])
    total_tokens = check_static_int(total_tokens, "total_tokens")
    check_token_capacity((cu_seqlens if host is None else host)[-1], total_tokens, "total_tokens")
    return total_tokens


COMPARE_ALL_LIMIT = 1 << 16
"""`count_at_or_below` compares every pair up to this many (boundaries x outputs)."""


def count_at_or_below(boundaries: jax.Array, length: int) -> jax.Array:
    """``out[t] = #{i : boundaries[i] <= t}`` for ``t in range(length)``, loop-free.

    For sorted ``boundaries`` this is ``searchsorted(boundaries, arange(length),
    side="right")``, with no ``while`` loop (``jnp.searchsorted``'s default is one, which a
    GPU runs with a host round trip per iteration). It holds for any order of
    ``boundaries``. Up to `COMPARE_ALL_LIMIT` pairs it is one comparison of every
    (boundary, t) pair summed per t: a single fused reduction, where the scatter-add of
    ones at the boundaries and the cumsum used beyond it (O(n + length) work) are two
    kernels on a GPU, each a few microseconds of launch on the short lists of a call's
    tiles (16 documents of 1k tokens: 22 boundaries, 147 tiles).

    Args:
      boundaries: int ``[n]``.
      length: static number of outputs.

    Returns:
      int32 ``[length]`` (a count of at most ``n`` boundaries).
    """
    if boundaries.shape[0] * length <= COMPARE_ALL_LIMIT:
        t = jnp.arange(length, dtype=boundaries.dtype)
        return jnp.sum(boundaries[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    # A boundary below 0 counts for every t (bin 0); one at or past `length` for none
    # (the last bin, never summed).
    bins = jnp.clip(boundaries, 0, length)
    marks = jnp.zeros((length + 1,), jnp.int32).at[bins].add(1)
    return jnp.cumsum(marks[:length], dtype=jnp.int32)


# Private cores are jitted so that eager calls compile one fused program per shape rather
# than one program per jnp op; under an outer jit they simply inline.


@jax.jit
def _lens(cu_seqlens: jax.Array) -> jax.Array:
    return cu_seqlens[1:] - cu_seqlens[:-1]


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _cu_seqlens_from_mask(mask: jax.Array, out_dtype: np.dtype) -> jax.Array:
    lens = jnp.sum(mask != 0, axis=1, dtype=out_dtype)
    return jnp.concatenate([jnp.zeros((1,), out_dtype), jnp.cumsum(lens, dtype=out_dtype)])


@naming_op("prepare_lens")
def prepare_lens(cu_seqlens: Any) -> jax.Array:
    """Sequence lengths ``[batch]`` from ``cu_seqlens: [batch + 1]``."""
    return _lens(check_cu_seqlens(cu_seqlens))


@naming_op("prepare_lens_from_mask")
def prepare_lens_from_mask(mask: Any) -> jax.Array:
    """Real tokens per row: ``mask: [batch, seq]`` (nonzero = real) -> ``[batch]`` int32.

    The real tokens need not be contiguous; every nonzero entry counts.
    """
    return _lens(_cu_seqlens_from_mask(check_mask(mask), jnp.dtype(jnp.int32)))


@naming_op("prepare_cu_seqlens_from_mask")
def prepare_cu_seqlens_from_mask(mask: Any, out_dtype: Any = jnp.int32) -> jax.Array:
    """``cu_seqlens: [batch + 1]`` (leading 0) of the rows of ``mask: [batch, seq]``."""
    out_dtype = jnp.dtype(out_dtype)
    # Signed only: every consumer of cu_seqlens fills index tails with -1.
    if not jnp.issubdtype(out_dtype, jnp.signedinteger):
        raise TypeError(f"out_dtype must be a signed integer dtype, got {out_dtype}.")
    return _cu_seqlens_from_mask(check_mask(mask), out_dtype)


@functools.partial(jax.jit, static_argnames=("total_tokens", "column"))
def token_indices(cu_seqlens: jax.Array, total_tokens: int, column: int | None = None) -> jax.Array:
    """``[total_tokens, 2]`` (sequence id, position), or one column of it; tail is -1.

    The unchecked core of the ``prepare_*_ids`` functions, for ops whose arguments are
    validated already (it runs under plain ``jax.jit`` with traced ``cu_seqlens``).
    Jitted so that eager calls compile one fused program per shape, not one per op.
    """
    token = jnp.arange(total_tokens, dtype=cu_seqlens.dtype)
    # Offsets at or below t, minus one: with repeated offsets (empty sequences) every
    # equal one counts, so t lands in the first non-empty sequence starting there.
    seq = count_at_or_below(cu_seqlens, total_tokens).astype(cu_seqlens.dtype) - 1
    # Past the last real token seq == batch, so this gather reads cu_seqlens[-1]: in bounds.
    position = token - cu_seqlens[seq]
    out = jnp.where((token < cu_seqlens[-1])[:, None], jnp.stack([seq, position], 1), FILL_INDEX)
    return out if column is None else out[:, column]


@naming_op("prepare_sequence_ids")
def prepare_sequence_ids(cu_seqlens: Any, total_tokens: int | None = None) -> jax.Array:
    """Index of the sequence owning each packed token.

    Args:
      cu_seqlens: ``[batch + 1]``.
      total_tokens: static packed length ``T >= cu_seqlens[-1]`` (required when traced).

    Returns:
      ``[T]``: ``searchsorted(cu_seqlens, t, side="right") - 1`` (the last sequence
      starting at or before ``t``) for real tokens ``t``,
      -1 for ``t >= cu_seqlens[-1]``.
    """
    cu_seqlens, host = check_cu_seqlens_and_host(cu_seqlens)
    total_tokens = _resolve_total_tokens(cu_seqlens, host, total_tokens, "prepare_sequence_ids")
    return token_indices(cu_seqlens, total_tokens, column=0)


@naming_op("prepare_position_ids")
def prepare_position_ids(cu_seqlens: Any, total_tokens: int | None = None) -> jax.Array:
    """Position of each packed token within its own sequence.

    Args:
      cu_seqlens: ``[batch + 1]``.
      total_tokens: static packed length ``T >= cu_seqlens[-1]`` (required when traced).

    Returns:
      ``[T]``: ``t - cu_seqlens[seq(t)]`` (0 at every sequence start) for real tokens,
      -1 for ``t >= cu_seqlens[-1]``.
    """
    cu_seqlens, host = check_cu_seqlens_and_host(cu_seqlens)
    total_tokens = _resolve_total_tokens(cu_seqlens, host, total_tokens, "prepare_position_ids")
    return token_indices(cu_seqlens, total_tokens, column=1)


@naming_op("prepare_token_indices")
def prepare_token_indices(cu_seqlens: Any, total_tokens: int | None = None) -> jax.Array:
    """``(sequence id, position in sequence)`` of each packed token.

    Args:
      cu_seqlens: ``[batch + 1]``.
      total_tokens: static packed length ``T >= cu_seqlens[-1]`` (required when traced).

    Returns:
      ``[T, 2]``; column 0 is :func:`prepare_sequence_ids`, column 1
      :func:`prepare_position_ids`; both are -1 for ``t >= cu_seqlens[-1]``.
    """
    cu_seqlens, host = check_cu_seqlens_and_host(cu_seqlens)
    total_tokens = _resolve_total_tokens(cu_seqlens, host, total_tokens, "prepare_token_indices")
    return token_indices(cu_seqlens, total_tokens)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _chunk_offsets(cu_seqlens: jax.Array, chunk_size: int) -> jax.Array:
    counts = cdiv(cu_seqlens[1:] - cu_seqlens[:-1], chunk_size)
    return jnp.concatenate([cu_seqlens[:1] * 0, jnp.cumsum(counts, dtype=cu_seqlens.dtype)])


@naming_op("prepare_chunk_offsets")
def prepare_chunk_offsets(cu_seqlens: Any, chunk_size: int) -> jax.Array:
    """Cumulative chunk counts: ``[batch + 1]`` with ``out[0] = 0`` and
    ``out[i + 1] - out[i] = cdiv(len_i, chunk_size)`` (0 for an empty sequence)."""
    cu_seqlens = check_cu_seqlens(cu_seqlens)
    chunk_size = check_chunk_size(chunk_size)
    return _chunk_offsets(cu_seqlens, chunk_size)


@functools.partial(jax.jit, static_argnames=("num_chunks",))
def _chunk_indices(chunk_offsets: jax.Array, num_chunks: int) -> jax.Array:
    """``[num_chunks, 2]`` (sequence id, chunk in sequence) from ``[batch + 1]`` offsets."""
    chunk = jnp.arange(num_chunks, dtype=chunk_offsets.dtype)
    # As for tokens: counting every repeated offset skips sequences with zero chunks.
    seq = count_at_or_below(chunk_offsets, num_chunks).astype(chunk.dtype) - 1
    chunk_in_seq = chunk - chunk_offsets[seq]
    real = chunk < chunk_offsets[-1]
    return jnp.where(real[:, None], jnp.stack([seq, chunk_in_seq], axis=1), FILL_INDEX)


@naming_op("chunk_bound")
def chunk_bound(total_tokens: int, chunk_size: int, num_sequences: int) -> int:
    """A static bound on the chunks of `num_sequences` sequences of `total_tokens` in all.

    Only non-empty sequences have chunks, and there are at most n = min(num_sequences,
    total_tokens) of them; sum_i cdiv(len_i, C) <= (total + n * (C - 1)) // C. It does not
    grow with the empty sequences (segment ids make most of theirs empty), and it is at
    most `cdiv(total, C) + num_sequences`. At least 1, so a grid is never empty.
    """
    total_tokens = check_static_int(total_tokens, "total_tokens")
    chunk_size = check_chunk_size(chunk_size)
    num_sequences = check_static_int(num_sequences, "num_sequences")
    nonempty = min(num_sequences, total_tokens)
    return max(1, (total_tokens + nonempty * (chunk_size - 1)) // chunk_size)


@naming_op("prepare_chunk_indices")
def prepare_chunk_indices(
    cu_seqlens: Any,
    chunk_size: int,
    num_chunks: int | None = None,
    *,
    total_tokens: int | None = None,
) -> jax.Array:
    """``(sequence id, chunk index within the sequence)`` for every chunk, in packed order.

    Sequence ``i`` contributes ``cdiv(len_i, chunk_size)`` chunks numbered from 0; empty
    sequences contribute none.

    Args:
      cu_seqlens: ``[batch + 1]``.
      chunk_size: static positive int ``C``.
      num_chunks: static number of output rows ``N``. If omitted: with ``total_tokens``
        the static bound `chunk_bound(total_tokens, C, batch)` (always enough, since each
        sequence adds at most one partial chunk); otherwise, on concrete input only,
        the exact count.
      total_tokens: static packed length, used only to derive the bound above.

    Returns:
      ``[N, 2]``; rows past the real chunks are ``(-1, -1)``.
    """
    cu_seqlens, host = check_cu_seqlens_and_host(cu_seqlens)
    chunk_size = check_chunk_size(chunk_size)
    offsets = _chunk_offsets(cu_seqlens, chunk_size)
    # Tokens and chunks, counted on the host where cu_seqlens is concrete.
    real = cu_seqlens[-1] if host is None else host[-1]
    chunks = offsets[-1] if host is None else int(np.sum(-(-np.diff(host) // chunk_size)))
    batch = cu_seqlens.shape[0] - 1
    if num_chunks is None:
        if total_tokens is not None:
            total_tokens = check_static_int(total_tokens, "total_tokens")
            check_token_capacity(real, total_tokens, "total_tokens")
            num_chunks = chunk_bound(total_tokens, chunk_size, batch)
        elif host is None:
            raise ValueError(
                "prepare_chunk_indices: num_chunks or total_tokens must be given as a static "
                "int when cu_seqlens is traced (e.g. under jax.jit)."
            )
        else:
            num_chunks = chunks
    else:
        num_chunks = check_static_int(num_chunks, "num_chunks")
        require(
            chunks <= num_chunks,
            f"num_chunks={num_chunks} is smaller than the number of chunks in cu_seqlens.",
        )
    return _chunk_indices(offsets, num_chunks)
