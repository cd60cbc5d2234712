"""A static report on one Triton kernel and launch configuration, compiled offline.

Compiles for an NVIDIA target with no GPU present (Triton's compiler and its bundled
`ptxas`/`cuobjdump` need no driver) and reads off what decides a kernel's speed before
it ever runs: registers per thread, spills, shared memory, and whether the Hopper
warpgroup tensor-core instructions (`wgmma`, SASS `HGMMA`) were emitted.
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


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What the compiler made of one kernel at one configuration.

    Attributes:
      kernel: the kernel's name.
      compute_capability: the target, e.g. 80 (A100) or 90 (H100).
      num_warps, num_stages: the launch configuration compiled.
      registers: registers per thread.
      spill_store_bytes, spill_load_bytes: register spills to local memory, per thread.
      stack_bytes: the per-thread stack frame.
      shared_memory_bytes: shared memory each program requests at launch.
      uses_wgmma: Hopper warpgroup MMA (`wgmma` in PTX, `HGMMA` in SASS) is used.
      uses_mma: any tensor-core MMA is used (`HMMA` or `HGMMA` in SASS).
      sass_opcodes: how often each SASS opcode (without modifiers) appears.
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

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes + self.spill_load_bytes > 0

    def summary(self) -> str:
        return (
            f"{self.kernel} sm_{self.compute_capability} warps={self.num_warps} "
            f"stages={self.num_stages}: {self.registers} regs, "
            f"spills {self.spill_store_bytes}/{self.spill_load_bytes} B, "
            f"smem {self.shared_memory_bytes} B, wgmma={self.uses_wgmma}, mma={self.uses_mma}"
        )


def _ptxas_arch(compute_capability: int) -> str:
    # Triton targets the architecture-specific Hopper/Blackwell ISA ("a" suffix).
    suffix = "a" if compute_capability >= 90 else ""
    return f"sm_{compute_capability}{suffix}"


def _ptxas_statistics(ptx: str, compute_capability: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [
                get_ptxas(compute_capability).path,
                "-v",
                f"-arch={_ptxas_arch(compute_capability)}",
                ptx_path,
                "-o",
                os.path.join(tmp, "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    log = result.stdout + result.stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0
    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "stack_bytes": number(r"(\d+) bytes stack frame"),
    }


def _sass_opcodes(cubin: bytes) -> collections.Counter[str]:
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(80).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run(
            [cuobjdump, "-sass", path], capture_output=True, text=True, check=True
        ).stdout
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
) -> KernelReport:
    """Compiles `kernel` offline for `compute_capability` and reports on the result.

    Args:
      kernel: a `@triton.jit` function.
      signature: Triton type of every non-constexpr parameter, by name: pointers as
        "*fp16", "*bf16", "*fp32", "*i32", ...; scalars as "i32", "i64", "fp32".
      constexprs: values of the `tl.constexpr` parameters, by name.
      compute_capability: 80 (A100), 90 (H100), ...
      num_warps, num_stages: the launch configuration to compile.
    """
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
    with triton.knobs.cache.scope(), tempfile.TemporaryDirectory() as cache_dir:
        triton.knobs.cache.dir = cache_dir
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", compute_capability, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    statistics = _ptxas_statistics(compiled.asm["ptx"], compute_capability)
    opcodes = _sass_opcodes(compiled.asm["cubin"])
    return KernelReport(
        kernel=kernel.__name__,
        compute_capability=compute_capability,
        num_warps=num_warps,
        num_stages=num_stages,
        shared_memory_bytes=int(compiled.metadata.shared),
        uses_wgmma="wgmma" in compiled.asm["ptx"] or opcodes["HGMMA"] > 0,
        uses_mma=opcodes["HMMA"] + opcodes["HGMMA"] > 0,
        sass_opcodes=types.MappingProxyType(dict(opcodes)),
        **statistics,
    )
