"""The GPU rows' runner (bench/runner.py), their declarations (bench/gpu_rows.py) and
`python -m bench gpu-check` (bench/gpu_check.py), run here at toy sizes through Triton's
interpreter; cuDNN and PyTorch are absent, so XLA's attention stands in for cuDNN."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import gpu_check, gpu_rows, runner
from bench.report import FWD_BWD_FLOP_FACTOR


class FakeClock:
    """perf_counter advancing 1 ms per queued call and 5 ms per sync (a host round trip)."""

    def __init__(self):
        self.now, self.syncs, self.calls = 0.0, 0, 0

    def perf_counter(self) -> float:
        return self.now

    def fn(self, x):
        self.calls += 1
        self.now += 1e-3
        return x

    def sync(self, _):
        self.syncs += 1
        self.now += 5e-3


def test_back_to_back_syncs_once_per_repeat(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock.perf_counter)
    timing = runner.Timing(repeats=3, calls=10, warmup_repeats=0, warmup_s=0.0)
    times, result, calls = runner.back_to_back_seconds(clock.fn, (7,), clock.sync, timing)
    assert result == 7 and calls == 10
    # Warm-up (1 call, 1 sync), then 3 repeats of 10 calls and one sync each.
    assert clock.calls == 1 + 30 and clock.syncs == 1 + 3
    # Per call: 1 ms of work + 5 ms of sync shared by 10 calls, not 6 ms.
    assert times == pytest.approx((1.5e-3,) * 3)


def test_warm_up_repeats_run_and_are_not_kept(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock.perf_counter)
    slow_first = iter([9e-3] * 4)  # the compile call and 3 warm-up calls; the rest 1 ms

    def fn(x):
        clock.calls += 1
        clock.now += next(slow_first, 1e-3)
        return x

    timing = runner.Timing(repeats=2, calls=4, warmup_repeats=1, warmup_s=0.0)
    times, _, _ = runner.back_to_back_seconds(fn, (1,), clock.sync, timing)
    assert clock.calls == 1 + 3 * 4 and clock.syncs == 1 + 3
    assert len(times) == 2 and max(times) < 3e-3  # (4 ms + 5 ms sync) / 4 calls each


def test_warm_up_lasts_at_least_warmup_s(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock.perf_counter)
    timing = runner.Timing(repeats=2, calls=4, warmup_repeats=1, warmup_s=0.05)
    runner.back_to_back_seconds(clock.fn, (1,), clock.sync, timing)
    # A repeat is 4 calls and a sync: 9 ms; six of them pass 50 ms, then the two timed.
    assert clock.syncs == 1 + 6 + 2


def test_back_to_back_sizes_repeats_to_the_target(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock.perf_counter)
    timing = runner.Timing(repeats=2, target_s=0.06, max_calls=100)
    _, _, calls = runner.back_to_back_seconds(clock.fn, (1,), clock.sync, timing)
    assert calls == 10  # one synced call takes 6 ms: 10 fill 60 ms
    timing = runner.Timing(repeats=2, target_s=10.0, max_calls=50)
    assert runner.back_to_back_seconds(clock.fn, (1,), clock.sync, timing)[2] == 50


def test_fwd_bwd_returns_the_output_with_the_gradients():
    impl = runner.Impl("sq", lambda a, b: jnp.sin(a) * b, lambda h: ((), None), None)
    fn = runner._jax_callable(impl, num_diff=1, grad=True)
    a, b, d_out = (jnp.asarray(np.random.default_rng(i).standard_normal(5)) for i in range(3))
    out, (da,) = fn(a, b, d_out)
    np.testing.assert_allclose(out, np.sin(a) * b, rtol=1e-6)
    np.testing.assert_allclose(da, np.cos(a) * b * d_out, rtol=1e-6)


def _dense(spec: gpu_rows.MaskSpec) -> np.ndarray:
    """The pattern as a [T, T] boolean array, element by element."""
    doc = np.repeat(np.arange(len(spec.doc_lens)), spec.doc_lens)
    q, kv = np.arange(spec.tokens)[:, None], np.arange(spec.tokens)[None, :]
    allowed = doc[q] == doc[kv]
    if spec.causal:
        allowed &= q >= kv
    if spec.window is not None:
        allowed &= q - kv <= spec.window
    if spec.keep is not None:
        allowed &= spec.keep[q // spec.block, kv // spec.block]
    return allowed


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=5),
    st.booleans(),
    st.integers(0, 3),
)
def test_allowed_pairs_count_the_dense_pattern(doc_lens, causal, kind):
    spec = gpu_rows.MaskSpec(tuple(doc_lens), causal=causal)
    tokens = sum(doc_lens)
    if kind == 1:  # one causal document with a window
        spec = gpu_rows.MaskSpec((tokens,), window=doc_lens[0] % 7)
    elif kind == 2 and tokens >= 4:  # one document, random blocks of 4
        tokens -= tokens % 4
        keep = gpu_rows.random_blocks(tokens, 4, seed=tokens)
        spec = gpu_rows.MaskSpec((tokens,), causal=False, keep=keep, block=4)
    assert spec.allowed_pairs() == int(_dense(spec).sum())


def test_the_issue_rows_are_declared():
    sizes = gpu_rows.Sizes.gpu()
    assert sum(sizes.mixed_docs) == sizes.tokens == 16384
    keys = [case.key for case in gpu_rows.cases(sizes)]
    for key in (
        "16x1024 causal", "4x4096 causal", "1x16384 causal", "4x4096 not causal",
        "4x4096 causal GQA", "mixed 7000..484 causal", "1x16384 causal window 1024",
        "16384 tok causal",
        "16384 tok window 1024", "16384 tok 16 documents", "16384 tok random 50%",
        "m8192 G64", "m32768 G32", "4x4096 d256 causal",
    ):  # fmt: skip
        assert key in keys, key
    case = next(c for c in gpu_rows.cases(sizes) if c.key == "16x1024 causal")
    assert case.forward_flops == 4 * 128 * 16 * 16 * 1024 * 1025 / 2
    assert case.flops("fwd+bwd") == FWD_BWD_FLOP_FACTOR["attention"] * case.forward_flops
    assert case.anchors[0].name == "jax cudnn attention"
    # The window's forward moved to 128x128 by the static report: its A/B times the former.
    window = next(c for c in gpu_rows.cases(sizes) if c.key == "1x16384 causal window 1024")
    assert "ours triton varlen forward 128x64 3 stages" in [a.name for a in window.anchors]
    # Gemma's head_dim at 8 heads: the 4 x 4096 row's FLOPs, its d=256 tiles' A/B rows, last
    wide = next(c for c in gpu_rows.cases(sizes) if c.key == "4x4096 d256 causal")
    assert wide.shape == "4x4096 d256 causal h8 d256 bf16"
    assert wide.forward_flops == 4 * 256 * 8 * 4 * 4096 * 4097 / 2
    assert {"ours triton varlen forward 128x32", "ours triton varlen dq 64x32",
            "ours triton varlen dkdv 64x32 mma.sync", "ours triton varlen dkdv 16x64 key-major",
            "ours triton varlen dkdv 16x64 head-major 2 stages",
            } <= {a.name for a in wide.anchors}  # fmt: skip
    assert keys[-1] == wide.key
    matmul = next(c for c in gpu_rows.cases(sizes) if c.key == "m8192 G64")
    assert matmul.flops("fwd+bwd") == 3 * 2 * 8192 * 2048 * 1408
    assert [a.name for a in matmul.anchors][:2] == ["jax ragged_dot", "dense matmul (roofline)"]


def test_without_torch_the_torch_anchors_are_left_out(monkeypatch):
    monkeypatch.setattr(gpu_rows, "torch_available", lambda: False)
    names = {a.name for c in gpu_rows.cases(gpu_rows.Sizes.gpu()) for a in c.anchors}
    assert not any(name.startswith("torch") for name in names)
    monkeypatch.setattr(gpu_rows, "torch_available", lambda: True)
    names = {a.name for c in gpu_rows.cases(gpu_rows.Sizes.gpu()) for a in c.anchors}
    assert {"torch sdpa flash", "torch sdpa cudnn", "torch flex_attention"} <= names
    assert "torch _grouped_mm" in names


def _dry_run(path: Path, rows: list[str]) -> list[dict]:
    """The rows `gpu-check --dry-run` wrote to `path` for `rows`, without PyTorch's anchors
    wherever it runs (the GPU machine has torch); every row was timed and checked."""
    status = gpu_check.main(["--dry-run", "--no-torch", "--rows", *rows, "--json", str(path)])
    assert status == 0
    document = json.loads(path.read_text())
    assert {"commit", "torch", "jax_cuda_plugin"} <= document["machine"].keys()
    found = document["rows"]
    # The dense matmul, ours on it and the memory roof do other work than the row: no check.
    unchecked = {"dense matmul (roofline)", "ours triton, one group", "memory roof (XLA)"}
    for row in found:
        assert row["times"] and row["baseline_times"]
        assert row["ok"] is (None if row["baseline"] in unchecked else True)
    return found


def _passes_of(found: list[dict], anchors: tuple[tuple[str, str], ...]) -> None:
    # Each (part of an anchor's name, the pass its rows time): "forward" or "fwd+bwd".
    for kernel, label in anchors:
        rows = [r for r in found if kernel in r["baseline"]]
        assert rows and all(r["op"].endswith(label) for r in rows), kernel


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dry_run_checks_grouped_matmul_and_block_sparse_rows_against_their_anchors(
    tmp_path: Path, capsys
):
    path = tmp_path / "results" / "dry.json"
    # 64 tok 16 documents: the block-sparse row with the A/B anchors
    found = _dry_run(path, ["m64 G4", "64 tok random 50%", "64 tok 16 documents"])
    assert {r["shape"].split(" h")[0].split(" bf16")[0] for r in found} == {
        "m64 k32 n16 G4", "64 tok random 50%", "64 tok 16 documents",
    }  # fmt: skip
    # --dry-run adds the A/B anchors: on grouped matmul gmm with TMA, its launches
    # persistent (by pointers and by TMA), both with the launch's descriptors (the
    # persistent one forward and fwd+bwd), the weight gradient's tgmm persistent (fwd+bwd
    # only), warp-specialized at both candidate tiles, its groups being small at 64-row
    # tiles, every launch at megablox's tiling (the default before Hopper's), and the weight
    # gradient's tgmm with TMA and warp-specialized (fwd+bwd only); on the block-sparse
    # documents two CTAs per SM, FlexAttention's forward and dK/dV tiles, the dQ tile and
    # the forward and dK/dV with their softmax overlapped.
    assert {r["baseline"] for r in found} == {
        "jax xla attention", "jax ragged_dot", "dense matmul (roofline)", "ours triton tma",
        "ours triton 64x64x256 4 warps", "ours triton tiling 128x128x128",
        "ours triton, one group", "ours triton warp-specialized 128x64x256 2 stages",
        "ours triton warp-specialized 128x64x128 5 stages", "ours triton, tgmm tma",
        "ours triton, tgmm tma warp-specialized 64x128x256 2 stages", "memory roof (XLA)",
        "ours triton block-sparse 4 warps two CTAs",
        "ours triton block-sparse forward 128x64 3 stages", "ours triton block-sparse dq 128x128",
        "ours triton block-sparse forward overlapped softmax",
        "ours triton block-sparse dkdv 64x128 3 stages",
        "ours triton block-sparse dkdv overlapped softmax", "ours triton, gmm persistent",
        "ours triton, gmm persistent tma", "ours triton, tgmm persistent",
        "ours triton tma host descriptors", "ours triton, gmm persistent tma host descriptors",
    }  # fmt: skip
    _passes_of(found, (
        ("block-sparse forward 128x64", "forward"), ("block-sparse forward overlapped", "forward"),
        ("block-sparse dkdv", "fwd+bwd"), ("block-sparse dq 128x128", "fwd+bwd"),
        ("tgmm", "fwd+bwd"),
    ))  # fmt: skip
    persistent_rows = {r["op"].split()[-1] for r in found if "gmm persistent" in r["baseline"]}
    assert persistent_rows == {"forward", "fwd+bwd"}  # gmm's launches, tgmm at its default
    out = capsys.readouterr().out
    assert "dlhs" in out and "MISMATCH" not in out
    # The verdicts of the file just written: every A/B anchor has one.
    assert gpu_check.main(["--verdicts", str(path)]) == 0
    verdicts = capsys.readouterr().out
    assert "ours triton block-sparse dkdv 64x128 3 stages: " in verdicts
    no_torch = "grouped matmul >= 0.9x torch._grouped_mm: no row of this run has that anchor"
    assert no_torch in verdicts


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dry_run_checks_the_varlen_rows_against_their_anchors(tmp_path: Path, capsys):
    path = tmp_path / "results" / "dry.json"
    # 4x16 causal: also its GQA row; 16x4 causal: the first varlen row (short documents);
    # 32x2 causal: the many-document row; 4x16 d32 causal: the wide-head row (d=256's)
    found = _dry_run(path, ["16x4 causal", "4x16 causal", "32x2 causal", "4x16 d32 causal"])
    assert {r["shape"].split(" h")[0].split(" bf16")[0] for r in found} == {
        "16x4 causal", "4x16 causal", "4x16 causal GQA", "32x2 causal", "4x16 d32 causal",
    }  # fmt: skip
    # --dry-run adds the A/B anchors: on the first two rows three pipeline stages and
    # dK/dV at Flex's config (the forward at 128x128 three stages deep also on the row
    # without a right bound), dQ by atomics (and by bulk tensor reductions), the dK/dV
    # tile before TMA, the backward, the forward and dQ of two CTAs per SM (by pointers and
    # by descriptors), and the forward and dK/dV with their softmax overlapped, on the
    # many documents the persistent forward at its former tile (128x64) and of two CTAs
    # per SM, on the first two the warp-specialized forward and dK/dV (the forward also
    # without a bound) and each kernel with TMA by the programs' descriptors and by the
    # launch's; on the wide-head row the forward and dQ at their former d=256 tiles and
    # dK/dV key-major (its former tile, and by mma.sync) and head-major at two stages.
    assert {r["baseline"] for r in found} == {
        "jax xla attention", "ours triton varlen dkdv 32x128 by pointers",
        "ours triton varlen three stages", "ours triton varlen dkdv 64x128 3 stages",
        "ours triton varlen forward 128x128 3 stages",
        "ours triton varlen forward 64x128 4 warps 1 stage",
        "ours triton varlen dq 64x128 4 warps 1 stage",
        "ours triton varlen forward 64x128 4 warps 1 stage tma",
        "ours triton varlen dq 64x128 4 warps 1 stage tma",
        "ours triton varlen forward 128x64 3 stages",
        "ours triton varlen dq by atomics", "ours triton varlen dq by tma reduction",
        "ours triton varlen forward warp-specialized",
        "ours triton varlen dkdv warp-specialized",
        "ours triton varlen forward overlapped softmax",
        "ours triton varlen dkdv overlapped softmax",
        "ours triton varlen backward 64x64 4 warps", "ours triton varlen forward tma",
        "ours triton varlen forward tma host descriptors", "ours triton varlen dq tma",
        "ours triton varlen dq tma host descriptors", "ours triton varlen dkdv tma",
        "ours triton varlen dkdv tma host descriptors", "ours triton varlen forward 128x32",
        "ours triton varlen dq 64x32", "ours triton varlen dkdv 64x32 mma.sync",
        "ours triton varlen dkdv 16x64 key-major",
        "ours triton varlen dkdv 16x64 head-major 2 stages",
    }  # fmt: skip
    _passes_of(found, (
        ("forward tma", "forward"), ("forward overlapped", "forward"),
        ("dkdv overlapped", "fwd+bwd"), ("backward 64x64", "fwd+bwd"),
        ("dkdv 64x128 3 stages", "fwd+bwd"), ("forward 128x128 3 stages", "forward"),
        ("dq by tma reduction", "fwd+bwd"), ("dq tma", "fwd+bwd"), ("dkdv tma", "fwd+bwd"),
        ("forward 128x32", "forward"), ("dq 64x32", "fwd+bwd"), ("dkdv 64x32", "fwd+bwd"),
        ("dkdv 16x64", "fwd+bwd"),
        ("forward 64x128 4 warps", "forward"), ("dq 64x128 4 warps", "fwd+bwd"),
    ))  # fmt: skip
    out = capsys.readouterr().out
    assert "dq" in out and "MISMATCH" not in out
    assert gpu_check.main(["--verdicts", str(path)]) == 0
    assert "ours triton varlen dkdv 64x128 3 stages: " in capsys.readouterr().out


def test_ncu_summary_splits_our_kernels_from_the_rest():
    text = """==PROF== Disconnected from process 123
  attention_forward_kernel (128, 16, 1)x(128, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: Command line profiler metrics
    ----------------------- ----------- ------------ ------------ ------------
    Metric Name             Metric Unit      Minimum      Maximum      Average
    ----------------------- ----------- ------------ ------------ ------------
    gpu__time_duration.sum           us       700.10       760.00       730.50
  loop_convert_fusion (64, 1, 1)x(256, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: Command line profiler metrics
    gpu__time_duration.sum           ns     4,100.00     4,300.00     4,200.00
"""
    kernels = gpu_check.parse_ncu_summary(text)
    assert kernels == pytest.approx(
        {
            "attention_forward_kernel (128, 16, 1)": 730.5e-6,
            "loop_convert_fusion (64, 1, 1)": 4.2e-6,
        }
    )
    summary = gpu_check.summarise_ncu(kernels, gpu_check.our_kernel_names())
    assert "our kernels 730.5 us (99%), other kernels 4.2 us" in summary


def test_ncu_summary_reads_the_h100_machines_format():
    """Lines as the ncu of the H100 machine wrote them (2026-11-27): no Context or Stream,
    an invocation count; one kernel on two grids stays two entries."""
    text = """[1831] python3.12@127.0.0.1
  gmm_kernel (127, 11, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 4
    Section: Command line profiler metrics
    ---------------------- ----------- ------- ------- -------
    Metric Name            Metric Unit Minimum Maximum Average
    ---------------------- ----------- ------- ------- -------
    gpu__time_duration.sum          us  268.83  270.98  270.14
    ---------------------- ----------- ------- ------- -------

  gmm_kernel (127, 16, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 2
    gpu__time_duration.sum          us  257.86  259.04  258.45
  loop_clamp_fusion (1, 1, 1)x(127, 1, 1), Device 0, CC 9.0, Invocations 2
    gpu__time_duration.sum          us    2.94    3.30    2.99
  void cub::Sort<int, (bool)0>(int *, int) (4, 1, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 1
    gpu__time_duration.sum          us    5.00    5.00    5.00
"""
    kernels = gpu_check.parse_ncu_summary(text)
    assert kernels == pytest.approx(
        {
            "gmm_kernel (127, 11, 1)": 270.14e-6,
            "gmm_kernel (127, 16, 1)": 258.45e-6,
            "loop_clamp_fusion (1, 1, 1)": 2.99e-6,
            "void cub::Sort<int, (bool)0>(int *, int) (4, 1, 1)": 5e-6,
        }
    )
    summary = gpu_check.summarise_ncu(kernels, gpu_check.our_kernel_names())
    assert "our kernels 528.6 us (99%), other kernels 8.0 us" in summary


def test_our_kernel_names_are_the_triton_kernels():
    names = gpu_check.our_kernel_names()
    assert {"attention_forward_kernel", "block_sparse_forward_kernel"} <= names
    assert all(name.endswith("_kernel") for name in names)


def _toy_prepare(host):
    return (jnp.asarray(host["x"]),), jnp.ones(3)


def _unavailable(host):
    raise RuntimeError("refuses this shape")


def _toy_impl(name: str, prepare=_toy_prepare, *, checked: bool = True, **passes) -> runner.Impl:
    """x -> 2x on one array; `checked` False: other work (no check, as a roof); `passes`:
    `grad` / `forward` as `Impl` takes them."""
    canonical = (lambda r, g: gpu_rows._to_numpy(r)) if checked else None
    return runner.Impl(name, lambda a: 2.0 * a, prepare, canonical, **passes)


def _toy_case(key: str, ours=None, anchors=(), ab_part: bool = False) -> runner.Case:
    """A case of one random array; an A/B part's key names its row's shape, as `ab_apart`
    keeps it."""
    inputs = {"x": np.random.default_rng(0).standard_normal(3).astype(np.float32)}
    shape, ours = key.removesuffix(" (A/B)"), ours or _toy_impl("ours")
    return runner.Case("s", "op", key, shape, "matmul", 6.0, lambda: inputs, ours,
                       tuple(anchors), 0.1, 1, ab_part=ab_part)  # fmt: skip


def test_a_failing_case_is_a_failed_row_and_the_next_case_runs(capsys):
    broken = _toy_impl("ours", _unavailable)
    rows = runner.run_cases([_toy_case("a", broken), _toy_case("b")], runner.Timing(1, calls=1))
    assert [(r.shape, r.ok) for r in rows] == [("a", False), ("b", None), ("b", None)]
    assert rows[2].flops == 18.0  # fwd+bwd: 3x a matmul's forward
    assert "ours failed: RuntimeError: refuses this shape" in capsys.readouterr().out


def test_ab_anchors_run_after_every_rows_other_anchors(capsys):
    roof = _toy_impl("ours on one group", checked=False)  # other work: no A/B anchor
    found = [
        _toy_case("a", None, (_toy_impl("theirs"), _toy_impl("ours fwd only", grad=False), roof)),
        _toy_case("b", None, (_toy_impl("theirs"),)),
        _toy_case("c", None, (_toy_impl("ours bwd only", forward=False),)),
    ]
    assert gpu_rows.ab_apart(found, "with-row") == found
    after = gpu_rows.ab_apart(found, "after")
    assert [(c.key, [a.name for a in c.anchors]) for c in after] == [
        ("a", ["theirs", "ours on one group"]), ("b", ["theirs"]), ("c", []),
        ("a (A/B)", ["ours fwd only"]), ("c (A/B)", ["ours bwd only"]),
    ]  # fmt: skip
    assert gpu_rows.ab_apart(found, "only") == after[3:]
    with pytest.raises(ValueError, match="ab must be"):
        gpu_rows.ab_apart(found, "first")
    # An A/B part times ours only in the passes its anchors time: no row of ours alone.
    rows = runner.run_cases(after[3:], runner.Timing(1, calls=1))
    assert [(r.op, r.baseline) for r in rows] == [
        ("op forward", "ours fwd only"), ("op fwd+bwd", "ours bwd only"),
    ]  # fmt: skip
    assert all(r.ok for r in rows)
    # A whole row (not an A/B part) keeps its row of ours alone where no anchor ran.
    assert [r.baseline for r in runner.run_cases(after[2:3], runner.Timing(1, calls=1))] == [
        "", "",
    ]  # fmt: skip


def test_an_a_b_part_adds_no_row_of_ours_alone_and_follows_its_rows_failure(capsys):
    refusing = (_toy_impl("ours other", _unavailable),)
    broken = _toy_impl("ours", _unavailable)
    timing = runner.Timing(1, calls=1)
    # Its only anchor unavailable: the A/B part has nothing to set ours beside.
    assert runner.run_cases([_toy_case("a (A/B)", None, refusing, ab_part=True)], timing) == []
    # Ours failed in the row's first part: its A/B part is not compiled again.
    rows = runner.run_cases(
        [_toy_case("b", broken), _toy_case("b (A/B)", broken, refusing, ab_part=True)], timing
    )
    assert [(r.shape, r.ok) for r in rows] == [("b", False)]
    assert "op b (A/B anchors): skipped, ours failed above" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ab_only_runs_ours_beside_its_a_b_anchors_alone(tmp_path: Path, capsys):
    path = tmp_path / "ab.json"
    assert gpu_check.main(["--dry-run", "--rows", "m64", "--ab", "only", "--json", str(path)]) == 0
    found = json.loads(path.read_text())["rows"]
    assert found and all(row["baseline"].startswith("ours triton") for row in found)
    assert not any(row["baseline"] == "ours triton, one group" for row in found)  # a roof
    assert all(row["ok"] is True for row in found)
    assert "(A/B anchors)" in capsys.readouterr().out


def test_padded_anchor_gives_the_packed_documents_back():
    """The mixed-length row's cuDNN anchor pads the documents into a batch with
    `query_seq_lengths`; its result, gathered back, is the packed attention (here XLA's
    on both sides, against our XLA varlen path), gradients included."""
    from jax_bridge import varlen_attention

    spec = gpu_rows.MaskSpec((11, 5, 3))
    host = gpu_rows._attention_inputs(spec.tokens, 2, 1, 16, seed=3)()
    anchor = gpu_rows.jax_attention_impl(spec, "xla")
    case = gpu_rows.Case("s", "op", "k", "k", "attention", 1.0, lambda: host, anchor, (), 0.0, 3)
    _, result, _ = runner.measure(anchor, host, case, True, runner.Timing(1, calls=1))
    cu = jnp.asarray(spec.cu_seqlens())
    q, k, v, d_out = (jnp.asarray(host[n], jnp.bfloat16) for n in ("q", "k", "v", "d_out"))
    out, pullback = jax.vjp(
        lambda q, k, v: varlen_attention(q, k, v, cu, cu, causal=True, implementation="xla"),
        q, k, v,
    )  # fmt: skip
    expected = gpu_rows._to_numpy((out, pullback(d_out)))
    got_all = anchor.canonical(result, True)
    for name, got, want in zip("out dq dk dv".split(), got_all, expected, strict=True):
        assert got.shape == want.shape, name
        assert runner.relative_error(got, want) < gpu_rows.ATTENTION_TOLERANCE, name
