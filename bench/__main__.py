"""Runs the benchmark sections and prints one summary table: `python -m bench [options]`.

    python -m bench [--quick | --full] [--only NAME ...] [--json PATH] [--plot PATH] [NAME ...]
    python -m bench report [ARGS ...]   # bench.kernel_report.main(ARGS)
    python -m bench tune [ARGS ...]     # bench.tune.main(ARGS)
    python -m bench aot [ARGS ...]      # bench.aot.main(ARGS): compiled for H100/A100/TPUs
    python -m bench train [ARGS ...]    # bench.train.main(ARGS): the example LM, ours vs dense
    python -m bench train-at-scale [ARGS ...]  # its train step compiled for 8-256 chips
    python -m bench gpu-check [ARGS ...]  # bench.gpu_check.main(ARGS): GPU rows + anchors

Each section's `main()` prints its own lines and returns `BenchRow`s (bench/report.py); the
rows are printed as one table at the end (stdout), while a progress bar over the sections
goes to stderr. A row whose correctness check failed makes the run exit non-zero. Speed
goals are printed as ratios against a baseline measured in the same run, and reported, not
enforced. On a machine without a GPU, JAX is kept on the CPU (and the Triton kernels run
through Triton's interpreter, at small sizes only). `--quick` (the default) keeps the CPU
run under 3 minutes on 2 cores; `--full` runs the larger sizes (passed to each section as
`main(full=True)`; GMM_BENCH_FULL=1 is read here only, as `--full`) and ends with the
memory summary compiled for an H100 and a TPU (`python -m bench aot`'s one line).
`--plot PATH` draws time against sequence length (attention) and group count (grouped
matmul) as a PNG (bench/plot.py; needs matplotlib, in the `test` extra).

A first argument naming a subcommand (`report`, `tune`) hands the rest of the command line
to that module's `main(argv)`. Subcommands are recognised only in first position and no
section shares a subcommand's name, so `python -m bench host_layer` is never one.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

from bench.quiet_start import has_nvidia_driver, start_jax_quietly
from bench.report import BenchRow, format_table, machine_description, write_json

SECTIONS = (
    "host_layer",
    "segment_masks",
    "launcher",
    "attention",
    "grouped_matmul",
    "splash_masks",
    "block_sparse",
    "expert_parallel",
    "ring_attention",
)
# Subcommand -> the module whose `main(argv)` runs it, imported only when asked for (the
# modules are optional: a checkout without one says so instead of failing at start-up).
SUBCOMMANDS = {
    "report": "bench.kernel_report",
    "tune": "bench.tune",
    "aot": "bench.aot",
    "train": "bench.train",
    "train-at-scale": "bench.train_at_scale",
    "gpu-check": "bench.gpu_check",
}
assert not set(SUBCOMMANDS) & set(SECTIONS), "a section must not share a subcommand's name"


def _prefer_cpu_without_gpu(*, fake_devices: bool = True) -> None:
    """Keeps JAX on the GPU and CPU of a GPU machine and on the CPU of a machine with no
    accelerator (an explicit JAX_PLATFORMS wins) and, without a GPU and with
    `fake_devices`, asks XLA for 8 host devices. Must run before JAX is imported."""
    has_tpu = bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))
    if has_nvidia_driver():
        # libtpu (the test extra's, for compile-only TPUs) would otherwise look for a TPU
        # at start-up and print what it cannot find; compile_for loads it when asked.
        if not has_tpu:
            os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")
        # The GPU rows time PyTorch's kernels in the same process: JAX must not hold 75%
        # of the GPU's memory from the start.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    elif not has_tpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # Eight host devices for the mesh sections (ring attention, expert parallelism);
        # they share the CPU's cores, so those rows measure overhead, not speed-up.
        flags = os.environ.get("XLA_FLAGS", "")
        if fake_devices and "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n")[0] if __doc__ else None,
        epilog="subcommands (first argument): "
        + "; ".join(
            f"{name} [ARGS ...] runs {module}.main(ARGS)" for name, module in SUBCOMMANDS.items()
        ),
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (the default)")
    size.add_argument("--full", action="store_true", help="the larger sizes (minutes on a CPU)")
    parser.add_argument(
        "--only",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME",
        help=f"sections to run (default: all), of: {', '.join(SECTIONS)}",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every row as JSON")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="draw time vs sequence length / group count as a PNG (needs matplotlib)",
    )
    parser.add_argument("sections", nargs="*", metavar="NAME", help="same as --only")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses and validates the flags; an unknown section name exits listing the valid ones."""
    parser = _parser()
    args = parser.parse_args(argv)
    chosen = [*args.only, *args.sections]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        hint = [f"'{n}' is a subcommand: put it first" for n in unknown if n in SUBCOMMANDS]
        parser.error(
            f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}"
            + "".join(f" ({h})" for h in hint)
        )
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # Fail before minutes of benchmarks, not after them.
        parser.error(
            "--plot needs matplotlib: pip install -e '.[test]' (or pip install matplotlib)"
        )
    args.chosen = list(dict.fromkeys(chosen)) or list(SECTIONS)
    return args


