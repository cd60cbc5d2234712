"""`python -m bench gpu-check`: the GPU rows with their anchors, JSON, a per-kernel profile.

    python -m bench gpu-check [--dry-run] [--rows KEY ...] [--json PATH] [--budget-s S]
                              [--no-torch] [--ab after|with-row|only]
    python -m bench gpu-check --profile KEY      # under ncu: ours alone on one row
    python -m bench gpu-check --ncu-summary FILE  # our kernels vs the rest, from ncu's text
    python -m bench gpu-check --verdicts FILE     # A/B anchors vs the default, issue 27's bars
    python -m bench gpu-check --compile-for h100 [--rows KEY ...] [--json PATH]  # not run
    python -m bench gpu-check --verdicts FILE --static PATH  # beside what ptxas made of them

Runs every case of bench/gpu_rows.py through bench/runner.py (back-to-back timing, one
sync per repeat; fwd+bwd returns the output with the gradients; every anchor checked
against ours) and prints one table; `--json` writes the rows with the machine, versions
and commit (bench/results/ keeps the files the README's figures come from). `--dry-run`
runs the same rows at toy sizes on whatever JAX has (on a CPU: Triton's interpreter, XLA's
attention standing in for cuDNN, no PyTorch), one call each: the check that the code runs.
`--compile-for TARGET` compiles, on a host without that GPU, ours and our A/B anchors of
every row at the GPU's sizes (bench/preflight.py): what a device call would run, checked
before one; its `--json` is what `--verdicts FILE --static PATH` sets beside each A/B row
(the kernels the anchor changes, as ptxas made them). bench/gpu_check.sh is the whole
device check: this, one ncu profile and the GPU tests.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

from bench.report import (
    BenchRow,
    bench_json_argument,
    format_table,
    json_object_argument,
    machine_description,
    readable_text_argument,
    write_json,
)

REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench gpu-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the usage lines as written
    )
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, one call each")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=[],
        metavar="KEY",
        help="only the cases whose key contains one of these",
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write the rows as JSON (with --compile-for: its programs and kernels)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the remaining cases past this many seconds",
    )
    parser.add_argument("--no-torch", action="store_true", help="leave PyTorch's anchors out")
    _add_ab_arguments(parser)
    parser.add_argument(
        "--profile",
        metavar="KEY",
        help="ours alone on the first case matching KEY, 3 calls (for ncu)",
    )
    parser.add_argument(
        "--ncu-summary",
        type=readable_text_argument,
        metavar="FILE",
        help="summarise an ncu --print-summary per-kernel text file",
    )
    parser.add_argument(
        "--verdicts",
        type=bench_json_argument,
        metavar="FILE",
        help="from a --json file: each A/B anchor against the default, and issue 27's bars "
        "(bench/verdicts.py)",
    )
    parser.add_argument(
        "--static",
        type=json_object_argument,
        metavar="PATH",
        help="with --verdicts: a --compile-for --json file of the same commit; each A/B row "
        "then names the kernels its anchor changes, with what ptxas made of them",
    )
    parser.add_argument(
        "--ptxas",
        metavar="PATH",
        help="with --compile-for: assemble the kernels with this ptxas instead of Triton's "
        "bundled one (e.g. a CUDA 13 release from the nvidia-cuda-nvcc wheel, as the "
        "device's jaxlib may use)",
    )
    parser.add_argument(
        "--compile-for",
        metavar="TARGET",
        help="compile ours and our A/B anchors of every row (at the GPU's sizes, every "
        "A/B flag on; the Hopper ones fail elsewhere) for TARGET (e.g. h100) on this host, "
        "without running them (bench/preflight.py); exit 1 if one fails or holds a while "
        "loop, or ptxas serialized or refused one of their kernels",
    )
    return parser


def _add_ab_arguments(parser: argparse.ArgumentParser) -> None:
    """The A/B anchors' flags: which run, and where."""
    parser.add_argument(
        "--tma",
        action="store_true",
        help="A/B anchors of tensor-descriptor (TMA) loads: the dK/dV tile before its TMA "
        "default on two varlen rows, gmm with TMA on the grouped matmul rows (on with "
        "--dry-run)",
    )
    parser.add_argument(
        "--host-descriptors",
        action="store_true",
        help="A/B anchors of TMA with descriptors the launch encodes (jaxlib >= 0.11.2): "
        "gmm so on the grouped matmul rows, one a tile and persistent, and each varlen "
        "kernel with either kind of descriptor on two rows (on with --dry-run)",
    )
    parser.add_argument(
        "--warp-specialized",
        action="store_true",
        help="A/B anchors of warp-specialized kernels (Hopper): gmm on the grouped matmul "
        "rows, the attention forward on three varlen rows (on with --dry-run)",
    )
    parser.add_argument(
        "--warp-specialized-dkdv",
        action="store_true",
        help="A/B anchors of the warp-specialized dK/dV kernel on two varlen rows (on "
        "with --dry-run)",
    )
    parser.add_argument(
        "--ab",
        choices=("after", "with-row", "only"),
        default="after",
        help="where the A/B anchors (ours in other configurations) run: 'after' every row's "
        "other anchors, with ours timed again beside them (the default: a budget reaches "
        "issue 27's bars first), 'with-row' in each row, or 'only' those (a second call); "
        "--profile and --compile-for take every case whole",
    )


