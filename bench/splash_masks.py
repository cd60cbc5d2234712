"""Timing of splash `process_mask` / `process_mask_dkv` (MaskInfo building) against JAX's.

Run alone with `JAX_PLATFORMS=cpu python -m bench.splash_masks`; `python -m bench` calls
`main()`. Masks: causal, local (window (1024, 0)) and documents (64 random documents,
causal inside each), at 8k / 32k / 128k tokens and 128 / 512 square blocks. Ours classifies
blocks from row intervals in O(tokens + blocks); JAX's splash `process_mask` loops over
every block in Python, so it is timed only where it is expected to finish in 60 s (the
estimate scales the time measured at a smaller size by the number of blocks); `--quick`
(the default) times JAX at 8k only. Both functions are lru_cached: the caches are cleared
before every timed call. The last row is ours on a 1,048,576-token causal mask at 512x512
blocks against its goal of 1 s.

Every row is checked: against JAX's MaskInfo where JAX ran (block_mask equal, data_next
equal on non-empty blocks), else by counting non-empty blocks against a count derived
independently from the mask's rule at block granularity.

Rows carry `bytes`: the MaskInfo arrays ours writes (its input is a rule, not an array,
so the output is all the memory it must move): throughput is MaskInfo bytes per second.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jax_masks
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask_info as jax_mask_info,
)

from bench.report import BenchRow, format_seconds
from pallas_tpu.splash import mask_info, masks

SIZES = (8192, 32768, 131072)
BLOCKS = (128, 512)
KINDS = ("causal", "local", "document")
LOCAL_WINDOW = (1024, 0)
NUM_DOCUMENTS = 64
REPEATS = 3
JAX_LIMIT_S = 60.0
QUICK_JAX_MAX_SIZE = 8192
GOAL_SIZE, GOAL_BLOCK, GOAL_SECONDS = 1_048_576, 512, 1.0
BACKEND = "numpy host"


class JaxDocumentMask(jax_masks._ComputableMask):
    """Causal-within-document mask in JAX splash's own mask class (its mask_function sees
    token ids; documents and positions relative to the document's end are looked up)."""

    def __init__(self, cu_seqlens: np.ndarray, length: int):
        token = np.arange(length)
        document = np.searchsorted(cu_seqlens, token, side="right") - 1
        relative = token - cu_seqlens[document + 1]

        def same_document_causal(q_ids, kv_ids):
            return (document[q_ids] == document[kv_ids]) & (relative[q_ids] >= relative[kv_ids])

        super().__init__((length, length), same_document_causal)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


@dataclasses.dataclass(frozen=True)
class Case:
    """One mask at one size and block size, in both libraries."""

    kind: str
    size: int
    block: int
    ours: masks.Mask
    theirs: jax_masks.Mask
    cu_seqlens: np.ndarray | None

    @property
    def shape(self) -> str:
        return f"{self.size} tok {self.block}x{self.block}"


def random_cu_seqlens(rng: np.random.Generator, size: int) -> np.ndarray:
    """NUM_DOCUMENTS non-empty documents covering `size` tokens at random cut points."""
    cuts = np.sort(rng.choice(np.arange(1, size), NUM_DOCUMENTS - 1, replace=False))
    return np.concatenate([[0], cuts, [size]]).astype(np.int32)


def make_case(kind: str, size: int, block: int) -> Case:
    """The same mask as ours and as JAX's (a MultiHeadMask of one head for JAX)."""
    shape = (size, size)
    cu = None
    if kind == "causal":
        ours, theirs = masks.CausalMask(shape), jax_masks.CausalMask(shape)
    elif kind == "local":
        ours = masks.LocalMask(shape, LOCAL_WINDOW)
        theirs = jax_masks.LocalMask(shape, LOCAL_WINDOW, 0)
    else:
        cu = random_cu_seqlens(np.random.default_rng(size), size)
        ours, theirs = masks.DocumentMask(cu, causal=True), JaxDocumentMask(cu, size)
    return Case(kind, size, block, ours, jax_masks.MultiHeadMask((theirs,)), cu)


