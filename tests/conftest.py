"""Test-wide settings.

Eight fake CPU devices back every mesh test, and JAX computes on the CPU unless
`JAX_PLATFORMS` says otherwise (`JAX_PLATFORMS=cuda` runs the suite on a GPU): both must be
set before JAX is imported, which is why they live at the top of this file.
Hypothesis profiles (`HYPOTHESIS_PROFILE=...`), all but `long` derandomized so that a run
is reproducible: `ci` (the default, `make test`: a few examples each, enough to cross every
branch the strategies reach), `thorough` (`make test-all`'s second pass over the property
tests), `long` (a randomised search on demand). `--emulate-tf32` compiles XLA's float32
dots as XLA:GPU does (tests/tf32.py; `make test-device-stack` runs with it). Every
interpreted Triton launch is checked for accesses whose result a GPU's concurrency would
make order-dependent (two programs, or a program's threads without a barrier between) and
for accesses outside its buffers (jax_bridge/launch/program_conflicts.py), unless
`--no-conflict-check`.
"""

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Appended, not defaulted: a CI that sets XLA_FLAGS for other reasons must still get 8 devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# The suite compiles over a thousand small programs and runs each a few times: LLVM's
# optimization of the host code costs more than it saves (level 0 halves XLA:CPU compile
# times and cuts the quick suite by about a third). Every HLO pass still runs, so the
# programs, their fusions and their numerics are those of a default build; a CI that
# sets its own level keeps it.
# On a GPU (`JAX_PLATFORMS=cuda`) the flag would also switch off LLVM's optimization of
# XLA:GPU's own kernels, the oracles' included: CPU runs only.
if (
    os.environ["JAX_PLATFORMS"] == "cpu"
    and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# On a GPU every pytest-xdist worker is a JAX process: with XLA's default each would take
# 75% of the device's memory at start, and the second would fail.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Keeps Triton 3.9's default (fused multiply-add on) without its deprecation warning.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Kernels compiled for cuda by one test are not found on disk by another (nor by a
# later run): tests/launch/test_ptx_cache.py turns the PTX cache on where it tests it.
os.environ.setdefault("RAGGED_KERNELS_PTX_CACHE_DIR", "")

import hypothesis
import pytest

from bench.quiet_start import start_jax_quietly

# Without an NVIDIA driver, jax's CUDA plugin (needed for the CUDA lowering tests) logs
# four "Could not find cuda drivers" notices at start-up: dropped, other output kept.
start_jax_quietly()

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile("ci", max_examples=10, derandomize=True, **_COMMON)
hypothesis.settings.register_profile("thorough", max_examples=60, derandomize=True, **_COMMON)
hypothesis.settings.register_profile("long", max_examples=1000, **_COMMON)
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
    parser.addoption(
        "--as-gpu",
        type=int,
        choices=(80, 90),
        default=None,
        metavar="CC",
        help="on a CPU: trace every test's Triton launches for sm_CC at a GPU's defaults, "
        "outputs poisoned, and run them through the interpreter with a GPU's buffers",
    )
    parser.addoption(
        "--no-conflict-check",
        action="store_true",
        help="do not check interpreted launches for order-dependent accesses (two programs, "
        "a missing barrier) and accesses outside their buffers "
        "(jax_bridge/launch/program_conflicts.py; checked by default)",
    )
    parser.addoption(
        "--emulate-tf32",
        action="store_true",
        help="compile float32 XLA dots below HIGHEST precision in TF32, as XLA:GPU does "
        "(tests/tf32.py): tests that would fail on a GPU for it fail here",
    )


def pytest_configure(config):
    from tests import margins

    # xdist workers receive the same options: every process appends to the one file.
    margins.configure(config.getoption("--margins"))
    if config.getoption("--as-gpu"):
        import jax

        from jax_bridge.launch.jax_triton_compat import jax_triton_api_version

        if jax.default_backend() != "cpu" or jax_triton_api_version() != (0, 3):
            raise pytest.UsageError("--as-gpu runs on a CPU with jax-triton 0.3 (its stand-in)")
    if not config.getoption("--no-conflict-check"):
        from jax_bridge.launch import program_conflicts

        program_conflicts.set_checking(True)
    if config.getoption("--emulate-tf32"):
        from tests import tf32

        tf32.install()


def pytest_terminal_summary(terminalreporter, config):
    from tests import margins

    path = config.getoption("--margins")
    if path is None or hasattr(config, "workerinput"):  # the controller reports, once
        return
    threshold = config.getoption("--margins-above")
    for line in margins.summary(path, margins.THRESHOLD if threshold is None else threshold):
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _launches_as_on_a_gpu(request, monkeypatch):
    """On a GPU, kernels' outputs start poisoned (NaN, the integer minimum) as on the
    interpreter, so that an element a kernel leaves unwritten fails the test; with
    `--as-gpu CC` on a CPU, the test's Triton launches are traced for sm_CC at a GPU's
    defaults, their outputs poisoned, and run by the interpreter with a GPU's buffers
    (`tests/launch/recording.py`). Neither where a test inspects lowered programs
    (`tests/devices.py`)."""
    from tests.devices import poisons_outputs

    as_gpu = request.config.getoption("--as-gpu")
    if not poisons_outputs(request.node.nodeid, as_gpu):
        yield
        return
    from jax_bridge import cuda_lowering, poisoned_outputs

    with contextlib.ExitStack() as stack:
        if as_gpu:
            from tests.launch.recording import interpret_gpu_launches

            interpret_gpu_launches(monkeypatch)
            stack.enter_context(cuda_lowering(as_gpu))
        stack.enter_context(poisoned_outputs())
        yield


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the whole collection is seen
def pytest_collection_modifyitems(config, items):
    from tests import budget

    for item in items:
        if budget.is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    # Named test ids narrow the collection below whole files: no staleness to judge then.
    if not any("::" in arg for arg in config.args):
        stale = budget.unmatched_patterns(item.nodeid for item in items)
        if stale:
            raise pytest.UsageError(f"tests/budget.py: patterns that match no test: {stale}")
