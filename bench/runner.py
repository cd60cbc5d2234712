"""One runner for the GPU rows: timing, checks and FLOP counts, for rows declared as data.

A `Case` declares a row: the op, its shape, its forward FLOPs, how to draw its inputs, our
implementation and the anchors (baselines) to time against it in the same run, and the
tolerance of the check. `run_case` turns it into `BenchRow`s, one per (pass, anchor):

* timing (`back_to_back_seconds`): after a warm-up (compile) call, each repeat queues
  `calls` calls back to back and synchronises once at the end; a repeat's figure is its
  wall time / `calls`. Host dispatch then overlaps the device work instead of adding to
  every call (a sync per call adds ~150 us on a GPU, to both sides of a ratio).
  `calls` is chosen per implementation so that a repeat lasts about `Timing.target_s`.
* forward + backward returns the output with the gradients (`(out, grads)`), so that XLA
  cannot drop a forward the backward does not need;
* FLOPs: the useful forward FLOPs of the case, times `FWD_BWD_FLOP_FACTOR[case.work]` for
  forward + backward (bench/report.py states the conventions);
* checks: every output and gradient against the anchor's, converted to our layout
  (`Impl.canonical`), as max |ours - anchor| / max |anchor| < `case.tolerance`. An anchor
  that does different work (a dense matmul of the same FLOPs) has no `canonical` and its
  rows carry no check.

An anchor that cannot run here (no PyTorch, no cuDNN, a shape it refuses) is reported on
one line and skipped; ours failing is a failed row (`ok=False`: the run exits non-zero).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.report import FWD_BWD_FLOP_FACTOR, BenchRow

# The names of the checked arrays, output first, in `Impl.canonical`'s order.
RESULT_NAMES = {"attention": ("out", "dq", "dk", "dv"), "matmul": ("out", "dlhs", "drhs")}
PASSES = ("forward", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Timing:
    """How to time: `repeats` repeats of about `target_s` seconds each (at least one call,
    at most `max_calls`), or of exactly `calls` calls where given (no sizing call: what a
    slow interpreter or a profiler wants); the row keeps every repeat's per-call time.
    Untimed repeats run first, at least `warmup_repeats` of them and until `warmup_s`
    seconds have passed: on an H100 a cold row's repeats of 20 ms ran 2346, 1078, 751, 659
    and 581 us per call against 316 warm (clocks and caches settling)."""

    repeats: int = 5
    target_s: float = 0.02
    max_calls: int = 200
    calls: int | None = None
    warmup_repeats: int = 1
    warmup_s: float = 0.2


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of a case: ours or an anchor.

    `prepare(host)` turns the case's host inputs (float32 numpy arrays, our layout) into
    `(args, d_out)` on the device in this implementation's layout; the first
    `Case.num_diff` args are differentiated. `fn(*args)` is the timed forward.
    `canonical(result, grad)` maps the result (`out`, or `(out, grads)` for fwd+bwd) to a
    list of float32 numpy arrays in our layout ([out] or [out, *grads]); None: unchecked.
    `framework`: "jax" (jitted by the runner) or "torch" (called eagerly, as compiled by
    the case). `grad`: whether it has a backward to time; `forward`: whether its forward
    is its own to time (False: an A/B anchor that differs from ours in the backward only).
    """

    name: str
    fn: Callable[..., Any]
    prepare: Callable[[dict[str, np.ndarray]], tuple[tuple, Any]]
    canonical: Callable[[Any, bool], list[np.ndarray]] | None
    framework: str = "jax"
    grad: bool = True
    forward: bool = True


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table as data (see the module docstring)."""

    section: str
    op: str
    key: str
    shape: str
    work: str  # a key of FWD_BWD_FLOP_FACTOR
    forward_flops: float
    inputs: Callable[[], dict[str, np.ndarray]]
    ours: Impl
    anchors: tuple[Impl, ...]
    tolerance: float
    num_diff: int
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The A/B part of a row (`gpu_rows.ab_apart`): its anchors are ours in other
    # configurations, and ours (timed in the row's first part too) is timed only in the
    # passes they time.
    ab_part: bool = False

    def flops(self, label: str) -> float:
        """Useful FLOPs of one call of pass `label` ('forward' or 'fwd+bwd')."""
        return self.forward_flops * (FWD_BWD_FLOP_FACTOR[self.work] if label != "forward" else 1)


def back_to_back_seconds(
    fn: Callable[..., Any], args: Sequence[Any], sync: Callable[[Any], Any], timing: Timing
) -> tuple[tuple[float, ...], Any, int]:
    """(per-call seconds of each repeat, the warm-up call's result, calls per repeat).

    One warm-up (compile) call and, unless `timing.calls` is given, one synchronised call
    to size the repeats; then each repeat (the untimed warm-up repeats first) issues `calls`
    calls and synchronises on the last result only (a device runs one stream in order: the
    last result ready means all are).
    """
    result = fn(*args)
    sync(result)
    calls = timing.calls
    if calls is None:
        start = time.perf_counter()
        sync(fn(*args))
        once = time.perf_counter() - start
        calls = max(1, min(timing.max_calls, math.ceil(timing.target_s / max(once, 1e-9))))

    def repeat() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            last = fn(*args)
        sync(last)
        return (time.perf_counter() - start) / calls

    warm_start, warmed = time.perf_counter(), 0
    while warmed < timing.warmup_repeats or time.perf_counter() - warm_start < timing.warmup_s:
        repeat()
        warmed += 1
    return tuple(repeat() for _ in range(timing.repeats)), result, calls


def relative_error(result: np.ndarray, reference: np.ndarray) -> float:
    """max |result - reference| / max |reference| in float32 (0 for two all-zero arrays)."""
    a, b = (np.asarray(x, np.float32) for x in (result, reference))
    if a.shape != b.shape:
        raise ValueError(f"check: result shape {a.shape} != reference shape {b.shape}")
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / max(scale, 1e-30) if a.size else 0.0


def _jax_callable(impl: Impl, num_diff: int, grad: bool) -> Callable[..., Any]:
    import jax

    if not grad:
        return jax.jit(impl.fn)

    def run(*args_and_cotangent):
        *args, d_out = args_and_cotangent
        rest = args[num_diff:]
        out, pullback = jax.vjp(lambda *d: impl.fn(*d, *rest), *args[:num_diff])
        return out, pullback(d_out)  # the output too: XLA must not drop the forward

    return jax.jit(run)


def _torch_callable(impl: Impl, num_diff: int, grad: bool) -> Callable[..., Any]:
    import torch

    if not grad:

        def forward(*args):
            with torch.no_grad():
                return impl.fn(*args)

        return forward

    def run(*args_and_cotangent):
        *args, d_out = args_and_cotangent
        out = impl.fn(*args)
        return out, torch.autograd.grad(out, args[:num_diff], d_out)

    return run


def _torch_sync(_result: Any) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(
    impl: Impl, host: dict[str, np.ndarray], case: Case, grad: bool, timing: Timing
) -> tuple[tuple[float, ...], Any, int]:
    """Times `impl` on the case's inputs: (per-call seconds per repeat, result, calls)."""
    args, d_out = impl.prepare(host)
    call_args = (*args, d_out) if grad else tuple(args)
    if impl.framework == "torch":
        fn, sync = _torch_callable(impl, case.num_diff, grad), _torch_sync
    else:
        import jax

        fn, sync = _jax_callable(impl, case.num_diff, grad), jax.block_until_ready
    return back_to_back_seconds(fn, call_args, sync, timing)


def _check(case: Case, anchor: Impl, ours: list[np.ndarray], result: Any, grad: bool):
    """(ok or None, 'out 1.2e-03, dq ...') of ours against the anchor's result."""
    if anchor.canonical is None:
        return None, "unchecked (different work)"
    names = RESULT_NAMES[case.work][: len(ours)]
    errors = [
        relative_error(a, b) for a, b in zip(ours, anchor.canonical(result, grad), strict=True)
    ]
    ok = max(errors) < case.tolerance
    text = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors, strict=True))
    return ok, text + (" OK" if ok else " MISMATCH")


