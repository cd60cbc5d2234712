"""Runs the benchmark sections and prints one summary table: `python -m bench [options]`.

    python -m bench [--quick | --full] [--only NAME ...] [--json PATH] [NAME ...]

Each section's `main()` prints its own lines and returns `BenchRow`s (bench/report.py); the
rows are printed as one table at the end (stdout), while a progress bar over the sections
goes to stderr. A row whose correctness check failed makes the run exit non-zero. Speed
goals are printed as ratios against a baseline measured in the same run, and reported, not
enforced. On a machine without a GPU, JAX is kept on the CPU (and the Triton kernels run
through Triton's interpreter, at small sizes only). `--quick` (the default) keeps the CPU
run to a few minutes; `--full` runs the larger sizes (`GMM_BENCH_FULL=1` does the same).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

from bench.report import BenchRow, format_table, machine_description, write_json

SECTIONS = (
    "host_layer",
    "segment_masks",
    "launcher",
    "attention",
    "grouped_matmul",
    "splash_masks",
    "expert_parallel",
    "ring_attention",
)


def _prefer_cpu_without_gpu() -> None:
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # Eight host devices for the mesh sections (ring attention, expert parallelism);
        # they share the CPU's cores, so those rows measure overhead, not speed-up.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n")[0] if __doc__ else None
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (the default)")
    size.add_argument("--full", action="store_true", help="the larger sizes (minutes on a CPU)")
    parser.add_argument(
        "--only", nargs="+", action="extend", default=[], metavar="NAME", help="sections to run"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every row as JSON")
    parser.add_argument("sections", nargs="*", metavar="NAME", help="same as --only")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses and validates the flags; an unknown section name exits listing the valid ones."""
    parser = _parser()
    args = parser.parse_args(argv)
    chosen = [*args.only, *args.sections]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.chosen = list(dict.fromkeys(chosen)) or list(SECTIONS)
    return args


def _apply_size(args: argparse.Namespace) -> str:
    """Sets the sections' size switches from --quick / --full; returns 'quick' or 'full'."""
    if args.full:
        os.environ["GMM_BENCH_FULL"] = "1"
    elif args.quick:
        os.environ["GMM_BENCH_FULL"] = "0"
    return "full" if os.environ.get("GMM_BENCH_FULL") == "1" else "quick"


@contextlib.contextmanager
def _progress(names: Sequence[str]) -> Iterator[tqdm]:
    """A bar over the sections on stderr (hidden when stderr is not a terminal)."""
    bar = tqdm(total=len(names), desc="bench", unit="section", file=sys.stderr, disable=None)
    # Printed lines go through `tqdm.write`, above the bar, still to stdout.
    with bar, contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
        yield bar


def run_sections(names: Sequence[str]) -> list[BenchRow]:
    """Runs each section in turn under the progress bar; returns all their rows."""
    rows: list[BenchRow] = []
    with _progress(names) as bar:
        for name in names:
            bar.set_postfix_str(name)
            print(f"\n## {name}")
            rows += importlib.import_module(f"bench.{name}").main()
            bar.update()
    return rows


def main(argv: Sequence[str]) -> None:
    """The command line: run, print the summary table, write JSON, exit 1 on a failed check."""
    args = parse_args(argv)
    mode = _apply_size(args)
    _prefer_cpu_without_gpu()
    import jax

    start = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {jax.default_backend()} ({device}), {mode} sizes")
    rows = run_sections(args.chosen)
    wall = time.perf_counter() - start
    print(f"\n## summary ({mode} sizes, base/ours > 1: ours is faster)\n{format_table(rows)}")
    print(f"\ntotal wall time {wall:.1f} s")
    if args.json is not None:
        flags = {"mode": mode, "sections": args.chosen, "json": str(args.json)}
        write_json(args.json, rows, machine_description(flags), wall)
        print(f"wrote {args.json}")
    failures = [f"{row.section}: {row.op} {row.shape}" for row in rows if row.ok is False]
    if failures:
        raise SystemExit("failed checks:\n  " + "\n  ".join(failures))
    print("all bench checks passed")


if __name__ == "__main__":
    main(sys.argv[1:])
