"""Where the package keeps the files it writes for later processes (the tuning cache, the
PTX cache): one directory, chosen as the XDG base directory spec says; and how it writes
them, atomically."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

CACHE_DIR_ENV = "RAGGED_KERNELS_CACHE_DIR"


def cache_directory() -> Path:
    """`$RAGGED_KERNELS_CACHE_DIR`, else `$XDG_CACHE_HOME/ragged-kernels`, else
    `~/.cache/ragged-kernels` (also where `$XDG_CACHE_HOME` is not absolute, as the spec
    says); read from the environment at each call."""
    directory = os.environ.get(CACHE_DIR_ENV)
    if directory:
        return Path(directory).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "ragged-kernels"


def replace_atomically(path: Path, payload: bytes, *, mode: int | None = None) -> None:
    """Writes `payload` to `path` through a temporary file beside it, flushed to disk, then
    renamed over it: a reader sees the old file or the new one, never a torn one. `mode`:
    the file's permissions (None: the temporary file's, 0600). Raises what the file
    system raises, the temporary file removed."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