def our_kernel_names() -> frozenset[str]:
    """The names of the package's Triton kernels (`@triton.jit` functions in
    triton_kernels/ whose names end in `_kernel`): what a profile counts as ours."""
    names = set()
    for path in (REPO / "triton_kernels").rglob("*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\n\s*def (\w+_kernel)\b", path.read_text()))
    return frozenset(names)


_TIME = re.compile(r"^\s*gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)(?:\s+([\d.,]+)\s+([\d.,]+))?")
# Demangled C++ names hold spaces ("void cub::DeviceRadixSortKernel<...>(...)"): the
# name is everything before the last "(grid)x(block), ".
_KERNEL = re.compile(r"^\s*(.+?) (\([\d, ]+\))x\([\d, ]+\), (?:Context|Device) \d")
_UNIT = {
    "ns": 1e-9,
    "nsecond": 1e-9,
    "us": 1e-6,
    "usecond": 1e-6,
    "ms": 1e-3,
    "msecond": 1e-3,
    "s": 1.0,
    "second": 1.0,
}


def parse_ncu_summary(text: str) -> dict[str, float]:
    """{kernel name and grid: average seconds per launch} from `ncu --print-summary
    per-kernel` text: each kernel's block starts with its name line ("name (grid)x(block),"
    then "Context 1, Stream 13, Device 0, CC 9.0" or, from the ncu on the H100 machine,
    "Device 0, CC 9.0, Invocations 4"), and its `gpu__time_duration.sum` line gives the unit
    and (min, max, average) or one value. The grid is part of the key: one kernel launched
    on two grids (gmm for the output and for the input gradient) is two entries."""
    kernels, name = {}, None
    for line in text.splitlines():
        match = _TIME.match(line)
        if match and name is not None:
            values = [v for v in match.groups()[1:] if v is not None]
            kernels[name] = float(values[-1].replace(",", "")) * _UNIT.get(match[1], 1e-9)
            name = None  # a time belongs to the header just above it, never to an older one
        elif header := _KERNEL.match(line):
            name = f"{header[1]} {header[2]}"
    return kernels


def summarise_ncu(kernels: dict[str, float], ours: frozenset[str]) -> str:
    """Lines: each kernel's average time per launch, ours marked, and the split."""
    mine = {n: t for n, t in kernels.items() if any(o in n for o in ours)}
    rest = {n: t for n, t in kernels.items() if n not in mine}
    lines = [
        f"{'ours' if n in mine else 'xla ':4s} {t * 1e6:10.1f} us  {n[:100]}"
        for n, t in sorted(kernels.items(), key=lambda kv: -kv[1])
    ]
    total = sum(kernels.values()) or 1.0
    lines.append(
        f"our kernels {sum(mine.values()) * 1e6:.1f} us ({sum(mine.values()) / total:.0%}), "
        f"other kernels {sum(rest.values()) * 1e6:.1f} us, per launch of each"
    )
    return "\n".join(lines)


def _select(cases, keys: Sequence[str]):
    """The cases whose key holds one of `keys` (all without keys). A key printed for a
    skipped A/B part, "... (A/B)", selects its row; `--ab` says which parts of it run."""
    keys = [k.removesuffix(" (A/B)") for k in keys]
    return [c for c in cases if not keys or any(k in c.key for k in keys)]


def _saver(args: argparse.Namespace, start: float):
    """Writes the rows so far to --json (None without it): a killed run keeps them."""
    if args.json is None:
        return None
    flags = {"mode": "dry-run" if args.dry_run else "gpu-check", "rows": args.rows}
    machine = machine_description(flags)

    def save(rows: list[BenchRow]) -> None:
        write_json(args.json, rows, machine, time.perf_counter() - start)

    return save


