"""Structured bench results: one `BenchRow` per measurement, the summary table, the JSON file.

Every section returns its rows; `python -m bench` prints them as one table at the end and,
with ``--json PATH``, writes them with a description of the machine they were measured on.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = ("op", "shape", "backend", "median (min-max)", "baseline", "baseline time", "base/ours")


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One measurement: our op's repeat times, its baseline's, and its correctness check.

    `times` and `baseline_times` hold every timed repeat in seconds (after warm-up); either
    may be empty for a row that is a check only. `ok` is None where nothing was checked.
    """

    section: str
    op: str
    shape: str
    backend: str
    times: tuple[float, ...] = ()
    baseline: str = ""
    baseline_times: tuple[float, ...] = ()
    ok: bool | None = None

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
        }
        return out


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
    return (
        row.op,
        row.shape,
        row.backend,
        format_spread(row.times),
        row.baseline or "-",
        format_seconds(row.baseline_s),
        ratio,
        row.check,
    )


def format_table(rows: Sequence[BenchRow]) -> str:
    """One aligned text table of all rows (text left-aligned, figures right-aligned)."""
    header = (*COLUMNS, "check")
    body = [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = {3, 5, 6}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(cells) for cells in body)])


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_description(flags: dict[str, Any]) -> dict[str, Any]:
    """Versions, backend, device and host of this run, with the command-line flags."""
    import jax

    return {
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
    path: Path, rows: Sequence[BenchRow], machine: dict[str, Any], wall_s: float
) -> None:
    """Writes {"machine", "wall_s", "rows"} to `path` (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"machine": machine, "wall_s": wall_s, "rows": [r.as_dict() for r in rows]}
    path.write_text(json.dumps(document, indent=2) + "\n")
