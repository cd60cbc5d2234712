"""A static report on one Triton kernel and launch configuration, compiled offline.

Compiles for an NVIDIA target with no GPU present (Triton's compiler and its bundled
`ptxas`/`cuobjdump` need no driver) and reads off what decides a kernel's speed before
it ever runs: registers per thread, spills, shared memory, CTAs per SM, whether the Hopper
warpgroup tensor-core instructions (`wgmma`, SASS `HGMMA`) were emitted, and the static
throughput proxy: warp-instructions of the innermost tensor-core loop per MFLOP of the
tensor-core work that loop does (`InnerLoop`), counted as the tile's work where the caller
states it (`KernelReport.mma_redundancy`: MMAs that repeat another warpgroup's products
are instructions, not work).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile
import types
from collections.abc import Mapping
from typing import Any

import triton
import triton.compiler
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from jax_bridge.launch.interpreter import no_interpreted_launch

# Per-SM limits by compute capability: (registers, shared memory bytes, resident warps,
# resident CTAs), from NVIDIA's occupancy tables. 1 KiB of each CTA's shared memory is
# reserved by the system on sm_80 and later. sm_103 (B300) has sm_100's SM, sm_121 (GB10)
# sm_120's: listed, so that the tuner sizes their pipelines by their own shared memory
# (`jax_bridge.tuning.heuristics.shared_memory_limit_for`) and not by the 99 KiB it
# assumes of a GPU it does not know.
SM_LIMITS = {
    80: (65536, 164 * 1024, 64, 32),
    86: (65536, 100 * 1024, 48, 16),
    87: (65536, 164 * 1024, 48, 16),
    89: (65536, 100 * 1024, 48, 24),
    90: (65536, 228 * 1024, 64, 32),
    100: (65536, 228 * 1024, 64, 32),
    103: (65536, 228 * 1024, 64, 32),
    120: (65536, 100 * 1024, 48, 32),
    121: (65536, 100 * 1024, 48, 32),
}
LOOP_RELOADS_TOLERATED = 1
"""Spill loads (and no store) an innermost loop may hold before `KernelReport.loop_spills`
says it spills (Triton 3.6's dK/dV loop at 64x128 reloads one loop-invariant register)."""
_RESERVED_SHARED_PER_CTA = 1024
_REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256


@dataclasses.dataclass(frozen=True)
class InnerLoop:
    """The innermost loop holding tensor-core instructions, read off the SASS.

    Attributes:
      start, end: byte addresses of its first instruction and of its backward branch.
      instructions: instructions per iteration, per warp (every warp runs the loop body).
      mma_flops: tensor-core FLOPs one iteration does for the whole CTA, from the shapes of
        its HGMMA (per warpgroup: 2*M*N*K) and HMMA (per warp: 2*M*N*K) instructions.
      spill_instructions: local-memory loads and stores (LDL, STL: spills) in the body.
      spill_stores: the stores (STL) among them.
      mufu: special-function instructions (MUFU: the softmax's exp2s) in the body.
      mufu_beside_mma: those issued while a warpgroup MMA is in flight (after an HGMMA,
        before the WARPGROUP.DEPBAR that waits for it): work the tensor cores overlap.
      cta_barriers: barriers of every thread of the CTA in the body (BAR.SYNC without a
        thread count; Triton's pipeline takes one before reading what its asynchronous
        copies wrote and before overwriting a stage). Each holds the CTA's warpgroups in
        step, so with two or more one's exp2s cannot run beside another's MMAs; a CTA of
        one warpgroup is held by none, and two of them on an SM run out of step.
    """

    start: int
    end: int
    instructions: int
    mma_flops: int
    spill_instructions: int = 0
    spill_stores: int = 0
    mufu: int = 0
    mufu_beside_mma: int = 0
    cta_barriers: int = 0

    def instructions_per_mflop(self, num_warps: int, work_flops: int | None = None) -> float:
        """Warp-instructions the loop's `num_warps` issue per MFLOP of tensor-core work, the
        work its tile owes (`work_flops`) or, where None, what its MMAs execute: lower is
        better (a config of the same algorithm with bigger tiles amortises its softmax and
        address arithmetic over more matmul work)."""
        flops = work_flops or self.mma_flops
        return self.instructions * num_warps / (flops / 1e6)


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)")
_HMMA_SHAPE = re.compile(r"HMMA\.(16)(8)(16|8|4)")
_TCGEN05_MMA = re.compile(r"UTC\w*MMA")
# `BAR.SYNC.DEFER_BLOCKING 0x0`: the whole CTA; a named barrier of some warps (a
# warp-specialized partition's) carries their thread count as a second operand.
_CTA_BARRIER = re.compile(r"BAR\.SYNC(?:\.DEFER_BLOCKING)?$")