def expected_nonempty_blocks(case: Case) -> int:
    """Non-empty blocks from the mask's rule at block granularity (independent of both
    implementations): block (qi, ki) holds q rows [qi b, qi b + b) and kv rows likewise."""
    b, n = case.block, case.size // case.block
    qi = np.arange(n)
    if case.kind == "causal":
        return n * (n + 1) // 2
    if case.kind == "local":  # some i - left <= j <= i: ki <= qi and kv end >= q start - left
        first_ki = np.maximum(0, -(-(qi * b - LOCAL_WINDOW[0] - b + 1) // b))
        return int(np.sum(qi - first_ki + 1))
    blocks = np.zeros((n, n), bool)
    for start, end in itertools.pairwise(case.cu_seqlens):
        rows = np.arange(start // b, (end - 1) // b + 1)
        q, k = np.meshgrid(rows, rows, indexing="ij")
        # Non-empty iff the document's earliest kv token in block k precedes its latest q token.
        blocks[q, k] |= np.maximum(k * b, start) <= np.minimum(q * b + b - 1, end - 1)
    return int(blocks.sum())


def info_bytes(info: Any) -> int:
    """Bytes of every array a MaskInfo holds."""
    return sum(np.asarray(a).nbytes for a in info[:5] if a is not None)


def format_bytes(size: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024 or unit == "MiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def timed(fn: Callable[[], Any], clear: Callable[[], None], repeats: int):
    """Wall times of `repeats` calls of fn, each after clearing the lru cache; last output."""
    times, out = [], None
    for _ in range(repeats):
        clear()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return tuple(times), out


def run_ours(case: Case, is_dkv: bool, repeats: int = REPEATS):
    process = mask_info.process_mask_dkv if is_dkv else mask_info.process_mask
    times, (info, _) = timed(
        lambda: process(case.ours, (case.block, case.block)),
        mask_info._process_static.cache_clear,
        repeats,
    )
    return times, info


def run_jax(case: Case, is_dkv: bool):
    process = jax_mask_info.process_mask_dkv if is_dkv else jax_mask_info.process_mask
    times, (info, _) = timed(
        lambda: process(case.theirs, (case.block, case.block)),
        jax_mask_info._process_mask.cache_clear,
        1,
    )
    return times, info


def same_info(ours: Any, theirs: Any) -> bool:
    """block_mask equal everywhere, data_next equal on non-empty blocks."""
    if np.shape(ours.block_mask) != np.shape(theirs.block_mask):
        return False
    used = np.asarray(theirs.block_mask) != 0
    return bool(
        np.array_equal(ours.block_mask, theirs.block_mask)
        and np.array_equal(np.asarray(ours.data_next)[used], np.asarray(theirs.data_next)[used])
    )


@dataclasses.dataclass
class JaxPlanner:
    """Decides whether JAX's per-block loop runs, from the last time measured per
    (kind, block, function): time grows with the number of blocks."""

    max_size: int
    measured: dict[tuple[str, int, bool], tuple[int, float]] = dataclasses.field(
        default_factory=dict
    )

    def skip_reason(self, case: Case, is_dkv: bool) -> str | None:
        key = (case.kind, case.block, is_dkv)
        estimate = None
        if key in self.measured:
            size, seconds = self.measured[key]
            estimate = seconds * (case.size / size) ** 2
        if estimate is not None and estimate > JAX_LIMIT_S:
            return f"skipped (est. {estimate:.0f} s > {JAX_LIMIT_S:.0f} s)"
        if case.size > self.max_size:
            shown = "" if estimate is None else f"; est. {format_seconds(estimate)}"
            return f"skipped (--quick{shown})"
        return None

    def record(self, case: Case, is_dkv: bool, seconds: float) -> None:
        self.measured[(case.kind, case.block, is_dkv)] = (case.size, seconds)


def bench_case(case: Case, is_dkv: bool, planner: JaxPlanner) -> tuple[BenchRow, str]:
    """One row (ours against JAX's or its skip reason) and its printed line."""
    op = f"{'process_mask_dkv' if is_dkv else 'process_mask'} {case.kind}"
    times, info = run_ours(case, is_dkv)
    skip = planner.skip_reason(case, is_dkv)
    theirs_times, theirs_bytes = (), "-"
    if skip is None:
        theirs_times, theirs = run_jax(case, is_dkv)
        planner.record(case, is_dkv, theirs_times[0])
        ok = same_info(info, theirs)
        theirs_bytes = format_bytes(info_bytes(theirs))
        baseline = "jax splash process_mask"
    else:
        ok = int(np.count_nonzero(info.block_mask)) == expected_nonempty_blocks(case)
        baseline = f"jax splash: {skip}"
    ours_bytes = format_bytes(info_bytes(info))
    row = BenchRow(
        "splash_masks",
        op,
        f"{case.shape} ({ours_bytes})",
        BACKEND,
        times,
        baseline,
        theirs_times,
        ok,
        bytes=float(info_bytes(info)),
        params={"seq_len": case.size, "block": case.block},
    )
    theirs_time = format_seconds(theirs_times[0]) if theirs_times else skip
    line = (
        f"{op:<26} {case.shape:<20} ours {format_seconds(statistics.median(times)):>9}"
        f" {ours_bytes:>10} | jax {theirs_time:>9} {theirs_bytes:>10}"
        f" | {'ok' if ok else 'FAILED'}"
    )
    return row, line


def goal_row() -> tuple[BenchRow, str]:
    """Ours on the 1M-token causal mask at 512x512 blocks against the 1 s goal."""
    case = make_case("causal", GOAL_SIZE, GOAL_BLOCK)
    times, info = run_ours(case, is_dkv=False)
    ok = int(np.count_nonzero(info.block_mask)) == expected_nonempty_blocks(case)
    seconds = statistics.median(times)
    verdict = "ok" if seconds < GOAL_SECONDS else f"SLOWER than the {GOAL_SECONDS:.0f} s goal"
    shape = f"{case.shape} ({format_bytes(info_bytes(info))})"
    line = f"process_mask causal {case.shape}: median {format_seconds(seconds)} ({verdict})"
    row = BenchRow(
        "splash_masks", "process_mask causal", shape, BACKEND, times,
        f"goal {GOAL_SECONDS:.0f} s", (GOAL_SECONDS,), ok,
        bytes=float(info_bytes(info)), params={"seq_len": case.size, "block": case.block},
    )  # fmt: skip
    return row, line


def main(*, full: bool = False) -> list[BenchRow]:
    """Prints the mask table; returns a row per (mask, size, block, function); `full`:
    JAX's planner up to the largest size too (`python -m bench --full`)."""
    planner = JaxPlanner(max_size=max(SIZES) if full else QUICK_JAX_MAX_SIZE)
    # Warm-up: the first call of either library pays for imports and numpy set-up.
    warm = make_case("causal", 1024, 128)
    run_ours(warm, False, repeats=1)
    run_jax(warm, False)
    rows = []
    for block, kind, size in itertools.product(BLOCKS, KINDS, SIZES):
        case = make_case(kind, size, block)
        for is_dkv in (False, True):
            row, line = bench_case(case, is_dkv, planner)
            print(line)
            rows.append(row)
    row, line = goal_row()
    print(line)
    return [*rows, row]


if __name__ == "__main__":
    main()
