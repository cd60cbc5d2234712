"""`python -m bench report`: what the compiler makes of every Triton kernel, with no GPU.

    python -m bench report [--arch 80 90] [--head-dim 64 128] [--json PATH]

Each kernel of `triton_kernels.catalog.default_variants` is compiled offline at its
default configuration for each architecture, and one line per (kernel, architecture)
gives: registers per thread, spills, shared memory, resident CTAs per SM, tensor-core
instructions (HGMMA on sm_90, HMMA on sm_80) and the static throughput proxy: the
warp-instructions of the innermost unmasked tensor-core loop per MFLOP of the work its tile
owes (`jax_bridge.launch.report.InnerLoop`). Lower is better; it compares configs and
kernels of different tile shapes fairly, and it moves with every change to a kernel.
"MMA x" is the loop's executed tensor-core FLOPs over that work
(`KernelReport.mma_redundancy`): above 1 where warps compute the same products (e.g. at
8 warps, products of fewer than 128 rows; Hopper's d=256 dK/dV at 1.5).
Beside it, what the count cannot price: the loop's exp2s issued while an MMA is in
flight ("exp2 by MMA") and its barriers of the whole CTA ("CTA bar"), each of which holds
a CTA's warpgroups in step (a CTA of one warpgroup, 4 warps, is held by none). On the
H100 the forward and dQ with TMA at their default tiles, with fewer instructions and more
such barriers (4 a tile against 2 under Triton 3.6), ran slower than the same tiles by
pointers (forward 5%, fwd+bwd 3-12%); dK/dV at 64x128 with TMA, 27% fewer instructions
than the 32x128 by pointers it replaced, gained 8% on 4 x 4096 despite them (both had
their wgmma serialized under 3.6 then: SERIAL). FlexAttention's backward (also Triton),
~1.35x ours on 4 x 4096 causal in that run, is no counter-example: its kernels,
instantiated by hand at its H100 config (three stages), run 491 (dK/dV) and 434 (dQ)
under Triton 3.6 and are not serialized, while our dK/dV of that run was (554, SERIAL;
now 360, not serialized, untimed). Depth of the pipeline is one thing the count cannot
see (`bench/gpu_rows.py` times it as A/B rows).

Flags: SPILL (a spill store inside that loop, or more than `LOOP_RELOADS_TOLERATED`
reloads, where every iteration pays them, or more than `SPILL_OUTSIDE_LOOP_BYTES`
elsewhere), SERIAL (ptxas serialized the warpgroup MMAs: each
waits for the one before, which no instruction count shows), SMEM (over the CTA's
shared-memory limit), NO-HGMMA (an sm_90 kernel without warpgroup MMA), and OVER-TARGET
(one of the three default sm_90 attention kernels, forward, dQ and dK/dV, at head_dim 128
above `TARGET_PER_MFLOP`; the variants beside them, such as `attention_forward_overlap`,
are A/B candidates and are not held to it). The exit status is 1 when any line is
flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPILL_OUTSIDE_LOOP_BYTES = 64
"""Spill bytes per thread tolerated outside the innermost tensor-core loop (a program
pays them once, not every iteration)."""

TARGET_PER_MFLOP = 550
"""Issue target: forward, dQ and dK/dV each at most this many warp-instructions per MFLOP
on sm_90 (bf16, head_dim 128, causal)."""

_TARGET_KERNELS = ("attention_forward", "attention_backward_dq", "attention_backward_dkdv")
_COLUMNS = (
    "kernel", "arch", "problem", "warps", "stages", "regs", "spill B", "smem KiB",
    "CTAs/SM", "MMA", "loop instr", "instr/MFLOP", "MMA x", "exp2 by MMA", "CTA bar", "flags",
)  # fmt: skip


def _flags(report: Any, name: str, head_dim: int | None) -> list[str]:
    flags = []
    spilled = max(report.spill_store_bytes, report.spill_load_bytes)
    if report.loop_spills or spilled > SPILL_OUTSIDE_LOOP_BYTES:
        flags.append("SPILL")
    if report.serialized_wgmma:
        flags.append("SERIAL")
    if report.exceeds_shared_memory:
        flags.append("SMEM")
    # Warpgroup MMA exists on sm_90 only (Blackwell has tcgen05, sm_120 mma.sync).
    if report.compute_capability == 90 and report.uses_mma and not report.uses_wgmma:
        flags.append("NO-HGMMA")
    proxy = report.instructions_per_mflop
    if (
        name in _TARGET_KERNELS
        and report.compute_capability == 90
        and head_dim == 128
        and (proxy is None or proxy > TARGET_PER_MFLOP)
    ):
        flags.append("OVER-TARGET")
    return flags


def _mma_kind(report: Any) -> str:
    if report.uses_wgmma:
        return "HGMMA"
    if report.sass_opcodes.get("HMMA", 0):
        return "HMMA"
    return "tcgen05" if report.uses_mma else "-"


def report_rows(archs: Sequence[int], head_dims: Sequence[int]) -> list[dict[str, Any]]:
    """One dict per (kernel variant, architecture), JSON-ready."""
    from jax_bridge.launch.report import variant_report
    from triton_kernels.catalog import default_variants

    rows = []
    for arch in archs:
        for variant in default_variants(arch, tuple(head_dims)):
            report = variant_report(variant, arch)
            mma = sum(n for op, n in report.sass_opcodes.items() if op.endswith("MMA"))
            loop = report.inner_loop
            proxy = report.instructions_per_mflop
            redundancy = report.mma_redundancy
            head_dim = variant.constexprs.get("HEAD_DIM")
            rows.append(
                {
                    "kernel": variant.name,
                    "arch": f"sm_{arch}",
                    "problem": variant.description,
                    "num_warps": report.num_warps,  # a warp-specialized kernel's own
                    "num_stages": variant.num_stages,
                    "registers": report.registers,
                    "spill_bytes": report.spill_store_bytes + report.spill_load_bytes,
                    "shared_memory_bytes": report.shared_memory_bytes,
                    "ctas_per_sm": report.ctas_per_sm,
                    "mma_instructions": mma,
                    "mma_kind": _mma_kind(report),
                    "loop_instructions": loop.instructions if loop else None,
                    "loop_mma_flops": loop.mma_flops if loop else None,
                    "instructions_per_mflop": None if proxy is None else round(proxy, 1),
                    "mma_redundancy": None if redundancy is None else round(redundancy, 3),
                    "loop_mufu": loop.mufu if loop else None,
                    "loop_mufu_beside_mma": loop.mufu_beside_mma if loop else None,
                    "loop_cta_barriers": loop.cta_barriers if loop else None,
                    "flags": _flags(report, variant.name, head_dim),
                }
            )
    return rows


def format_report(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as one aligned table (figures right-aligned)."""
    cells = [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]
    left = {0, 1, 2, 15}

    def line(row: Sequence[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in pairs).rstrip()

    return "\n".join([line(_COLUMNS), "  ".join("-" * w for w in widths), *map(line, cells)])


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    # fmt: off
    return (
        r["kernel"], r["arch"], r["problem"], str(r["num_warps"]), str(r["num_stages"]),
        str(r["registers"]), str(r["spill_bytes"]), f"{r['shared_memory_bytes'] / 1024:.0f}",
        str(r["ctas_per_sm"]), f"{r['mma_instructions']} {r['mma_kind']}",
        "-" if r["loop_instructions"] is None else str(r["loop_instructions"]),
        "-" if r["instructions_per_mflop"] is None else f"{r['instructions_per_mflop']:.0f}",
        "-" if r.get("mma_redundancy") is None else f"{r['mma_redundancy']:.2f}",
        f"{r['loop_mufu_beside_mma']}/{r['loop_mufu']}" if r.get("loop_mufu") else "-",
        _barrier_cell(r),
        " ".join(r["flags"]) or "ok",
    )
    # fmt: on


def _barrier_cell(r: dict[str, Any]) -> str:
    # A barrier holds warpgroups in step only where the CTA has two or more.
    count = r.get("loop_cta_barriers")
    if count is None:
        return "-"
    return str(count) if r["num_warps"] > 4 else f"{count} (1 WG)"


def grid_sizes(batch: int = 8, seq: int = 8192, block_m: int = 128, seed: int = 0) -> dict:
    """Forward programs per head of `flash_attention` with segment ids (documents of
    random lengths in every row): the real query tiles, the grid of the old bound
    `cdiv(total, BLOCK) + sequences`, the tile list's rows (`chunk_bound`), and the
    programs the bridge launches (persistent past 60 sequences)."""
    import numpy as np

    from jax_bridge.attention import schedule
    from jax_bridge.attention.padded import segment_ids_to_cu_seqlens
    from jax_bridge.core.numerics import cdiv
    from jax_bridge.host.cu_seqlens import chunk_bound

    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, seq), np.int32)
    for row in ids:
        ends = np.sort(rng.choice(np.arange(1, seq), size=15, replace=False))
        row[:] = np.searchsorted(ends, np.arange(seq), side="right") + 1
    cu_q, _ = segment_ids_to_cu_seqlens(ids, ids)
    lengths = np.diff(np.asarray(cu_q))
    total, sequences = batch * seq, len(lengths) + 4  # the bridge adds two head, two tail ones
    rows = chunk_bound(total, block_m, sequences)
    persistent = schedule.persistent(sequences)
    programs = schedule.programs(rows, total, block_m, persistent)
    return {
        "problem": f"batch {batch} x seq {seq}, 16 documents a row, BLOCK_M {block_m}",
        "real_tiles": int(sum(-(-n // block_m) for n in lengths)),
        "grid_before": int(cdiv(total, block_m) + sequences),
        "tile_rows": int(rows),
        "grid_now": int(programs),
    }


def arch_argument(text: str) -> int:
    """An argparse type: a compute capability as a number (`90`), as `sm_90`, or as a GPU
    `compile_for` names (`h100`, `a100`), as `gpu-check --compile-for` takes it."""
    from jax_bridge.aot.targets import TARGETS

    name = text.strip().lower()
    target = TARGETS.get(name)
    if target is not None and target.compute_capability is not None:
        return target.compute_capability
    try:
        return int(name.removeprefix("sm_"))
    except ValueError:
        gpus = sorted(n for n, t in TARGETS.items() if t.compute_capability is not None)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability (90, sm_90) or a GPU ({', '.join(gpus)})"
        ) from None


def head_dim_argument(text: str) -> int:
    """An argparse type: a head dim the attention kernels take, or a usage error naming the
    range (`bench report --head-dim`, `bench tune --head-dim`)."""
    from triton_kernels.flash_attention.config import MAX_HEAD_DIM, MIN_HEAD_DIM

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"head_dim must be an integer, got {text!r}") from None
    if not MIN_HEAD_DIM <= value <= MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(
            f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {value}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from jax_bridge.launch.report import SM_LIMITS

    parser.add_argument(
        "--arch",
        type=arch_argument,
        nargs="+",
        default=[80, 90],
        choices=sorted(SM_LIMITS),
        metavar="CC",
        help=f"compute capabilities to compile for, of {sorted(SM_LIMITS)} (or sm_90, h100, "
        "a100; default: 80 90); "
        "sm_100's tcgen05 MMAs carry no shape, so it gets no instr/MFLOP",
    )
    parser.add_argument(
        "--head-dim",
        type=head_dim_argument,
        nargs="+",
        default=[64, 128],
        metavar="D",
        help="attention head dims, 16..256 (default: 64 128)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every row as JSON")
    return parser


def main(argv: Sequence[str]) -> None:
    """The command line: prints the table, writes JSON, exits 1 when a line is flagged."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for a GPU needs no GPU
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = report_rows(args.arch, args.head_dim)
    print(format_report(rows))
    grid = grid_sizes()
    print(
        f"\nflash_attention with segment ids ({grid['problem']}): forward programs per "
        f"head {grid['grid_before']} before, {grid['grid_now']} persistent programs now "
        f"walking {grid['tile_rows']} list rows, {grid['real_tiles']} of them with work"
    )
    print(
        f"\ninstr/MFLOP: warp-instructions of the innermost unmasked tensor-core loop per "
        f"MFLOP of the work its tile owes (target <= {TARGET_PER_MFLOP} for the default "
        "sm_90 attention forward, dQ and dK/dV at bf16, head_dim 128, causal; the other "
        "variants are A/B candidates); MMA x: the FLOPs that loop's "
        "MMAs execute over that work (above 1: warps computing the same products); "
        "exp2 by MMA: of that loop's "
        "MUFU instructions, those issued while a warpgroup MMA is in flight; CTA bar: "
        "that loop's barriers of the whole CTA, each holding its warpgroups in step (one "
        "warpgroup's exp2s cannot run beside another's MMAs); \"n (1 WG)\": counted in a "
        "CTA of one warpgroup (4 warps), where they hold no other warpgroup, and two such "
        "CTAs on an SM run out of step; warp-specialized rows: the consumers' loop, whose "
        "named barriers of some warps are not counted"
    )
    if args.json is not None:
        from bench.report import machine_description

        args.json.parent.mkdir(parents=True, exist_ok=True)
        machine = machine_description({"report": True})
        document = {"machine": machine, "rows": rows, "grid": grid}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    flagged = [f"{r['kernel']} {r['arch']} {r['problem']}" for r in rows if r["flags"]]
    if flagged:
        raise SystemExit("flagged:\n  " + "\n  ".join(flagged))
    print("no kernel flagged")


if __name__ == "__main__":
    main(sys.argv[1:])
