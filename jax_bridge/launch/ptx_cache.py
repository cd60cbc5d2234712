"""A disk cache of the PTX that Triton compiles for jax_triton: a kernel compiled once, by
any process on any machine with the same Triton, is not compiled again.

jax_triton builds each kernel (Python to TTIR, then TTIR to PTX through Triton's passes and
LLVM) in every process that lowers it, running Triton's compiler stages itself (never
`triton.compile`, whose disk cache it also turns off by emptying TRITON_CACHE_DIR), and
keeps the result in memory only. The TTIR-to-PTX step is most of that work: ~0.56 s a
kernel on this project's 2-core machine (Triton 3.6), 2.0 of the 2.8 s that compiling
varlen attention's forward and backward for an H100 takes, in every process that does. A
device run pays it for each of the 121 distinct kernels its rows launch, out of its few
minutes, for kernels a CPU can compile beforehand: `gpu-check --compile-for h100` fills
this cache (`make gpu-ptx-cache`), the device run carries it (`bench/gpu_check.sh`), and
there only jaxlib's PTX-to-machine-code step remains.

Key (sha256 of): this format's version; Triton's own key (`triton_key`: its version and a
hash of its compiler, backends, language and libtriton, whose build differs between Python
versions) and its backend's (ptxas version, arch); the installed jax-triton's version; the
compile options, the external libraries (libdevice) by their contents rather than their
paths; the compute capability; Triton's cache-invalidating environment variables; and the
TTIR text, each source location's path made relative to this project or to Triton
(`portable_ttir`), so that a checkout elsewhere (the device's copy of the tree) finds what
was compiled here. A PTX found so keeps the compiling machine's paths in its line
information.

Entries: one gzip'd JSON file a kernel, `<key>.json.gz`, holding {"format", "version",
"key", "name", "shared_mem_bytes", "scratch_size", "scratch_align", "num_warps",
"descriptors", "ptx"}.

Where: `$RAGGED_KERNELS_PTX_CACHE_DIR`; unset: `ptx/` in the package's cache directory
(`jax_bridge.core.cache_dir`); set empty or to "0": no cache.

Invariants:
* Only a compile that returned is stored. Debug compiles and jax_triton's dump directory
  bypass the cache (they want the intermediate IRs, which it does not keep), as do
  Triton's instrumentation (a pass the key does not see) and a jax_triton whose compile
  result holds more than this cache keeps (`slot_for`).
* An entry is used only if every field has its type, its key is its file's and its PTX
  defines its kernel; anything else is ignored with a warning and compiled again (the new
  result replaces it). A failed read or write costs a compile, never the call.
* Writes are atomic (a temporary file in the same directory, then `os.replace`; mode
  0644): a reader sees a whole entry or none; two writers of one key write the same
  kernel. Nothing is ever evicted.
* PTX runs on the GPU: the directory is to be trusted as the Python environment is (as
  Triton's own `~/.triton/cache`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

from jax_bridge.core.cache_dir import cache_directory, replace_atomically

__all__ = ["PTX_CACHE_ENV", "CachedKernel", "ptx_cache_directory", "ptx_cache_statistics"]

PTX_CACHE_ENV = "RAGGED_KERNELS_PTX_CACHE_DIR"
FORMAT = "ragged-kernels-ptx"
VERSION = 2  # 2: the host-side tensor descriptors' metadata ("descriptors")
_SUFFIX = ".json.gz"
_PROJECT = Path(os.path.abspath(__file__)).parents[2]  # holds jax_bridge/, triton_kernels/

# hits, misses (compiled, then stored), ignored (a bad entry), write_errors.
_statistics: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass(frozen=True)
class CachedKernel:
    """One compiled kernel: what jax_triton builds jaxlib's kernel object from (name, PTX,
    shared memory) and what the launch layer adds (`kernel_needs.KernelNeeds`: global
    scratch a program, the warps the compiled kernel runs, None: the warps asked for; the
    metadata of its host-side tensor descriptors, in parameter order)."""

    name: str
    ptx: str
    shared_mem_bytes: int
    scratch_size: int
    scratch_align: int
    num_warps: int | None
    descriptors: tuple[dict[str, Any], ...] = ()


# jax_triton's `CompilationResult` fields a hit can give (the IRs as None); a jax_triton
# whose result holds others (scratch, descriptor metadata) compiles uncached.
_RESULT_FIELDS = frozenset({"binary", "name", "shared_mem_bytes", "ttgir", "llir"})

_FIELD_TYPES = {
    "name": str, "ptx": str, "shared_mem_bytes": int, "scratch_size": int,
    "scratch_align": int, "num_warps": (int, type(None)), "descriptors": list,
}  # fmt: skip


def ptx_cache_directory() -> Path | None:
    """The cache's directory now (module docstring), or None where it is turned off."""
    value = os.environ.get(PTX_CACHE_ENV)
    if value is None:
        return cache_directory() / "ptx"
    if value.strip() in ("", "0"):
        return None
    return Path(value).expanduser()


def ptx_cache_statistics() -> dict[str, int]:
    """This process's counts: "hits", "misses" (compiled, then stored unless the write
    failed), "ignored" (bad entries, compiled again) and "write_errors"."""
    return {name: _statistics[name] for name in ("hits", "misses", "ignored", "write_errors")}


