"""Load-balanced sequence order for causal context-parallel (ring) attention.

With a causal mask, the token at global position p attends p + 1 keys, so cutting the
sequence into `cp_size` contiguous pieces gives the last rank far more work than the
first. The balanced order cuts it into `2 * cp_size` equal chunks and gives rank r
chunks r and 2 * cp_size - 1 - r: every rank then holds one early and one late chunk,
and the sum of positions (the causal work) is the same on every rank.

The reordered layout is `[rank 0 chunks, rank 1 chunks, ...]` along the sequence axis,
so sharding that axis contiguously over the context-parallel mesh axis hands each rank
its pair. The permutation is computed on the host from static sizes.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.validation import check_bool, check_static_int, naming_op

__all__ = [
    "inverse_load_balanced_positions",
    "load_balanced_positions",
    "reorder_sequence",
]


def _check_sizes(seq_len: int, cp_size: int, seq_len_name: str = "seq_len") -> None:
    cp_size = check_static_int(cp_size, "cp_size", minimum=1)
    seq_len = check_static_int(seq_len, seq_len_name)
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"{seq_len_name} (the sequence length) = {seq_len} must be divisible by "
            f"2 * cp_size = {2 * cp_size} "
            "(the balanced order splits it into 2 * cp_size equal chunks)"
        )


@naming_op("load_balanced_positions")
def load_balanced_positions(seq_len: int, cp_size: int) -> np.ndarray:
    """Global position of every token in the load-balanced layout.

    Args:
      seq_len: sequence length, divisible by `2 * cp_size`.
      cp_size: number of context-parallel ranks, >= 1.

    Returns:
      int32 numpy array `[seq_len]`, a permutation: entry `i` is the original (contiguous)
      position of the token stored at index `i` of the reordered sequence. Rank r owns
      indices `[r * seq_len / cp_size, (r + 1) * seq_len / cp_size)`. cp_size = 1 gives
      the identity.
    """
    _check_sizes(seq_len, cp_size)
    num_chunks = 2 * cp_size
    chunk_len = seq_len // num_chunks
    ranks = np.arange(cp_size)
    # Chunk order [0, 2cp-1, 1, 2cp-2, ...]: rank r's two chunks sit side by side.
    chunk_order = np.stack([ranks, num_chunks - 1 - ranks], axis=1).reshape(-1)
    positions = chunk_order[:, None] * chunk_len + np.arange(chunk_len)[None, :]
    return positions.reshape(-1).astype(np.int32)


@naming_op("inverse_load_balanced_positions")
def inverse_load_balanced_positions(seq_len: int, cp_size: int) -> np.ndarray:
    """Index in the load-balanced layout of every original position.

    Returns:
      int32 numpy array `[seq_len]`, the inverse permutation of `load_balanced_positions`:
      `load_balanced_positions(...)[inverse_load_balanced_positions(...)] == arange(seq_len)`.
    """
    return np.argsort(load_balanced_positions(seq_len, cp_size)).astype(np.int32)


@naming_op("reorder_sequence")
def reorder_sequence(
    x: jax.Array, cp_size: int, seq_dim: int = 1, to_contiguous: bool = False
) -> jax.Array:
    """Moves a sequence axis into (or, with `to_contiguous`, out of) the balanced layout.

    Args:
      x: any array whose axis `seq_dim` is the sequence, e.g. `[batch, seq_len, ...]`;
        its length must be divisible by `2 * cp_size`.
      cp_size: number of context-parallel ranks, >= 1.
      seq_dim: the sequence axis (negative values count from the end).
      to_contiguous: False: contiguous -> balanced; True: balanced -> contiguous, the
        exact inverse.

    Returns:
      array like `x`, permuted along `seq_dim` by one gather.
    """
    x = jnp.asarray(x)
    try:
        seq_dim = operator.index(seq_dim)
    except TypeError:
        raise TypeError(f"seq_dim must be an int, got {type(seq_dim).__name__}") from None
    if not -x.ndim <= seq_dim < x.ndim:
        raise ValueError(f"seq_dim={seq_dim} is out of range for x with shape {x.shape}")
    seq_dim %= x.ndim
    _check_sizes(x.shape[seq_dim], cp_size, seq_len_name=f"x.shape[{seq_dim}]")
    if check_bool("reorder_sequence", to_contiguous, "to_contiguous"):
        source_index = inverse_load_balanced_positions(x.shape[seq_dim], cp_size)
    else:
        source_index = load_balanced_positions(x.shape[seq_dim], cp_size)
    # Indices are a permutation, always in bounds: "clip" only skips the fill-mode masking.
    return jnp.take(x, jnp.asarray(source_index), axis=seq_dim, mode="clip", unique_indices=True)
