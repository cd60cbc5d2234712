"""The 1B MoE training step compiled at scale: `python -m bench train-at-scale [--quick]`.

Nothing runs and no array is allocated: `examples/train_lm`'s full train step (value and
gradients of the loss, then the optax AdamW update, with the state donated as
`Trainer.step` donates it) is traced over `jax.ShapeDtypeStruct`s that carry
`NamedSharding`s on a mesh of compile-only devices (`jax_bridge.target_mesh`), and XLA with
the real kernel compilers (Triton for H100, Mosaic for TPUs) compiles it.

For each target (8 H100s, a 64-chip TPU v5p slice, 256 TPU v6e chips), on a
("data", "expert", "context") mesh with every axis > 1, and for both flavours (ours: our
varlen / ring attention and all-to-all expert parallelism; the dense twin: dense-mask XLA
attention and a per-expert loop), it prints:

1. at 32k-token packed rows: memory per device (arguments, temps, total) against the
   device's HBM, and the collectives of one step by kind;
2. the largest power-of-two sequence length that fits per device (the sweep stops at the
   first length that does not fit or that the compiler refuses, and says why).

"Fits" compares XLA's figure with the chip's HBM: the runtime's own reservations (CUDA
context, XLA's allocator fraction) are not counted. A TPU compile of the 1B step takes 3 to
5 minutes on one core, so the table's compiles run first and the sweeps get what is left
of `--budget` minutes (25 by default): a sweep cut short says so. On TPUs the windowed
layers' ring runs its XLA backend (the ring's Pallas kernels take no window yet).

`--quick` compiles for H100 only and sweeps a few lengths; `--json PATH` writes every row.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import operator
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding

# Device memory per chip, in decimal GB as the vendors publish it (NVIDIA's H100 SXM5
# datasheet: 80 GB HBM3; Google Cloud's TPU pages: v5p 95 GB HBM2e, v6e 32 GB HBM). Decimal
# GB is the smaller reading, so "fits" is the conservative verdict.
HBM_BYTES = {"h100": 80 * 10**9, "tpu-v5p": 95 * 10**9, "tpu-v6e": 32 * 10**9}

# Mesh per target, every axis > 1. The experts (8) split evenly over "expert"; a packed row
# lives on one data x expert shard (rows = data * expert, one row per shard per step) and
# its sequence is split over "context" (the ring). 8 H100s: one host, 2 x 2 x 2. v5p-64:
# all 8 experts apart (one per chip, the all-to-all at its widest), 2 x 8 x 4. v6e-256:
# 8 x 8 x 4, the same expert and ring sizes and 8 data replicas.
MESHES = {
    "h100": {"data": 2, "expert": 2, "context": 2},
    "tpu-v5p": {"data": 2, "expert": 8, "context": 4},
    "tpu-v6e": {"data": 8, "expert": 8, "context": 4},
}
TABLE_SEQ = 32 * 1024  # the packed row length of the table
SWEEP = {  # powers of two, ascending; each flavour's sweep stops at its first failure
    "ours": [2**k for k in range(12, 19)],  # 4k .. 256k
    "dense": [2**k for k in range(10, 17)],  # 1k .. 64k
}
QUICK_SWEEP = {"ours": [TABLE_SEQ, 2 * TABLE_SEQ], "dense": [4096, 8192]}
FLAVOURS = ("ours", "dense")
_GB = 10**9


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One compile of the train step: a target, a flavour, a row length.

    Bytes are per device (XLA's memory analysis); `total_bytes` is arguments + outputs +
    temps - aliased (the donated state's outputs reuse its buffers). `error` is set, and
    the figures are 0, when the compiler refused the program.
    """

    target: str
    flavour: str
    mesh: dict[str, int]
    seq_len: int
    rows: int
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0
    total_bytes: int = 0
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # in the HLO
    collectives_per_step: dict[str, int] = dataclasses.field(default_factory=dict)  # run
    compile_seconds: float = 0.0
    error: str = ""

    @property
    def fits(self) -> bool:
        """Compiled, and its memory per device is within the device's HBM."""
        return not self.error and self.total_bytes <= HBM_BYTES.get(self.target, math.inf)


def make_target_mesh(target: str, sizes: dict[str, int]) -> Mesh:
    """A ("data", "expert", "context") mesh of compile-only devices, axes automatic as in
    `examples.train_lm.train.make_mesh` (XLA partitions all outside the shard_maps)."""
    from examples.train_lm.kernels import AXES
    from jax_bridge import target_mesh

    ordered = {axis: sizes.get(axis, 1) for axis in AXES}
    return target_mesh(target, ordered, axis_types=(AxisType.Auto,) * len(AXES))


