"""The autotuner: the winner under an injected clock, pruning before any build, failures,
the cache (hit, force, corrupt entries), static-report pruning, and the tunable ops
end to end through Triton's interpreter (a GPU stands in only for the platform check).

Every test uses a cache under tmp_path (the autouse fixture), never the user's home.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_bridge.tuning.autotune as autotune_module
from jax_bridge.attention.api import varlen_attention
from jax_bridge.attention.reference import attention_reference
from jax_bridge.grouped_matmul.api import grouped_matmul
from jax_bridge.grouped_matmul.reference import grouped_matmul_reference
from jax_bridge.launch.report import InnerLoop, KernelReport
from jax_bridge.tuning.autotune import (
    autotune,
    static_report_prune,
    tune_attention,
    tune_grouped_matmul,
)
from jax_bridge.tuning.cache import CACHE_DIR_ENV, TuningCache
from jax_bridge.tuning.device import device_fingerprint
from jax_bridge.tuning.params import BwdParams, FwdParams
from tests.devices import cpu_only
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig

A = FwdParams(blocksize_m=64, num_warps=4)
B = FwdParams(blocksize_m=128, num_warps=8)
C = FwdParams(blocksize_m=256, num_warps=8)
ARGS = (np.ones((4, 4), np.float32),)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return TuningCache()


class Clock:
    """A fake clock that the timed functions advance by their candidate's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_build(clock: Clock, costs: dict, built: list | None = None, fail=()):
    """build(params) -> a function costing `costs[params]` seconds a call (a list: one
    cost per call, the first being the untimed warm-up); `fail` raise when built."""

    def build(params):
        if built is not None:
            built.append(params)
        if params in fail:
            raise RuntimeError(f"out of resources at {params}")
        schedule = iter(costs[params]) if isinstance(costs[params], list) else None

        def run(x):
            clock.now += next(schedule) if schedule else costs[params]
            return x + 1

        return run

    return build


def test_the_fastest_candidate_wins_and_is_stored(cache):
    clock, built = Clock(), []
    costs = {A: 3 / 1024, B: 1 / 1024, C: 2 / 1024}
    result = autotune("op", fake_build(clock, costs, built), ARGS, [A, B, C], timer=clock)
    assert result.best == B and not result.from_cache
    assert dict(result.times) == costs  # every call of a candidate costs the same
    assert list(result.times) == [A, B, C]  # in candidate order
    assert built == [A, B, C]  # each built once
    assert clock.now == pytest.approx(6 * (3 / 1024 + 1 / 1024 + 2 / 1024))  # warm-up + 5 repeats
    entry = cache.get(
        "op", device_fingerprint(), {"args": autotune_module.abstractify(ARGS), "static": None}
    )
    assert entry["params"] == B.to_dict() and entry["time_s"] == 1 / 1024


