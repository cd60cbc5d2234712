"""Start-up output on a CPU machine: the CUDA plugin's no-driver notices are dropped,
every other line written to stderr (C++ or Python) is kept."""

import os
import subprocess
import sys

import pytest

from bench.quiet_start import NOTICES, dropping_notices, has_nvidia_driver

ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
STUB = (
    "I0000 00:00:1795643666.963905    6293 cudart_stub.cc:31] Could not find cuda drivers "
    "on your machine, GPU will not be used."
)


def test_only_the_two_notices_match():
    assert NOTICES.fullmatch(ABSL) and NOTICES.fullmatch(STUB)
    # A real error from the same file, or the notice inside another line, is not one.
    assert not NOTICES.fullmatch(STUB.replace("Could not find", "Failed to find"))
    assert not NOTICES.fullmatch("E0000 " + STUB[6:])
    assert not NOTICES.fullmatch(f"Traceback: {ABSL}")


def test_dropping_notices_keeps_other_lines(capfd):
    with pytest.raises(RuntimeError), dropping_notices():
        os.write(2, f"{ABSL}\n{STUB}\nreal error from C++\n".encode())
        print("python warning", file=sys.stderr)
        raise RuntimeError("the block fails: what it wrote is still passed on")
    # (Under capfd, sys.stderr is pytest's own: compared as a set of lines.)
    assert sorted(capfd.readouterr().err.splitlines()) == ["python warning", "real error from C++"]


@pytest.mark.skipif(has_nvidia_driver(), reason="the notices appear only without a driver")
def test_bench_start_prints_no_notices():
    """`python -m bench report --help` starts JAX the way the main job does."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    result = subprocess.run(
        [sys.executable, "-m", "bench", "report", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stderr
    assert "cudart_stub" not in result.stderr and "absl::InitializeLog" not in result.stderr
    assert "usage: python -m bench report" in result.stdout
