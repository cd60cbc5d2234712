"""What a device run's rows say, read from its JSON: `python -m bench gpu-check --verdicts FILE`.

Two views of the rows `gpu-check --json` wrote (bench/results/):

* the A/B anchors (ours in another configuration, named "ours ...", checked against the
  default): for each, on every row and pass it ran, the default's time over its own, so
  above 1 it is faster and the default should move; and one verdict per anchor;
* issue 27's bars ("Done when"): ours against FlexAttention on every attention row, against
  JAX's cuDNN on the varlen rows of equal documents, against `torch._grouped_mm` on the
  grouped matmul rows, each as ours' speed over the anchor's (as `BenchRow.ratio`).

The session after a device run settles defaults and the issue's note from these lines
instead of reading the whole table. Given the static check of the same commit
(`gpu-check --compile-for h100 --json`, bench/preflight.py), each A/B row also names the
kernels its anchor changes with what ptxas made of them, anchor against default: the
static proxy beside the device's answer, the data that calibrates it.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.report import BenchRow

CLEAR_MARGIN = 0.03
"""An A/B anchor wins (or loses) a row when it is this much faster (slower) than the
default: on the H100 the median row's repeats spread by 2% (max - min over the median,
bench/results/gpu-check-20261127T0213Z.json; rows timed cold, before the runner's warm-up
repeats, far more)."""


@dataclasses.dataclass(frozen=True)
class Bar:
    """One of the issue's minimums: ours over `anchor` at least `minimum` on the rows
    `applies` accepts."""

    name: str
    anchor: str
    minimum: float
    applies: Callable[[BenchRow], bool]


def _equal_documents(row: BenchRow) -> bool:
    # Varlen rows named "<documents>x<length> ..." hold documents of one length.
    return row.section == "attention" and re.match(r"\d+x\d+ ", row.shape) is not None


BARS = (
    Bar("attention >= 1.0x FlexAttention", "torch flex_attention", 1.0,
        lambda row: row.section in ("attention", "block_sparse")),
    Bar("varlen, equal documents >= 0.75x JAX's cuDNN", "jax cudnn attention", 0.75,
        _equal_documents),
    Bar("grouped matmul >= 0.9x torch._grouped_mm", "torch _grouped_mm", 0.9,
        lambda row: row.section == "grouped_matmul"),
)  # fmt: skip


def _label(row: BenchRow) -> str:
    """'16x1024 causal h16 d128 bf16, forward': the row's shape and pass."""
    return f"{row.shape}, {row.op.rsplit(' ', 1)[-1]}"


def _is_ab(row: BenchRow) -> bool:
    # Ours in another configuration does the same work, so it is checked against ours;
    # ours on other work (gmm on one group: a roof) is not, and is no A/B.
    return row.baseline.startswith("ours ") and row.ok is not None and row.ratio is not None


def ab_verdict(speedups: Sequence[float], margin: float = CLEAR_MARGIN) -> str:
    """One word for an A/B anchor over its rows, from the default's time over its own on
    each: 'faster' (every row by more than `margin`), 'slower' (every row), 'mixed' (some
    of each) or 'even'."""
    faster = sum(s > 1 + margin for s in speedups)
    slower = sum(s < 1 - margin for s in speedups)
    if faster and not slower:
        return "faster" if faster == len(speedups) else "faster or even"
    if slower and not faster:
        return "slower" if slower == len(speedups) else "slower or even"
    return "mixed" if faster else "even"


def _short(kernel: str) -> str:
    """'attention_backward_dkdv_kernel' -> 'dkdv'."""
    for part in ("attention_", "block_sparse_", "backward_", "_kernel"):
        kernel = kernel.replace(part, "")
    return kernel


def _kernel_text(kernel: Mapping[str, Any]) -> str:
    if kernel.get("error"):
        return "ptxas failed"
    per, tile, repeats = (kernel.get(f) for f in ("per_mflop", "tile", "mma_redundancy"))
    flags = [f for f in ("serialized", "loop_spills") if kernel.get(f)]
    return (
        (f"{tile} " if tile else "")
        + (f"{per:.0f}/MFLOP" if per is not None else "no MMA loop")
        + (f" MMAs x{repeats:.2f}" if repeats is not None and repeats > 1.005 else "")
        + f" {kernel['spill_store_bytes']} B spilled"
        + "".join(f" {f.upper()}" for f in flags)
    )