def _mma_flops(opcode: str, num_warps: int) -> int:
    """Tensor-core FLOPs of one SASS instruction, executed by the whole CTA."""
    if match := _HGMMA_SHAPE.match(opcode):  # one per warpgroup of 4 warps
        m, n, k = map(int, match.groups())
        return 2 * m * n * k * max(1, num_warps // 4)
    if match := _HMMA_SHAPE.match(opcode):  # one per warp
        m, n, k = map(int, match.groups())
        return 2 * m * n * k * num_warps
    return 0


def innermost_mma_loop(sass: str, num_warps: int) -> InnerLoop | None:
    """The cheapest innermost loop of `sass` (cuobjdump output) that does tensor-core work.

    A loop is a branch target and the last backward branch to it (a loop may have several
    back-edges); innermost means it holds no other loop with MMAs (a loop of its own,
    e.g. a wait, inside it does not disqualify it). Kernels here keep a masked copy of
    their main loop for the tiles at the mask's edges; it does the same matmuls plus the
    mask, so the cheapest loop with MMAs is the unmasked one. None when no loop holds an
    MMA.
    """
    body = [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(sass)]
    ends: dict[int, int] = {}  # loop head -> its last back-edge
    for address, opcode, rest in body:
        target = _BRANCH_TARGET.search(rest) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:  # a self-branch is no loop
            head = int(target.group(1), 16)
            ends[head] = max(ends.get(head, address), address)
    found = []
    for lo, hi in ends.items():
        lines = [(op, rest) for address, op, rest in body if lo <= address <= hi]
        ops = [op for op, _ in lines]
        flops = sum(_mma_flops(op, num_warps) for op in ops)
        if flops:
            spilling = sum(op.split(".")[0] in ("LDL", "STL") for op in ops)
            stores = sum(op.split(".")[0] == "STL" for op in ops)
            mufu = sum(op.startswith("MUFU") for op in ops)
            barriers = sum(bool(_CTA_BARRIER.match(op)) and "," not in rest for op, rest in lines)
            beside = _mufu_beside_mma(ops)
            found.append(
                InnerLoop(lo, hi, len(ops), flops, spilling, stores, mufu, beside, barriers)
            )
    inner = [
        loop
        for loop in found
        if not any(
            loop.start <= other.start and other.end <= loop.end and other != loop for other in found
        )
    ]
    return min(inner, key=lambda loop: loop.instructions, default=None)


def _mufu_beside_mma(ops: list[str]) -> int:
    """MUFU instructions of a loop body issued while a warpgroup MMA is in flight: after
    an HGMMA and before the next WARPGROUP.DEPBAR (one pass in program order; an MMA
    left in flight at the back-edge is not followed around it)."""
    in_flight, beside = False, 0
    for op in ops:
        if op.startswith("HGMMA"):
            in_flight = True
        elif op.startswith("WARPGROUP.DEPBAR"):
            in_flight = False
        elif in_flight and op.startswith("MUFU"):
            beside += 1
    return beside


def ctas_per_sm(
    compute_capability: int, num_warps: int, registers: int, shared_memory_bytes: int
) -> int:
    """Resident CTAs per SM, the smallest of what registers, shared memory, warps and the
    CTA limit allow (sm_90's tables for an unknown capability)."""
    reg_limit, smem_limit, warp_limit, cta_limit = SM_LIMITS.get(compute_capability, SM_LIMITS[90])
    unit = _REGISTER_ALLOCATION_UNIT
    regs_per_warp = -(-max(registers, 1) * 32 // unit) * unit
    by_registers = reg_limit // (regs_per_warp * num_warps)
    by_shared = smem_limit // (shared_memory_bytes + _RESERVED_SHARED_PER_CTA)
    return max(0, min(by_registers, by_shared, warp_limit // num_warps, cta_limit))


def max_shared_memory_per_cta(compute_capability: int) -> int:
    """The opt-in shared-memory limit of one CTA (bytes)."""
    smem = SM_LIMITS.get(compute_capability, SM_LIMITS[90])[1]
    return smem - _RESERVED_SHARED_PER_CTA


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What the compiler made of one kernel at one configuration.

    Attributes:
      kernel: the kernel's name.
      compute_capability: the target, e.g. 80 (A100) or 90 (H100).
      num_warps, num_stages: the launch configuration compiled (num_warps: the kernel's own,
        more than asked where Triton warp-specialized a loop).
      registers: registers per thread.
      spill_store_bytes, spill_load_bytes: register spills to local memory, per thread.
      stack_bytes: the per-thread stack frame.
      shared_memory_bytes: shared memory each program requests at launch.
      uses_wgmma: Hopper warpgroup MMA (`wgmma` in PTX, `HGMMA` in SASS) is used.
      uses_mma: any tensor-core MMA is used (`HMMA` or `HGMMA` in SASS).
      sass_opcodes: how often each SASS opcode (without modifiers) appears.
      inner_loop: the innermost tensor-core loop (None without one), for the throughput
        proxy `instructions_per_mflop`.
      serialized_wgmma: ptxas serialized the kernel's warpgroup MMAs (its C7515 notice:
        each waits for the one before, no overlap with other work). The instruction
        counts cannot see it; on an H100 the dK/dV kernel it hit ran at two thirds of the
        dQ kernel's tensor throughput.
      loop_warps: the warps that run the inner loop (None: `num_warps`): a
        warp-specialized kernel's consumers, without the producer warpgroup.
      loop_work_flops: the tensor-core FLOPs one iteration of the loop owes its tile (2 x
        M x N x K for each product of the tile's shapes), where the caller knows them
        (`triton_kernels.catalog` does); None otherwise.
    """

    kernel: str
    compute_capability: int
    num_warps: int
    num_stages: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_memory_bytes: int
    uses_wgmma: bool
    uses_mma: bool
    sass_opcodes: Mapping[str, int]
    inner_loop: InnerLoop | None = None
    serialized_wgmma: bool = False
    loop_warps: int | None = None
    loop_work_flops: int | None = None

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes + self.spill_load_bytes > 0

    @property
    def loop_spills(self) -> bool:
        """Spills inside the innermost tensor-core loop, which every iteration pays (a
        spill elsewhere costs a program a few instructions once): any store, or more than
        `LOOP_RELOADS_TOLERATED` loads. A lone reload is a value kept in local memory
        across the loop and read once an iteration, from L1, by a loop of hundreds of
        instructions."""
        loop = self.inner_loop
        return loop is not None and (
            loop.spill_stores > 0 or loop.spill_instructions > LOOP_RELOADS_TOLERATED
        )

    @property
    def ctas_per_sm(self) -> int:
        return ctas_per_sm(
            self.compute_capability, self.num_warps, self.registers, self.shared_memory_bytes
        )

    @property
    def exceeds_shared_memory(self) -> bool:
        return self.shared_memory_bytes > max_shared_memory_per_cta(self.compute_capability)

    @property
    def mma_redundancy(self) -> float | None:
        """The inner loop's tensor-core FLOPs over the work its tile owes
        (`loop_work_flops`; None where unknown): 1.0 where every MMA computes its own
        part; above 1 where warps compute the same products, as Triton's layouts have
        them do, e.g., for products of fewer rows than the warps cover (16 a warp with
        mma.sync, 64 a warpgroup with wgmma: 128 at 8 warps). Hopper's dQ at 64x32,
        d=256, ran its QK^T and dO V^T in both warpgroups (5/3)."""
        if self.inner_loop is None or not self.loop_work_flops:
            return None
        return self.inner_loop.mma_flops / self.loop_work_flops

    @property
    def instructions_per_mflop(self) -> float | None:
        """Warp-instructions of the inner loop per MFLOP of the work its tile owes
        (`loop_work_flops`), or per MFLOP its MMAs execute where that is unknown (the
        same where `mma_redundancy` is 1)."""
        if self.inner_loop is None:
            return None
        warps = self.loop_warps or self.num_warps
        return self.inner_loop.instructions_per_mflop(warps, self.loop_work_flops)

    def summary(self) -> str:
        return (
            f"{self.kernel} sm_{self.compute_capability} warps={self.num_warps} "
            f"stages={self.num_stages}: {self.registers} regs, "
            f"spills {self.spill_store_bytes}/{self.spill_load_bytes} B, "
            f"smem {self.shared_memory_bytes} B, wgmma={self.uses_wgmma}, mma={self.uses_mma}"
            + (", wgmma serialized" if self.serialized_wgmma else "")
            + (", spills in the loop" if self.loop_spills else "")
        )


def _ptxas_arch(compute_capability: int) -> str:
    # Triton targets the architecture-specific Hopper/Blackwell ISA ("a" suffix).
    suffix = "a" if compute_capability >= 90 else ""
    return f"sm_{compute_capability}{suffix}"


def _ptxas(
    ptx: str, compute_capability: int, ptxas: str | None = None
) -> tuple[dict[str, Any], bytes]:
    """(`ptxas_log_statistics` of its log, the cubin) of `ptx` assembled by `ptxas` (a
    path; Triton's bundled one by default)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [
                ptxas or get_ptxas(compute_capability).path,
                "-v",
                f"-arch={_ptxas_arch(compute_capability)}",
                ptx_path,
                "-o",
                cubin_path,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        with open(cubin_path, "rb") as f:
            cubin = f.read()
    return ptxas_log_statistics(result.stdout + result.stderr), cubin


def ptxas_log_statistics(log: str) -> dict[str, Any]:
    """Registers, spills, stack and wgmma serialization, read off a `ptxas -v` log."""
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0
    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "stack_bytes": number(r"(\d+) bytes stack frame"),
        # "(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized"
        "serialized_wgmma": "wgmma.mma_async instructions are serialized" in log,
    }


def _sass(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(80).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run(
            [cuobjdump, "-sass", path], capture_output=True, text=True, check=True
        ).stdout


def _sass_opcodes(sass: str) -> collections.Counter[str]:
    # Instruction lines look like `/*0070*/  @!P0 HGMMA.64x128x16.F32 ... ;`.
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return collections.Counter(opcodes)


def static_kernel_report(
    kernel: triton.JITFunction,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    *,
    compute_capability: int = 90,
    num_warps: int = 4,
    num_stages: int = 2,
    loop_work_flops: int | None = None,
) -> KernelReport:
    """Compiles `kernel` offline for `compute_capability` and reports on the result.

    Args:
      kernel: a `@triton.jit` function.
      signature: Triton type of every non-constexpr parameter, by name: pointers as
        "*fp16", "*bf16", "*fp32", "*i32", ...; scalars as "i32", "i64", "fp32".
      constexprs: values of the `tl.constexpr` parameters, by name.
      compute_capability: 80 (A100), 90 (H100), ...
      num_warps, num_stages: the launch configuration to compile.
      loop_work_flops: the tensor-core FLOPs one iteration of the kernel's inner loop owes
        its tile (`KernelReport.loop_work_flops`), if known.
    """
    compiled = compile_offline(
        kernel, signature, constexprs, compute_capability=compute_capability,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    statistics, _ = _ptxas(compiled.asm["ptx"], compute_capability)
    warps = int(compiled.metadata.num_warps)
    return _kernel_report(
        kernel.__name__, compiled.asm["ptx"], compiled.asm["cubin"], statistics,
        compute_capability, warps, num_stages, int(compiled.metadata.shared),
        loop_warps=warps_in_loop(warps, num_warps), loop_work_flops=loop_work_flops,
    )  # fmt: skip


def warps_in_loop(compiled_warps: int, asked_warps: int) -> int:
    """The warps that run a kernel's inner loop. A warp-specialized loop adds warpgroups to
    the warps asked (4 -> 12 on Hopper: the kernel's own count): its consumers run the
    loop, while the producer warpgroup, the warps asked, copies."""
    return compiled_warps - asked_warps if compiled_warps > asked_warps else compiled_warps


def compile_offline(
    kernel: triton.JITFunction,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    *,
    compute_capability: int = 90,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Any:
    """`kernel` compiled by Triton for `compute_capability` on this host (no GPU needed):
    Triton's compiled kernel, whose `asm` holds each stage's code ("ttir", "ttgir",
    "ptx", "cubin"). Arguments as `static_kernel_report`'s."""
    full_signature = dict(signature)
    full_signature.update({name: "constexpr" for name in constexprs})
    missing = [n for n in kernel.arg_names if n not in full_signature]
    if missing:
        raise ValueError(
            f"signature: no type given for parameter(s) {missing} of {kernel.__name__}"
        )
    # jax_triton launches with every array 16-byte aligned (XLA buffers are) and tells
    # Triton so; without the same hint Triton cannot vectorise loads and the report would
    # describe a kernel (more registers, spills) that never runs.
    aligned_pointers = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if full_signature[name].startswith("*")
    }
    source = triton.compiler.ASTSource(kernel, full_signature, dict(constexprs), aligned_pointers)
    # Importing jax_triton empties TRITON_CACHE_DIR (it disables Triton's cache), which
    # `triton.compile` refuses: compile into a cache of our own instead.
    with (
        no_interpreted_launch(),
        triton.knobs.cache.scope(),
        tempfile.TemporaryDirectory() as cache_dir,
    ):
        triton.knobs.cache.dir = cache_dir
        # Fused multiply-adds on, as jax-triton compiles a launch (stated: Triton 3.9
        # warns when the default decides).
        return triton.compile(
            source,
            target=GPUTarget("cuda", compute_capability, 32),
            options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True},
        )


def ptx_kernel_report(
    kernel: str,
    ptx: str,
    *,
    compute_capability: int,
    num_warps: int,
    shared_memory_bytes: int,
    ptxas: str | None = None,
    loop_warps: int | None = None,
    loop_work_flops: int | None = None,
) -> KernelReport:
    """`static_kernel_report` of a kernel already lowered to PTX, as jax-triton hands it to
    jaxlib (which assembles it on the device): assembled here by `ptxas` (a path; Triton's
    bundled one by default: another release, such as the device's, may assemble the same
    PTX differently). `num_stages` is reported as 0: the PTX does not say; nor does it say
    the tile, so `loop_work_flops` (`KernelReport`) comes from whoever built the kernel,
    and where None the proxy is per MFLOP the loop's MMAs execute. `loop_warps`: see
    `KernelReport` (`warps_in_loop` counts them)."""
    statistics, cubin = _ptxas(ptx, compute_capability, ptxas)
    return _kernel_report(
        kernel, ptx, cubin, statistics, compute_capability, num_warps, 0, shared_memory_bytes,
        loop_warps=loop_warps, loop_work_flops=loop_work_flops,
    )  # fmt: skip


def _kernel_report(
    kernel: str, ptx: str, cubin: bytes, statistics: Mapping[str, Any], compute_capability: int,
    num_warps: int, num_stages: int, shared_memory_bytes: int, loop_warps: int | None = None,
    loop_work_flops: int | None = None,
) -> KernelReport:  # fmt: skip
    sass = _sass(cubin)
    opcodes = _sass_opcodes(sass)
    return KernelReport(
        kernel=kernel,
        compute_capability=compute_capability,
        num_warps=num_warps,
        num_stages=num_stages,
        shared_memory_bytes=shared_memory_bytes,
        uses_wgmma="wgmma" in ptx or opcodes["HGMMA"] > 0,
        # Blackwell's tcgen05 MMAs (UTCHMMA, ...) carry no shape in the opcode: they count
        # as tensor-core use, but no loop FLOPs (no throughput proxy on sm_100).
        uses_mma=any(op in ("HMMA", "HGMMA") or _TCGEN05_MMA.match(op) for op in opcodes),
        sass_opcodes=types.MappingProxyType(dict(opcodes)),
        inner_loop=innermost_mma_loop(sass, loop_warps or num_warps),
        loop_warps=loop_warps,
        loop_work_flops=loop_work_flops,
        **statistics,
    )


def variant_report(variant: Any, compute_capability: int) -> KernelReport:
    """`static_kernel_report` of a `triton_kernels.catalog.KernelVariant` (anything with
    its kernel, signature, constexprs, num_warps and num_stages; and its loop's work,
    `loop_work_flops`, where it has one)."""
    return static_kernel_report(
        variant.kernel,
        variant.signature,
        variant.constexprs,
        compute_capability=compute_capability,
        num_warps=variant.num_warps,
        num_stages=variant.num_stages,
        loop_work_flops=getattr(variant, "loop_work_flops", None),
    )
