"""`python -m bench train`: the example language model (examples/train_lm) trained with our
kernels and as its dense twin, in the same run, on the same batches.

    python -m bench train [--steps N] [--seq-len S] [--rows R] [--plot PATH] [--json PATH]

Both flavours start from the same parameters and see the same packed batches (a new set of
document boundaries every step). Reported: the median step time after the first step (the
first compiles), tokens per second, the ratio dense/ours (> 1: ours is faster), the trace
count (1: no re-trace), the median time a step waited for its batch (the packing runs
ahead on a host thread: near zero means the data loader never stalls the step), and the
losses side by side every few steps. A progress bar runs on
stderr; `--plot PATH` draws both loss curves as a PNG (matplotlib's Agg canvas).
On a CPU, one device: the rows measure the kernels' work, not any parallel speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import jax
from tqdm import tqdm

from examples.train_lm.config import TINY, TrainConfig
from examples.train_lm.data import Prefetcher, batches
from examples.train_lm.train import Trainer

FLAVOURS = ("ours", "dense")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--plot", type=Path, metavar="PATH", help="draw both loss curves")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure")
    return parser


def train_flavour(flavour: str, train: TrainConfig, bar: tqdm) -> dict:
    """Trains one flavour; returns its losses, step times (s) and trace count."""
    trainer = Trainer(TINY, train, flavour)
    params, opt_state = trainer.init(jax.random.key(train.seed))
    source = Prefetcher(batches(train))
    losses, seconds, waits = [], [], []
    try:
        for _ in range(train.steps):
            start = time.perf_counter()
            batch = next(source)  # packed ahead on the host: waiting here is a stall
            waits.append(time.perf_counter() - start)
            params, opt_state, metrics = trainer.step(params, opt_state, batch)
            losses.append(float(metrics["loss"]))  # float() waits for the step
            seconds.append(time.perf_counter() - start)
            bar.update()
    finally:
        source.close()
    return {"losses": losses, "step_s": seconds, "wait_s": waits, "traces": trainer.traces}


def _report(results: dict, train: TrainConfig) -> list[str]:
    tokens = train.rows * train.seq_len
    widths = {"step (median)": 14, "tokens/s": 10, "first step": 11, "data wait": 10, "traces": 6}
    lines = [f"{'':8s} " + " ".join(f"{name:>{width}s}" for name, width in widths.items())]
    for name, r in results.items():
        median = statistics.median(r["step_s"][1:])
        r["median_step_s"], r["tokens_per_s"] = median, tokens / median
        wait = statistics.median(r["wait_s"][1:])  # the host's packing, not hidden by prefetch
        lines.append(
            f"{name:8s} {median * 1e3:12.1f}ms {tokens / median:10,.0f} "
            f"{r['step_s'][0]:10.1f}s {wait * 1e6:8.0f}us {r['traces']:6d}"
        )
    ratio = results["dense"]["median_step_s"] / results["ours"]["median_step_s"]
    lines.append(f"dense/ours step time: {ratio:.2f}x (> 1: ours is faster)")
    lines.append(f"{'step':>6s} {'ours':>8s} {'dense':>8s}")
    every = max(1, train.steps // 10)
    for step in [*range(0, train.steps, every), train.steps - 1]:
        pair = (results[f]["losses"][step] for f in FLAVOURS)
        lines.append(f"{step:6d} " + " ".join(f"{loss:8.4f}" for loss in pair))
    return lines


def plot_losses(results: dict, path: Path) -> None:
    """Both loss curves against the step, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, style in zip(FLAVOURS, ("-", "--"), strict=True):
        axes.plot(results[name]["losses"], style, label=f"{name} ({results[name]['traces']} trace)")
    axes.set(xlabel="step", ylabel="training loss (nats per byte)", title="examples/train_lm")
    axes.legend()
    figure.savefig(path, dpi=120)


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    train = TrainConfig(seq_len=args.seq_len, rows=args.rows, steps=args.steps)
    print(
        f"examples/train_lm, {TINY.parameter_count():,} parameters, {train.rows} rows x "
        f"{train.seq_len} tokens per step, {train.steps} steps, on {jax.devices()[0].device_kind}"
    )
    with tqdm(total=2 * train.steps, desc="train", unit="step", disable=None) as bar:
        results = {name: train_flavour(name, train, bar) for name in FLAVOURS}
    print("\n".join(_report(results, train)))
    if args.plot is not None:
        plot_losses(results, args.plot)
        print(f"wrote {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({"train": vars(train), "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0
