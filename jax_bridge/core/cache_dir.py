"""Where the package keeps the files it writes for later processes (the tuning cache, the
PTX cache): one directory, chosen as the XDG base directory spec says."""

from __future__ import annotations

import os
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
