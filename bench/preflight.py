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

One line per (case, implementation, pass): our kernel launches in the program, its `while`
loops (each a host round trip a call on a GPU: `jax_bridge.aot.common.while_loops`), XLA's
temporary memory and the compile time; or the error. Then one line per distinct kernel
those programs launch, from the PTX jax-triton hands jaxlib, assembled here by ptxas
(`jax_bridge.launch.report.ptx_kernel_report`): its tile (from the constexprs the launch
built it with, which the PTX does not name), registers, spills (SPILL where its innermost
tensor-core loop pays them), shared memory, its loop's warp-instructions per MFLOP of the
tile's work (and its MMAs' repeats where above 1), and SERIAL where ptxas serialized its
warpgroup MMAs, which fails the check (the H100 runs of 2026-11-27 timed serialized dK/dV
and tgmm kernels that no catalog row had flagged in time). A kernel with device-side
tensor descriptors refused by a jaxlib that cannot pass their scratch (before
`kernel_needs.FIRST_JAXLIB_WITH_SCRATCH`) is unavailable here, not failed: the device's
jaxlib takes it. `make test-device-stack` runs this on the device's software (Triton 3.6,
jax 0.11.2); `make gpu-preflight` on whichever of the two venvs is there. Kernels are told
apart by their PTX: a warp-specialized kernel's PTX may differ between two compiles of one
config, and count twice. The ptxas is Triton's bundled one (`ptxas_version`); on the
device jaxlib assembles the PTX with its own, whose release decides there what is
serialized."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bench.runner import Case, Impl, _jax_callable

if TYPE_CHECKING:
    from jax_bridge.launch.report import KernelReport


@dataclasses.dataclass(frozen=True)
class CompiledRow:
    """What compiling one (case, implementation, pass) gave: `error` is None where it
    compiled."""

    case: str
    impl: str
    label: str
    seconds: float
    shape: str = ""  # the case's shape, as the device run's rows name it
    kernels: int = 0
    loops: int = 0
    temp_bytes: int = 0
    error: str | None = None
    unavailable: bool = False  # refused for this jaxlib's sake only (see the docstring)
    kernel_keys: tuple[str, ...] = ()  # `KernelBuilds` keys of the kernels it launches

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


@dataclasses.dataclass(frozen=True)
class BuiltKernel:
    """A Triton kernel as jax-triton hands it to jaxlib: `num_warps` the kernel's own (a
    warp-specialized one runs more than its launch asked for, `asked_warps`), and the
    constexprs it was compiled with (None where not recorded), which name its tile."""

    name: str
    num_warps: int
    shared_memory_bytes: int
    ptx: str
    compute_capability: int
    asked_warps: int | None = None
    constexprs: Mapping[str, Any] | None = None

    @property
    def loop_work(self) -> tuple[str, int] | None:
        """(its tile, the FLOPs an iteration of its loop owes the tile):
        `triton_kernels.catalog.launched_loop_work`; None without a loop or constexprs."""
        from triton_kernels.catalog import launched_loop_work

        return None if self.constexprs is None else launched_loop_work(self.name, self.constexprs)


