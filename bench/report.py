"""Structured bench results: one `BenchRow` per measurement, the summary table, the JSON file.

Every section returns its rows; `python -m bench` prints them as one table at the end and,
with ``--json PATH``, writes them with a description of the machine they were measured on.

Throughput conventions (a row's `flops` / `bytes` are the useful work of ONE timed call,
so `throughput` = work / median time; the baseline does the same useful work):

* attention: only allowed (unmasked) score entries count, 4 * head_dim FLOPs each per
  query head for the forward (QK^T and PV, 2 * head_dim each); forward + backward counts
  3.5x the forward (the backward's five matmuls, QK^T recomputed, are 2.5x the forward:
  FlashAttention's benchmark convention);
* grouped matmul: 2 * m * k * n for the forward (m = rows routed to a group), 3x that for
  forward + backward (dlhs and drhs are one such product each);
* memory-bound ops (host layer, segment masks, mask processing, softmax): `bytes` = the
  bytes the op must read plus write (its inputs and outputs), not its internal traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Forward + backward counts this many forwards (the module docstring's conventions). The one
# definition: the sections and bench/runner.py read it from here.
FWD_BWD_FLOP_FACTOR = {"attention": 3.5, "matmul": 3.0}

# Each row takes two lines, so that the table fits ~120 columns (TABLE_WIDTH) whatever the
# baseline's name: the figures on the first, under these headers; the shape and the baseline
# (name and median time) on an indented second line. `--json` keeps every figure.
COLUMNS = ("op", "backend", "median (min-max)", "throughput", "base/ours")
_RIGHT_ALIGNED = {2, 3, 4}  # the figures' columns
TABLE_WIDTH = 120


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One measurement: our op's repeat times, its baseline's, and its correctness check.

    `times` and `baseline_times` hold every timed repeat in seconds (after warm-up); either
    may be empty for a row that is a check only. `ok` is None where nothing was checked.
    `flops` / `bytes`: the useful work of one call (module docstring), None where no such
    count means anything; `throughput` prefers FLOP/s when both are given. `params`: the
    row's sizes as numbers for plots, e.g. {"seq_len": 512} or {"num_groups": 64}.
    """

    section: str
    op: str
    shape: str
    backend: str
    times: tuple[float, ...] = ()
    baseline: str = ""
    baseline_times: tuple[float, ...] = ()
    ok: bool | None = None
    flops: float | None = None
    bytes: float | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    @property
    def baseline_s(self) -> float | None:
        return statistics.median(self.baseline_times) if self.baseline_times else None

    @property
    def ratio(self) -> float | None:
        """Baseline median / our median: above 1 means ours is faster."""
        if self.median_s is None or self.baseline_s is None or self.median_s == 0:
            return None
        return self.baseline_s / self.median_s

    @property
    def flop_per_s(self) -> float | None:
        """Useful FLOP per second of our median call."""
        return _rate(self.flops, self.median_s)

    @property
    def bytes_per_s(self) -> float | None:
        """Useful bytes per second of our median call."""
        return _rate(self.bytes, self.median_s)

    @property
    def throughput(self) -> str:
        """'1.23 TFLOP/s', '850 MB/s', or '-' where the row has no work count or time."""
        if self.flop_per_s is not None:
            return format_rate(self.flop_per_s, "FLOP/s")
        if self.bytes_per_s is not None:
            return format_rate(self.bytes_per_s, "B/s")
        return "-"

    @property
    def check(self) -> str:
        return {None: "-", True: "ok", False: "FAIL"}[self.ok]

    def as_dict(self) -> dict[str, Any]:
        """Every field plus the derived figures, JSON-ready."""
        out = dataclasses.asdict(self)
        out["times"], out["baseline_times"] = list(self.times), list(self.baseline_times)
        out |= {
            "median_s": self.median_s,
            "min_s": min(self.times) if self.times else None,
            "max_s": max(self.times) if self.times else None,
            "baseline_s": self.baseline_s,
            "ratio": self.ratio,
            "check": self.check,
            "flop_per_s": self.flop_per_s,
            "bytes_per_s": self.bytes_per_s,
            "baseline_flop_per_s": _rate(self.flops, self.baseline_s),
            "baseline_bytes_per_s": _rate(self.bytes, self.baseline_s),
            "throughput": self.throughput,
        }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRow:
        """The row back from `as_dict`'s output (derived figures are recomputed)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {key: value for key, value in data.items() if key in fields}
        kept["times"] = tuple(kept.get("times", ()))
        kept["baseline_times"] = tuple(kept.get("baseline_times", ()))
        return cls(**kept)


def _rate(work: float | None, seconds: float | None) -> float | None:
    if work is None or not seconds:
        return None
    return work / seconds


_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def format_rate(per_second: float, unit: str) -> str:
    """A rate with the SI prefix that keeps the number in [1, 1000): '12.3 GFLOP/s',
    '1.2 TFLOP/s', '850 MB/s' (decimal prefixes, as hardware peak figures are quoted)."""
    # 999.7e6 rounds to "1 G", not "1000 M": a prefix applies from 999.5 of the one below.
    scale, prefix = next(((s, p) for s, p in _PREFIXES if per_second >= s * 0.9995), _PREFIXES[-1])
    value = per_second / scale
    return f"{value:.3g} {prefix}{unit}" if value < 100 else f"{value:.0f} {prefix}{unit}"


def _unit(seconds: float) -> tuple[float, str]:
    if seconds < 1e-3:
        return 1e6, "us"
    if seconds < 1.0:
        return 1e3, "ms"
    return 1.0, "s"


def format_seconds(seconds: float | None) -> str:
    """'3.49 ms', '812 us', '1.25 s'; '-' for no time."""
    if seconds is None:
        return "-"
    scale, unit = _unit(seconds)
    value = seconds * scale
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def format_spread(times: Sequence[float]) -> str:
    """Median with min-max in the median's unit, e.g. '3.49 ms (3.10-3.92)'."""
    if not times:
        return "-"
    median = statistics.median(times)
    if len(times) == 1:
        return format_seconds(median)
    scale, _ = _unit(median)
    low, high = min(times) * scale, max(times) * scale
    return f"{format_seconds(median)} ({low:.3g}-{high:.3g})"


