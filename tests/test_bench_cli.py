"""`python -m bench` as a user runs it: flags, the summary table, the JSON file, the plot,
the subcommands, exit codes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import bench.__main__ as cli
from bench.__main__ import SECTIONS, SUBCOMMANDS
from bench.plot import collect_series, plot_rows
from bench.report import BenchRow, format_rate, format_table, read_json, write_json

REPO = Path(__file__).resolve().parent.parent
MACHINE_KEYS = {
    "python", "jax", "jaxlib", "triton", "jax_triton", "backend", "device_kind",
    "cpu_count", "platform", "date", "flags",
}  # fmt: skip
ROW_KEYS = {
    "section", "op", "shape", "backend", "times", "median_s", "min_s", "max_s",
    "baseline", "baseline_times", "baseline_s", "ratio", "ok", "check",
    "flops", "bytes", "params", "throughput", "flop_per_s", "bytes_per_s",
    "baseline_flop_per_s", "baseline_bytes_per_s",
}  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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


def test_host_layer_json_and_plot(tmp_path: Path) -> None:
    path, png = tmp_path / "out" / "bench.json", tmp_path / "plots" / "bench.png"
    run = _bench("--quick", "--only", "host_layer", "--json", str(path), "--plot", str(png))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "median (min-max)" in run.stdout and "prepare_position_ids" in run.stdout
    assert "throughput" in run.stdout and "B/s" in run.stdout
    # host_layer rows have no sizes to plot: the PNG is written all the same, with a note.
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 1000
    assert f"wrote {png} (0 series)" in run.stdout
    document = json.loads(path.read_text())
    assert list(document["section_s"]) == ["host_layer"] and document["section_s"]["host_layer"] > 0
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
        # Memory-bound: bytes read + written, no FLOPs; throughput from our median.
        assert row["flops"] is None and row["flop_per_s"] is None and row["bytes"] > 0
        assert row["bytes_per_s"] == pytest.approx(row["bytes"] / row["median_s"])
        assert row["baseline_bytes_per_s"] == pytest.approx(row["bytes"] / row["baseline_s"])
        assert row["throughput"] == format_rate(row["bytes_per_s"], "B/s")
        assert row["throughput"].endswith("B/s") and row["params"]["total_tokens"] > 0


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
    assert len(lines) == 3 + 2 * 2  # header, legend, rule; two lines a row
    assert "2 ms (1-3)" in lines[3] and "2x" in lines[3] and lines[3].endswith("ok")
    assert lines[4] == "    4x4; vs numpy: 4 ms"
    assert lines[5].endswith("FAIL") and " - " in lines[5]
    assert lines[6] == "    8"


def test_throughput_units_read_well() -> None:
    assert format_rate(12.34e9, "FLOP/s") == "12.3 GFLOP/s"
    assert format_rate(1.2e12, "FLOP/s") == "1.2 TFLOP/s"
    assert format_rate(850e6, "B/s") == "850 MB/s"
    assert format_rate(999.7e6, "B/s") == "1 GB/s" and format_rate(999.4e6, "B/s") == "999 MB/s"
    assert format_rate(3.0, "B/s") == "3 B/s" and format_rate(2500.0, "B/s") == "2.5 kB/s"
    compute = BenchRow("s", "op", "x", "cpu", (0.5, 1.0, 2.0), flops=2e12, bytes=1e9)
    assert compute.throughput == "2 TFLOP/s"  # FLOP/s preferred when both are given
    assert compute.as_dict()["bytes_per_s"] == pytest.approx(1e9)
    memory = BenchRow("s", "op", "x", "cpu", (0.002,), bytes=1.7e9)
    assert memory.throughput == "850 GB/s" and memory.flop_per_s is None
    assert BenchRow("s", "op", "x", "cpu", flops=1e9).throughput == "-"  # no time
    lines = format_table([compute, memory]).splitlines()
    assert "throughput" in lines[0] and "2 TFLOP/s" in lines[3] and "850 GB/s" in lines[5]


def test_table_fits_120_columns() -> None:
    """The widest rows the main job prints (long op names, shapes and baseline names,
    times with ranges in seconds) stay within 120 characters a line, and every figure of
    the row is still on the table."""
    row = BenchRow(
        "grouped_matmul",
        "transposed_grouped_matmul fwd+bwd",
        "m8192 k512 n352 G64 f32 (tokens sorted by expert, 12 empty groups)",
        "cpu triton-interpret",
        (123.456, 101.2, 131.9),
        "per-group jnp.dot under jax.jit with dispatch (baseline)",
        (4.4, 4.5),
        True,
        flops=1.23e12,
    )
    text = format_table([row, BenchRow("s", "op", "x", "cpu")])
    assert max(map(len, text.splitlines())) <= 120, text
    for figure in ("123 s (101-132)", "0.036x", "4.45 s", "9.96 GFLOP/s", row.baseline, row.shape):
        assert figure in text, figure


def _sized_rows() -> list[BenchRow]:
    """Attention rows at three sequence lengths, grouped matmul rows at three group counts
    (ours timed once, against two baselines, as the section reports it)."""
    rows = []
    for length in (128, 256, 512):
        for op, factor in (("forward", 1.0), ("fwd+bwd", 3.5)):
            rows.append(
                BenchRow(
                    "attention",
                    f"varlen_attention {op}",
                    f"16x{length}",
                    "cpu xla",
                    (factor * length * 1e-5,) * 3,
                    "dense",
                    (factor * length**2 * 1e-7,) * 3,
                    True,
                    flops=factor * 4 * 64 * length**2,
                    params={"seq_len": length},
                )
            )
    for groups in (8, 16, 64):
        for baseline, seconds in (("per-group jnp.dot", 0.03), ("ragged_dot", 0.005 * groups)):
            rows.append(
                BenchRow(
                    "grouped_matmul",
                    "grouped_matmul forward",
                    f"G{groups}",
                    "cpu xla",
                    (0.05, 0.06, 0.04),
                    baseline,
                    (seconds,),
                    True,
                    flops=1e9,
                    params={"num_groups": groups},
                )
            )
    return [*rows, BenchRow("host_layer", "pack", "8", "cpu jit", (0.1,), bytes=1e6)]


def test_plot_series_and_png(tmp_path: Path) -> None:
    rows = _sized_rows()
    attention = collect_series(rows, "attention", "seq_len")
    assert len(attention) == 4 and all(len(s.points) == 3 for s in attention)
    assert [x for x, _ in attention[0].points] == [128, 256, 512]
    gmm = collect_series(rows, "grouped_matmul", "num_groups")
    # Ours once (not once per baseline), and each baseline: three lines of three points.
    assert sorted((s.baseline, s.method) for s in gmm) == [
        (False, "cpu xla"), (True, "per-group jnp.dot"), (True, "ragged_dot")
    ]  # fmt: skip
    assert dict(next(s for s in gmm if not s.baseline).points)[16] == pytest.approx(0.05)
    path = tmp_path / "sub" / "bench.png"
    assert plot_rows(rows, path) == 7
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 10_000


def test_json_round_trip_and_replot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _sized_rows()
    path, png = tmp_path / "bench.json", tmp_path / "again.png"
    write_json(path, rows, {"backend": "cpu"}, 1.0, {"attention": 0.5})
    assert read_json(path) == rows
    from bench.plot import main as plot_main

    plot_main([str(path), str(png)])
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {png} (7 series)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, text",
    [
        (None, "No such file or directory"),
        ("not json", "is not JSON"),
        ("[1, 2]", "holds no JSON object"),
        ('{"programs": []}', "holds no rows"),
    ],
)
def test_a_saved_run_that_is_not_one_is_a_usage_error(tmp_path: Path, capsys, content, text):
    """`bench.plot FILE` and `gpu-check --verdicts FILE` (and `--static`, `--ncu-summary`)
    say what is wrong with the file, not a traceback."""
    from bench import gpu_check
    from bench.plot import main as plot_main

    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    calls = [
        lambda: plot_main([str(path), str(tmp_path / "out.png")]),
        lambda: gpu_check.main(["--verdicts", str(path)]),
    ]
    if text != "holds no rows":  # --static and --ncu-summary take any object / any text
        calls.append(lambda: gpu_check.main(["--verdicts", str(path), "--static", str(path)]))
    for call in calls:
        with pytest.raises(SystemExit) as exit_info:
            call()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and text in err and str(path) in err, err
    if content is None:
        with pytest.raises(SystemExit):
            gpu_check.main(["--ncu-summary", str(path)])
        assert "cannot read" in capsys.readouterr().err


def test_arch_takes_numbers_sm_names_and_gpus(capsys) -> None:
    """`bench report --arch` and `bench tune --arch` take 90, sm_90 or h100 (the names
    `gpu-check --compile-for` takes), and refuse the rest naming what they take."""
    from bench import kernel_report, tune

    for parser in (kernel_report._parser(), tune._parser()):
        for text, capability in (("90", 90), ("sm_90", 90), ("H100", 90), ("a100", 80)):
            arch = parser.parse_args(["--arch", text]).arch
            assert arch in (capability, [capability])
        for text, message in (("75", "invalid choice: 75"), ("foo", "or a GPU (a100, h100)")):
            with pytest.raises(SystemExit):
                parser.parse_args(["--arch", text])
            assert message in capsys.readouterr().err


def test_plot_needs_matplotlib(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--only", "host_layer", "--plot", "out.png"])
    assert exit_info.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


# ---------------------------------------------------------------------------- subcommands


def test_subcommands_are_not_sections() -> None:
    expected = {"report", "tune", "aot", "train", "train-at-scale", "gpu-check"}
    assert set(SUBCOMMANDS) == expected and not set(SUBCOMMANDS) & set(SECTIONS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_its_module(name: str) -> None:
    assert importlib.util.find_spec(SUBCOMMANDS[name]) is not None, name


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_dispatches_the_rest_of_the_command_line(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    fake = types.ModuleType(SUBCOMMANDS[name])
    fake.main = lambda argv: calls.append(argv) or 3
    monkeypatch.setitem(sys.modules, SUBCOMMANDS[name], fake)  # imported lazily: found here
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--arch", "sm_90", "host_layer"])
    assert exit_info.value.code == 3 and calls == [["--arch", "sm_90", "host_layer"]]
    fake.main = lambda argv: None
    assert cli.run_subcommand(name, []) == 0


def test_missing_subcommand_module_says_so(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(SUBCOMMANDS, "tune", "bench._no_such_subcommand")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", "--help"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no bench._no_such_subcommand module" in err and "`tune` is not available" in err


def test_subcommand_import_errors_are_not_hidden(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "broken_subcommand.py").write_text("import no_such_dependency_of_a_subcommand\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(SUBCOMMANDS, "report", "broken_subcommand")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_a_subcommand"):
        cli.run_subcommand("report", [])


def test_a_subcommand_name_as_a_section_is_an_error(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "report"])
    assert "'report' is a subcommand: put it first" in capsys.readouterr().err


def test_kernel_report_lists_every_kernel_with_the_proxy(tmp_path: Path, capsys) -> None:
    """`python -m bench report` at one architecture and head_dim: one row per catalog
    kernel, the proxy on every tensor-core kernel, each kernel's loop computing each of
    its tile's products once, nothing flagged at d=64 (the target applies to d=128), and
    the JSON carries every column and the grid sizes."""
    from bench import kernel_report
    from triton_kernels.catalog import default_variants

    path = tmp_path / "report.json"
    kernel_report.main(["--arch", "90", "--head-dim", "64", "--json", str(path)])
    assert "no kernel flagged" in capsys.readouterr().out
    document = json.loads(path.read_text())
    rows = document["rows"]
    assert [r["kernel"] for r in rows] == [v.name for v in default_variants(90, (64,))]
    for row in rows:
        assert row["spill_bytes"] == 0 and row["flags"] == []
        assert row["mma_kind"] == "HGMMA" and row["instructions_per_mflop"] > 0
        assert row["mma_redundancy"] == 1.0, row
    grid = document["grid"]
    assert grid["grid_now"] <= grid["real_tiles"] <= grid["tile_rows"] < grid["grid_before"]


def test_full_reaches_the_sections_that_have_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """--full is an argument of the sections' main (not an environment variable they read);
    sections without sizes are called without it."""
    calls = []
    sized, plain = types.ModuleType("bench.sized"), types.ModuleType("bench.plain")
    sized.main = lambda *, full=False: calls.append(("sized", full)) or []
    plain.main = lambda: calls.append(("plain", None)) or []
    monkeypatch.setitem(sys.modules, "bench.sized", sized)
    monkeypatch.setitem(sys.modules, "bench.plain", plain)
    monkeypatch.delenv("GMM_BENCH_FULL", raising=False)
    for argv in (["--full"], [], ["--quick"]):
        mode = cli._apply_size(cli.parse_args([*argv, "host_layer"]))
        cli.run_sections(["sized", "plain"], full=mode == "full")
    assert calls == [("sized", True), ("plain", None), ("sized", False), ("plain", None)] * 1 + [
        ("sized", False), ("plain", None)
    ]  # fmt: skip
    monkeypatch.setenv("GMM_BENCH_FULL", "1")
    assert cli._apply_size(cli.parse_args(["host_layer"])) == "full"
    assert cli._apply_size(cli.parse_args(["--quick", "host_layer"])) == "quick"


def test_the_compiled_summary_runs_with_full_sizes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling for an H100 and a TPU takes over a minute on 2 cores: the quick run (make
    bench) names the command instead; --full runs it."""
    from bench import aot

    calls = []
    monkeypatch.setattr(aot, "summary_line", lambda: calls.append(1) or "compiled: 3x less")
    quick = cli._compiled_summary("quick")
    assert calls == [] and "python -m bench aot" in quick
    assert "compiled: 3x less" in cli._compiled_summary("full") and calls == [1]
