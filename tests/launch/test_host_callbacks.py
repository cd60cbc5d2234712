"""Python's exit waits for the interpreted launches JAX dispatched (`host_callbacks`)."""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jax_bridge.launch import host_callbacks

_ROOT = pathlib.Path(__file__).resolve().parents[2]

# Eager gradients whose forward launches go unused: the third call's compiled programs
# are cached, so it returns before any of its launches has started, and the script ends.
# Without the exit handler the process aborted (status 134) every time, after every
# result it asked for was computed.
_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from jax_bridge import grouped_matmul
    x = jax.random.normal(jax.random.key(0), (40, 32))
    w = jax.random.normal(jax.random.key(1), (3, 32, 16))
    sizes = jnp.array([10, 0, 25], jnp.int32)
    for implementation in ("triton", "xla", "triton"):
        jax.grad(lambda x: grouped_matmul(x, w, sizes, implementation=implementation).sum())(x)
    print("dispatched")
    """
)


def test_a_script_ends_cleanly_with_launches_it_did_not_wait_for():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dispatched" in done.stdout and "terminate" not in done.stderr


@pytest.fixture
def fresh_state(monkeypatch):
    """The module's counters as in a process that has launched nothing."""
    monkeypatch.setattr(host_callbacks, "_running", 0)
    monkeypatch.setattr(host_callbacks, "_last_end", None)


def _callback_in_a_thread(release: threading.Event) -> threading.Thread:
    started = threading.Event()

    def run():
        with host_callbacks.running_on_host():
            started.set()
            release.wait()

    thread = threading.Thread(target=run)
    thread.start()
    started.wait()
    return thread


def test_the_exit_waits_for_nothing_if_nothing_ran(fresh_state):
    start = time.monotonic()
    assert host_callbacks.wait_for_host_callbacks(quiet_s=5.0)
    assert time.monotonic() - start < 1.0


def test_the_exit_waits_for_a_running_callback_then_a_quiet_moment(fresh_state):
    release = threading.Event()
    thread = _callback_in_a_thread(release)
    start = time.monotonic()  # before the timer: a loaded machine may start it late
    threading.Timer(0.3, release.set).start()
    assert host_callbacks.wait_for_host_callbacks(quiet_s=0.1, limit_s=30.0)
    thread.join()
    waited = time.monotonic() - start
    assert waited >= 0.4, waited  # the callback's 0.3 s, then 0.1 s without one


def test_the_exit_stops_waiting_at_its_limit(fresh_state):
    release = threading.Event()
    thread = _callback_in_a_thread(release)
    try:
        start = time.monotonic()
        assert not host_callbacks.wait_for_host_callbacks(quiet_s=0.05, limit_s=0.2)
        assert time.monotonic() - start < 5.0
    finally:
        release.set()
        thread.join()
