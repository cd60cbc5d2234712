"""`python -m bench gpu-check --compile-for TARGET`: the GPU rows compiled, not run, here.

A device call is short and rare; a row whose kernel fails to compile for the GPU (a Triton
lowering that refuses a config, shared memory over the CTA's limit, an option a backend
cannot take at that shape) costs it a crash and a rerun. This compiles, on a host without
the GPU, what `gpu-check` would run: every case at the GPU's sizes, ours and every A/B
anchor of ours (each flag's anchors on: `--tma`, `--warp-specialized`,
`--warp-specialized-dkdv`), each pass the runner times, through the runner's own jitted
callables and `jax_bridge.compile_for` (XLA with the real Triton compiler for `TARGET`; the
kernels' machine code, ptxas, is built at their first launch on the device). The other
anchors (cuDNN, XLA's matmuls, PyTorch) are not ours to check and are left out.

One line per (case, implementation, pass): our kernel launches in the program, its
`while` loops (each a host round trip a call on a GPU: `tests/aot/test_no_host_loops.py`),
XLA's temporary memory and the compile time; or the error. A kernel with device-side
tensor descriptors refused by a jaxlib that cannot pass their scratch (before
`kernel_needs.FIRST_JAXLIB_WITH_SCRATCH`) is unavailable here, not failed: the device's
jaxlib takes it. `make test-device-stack` runs this on the device's software (Triton 3.6,
jax 0.11.2); `make gpu-preflight` on whichever of the two venvs is there.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence

from bench.runner import Case, Impl, _jax_callable

_WHILE = re.compile(r"^\s*(?:ROOT )?%\S+ = .* while\(", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class CompiledRow:
    """What compiling one (case, implementation, pass) gave: `error` is None where it
    compiled."""

    case: str
    impl: str
    label: str
    seconds: float
    kernels: int = 0
    loops: int = 0
    temp_bytes: int = 0
    error: str | None = None
    unavailable: bool = False  # refused for this jaxlib's sake only (see the docstring)

    @property
    def failed(self) -> bool:
        return self.error is not None and not self.unavailable

    def line(self) -> str:
        head = f"  {self.label:8s} {self.impl:44s}"
        if self.error is not None:
            return f"{head} {'UNAVAILABLE' if self.unavailable else 'FAILED'} {self.error}"
        return (
            f"{head} {self.kernels} kernel launches, {self.loops} while loops, "
            f"temp {self.temp_bytes / 2**20:7.1f} MiB, {self.seconds:5.1f} s"
        )


def ours_to_compile(case: Case) -> list[Impl]:
    """Ours and the A/B anchors that are ours too (in JAX, named "ours ...")."""
    anchors = [a for a in case.anchors if a.framework == "jax" and a.name.startswith("ours")]
    return [case.ours, *anchors]


def _needs_newer_jaxlib(error: Exception) -> bool:
    """The launch layer's refusal of descriptors' scratch on a jaxlib without it."""
    from jax_bridge.launch import kernel_needs

    return (
        isinstance(error, NotImplementedError)
        and "global scratch" in str(error)
        and kernel_needs.jaxlib_version() < kernel_needs.FIRST_JAXLIB_WITH_SCRATCH
    )


def compile_impl(case: Case, impl: Impl, host, grad: bool, target: str) -> CompiledRow:
    """Compiles the runner's callable of `impl` (its forward, or forward + backward where
    `grad`) on the case's inputs for `target`."""
    from jax_bridge import compile_for

    label = "fwd+bwd" if grad else "forward"
    start = time.perf_counter()
    try:
        args, d_out = impl.prepare(host)
        call_args = (*args, d_out) if grad else tuple(args)
        program = compile_for(_jax_callable(impl, case.num_diff, grad), *call_args, target=target)
    except Exception as error:  # any failure is what this check exists to report
        first = str(error).strip().splitlines()[0][:240] if str(error).strip() else ""
        return CompiledRow(
            case.key, impl.name, label, time.perf_counter() - start,
            error=f"{type(error).__name__}: {first}", unavailable=_needs_newer_jaxlib(error),
        )  # fmt: skip
    return CompiledRow(
        case.key, impl.name, label, time.perf_counter() - start,
        kernels=len(program.report.kernels),
        loops=len(_WHILE.findall(program.as_text())),
        temp_bytes=program.report.temp_bytes,
    )  # fmt: skip


def compile_cases(cases: Sequence[Case], target: str) -> list[CompiledRow]:
    """`compile_impl` over every case, ours and our A/B anchors, each pass they time;
    prints a line as each compiles."""
    rows = []
    for case in cases:
        print(f"{case.op} {case.shape}:", flush=True)
        host = case.inputs()
        for impl in ours_to_compile(case):
            for grad in (False, True):
                if not (impl.grad if grad else impl.forward):
                    continue
                row = compile_impl(case, impl, host, grad, target)
                print(row.line(), flush=True)
                rows.append(row)
    return rows


def summary(rows: Sequence[CompiledRow], target: str) -> tuple[str, bool]:
    """(the closing lines, whether every row compiled, or is unavailable on this jaxlib
    only, without a host loop)."""
    failed = [r for r in rows if r.failed]
    unavailable = [r for r in rows if r.unavailable]
    looped = [r for r in rows if r.error is None and r.loops]
    compiled = len(rows) - len(failed) - len(unavailable)
    lines = [
        f"compiled for {target}: {compiled} of {len(rows)} programs"
        + (f"; {len(unavailable)} need a newer jaxlib (the scratch)" if unavailable else "")
        + (f"; {len(looped)} with while loops" if looped else "")
    ]
    lines += [f"  FAILED {r.case} / {r.impl} / {r.label}: {r.error}" for r in failed]
    lines += [f"  LOOPS  {r.case} / {r.impl} / {r.label}: {r.loops}" for r in looped]
    return "\n".join(lines), not failed and not looped