def abstract_state(trainer: Any, mesh: Mesh) -> tuple[Any, Any]:
    """(params, optimizer state) as ShapeDtypeStructs with `param_specs` shardings.

    Params: float32 masters, e.g. w_up [blocks, E, hidden, ffn] over "expert", the rest
    replicated. AdamW's mu / nu mirror the params' tree, so the same rule (by leaf name)
    shards them; its step counts are replicated scalars.
    """
    from examples.train_lm.model import init_params
    from examples.train_lm.train import param_specs

    params = jax.eval_shape(lambda: init_params(trainer.model, jax.random.key(0)))
    opt_state = jax.eval_shape(trainer.tx.init, params)

    def placed(tree: Any) -> Any:
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(tree))
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )

    return placed(params), placed(opt_state)


def abstract_batch(train: Any, mesh: Mesh) -> Any:
    """A PackedBatch of ShapeDtypeStructs: tokens / targets int32 [rows, seq_len] over
    (("data", "expert"), "context"), cu_seqlens int32 [rows, max_documents + 1] over rows."""
    from examples.train_lm.data import PackedBatch
    from examples.train_lm.train import batch_spec

    shapes = PackedBatch(
        (train.rows, train.seq_len),
        (train.rows, train.seq_len),
        (train.rows, train.max_documents + 1),
    )
    return PackedBatch(
        *(
            jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, spec))
            for shape, spec in zip(shapes, batch_spec(), strict=True)
        )
    )


_HBM_REFUSAL = re.compile(r"HLO temporaries \((\S+)\) exceeds available HBM \((\S+)\)")


def error_kind(error: Exception) -> str:
    """A compiler's refusal in one line: out of memory (TPU compilers check the program
    against HBM themselves) or the exception's type and first line."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        kind = "out of memory"
    else:
        kind = type(error).__name__
    first = next((line for line in text.splitlines() if line.strip()), "")
    if sizes := _HBM_REFUSAL.search(first):  # XLA:TPU's own check, its figures in GiB
        return f"{kind}: temps {sizes.group(1)} > available HBM {sizes.group(2)} (compiler)"
    return f"{kind}: {first[:200]}"


def compile_step(model: Any, target: str, flavour: str, sizes: dict[str, int], seq_len: int):
    """Compiles one train step for `target` on a mesh of `sizes`; returns its StepRow.

    rows = data * expert packed rows of `seq_len` tokens per step (one per row shard).
    The step is jitted as `Trainer.init` jits it (the state donated, its shardings kept:
    a step that did not donate would hold the state twice) and handed to `compile_for`.
    """
    from examples.train_lm.config import TrainConfig
    from examples.train_lm.train import Trainer
    from jax_bridge import compile_for

    mesh = make_target_mesh(target, sizes)
    train = TrainConfig(seq_len=seq_len, rows=sizes["data"] * sizes["expert"])
    row = StepRow(target, flavour, dict(sizes), seq_len, train.rows)
    trainer = Trainer(model, train, flavour, mesh)
    params, opt_state = abstract_state(trainer, mesh)
    batch = abstract_batch(train, mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    step = jax.jit(
        trainer._step_body, donate_argnums=(0, 1), out_shardings=(*state_shardings, None)
    )
    start = time.perf_counter()
    try:
        program = compile_for(step, params, opt_state, batch, target=target, mesh=mesh)
    except Exception as error:  # the compiler's refusal is the row's result
        return dataclasses.replace(
            row, error=error_kind(error), compile_seconds=time.perf_counter() - start
        )
    report, hlo = program.report, program.as_text()
    return dataclasses.replace(
        row,
        argument_bytes=report.argument_bytes,
        output_bytes=report.output_bytes,
        temp_bytes=report.temp_bytes,
        alias_bytes=report.alias_bytes,
        total_bytes=report.total_bytes,
        collectives=dict(report.collectives),
        collectives_per_step=executed_collectives(hlo),
        compile_seconds=time.perf_counter() - start,
    )


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_CALLEES = re.compile(r"\b(?:body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_S32_CONSTANT = re.compile(r"= s32\[\]\S* constant\((\d+)\)")


def executed_collectives(hlo: str) -> dict[str, int]:
    """Collectives one step executes, by kind, from the optimized HLO text.

    `CompileReport.collectives` counts instructions: a collective inside the scan over
    blocks (or the ring's loop) appears once however often it runs. Here a while body's
    count is multiplied by its trip count: XLA:GPU's `known_trip_count`, else (XLA:TPU
    states none) the N of a condition `counter < constant(N)`, a scan's counter counting
    from 0; once when neither is there. A conditional counts its largest branch per kind
    (the ring skips some pairs).
    """
    from jax_bridge.aot.compile import parse_compiled_text

    bodies: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        if match := _COMPUTATION.match(line):
            name = match.group(1)
            bodies[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif name is not None and line.strip() != "}":
            bodies[name].append(line)

    def trip_count(line: str) -> int:
        if known := _TRIP_COUNT.search(line):
            return int(known.group(1))
        condition = re.search(r"condition=%([\w.\-]+)", line)
        lines = bodies.get(condition.group(1), ()) if condition else ()
        limits = [int(n) for text in lines for n in _S32_CONSTANT.findall(text)]
        less_than = any("direction=LT" in text for text in lines)
        return limits[0] if less_than and len(limits) == 1 else 1

    @functools.cache
    def count(computation: str) -> collections.Counter:
        lines = bodies.get(computation, ())
        total = collections.Counter(parse_compiled_text("\n".join(lines))[2])
        for line in lines:
            trips = trip_count(line) if " while(" in line else 1
            for callee in _CALLEES.findall(line):
                total.update({k: n * trips for k, n in count(callee).items()})
            if branches := _BRANCHES.search(line):
                counts = [count(b.strip().lstrip("%")) for b in branches.group(1).split(",")]
                total.update(functools.reduce(operator.or_, counts, collections.Counter()))
        return total

    return dict(sorted(count(entry).items())) if entry else {}


class OutOfTime(Exception):
    """The sweep's time budget would run out before the next compile ends."""