def test_a_cache_that_cannot_be_written_costs_the_entry_not_the_result(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = TuningCache(blocker / "tuning.json")  # its parent is a regular file
    clock = Clock()
    with (
        pytest.warns(UserWarning, match="cannot be read"),  # the lookup first
        pytest.warns(UserWarning, match="could not store the winner"),
    ):
        result = autotune(
            "op", fake_build(clock, {A: 2 / 1024, B: 1 / 1024}), ARGS, [A, B],
            cache=cache, timer=clock,
        )  # fmt: skip
    assert result.best == B and not result.from_cache


def test_median_of_the_repeats_and_the_warm_up_is_not_timed():
    clock = Clock()
    costs = {A: [100.0, 5.0, 1.0, 2.0, 3.0, 100.0], B: [0.0, 2.5, 2.5, 2.5, 2.5, 2.5]}
    result = autotune("op", fake_build(clock, costs), ARGS, [A, B], repeats=5, timer=clock)
    assert result.times[A] == 3.0 and result.times[B] == 2.5 and result.best == B


def test_ties_go_to_the_first_candidate():
    clock = Clock()
    costs = {A: 1 / 1024, B: 1 / 1024}
    assert autotune("op", fake_build(clock, costs), ARGS, [B, A], timer=clock).best == B


def test_a_cached_winner_is_returned_without_building():
    clock, built = Clock(), []
    costs = {A: 3 / 1024, B: 1 / 1024}
    autotune("op", fake_build(clock, costs), ARGS, [A, B], timer=clock)
    again = autotune("op", fake_build(clock, costs, built), ARGS, [A, B], timer=clock)
    assert again.from_cache and again.best == B and built == []
    assert dict(again.times) == {B: 1 / 1024}
    # Other shapes, static options or ops are other entries: timed afresh.
    other = (np.ones((8, 4), np.float32),)
    assert not autotune("op", fake_build(clock, costs), other, [A, B], timer=clock).from_cache
    with_static = autotune("op", fake_build(clock, costs), ARGS, [A, B], static={"causal": True})
    assert not with_static.from_cache


def test_force_times_again_and_replaces_the_winner():
    clock = Clock()
    autotune("op", fake_build(clock, {A: 3 / 1024, B: 1 / 1024}), ARGS, [A, B], timer=clock)
    built = []
    forced = autotune(
        "op",
        fake_build(clock, {A: 1 / 1024, B: 3 / 1024}, built),
        ARGS,
        [A, B],
        force=True,
        timer=clock,
    )
    assert built == [A, B] and forced.best == A and not forced.from_cache
    assert autotune("op", fake_build(clock, {}), ARGS, [A, B], timer=clock).best == A


def test_pruned_candidates_are_never_built():
    clock, built = Clock(), []
    costs = {A: 1 / 1024, B: 2 / 1024, C: 3 / 1024}

    def prune(params):
        if params == C:
            raise RuntimeError("ptxas refused")
        return "spills 64 B" if params == A else None

    result = autotune(
        "op", fake_build(clock, costs, built), ARGS, [A, B, C], prune=prune, timer=clock
    )
    assert built == [B] and result.best == B
    assert dict(result.pruned) == {
        A: "spills 64 B",
        C: "static check failed: RuntimeError: ptxas refused",
    }


def test_a_candidate_that_fails_is_recorded_not_fatal():
    clock = Clock()
    costs = {A: 1 / 1024, B: 2 / 1024}
    result = autotune("op", fake_build(clock, costs, fail={A}), ARGS, [A, B], timer=clock)
    assert result.best == B and dict(result.failed) == {A: f"RuntimeError: out of resources at {A}"}


def test_every_candidate_pruned_or_failed_is_an_error_naming_the_op(cache):
    clock = Clock()
    with pytest.raises(
        RuntimeError,
        match=r"autotune\('gmm'\): every candidate was pruned or failed: .*spills.*out of",
    ):
        autotune(
            "gmm",
            fake_build(clock, {A: 1.0, B: 1.0}, fail={B}),
            ARGS,
            [A, B],
            prune=lambda p: "spills" if p == A else None,
            timer=clock,
        )
    assert cache.entries() == {}


def test_candidates_are_checked():
    build = fake_build(Clock(), {A: 1.0})
    with pytest.raises(ValueError, match=r"autotune\('op'\): no candidates"):
        autotune("op", build, ARGS, [])
    with pytest.raises(TypeError, match="all FwdParams or all BwdParams"):
        autotune("op", build, ARGS, [A, BwdParams()])
    with pytest.raises(TypeError, match="all FwdParams or all BwdParams"):
        autotune("op", build, ARGS, [GroupedMatmulConfig(64, 64, 64)])
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        autotune("op", build, ARGS, [A], repeats=0)
    built = []
    autotune("op", fake_build(Clock(), {A: 1.0}, built), ARGS, [A, A, A])
    assert built == [A]  # duplicates dropped


def test_an_invalid_cached_entry_is_retuned_with_a_warning(cache):
    clock = Clock()
    key_args = {"args": autotune_module.abstractify(ARGS), "static": None}
    cache.put(
        "op", device_fingerprint(), key_args, {"blocksize_m": 48}, 1 / 1024
    )  # not a power of 2
    with pytest.warns(UserWarning, match="op: FwdParams.blocksize_m must be a power of two"):
        result = autotune("op", fake_build(clock, {A: 1 / 1024}), ARGS, [A], timer=clock)
    assert result.best == A and not result.from_cache


def test_real_timing_picks_the_candidate_that_does_less_work():
    # On a GPU a 256-wide product takes microseconds, as long as a launch: larger there.
    size = 256 if jax.default_backend() == "cpu" else 2048
    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)) / 16, jnp.float32)

    def build(params):  # num_stages products in a chain: 1 does a sixteenth of 16's work
        def chain(x):
            return functools.reduce(lambda a, _: jnp.tanh(a @ x), range(params.num_stages), x)

        return jax.jit(chain)

    one, sixteen = FwdParams(num_stages=1), FwdParams(num_stages=16)
    result = autotune("chain", build, (x,), [sixteen, one], repeats=3)
    assert result.best == one
    assert result.times[sixteen] > 2 * result.times[one] > 0


