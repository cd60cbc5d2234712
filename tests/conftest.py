"""Test-wide settings.

Eight fake CPU devices back every mesh test, and JAX never looks for a GPU: both must be
set before JAX is imported, which is why they live at the top of this file.
Hypothesis runs a deterministic profile by default (CI); `HYPOTHESIS_PROFILE=long` runs
a longer, randomised search on demand.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Appended, not defaulted: a CI that sets XLA_FLAGS for other reasons must still get 8 devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# Keeps Triton 3.9's default (fused multiply-add on) without its deprecation warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import hypothesis

from bench.quiet_start import start_jax_quietly

# Without an NVIDIA driver, jax's CUDA plugin (needed for the CUDA lowering tests) logs
# four "Could not find cuda drivers" notices at start-up: dropped, other output kept.
start_jax_quietly()

hypothesis.settings.register_profile(
    "ci",
    max_examples=30,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "long",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    group = parser.getgroup("margins", "numeric margins (tests/margins.py)")
    group.addoption(
        "--margins",
        metavar="PATH",
        default=None,
        help="append every numerics assertion's error / allowed error to PATH (JSON lines)",
    )
    group.addoption(
        "--margins-above",
        type=float,
        default=None,
        help="with --margins: list the assertions above this margin at the end (default 0.5)",
    )


def pytest_configure(config):
    from tests import margins

    # xdist workers receive the same options: every process appends to the one file.
    margins.configure(config.getoption("--margins"))


def pytest_terminal_summary(terminalreporter, config):
    from tests import margins

    path = config.getoption("--margins")
    if path is None or hasattr(config, "workerinput"):  # the controller reports, once
        return
    threshold = config.getoption("--margins-above")
    for line in margins.summary(path, margins.THRESHOLD if threshold is None else threshold):
        terminalreporter.write_line(line)