class KernelBuilds:
    """The kernels jax-triton builds while it is `recording()`, by the hash of their PTX."""

    def __init__(self):
        self.kernels: dict[str, BuiltKernel] = {}
        self.order: list[str] = []  # keys in build order, repeats included

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Records every jaxlib `TritonKernel` built inside, with the launch's constexprs
        and warps, with an empty jax-triton kernel cache and the launch layer's cache of
        host-descriptor kernels passed by (a kernel built before would not be built, nor
        recorded, again)."""
        from jax._src.lib import gpu_triton
        from jax_triton import triton_lib

        from jax_bridge.launch import host_descriptors
        from jax_bridge.launch.kernel_needs import pass_kernel_needs

        pass_kernel_needs()  # its wrappers go first, so that restoring ours keeps them
        real = (gpu_triton.TritonKernel, triton_lib._COMPILED_KERNEL_CACHE,
                triton_lib.get_or_create_triton_kernel, host_descriptors._compiled)  # fmt: skip
        building: dict[str, Any] = {}  # the launch whose kernel is being built

        def build(*args, num_warps, metaparams, **kwargs):  # jax-triton's launches
            building.update(asked_warps=num_warps or 4, constexprs=dict(metaparams))
            try:
                return real[2](*args, num_warps=num_warps, metaparams=metaparams, **kwargs)
            finally:
                building.clear()

        def build_with_descriptors(kernel, types, constants, num_warps, *rest):
            building.update(asked_warps=num_warps, constexprs=dict(constants))
            try:
                return real[3].__wrapped__(kernel, types, constants, num_warps, *rest)
            finally:
                building.clear()

        def record(name, num_warps, num_ctas, shared, ptx, ttir, capability, *rest):
            key = hashlib.sha256(ptx if isinstance(ptx, bytes) else ptx.encode()).hexdigest()
            text = ptx.decode() if isinstance(ptx, bytes) else ptx
            self.kernels.setdefault(
                key, BuiltKernel(name, num_warps, shared, text, capability, **building)
            )
            self.order.append(key)
            return real[0](name, num_warps, num_ctas, shared, ptx, ttir, capability, *rest)

        gpu_triton.TritonKernel, triton_lib._COMPILED_KERNEL_CACHE = record, {}
        triton_lib.get_or_create_triton_kernel = build
        host_descriptors._compiled = build_with_descriptors
        try:
            yield
        finally:
            (gpu_triton.TritonKernel, triton_lib._COMPILED_KERNEL_CACHE,
             triton_lib.get_or_create_triton_kernel, host_descriptors._compiled) = real  # fmt: skip


def ours_to_compile(case: Case) -> list[Impl]:
    """Ours and the A/B anchors that are ours too (in JAX, named "ours ...")."""
    anchors = [a for a in case.anchors if a.framework == "jax" and a.name.startswith("ours")]
    return [case.ours, *anchors]


def _needs_newer_jaxlib(error: Exception) -> bool:
    """The launch layer's refusal of descriptors' scratch, or of host-side descriptors,
    on a jaxlib that cannot pass them."""
    from jax_bridge.launch import kernel_needs
    from jax_bridge.launch.host_descriptors import host_descriptors_launchable

    if not isinstance(error, NotImplementedError):
        return False
    if "host-side tensor descriptors" in str(error):
        return not host_descriptors_launchable()
    return (
        "global scratch" in str(error)
        and kernel_needs.jaxlib_version() < kernel_needs.FIRST_JAXLIB_WITH_SCRATCH
    )


def _reason(error: Exception) -> str:
    """One line of why: a Triton compile error's own message (its text starts with the
    source position and the offending lines), else the error's first line."""
    message = getattr(error, "error_message", None)  # triton CompilationError
    lines = str(message or error).strip().splitlines()
    return lines[0][:240] if lines else ""


def compile_impl(
    case: Case, impl: Impl, host, grad: bool, target: str, builds: KernelBuilds | None = None
) -> CompiledRow:
    """Compiles the runner's callable of `impl` (its forward, or forward + backward where
    `grad`) on the case's inputs for `target`, recording its kernels in `builds`."""
    from jax_bridge import compile_for
    from jax_bridge.aot.common import while_loops

    label = "fwd+bwd" if grad else "forward"
    builds = builds if builds is not None else KernelBuilds()
    first = len(builds.order)
    start = time.perf_counter()
    try:
        args, d_out = impl.prepare(host)
        call_args = (*args, d_out) if grad else tuple(args)
        with builds.recording():
            program = compile_for(
                _jax_callable(impl, case.num_diff, grad), *call_args, target=target
            )
    except Exception as error:  # any failure is what this check exists to report
        return CompiledRow(
            case.key, impl.name, label, time.perf_counter() - start, case.shape,
            error=f"{type(error).__name__}: {_reason(error)}",
            unavailable=_needs_newer_jaxlib(error),
        )  # fmt: skip
    keys = tuple(dict.fromkeys(builds.order[first:]))
    if program.report.kernels and not keys:  # jit's caches reused an earlier lowering
        return CompiledRow(
            case.key, impl.name, label, time.perf_counter() - start, case.shape,
            error="no kernel recorded: a lowering cached from an earlier compile of this impl",
        )  # fmt: skip
    return CompiledRow(
        case.key, impl.name, label, time.perf_counter() - start, case.shape,
        kernels=len(program.report.kernels),
        loops=len(while_loops(program.as_text())),
        temp_bytes=program.report.temp_bytes,
        kernel_keys=keys,
    )  # fmt: skip


