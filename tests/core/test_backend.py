"""The one rule that picks an implementation."""

import pytest

from jax_bridge.core.backend import resolve_implementation


@pytest.mark.parametrize(
    "platform, supported, expected",
    [
        ("cuda", ("triton", "xla"), "triton"),
        ("rocm", ("triton", "xla"), "triton"),
        ("tpu", ("triton", "xla"), "xla"),
        ("tpu", ("pallas", "xla"), "pallas"),
        ("cpu", ("triton", "pallas", "xla"), "xla"),
    ],
)
def test_auto_picks_the_platform_native_kernel(platform, supported, expected):
    assert (
        resolve_implementation("auto", op="op", supported=supported, platform=platform) == expected
    )


def test_explicit_choice_wins_and_triton_runs_anywhere():
    assert (
        resolve_implementation("xla", op="op", supported=("triton", "xla"), platform="cuda")
        == "xla"
    )
    assert (
        resolve_implementation("triton", op="op", supported=("triton", "xla"), platform="cpu")
        == "triton"
    )


def test_unavailable_choices_say_why():
    with pytest.raises(ValueError, match="implementation must be one of"):
        resolve_implementation("cudnn", op="op", supported=("xla",))
    with pytest.raises(ValueError, match="not available for this op"):
        resolve_implementation("pallas", op="gmm", supported=("triton", "xla"))
    with pytest.raises(ValueError, match="needs a TPU"):
        resolve_implementation("pallas", op="op", supported=("pallas", "xla"), platform="cpu")