def static_difference(row: BenchRow, static: Mapping[str, Any]) -> str:
    """The kernels the A/B row's anchor launches differently from the default, each as
    'name: anchor's | default's' (its tile, its loop's warp-instructions per MFLOP of the
    tile's work, its MMAs' repeats above 1, bytes spilled a thread, SERIALIZED /
    LOOP_SPILLS; documents before the tile was recorded say no tile and price per MFLOP
    the MMAs execute), from a `preflight.static_document`; '' where the
    document has not both programs."""
    label = row.op.rsplit(" ", 1)[-1]
    programs = {
        p["impl"]: p["kernels"]
        for p in static["programs"]
        if p["shape"] == row.shape and p["pass"] == label and not p["error"]
    }
    if row.backend not in programs or row.baseline not in programs:
        return ""
    kernels = static["kernels"]

    def by_name(keys: Sequence[str]) -> dict[str, list[str]]:
        named: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            named[kernels[key]["name"]].append(key)
        return named

    ours, anchor = by_name(programs[row.backend]), by_name(programs[row.baseline])
    parts = []
    for name in dict.fromkeys([*anchor, *ours]):
        pairs = list(zip(anchor.get(name, []), ours.get(name, []), strict=False))
        changed = [(a, o) for a, o in pairs if a != o]
        extra = len(anchor.get(name, [])) - len(ours.get(name, []))
        parts += [f"{_short(name)}: {_kernel_text(kernels[a])} | {_kernel_text(kernels[o])}"
                  for a, o in changed]  # fmt: skip
        if extra:
            parts.append(f"{'+' if extra > 0 else '-'}{abs(extra)} {_short(name)}")
    return "; ".join(parts) if parts else "same kernels"


def format_ab(rows: Sequence[BenchRow], static: Mapping[str, Any] | None = None) -> str:
    """Each A/B anchor: its speed over the default's on every row it ran, and its verdict;
    with `static`, beside each row the kernels it changes (`static_difference`)."""
    by_anchor: dict[str, list[BenchRow]] = defaultdict(list)
    for row in rows:
        if _is_ab(row):
            by_anchor[row.baseline].append(row)
    if not by_anchor:
        return "no A/B anchor in these rows"
    lines = []
    for anchor, found in by_anchor.items():
        # ratio = anchor's time / ours: the anchor's speed over the default's is 1 / ratio.
        speedups = [1 / row.ratio for row in found]
        lines.append(f"{anchor}: {ab_verdict(speedups)}")
        for row, speedup in zip(found, speedups, strict=True):
            lines.append(f"  {speedup:5.2f}x  {_label(row)}")
            if static is not None and (difference := static_difference(row, static)):
                lines.append(f"           {difference}")
    return "\n".join(lines)


def format_bars(rows: Sequence[BenchRow], bars: Sequence[Bar] = BARS) -> str:
    """Each bar: every row it applies to, ours over the anchor, 'ok' or 'BELOW'."""
    lines = []
    for bar in bars:
        found = [r for r in rows if r.baseline == bar.anchor and r.ratio and bar.applies(r)]
        if not found:
            lines.append(f"{bar.name}: no row of this run has that anchor")
            continue
        met = sum(r.ratio >= bar.minimum for r in found)
        lines.append(f"{bar.name}: {met} of {len(found)} rows")
        lines += [
            f"  {r.ratio:5.2f}x {'ok   ' if r.ratio >= bar.minimum else 'BELOW'} {_label(r)}"
            for r in found
        ]
    return "\n".join(lines)


def format_verdicts(rows: Sequence[BenchRow], static: Mapping[str, Any] | None = None) -> str:
    """Both views, as `gpu-check --verdicts` prints them (`static`: see `format_ab`)."""
    beside = (
        " (beside: each changed kernel, anchor's | default's; +N / -N: distinct kernels the "
        "anchor launches that the default does not / the reverse)"
        if static
        else ""
    )
    return (
        f"## A/B anchors (the default's time / the anchor's: above 1 the anchor is faster)"
        f"{beside}\n{format_ab(rows, static)}\n\n## Issue 27's bars (ours' speed / the anchor's)\n"
        f"{format_bars(rows)}"
    )