def compile_cases(
    cases: Sequence[Case], target: str, builds: KernelBuilds | None = None
) -> list[CompiledRow]:
    """`compile_impl` over every case, ours and our A/B anchors, each pass they time,
    their kernels recorded in `builds`; prints a line as each compiles."""
    builds = builds if builds is not None else KernelBuilds()
    rows = []
    for case in cases:
        print(f"{case.op} {case.shape}:", flush=True)
        host = case.inputs()
        for impl in ours_to_compile(case):
            for grad in (False, True):
                if not (impl.grad if grad else impl.forward):
                    continue
                row = compile_impl(case, impl, host, grad, target, builds)
                print(row.line(), flush=True)
                rows.append(row)
    return rows


@dataclasses.dataclass(frozen=True)
class KernelCheck:
    """What ptxas made of one built kernel (`report`), or why it could not say (`error`),
    and the programs that launch it; `key`: its `KernelBuilds` key."""

    key: str
    kernel: BuiltKernel
    users: tuple[CompiledRow, ...]
    report: KernelReport | None = None
    error: str | None = None

    @property
    def serialized(self) -> bool:
        return self.report is not None and self.report.serialized_wgmma

    def line(self) -> str:
        k, n = self.kernel, len(self.users)
        used = (
            f"in {n} program{'s' if n > 1 else ''}, first {self.users[0].case} / "
            f"{self.users[0].impl}"
            if n
            else "in no program that compiled"
        )
        head = f"  {k.name:36s} {k.num_warps:2d} warps {k.shared_memory_bytes / 1024:6.1f} KiB"
        if self.error is not None:
            return f"{head} ptxas FAILED: {self.error}; {used}"
        r, work = self.report, k.loop_work
        per, repeats = r.instructions_per_mflop, r.mma_redundancy
        flags = [f for f, on in (("SERIAL", r.serialized_wgmma), ("SPILL", r.loop_spills)) if on]
        return (
            f"{head}{f' {work[0]:>10s}' if work else ''} {r.registers:3d} regs, spills "
            f"{r.spill_store_bytes}/{r.spill_load_bytes} B"
            + (f", {per:5.0f} per MFLOP" if per is not None else "")
            + (f" (MMAs x{repeats:.2f})" if repeats is not None and repeats > 1.005 else "")
            + (f" {' '.join(flags)}" if flags else "")
            + f" {used}"
        )


def check_kernels(
    builds: KernelBuilds, rows: Sequence[CompiledRow], ptxas: str | None = None
) -> list[KernelCheck]:
    """Every kernel in `builds` assembled by `ptxas` (a path; Triton's by default) and read
    (`ptx_kernel_report`), with the rows that launch it; prints a line as each is read."""
    from jax_bridge.launch.report import ptx_kernel_report, warps_in_loop

    checks = []
    for key, kernel in builds.kernels.items():
        users = tuple(r for r in rows if key in r.kernel_keys)
        asked, work = kernel.asked_warps, kernel.loop_work
        try:
            report = ptx_kernel_report(
                kernel.name, kernel.ptx, compute_capability=kernel.compute_capability,
                num_warps=kernel.num_warps, shared_memory_bytes=kernel.shared_memory_bytes,
                ptxas=ptxas, loop_warps=asked and warps_in_loop(kernel.num_warps, asked),
                loop_work_flops=work and work[1],
            )  # fmt: skip
            check = KernelCheck(key, kernel, users, report=report)
        except subprocess.CalledProcessError as error:  # ptxas refused the PTX
            lines = (error.stderr or "").strip().splitlines()
            check = KernelCheck(key, kernel, users, error=" / ".join(lines[:3])[:300])
        print(check.line(), flush=True)
        checks.append(check)
    return checks


