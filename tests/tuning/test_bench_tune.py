"""`python -m bench tune` (bench/tune.py): nothing to time without a GPU, and a dry run
that prunes candidates by the real static report (compiled offline for sm_90)."""

import pytest

import jax_bridge.tuning
from bench import tune
from jax_bridge.tuning.cache import CACHE_DIR_ENV
from jax_bridge.tuning.params import FwdParams


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


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
