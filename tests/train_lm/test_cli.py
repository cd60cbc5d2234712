"""The two commands of the example: `python examples/train_lm` (trains, prints the loss
curve) and `python -m bench train` (ours vs the dense twin, same batches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert "steps 0..3" in out and "1 trace(s)" in out


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
