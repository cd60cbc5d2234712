"""The PTX cache: a kernel lowered for cuda in a fresh process (jax_triton's in-memory
cache emptied) is found on disk and handed to jaxlib exactly as its compile was, needs
included (global scratch, the warps a warp-specialized kernel runs); its key sees every
input of the compile but the paths of the checkout and of Triton; bad entries are
compiled again, never used."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

from jax_bridge import lower_for_cuda
from jax_bridge.core.cache_dir import CACHE_DIR_ENV
from jax_bridge.launch import host_descriptors, ptx_cache
from jax_bridge.launch.host_descriptors import host_descriptors_launchable
from jax_bridge.launch.jax_triton_compat import jax_triton_api_version
from tests.launch.recording import record_triton_kernels
from tests.launch.test_kernel_needs import _copy, _descriptor_copy, _matmul, _plain_copy

TRITON_ROOT = Path(triton.__file__).resolve().parent
PROJECT_ROOT = Path(ptx_cache.__file__).resolve().parents[2]
assert PROJECT_ROOT == Path(ptx_cache._PROJECT).resolve()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache directory in use, and this process's counts from zero."""
    directory = tmp_path / "ptx"
    monkeypatch.setenv(ptx_cache.PTX_CACHE_ENV, str(directory))
    monkeypatch.setattr(ptx_cache, "_statistics", collections.Counter())
    return directory


def _lower_fresh(monkeypatch: pytest.MonkeyPatch, case: str) -> list[tuple]:
    """jaxlib's TritonKernel calls of lowering `case` as a fresh process would (a new
    function, jax_triton's in-memory kernel cache empty), on a jaxlib that takes the
    scratch."""
    recorded = record_triton_kernels(monkeypatch, (0, 11, 2))
    lower_for_cuda(*_cases()[case])
    return list(recorded.calls)  # a later recorder records through this one too


def _cases():
    a = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    return {
        "plain": (lambda x: _copy(_plain_copy, x, 32, 32), x),
        "descriptors": (lambda x: _copy(_descriptor_copy, x, 32, 32), x),
        "warp-specialized": (lambda a, b: _matmul(a, b), a, b),
    }


@pytest.mark.skipif(jax_triton_api_version() != (0, 3), reason="recorded through jax_triton 0.3")
@pytest.mark.parametrize("case", ["plain", "descriptors", "warp-specialized"])
def test_a_kernel_found_in_the_cache_is_built_as_its_compile_was(case, cache, monkeypatch):
    compiled = _lower_fresh(monkeypatch, case)
    assert ptx_cache.ptx_cache_statistics() == dict(hits=0, misses=1, ignored=0, write_errors=0)
    (entry,) = cache.iterdir()
    found = _lower_fresh(monkeypatch, case)
    assert ptx_cache.ptx_cache_statistics()["hits"] == 1
    assert ptx_cache.ptx_cache_statistics()["misses"] == 1
    # name, warps (12 where warp-specialized), CTAs, shared memory, PTX, TTIR, capability
    # and the scratch (descriptors): the same arguments, compiled once.
    assert found == compiled and len(found) == 1
    assert list(cache.iterdir()) == [entry]


@pytest.mark.skipif(jax_triton_api_version() != (0, 3), reason="recorded through jax_triton 0.3")
@pytest.mark.parametrize(
    "spoil",
    [
        lambda data: {**data, "ptx": data["ptx"].replace(".entry", ".func")},
        lambda data: {**data, "key": "0" * 64},
        lambda data: {**data, "num_warps": True},
        lambda data: {**data, "shared_mem_bytes": "0"},
        lambda data: {**data, "descriptors": [1]},
        lambda data: {**data, "version": 0},
        lambda data: [data],
        "flip a bit of the compressed body",  # zlib.error, not an OSError
    ],
)
def test_a_bad_entry_is_compiled_again_and_replaced(spoil, cache, monkeypatch):
    compiled = _lower_fresh(monkeypatch, "descriptors")
    (entry,) = cache.iterdir()
    good = entry.read_bytes()
    if isinstance(spoil, str):
        body = bytearray(good)
        body[len(body) // 2] ^= 0x10  # within the deflate stream (the header is 10 bytes)
        entry.write_bytes(bytes(body))
    else:
        data = json.loads(gzip.decompress(good))
        entry.write_bytes(gzip.compress(json.dumps(spoil(data)).encode()))
    with pytest.warns(UserWarning, match="PTX cache entry .*compiling the kernel again"):
        again = _lower_fresh(monkeypatch, "descriptors")
    assert again == compiled
    assert ptx_cache.ptx_cache_statistics() == dict(hits=0, misses=2, ignored=1, write_errors=0)
    assert entry.read_bytes() == good


@pytest.mark.skipif(
    not host_descriptors_launchable(), reason="jaxlib >= 0.11.2 passes host-side descriptors"
)
def test_a_kernel_taking_host_descriptors_keeps_their_metadata_in_the_cache(cache):
    """A kernel whose descriptors the launch encodes, found in the cache, is launched as
    its compile was: the entry keeps each descriptor's metadata (swizzle, element type,
    box), from which the launch encodes it (the lowered call, its parameters included,
    is the same)."""
    from tests.launch.test_host_descriptors import _launch

    a = jax.ShapeDtypeStruct((40, 32), jnp.float32)
    b = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)

    def lower() -> str:
        host_descriptors._compiled.cache_clear()  # as in a fresh process
        return lower_for_cuda(lambda a, b: _launch(a, b), a, b)

    compiled = lower()
    (entry,) = cache.iterdir()
    metas = json.loads(gzip.decompress(entry.read_bytes()))["descriptors"]
    assert [m["block_size"][-1] for m in metas] == [32, 32] and all("swizzle" in m for m in metas)
    assert lower() == compiled
    assert ptx_cache.ptx_cache_statistics() == dict(hits=1, misses=1, ignored=0, write_errors=0)


