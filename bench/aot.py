"""What the hardware compilers say about our ops.

    python -m bench aot [--quick] [--no-cycles] [--json PATH]

Nothing runs: every program is compiled on this host for compile-only devices
(`jax_bridge.compile_for`) by XLA with the real kernel compilers (Triton for H100 and
A100, Mosaic for TPUs).

1. Memory: per target, op, shape and dtype, our op forward + backward compiled (or the
   compiler's error) and XLA's temp memory for it, against a baseline compiled the same
   way: `jax.nn.dot_product_attention` (XLA, a dense document mask) and on TPUs JAX's
   splash kernels for attention; `jax.lax.ragged_dot` and a per-group loop for grouped
   matmul. ratio = baseline temp / ours (above 1: ours needs less).
2. Cycles (TPU v5p and v6e, the chips whose kernels libtpu's static profile prices):
   estimated cycles per visited block of our forward / dQ / dK-dV kernels against JAX's
   splash kernels on the same problem and block sizes, for full and partial blocks
   (`bench/splash_cycles.py` says how blocks are forced to be priced), and an estimate for
   causal, local and document masks from each MaskInfo's block counts.

`--quick` compiles H100 and TPU v6e only and prices bf16 on v6e; `summary_line()` is the
one line the main job prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import splash_cycles

TARGETS = ("h100", "a100", "tpu-v5e", "tpu-v6e")
PRICED = ("tpu-v5p", "tpu-v6e")
TOKENS, HEADS, HEAD_DIM, DOCUMENTS = 8192, 16, 128, 8
ROWS, HIDDEN, FFN, EXPERTS = 16384, 1024, 2048, 8
_MIB = 2**20
MASK_SEQ = 32768  # the sequence the mask estimates count blocks of


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """Temp bytes of one op compiled for one target, ours and a baseline's."""

    target: str
    op: str
    shape: str
    dtype: str
    backend: str
    temp_bytes: int | None
    baseline: str
    baseline_temp_bytes: int | None
    error: str = ""
    baseline_error: str = ""

    @property
    def ratio(self) -> float | None:
        if not self.temp_bytes or self.baseline_temp_bytes is None:
            return None
        return self.baseline_temp_bytes / self.temp_bytes


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _grads(fn: Callable, argnums: tuple[int, ...]) -> Callable:
    """fn's value and gradients: forward and backward in one program."""

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=argnums)


def _temp(fn: Callable, args: Sequence[Any], target: str) -> tuple[int | None, str]:
    from jax_bridge import compile_for

    try:
        return compile_for(fn, *args, target=target).report.temp_bytes, ""
    except Exception as error:  # the compiler's refusal is the row's result
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def _auto_backend(target: str, supported: tuple[str, ...]) -> str:
    """The backend `implementation="auto"` picks on `target`'s platform."""
    from jax_bridge import TARGETS
    from jax_bridge.core.backend import resolve_implementation

    platform = TARGETS[target].platform
    return resolve_implementation("auto", op="bench", supported=supported, platform=platform)


def _rows(target, op, shape, dtype, supported, ours, args, baselines) -> list[MemoryRow]:
    """One row per baseline: our program's temp bytes against the baseline's, each
    compiled for `target` (`baselines`: name -> (program, its arguments))."""
    temp, error = _temp(ours, args, target)
    backend = _auto_backend(target, supported)
    rows = []
    for name, (fn, base_args) in baselines.items():
        base, base_error = _temp(fn, base_args, target)
        rows.append(
            MemoryRow(target, op, shape, dtype, backend, temp, name, base, error, base_error)
        )
    return rows