def _apply_size(args: argparse.Namespace) -> str:
    """'full' or 'quick' from --quick / --full (GMM_BENCH_FULL=1 still means --full where
    neither is given); the sections get it as `main(full=...)`, not from the environment."""
    if args.full or (not args.quick and os.environ.get("GMM_BENCH_FULL") == "1"):
        return "full"
    return "quick"


@contextlib.contextmanager
def _progress(names: Sequence[str]) -> Iterator[tqdm]:
    """A bar over the sections on stderr (hidden when stderr is not a terminal)."""
    bar = tqdm(total=len(names), desc="bench", unit="section", file=sys.stderr, disable=None)
    # Printed lines go through `tqdm.write`, above the bar, still to stdout.
    with bar, contextlib.redirect_stdout(DummyTqdmFile(sys.stdout)):
        yield bar


def _run_section(name: str, full: bool) -> list[BenchRow]:
    """`bench.<name>.main()`, with `full=` where the section has sizes to choose."""
    main = importlib.import_module(f"bench.{name}").main
    takes_full = "full" in inspect.signature(main).parameters
    return main(full=full) if takes_full else main()


def run_sections(
    names: Sequence[str], full: bool = False
) -> tuple[list[BenchRow], dict[str, float]]:
    """Runs each section in turn under the progress bar; returns all their rows and each
    section's wall time in seconds (import included)."""
    rows: list[BenchRow] = []
    seconds: dict[str, float] = {}
    with _progress(names) as bar:
        for name in names:
            bar.set_postfix_str(name)
            print(f"\n## {name}")
            start = time.perf_counter()
            rows += _run_section(name, full)
            seconds[name] = time.perf_counter() - start
            print(f"({name}: {seconds[name]:.1f} s)")
            bar.update()
    return rows, seconds


def run_subcommand(name: str, argv: Sequence[str]) -> int:
    """Imports `SUBCOMMANDS[name]` and returns its `main(argv)`'s exit status (None -> 0).

    A missing module is reported on stderr with status 2; an import error inside an
    existing module is not hidden (it is re-raised)."""
    module_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(
            f"python -m bench {name}: this checkout has no {module_name} module "
            f"({module_name.replace('.', '/')}.py), so `{name}` is not available",
            file=sys.stderr,
        )
        return 2
    status = module.main(list(argv))
    return 0 if status is None else int(status)


def _plot(path: Path, rows: Sequence[BenchRow]) -> None:
    from bench.plot import plot_rows  # matplotlib is imported only when asked for

    plotted = plot_rows(rows, path)
    print(f"wrote {path} ({plotted} series)")


def _compiled_summary(mode: str) -> str:
    """`python -m bench aot`'s one line (what the hardware compilers say), or why not; with
    quick sizes only where to find it (compiling for an H100 and a TPU takes over a minute
    on 2 CPU cores, as long as the quick sections together)."""
    if mode != "full":
        return (
            "\nnot compiled for an H100 and a TPU at quick sizes (over a minute): "
            "python -m bench aot --quick --no-cycles (the memory alone), or python -m bench --full"
        )
    try:
        from bench.aot import summary_line

        return "\n" + summary_line() + " (details: python -m bench aot)"
    except Exception as error:  # the timed table above stands on its own
        return f"\ncompiled summary unavailable: {type(error).__name__}: {error}"


def main(argv: Sequence[str]) -> None:
    """The command line: run, print the summary table, write JSON / PNG, exit 1 on a failed
    check; or hand the command line to a subcommand."""
    if argv and argv[0] in SUBCOMMANDS:
        _prefer_cpu_without_gpu(fake_devices=False)
        start_jax_quietly()
        raise SystemExit(run_subcommand(argv[0], argv[1:]))
    args = parse_args(argv)
    mode = _apply_size(args)
    _prefer_cpu_without_gpu()
    start_jax_quietly()
    import jax

    start = time.perf_counter()
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {jax.default_backend()} ({device}), {mode} sizes")
    rows, section_s = run_sections(args.chosen, full=mode == "full")
    wall = time.perf_counter() - start
    print(f"\n## summary ({mode} sizes, base/ours > 1: ours is faster)\n{format_table(rows)}")
    print(f"\ntotal wall time {wall:.1f} s")
    print(_compiled_summary(mode))
    if args.json is not None:
        flags = {"mode": mode, "sections": args.chosen, "json": str(args.json)}
        flags |= {"plot": str(args.plot)} if args.plot is not None else {}
        write_json(args.json, rows, machine_description(flags), wall, section_s)
        print(f"wrote {args.json}")
    if args.plot is not None:
        _plot(args.plot, rows)
    failures = [f"{row.section}: {row.op} {row.shape}" for row in rows if row.ok is False]
    if failures:
        raise SystemExit("failed checks:\n  " + "\n  ".join(failures))
    print("all bench checks passed")


if __name__ == "__main__":
    main(sys.argv[1:])
