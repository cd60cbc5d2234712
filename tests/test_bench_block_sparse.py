"""`python -m bench block_sparse`: the sparsity sweep's masks and counts, and the timed
rows' checks (on a reduced size, with the section's own code)."""

import numpy as np
import pytest

from bench import block_sparse
from jax_bridge.block_sparse.masks import block_counts


def test_random_blocks_keep_the_diagonal_and_about_their_density():
    keep = block_sparse.RandomBlocks(64 * block_sparse.BLOCK, 0.1).keep
    assert keep.shape == (64, 64) and keep.diagonal().all()
    assert 0.05 < keep.mean() < 0.2


def test_visited_blocks_are_the_blocks_the_dense_masks_touch():
    tokens = 1024
    for name, mask in block_sparse.masks(tokens).items():
        dense = np.asarray(mask[0:tokens, 0:tokens])
        blocks = dense.reshape(8, 128, 8, 128).any(axis=(1, 3))
        counts = block_counts(mask, block_sizes=block_sparse._blocks())
        assert counts.dense == 64 and counts.visited == int(blocks.sum()), name


@pytest.mark.parametrize("name", ["16 documents", "random 90% sparse"])
def test_timed_rows_check_ours_against_every_baseline(name, monkeypatch):
    monkeypatch.setattr(block_sparse, "REPEATS", 1)
    rng = np.random.default_rng(0)
    q, k, v, d_out = (rng.standard_normal((1, 512, 2, 64)).astype(np.float32) for _ in range(4))
    rows = block_sparse._timed_row(name, block_sparse.masks(512)[name], q, k, v, d_out)
    assert len(rows) == (2 if name == "16 documents" else 1)
    assert all(row.ok and row.times and row.baseline_times for row in rows)


def test_gpu_section_runs_the_block_sparse_cases(monkeypatch):
    # The cases run in tests/test_bench_gpu_check.py; the section hands over all four.
    from bench import block_sparse_gpu, gpu_rows

    seen = []
    monkeypatch.setattr(block_sparse_gpu, "run_cases", lambda cases, _: seen.append(cases) or [])
    block_sparse_gpu.main(gpu_rows.Sizes.tiny())
    assert [c.key for c in seen[0]] == [
        "64 tok causal", "64 tok window 16", "64 tok 16 documents", "64 tok random 50%"
    ]  # fmt: skip
    causal_pairs = 64 * 65 / 2
    assert seen[0][0].flops("fwd+bwd") == 3.5 * 4 * 16 * 2 * causal_pairs