def portable_ttir(ttir: str) -> str:
    """`ttir` with each location's path under this project or under Triton written from
    that root ("<project>/triton_kernels/...", "<triton>/language/..."): equal TTIR on
    machines whose checkouts and Pythons lie elsewhere. A root is matched as imported and
    with its links resolved (a virtual environment's lib64, a linked home)."""
    import triton

    # Triton first: a virtual environment may lie inside the project.
    roots = [
        (name, f"{root}{os.sep}")
        for name, path in (("<triton>", Path(triton.__file__).parent), ("<project>", _PROJECT))
        for root in dict.fromkeys((os.path.abspath(path), os.path.realpath(path)))
    ]

    def relative(match: re.Match) -> str:
        path = match[1]
        for name, prefix in roots:
            if path.startswith(prefix):
                return f'loc("{name}/{path[len(prefix) :]}"'
        return match[0]

    return re.sub(r'loc\("([^"]*)"', relative, ttir)


@functools.cache
def _software_key() -> str:
    """What of the installed software decides the PTX: Triton's key and jax-triton's
    version (read once a process: `triton_key` hashes Triton's files, about a second)."""
    from triton.runtime.cache import triton_key

    try:
        jax_triton = importlib.metadata.version("jax-triton")
    except importlib.metadata.PackageNotFoundError:
        jax_triton = "absent"
    return f"{triton_key()}|jax-triton {jax_triton}"


@functools.cache
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _options_key(options: Any) -> str:
    fields = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else vars(options)
    # An external library (libdevice) by its name and contents: its path differs between
    # installs, and TRITON_LIBDEVICE_PATH may name another file.
    libraries = fields.pop("extern_libs", None) or ()
    fields["extern_libs"] = sorted((str(name), _file_digest(str(path))) for name, path in libraries)
    return json.dumps(fields, sort_keys=True, default=repr)


def compile_key(ttir: str, backend: Any, options: Any, target: Any) -> str:
    """The cache key (module docstring) of compiling `ttir` (its text) with Triton's
    `backend` and `options` for `target` (the compute capability)."""
    from triton.compiler.compiler import get_cache_invalidating_env_vars

    parts = [
        f"{FORMAT} {VERSION}",
        _software_key(),
        str(backend.hash()),
        _options_key(options),
        repr(target),
        json.dumps(get_cache_invalidating_env_vars(), sort_keys=True),
        portable_ttir(ttir),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _warn(path: Path, problem: str) -> None:
    warnings.warn(f"PTX cache entry {path}: {problem}; compiling the kernel again", stacklevel=3)


def _entry_problem(data: Any, key: str) -> str | None:
    """Why `data` is not a valid entry of `key`, or None."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"not a {FORMAT} entry"
    if data.get("version") != VERSION or data.get("key") != key:
        return "another version or key"
    for name, kind in _FIELD_TYPES.items():
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"field {name!r} is not of type {kind}"
    if not all(isinstance(d, dict) for d in data["descriptors"]):
        return "field 'descriptors' is not a list of objects"
    if not re.search(rf"\.entry\s+{re.escape(data['name'])}\s*\(", data["ptx"]):
        return f"its PTX does not define kernel {data['name']!r}"
    return None


def load(directory: Path, key: str) -> CachedKernel | None:
    """The entry of `key` in `directory`, or None (missing, or bad: warned)."""
    path = directory / f"{key}{_SUFFIX}"
    try:
        data = json.loads(gzip.decompress(path.read_bytes()).decode("utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # no entry (yet): no warning
        return None
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError, RecursionError) as err:
        _statistics["ignored"] += 1
        _warn(path, f"unreadable ({type(err).__name__}: {err})")
        return None
    problem = _entry_problem(data, key)
    if problem is not None:
        _statistics["ignored"] += 1
        _warn(path, problem)
        return None
    _statistics["hits"] += 1
    fields = {name: data[name] for name in _FIELD_TYPES}
    return CachedKernel(**{**fields, "descriptors": tuple(fields["descriptors"])})


def slot_for(ttir: Any, backend: Any, options: Any, target: Any) -> tuple | None:
    """(directory, key) of compiling `ttir` (a module) with `backend` and `options` for
    `target` (what else the compile step takes: the compute capability), or None where it
    bypasses the cache: the cache off (or its directory unknown: no home), a debug
    compile, jax_triton dumping the intermediate IRs, Triton instrumenting the kernel, or
    a jax_triton whose compile result holds more than this cache keeps."""
    from jax_triton import triton_lib

    if getattr(options, "debug", False) or getattr(triton_lib, "_JAX_TRITON_DUMP_DIR", None):
        return None
    if getattr(backend, "instrumentation", None) is not None or _instrumented():
        return None
    result_fields = {f.name for f in dataclasses.fields(triton_lib.CompilationResult)}
    if not result_fields <= _RESULT_FIELDS:
        return None
    try:
        directory = ptx_cache_directory()
        if directory is None:
            return None
        return directory, compile_key(str(ttir), backend, options, target)
    except (OSError, RuntimeError, ImportError) as err:  # no home, Triton's files, ptxas
        warnings.warn(f"PTX cache: no key for this compile ({err}); compiling", stacklevel=3)
        return None


def _instrumented() -> bool:
    """Triton's instrumentation (TRITON_INSTRUMENTATION_MODE: a pass the key cannot see)."""
    import triton

    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    return bool(getattr(compilation, "instrumentation_mode", ""))


def store(directory: Path, key: str, kernel: CachedKernel) -> None:
    """Writes `kernel`, just compiled, as the entry of `key`, atomically; a failure is
    warned, not raised."""
    _statistics["misses"] += 1
    document = {"format": FORMAT, "version": VERSION, "key": key, **dataclasses.asdict(kernel)}
    payload = gzip.compress(json.dumps(document).encode("utf-8"), mtime=0)
    path = directory / f"{key}{_SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # readable by others, as Triton's cache is (a temporary file's mode is 0600)
        replace_atomically(path, payload, mode=0o644)
    except OSError as err:
        _statistics["write_errors"] += 1
        warnings.warn(f"PTX cache {directory}: cannot store {path.name} ({err})", stacklevel=2)
