"""Every public helper of the host layer names itself, the argument and what was expected
when its input is wrong, as the ops do (`naming_op`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_bridge as jb

_DECREASING = np.array([0, 3, 2], np.int32)
_CALLS = {
    "pack": (ValueError, "lengths_or_mask", lambda: jb.pack(jnp.ones((2, 4, 3)), [5, 1])),
    "unpack": (ValueError, "max_len=2", lambda: jb.unpack(jnp.ones((4, 3)), [0, 3, 4], 2, 2)),
    "prepare_lens": (ValueError, "cu_seqlens", lambda: jb.prepare_lens(_DECREASING)),
    "prepare_chunk_indices": (
        ValueError, "cu_seqlens", lambda: jb.prepare_chunk_indices(_DECREASING, 2)
    ),
    "prepare_chunk_offsets": (
        TypeError, "chunk_size", lambda: jb.prepare_chunk_offsets(np.array([0, 3]), 2.0)
    ),
    "prepare_position_ids": (ValueError, "cu_seqlens", lambda: jb.prepare_position_ids([1, 3])),
    "prepare_sequence_ids": (
        ValueError, "cu_seqlens", lambda: jb.prepare_sequence_ids(np.array([[0, 3]]))
    ),
    "prepare_token_indices": (
        TypeError, "cu_seqlens", lambda: jb.prepare_token_indices(np.array([0.0, 3.0]))
    ),
    "prepare_cu_seqlens_from_mask": (
        ValueError, "mask", lambda: jb.prepare_cu_seqlens_from_mask(np.ones(3, bool))
    ),
    "prepare_lens_from_mask": (
        ValueError, "mask", lambda: jb.prepare_lens_from_mask(np.ones((2, 2, 2), bool))
    ),
    "chunk_bound": (TypeError, "chunk_size", lambda: jb.chunk_bound(8, "2", 1)),
    "chunk_array": (TypeError, "chunk_size", lambda: jb.chunk_array(jnp.ones(5), np.ones(2))),
    "unchunk_array": (ValueError, "rank", lambda: jb.unchunk_array(jnp.ones(5))),
    "segment_ids_to_mask": (
        TypeError, "segment_ids", lambda: jb.segment_ids_to_mask(np.ones((2, 3)))
    ),
    "mask_to_segment_ids": (ValueError, "mask", lambda: jb.mask_to_segment_ids(np.ones(3))),
    "is_segment_mask": (ValueError, "mask", lambda: jb.is_segment_mask(np.ones(3))),
    "reorder_sequence": (ValueError, "cp_size", lambda: jb.reorder_sequence(jnp.ones((1, 6)), 2)),
    "load_balanced_positions": (
        ValueError, "cp_size", lambda: jb.load_balanced_positions(7, 3)
    ),
    "inverse_load_balanced_positions": (
        ValueError, "cp_size", lambda: jb.inverse_load_balanced_positions(7, 3)
    ),
}  # fmt: skip


@pytest.mark.parametrize("op", list(_CALLS))
def test_a_bad_input_names_the_helper_and_the_argument(op):
    error, argument, call = _CALLS[op]
    with pytest.raises(error, match=rf"^{op}: .*{argument}") as info:
        call()
    assert not str(info.value).startswith(f"{op}: {op}:")


def test_a_traced_check_names_the_helper():
    from jax.experimental import checkify

    def positions(cu):
        return jb.prepare_position_ids(cu, total_tokens=4)

    error, _ = checkify.checkify(jax.jit(positions))(jnp.asarray([0, 3, 2], jnp.int32))
    assert str(error.get()).startswith("prepare_position_ids: ")
