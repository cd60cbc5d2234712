"""bench/verdicts.py: the A/B anchors' verdicts and issue 27's bars, from a run's rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.report import BenchRow, read_json
from bench.verdicts import BARS, ab_verdict, format_ab, format_bars, format_verdicts

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _row(section, op, shape, baseline, ours_s, theirs_s, ok=True) -> BenchRow:
    return BenchRow(section, op, shape, "ours triton", (ours_s,) * 3, baseline, (theirs_s,) * 3, ok)


@pytest.mark.parametrize(
    ("speedups", "verdict"),
    [
        ((1.10, 1.20), "faster"),
        ((1.10, 1.01), "faster or even"),
        ((0.80, 0.90), "slower"),
        ((0.80, 1.00), "slower or even"),
        ((1.10, 0.90), "mixed"),
        ((1.02, 0.98), "even"),
    ],
)
def test_an_ab_verdict_needs_a_clear_margin_on_every_row(speedups, verdict):
    assert ab_verdict(speedups) == verdict


def test_ab_lines_give_the_anchors_speed_over_the_default():
    rows = [
        # ours (the default) 2 ms, the anchor 1 ms: the anchor is 2x faster
        _row("attention", "varlen_attention fwd+bwd", "4x4096 causal", "ours triton varlen x",
             2e-3, 1e-3),
        _row("attention", "varlen_attention forward", "4x4096 causal", "ours triton varlen x",
             1e-3, 1e-3),
        _row("attention", "varlen_attention forward", "4x4096 causal", "jax cudnn attention",
             1e-3, 5e-4),
        # ours on other work, unchecked (gmm on one group): no A/B
        _row("grouped_matmul", "grouped_matmul forward", "m8192", "ours triton, one group",
             1e-3, 5e-4, ok=None),
    ]  # fmt: skip
    text = format_ab(rows)
    assert text.splitlines() == [
        "ours triton varlen x: faster or even",
        "   2.00x  4x4096 causal, fwd+bwd",
        "   1.00x  4x4096 causal, forward",
    ]
    assert format_ab(rows[2:]) == "no A/B anchor in these rows"


def test_each_bar_applies_to_its_rows_only():
    rows = [
        _row("attention", "varlen_attention forward", "16x1024 causal h16", "jax cudnn attention",
             1e-3, 8e-4),
        # the mixed lengths are no equal-document row: out of the cuDNN bar
        _row("attention", "varlen_attention forward", "mixed 7000..484 causal h16",
             "jax cudnn attention", 1e-3, 2e-3),
        _row("block_sparse", "block_sparse_attention forward", "16384 tok causal h16",
             "torch flex_attention", 1e-3, 1.2e-3),
        _row("grouped_matmul", "grouped_matmul forward", "m8192", "torch _grouped_mm", 1e-3,
             8.9e-4),
    ]  # fmt: skip
    lines = format_bars(rows).splitlines()
    assert lines == [
        "attention >= 1.0x FlexAttention: 1 of 1 rows",
        "   1.20x ok    16384 tok causal h16, forward",
        "varlen, equal documents >= 0.75x JAX's cuDNN: 1 of 1 rows",
        "   0.80x ok    16x1024 causal h16, forward",
        "grouped matmul >= 0.9x torch._grouped_mm: 0 of 1 rows",
        "   0.89x BELOW m8192, forward",
    ]


def test_the_verdicts_of_a_saved_device_run():
    """The H100 run of 2026-11-27 with the TMA anchors: gmm by descriptors slower on both
    rows, and ours below FlexAttention on 16 x 1024."""
    text = format_verdicts(read_json(RESULTS / "gpu-check-20261127T0221Z-tma.json"))
    assert "ours triton tma: slower" in text
    flex = text.split(BARS[0].name)[1].split("\n\n")[0]
    assert "BELOW 16x1024 causal h16 d128 bf16, forward" in flex
