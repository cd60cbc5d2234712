"""`python -m bench tune` (bench/tune.py): nothing to time without a GPU, and a dry run
that prunes candidates by the real static report (compiled offline for sm_90)."""

import pytest

import jax_bridge.tuning
from bench import tune
from jax_bridge.tuning.cache import CACHE_DIR_ENV
from jax_bridge.tuning.params import BwdParams, FwdParams
from tests.devices import cpu_only


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@cpu_only("without a GPU `bench tune` explains and stores nothing")
def test_without_a_gpu_it_explains_and_exits_0(capsys, cache_dir):
    assert tune.main([]) == 0
    out = capsys.readouterr().out
    assert "nothing to tune on cpu" in out and "--dry-run" in out
    assert not cache_dir.exists()  # nothing stored


def test_the_grouped_matmul_problem_is_the_catalogs():
    from triton_kernels import catalog

    assert (tune.GMM_PROBLEM, tune.GMM_GROUPS) == (catalog.GMM_PROBLEM, catalog.GMM_GROUPS)


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--arch", "75"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        tune.main(["--op", "softmax"])
    for head_dim, text in (("300", "must be in [16, 256], got 300"), ("x", "an integer")):
        with pytest.raises(SystemExit) as exit_info:
            tune.main(["--dry-run", "--op", "attention", "--head-dim", head_dim])
        assert exit_info.value.code == 2 and text in capsys.readouterr().err


def test_it_compiles_for_the_targets_bench_report_does():
    """Every compute capability the static report sizes (`SM_LIMITS`) is a dry run's
    target too, and none other: `bench report --arch 103` and `bench tune --arch 103`."""
    from bench import kernel_report
    from jax_bridge.launch.report import SM_LIMITS

    def arch_choices(parser):
        (action,) = [a for a in parser._actions if "--arch" in a.option_strings]
        return list(action.choices)

    targets = sorted(SM_LIMITS)
    assert arch_choices(tune._parser()) == arch_choices(kernel_report._parser()) == targets