def _cells(row: BenchRow) -> tuple[str, ...]:
    ratio = "-" if row.ratio is None else f"{row.ratio:.3g}x"
    return (row.op, row.backend, format_spread(row.times), row.throughput, ratio, row.check)


def _detail(row: BenchRow) -> list[str]:
    """The second line: shape, then the baseline and its median time (if any); a third
    line for the baseline where both do not fit TABLE_WIDTH."""
    if not row.baseline and row.baseline_s is None:
        return [f"    {row.shape}"]
    baseline = f"vs {row.baseline or '-'}: {format_seconds(row.baseline_s)}"
    joined = f"    {row.shape}; {baseline}"
    return [joined] if len(joined) <= TABLE_WIDTH else [f"    {row.shape}", f"    {baseline}"]


def format_table(rows: Sequence[BenchRow]) -> str:
    """One aligned text table, two lines a row: op, backend and the figures (text
    left-aligned, figures right-aligned), then the shape and the baseline, indented (on
    two lines where one would pass TABLE_WIDTH)."""
    header = (*COLUMNS, "check")
    body = [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in _RIGHT_ALIGNED else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    legend = "    shape; vs baseline: its median time"
    lines = [line(header), legend, "  ".join("-" * w for w in widths)]
    for row, cells in zip(rows, body, strict=True):
        lines += [line(cells), *_detail(row)]
    return "\n".join(lines)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_commit() -> str | None:
    """The checkout's commit (with "-dirty" where tracked files differ from it), or
    $BENCH_COMMIT where there is no git repository (a copy of the working tree)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("BENCH_COMMIT")
    if head.returncode != 0:
        return os.environ.get("BENCH_COMMIT")
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_description(flags: dict[str, Any]) -> dict[str, Any]:
    """Versions, backend, device and host of this run, its commit, the command-line flags."""
    import jax

    cuda_plugin = next(
        (v for d in ("jax-cuda13-plugin", "jax-cuda12-plugin") if (v := _version(d))), None
    )
    return {
        "commit": source_commit(),
        "torch": _version("torch"),
        "jax_cuda_plugin": cuda_plugin,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "triton": _version("triton"),
        "jax_triton": _version("jax-triton"),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "flags": flags,
    }


def write_json(
    path: Path,
    rows: Sequence[BenchRow],
    machine: dict[str, Any],
    wall_s: float,
    section_s: dict[str, float] | None = None,
) -> None:
    """Writes {"machine", "wall_s", "section_s", "rows"} to `path` (parent folders created).

    `section_s`: each section's wall time in seconds, in the order they ran.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": machine,
        "wall_s": wall_s,
        "section_s": section_s or {},
        "rows": [r.as_dict() for r in rows],
    }
    path.write_text(json.dumps(document, indent=2, default=_json_scalar) + "\n")


def read_json(path: Path) -> list[BenchRow]:
    """The rows of a file `write_json` wrote."""
    return rows_of(json.loads(path.read_text()))


def readable_text_argument(text: str) -> str:
    """An argparse type: the contents of the text file `text`, or a usage error saying why
    it cannot be read (not a traceback)."""
    try:
        return Path(text).read_text()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text} is not a text file") from None


def json_object_argument(text: str) -> dict[str, Any]:
    """An argparse type: the JSON object in the file `text`, or a usage error."""
    try:
        document = json.loads(readable_text_argument(text))
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text} is not JSON ({error})") from None
    if not isinstance(document, dict):
        raise argparse.ArgumentTypeError(f"{text} holds no JSON object")
    return document


def bench_json_argument(text: str) -> dict[str, Any]:
    """An argparse type: a document `write_json` wrote (`python -m bench --json`, `python -m
    bench gpu-check --json`), or a usage error."""
    document = json_object_argument(text)
    if not isinstance(document.get("rows"), list):
        raise argparse.ArgumentTypeError(
            f"{text} holds no rows: not a file of python -m bench --json or gpu-check --json"
        )
    return document


def rows_of(document: Mapping[str, Any]) -> list[BenchRow]:
    """The rows of a document `write_json` wrote, as read from its file."""
    return [BenchRow.from_dict(row) for row in document["rows"]]


def _json_scalar(value: Any) -> Any:
    """numpy scalars (in `params`) as Python numbers; anything else is an error."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable: {value!r}")
