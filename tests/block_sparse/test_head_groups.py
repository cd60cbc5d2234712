"""How a MultiHeadMask with traced documents is split into calls (`traced_head_groups`)
and which kv heads each call reads (`kv_heads_of`): invariants, by hypothesis."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given

from jax_bridge.block_sparse.masks import kv_heads_of, traced_head_groups
from pallas_tpu.splash import CausalMask, DocumentMask, LocalMask, MultiHeadMask


@st.composite
def _heads_and_group(draw):
    """(ascending query heads of some of num_kv * group heads, group size)."""
    group = draw(st.integers(1, 4))
    num_q_heads = group * draw(st.integers(1, 4))
    chosen = draw(st.lists(st.booleans(), min_size=num_q_heads, max_size=num_q_heads))
    heads = np.nonzero(chosen)[0].astype(np.int32)
    return (heads if len(heads) else np.arange(num_q_heads, dtype=np.int32)), group


@given(_heads_and_group())
def test_each_query_head_of_a_call_reads_its_own_kv_head(heads_and_group):
    """In the call on `heads` with kv heads `kv`, query head i reads kv[i // (len(heads) //
    len(kv))] by the op's GQA rule; that is the kv head heads[i] reads in the whole op.
    The call keeps GQA exactly when `heads` are whole kv groups."""
    heads, group = heads_and_group
    kv = kv_heads_of(heads, group)
    assert kv.dtype == np.int32 and len(heads) % len(kv) == 0
    call_group = len(heads) // len(kv)
    np.testing.assert_array_equal(kv[np.arange(len(heads)) // call_group], heads // group)
    whole = len(heads) % group == 0 and set(heads.tolist()) == {
        int(h) for kv_head in set((heads // group).tolist())
        for h in range(kv_head * group, (kv_head + 1) * group)
    }  # fmt: skip
    assert (call_group == group) == whole


_KINDS = st.lists(st.sampled_from(["traced_a", "traced_b", "causal", "local"]), min_size=1)


@given(_KINDS)
def test_traced_head_groups_partition_the_heads_and_keep_each_mask(kinds):
    """Every head lies in exactly one group, in ascending order; a traced member's group
    is exactly the heads holding that object; the static heads form one group whose mask
    is, head by head, their own mask."""
    length = 16
    shape = (length, length)
    seen = {}

    def build(cu):
        members = {
            "traced_a": DocumentMask(cu, shape=shape, causal=True),
            "traced_b": DocumentMask(cu, shape=shape, window=(3, 0)),
            "causal": CausalMask(shape),
            "local": LocalMask(shape, (2, 2), 0),
        }
        mask = MultiHeadMask([members[k] for k in kinds])
        for heads, member in traced_head_groups(mask):
            assert np.all(np.diff(heads) > 0)
            seen[tuple(heads.tolist())] = member
            if isinstance(member, DocumentMask) and member.traced:
                holders = [h for h, m in enumerate(mask.masks) if m is member]
                assert heads.tolist() == holders
            elif isinstance(member, MultiHeadMask):
                assert list(member.masks) == [mask.masks[h] for h in heads]
            else:
                assert all(mask.masks[h] == member for h in heads)
        return jnp.zeros(())

    jax.jit(build)(jnp.asarray([0, 5, 16], jnp.int32))
    covered = sorted(h for heads in seen for h in heads)
    assert covered == list(range(len(kinds)))