# --- static_report_prune ------------------------------------------------------------


def _report(**changes) -> KernelReport:
    fields = dict(
        kernel="gmm_kernel",
        compute_capability=90,
        num_warps=8,
        num_stages=3,
        registers=168,
        spill_store_bytes=0,
        spill_load_bytes=0,
        stack_bytes=0,
        shared_memory_bytes=96 * 1024,
        uses_wgmma=True,
        uses_mma=True,
        sass_opcodes=types.MappingProxyType({"HGMMA": 32}),
    )
    return KernelReport(**{**fields, **changes})


def test_static_report_prune():
    prune = static_report_prune(lambda report: report)
    assert prune(_report()) is None
    assert prune(_report(spill_store_bytes=40, spill_load_bytes=24)) == (
        "gmm_kernel spills 64 B (stores and loads per thread)"
    )
    # 120 KiB fits sm_90's 227 KiB per block, not sm_86's 99 KiB.
    assert prune(_report(shared_memory_bytes=120 * 1024)) is None
    assert prune(_report(compute_capability=86, shared_memory_bytes=120 * 1024)) == (
        "gmm_kernel needs 122880 B of shared memory, over the 101376 B of sm_86"
    )
    strict = static_report_prune(lambda report: report, shared_memory_limit=64 * 1024)
    assert "over the 65536 B" in strict(_report())
    # With an inner tensor-core loop, spills outside it are kept (a program pays them
    # once); spill stores in it, more than one reload an iteration, or serialized MMAs
    # are pruned.
    loop = InnerLoop(start=0, end=512, instructions=400, mma_flops=2**22)
    outside = _report(inner_loop=loop, spill_store_bytes=120, spill_load_bytes=140)
    assert prune(outside) is None
    one_reload = dataclasses.replace(loop, spill_instructions=1)
    assert prune(_report(inner_loop=one_reload, spill_load_bytes=24)) is None
    stores = dataclasses.replace(loop, spill_instructions=3, spill_stores=1)
    assert prune(_report(inner_loop=stores, spill_store_bytes=8, spill_load_bytes=8)) == (
        "gmm_kernel spills in its inner loop (3 local-memory accesses an iteration, 1 of "
        "them stores)"
    )
    reloads = dataclasses.replace(loop, spill_instructions=2)
    assert "spills in its inner loop" in prune(_report(inner_loop=reloads, spill_load_bytes=8))
    assert prune(_report(inner_loop=loop, serialized_wgmma=True)) == (
        "gmm_kernel has its warpgroup MMAs serialized by ptxas"
    )
    # Several kernels per candidate: the first problem is the reason.
    several = static_report_prune(lambda reports: reports)
    assert several([_report(), _report(kernel="tgmm_kernel", spill_load_bytes=8)]).startswith(
        "tgmm_kernel spills 8 B"
    )


# --- the tunable ops ------------------------------------------------------------------


@cpu_only("without a GPU the ops refuse to tune")
def test_the_ops_have_nothing_to_tune_without_a_gpu():
    x = jnp.ones((32, 16), jnp.float32)
    with pytest.raises(RuntimeError, match="tune_grouped_matmul: nothing to tune without a GPU"):
        tune_grouped_matmul(x, jnp.ones((2, 16, 16)), jnp.array([16, 16], jnp.int32))
    q = jnp.ones((16, 2, 16), jnp.float32)
    cu = jnp.array([0, 16], jnp.int32)
    with pytest.raises(RuntimeError, match="tune_attention: nothing to tune without a GPU"):
        tune_attention(q, q, q, cu, cu)


@pytest.fixture
def pretend_gpu(monkeypatch):
    # Only the platform check is fooled: the kernels still run in Triton's interpreter.
    monkeypatch.setattr(autotune_module, "get_device_platform", lambda device=None: "gpu")