def largest_fitting(
    model: Any, target: str, flavour: str, lengths: Sequence[int], known: dict[int, StepRow],
    deadline: float = math.inf,
) -> tuple[int | None, list[StepRow], int | None]:  # fmt: skip
    """The largest of `lengths` (ascending powers of two) whose step fits.

    Equivalent to trying every length from the smallest and stopping at the first that
    does not fit (memory grows with the length), but it starts from a known row (`known`:
    rows already compiled, by length, e.g. the table's) or the middle, and walks up while
    it fits and down while it does not: two or three compiles instead of up to seven, which
    is what keeps the TPU sweeps (minutes a compile) affordable. A compile that would end
    after `deadline` (time.monotonic(), judged by the slowest compile so far) is not
    started: the walk stops there.

    Returns (the largest fitting length, or None; the rows compiled here; the length the
    walk did not compile for lack of time, or None when it finished).
    """
    rows = dict(known)

    def fits(i: int) -> bool:
        if lengths[i] not in rows:
            slowest = max((r.compile_seconds for r in rows.values()), default=0.0)
            if time.monotonic() + slowest > deadline:
                raise OutOfTime(lengths[i])
            rows[lengths[i]] = compile_step(model, target, flavour, MESHES[target], lengths[i])
            _progress(rows[lengths[i]])
        return rows[lengths[i]].fits

    i = next((i for i, n in enumerate(lengths) if n in known), len(lengths) // 2)
    best, skipped = None, None
    try:
        if fits(i):
            best = lengths[i]
            while i + 1 < len(lengths) and fits(i + 1):
                i, best = i + 1, lengths[i + 1]
        else:
            while i > 0 and not fits(i - 1):
                i -= 1
            best = lengths[i - 1] if i > 0 else None
    except OutOfTime as cut:
        skipped = cut.args[0]
    tried = [rows[n] for n in lengths if n in rows and n not in known]
    return best, tried, skipped


def _progress(row: StepRow) -> None:
    verdict = row.error or f"{row.total_bytes / _GB:.1f} GB, fits: {row.fits}"
    print(
        f"  compiled {row.target} {row.flavour} seq {row.seq_len}: {verdict} "
        f"({row.compile_seconds:.0f} s)",
        flush=True,
    )


_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "all-to-all": "A2A",
    "collective-permute": "CP",
    "reduce-scatter": "RS",
}


