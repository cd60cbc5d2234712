"""Timing of mask -> segment ids on a [4096, 4096] segment mask (goal: < 0.5 s on CPU).

Run alone with `JAX_PLATFORMS=cpu python -m bench.segment_masks`; `python -m bench` calls
`main()`. The goal is stated for this repo's 2-core CPU machine; the device is whatever JAX
picks, so set JAX_PLATFORMS to compare like with like. Rows carry `bytes`: the mask read
plus the output written (memory-bound ops: the throughput column is bytes per second).
"""

from __future__ import annotations

import statistics

import jax
import numpy as np

from bench.report import BenchRow
from bench.timing import repeat_seconds
from jax_bridge.host.segment_ids import (
    is_segment_mask,
    mask_to_segment_ids,
    segment_ids_to_mask,
)

MASK_SIZE = 4096
NUM_SEGMENTS = 64
REPEATS = 7
GOAL_SECONDS = 0.5


def random_segment_mask(rng: np.random.Generator, size: int) -> np.ndarray:
    """[size, size] bool segment mask with ~5% padding, rows and columns shuffled apart."""
    ids = rng.integers(1, NUM_SEGMENTS + 1, size=size)
    ids[rng.random(size) < 0.05] = 0
    return np.asarray(segment_ids_to_mask((ids, rng.permutation(ids))))


def main() -> list[BenchRow]:
    """Prints the timings; returns a row per function (both carry the round-trip check)."""
    mask = jax.device_put(random_segment_mask(np.random.default_rng(0), MASK_SIZE))
    to_ids = jax.jit(mask_to_segment_ids)
    check = jax.jit(is_segment_mask)

    ids_times, ids = repeat_seconds(to_ids, mask, repeats=REPEATS)
    check_times, verdict_out = repeat_seconds(check, mask, repeats=REPEATS)
    ids_seconds, check_seconds = statistics.median(ids_times), statistics.median(check_times)
    rebuilt = np.asarray(segment_ids_to_mask(to_ids(mask)))
    round_trip_ok = bool(np.array_equal(rebuilt, np.asarray(mask))) and bool(check(mask))

    what = f"[{MASK_SIZE}, {MASK_SIZE}] bool, jitted, {jax.devices()[0].platform}"
    verdict = "ok" if ids_seconds < GOAL_SECONDS else f"SLOWER than the {GOAL_SECONDS} s goal"
    print(f"mask_to_segment_ids {what}: median {ids_seconds:.3f} s ({verdict})")
    print(f"is_segment_mask     {what}: median {check_seconds:.3f} s")
    print(f"segment mask round trip: {'ok' if round_trip_ok else 'FAILED'}")
    shape, backend = f"{MASK_SIZE}x{MASK_SIZE} bool", f"{jax.default_backend()} jit"
    # Bytes read and written: the bool mask in, the ids (a pair of int32 [size]) or one bool out.
    moved = {
        "mask_to_segment_ids": mask.nbytes
        + sum(np.asarray(a).nbytes for a in jax.tree.leaves(ids)),
        "is_segment_mask": mask.nbytes + np.asarray(verdict_out).nbytes,
    }
    timings = (("mask_to_segment_ids", ids_times), ("is_segment_mask", check_times))
    return [
        BenchRow(
            "segment_masks",
            name,
            shape,
            backend,
            times,
            ok=round_trip_ok,
            bytes=float(moved[name]),
            params={"mask_size": MASK_SIZE},
        )
        for name, times in timings
    ]


if __name__ == "__main__":
    main()
