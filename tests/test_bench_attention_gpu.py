"""The attention section's GPU table (bench/attention_gpu.py): the varlen cases of
bench/gpu_rows.py through bench/runner.py. The cases themselves run in
tests/test_bench_gpu_check.py; here, that the section hands them over whole."""

from bench import attention_gpu, gpu_rows, runner


def test_causal_flops_count_the_allowed_pairs():
    # Two causal documents of 3 tokens: 6 allowed pairs each.
    assert gpu_rows.MaskSpec((3, 3)).allowed_pairs() == 2 * 6
    assert gpu_rows.MaskSpec((3, 3), causal=False).allowed_pairs() == 2 * 9


def test_section_runs_every_varlen_case(monkeypatch):
    seen = []
    monkeypatch.setattr(attention_gpu, "run_cases", lambda cases, timing: seen.append(
        ([c.key for c in cases], timing)) or [])  # fmt: skip
    assert attention_gpu.main(gpu_rows.Sizes.tiny()) == []
    keys, timing = seen[0]
    assert keys == ["16x4 causal", "4x16 causal", "1x64 causal", "4x16 not causal",
                    "4x16 causal GQA", "32x2 causal", "mixed 28..4 causal",
                    "1x64 causal window 16", "4x16 d32 causal"]  # fmt: skip
    assert timing == runner.Timing()