def _row(case: Case, label: str, ours_times, anchor: str = "", anchor_times=(), ok=None):
    return BenchRow(
        case.section,
        f"{case.op} {label}",
        case.shape,
        f"{case.ours.name}",
        tuple(ours_times),
        anchor,
        tuple(anchor_times),
        ok,
        flops=case.flops(label),
        params=dict(case.params),
    )


def _rate(flops: float, seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms {flops / seconds / 1e12:7.2f} TFLOP/s"


def run_case(
    case: Case, timing: Timing, passes: Sequence[str] = PASSES, anchors: bool = True
) -> list[BenchRow]:
    """Times ours and every anchor on `case` for each pass; one row per (pass, anchor that
    ran), or one row without a baseline where none ran (in an A/B part, `Case.ab_part`, a
    pass none of its anchors times is skipped). Prints a line per measurement."""
    host = case.inputs()
    print(f"{case.op} {case.shape}{' (A/B anchors)' if case.ab_part else ''}:")
    rows = []
    for label in passes:
        grad = label != "forward"
        timed = [a for a in case.anchors if (a.grad if grad else a.forward)] if anchors else []
        if case.ab_part and not timed:
            continue
        times, result, calls = measure(case.ours, host, case, grad, timing)
        ours = case.ours.canonical(result, grad)
        median = float(np.median(times))
        print(
            f"  {label:8s} {case.ours.name:26s} {_rate(case.flops(label), median)} ({calls} calls)"
        )
        found = []
        for anchor in timed:
            try:
                anchor_times, anchor_result, calls = measure(anchor, host, case, grad, timing)
                ok, errors = _check(case, anchor, ours, anchor_result, grad)
            except Exception as error:  # an anchor refusing the shape or absent: say so
                print(
                    f"  {label:8s} {anchor.name:26s} unavailable: {type(error).__name__}: "
                    f"{str(error).splitlines()[0][:160] if str(error) else ''}"
                )
                continue
            theirs = float(np.median(anchor_times))
            print(
                f"  {label:8s} {anchor.name:26s} {_rate(case.flops(label), theirs)} "
                f"speed ours/anchor {theirs / median:5.2f}x | {errors}"
            )
            found.append(_row(case, label, times, anchor.name, anchor_times, ok))
        # An A/B part's ours was timed in its row's first part: alone it adds nothing.
        rows += found or ([] if case.ab_part else [_row(case, label, times)])
    return rows


def run_cases(
    cases: Sequence[Case],
    timing: Timing,
    *,
    passes: Sequence[str] = PASSES,
    anchors: bool = True,
    budget_s: float | None = None,
    on_rows: Callable[[list[BenchRow]], None] | None = None,
) -> list[BenchRow]:
    """`run_case` over `cases` (a case whose own implementation fails becomes a failed
    row, and the next case runs; the A/B part of a row whose ours failed is skipped);
    past `budget_s` seconds the remaining cases are named and skipped (a GPU check must
    end in its time slot with the rows it has). `on_rows` gets the rows so far after each
    case (to save them before a time limit kills the run)."""
    start, rows, failed = time.perf_counter(), [], set()
    for index, case in enumerate(cases):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            skipped = ", ".join(c.key for c in cases[index:])
            print(f"time budget of {budget_s:.0f} s spent: skipped {skipped}")
            break
        if case.ab_part and (case.op, case.shape) in failed:
            print(f"{case.op} {case.shape} (A/B anchors): skipped, ours failed above")
            continue
        try:
            rows += run_case(case, timing, passes, anchors)
        except Exception as error:  # ours failed: a failed row, and on to the next case
            print(f"  ours failed: {type(error).__name__}: {str(error)[:300]}")
            rows.append(BenchRow(case.section, case.op, case.shape, case.ours.name, ok=False))
            failed.add((case.op, case.shape))
        if on_rows is not None:
            on_rows(rows)
    return rows
