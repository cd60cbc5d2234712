"""The work lists of the Triton varlen attention kernels: which (sequence, tile) each
program owns, over an extended set of sequences that covers every packed row.

Packed rows that belong to no sequence (past `cu_seqlens[-1]`, or before `cu_seqlens[0]`
when an unchecked traced value does not start at 0) are covered too: the kernels see four
extra sequences, a head and a tail on each axis, each with rows on one axis only, so such
query rows get output 0 and lse -inf (or the sink), such key rows get zero gradients, and
every output element is written.

Up to `_SPARE_PROGRAMS` sequences (the extended ones included) the lists come from one
small Triton kernel (`attention_schedule_kernel`) and each program owns one row. Past that
(segment ids give up to one sequence a token) XLA builds them, and fewer programs than
rows walk them (PERSISTENT). Both give the same lists.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton

from jax_bridge.core.numerics import cdiv
from jax_bridge.host.cu_seqlens import chunk_bound, prepare_chunk_indices
from jax_bridge.launch.triton_call import triton_call
from triton_kernels.flash_attention.config import AttentionFeatures
from triton_kernels.flash_attention.schedule import attention_schedule_kernel

# Programs beyond the full tiles of the packed axis, for partial tiles at sequence ends.
_SPARE_PROGRAMS = 64
# List rows per program of the schedule kernel.
_SCHEDULE_ROWS = 32


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """The kernels' view of one call's sequences.

    Attributes:
      cu_q, cu_k: int32 [B + 5]: cu_seqlens of the extended sequences (`_with_tail_sequences`).
      query_tiles: int32 [Nq, 2]: (sequence, query tile) rows, then (-1, -1) rows.
      key_tiles: int32 [Nk, 2] likewise for key tiles, or None (not asked for).
      persistent: the kernels walk the lists with fewer programs than rows (`persistent`).
    """

    cu_q: jax.Array
    cu_k: jax.Array
    query_tiles: jax.Array
    key_tiles: jax.Array | None
    persistent: bool


def persistent(num_sequences: int) -> bool:
    """Whether the kernels walk their tile lists (PERSISTENT) rather than launch a program
    a row, for `num_sequences` extended sequences (B + 4). The list's static bound is
    `cdiv(total, block) + min(sequences, total)` rows, almost all empty when there are
    many sequences, and each program costs a block launch. Past `_SPARE_PROGRAMS`
    sequences, `cdiv(total, block) + _SPARE_PROGRAMS` programs walk the list instead (their
    loop costs registers: `default_attention_config(persistent=True)` keeps the forward's
    smaller tile)."""
    return num_sequences > _SPARE_PROGRAMS


def call_walks_tile_lists(cu_seqlens_q: jax.Array) -> bool:
    """`persistent` for a call of B sequences (`cu_seqlens_q`: [B + 1]), whose kernels see
    B + 4 extended sequences (`_with_tail_sequences`)."""
    return persistent(cu_seqlens_q.shape[0] + 3)


def programs(rows: int, total: int, block: int, persistent: bool) -> int:
    """Programs on the grid's tile axis, for a tile list of `rows` rows."""
    if not persistent:
        return rows
    return min(rows, cdiv(total, block) + _SPARE_PROGRAMS)


