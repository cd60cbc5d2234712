"""Real text with no download: the Python standard library's source files as bytes, cut
into documents and packed into fixed-size rows with a new set of boundaries every step.

A batch is `PackedBatch(tokens, targets, cu_seqlens)` in numpy: tokens/targets int32
[rows, seq_len], cu_seqlens int32 [rows, max_documents + 1] per row (the repeated last
entry pads it; tokens past it are padding). A target is the next byte of the same
document, or -1 (no loss) at a document's last token and in padding. Everything else
(segment ids, positions) is derived on the device by the host-side layer
(`jax_bridge.prepare_sequence_ids` / `prepare_position_ids`, in model.py's step).
`Prefetcher` builds batches on a host thread, a few steps ahead, so the step never waits.
"""

from __future__ import annotations

import functools
import queue
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from examples.train_lm.config import TrainConfig

NO_TARGET = -1


class PackedBatch(NamedTuple):
    tokens: np.ndarray  # int32 [rows, seq_len]
    targets: np.ndarray  # int32 [rows, seq_len], NO_TARGET where no loss
    cu_seqlens: np.ndarray  # int32 [rows, max_documents + 1]


@functools.cache
def standard_library_texts(limit: int = 400) -> tuple[bytes, ...]:
    """Up to `limit` of the standard library's .py files, read as bytes, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())[:limit]
    texts = tuple(p.read_bytes() for p in files)
    if not texts:
        raise RuntimeError(f"no Python sources under {root}: cannot build the text corpus")
    return texts


def documents(rng: np.random.Generator, config: TrainConfig) -> Iterator[np.ndarray]:
    """An endless stream of documents: a random file, a random piece of it of a random
    length (log-uniform between min_document and seq_len), as uint8 tokens."""
    texts = standard_library_texts()
    while True:
        text = texts[rng.integers(len(texts))]
        high = min(len(text), config.seq_len)
        if high < config.min_document:
            continue
        length = int(np.exp(rng.uniform(np.log(config.min_document), np.log(high + 1))))
        length = min(max(length, config.min_document), high)
        start = rng.integers(len(text) - length + 1)
        yield np.frombuffer(text, np.uint8, length, start)


def pack_row(docs: Iterator[np.ndarray], config: TrainConfig) -> tuple[np.ndarray, ...]:
    """Fills one row greedily; the document that does not fit is cut to the space left
    (a piece shorter than min_document ends the row as padding)."""
    tokens = np.zeros(config.seq_len, np.int32)
    targets = np.full(config.seq_len, NO_TARGET, np.int32)
    cu = [0]
    while len(cu) <= config.max_documents and config.seq_len - cu[-1] >= config.min_document:
        doc = next(docs)[: config.seq_len - cu[-1]]
        start, end = cu[-1], cu[-1] + len(doc)
        tokens[start:end] = doc
        targets[start : end - 1] = doc[1:]
        cu.append(end)
    cu += [cu[-1]] * (config.max_documents + 1 - len(cu))
    return tokens, targets, np.asarray(cu, np.int32)


def batches(config: TrainConfig, seed: int | None = None) -> Iterator[PackedBatch]:
    """Endless packed batches; the same seed gives the same batches."""
    rng = np.random.default_rng(config.seed if seed is None else seed)
    docs = documents(rng, config)
    while True:
        rows = [pack_row(docs, config) for _ in range(config.rows)]
        yield PackedBatch(*(np.stack(parts) for parts in zip(*rows, strict=True)))


class Prefetcher:
    """Runs an iterator on a daemon thread, `depth` items ahead (the host never stalls the
    step unless packing is slower than a step). Iterate it; `close()` stops the thread."""

    def __init__(self, source: Iterator, depth: int = 4):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True)
        self._thread.start()

    def _fill(self, source: Iterator) -> None:
        try:
            for item in source:
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as error:  # re-raised in the consumer
            self._queue.put(error)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