def run(args: argparse.Namespace) -> list[BenchRow]:
    """The rows of the chosen cases (ours alone on one case under --profile)."""
    import jax

    from bench import gpu_rows
    from bench.runner import Timing, run_cases

    gpu_rows.USE_TORCH = not args.no_torch
    gpu_rows.USE_TMA = args.tma or args.dry_run
    gpu_rows.USE_HOST_DESCRIPTORS = args.host_descriptors or args.dry_run
    gpu_rows.USE_WARP_SPECIALIZED = args.warp_specialized or args.dry_run
    gpu_rows.USE_WARP_SPECIALIZED_DKDV = args.warp_specialized_dkdv or args.dry_run
    on_gpu = jax.default_backend() in ("cuda", "rocm", "gpu")
    sizes = gpu_rows.Sizes.gpu() if on_gpu and not args.dry_run else gpu_rows.Sizes.tiny()
    quick = args.dry_run or not on_gpu
    one_call = Timing(repeats=1, calls=1, warmup_repeats=0, warmup_s=0.0)
    timing = one_call if quick else Timing()
    chosen = _select(gpu_rows.cases(sizes), [args.profile] if args.profile else args.rows)
    if args.profile:
        if not chosen:
            raise SystemExit(f"gpu-check --profile: no case matches {args.profile!r}")
        return run_cases(chosen[:1], one_call, anchors=False)
    chosen = gpu_rows.ab_apart(chosen, args.ab)
    parts = sum(case.ab_part for case in chosen)
    print(
        f"gpu-check: {len(chosen)} cases ({parts} of them A/B parts) at "
        f"{'toy' if quick else 'full'} sizes on {jax.devices()[0].device_kind}; torch "
        f"anchors: {gpu_rows.torch_available()}"
    )
    save = _saver(args, time.perf_counter())
    return run_cases(chosen, timing, budget_s=args.budget_s, on_rows=save)


def compile_rows(args: argparse.Namespace) -> int:
    """`--compile-for`: 0 if every program compiled (or is unavailable on this jaxlib
    only) without a host loop and ptxas serialized or refused none of their kernels, else
    1; with --dry-run at the toy sizes."""
    from bench import gpu_rows, preflight

    gpu_rows.USE_TMA = gpu_rows.USE_WARP_SPECIALIZED = gpu_rows.USE_WARP_SPECIALIZED_DKDV = True
    gpu_rows.USE_HOST_DESCRIPTORS = True
    gpu_rows.USE_TORCH = False
    sizes = gpu_rows.Sizes.tiny() if args.dry_run else gpu_rows.Sizes.gpu()
    chosen = _select(gpu_rows.cases(sizes), args.rows)
    print(f"gpu-check --compile-for {args.compile_for}: {len(chosen)} cases")
    builds = preflight.KernelBuilds()
    compiled = preflight.compile_cases(chosen, args.compile_for, builds)
    assembler, release = args.ptxas or "Triton's ptxas", preflight.ptxas_version(args.ptxas)
    print(f"\nthe {len(builds.kernels)} distinct kernels, assembled by {assembler} ({release}):")
    kernels = preflight.check_kernels(builds, compiled, args.ptxas)
    text, ok = preflight.summary(compiled, args.compile_for, kernels)
    print(text)
    print(ptx_cache_line())
    if args.json is not None:
        document = preflight.static_document(compiled, kernels, args.compile_for, release)
        document["machine"] = machine_description({"mode": "compile-for", "rows": args.rows})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


def ptx_cache_line() -> str:
    """What this process found in the PTX cache (`jax_bridge.launch.ptx_cache`): a device
    run carries the kernels `--compile-for h100` compiled on a CPU, so that it compiles
    none of them again."""
    from jax_bridge.launch.ptx_cache import ptx_cache_directory, ptx_cache_statistics

    directory = ptx_cache_directory()
    if directory is None:
        return "PTX cache: off"
    counts = ptx_cache_statistics()
    return (
        f"PTX cache {directory}: {counts['hits']} kernels found, {counts['misses']} compiled "
        f"(stored: {counts['misses'] - counts['write_errors']}), {counts['ignored']} bad "
        "entries ignored"
    )


def _warn_other_commit(run: dict, static: dict) -> None:
    """A line where the static document was not made at the run's commit: its kernels may
    not be the ones the run timed."""
    ran = run.get("machine", {}).get("commit")
    made = static.get("machine", {}).get("commit")
    if ran != made:
        print(f"(--static is of commit {made}, the run of {ran}: kernels may differ)\n")


def main(argv: Sequence[str]) -> int:
    """Runs the check; 1 if a row's check failed, else 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.static is not None and args.verdicts is None:
        parser.error("--static goes with --verdicts FILE")
    if args.ptxas is not None and args.compile_for is None:
        parser.error("--ptxas goes with --compile-for TARGET")
    if args.compile_for is not None:
        return compile_rows(args)
    if args.ncu_summary is not None:
        print(summarise_ncu(parse_ncu_summary(args.ncu_summary), our_kernel_names()))
        return 0
    if args.verdicts is not None:
        from bench.report import rows_of
        from bench.verdicts import format_verdicts

        if args.static is not None:
            _warn_other_commit(args.verdicts, args.static)
        print(format_verdicts(rows_of(args.verdicts), args.static))
        return 0
    start = time.perf_counter()
    rows = run(args)
    wall = time.perf_counter() - start
    print(f"\n## gpu-check (base/ours > 1: ours is faster)\n{format_table(rows)}")
    print(f"\ngpu-check wall time {wall:.1f} s")
    print(ptx_cache_line())
    if args.json is not None and not args.profile:
        _saver(args, start)(rows)
        print(f"wrote {args.json}")
    failed = [f"{r.op} {r.shape} vs {r.baseline}" for r in rows if r.ok is False]
    if failed:
        print("failed checks:\n  " + "\n  ".join(failed))
        return 1
    return 0
