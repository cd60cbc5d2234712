"""The host-layer bench times what its rows say: each op inside a jitted loop (a training
step's view, dispatch and input transfer paid once), and says so in every row."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import host_layer
from bench.host_layer import HostLayerBenchConfig, in_step


def _computation(hlo: str, name: str) -> str:
    match = re.search(rf"^%{re.escape(name)} .*?^}}", hlo, re.S | re.M)
    assert match, f"no computation {name}"
    return match.group(0)


def _while_body(hlo: str) -> str:
    """The text of the (single) while loop's body in optimized HLO, with the fusions it
    calls (XLA fuses the gather into a select, a copy, ...)."""
    bodies = re.findall(r"body=%([\w.\-]+)", hlo)
    assert len(bodies) == 1, f"expected one while loop, found {bodies}"
    body = _computation(hlo, bodies[0])
    called = re.findall(r"calls=%([\w.\-]+)", body)
    return "\n".join([body, *(_computation(hlo, name) for name in called)])


def test_in_step_returns_the_op_result_and_keeps_the_op_in_the_loop() -> None:
    """The loop's result is one call's, and after XLA's optimizations the gather still runs
    in the loop body: it was neither hoisted out (loop-invariant inputs) nor dropped."""
    rng = np.random.default_rng()
    rows = rng.standard_normal((50, 3)).astype(np.float32)
    index = rng.integers(0, 50, 20).astype(np.int32)

    def op(x, i):
        return jnp.take(x, i, axis=0)

    looped = in_step(op, 7)
    np.testing.assert_array_equal(np.asarray(looped(rows, index)), rows[index])
    hlo = looped.lower(rows, index).compile().as_text()
    assert " gather(" in _while_body(hlo)
    assert '"known_trip_count":{"n":"7"}' in hlo.replace(" ", "")


def test_rows_time_one_call_inside_a_step_and_say_so(monkeypatch) -> None:
    """Each row's times are the loop's divided by its call count, its labels and params name
    that measurement, and the single eager call's time is kept apart."""
    loop_s, eager_s = (0.8, 0.4, 0.6), (0.05, 0.07, 0.06)
    real_repeat = host_layer.repeat_seconds

    def fake_repeat(fn, *args, repeats):
        _, out = real_repeat(fn, *args, repeats=1)
        looped = getattr(fn, "__name__", "") == "run"  # in_step's jitted loop
        return (loop_s if looped else eager_s), out

    monkeypatch.setattr(host_layer, "repeat_seconds", fake_repeat)
    config = HostLayerBenchConfig(
        num_docs=5, total_tokens=300, chunk_size=16, feature_dim=2, repeats=3, calls_per_step=4
    )
    rows = host_layer.main(config)
    assert len(rows) == 8
    for row in rows:
        assert row.ok is True
        assert row.times == pytest.approx(tuple(t / 4 for t in loop_s))
        assert row.backend == f"{jax.default_backend()} in step"
        assert row.shape.endswith(", per call of 4 in one jit")
        assert row.params["calls_per_step"] == 4
        assert row.params["one_call_s"] == pytest.approx(0.06)
