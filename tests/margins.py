"""How close each numerics assertion came to failing, so that thin tolerances show up
before a new machine or BLAS build turns them red.

The margin of an assertion is its worst error over its allowed error: a passing
assertion has margin <= 1, and one above 0.5 is within a factor of two of failing (on
another summation order, BLAS kernel or ISA it may fail). The tests' comparison helpers
call `record(name, margin)`; nothing is kept unless a report file was asked for:

    pytest tests/attention --margins=/tmp/margins.jsonl          # prints tests above 0.5
    pytest ... --margins=/tmp/m.jsonl --margins-above=0.3         # another threshold
    python -m tests.margins /tmp/m.jsonl [--above 0.5]            # reads a saved file

Each process (pytest-xdist workers included) appends one JSON line per assertion, so
the file collects a whole `-n auto` run. It is appended to: remove it to start afresh.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterable

# The file this process appends to; set by tests/conftest.py from --margins.
_PATH: str | None = None
THRESHOLD = 0.5


def configure(path: str | None) -> None:
    global _PATH
    _PATH = path


def record(name: str, margin: float) -> None:
    """Appends (current test, assertion name, margin) to the report file, if any."""
    if _PATH is None:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    line = json.dumps({"test": test, "name": name, "margin": float(margin)})
    # One short write per line in append mode: lines of parallel workers do not interleave.
    with open(_PATH, "a") as f:
        f.write(line + "\n")


def load(path: str) -> dict[tuple[str, str], float]:
    """{(test, assertion name): worst margin over every record of that pair}."""
    worst: dict[tuple[str, str], float] = {}
    if not os.path.exists(path):
        return worst
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            key = (entry["test"], entry["name"])
            margin = entry["margin"]
            margin = math.inf if math.isnan(margin) else margin
            worst[key] = max(worst.get(key, -math.inf), margin)
    return worst


def above(worst: dict[tuple[str, str], float], threshold: float) -> list[str]:
    """Report lines for the pairs whose margin exceeds `threshold`, the worst first."""
    rows = sorted(((m, t, n) for (t, n), m in worst.items() if m > threshold), reverse=True)
    return [f"{m:6.3f}  {t}  [{n}]" for m, t, n in rows]


def summary(path: str, threshold: float) -> list[str]:
    worst = load(path)
    lines = above(worst, threshold)
    top = max(worst.values(), default=float("nan"))
    head = f"numeric margins: {len(worst)} assertions, worst {top:.3f}, {len(lines)} above "
    return [head + f"{threshold:g} (error / allowed error)", *lines]


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a file written by pytest --margins=PATH")
    parser.add_argument("--above", type=float, default=THRESHOLD)
    args = parser.parse_args(None if argv is None else list(argv))
    print("\n".join(summary(args.path, args.above)))


if __name__ == "__main__":
    main()
