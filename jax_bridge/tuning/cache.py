"""The tuning cache: one JSON file of measured winners, keyed by (op, device, arguments).

File layout (`tuning.json`)::

    {"format": "ragged-kernels-tuning", "version": 1,
     "entries": {"<op>-<hash>": {"op": str, "device": str, "args": <stable_json of the
                 abstract arguments>, "params": {field: int | bool}, "time_s": float,
                 "date": ISO 8601 UTC}}}

Where: `$RAGGED_KERNELS_CACHE_DIR/tuning.json`, else `$XDG_CACHE_HOME/ragged-kernels/`,
else `~/.cache/ragged-kernels/`.

Invariants:
* The file is only ever parsed as JSON and checked field by field: nothing in it is
  executed, imported or unpickled. A corrupt file, or one with a foreign format marker,
  another version or wrongly typed fields, is ignored with a warning naming it.
* Writes replace the file atomically (a temporary file in the same directory, then
  `os.replace`), so a reader never sees a torn file. Where POSIX locks exist the
  read-modify-write also holds an exclusive `flock` on `tuning.json.lock`, so concurrent
  writers lose no entry; without them the last writer's entry is kept.
* A file that is not ours (no marker, another format or version) is never overwritten:
  `put` warns and stores nothing. One that is not JSON (or not UTF-8) is corrupt: `put`
  replaces it, with a warning. An invalid entry in our file is dropped alone; the other
  entries are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jax_bridge.core.cache_dir import CACHE_DIR_ENV, cache_directory, replace_atomically
from jax_bridge.tuning.keys import cache_key, stable_json
from jax_bridge.tuning.params import BOOL_FIELDS

__all__ = ["CACHE_DIR_ENV", "TuningCache", "default_cache_path"]

CACHE_FILE = "tuning.json"
FORMAT = "ragged-kernels-tuning"
VERSION = 1


def default_cache_path() -> Path:
    """`tuning.json` in the package's cache directory (`cache_directory`:
    `$RAGGED_KERNELS_CACHE_DIR`, else the XDG cache directory's `ragged-kernels/`)."""
    return cache_directory() / CACHE_FILE


def _entry_problem(entry: Any) -> str | None:
    """Why `entry` is not a valid cache entry, or None."""
    if not isinstance(entry, dict):
        return f"an entry is a {type(entry).__name__}, not an object"
    for name, kind in (("op", str), ("device", str), ("date", str), ("params", dict)):
        if not isinstance(entry.get(name), kind):
            return f"entry field {name!r} is not a {kind.__name__}"
    if "args" not in entry:
        return "entry field 'args' is missing"
    time_s = entry.get("time_s")
    if isinstance(time_s, bool) or not isinstance(time_s, int | float):
        return "entry field 'time_s' is not a number"
    if not (math.isfinite(time_s) and time_s >= 0):
        return f"entry field 'time_s' is {time_s!r}"
    for name, value in entry["params"].items():
        if name in BOOL_FIELDS:
            if not isinstance(value, bool):
                return f"params field {name!r} is not a bool"
        elif isinstance(value, bool) or not isinstance(value, int):
            return f"params field {name!r} is not an int"
    return None


@dataclasses.dataclass(frozen=True)
class TuningCache:
    """The JSON tuning cache at `path` (None: `default_cache_path()`, read at creation)."""

    path: Path | None = None  # always a Path after __post_init__

    def __post_init__(self) -> None:
        path = default_cache_path() if self.path is None else Path(self.path).expanduser()
        object.__setattr__(self, "path", path)

    def _warn(self, problem: str, action: str) -> None:
        warnings.warn(f"tuning cache {self.path}: {problem}; {action}", stacklevel=4)

    def _read(self) -> tuple[dict[str, dict], bool, str | None]:
        """(the valid entries, whether `put` may replace the file, what is wrong with
        it or None). A missing file is an empty, writable cache."""
        try:
            text = self.path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            return {}, True, None
        except (OSError, UnicodeDecodeError) as err:  # unreadable: keep it; not UTF-8: ours
            return {}, isinstance(err, UnicodeDecodeError), f"cannot be read ({err})"
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            return {}, True, f"not valid JSON ({err})"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return {}, False, f"not a ragged-kernels tuning cache (no format {FORMAT!r})"
        if data.get("version") != VERSION:
            version = data.get("version")
            return {}, False, f"version {version!r}, this ragged-kernels reads {VERSION}"
        entries = data.get("entries")
        if not isinstance(entries, dict):
            return {}, True, "'entries' is not an object"
        # A bad entry (hand-edited, or written by a bug) costs only itself.
        bad = {key: p for key, e in entries.items() if (p := _entry_problem(e)) is not None}
        if bad:
            key, problem = next(iter(bad.items()))
            valid = {k: e for k, e in entries.items() if k not in bad}
            return valid, True, f"{len(bad)} invalid entr(ies) dropped, e.g. {key}: {problem}"
        return entries, True, None

    def _entries(self) -> dict[str, dict]:
        entries, _, problem = self._read()
        if problem is not None:
            self._warn(problem, "ignoring it")
        return entries

    def entries(self) -> dict[str, dict]:
        """Every valid entry by key (empty for a missing, corrupt or foreign file)."""
        return self._entries()

    def get(self, op: str, device: str, abstract_args: Any) -> dict | None:
        """The entry stored for (op, device, abstract_args), or None."""
        entry = self._entries().get(cache_key(op, device, abstract_args))
        if entry is None:
            return None
        # Guards against a hash collision or a hand-edited key.
        args = json.loads(stable_json(abstract_args))
        if (entry["op"], entry["device"], entry["args"]) != (op, device, args):
            return None
        return entry

    def put(
        self,
        op: str,
        device: str,
        abstract_args: Any,
        params: Mapping[str, int | bool],
        time_s: float,
    ) -> str | None:
        """Stores (or replaces) one entry; returns its key, or None when the file at
        `path` is not a tuning cache (warned; it is never overwritten)."""
        entry = {
            "op": op,
            "device": device,
            "args": json.loads(stable_json(abstract_args)),
            "params": dict(params),
            "time_s": float(time_s),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        problem = _entry_problem(entry)
        if problem is not None:
            raise ValueError(f"TuningCache.put: {problem}.")
        key = cache_key(op, device, abstract_args)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries, writable, problem = self._read()
            if not writable:
                self._warn(problem, f"not storing {key} (the file is not overwritten)")
                return None
            if problem is not None:
                self._warn(problem, "replacing it")
            entries[key] = entry
            self._replace({"format": FORMAT, "version": VERSION, "entries": entries})
        return key

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on `<path>.lock` where POSIX locks exist (else none)."""
        try:
            import fcntl
        except ImportError:  # Windows: the atomic replace alone keeps the file whole
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _replace(self, document: dict) -> None:
        """Writes `document` to a temporary file beside `path`, then renames it over."""
        text = json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n"
        replace_atomically(self.path, text.encode("utf-8"))
