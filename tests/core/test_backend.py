"""The one rule that picks an implementation."""

import pytest

from jax_bridge.core.backend import compiling_for_platform, resolve_implementation


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
    # An unknown name is answered with the op's own choices, not every backend's.
    with pytest.raises(ValueError, match=r"one of \('auto', 'triton', 'xla'\), got 'cuda'"):
        resolve_implementation("cuda", op="gmm", supported=("xla", "triton"))
    with pytest.raises(ValueError, match="not available for this op"):
        resolve_implementation("pallas", op="gmm", supported=("triton", "xla"))


def test_explicit_pallas_runs_off_tpu():
    # Off a TPU the Pallas kernels run in Pallas' interpret mode (the backend decides).
    assert (
        resolve_implementation("pallas", op="op", supported=("pallas", "xla"), platform="cpu")
        == "pallas"
    )


# --- BackendTable: one table per op -------------------------------------------------

import types  # noqa: E402

from jax_bridge.core.backend import BackendTable  # noqa: E402


def _table():
    return BackendTable(
        "op", {"xla": types.SimpleNamespace(tag="x"), "triton": types.SimpleNamespace(tag="t")}
    )


def test_table_resolves_like_the_rule_and_returns_the_module():
    table = _table()
    with compiling_for_platform("cpu"):
        assert table.resolve("auto") == "xla"
    with compiling_for_platform("cuda"):
        assert table.resolve("auto") == "triton"
    assert table[table.resolve("triton")].tag == "t"
    with pytest.raises(ValueError, match="op: implementation='pallas' is not available"):
        table.resolve("pallas")


def test_table_interpret_selects_triton_and_refuses_other_choices():
    table = _table()
    assert table.resolve("auto", interpret=True) == "triton"
    assert table.resolve("triton", interpret=True) == "triton"
    with pytest.raises(ValueError, match="op: interpret=True runs the Triton kernels"):
        table.resolve("xla", interpret=True)
    no_triton = BackendTable("op2", {"xla": object()})
    with pytest.raises(ValueError, match="op2: interpret=True"):
        no_triton.resolve("auto", interpret=True)


def test_table_rejects_unknown_backends_and_is_read_only():
    with pytest.raises(ValueError, match="unknown backends"):
        BackendTable("op", {"cudnn": object()})
    table = _table()
    with pytest.raises(TypeError):
        table.backends["pallas"] = object()


def test_every_op_table_lists_its_backends():
    from jax_bridge.attention import api as attention_api
    from jax_bridge.grouped_matmul import api as gmm_api

    for table, contract, backends in (
        (
            attention_api.BACKENDS,
            ("HEAD_DIMS", "forward", "backward"),
            {"xla", "triton", "pallas"},
        ),
        (gmm_api._BACKENDS, ("gmm", "tgmm"), {"xla", "triton"}),
    ):
        assert set(table.backends) == backends
        for name, module in table.backends.items():
            missing = [f for f in contract if not hasattr(module, f)]
            assert not missing, (table.op, name, missing)