def attention_rows(target: str, dtype: str) -> list[MemoryRow]:
    """varlen_attention (causal, documents) against dense XLA attention (and JAX splash)."""
    from jax_bridge import varlen_attention

    cu = jnp.asarray(np.linspace(0, TOKENS, DOCUMENTS + 1).astype(np.int32))
    qkv = [_spec((TOKENS, HEADS, HEAD_DIM), dtype)] * 3
    ours = _grads(lambda q, k, v: varlen_attention(q, k, v, cu, cu, causal=True), (0, 1, 2))
    segments = jnp.asarray(np.repeat(np.arange(DOCUMENTS), TOKENS // DOCUMENTS))

    def dense(q, k, v):
        same = segments[:, None] == segments[None, :]
        return jax.nn.dot_product_attention(
            q[None],
            k[None],
            v[None],
            mask=same[None, None],
            is_causal=True,
            implementation="xla",
        )[0]

    baselines = {"dot_product_attention": (_grads(dense, (0, 1, 2)), qkv)}
    if target.startswith("tpu"):
        baselines["jax splash"] = _jax_splash(dtype, segments)
    shape = f"{TOKENS}x{HEADS}x{HEAD_DIM}, {DOCUMENTS} docs"
    supported = ("xla", "triton", "pallas")
    return _rows(target, "varlen_attention fwd+bwd", shape, dtype, supported, ours, qkv, baselines)


def _jax_splash(dtype: str, segments: jax.Array):
    """JAX's splash on [heads, tokens, head_dim], causal, documents as segment ids."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((TOKENS, TOKENS))] * HEADS)
    kernel = sk.make_splash_mha_single_device(mask)
    ids = sk.SegmentIds(segments, segments)
    fn = _grads(lambda q, k, v: kernel(q, k, v, segment_ids=ids), (0, 1, 2))
    return fn, [_spec((HEADS, TOKENS, HEAD_DIM), dtype)] * 3


def grouped_matmul_rows(target: str, dtype: str) -> list[MemoryRow]:
    """grouped_matmul forward + backward against ragged_dot and a per-group loop, both
    with float32 outputs like grouped_matmul's default preferred_element_type."""
    from jax_bridge import grouped_matmul

    sizes = jnp.asarray(np.full(EXPERTS, ROWS // EXPERTS), jnp.int32)
    args = [_spec((ROWS, HIDDEN), dtype), _spec((EXPERTS, HIDDEN, FFN), dtype)]
    f32 = jnp.float32
    group = jnp.repeat(jnp.arange(EXPERTS), ROWS // EXPERTS, total_repeat_length=ROWS)

    def loop(lhs, rhs):
        rows_of = lambda g: jnp.where((group == g)[:, None], lhs, 0)
        return sum(jnp.dot(rows_of(g), rhs[g], preferred_element_type=f32) for g in range(EXPERTS))

    ragged = lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=f32)
    baselines = {
        "ragged_dot": (_grads(ragged, (0, 1)), args),
        "per-group loop": (_grads(loop, (0, 1)), args),
    }
    ours = _grads(lambda a, b: grouped_matmul(a, b, sizes), (0, 1))
    shape = f"{ROWS}x{HIDDEN} @ {EXPERTS}x{HIDDEN}x{FFN}"
    op = "grouped_matmul fwd+bwd"
    return _rows(target, op, shape, dtype, ("xla", "triton"), ours, args, baselines)


def memory_rows(targets: Sequence[str]) -> list[MemoryRow]:
    from jax_bridge import TARGETS

    rows = []
    for target in targets:
        for dtype in ("bfloat16", "float32"):
            if dtype in TARGETS[target].dtypes:
                rows += attention_rows(target, dtype) + grouped_matmul_rows(target, dtype)
    return rows


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / _MIB:,.1f} MiB"


def format_memory(rows: Sequence[MemoryRow]) -> str:
    lines = [
        f"{'target':8} {'op':24} {'dtype':8} {'backend':7} {'temp':>12} "
        f"{'baseline':22} {'base temp':>12} {'base/ours':>9}"
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:,.1f}x"
        ours = "ERROR" if r.error else _mib(r.temp_bytes)
        base = "ERROR" if r.baseline_error else _mib(r.baseline_temp_bytes)
        lines.append(
            f"{r.target:8} {r.op:24} {r.dtype:8} {r.backend:7} {ours:>12} "
            f"{r.baseline:22} {base:>12} {ratio:>9}"
        )
    shapes = dict.fromkeys(f"  {r.op}: {r.shape}" for r in rows)
    errors = [
        f"  {r.target} {r.op} {r.dtype}: {r.error or r.baseline_error}"
        for r in rows
        if r.error or r.baseline_error
    ]
    return "\n".join([*lines, "shapes:", *shapes, *(["errors:", *errors] if errors else [])])


# Targets (issue 19): per visited block, ours <= 1.0x JAX's splash on a full block and
# <= 1.25x on a partial block, for every kernel, on v5p and v6e, in bf16 and f32.
FULL_GOAL, PARTIAL_GOAL = 1.0, 1.25


def _price_all(target: str, dtype: str, problem) -> tuple[dict, dict, dict]:
    """(ours, jax's, errors): {kind: {kernel: cycles per block}} for every kind that
    libtpu's profiler priced, and {who kind: why not} for the rest (its own aborts)."""
    ours, theirs, errors = {}, {}, {}
    for who, kinds, into in (
        ("ours", ("full", "partial", "isolating"), ours),
        ("jax", ("full", "partial"), theirs),
    ):
        for kind in kinds:
            try:
                into[kind] = splash_cycles.block_cycles(target, dtype, problem, who, kind)
            except RuntimeError as error:
                errors[f"{who} {kind}"] = str(error).splitlines()[0][:200]
    return ours, theirs, errors


def cycle_rows(targets: Sequence[str], dtypes: Sequence[str], problem) -> list[dict]:
    """Per target, dtype and kernel: estimated cycles per block, ours vs JAX's; and the
    mask estimates (causal, local, documents) built from them."""
    rows = []
    # Block counts of a longer sequence (cheap: MaskInfo only) at the priced block size.
    long = dataclasses.replace(problem, seq=MASK_SEQ)
    masks = splash_cycles.example_masks(long)
    counts = {name: splash_cycles.mask_blocks(m, long) for name, m in masks.items()}
    for target in targets:
        for dtype in dtypes:
            ours, theirs, errors = _price_all(target, dtype, problem)
            for what, reason in errors.items():
                rows.append(
                    dict(target=target, dtype=dtype, mask="error", error=f"{what}: {reason}")
                )
            for kernel in splash_cycles.KERNELS:
                rows.append(_block_row(target, dtype, kernel, ours, theirs))
            if not all(k in d for d in (ours, theirs) for k in ("full", "partial")):
                continue
            for name, count in counts.items():
                mine = splash_cycles.estimate_mask_cycles(count, ours["full"], ours["partial"])
                base = splash_cycles.estimate_mask_cycles(count, theirs["full"], theirs["partial"])
                for kernel in splash_cycles.KERNELS:
                    rows.append(
                        dict(
                            target=target,
                            dtype=dtype,
                            kernel=kernel,
                            mask=name,
                            blocks=count[kernel],
                            ours=mine[kernel],
                            jax=base[kernel],
                            ratio=mine[kernel] / base[kernel],
                        )
                    )
    return rows


def _block_row(target, dtype, kernel, ours, theirs) -> dict:
    """One kernel's cycles per block; None where the profiler gave no figure."""
    get = lambda table, kind: table.get(kind, {}).get(kernel)
    ratio = lambda kind: (
        None
        if get(ours, kind) is None or get(theirs, kind) is None
        else get(ours, kind) / get(theirs, kind)
    )
    full, partial = ratio("full"), ratio("partial")
    goal = (
        None if full is None or partial is None else full <= FULL_GOAL and partial <= PARTIAL_GOAL
    )
    return dict(
        target=target,
        dtype=dtype,
        kernel=kernel,
        mask="one block",
        ours_full=get(ours, "full"),
        jax_full=get(theirs, "full"),
        full_ratio=full,
        ours_partial=get(ours, "partial"),
        jax_partial=get(theirs, "partial"),
        partial_ratio=partial,
        ours_isolating=get(ours, "isolating"),
        meets_goal=goal,
    )


def format_cycles(rows: Sequence[dict], problem) -> str:
    blocks = [r for r in rows if r["mask"] == "one block"]
    lines = [
        f"estimated cycles per visited block ({problem.heads} heads x {problem.seq}, "
        f"d={problem.head_dim}, blocks {problem.block}; goal: full <= {FULL_GOAL}x, "
        f"partial <= {PARTIAL_GOAL}x JAX's splash)",
        f"{'target':8} {'dtype':8} {'kernel':7} {'full ours/jax':>18} {'ratio':>6} "
        f"{'partial ours/jax':>18} {'ratio':>6} {'isolating':>9} goal",
    ]
    cell = lambda x, spec: "-" if x is None else format(x, spec)
    for r in blocks:
        goal = {None: "n/a", True: "met", False: "MISSED"}[r["meets_goal"]]
        lines.append(
            f"{r['target']:8} {r['dtype']:8} {r['kernel']:7} "
            f"{cell(r['ours_full'], '>8.0f')} / {cell(r['jax_full'], '<7.0f')} "
            f"{cell(r['full_ratio'], '>6.2f')} "
            f"{cell(r['ours_partial'], '>8.0f')} / {cell(r['jax_partial'], '<7.0f')} "
            f"{cell(r['partial_ratio'], '>6.2f')} {cell(r['ours_isolating'], '>9.0f')} {goal}"
        )
    lines.append(
        f"\nmask estimates at {MASK_SEQ} tokens (full x full blocks + partial x partial "
        "blocks, our MaskInfo)"
    )
    lines.append(
        f"{'target':8} {'dtype':8} {'mask':10} {'kernel':7} {'full, partial':>14} "
        f"{'ours Mcycles':>12} {'jax Mcycles':>12} {'ratio':>6}"
    )
    for r in rows:
        if r["mask"] == "error":
            lines.insert(2, f"{r['target']:8} {r['dtype']:8} not priced: {r['error']}")
    for r in rows:
        if r["mask"] not in ("one block", "error"):
            full, partial = r["blocks"]
            lines.append(
                f"{r['target']:8} {r['dtype']:8} {r['mask']:10} {r['kernel']:7} "
                f"{f'{full}, {partial}':>14} {r['ours'] / 1e6:>12.3f} {r['jax'] / 1e6:>12.3f} "
                f"{r['ratio']:>6.2f}"
            )
    return "\n".join(lines)


def summary_line() -> str:
    """One line for the main job: H100 and TPU v6e temp memory of varlen attention
    forward + backward in bf16 against dense XLA attention (compiled, not run)."""
    parts = []
    for target in ("h100", "tpu-v6e"):
        try:
            row = attention_rows(target, "bfloat16")[0]
        except Exception as error:  # e.g. libtpu missing
            parts.append(f"{target}: {type(error).__name__}")
            continue
        if row.error:
            parts.append(f"{target}: compile ERROR")
            continue
        parts.append(
            f"{target} temp {_mib(row.temp_bytes)} vs {_mib(row.baseline_temp_bytes)} "
            f"dense ({row.ratio:,.0f}x less)"
        )
    shape = f"{TOKENS} tokens x {HEADS} heads, d={HEAD_DIM}, bf16"
    return f"compiled varlen_attention fwd+bwd ({shape}): " + "; ".join(parts)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench aot", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="H100 and v6e, cycles bf16 on v6e")
    parser.add_argument("--no-cycles", action="store_true", help="memory table only")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    return parser


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    targets = ("h100", "tpu-v6e") if args.quick else TARGETS
    memory = memory_rows(targets)
    print("## temp memory, forward + backward (compiled, not run)\n" + format_memory(memory))
    problem = splash_cycles.Problem()
    cycles: list[dict] = []
    if not args.no_cycles:
        priced = ("tpu-v6e",) if args.quick else PRICED
        dtypes = ("bfloat16",) if args.quick else ("bfloat16", "float32")
        cycles = cycle_rows(priced, dtypes, problem)
        print("\n## TPU kernels, libtpu's static estimate\n" + format_cycles(cycles, problem))
    print(f"\n(bench aot: {time.perf_counter() - start:.0f} s)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "memory": [dataclasses.asdict(r) | {"ratio": r.ratio} for r in memory],
            "cycles": cycles,
            "problem": dataclasses.asdict(problem),
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    failed = [r for r in memory if r.error]
    return 1 if failed else 0
