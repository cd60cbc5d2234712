"""`python -m bench aot`: its block counts and estimates, its rows at small sizes."""

import numpy as np
import pytest

from bench import aot, splash_cycles
from pallas_tpu import splash


def test_causal_mask_blocks_are_the_lower_triangle_and_the_diagonal():
    problem = splash_cycles.Problem(heads=2, seq=1024, block=256)
    n = problem.seq // problem.block
    mask = splash.MultiHeadMask([splash.CausalMask((problem.seq,) * 2)] * problem.heads)
    counts = splash_cycles.mask_blocks(mask, problem)
    expected = (problem.heads * n * (n - 1) // 2, problem.heads * n)  # below / on diagonal
    assert counts == {"forward": expected, "dq": expected, "dkv": expected}


def test_mask_estimate_weighs_each_kind_by_its_count():
    rng = np.random.default_rng(0)
    full = {k: float(rng.uniform(1e3, 2e3)) for k in splash_cycles.KERNELS}
    partial = {k: float(rng.uniform(2e3, 3e3)) for k in splash_cycles.KERNELS}
    counts = {k: tuple(int(c) for c in rng.integers(0, 100, 2)) for k in splash_cycles.KERNELS}
    estimate = splash_cycles.estimate_mask_cycles(counts, full, partial)
    for k in splash_cycles.KERNELS:
        assert estimate[k] == pytest.approx(full[k] * counts[k][0] + partial[k] * counts[k][1])


def test_example_masks_cover_causal_local_and_documents():
    problem = splash_cycles.Problem(heads=1, seq=1024, block=256)
    masks = splash_cycles.example_masks(problem)
    dense = {name: np.asarray(m[0:1, :, :])[0] for name, m in masks.items()}
    causal = np.tril(np.ones((1024, 1024), bool))
    np.testing.assert_array_equal(dense["causal"], causal)
    assert dense["local"].sum() < dense["causal"].sum()
    assert dense["documents"].sum() < dense["causal"].sum()
    assert not np.any(dense["documents"] & ~causal)


def test_memory_rows_at_small_sizes(monkeypatch):
    for name, value in dict(
        TOKENS=512, HEADS=2, DOCUMENTS=4, ROWS=512, HIDDEN=128, FFN=256, EXPERTS=4
    ).items():
        monkeypatch.setattr(aot, name, value)
    rows = aot.attention_rows("h100", "bfloat16") + aot.grouped_matmul_rows("h100", "bfloat16")
    assert [r.baseline for r in rows] == ["dot_product_attention", "ragged_dot", "per-group loop"]
    assert all(not r.error and not r.baseline_error for r in rows), rows
    assert rows[0].backend == "triton" and rows[0].ratio > 1  # no [tokens, tokens] scores
    table = aot.format_memory(rows)
    assert "dot_product_attention" in table and max(map(len, table.splitlines())) <= 120


def test_cycle_table_marks_what_the_profiler_did_not_price():
    ours = {"full": {"forward": 90.0, "dq": 100.0, "dkv": 130.0}}
    theirs = {"full": {"forward": 100.0, "dq": 100.0, "dkv": 100.0}, "partial": {}}
    rows = [aot._block_row("tpu-v5p", "bfloat16", k, ours, theirs) for k in ("forward", "dkv")]
    assert rows[0]["full_ratio"] == pytest.approx(0.9) and rows[0]["partial_ratio"] is None
    assert rows[0]["meets_goal"] is None  # no partial figure: no verdict
    rows.append(dict(target="tpu-v5p", dtype="bfloat16", mask="error", error="ours partial: x"))
    table = aot.format_cycles(rows, splash_cycles.Problem())
    assert "not priced: ours partial: x" in table and " n/a" in table
    assert "0.90" in table and "1.30" in table