def format_table(rows: Sequence[StepRow]) -> str:
    """Markdown: per target and flavour, memory per device (GB) and collectives by kind
    (executed per step, instructions in the HLO in parentheses)."""
    lines = [
        "| target | mesh (data x expert x context) | flavour | seq | rows | arguments GB "
        "| temps GB | total GB | HBM GB | fits | collectives per step (in HLO) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mesh = " x ".join(str(r.mesh[a]) for a in ("data", "expert", "context"))
        hbm = HBM_BYTES[r.target] / _GB
        if r.error:
            cells = f"- | - | - | {hbm:.0f} | no: {r.error[:90]} | -"
        else:
            coll = ", ".join(
                f"{_SHORT.get(k, k)} {n} ({r.collectives.get(k, 0)})"
                for k, n in r.collectives_per_step.items()
            )
            cells = (
                f"{r.argument_bytes / _GB:.2f} | {r.temp_bytes / _GB:.2f} | "
                f"{r.total_bytes / _GB:.2f} | {hbm:.0f} | {'yes' if r.fits else 'no'} | {coll}"
            )
        lines.append(f"| {r.target} | {mesh} | {r.flavour} | {r.seq_len} | {r.rows} | {cells} |")
    return "\n".join(lines)


def sweep_summary(
    target: str, flavour: str, best: int | None, rows: Sequence[StepRow], skipped: int | None
) -> dict:
    """The sweep's result: the largest fitting length, where and why it stopped (a length
    that did not fit, or `skipped`: the next length, left uncompiled for lack of time)."""
    misses = sorted((r for r in rows if not r.fits), key=lambda r: r.seq_len)
    stop = misses[0] if misses else None
    if stop is not None:
        stopped_at = stop.seq_len
        hbm = HBM_BYTES[target] / _GB
        why = stop.error or f"needs {stop.total_bytes / _GB:.1f} GB > {hbm:.0f} GB"
    elif skipped is not None:
        stopped_at, why = skipped, "not compiled: the run's time budget (--budget) ran out"
    else:
        stopped_at, why = None, None
    return dict(
        target=target,
        flavour=flavour,
        largest_fitting=best,
        stopped_at=stopped_at,
        why=why,
        cut_short=skipped is not None,
        compiled=sorted(r.seq_len for r in rows),
    )


def run(model: Any, targets: Sequence[str], sweeps: dict[str, list[int]], budget: float):
    """The TABLE_SEQ row of every target and flavour first, then the sweeps (the largest
    fitting length), h100 first, until `budget` seconds from now.

    Returns (table rows, sweep summaries, every row compiled)."""
    deadline = time.monotonic() + budget
    table = []
    for target in targets:
        for flavour in FLAVOURS:
            table.append(compile_step(model, target, flavour, MESHES[target], TABLE_SEQ))
            _progress(table[-1])
    summaries, compiled = [], list(table)
    for row in table:
        known = {TABLE_SEQ: row} if TABLE_SEQ in sweeps[row.flavour] else {}
        best, tried, skipped = largest_fitting(
            model, row.target, row.flavour, sweeps[row.flavour], known, deadline
        )
        compiled += tried
        every = [r for r in compiled if (r.target, r.flavour) == (row.target, row.flavour)]
        summaries.append(sweep_summary(row.target, row.flavour, best, every, skipped))
    return table, summaries, compiled


def format_sweeps(summaries: Sequence[dict]) -> str:
    """Markdown: per target and flavour, the largest fitting length and why it stopped."""
    lines = [
        "| target | flavour | largest fitting seq | stops at | why | lengths compiled |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        best = s["largest_fitting"] or "none"
        if s["cut_short"] and s["largest_fitting"]:
            best = f">= {best} (cut short)"
        lines.append(
            f"| {s['target']} | {s['flavour']} | {best} | {s['stopped_at'] or '-'} | "
            f"{(s['why'] or 'fits at every length tried')[:140]} | "
            f"{', '.join(map(str, s['compiled']))} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench train-at-scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="H100 only, a few lengths")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    parser.add_argument(
        "--budget",
        type=float,
        default=25.0,
        metavar="MINUTES",
        help="the sweeps start no compile that would end later than this after the start "
        "(the table's compiles always run; default 25)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Compiles, prints the two tables (markdown) and, with --json, writes every row."""
    from examples.train_lm.config import ONE_BILLION

    args = _parser().parse_args(list(argv))
    targets = ("h100",) if args.quick else tuple(MESHES)
    sweeps = QUICK_SWEEP if args.quick else SWEEP
    start = time.perf_counter()
    print(
        f"train step of ONE_BILLION ({ONE_BILLION.parameter_count() / 1e9:.2f}B parameters, "
        f"{ONE_BILLION.num_experts} experts top-{ONE_BILLION.top_k}, "
        f"{ONE_BILLION.num_layers} layers) compiled for {', '.join(targets)}",
        flush=True,
    )
    table, summaries, compiled = run(ONE_BILLION, targets, sweeps, 60 * args.budget)
    print(f"\nmemory per device and collectives per step at {TABLE_SEQ}-token rows\n")
    print(format_table(table))
    print("\nlargest power-of-two sequence length that fits per device\n")
    print(format_sweeps(summaries))
    seconds = time.perf_counter() - start
    print(f"\n{len(compiled)} compiles in {seconds:.0f} s")
    if args.json:
        figures = dict(
            hbm_bytes=HBM_BYTES,
            meshes=MESHES,
            table=[dataclasses.asdict(r) for r in table],
            sweeps=summaries,
            compiled=[dataclasses.asdict(r) for r in compiled],
            seconds=seconds,
        )
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":  # python -m bench.train_at_scale (or python -m bench train-at-scale)
    import sys

    sys.exit(main(sys.argv[1:]))
