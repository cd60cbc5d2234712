"""The JSON tuning cache: location, round trip, corrupt and foreign files, concurrent writers.

Every test uses a cache under tmp_path (the autouse fixture points the environment
there), never the user's home.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge.tuning import cache as cache_module
from jax_bridge.tuning.cache import CACHE_DIR_ENV, TuningCache, default_cache_path
from jax_bridge.tuning.keys import abstractify, cache_key
from jax_bridge.tuning.params import BwdParams, FwdParams

ROOT = Path(__file__).resolve().parents[2]
ARGS = abstractify(
    (np.zeros((512, 64), np.float32), jax.ShapeDtypeStruct((8, 64, 32), jnp.bfloat16))
)
PARAMS = {"blocksize_m": 128, "blocksize_k": 64, "blocksize_n": 128, "num_warps": 8}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "tuning.json"


def test_location_from_the_environment(tmp_path, monkeypatch):
    assert default_cache_path() == tmp_path / "cache" / "tuning.json"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_path() == tmp_path / "xdg" / "ragged-kernels" / "tuning.json"
    # The XDG spec: a relative XDG_CACHE_HOME is invalid and ignored.
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_path() == tmp_path / "home" / ".cache" / "ragged-kernels" / "tuning.json"
    assert TuningCache(tmp_path / "x.json").path == tmp_path / "x.json"


def test_round_trip(isolated_cache):
    cache = TuningCache()
    assert cache.path == isolated_cache
    assert cache.get("grouped_matmul.fwd", "gpu-x", ARGS) is None  # no file yet
    key = cache.put("grouped_matmul.fwd", "gpu-x", ARGS, PARAMS, 0.00125)
    assert key == cache_key("grouped_matmul.fwd", "gpu-x", ARGS)
    entry = TuningCache().get("grouped_matmul.fwd", "gpu-x", ARGS)
    assert entry["params"] == PARAMS and entry["time_s"] == 0.00125
    assert entry["op"] == "grouped_matmul.fwd" and entry["device"] == "gpu-x"
    assert entry["date"].endswith("+00:00")  # ISO 8601, UTC
    # Other ops, devices and shapes are other entries.
    assert cache.get("grouped_matmul.fwd_bwd", "gpu-x", ARGS) is None
    assert cache.get("grouped_matmul.fwd", "gpu-y", ARGS) is None
    assert cache.get("grouped_matmul.fwd", "gpu-x", abstractify(np.zeros((256, 64)))) is None
    # A second put replaces; the file is the documented JSON.
    cache.put("grouped_matmul.fwd", "gpu-x", ARGS, {"num_warps": 4}, 0.002)
    document = json.loads(isolated_cache.read_text())
    assert document["format"] == "ragged-kernels-tuning" and document["version"] == 1
    assert document["entries"][key]["params"] == {"num_warps": 4}
    assert list(cache.entries()) == [key]


@pytest.mark.parametrize(
    "params",
    [
        FwdParams(blocksize_m=128, blocksize_k=64, blocksize_n=256, num_warps=4,
                  num_stages=2, tma=True, warp_specialize=True),
        FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3, tma=False,
                  warp_specialize=False, overlap_softmax=True),
        BwdParams(q_blocksize=32, kv_blocksize=128, tma=False, overlap_softmax=True,
                  dq_tma=True),
    ],
    ids=["gmm_warp_specialized", "forward_overlapped", "dkdv_overlapped"],
)  # fmt: skip
def test_entries_with_the_option_fields_load_back(isolated_cache, params):
    cache = TuningCache()
    cache.put("op", "gpu-x", ARGS, params.to_dict(), 0.001)
    document = json.loads(isolated_cache.read_text())  # JSON's true and false
    (stored,) = document["entries"].values()
    assert stored["params"] == params.to_dict()
    entry = TuningCache().get("op", "gpu-x", ARGS)  # valid: no warning, not dropped
    assert entry is not None and type(params).from_dict(entry["params"]) == params


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[" * 100000, "not valid JSON"),
        ('{"format": "ragged-kernels-tuning", "version": 1, "entries": []}', "'entries' is not"),
        (
            '{"format": "ragged-kernels-tuning", "version": 1, "entries": {"k": {"op": "x", '
            '"device": "d", "args": null, "params": {"num_warps": "8"}, "time_s": 1.0, '
            '"date": "2024"}}}',
            "params field 'num_warps' is not an int",
        ),
        (
            '{"format": "ragged-kernels-tuning", "version": 1, "entries": {"k": {"op": "x", '
            '"device": "d", "args": null, "params": {"overlap_softmax": 1}, "time_s": 1.0, '
            '"date": "2024"}}}',
            "params field 'overlap_softmax' is not a bool",
        ),
        (
            '{"format": "ragged-kernels-tuning", "version": 1, "entries": {"k": {"op": "x", '
            '"device": "d", "args": null, "params": {}, "time_s": -1, "date": "2024"}}}',
            "'time_s' is -1",
        ),
        (
            '{"format": "ragged-kernels-tuning", "version": 1, "entries": {"k": {"op": 1}}}',
            "entry field 'op' is not a str",
        ),
    ],
)
def test_a_corrupt_cache_is_ignored_with_a_warning_then_replaced(isolated_cache, text, problem):
    isolated_cache.parent.mkdir(parents=True)
    isolated_cache.write_text(text, encoding="latin-1")
    cache = TuningCache()
    with pytest.warns(UserWarning, match=f"tuning cache {isolated_cache}: .*{problem}"):
        assert cache.entries() == {}
    with pytest.warns(UserWarning, match=str(isolated_cache)):
        assert cache.get("op", "dev", ARGS) is None
    # The file carries no valid entry of ours: the next put replaces it.
    with pytest.warns(UserWarning):
        assert cache.put("op", "dev", ARGS, PARAMS, 1.0) is not None
    assert TuningCache().get("op", "dev", ARGS)["params"] == PARAMS


def test_invalid_utf8_is_ignored(isolated_cache):
    isolated_cache.parent.mkdir(parents=True)
    isolated_cache.write_bytes(b'{"format": "\xff"}')
    with pytest.warns(UserWarning, match="cannot be read"):
        assert TuningCache().entries() == {}


@pytest.mark.parametrize(
    "document, problem",
    [
        ({"format": "something-else", "entries": {}}, "not a ragged-kernels tuning cache"),
        ([1, 2, 3], "not a ragged-kernels tuning cache"),
        ({"format": "ragged-kernels-tuning", "version": 2, "entries": {}}, "version 2"),
    ],
)
def test_a_foreign_file_is_ignored_and_never_overwritten(isolated_cache, document, problem):
    isolated_cache.parent.mkdir(parents=True)
    text = json.dumps(document)
    isolated_cache.write_text(text)
    cache = TuningCache()
    with pytest.warns(UserWarning, match=problem):
        assert cache.get("op", "dev", ARGS) is None
    with pytest.warns(UserWarning, match="not storing"):
        assert cache.put("op", "dev", ARGS, PARAMS, 1.0) is None
    assert isolated_cache.read_text() == text


def test_nothing_in_the_file_is_executed(isolated_cache, monkeypatch):
    # A file crafted to run code if it were evaluated or unpickled: it is only parsed.
    isolated_cache.parent.mkdir(parents=True)
    isolated_cache.write_text("__import__('os').system('touch pwned')")
    monkeypatch.chdir(isolated_cache.parent)
    with pytest.warns(UserWarning, match="not valid JSON"):
        TuningCache().entries()
    assert not (isolated_cache.parent / "pwned").exists()


def test_one_bad_entry_costs_only_itself(isolated_cache):
    cache = TuningCache()
    kept = cache.put("grouped_matmul.fwd", "gpu-x", ARGS, PARAMS, 0.001)
    spoiled = cache.put("grouped_matmul.bwd", "gpu-x", ARGS, PARAMS, 0.002)
    document = json.loads(isolated_cache.read_text())
    document["entries"][spoiled]["time_s"] = "fast"
    isolated_cache.write_text(json.dumps(document))
    with pytest.warns(UserWarning, match=r"1 invalid entr\(ies\) dropped.*time_s"):
        assert list(cache.entries()) == [kept]
    with pytest.warns(UserWarning, match="time_s"):
        third = cache.put("grouped_matmul.fwd_bwd", "gpu-x", ARGS, PARAMS, 0.003)
    assert sorted(TuningCache().entries()) == sorted([kept, third])


def test_put_refuses_an_invalid_entry():
    with pytest.raises(ValueError, match="params field 'num_warps' is not an int"):
        TuningCache().put("op", "dev", ARGS, {"num_warps": 8.0}, 1.0)
    with pytest.raises(ValueError, match="params field 'num_warps' is not an int"):
        TuningCache().put("op", "dev", ARGS, {"num_warps": True}, 1.0)
    for name in ("tma", "dq_tma", "warp_specialize", "overlap_softmax"):
        with pytest.raises(ValueError, match=f"params field '{name}' is not a bool"):
            TuningCache().put("op", "dev", ARGS, {name: 1}, 1.0)
    with pytest.raises(ValueError, match="'time_s' is nan"):
        TuningCache().put("op", "dev", ARGS, PARAMS, float("nan"))


def _write_concurrently(cache: TuningCache, writers: int, puts: int) -> None:
    def write(writer: int) -> None:
        for i in range(puts):
            cache.put(f"op{writer}", "dev", (i,), {"num_warps": 4, "num_stages": i + 1}, 1e-3)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_concurrent_writers_lose_nothing(isolated_cache):
    cache = TuningCache()
    _write_concurrently(cache, writers=8, puts=10)
    assert len(cache.entries()) == 80
    assert not [p for p in isolated_cache.parent.iterdir() if p.name.startswith(".tuning.json.")]


def test_without_locks_the_atomic_replace_still_never_tears_the_file(isolated_cache, monkeypatch):
    # What a platform without POSIX locks gets: concurrent read-modify-writes may lose
    # each other's entries, but every read parses and the last writer's entry is there.
    monkeypatch.setattr(TuningCache, "_locked", lambda self: contextlib.nullcontext())
    cache, stop, problems = TuningCache(), threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                try:
                    json.loads(isolated_cache.read_text())
                except ValueError as err:
                    problems.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        _write_concurrently(cache, writers=6, puts=10)
    finally:
        stop.set()
        reader.join()
    assert problems == []
    entries = cache.entries()  # parses without a warning
    assert 1 <= len(entries) <= 60
    last = cache.put("last", "dev", (), {"num_warps": 8}, 1e-3)
    assert last in cache.entries()


def test_concurrent_processes(isolated_cache):
    script = textwrap.dedent(
        """
        import sys
        from jax_bridge.tuning.cache import TuningCache
        cache = TuningCache()
        for i in range(15):
            cache.put(f"op{sys.argv[1]}", "dev", (i,), {"num_stages": i + 1}, 1e-3)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", CACHE_DIR_ENV: str(isolated_cache.parent)}
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(w)], cwd=ROOT, env=env)
        for w in range(3)
    ]
    assert [p.wait(timeout=120) for p in processes] == [0, 0, 0]
    entries = TuningCache().entries()
    assert len(entries) == 45
    assert {e["op"] for e in entries.values()} == {"op0", "op1", "op2"}


def test_format_constants_are_the_documented_ones():
    assert cache_module.FORMAT == "ragged-kernels-tuning" and cache_module.VERSION == 1
    assert CACHE_DIR_ENV == "RAGGED_KERNELS_CACHE_DIR"
