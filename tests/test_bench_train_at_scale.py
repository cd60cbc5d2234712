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


HLO = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a2a = f32[8]{0} all-to-all(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
}
%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(6)
  %g = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %c), direction=LT
}
%one (p: f32[8]) -> f32[8] {
  %cp = f32[8]{0} collective-permute(%p), channel_id=3, source_target_pairs={{0,1}}
}
%two (p: f32[8]) -> f32[8] {
  %cp.1 = f32[8]{0} collective-permute(%p), channel_id=4, source_target_pairs={{0,1}}
  %cp.2 = f32[8]{0} collective-permute(%cp.1), channel_id=5, source_target_pairs={{0,1}}
}
ENTRY %main (x: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
  %w.1 = s32[] while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  ROOT %c = f32[8]{0} conditional(%i, %x, %x), branch_computations={%one, %two}
}
"""


def test_executed_collectives_multiply_loops_by_their_trip_counts():
    # The TPU form (condition counter < 6) and the GPU form (known_trip_count 3); the
    # conditional's larger branch.
    counts = train_at_scale.executed_collectives(HLO)
    assert counts == {"all-reduce": 1, "all-to-all": 6 + 3, "collective-permute": 2}


def test_error_kind_keeps_the_compilers_figures():
    refusal = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (44.44G) exceeds available HBM (31.25G).\nmore"
    )
    assert train_at_scale.error_kind(refusal) == (
        "out of memory: temps 44.44G > available HBM 31.25G (compiler)"
    )
    assert train_at_scale.error_kind(ValueError("bad\nx")) == "ValueError: bad"