def test_tune_grouped_matmul_end_to_end(pretend_gpu, cache):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((48, 32)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.float32)
    sizes = jnp.array([20, 0, 25], jnp.int32)
    small = FwdParams(blocksize_m=16, blocksize_k=16, blocksize_n=16, num_warps=4, num_stages=1)
    large = FwdParams(blocksize_m=32, blocksize_k=32, blocksize_n=16, num_warps=4, num_stages=1)
    # The interpreter's times mean nothing: a stopped clock ties them, the first wins.
    result = tune_grouped_matmul(
        lhs, rhs, sizes, candidates=[large, small], repeats=1, timer=lambda: 0.0
    )
    assert not result.failed and dict(result.times) == {large: 0.0, small: 0.0}
    assert result.best == large
    (key,) = cache.entries()
    assert key.startswith("grouped_matmul.fwd_bwd-")
    # The winner, as the op's config, computes what the reference does.
    config = result.best.to_grouped_matmul_config(GroupedMatmulConfig(64, 64, 64))
    assert config == GroupedMatmulConfig(32, 32, 16, num_warps=4, num_stages=1)
    out = grouped_matmul(lhs, rhs, sizes, implementation="triton", config=config)
    expected = grouped_matmul_reference(lhs, rhs, sizes)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_tune_attention_end_to_end(pretend_gpu, cache):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((36, 2, 16)), jnp.float32)
    k, v = jnp.asarray(rng.standard_normal((2, 36, 1, 16)), jnp.float32)
    cu = jnp.array([0, 7, 36], jnp.int32)  # two documents, each crossing 16-row tiles
    candidates = {
        "forward": [FwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=1)],
        "backward_dkdv": [BwdParams(q_blocksize=32, kv_blocksize=16, num_warps=4, num_stages=1)],
        "backward_dq": [
            BwdParams(dq_q_blocksize=16, dq_kv_blocksize=16, dq_num_warps=2, dq_num_stages=1)
        ],
    }
    configs, results = tune_attention(
        q, k, v, cu, cu, causal=True, candidates=candidates, repeats=1
    )
    assert list(results) == ["forward", "backward_dkdv", "backward_dq"]
    assert all(not r.failed and not r.from_cache for r in results.values())
    assert configs == AttentionConfigs(
        forward=AttentionKernelConfig(16, 32, num_warps=4, num_stages=1),
        backward_dkdv=AttentionKernelConfig(32, 16, num_warps=4, num_stages=1),
        backward_dq=AttentionKernelConfig(16, 16, num_warps=2, num_stages=1),
    )
    # The tuned configs compute what the reference does, forward and gradient.
    tuned = lambda q: varlen_attention(
        q, k, v, cu, cu, causal=True, implementation="triton", config=configs
    )
    reference = lambda q: attention_reference(q, k, v, np.asarray(cu), np.asarray(cu), causal=True)
    np.testing.assert_allclose(tuned(q), reference(q), rtol=2e-5, atol=2e-5)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    grad = lambda f: jax.grad(lambda q: jnp.sum(f(q) * weights))(q)
    np.testing.assert_allclose(grad(tuned), grad(reference), rtol=2e-5, atol=2e-5)
    # A second call reads all three winners from the cache.
    again, cached = tune_attention(q, k, v, cu, cu, causal=True, candidates=candidates)
    assert again == configs and all(r.from_cache for r in cached.values())
    assert len(cache.entries()) == 3


def test_a_cached_winner_with_the_kernels_options_comes_back_whole():
    # The options are bools in the cache's JSON, as the params hold them.
    clock, built = Clock(), []
    ws = FwdParams(blocksize_m=128, num_warps=4, tma=True, warp_specialize=True)
    overlap = BwdParams(q_blocksize=32, kv_blocksize=128, tma=False, overlap_softmax=True)
    for winner, loser in ((ws, A), (overlap, BwdParams(q_blocksize=16))):
        op, costs = f"op-{type(winner).__name__}", {winner: 1 / 1024, loser: 2 / 1024}
        first = autotune(op, fake_build(clock, costs), ARGS, [loser, winner], timer=clock)
        assert first.best == winner and not first.from_cache
        again = autotune(op, fake_build(clock, costs, built), ARGS, [loser, winner], timer=clock)
        assert again.from_cache and again.best == winner
    assert built == []
