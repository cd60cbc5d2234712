"""Host callbacks (Triton's interpreter behind `jax.pure_callback`) end before Python does.

At exit JAX waits for the computations that have effects, not for pure callbacks. A
launch still running when the interpreter finalizes, or queued behind one (an eager
`jax.grad` dispatches the forward whose output it drops, and returns without it), has
XLA's callback thread reach a finalizing interpreter, which aborts the process
("terminate called without an active exception", exit status 134) after every result
the script waited for was right. So each host launch counts itself while it runs, and
an exit handler, which runs before JAX's own, waits until none has run for a moment
(dispatched launches start meanwhile, as the handler holds no lock and not the GIL).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator

_QUIET_S = 0.2
"""How long no host callback may have run before the exit handler lets Python finish."""
_LIMIT_S = 600.0
"""The longest the exit handler waits (a launch that never ends must not hang the exit)."""

_state = threading.Condition()
_running = 0
_last_end: float | None = None  # time.monotonic() when the last callback ended


@contextlib.contextmanager
def running_on_host() -> Iterator[None]:
    """Marks the body as a host callback that Python's exit must wait for."""
    global _running, _last_end
    with _state:
        _running += 1
    try:
        yield
    finally:
        with _state:
            _running -= 1
            _last_end = time.monotonic()
            _state.notify_all()


def wait_for_host_callbacks(quiet_s: float = _QUIET_S, limit_s: float = _LIMIT_S) -> bool:
    """Blocks until no host callback has run for `quiet_s` seconds, counted from the later
    of this call and the last callback's end (callbacks JAX dispatched but has not started,
    which this module cannot see, start meanwhile), at most `limit_s`; returns whether
    they drained. Returns at once if none ever ran."""
    start = time.monotonic()
    deadline = start + limit_s
    with _state:
        while _last_end is not None or _running:
            now = time.monotonic()
            quiet_since = max(start, _last_end or start)
            if not _running and now - quiet_since >= quiet_s:
                break
            if now >= deadline:
                return False
            # Releases the lock (and the GIL): a queued callback can start meanwhile.
            _state.wait(timeout=min(quiet_s, deadline - now))
    return True


atexit.register(wait_for_host_callbacks)