@pytest.mark.skipif(jax_triton_api_version() != (0, 3), reason="recorded through jax_triton 0.3")
def test_an_unreadable_entry_or_directory_costs_a_compile_not_the_call(cache, monkeypatch):
    compiled = _lower_fresh(monkeypatch, "plain")
    (entry,) = cache.iterdir()
    entry.write_bytes(b"not gzip")
    with pytest.warns(UserWarning, match="unreadable"):
        assert _lower_fresh(monkeypatch, "plain") == compiled
    blocked = cache.parent / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(ptx_cache.PTX_CACHE_ENV, str(blocked / "ptx"))
    with pytest.warns(UserWarning, match="cannot store"):
        assert _lower_fresh(monkeypatch, "plain") == compiled
    assert ptx_cache.ptx_cache_statistics()["write_errors"] == 1


@pytest.mark.parametrize("value", ["", "0", " 0 "])
def test_the_cache_is_off_when_its_variable_is_empty_or_0(value, monkeypatch, tmp_path):
    monkeypatch.setenv(ptx_cache.PTX_CACHE_ENV, value)
    assert ptx_cache.ptx_cache_directory() is None
    monkeypatch.delenv(ptx_cache.PTX_CACHE_ENV)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert ptx_cache.ptx_cache_directory() == tmp_path / "ptx"
    monkeypatch.setenv(ptx_cache.PTX_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert ptx_cache.ptx_cache_directory() == tmp_path / "elsewhere"


def _ttir(*paths: str) -> str:
    return "\n".join(f'#loc{i} = loc("{path}":{10 + i}:0)' for i, path in enumerate(paths))


def test_locations_are_written_from_the_project_and_triton_roots(tmp_path) -> None:
    """Locations under Triton (which may lie inside the project, in a virtual
    environment) and under the project lose their roots, reached directly or through a
    link; others and names are kept."""
    linked = tmp_path / "linked-checkout"
    linked.symlink_to(PROJECT_ROOT)
    paths = [
        f"{TRITON_ROOT}/language/standard.py",
        f"{PROJECT_ROOT}/triton_kernels/grouped_matmul/kernels.py",
        f"{linked}/triton_kernels/grouped_matmul/kernels.py",
        "/elsewhere/kernel.py",
    ]
    portable = [
        "<triton>/language/standard.py",
        "<project>/triton_kernels/grouped_matmul/kernels.py",
        f"{linked}/triton_kernels/grouped_matmul/kernels.py",  # a link the import did not take
        "/elsewhere/kernel.py",
    ]
    names = '\nloc("acc")'
    assert ptx_cache.portable_ttir(_ttir(*paths) + names) == _ttir(*portable) + names
    with pytest.MonkeyPatch.context() as patch:  # the project imported through the link
        patch.setattr(ptx_cache, "_PROJECT", linked)
        portable[2] = portable[1]
        assert ptx_cache.portable_ttir(_ttir(*paths) + names) == _ttir(*portable) + names


@dataclasses.dataclass(frozen=True)
class _Options:
    num_warps: int = 4
    num_stages: int = 2
    extern_libs: tuple = ()


def test_the_key_sees_every_input_of_the_compile_but_paths(monkeypatch, tmp_path) -> None:
    """Same key for the same compile in another checkout or install (the device's copy of
    the tree, its libdevice elsewhere); another key for anything else that changes it."""
    libdevice = [tmp_path / name / "libdevice.10.bc" for name in ("one", "two", "three")]
    for path, contents in zip(libdevice, (b"bitcode", b"bitcode", b"other bitcode"), strict=True):
        path.parent.mkdir()
        path.write_bytes(contents)
    options = lambda library=libdevice[0], **fields: _Options(
        extern_libs=(("libdevice", str(library)),), **fields
    )
    hopper = CUDABackend(GPUTarget("cuda", 90, 32))
    ttir = _ttir(f"{PROJECT_ROOT}/triton_kernels/flash_attention/forward.py")
    key = ptx_cache.compile_key(ttir, hopper, options(), (90,))
    assert ptx_cache.compile_key(ttir, hopper, options(libdevice[1]), (90,)) == key
    others = [
        ptx_cache.compile_key(ttir.replace(":10:", ":11:"), hopper, options(), (90,)),
        ptx_cache.compile_key(ttir, hopper, options(num_warps=8), (90,)),
        ptx_cache.compile_key(ttir, hopper, options(num_stages=3), (90,)),
        ptx_cache.compile_key(ttir, hopper, options(libdevice[2]), (90,)),
        ptx_cache.compile_key(ttir, hopper, options(), (80,)),
        ptx_cache.compile_key(ttir, CUDABackend(GPUTarget("cuda", 80, 32)), options(), (90,)),
    ]
    with monkeypatch.context() as patch:
        patch.setattr(ptx_cache, "_software_key", lambda: "another Triton")
        others.append(ptx_cache.compile_key(ttir, hopper, options(), (90,)))
    with monkeypatch.context() as patch:
        import triton.compiler.compiler as triton_compiler

        patch.setattr(triton_compiler, "get_cache_invalidating_env_vars", lambda: {"X": "1"})
        others.append(ptx_cache.compile_key(ttir, hopper, options(), (90,)))
    assert len({key, *others}) == len(others) + 1
    moved = ttir.replace(str(PROJECT_ROOT), "/another/checkout")
    assert ptx_cache.compile_key(moved, hopper, options(), (90,)) != key
    monkeypatch.setattr(ptx_cache, "_PROJECT", Path("/another/checkout"))
    assert ptx_cache.compile_key(moved, hopper, options(), (90,)) == key


@pytest.mark.skipif(jax_triton_api_version() != (0, 3), reason="recorded through jax_triton 0.3")
def test_a_compile_without_a_key_compiles_uncached(cache, monkeypatch):
    def no_key(*args):
        raise RuntimeError("ptxas not found")

    monkeypatch.setattr(ptx_cache, "compile_key", no_key)
    with pytest.warns(UserWarning, match="no key for this compile .*ptxas not found"):
        (call,) = _lower_fresh(monkeypatch, "plain")
    assert call[0] == "_plain_copy" and not cache.exists()


@pytest.mark.skipif(jax_triton_api_version() != (0, 3), reason="recorded through jax_triton 0.3")
def test_without_a_home_the_cache_is_off_with_a_warning(monkeypatch):
    for name in (ptx_cache.PTX_CACHE_ENV, CACHE_DIR_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    with pytest.warns(UserWarning, match="no key for this compile .*home directory"):
        (call,) = _lower_fresh(monkeypatch, "plain")
    assert call[0] == "_plain_copy"


def _slot(options, backend=None):
    backend = CUDABackend(GPUTarget("cuda", 90, 32)) if backend is None else backend
    return ptx_cache.slot_for(_ttir("/a/kernel.py"), backend, options, (90,))


@dataclasses.dataclass
class _ResultWithScratch:
    binary: str
    name: str
    shared_mem_bytes: int
    ttgir: str | None
    llir: str | None
    global_scratch_size: int


def test_compiles_the_cache_cannot_stand_for_bypass_it(cache, monkeypatch):
    """Debug compiles and jax_triton's IR dumps want the IRs the cache does not keep;
    Triton's instrumentation adds a pass the key cannot see; a jax_triton whose compile
    result holds more than the cache keeps (scratch, descriptor metadata) would get it
    from a hit as None."""
    from jax_triton import triton_lib

    assert _slot(_Options()) is not None
    debug = dataclasses.make_dataclass("Debug", [("debug", bool, True)])()
    assert _slot(debug) is None
    instrumented = CUDABackend(GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(instrumented, "instrumentation", object(), raising=False)
    assert _slot(_Options(), instrumented) is None
    with monkeypatch.context() as patch:
        patch.setattr(triton.knobs.compilation, "instrumentation_mode", "consan")
        assert _slot(_Options()) is None
    with monkeypatch.context() as patch:
        patch.setattr(triton_lib, "_JAX_TRITON_DUMP_DIR", "/tmp/dump", raising=False)
        assert _slot(_Options()) is None
    with monkeypatch.context() as patch:
        patch.setattr(triton_lib, "CompilationResult", _ResultWithScratch)
        assert _slot(_Options()) is None


def test_entries_are_readable_by_others(cache):
    kernel = ptx_cache.CachedKernel("k", ".entry k(\n)", 0, 0, 1, None)
    ptx_cache.store(cache, "0" * 64, kernel)
    (entry,) = cache.iterdir()
    assert entry.stat().st_mode & 0o777 == 0o644
    assert ptx_cache.load(cache, "0" * 64) == kernel
