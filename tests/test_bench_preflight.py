"""`python -m bench gpu-check --compile-for TARGET` (bench/preflight.py): the GPU rows
compiled for an H100 on this host, here at toy sizes."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import gpu_check, gpu_rows, preflight, runner
from jax_bridge.launch import kernel_needs
from jax_bridge.launch.host_descriptors import host_descriptors_launchable

_FLAGS = ("USE_TMA", "USE_WARP_SPECIALIZED", "USE_WARP_SPECIALIZED_DKDV", "USE_TORCH")


@pytest.fixture
def restored_flags(monkeypatch):
    """--compile-for turns every A/B flag on and PyTorch off: undone after the test."""
    for flag in _FLAGS:
        monkeypatch.setattr(gpu_rows, flag, getattr(gpu_rows, flag))


def _case(impl: runner.Impl, anchors: tuple[runner.Impl, ...] = ()) -> runner.Case:
    inputs = {"x": np.random.default_rng(0).standard_normal(8).astype(np.float32)}
    return runner.Case("s", "op", "key", "shape", "matmul", 1.0, lambda: inputs, impl, anchors,
                       0.1, 1)  # fmt: skip


def _impl(name: str, fn, framework: str = "jax", prepare=None) -> runner.Impl:
    prepare = prepare or (lambda host: ((jnp.asarray(host["x"]),), jnp.asarray(host["x"])))
    return runner.Impl(name, fn, prepare, None, framework=framework)


def test_ours_and_only_our_jax_anchors_are_compiled():
    ours = _impl("ours triton", jnp.sin)
    anchors = (
        _impl("jax cudnn attention", jnp.cos),
        _impl("ours triton tma", jnp.tanh),
        _impl("ours in torch", jnp.exp, framework="torch"),
    )
    assert [i.name for i in preflight.ours_to_compile(_case(ours, anchors))] == [
        "ours triton",
        "ours triton tma",
    ]


def test_each_pass_compiles_for_the_h100(capsys):
    """A jitted sin compiles for both passes: no kernel of ours, no loop, no error."""
    rows = preflight.compile_cases([_case(_impl("ours", jnp.sin))], "h100")
    assert [(r.label, r.error, r.loops, r.kernels) for r in rows] == [
        ("forward", None, 0, 0),
        ("fwd+bwd", None, 0, 0),
    ]
    text, ok = preflight.summary(rows, "h100")
    assert ok and text == "compiled for h100: 2 of 2 programs"
    assert "forward  ours" in capsys.readouterr().out


def test_a_failure_and_a_host_loop_fail_the_check():
    def refuse(host):
        raise ValueError("op: head_dim must be at most 256")

    def looped(x):  # a trip count read from the data: a while loop XLA keeps
        return jax.lax.while_loop(lambda c: c[1] < x[0] * 4, lambda c: (c[0] * 2, c[1] + 1),
                                  (x, 0.0))[0]  # fmt: skip

    broken = _case(_impl("ours broken", jnp.sin, prepare=refuse))
    loop = _case(_impl("ours looping", looped))
    rows = preflight.compile_cases([broken, loop], "h100")
    assert rows[0].error == "ValueError: op: head_dim must be at most 256"
    assert rows[2].error is None and rows[2].loops >= 1
    text, ok = preflight.summary(rows, "h100")
    assert not ok
    assert "FAILED key / ours broken / forward: ValueError: op: head_dim" in text
    assert "LOOPS  key / ours looping / forward" in text


@pytest.fixture(scope="module")
def first_varlen_row(tmp_path_factory):
    """`gpu-check --compile-for h100 --dry-run --json` of the first varlen row (toy sizes),
    once for the module: (exit status, printed lines, the JSON document, the names of the
    implementations it compiles), the A/B flags it turns on restored after."""
    flags = {flag: getattr(gpu_rows, flag) for flag in _FLAGS}
    path = tmp_path_factory.mktemp("preflight") / "static.json"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            argv = ["--compile-for", "h100", "--dry-run", "--rows", "16x4 causal"]
            status = gpu_check.main([*argv, "--json", str(path)])
        case = next(c for c in gpu_rows.cases(gpu_rows.Sizes.tiny()) if c.key == "16x4 causal")
        impls = preflight.ours_to_compile(case)
    finally:
        for flag, value in flags.items():
            setattr(gpu_rows, flag, value)
    return status, printed.getvalue().splitlines(), json.loads(path.read_text()), case, impls


def test_compile_for_compiles_a_varlen_row_with_its_anchors(first_varlen_row):
    """Ours and every A/B anchor of ours on the first varlen row (toy sizes), compiled by
    Triton for sm_90 through the bridge. A jaxlib without the descriptors' scratch refuses
    the tensor-descriptor anchors, one that cannot pass host-side descriptors those
    anchors, by name: unavailable here, not failed."""
    status, out, _, _, impls = first_varlen_row
    lines = [line for line in out if line.startswith("  forward") or
             line.startswith("  fwd+bwd")]  # fmt: skip
    expected = sum(impl.forward + impl.grad for impl in impls)  # each pass an impl times
    assert len(lines) == expected > 10
    assert status == 0 and not any(" FAILED" in line for line in lines), lines
    # On a jaxlib that cannot pass the descriptors' scratch the tensor-descriptor anchors
    # are refused by name, and said to be unavailable here (the device's jaxlib takes them).
    refused = [line for line in lines if " UNAVAILABLE " in line]
    scratch = [line for line in refused if "global scratch" in line]
    host = [line for line in refused if "host-side tensor descriptors" in line]
    assert len(scratch) + len(host) == len(refused)
    old_jaxlib = kernel_needs.jaxlib_version() < kernel_needs.FIRST_JAXLIB_WITH_SCRATCH
    assert bool(scratch) == old_jaxlib
    assert bool(host) == (not host_descriptors_launchable())
    compiled = [line for line in lines if " UNAVAILABLE " not in line]
    assert all(" 0 while loops" in line for line in compiled)
    # the forward: the schedule kernel and the forward kernel; fwd+bwd adds dQ and dK/dV
    assert all(" 2 kernel launches" in line for line in compiled if "  forward" in line)
    assert any("assembled by Triton's ptxas" in line and "release" in line for line in out)


@pytest.mark.parametrize("version, unavailable", [((0, 10, 2), True), ((0, 11, 2), False)])
def test_only_a_jaxlib_without_the_scratch_makes_a_refusal_unavailable(
    monkeypatch, version, unavailable
):
    monkeypatch.setattr(kernel_needs, "jaxlib_version", lambda: version)

    def refuse(host):
        raise NotImplementedError("Triton kernel 'k' needs 256 bytes of global scratch")

    rows = preflight.compile_cases([_case(_impl("ours tma", jnp.sin, prepare=refuse))], "h100")
    assert [(r.unavailable, r.failed) for r in rows] == [(unavailable, not unavailable)] * 2
    assert preflight.summary(rows, "h100")[1] == unavailable


def test_the_kernels_a_row_launches_are_recorded_and_read_by_ptxas(restored_flags):
    """The default varlen row (toy sizes) builds the schedule, forward, dQ and dK/dV
    kernels; each is assembled by ptxas and read, none serialized, and the recording
    leaves jaxlib's TritonKernel and jax-triton's kernel cache as they were."""
    from jax._src.lib import gpu_triton
    from jax_triton import triton_lib

    from jax_bridge.launch import host_descriptors

    kernel_needs.pass_kernel_needs()  # as any launch does first: the functions restored
    real = (gpu_triton.TritonKernel, triton_lib._COMPILED_KERNEL_CACHE,
            triton_lib.get_or_create_triton_kernel, host_descriptors._compiled)  # fmt: skip
    case = next(c for c in gpu_rows.cases(gpu_rows.Sizes.tiny()) if c.key == "16x4 causal")
    builds = preflight.KernelBuilds()
    rows = [preflight.compile_impl(case, case.ours, case.inputs(), True, "h100", builds)]
    assert all(a is b for a, b in zip(real, (
        gpu_triton.TritonKernel, triton_lib._COMPILED_KERNEL_CACHE,
        triton_lib.get_or_create_triton_kernel, host_descriptors._compiled,
    ), strict=True))  # fmt: skip
    names = {builds.kernels[key].name for key in rows[0].kernel_keys}
    assert names == {
        "attention_schedule_kernel", "attention_forward_kernel",
        "attention_backward_dq_kernel", "attention_backward_dkdv_kernel",
    }  # fmt: skip
    checks = preflight.check_kernels(builds, rows)
    assert len(checks) == len(builds.kernels) and all(c.users == tuple(rows) for c in checks)
    assert not any(c.serialized or c.error for c in checks)
    # another ptxas by path (here Triton's own, named): the same reading
    from triton.backends.nvidia.compiler import get_ptxas

    named = preflight.check_kernels(builds, rows, ptxas=get_ptxas(90).path)
    assert [c.report for c in named] == [c.report for c in checks]
    attention = [c for c in checks if "backward" in c.kernel.name or "forward" in c.kernel.name]
    assert all(c.report.uses_wgmma and c.report.inner_loop is not None for c in attention)
    assert preflight.summary(rows, "h100", checks)[1]
    # The launch's constexprs name each loop kernel's tile, so the proxy is per MFLOP of
    # the tile's work; these tiles compute each product once (the schedules: no loop).
    for check in checks:
        kernel, report = check.kernel, check.report
        assert kernel.asked_warps == kernel.num_warps == report.loop_warps
        if check in attention:
            c = kernel.constexprs
            assert kernel.loop_work[0] == f"{c['BLOCK_M']}x{c['BLOCK_N']}"
            assert report.loop_work_flops == kernel.loop_work[1] > 0
            assert report.mma_redundancy == 1.0 and f" {kernel.loop_work[0]} " in check.line()
        else:
            assert kernel.loop_work is None and report.mma_redundancy is None


@pytest.mark.skipif(
    not host_descriptors_launchable(), reason="host-side descriptors need jaxlib >= 0.11.2"
)
def test_a_warp_specialized_or_host_descriptor_kernel_is_priced_and_recorded_each_build():
    """A warp-specialized kernel's loop is its consumers' (12 warps run it, 4 asked), and
    a kernel with host-side descriptors, whose launch layer keeps its own cache, is
    recorded in each program that builds it."""
    from jax_bridge import compile_for, varlen_attention
    from triton_kernels.flash_attention.config import (
        WARP_SPECIALIZED_FORWARD_TILE,
        AttentionConfigs,
        AttentionKernelConfig,
    )

    cu = jnp.asarray([0, 100, 256], jnp.int32)
    q = jax.ShapeDtypeStruct((256, 2, 64), jnp.bfloat16)
    specialized = AttentionKernelConfig(*WARP_SPECIALIZED_FORWARD_TILE, tma=True,
                                        warp_specialize=True)  # fmt: skip
    host = AttentionKernelConfig(128, 64, 8, 2, tma=True, host_descriptors=True)
    builds = preflight.KernelBuilds()
    for config in (specialized, host, host):
        forward = AttentionConfigs(forward=config)
        with builds.recording():
            compile_for(lambda q, k, v, c=forward: varlen_attention(
                q, k, v, cu, cu, causal=True, implementation="triton", config=c,
            ), q, q, q, target="h100")  # fmt: skip
    forwards = [builds.kernels[k] for k in builds.order if "forward" in builds.kernels[k].name]
    assert len(forwards) == 3 and forwards[1] is forwards[2]  # the host one, twice
    assert [k.loop_work[0] for k in forwards] == ["128x128", "128x64", "128x64"]
    checks = {c.kernel.num_warps: c.report for c in preflight.check_kernels(builds, [])
              if "forward" in c.kernel.name}  # fmt: skip
    assert forwards[0].asked_warps == 4 and checks[12].loop_warps == 8
    assert checks[8].loop_warps == 8 and forwards[1].asked_warps == 8
    assert checks[12].mma_redundancy == checks[8].mma_redundancy == 1.0


def test_a_serialized_kernel_fails_the_check():
    """ptxas serializing a kernel's warpgroup MMAs (its C7515 notice) fails the check and
    names the kernel."""
    from jax_bridge.launch.report import KernelReport

    report = KernelReport("k", 90, 8, 2, 255, 0, 0, 0, 1024, True, True, {},
                          serialized_wgmma=True)  # fmt: skip
    kernel = preflight.BuiltKernel("attention_backward_dkdv_kernel", 8, 1024, "", 90)
    row = preflight.CompiledRow("4x4096 causal", "ours", "fwd+bwd", 1.0, kernel_keys=("a",))
    check = preflight.KernelCheck("a", kernel, (row,), report=report)
    text, ok = preflight.summary([row], "h100", [check])
    assert not ok and "SERIAL attention_backward_dkdv_kernel" in text and " SERIAL in " in text
    assert "first 4x4096 causal / ours" in text


def test_verdicts_set_the_changed_kernels_beside_each_ab_row(first_varlen_row):
    """`--compile-for --json` of a varlen row, then a device run's A/B rows on it (made up
    here): each row names the kernels its anchor launches differently from the default,
    anchor's | default's, and the kernels one has and the other has not."""
    from bench.report import BenchRow
    from bench.verdicts import format_ab

    _, _, static, case, impls = first_varlen_row
    assert static["target"] == "h100" and "commit" in static["machine"]
    assert "release" in static["ptxas"]
    compiled = {p["impl"] for p in static["programs"] if p["error"] is None}
    assert {p["impl"] for p in static["programs"]} == {i.name for i in impls}
    assert {"ours triton varlen dkdv 64x128 3 stages", "ours triton varlen dq by atomics"} <= (
        compiled
    )
    per = [k["per_mflop"] for k in static["kernels"].values() if "dkdv" in k["name"]]
    assert per and all(p is not None and p > 0 for p in per)

    def row(anchor: str) -> BenchRow:
        return BenchRow("attention", "varlen_attention fwd+bwd", case.shape, case.ours.name,
                        (1.0,), anchor, (0.9,), True)  # fmt: skip

    text = format_ab([row("ours triton varlen dkdv 64x128 3 stages"),
                      row("ours triton varlen dq by atomics")], static)  # fmt: skip
    lines = text.splitlines()
    deep = lines[lines.index("ours triton varlen dkdv 64x128 3 stages: faster") + 2]
    assert deep.strip().startswith("dkdv: ") and "/MFLOP" in deep and " | " in deep
    assert deep.count("64x128 ") == 2  # each side's tile (toy sizes: the default's too)
    loops = [k for k in static["kernels"].values()
             if k["name"].endswith(("forward_kernel", "dq_kernel", "dkdv_kernel"))]  # fmt: skip
    assert loops and all(k["tile"] and k["mma_redundancy"] for k in loops if not k["error"])
    assert "dq:" not in deep and "forward" not in deep  # only dK/dV changed
    atomic = lines[lines.index("ours triton varlen dq by atomics: faster") + 2]
    assert "+1 row_stats" in atomic and "-1 dq" in atomic and "dkdv: " in atomic


def test_a_lowering_jit_reused_is_not_a_program_without_kernels():
    """Compiling one implementation twice: the second lowering comes from jit's caches and
    builds no kernel, which is said, not read as a program with none."""
    case = next(c for c in gpu_rows.cases(gpu_rows.Sizes.tiny()) if c.key == "16x4 causal")
    builds, host = preflight.KernelBuilds(), case.inputs()
    first, again = (
        preflight.compile_impl(case, case.ours, host, False, "h100", builds) for _ in range(2)
    )
    assert first.error is None and len(first.kernel_keys) == 2
    assert again.failed and again.error.startswith("no kernel recorded")


def test_a_triton_compile_error_gives_its_own_message():
    class CompilationError(Exception):  # as triton.compiler.errors' own: source first
        error_message = "shape mismatch in tl.dot"

    error = CompilationError("at 45:8:\n    acc = tl.dot(a, b)\n        ^")
    assert preflight._reason(error) == "shape mismatch in tl.dot"
    assert preflight._reason(ValueError("op: bad head_dim\nmore")) == "op: bad head_dim"


def test_static_goes_with_verdicts_and_a_commit_mismatch_is_said(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--static", str(tmp_path / "s.json")])
    with pytest.raises(SystemExit):
        gpu_check.main(["--ptxas", "/usr/bin/ptxas"])  # goes with --compile-for
    run, static = tmp_path / "run.json", tmp_path / "static.json"
    run.write_text(json.dumps({"machine": {"commit": "aaa"}, "rows": []}))
    static.write_text(json.dumps({"machine": {"commit": "bbb"}, "programs": [], "kernels": {}}))
    assert gpu_check.main(["--verdicts", str(run), "--static", str(static)]) == 0
    assert "--static is of commit bbb, the run of aaa" in capsys.readouterr().out
