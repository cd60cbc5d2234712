"""The example's data pipeline: documents from the standard library, packed rows, the
prefetching thread. Properties, stated as invariants over random configurations."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.train_lm.config import TrainConfig
from examples.train_lm.data import NO_TARGET, Prefetcher, batches, standard_library_texts


@given(
    seq_len=st.integers(16, 512),
    max_documents=st.integers(1, 12),
    min_document=st.integers(2, 16),
    seed=st.integers(0, 2**31),
)
def test_every_row_is_a_valid_packing(seq_len, max_documents, min_document, seed):
    """cu_seqlens starts at 0, never decreases, stays within the row and has room for at
    most max_documents; every document is a piece of one source file; targets are the next
    token of the same document, NO_TARGET at a document's end and in padding."""
    config = TrainConfig(
        seq_len=seq_len, rows=2, max_documents=max_documents, min_document=min_document, seed=seed
    )
    batch = next(batches(config))
    assert batch.tokens.shape == batch.targets.shape == (2, seq_len)
    assert batch.cu_seqlens.shape == (2, max_documents + 1)
    corpus = b"\0".join(standard_library_texts())
    for tokens, targets, cu in zip(*batch, strict=True):
        assert cu[0] == 0 and np.all(np.diff(cu) >= 0) and cu[-1] <= seq_len
        expected = np.full(seq_len, NO_TARGET)
        for start, end in itertools.pairwise(cu):
            if end > start:
                assert bytes(tokens[start:end].astype(np.uint8)) in corpus
                expected[start : end - 1] = tokens[start + 1 : end]
        np.testing.assert_array_equal(targets, expected)
        assert np.all(tokens[cu[-1] :] == 0)


def test_a_new_packing_every_step_and_the_same_for_a_seed():
    config = TrainConfig(seq_len=256, rows=2)
    first, second = itertools.islice(batches(config), 2)
    assert not np.array_equal(first.cu_seqlens, second.cu_seqlens)
    again = next(batches(config))
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_prefetcher_yields_the_source_in_order_and_raises_its_errors():
    def source():
        yield from range(10)
        raise OSError("disk gone")

    prefetched = Prefetcher(source(), depth=2)
    assert [next(prefetched) for _ in range(10)] == list(range(10))
    with pytest.raises(OSError, match="disk gone"):
        next(prefetched)
    prefetched.close()


def test_prefetcher_close_stops_an_endless_source():
    prefetched = Prefetcher(itertools.count(), depth=2)
    assert next(prefetched) == 0
    prefetched.close()
    assert not prefetched._thread.is_alive()