def tile_schedule(
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    total_q: int,
    total_k: int,
    query_block: int,
    key_block: int | None,
    features: AttentionFeatures,
) -> TileSchedule:
    """The extended cu_seqlens and the tile lists of query tiles of `query_block` rows
    and (when `key_block` is given) key tiles of `key_block` rows.

    Args:
      cu_seqlens_q, cu_seqlens_k: int [B + 1], as the op was given them (unchecked).
      total_q, total_k: packed rows of each axis (> 0).
      query_block, key_block: tile rows of each list.
      features: the call's options (their right bound decides the order).
    """
    batch = cu_seqlens_q.shape[0] - 1
    num_sequences = batch + 4
    rows_q = chunk_bound(total_q, query_block, num_sequences)
    rows_k = None if key_block is None else chunk_bound(total_k, key_block, num_sequences)
    if persistent(num_sequences):
        cu_q, cu_k = _with_tail_sequences(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
        query_tiles = _xla_tiles(cu_q, total_q, query_block, features, query_side=True)
        key_tiles = None
        if key_block is not None:
            key_tiles = _xla_tiles(cu_k, total_k, key_block, features, query_side=False)
        return TileSchedule(cu_q, cu_k, query_tiles, key_tiles, True)
    ints = jax.ShapeDtypeStruct
    cu_q, cu_k, query_tiles, key_tiles = triton_call(
        jnp.asarray(cu_seqlens_q, jnp.int32),
        jnp.asarray(cu_seqlens_k, jnp.int32),
        batch,
        total_q,
        total_k,
        rows_q,
        rows_k or 1,
        kernel=attention_schedule_kernel,
        out_shape=(
            ints((batch + 5,), jnp.int32),
            ints((batch + 5,), jnp.int32),
            ints((rows_q, 2), jnp.int32),
            ints((rows_k or 1, 2), jnp.int32),
        ),
        grid=(cdiv(max(rows_q, rows_k or 0), _SCHEDULE_ROWS), 1 if key_block is None else 2),
        num_warps=4,
        num_stages=1,
        name="varlen_attention_schedule",
        BLOCK_Q=query_block,
        BLOCK_K=key_block or query_block,
        SLOTS=max(16, triton.next_power_of_2(batch + 5)),
        ROWS=_SCHEDULE_ROWS,
        HEAVIEST_FIRST=features.bounded_right,
        KEY_LIST=key_block is not None,
    )
    return TileSchedule(cu_q, cu_k, query_tiles, None if key_block is None else key_tiles, False)


def _with_tail_sequences(
    cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, total_q: int, total_k: int
) -> tuple[jax.Array, jax.Array]:
    """cu_seqlens of batch + 4 sequences: the query head `[0, cu_q[0])` (no keys), the key
    head `[0, cu_k[0])` (no queries), the given ones, the query tail (no keys) and the key
    tail (no queries). Every packed row then belongs to exactly one sequence, and rows
    outside the given ones attend nothing and are attended by nothing. (The heads are
    empty for valid cu_seqlens, which start at 0.)

    The public op checks cu_seqlens only under checkify. Here they are made non-decreasing
    and clipped to [0, total] first, so that invalid ones (decreasing, negative, past the
    end) under plain jit give garbage results but never out-of-bounds reads or writes.
    """
    cu_q = jnp.clip(jax.lax.cummax(jnp.asarray(cu_seqlens_q, jnp.int32)), 0, total_q)
    cu_k = jnp.clip(jax.lax.cummax(jnp.asarray(cu_seqlens_k, jnp.int32)), 0, total_k)
    zero = jnp.zeros((1,), jnp.int32)
    cu_q = jnp.concatenate([zero, cu_q[:1], cu_q, jnp.full((2,), total_q, jnp.int32)])
    cu_k = jnp.concatenate([zero, zero, cu_k, cu_k[-1:], jnp.full((1,), total_k, jnp.int32)])
    return cu_q, cu_k


def _xla_tiles(
    cu_seqlens: jax.Array, total: int, block: int, features: AttentionFeatures, query_side: bool
) -> jax.Array:
    """int32 [chunk_bound(total, block, sequences), 2]: the (sequence, tile) rows of
    extended `cu_seqlens`, (-1, -1) past them, in the schedule kernel's order: with a
    right bound, by descending span (t + 1 for query tiles, n - t for key tiles), ties in
    packed order, by a stable sort."""
    chunks = prepare_chunk_indices(cu_seqlens, block, total_tokens=total).astype(jnp.int32)
    if not features.bounded_right:  # else a tile's work grows with the tiles it spans
        return chunks
    seq, tile = chunks[:, 0], chunks[:, 1]
    if query_side:
        span = tile + 1
    else:
        lengths = jnp.diff(cu_seqlens)[jnp.maximum(seq, 0)]
        span = (lengths + block - 1) // block - tile
    span = jnp.where(seq >= 0, span, 0)  # -1 rows last
    return chunks[jnp.argsort(-span, stable=True)]
