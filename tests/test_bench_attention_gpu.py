"""The attention section's GPU table (bench/attention_gpu.py), run here through Triton's
interpreter at a toy size: its rows, its check and its FLOP count. On a GPU the same code
times the kernels against cuDNN."""

import pytest

from bench import attention_gpu


def test_causal_flops_counts_the_allowed_pairs():
    # Two causal documents of 3 tokens: 6 allowed pairs each, 4 * head_dim FLOPs per pair
    # and head.
    assert attention_gpu.causal_flops(6, 3, num_heads=2, head_dim=8) == 4 * 8 * 2 * 2 * 6


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_rows_check_triton_against_the_baseline():
    rows = attention_gpu.main(total=32, doc_lens=(16,), heads=2, dim=16, repeats=1)
    assert [row.op for row in rows] == ["varlen_attention forward", "varlen_attention fwd+bwd"]
    assert all(row.ok for row in rows)
    assert all(row.times and row.baseline_times for row in rows)
    assert rows[1].flops == attention_gpu.FWD_BWD_FLOP_FACTOR * rows[0].flops
    # No cuDNN on a CPU: the baseline says it is XLA's attention.
    assert rows[0].baseline.startswith("dot_product_attention")
