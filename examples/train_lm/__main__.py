"""Trains the example MoE language model on packed standard-library sources and prints
its loss curve: `python examples/train_lm [--steps N] [--mesh D,E,C] [--flavour ours|dense]`.

On a machine without an accelerator JAX runs on the CPU with as many fake devices as the
mesh needs (`--mesh 2,2,2`, the default: data 2, expert 2, context 2 on 8 devices).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> argparse.Namespace:
    sys.path.insert(0, str(REPO))
    from examples.train_lm.config import TrainConfig  # imports no jax

    parser = argparse.ArgumentParser(prog="python examples/train_lm", description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mesh", default="2,2,2", help="data,expert,context sizes")
    parser.add_argument("--flavour", choices=("ours", "dense"), default="ours")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args(argv)
    if min(args.steps, args.seq_len, args.rows) < 1:
        parser.error("--steps, --seq-len and --rows must be positive")
    shortest = TrainConfig.min_document
    if args.seq_len < shortest:
        parser.error(
            f"--seq-len must be at least {shortest} (the shortest document): a shorter row "
            f"holds no document to train on, got {args.seq_len}"
        )
    try:
        args.mesh = tuple(int(n) for n in args.mesh.split(","))
        assert len(args.mesh) == 3 and min(args.mesh) >= 1
    except (ValueError, AssertionError):
        parser.error(f"--mesh takes three positive ints D,E,C, got {args.mesh!r}")
    return args


def _use_cpu_devices(count: int) -> None:
    """Without a GPU or TPU: JAX on the CPU with `count` devices (before jax is imported)."""
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/accel0"):
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def curve(losses: list[float], width: int = 60, height: int = 12) -> str:
    """The loss curve as text: one column per step bucket, rows from max to min loss."""
    buckets = [
        losses[i * len(losses) // width : (i + 1) * len(losses) // width] for i in range(width)
    ]
    means = [sum(b) / len(b) for b in buckets if b]
    top, bottom = max(means), min(means)
    span = (top - bottom) or 1.0
    levels = [round((top - m) / span * (height - 1)) for m in means]
    rows = [
        f"{top - r * span / (height - 1):7.3f} |"
        + "".join("*" if lv == r else " " for lv in levels)
        for r in range(height)
    ]
    return "\n".join(
        [*rows, " " * 8 + "+" + "-" * len(means), f"{'':9s}steps 0..{len(losses) - 1}"]
    )


def main(argv: list[str]) -> None:
    args = _parse(argv)
    data, expert, context = args.mesh
    _use_cpu_devices(data * expert * context)
    import jax
    from tqdm import tqdm

    from examples.train_lm.config import TINY, TrainConfig
    from examples.train_lm.data import Prefetcher, batches
    from examples.train_lm.train import Trainer, losses_summary, make_mesh, run

    train = TrainConfig(seq_len=args.seq_len, rows=args.rows, steps=args.steps)
    mesh = make_mesh(data, expert, context) if data * expert * context > 1 else None
    trainer = Trainer(TINY, train, args.flavour, mesh)
    print(
        f"{args.flavour} model, {TINY.parameter_count():,} parameters, {TINY.num_layers} layers; "
        f"{train.rows} rows x {train.seq_len} tokens per step; mesh {args.mesh} on "
        f"{jax.devices()[0].platform}"
    )
    source = Prefetcher(batches(train))
    losses, start = [], time.perf_counter()
    try:
        for metrics in tqdm(run(trainer, source, args.steps), total=args.steps, unit="step"):
            losses.append(metrics["loss"])
    finally:
        source.close()
    print(curve(losses))
    seconds = time.perf_counter() - start
    # Compilations, not traces: a step re-compiled for new input shardings is not re-traced.
    print(f"{losses_summary(losses)}; {seconds:.1f} s, {trainer.compiles} compile(s) of the step")


if __name__ == "__main__":
    main(sys.argv[1:])
