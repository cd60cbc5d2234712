"""The two commands of the example: `python examples/train_lm` (trains, prints the loss
curve) and `python -m bench train` (ours vs the dense twin, same batches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.train_lm.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_lm_trains_on_a_mesh_and_prints_its_curve():
    out = _run("examples/train_lm", "--steps", "4", "--mesh", "1,2,2", "--seq-len", "64")
    assert "mesh (1, 2, 2) on cpu" in out
    assert "steps 0..3" in out and "1 compile(s) of the step" in out


def test_bench_train_compares_the_twin_on_the_same_batches(tmp_path):
    path = tmp_path / "train.json"
    out = _run("-m", "bench", "train", "--steps", "3", "--seq-len", "64", "--json", str(path))
    assert "dense/ours step time" in out
    results = json.loads(path.read_text())["results"]
    assert [len(results[f]["losses"]) for f in ("ours", "dense")] == [3, 3]
    assert results["ours"]["traces"] == results["dense"]["traces"] == 1
    assert all(len(results[f]["wait_s"]) == 3 for f in ("ours", "dense"))
    # Same parameters, same first batch: the first losses agree to bf16 rounding.
    ours, dense = results["ours"]["losses"][0], results["dense"]["losses"][0]
    assert abs(ours - dense) <= 1e-2 * abs(dense)


def test_train_lm_refuses_a_bad_mesh():
    done = subprocess.run(
        [sys.executable, "examples/train_lm", "--mesh", "2,2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--mesh takes three positive ints" in done.stderr


def test_train_lm_refuses_rows_shorter_than_the_shortest_document():
    """--seq-len 4 (< min_document 8) packed no document: every target was padding and
    the run printed `loss 0.000 -> 0.000`. It is an argument error now, and TrainConfig
    refuses it too (bench builds its own)."""
    done = subprocess.run(
        [sys.executable, "examples/train_lm", "--seq-len", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:]
    assert "--seq-len must be at least 8" in done.stderr
    with pytest.raises(ValueError, match=r"seq_len \(7\) must be at least min_document \(8\)"):
        TrainConfig(seq_len=7)
    with pytest.raises(ValueError, match="min_document must be >= 2"):
        TrainConfig(min_document=1)
    assert TrainConfig(seq_len=8).seq_len == 8  # one document of 8 tokens: 7 targets
