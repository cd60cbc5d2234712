"""Time against size of a bench run, as a PNG: `python -m bench --plot PATH`.

    python -m bench --only attention grouped_matmul --plot bench.png
    python -m bench.plot bench.json bench.png   # replot a run saved with --json

One subplot per op family whose rows carry a size in `BenchRow.params`: attention against
`seq_len` (tokens per document), grouped matmul against `num_groups`. In each, one line per
(op, backend) of ours (solid) and per (op, baseline) (dashed): median seconds per call,
log-scaled (the methods differ by orders of magnitude); the size axis is log2-scaled when
it spans at least 4x. A run without such rows still writes a PNG that says so.

matplotlib is imported here only, through its Agg canvas (no pyplot, no display, and no
change to the process-wide backend); `python -m bench` imports this module only for --plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.report import BenchRow, bench_json_argument, rows_of

# section -> (its rows' size parameter, the axis label)
FAMILIES: dict[str, tuple[str, str]] = {
    "attention": ("seq_len", "sequence length (tokens per document)"),
    "grouped_matmul": ("num_groups", "groups (experts)"),
}

_BASELINE_MARKERS = "s^Dv"


@dataclasses.dataclass(frozen=True)
class Series:
    """One line: `op` run by `method` (our backend or the baseline's name); `points` are
    (size, median seconds), sorted by size."""

    op: str
    method: str
    baseline: bool
    points: tuple[tuple[float, float], ...]

    @property
    def label(self) -> str:
        return f"{self.op}: {self.method}" if self.baseline else f"{self.op} ({self.method})"


def collect_series(rows: Sequence[BenchRow], section: str, size_key: str) -> list[Series]:
    """The lines of one family. Rows that repeat our timing against a second baseline
    (grouped matmul: dense loop and ragged_dot) give one point of ours: the first."""
    lines: dict[tuple[str, str, bool], dict[float, float]] = {}
    for row in rows:
        if row.section != section or size_key not in row.params:
            continue
        size = float(row.params[size_key])
        for method, baseline, seconds in (
            (row.backend, False, row.median_s),
            (row.baseline, True, row.baseline_s),
        ):
            if seconds is not None:
                lines.setdefault((row.op, method, baseline), {}).setdefault(size, seconds)
    return [
        Series(op, method, baseline, tuple(sorted(points.items())))
        for (op, method, baseline), points in lines.items()
    ]


def _draw_family(ax, series: Sequence[Series], title: str, x_label: str) -> None:
    from matplotlib.ticker import NullLocator

    sizes = sorted({x for s in series for x, _ in s.points})
    ops = list(dict.fromkeys(line.op for line in series))
    baselines = list(dict.fromkeys(line.method for line in series if line.baseline))
    for line in series:
        xs, ys = zip(*line.points, strict=True)
        # One colour per op: ours solid with circles, each baseline dashed with its marker.
        marker = _BASELINE_MARKERS[baselines.index(line.method) % 4] if line.baseline else "o"
        ax.plot(xs, ys, label=line.label, color=f"C{ops.index(line.op) % 10}", marker=marker,
                linestyle="--" if line.baseline else "-")  # fmt: skip
    ax.set_yscale("log")
    if sizes[0] > 0 and sizes[-1] / sizes[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{x:g}" for x in sizes])  # the measured sizes, not powers of 2
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(title=title, xlabel=x_label, ylabel="median time per call (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small")


def plot_rows(rows: Sequence[BenchRow], path: Path) -> int:
    """Draws the families found in `rows` into a PNG at `path` (parent folders created);
    returns the number of lines drawn (0: the PNG holds a note that nothing had sizes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families = [
        (section, x_label, found)
        for section, (size_key, x_label) in FAMILIES.items()
        if (found := collect_series(rows, section, size_key))
    ]
    figure = Figure(figsize=(6.5 * max(1, len(families)), 4.8), layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas renders the PNG
    if not families:
        ax = figure.subplots()
        ax.axis("off")
        ax.text(0.5, 0.5, "no rows with sizes to plot\n(run the attention or grouped_matmul "
                "section)", ha="center", va="center")  # fmt: skip
    else:
        axes = figure.subplots(1, len(families), squeeze=False)[0]
        for ax, (section, x_label, series) in zip(axes, families, strict=True):
            _draw_family(ax, series, section, x_label)
        figure.suptitle("python -m bench: ours (solid) against the baseline (dashed)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=110)
    return sum(len(series) for _, _, series in families)


def main(argv: Sequence[str]) -> None:
    """`python -m bench.plot BENCH.json OUT.png`: the plot of a saved run."""
    parser = argparse.ArgumentParser(prog="python -m bench.plot", description=main.__doc__)
    parser.add_argument(
        "json", type=bench_json_argument, help="a file written by python -m bench --json"
    )
    parser.add_argument("png", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    count = plot_rows(rows_of(args.json), args.png)
    print(f"wrote {args.png} ({count} series)")


if __name__ == "__main__":
    main(sys.argv[1:])