def test_dry_run_prunes_by_the_static_report(capsys, monkeypatch, cache_dir):
    # Two candidates, compiled for real: the op's default, and a 256 x 128 x 256 tile with
    # four stages, (256 * 128 + 128 * 256) * 2 B = 128 KiB a stage: far over any GPU's
    # shared memory (or spilling first: either way pruned before anything is timed).
    huge = FwdParams(blocksize_m=256, blocksize_k=128, blocksize_n=256, num_warps=8, num_stages=4)
    real = jax_bridge.tuning.grouped_matmul_candidates

    def two(shape, **kwargs):
        return [real(shape, **kwargs)[0], huge]

    monkeypatch.setattr(jax_bridge.tuning, "grouped_matmul_candidates", two)
    assert tune.main(["--dry-run", "--op", "grouped_matmul", "--arch", "90"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if "grouped_matmul.fwd_bwd" in line)
    assert "sm_90): 2 candidates" in lines[start]
    default_at = next(i for i, line in enumerate(lines) if "[default]" in line)
    assert lines[default_at + 1].strip() == "keep"
    huge_at = next(i for i, line in enumerate(lines) if line.strip() == repr(huge))
    verdict = lines[huge_at + 1]
    assert "pruned:" in verdict and ("shared memory" in verdict or "spills" in verdict), verdict
    assert any("1 kept, 1 pruned" in line for line in lines)
    assert not cache_dir.exists()  # a dry run stores nothing


def test_tune_on_a_pretend_gpu_stores_the_winners(capsys, monkeypatch, cache_dir):
    # Only the platform checks are fooled: the kernels run in Triton's interpreter, at
    # toy sizes, one candidate per kernel (the default), and no NVIDIA compute capability
    # means no static report.
    import jax_bridge.tuning.autotune as autotune_module

    gpu = lambda device=None: "gpu"
    monkeypatch.setattr(jax_bridge.tuning, "get_device_platform", gpu)
    monkeypatch.setattr(autotune_module, "get_device_platform", gpu)
    for module in (jax_bridge.tuning, autotune_module):
        for name in ("attention_candidates", "grouped_matmul_candidates"):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, real=real, **k: real(*a, **k)[:1])
    monkeypatch.setattr(tune, "GMM_PROBLEM", (48, 32, 16))
    monkeypatch.setattr(tune, "GMM_GROUPS", 3)
    monkeypatch.setattr(tune, "ATTENTION_DOCS", 2)
    monkeypatch.setattr(tune, "ATTENTION_DOC_LEN", 24)
    monkeypatch.setattr(tune, "Q_HEADS", 2)
    monkeypatch.setattr(tune, "KV_HEADS", 1)
    assert tune.main(["--head-dim", "16", "--dtype", "float32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in (
        "grouped_matmul.fwd_bwd",
        "varlen_attention.forward",
        "varlen_attention.backward_dq",
    ):
        assert f"  {name}: " in out, out
    assert "config=AttentionConfigs(" in out
    # the default config is the only candidate here: the op needs no config= for it
    assert "grouped_matmul(...) as it is: the default wins" in out
    assert f"winners stored in {cache_dir / 'tuning.json'}" in out
    assert len(jax_bridge.tuning.TuningCache().entries()) == 4
    # Again: every winner comes from the cache.
    assert tune.main(["--head-dim", "16", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.count(", cached)") == 4


def _has_an_option(params) -> bool:
    return bool(getattr(params, "warp_specialize", None) or params.overlap_softmax)


def test_dry_run_compiles_the_kernels_options(capsys, monkeypatch):
    """The candidates of the options (overlapped softmax, warp specialization) compile
    offline for sm_90 and are listed, beside each kernel's default; those the kernels'
    config modules report spill-free are kept (gmm's 5-stage warp-specialized tile too,
    which as the op's one config reaches tgmm at the 3 stages its shared memory holds)."""
    from triton_kernels.flash_attention.config import (
        OVERLAPPED_DKDV_TILE,
        OVERLAPPED_FORWARD_TILE,
        WARP_SPECIALIZED_DKDV_TILE,
        WARP_SPECIALIZED_FORWARD_TILE,
        AttentionKernelConfig,
    )
    from triton_kernels.grouped_matmul.config import (
        HOPPER_WARP_SPECIALIZED_GMM,
        warp_specialized_gmm_config,
    )

    for name in ("attention_candidates", "grouped_matmul_candidates"):
        real = getattr(jax_bridge.tuning, name)
        only = lambda *a, real=real, **k: [c for i, c in enumerate(real(*a, **k))
                                           if i == 0 or _has_an_option(c)]  # fmt: skip
        monkeypatch.setattr(jax_bridge.tuning, name, only)
    assert tune.main(["--dry-run", "--arch", "90"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    verdicts = {line: lines[i + 1] for i, line in enumerate(lines) if "Params(" in line}
    assert len(verdicts) == 4 + 2 + 2 + 2  # 4 defaults; the forward's, dK/dV's, gmm's
    assert not [v for v in verdicts.values() if "static check failed" in v], verdicts
    wide, deep = (
        FwdParams.from_grouped_matmul_config(warp_specialized_gmm_config(*tune.GMM_PROBLEM, t))
        for t in HOPPER_WARP_SPECIALIZED_GMM
    )
    kept = [
        FwdParams.from_attention_config(
            AttentionKernelConfig(*OVERLAPPED_FORWARD_TILE, overlap_softmax=True)
        ),
        FwdParams.from_attention_config(
            AttentionKernelConfig(*WARP_SPECIALIZED_FORWARD_TILE, tma=True, warp_specialize=True)
        ),
        BwdParams.from_dkdv_config(
            AttentionKernelConfig(*OVERLAPPED_DKDV_TILE, overlap_softmax=True)
        ),
        BwdParams.from_dkdv_config(
            AttentionKernelConfig(*WARP_SPECIALIZED_DKDV_TILE, tma=True, warp_specialize=True)
        ),
        wide,
    ]
    assert [verdicts[repr(c)] for c in kept] == ["keep"] * 5, verdicts
    assert verdicts[repr(deep)] == "keep", verdicts


def test_the_report_compiles_each_kernel_as_the_op_launches_it():
    """One config reaches gmm and tgmm: the report fits its stages to the shared memory
    as jax_bridge.grouped_matmul's launch does, and the catalog's variant specializes
    tgmm where the launch does."""
    from jax_bridge.grouped_matmul.triton import _within_shared_memory
    from jax_bridge.launch.target import cuda_lowering
    from triton_kernels.catalog import grouped_matmul_variant
    from triton_kernels.grouped_matmul.config import (
        HOPPER_WARP_SPECIALIZED_GMM,
        HOPPER_WARP_SPECIALIZED_TGMM,
        warp_specialized_gmm_config,
    )

    wide, deep = (warp_specialized_gmm_config(*tune.GMM_PROBLEM, t)
                  for t in HOPPER_WARP_SPECIALIZED_GMM)  # fmt: skip
    assert tune.as_launched(wide, "gmm", 2, 90) == wide
    # At block_k 64, block_n 256 Triton cannot compile tgmm's consumers: unspecialized.
    variant = grouped_matmul_variant("tgmm_token_major", 90, config=wide)
    assert not variant.constexprs["WARP_SPECIALIZE"] and variant.name.endswith("_tma")
    assert tune.as_launched(deep, "tgmm_token_major", 2, 90).num_stages < deep.num_stages
    candidates = jax_bridge.tuning.grouped_matmul_candidates(
        tune.GMM_PROBLEM, dtype="bfloat16", compute_capability=90, descriptors=True
    )
    specialized = warp_specialized_gmm_config(*tune.GMM_PROBLEM, HOPPER_WARP_SPECIALIZED_TGMM)
    # Candidates set every field: the default they convert over does not matter.
    configs = [specialized] + [c.to_grouped_matmul_config(specialized) for c in candidates]
    with cuda_lowering(90):
        for config in configs:
            for name in ("gmm", "gmm_transposed", "tgmm_token_major"):
                launched = _within_shared_memory(config, 2, name.startswith("tgmm"))
                assert tune.as_launched(config, name, 2, 90) == launched, (config, name)
