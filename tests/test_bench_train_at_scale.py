"""`python -m bench train-at-scale`: the train step of the TINY model compiled for 8
compile-only H100s, both flavours, at a small row length."""

import pytest

from bench import train_at_scale
from examples.train_lm.config import TINY

MESH = {"data": 2, "expert": 2, "context": 2}


@pytest.fixture(scope="module")
def rows():
    return {
        flavour: train_at_scale.compile_step(TINY, "h100", flavour, MESH, seq_len=256)
        for flavour in train_at_scale.FLAVOURS
    }


@pytest.mark.parametrize("flavour", train_at_scale.FLAVOURS)
def test_step_compiles_with_positive_figures(rows, flavour):
    row = rows[flavour]
    assert not row.error, row.error
    assert row.rows == 4 and row.seq_len == 256 and row.fits
    for size in (row.argument_bytes, row.output_bytes, row.temp_bytes, row.total_bytes):
        assert size > 0
    assert row.alias_bytes > 0  # the state is donated, as Trainer.step donates it
    assert row.compile_seconds > 0
    for kind, count in row.collectives.items():  # the loops run their collectives again
        assert row.collectives_per_step[kind] >= count > 0


def test_ours_exchanges_tokens_over_experts_and_keys_round_the_ring(rows):
    collectives = rows["ours"].collectives
    assert collectives.get("all-to-all", 0) > 0  # expert axis 2: dispatch / combine
    assert collectives.get("collective-permute", 0) > 0  # context axis 2: the ring


def test_tables_show_every_row():
    row = train_at_scale.StepRow("h100", "ours", MESH, 256, 4, 1, 1, 1, 0, 3, {"all-to-all": 2})
    row = train_at_scale.dataclasses.replace(row, collectives_per_step={"all-to-all": 4})
    failed = train_at_scale.StepRow("h100", "dense", MESH, 512, 4, error="out of memory: x")
    table = train_at_scale.format_table([row, failed])
    assert "A2A 4 (2)" in table and "no: out of memory" in table
    summary = train_at_scale.sweep_summary("h100", "dense", 256, [row, failed], None)
    assert summary["largest_fitting"] == 256 and summary["stopped_at"] == 512