def ptxas_version(ptxas: str | None = None) -> str:
    """The release line of `ptxas` (a path), by default Triton's bundled one, which reads
    the kernels here. On the device jaxlib assembles the PTX with its own, whose release
    may differ (and with it what ptxas serializes): `gpu-check --ptxas` takes another."""
    from triton.backends.nvidia.compiler import get_ptxas

    text = subprocess.run(
        [ptxas or get_ptxas(90).path, "--version"], capture_output=True, text=True, check=True
    ).stdout
    return next((line for line in text.splitlines() if "release" in line), text.strip())


def summary(
    rows: Sequence[CompiledRow], target: str, kernels: Sequence[KernelCheck] = ()
) -> tuple[str, bool]:
    """(the closing lines, whether every row compiled, or is unavailable on this jaxlib
    only, without a host loop, and every kernel assembled without serialized MMAs)."""
    failed = [r for r in rows if r.failed]
    unavailable = [r for r in rows if r.unavailable]
    looped = [r for r in rows if r.error is None and r.loops]
    compiled = len(rows) - len(failed) - len(unavailable)
    newer = f"; {len(unavailable)} need a newer jaxlib (scratch or host descriptors)"
    lines = [
        f"compiled for {target}: {compiled} of {len(rows)} programs"
        + (newer if unavailable else "")
        + (f"; {len(looped)} with while loops" if looped else "")
    ]
    lines += [f"  FAILED {r.case} / {r.impl} / {r.label}: {r.error}" for r in failed]
    lines += [f"  LOOPS  {r.case} / {r.impl} / {r.label}: {r.loops}" for r in looped]
    bad = [k for k in kernels if k.serialized or k.error is not None]
    if kernels:
        spilling = sum(k.report is not None and k.report.loop_spills for k in kernels)
        lines.append(
            f"{len(kernels)} distinct kernels: {len(bad)} serialized or refused by ptxas, "
            f"{spilling} spilling in their loop"
        )
    lines += [f"  {'SERIAL' if k.serialized else 'PTXAS'} {k.line().strip()}" for k in bad]
    return "\n".join(lines), not failed and not looped and not bad


def static_document(
    rows: Sequence[CompiledRow],
    checks: Sequence[KernelCheck],
    target: str,
    ptxas_release: str,
) -> dict:
    """The check as JSON data: every program (shape, pass, implementation, its kernels'
    keys, or its error) and every kernel ptxas read, by key, with the release of ptxas
    that read them (`ptxas_version`); `bench/verdicts.py` sets the kernels beside a device
    run's A/B rows (`gpu-check --verdicts FILE --static FILE`)."""
    kernels = {}
    for check in checks:
        r, work = check.report, check.kernel.loop_work
        kernels[check.key] = {
            "name": check.kernel.name,
            "num_warps": check.kernel.num_warps,
            "shared_memory_bytes": check.kernel.shared_memory_bytes,
            "tile": work and work[0],
            "error": check.error,
            **(
                {
                    "registers": r.registers,
                    "spill_store_bytes": r.spill_store_bytes,
                    "spill_load_bytes": r.spill_load_bytes,
                    "per_mflop": r.instructions_per_mflop,
                    "mma_redundancy": r.mma_redundancy,
                    "serialized": r.serialized_wgmma,
                    "loop_spills": r.loop_spills,
                }
                if r is not None
                else {}
            ),
        }
    programs = [
        {
            "case": r.case, "shape": r.shape, "pass": r.label, "impl": r.impl,
            "kernels": list(r.kernel_keys), "loops": r.loops, "error": r.error,
        }
        for r in rows
    ]  # fmt: skip
    return {
        "target": target, "ptxas": ptxas_release, "programs": programs,
        "kernels": kernels,
    }  # fmt: skip
