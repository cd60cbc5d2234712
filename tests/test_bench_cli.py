"""`python -m bench` as a user runs it: flags, the summary table, the JSON file, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import SECTIONS
from bench.report import BenchRow, format_table

REPO = Path(__file__).resolve().parent.parent
MACHINE_KEYS = {
    "python", "jax", "jaxlib", "triton", "jax_triton", "backend", "device_kind",
    "cpu_count", "platform", "date", "flags",
}  # fmt: skip
ROW_KEYS = {
    "section", "op", "shape", "backend", "times", "median_s", "min_s", "max_s",
    "baseline", "baseline_times", "baseline_s", "ratio", "ok", "check",
}  # fmt: skip


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_host_layer_json(tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench.json"
    run = _bench("--quick", "--only", "host_layer", "--json", str(path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "median (min-max)" in run.stdout and "prepare_position_ids" in run.stdout
    document = json.loads(path.read_text())
    assert MACHINE_KEYS <= document["machine"].keys()
    assert document["machine"]["backend"] == "cpu"
    assert document["machine"]["flags"]["mode"] == "quick"
    assert document["machine"]["flags"]["sections"] == ["host_layer"]
    rows = document["rows"]
    assert len(rows) >= 8
    for row in rows:
        assert ROW_KEYS <= row.keys()
        assert row["section"] == "host_layer" and row["baseline"] == "numpy"
        assert row["ok"] is True and row["check"] == "ok"
        assert row["min_s"] <= row["median_s"] <= row["max_s"] and len(row["times"]) >= 3
        assert row["ratio"] == pytest.approx(row["baseline_s"] / row["median_s"])


def test_unknown_section_lists_valid_ones() -> None:
    run = _bench("--only", "nonsense")
    assert run.returncode != 0
    assert "nonsense" in run.stderr
    assert all(name in run.stderr for name in SECTIONS)


def test_quick_and_full_exclude_each_other() -> None:
    assert _bench("--quick", "--full").returncode != 0


def test_table_marks_failures_and_missing_figures() -> None:
    rows = [
        BenchRow("s", "op a", "4x4", "cpu", (0.002, 0.001, 0.003), "numpy", (0.004,), True),
        BenchRow("s", "op b", "8", "sm_90", ok=False),
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4
    assert "2 ms (1-3)" in lines[2] and "2x" in lines[2] and lines[2].endswith("ok")
    assert lines[3].endswith("FAIL") and " - " in lines[3]
