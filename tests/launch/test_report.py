"""The static report's loop finder and occupancy, on kernels whose answer is known.

A K-loop of `tl.dot` over [BM, BK] x [BK, BN] tiles does exactly 2*BM*BN*BK tensor-core
FLOPs per iteration whatever the compiler does with it, so the loop the finder returns
must carry that many; a kernel without a loop has none. The finder's rules (innermost,
cheapest MMA loop, self-branches ignored) are checked on hand-written SASS listings.
"""

import warnings

import pytest
import triton
import triton.language as tl

from jax_bridge.launch.report import (
    KernelReport,
    ctas_per_sm,
    innermost_mma_loop,
    max_shared_memory_per_cta,
    ptxas_log_statistics,
    static_kernel_report,
)


@triton.jit
def _k_loop_kernel(
    a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):  # fmt: skip
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rk[:, None] * BN + rn[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BK
        b_ptrs += BK * BN
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc.to(c_ptr.dtype.element_ty))


def test_the_report_compiles_with_fused_multiply_adds_and_says_so(monkeypatch):
    """Fused multiply-adds on, as jax-triton compiles a launch, and stated: Triton 3.9
    warns a user whose environment leaves it to its default (3.10 changes it)."""
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = static_kernel_report(
            _k_loop_kernel, {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "K": "i32"},
            dict(BM=64, BN=64, BK=32), compute_capability=90,
        )  # fmt: skip
    assert report.uses_wgmma


@pytest.mark.parametrize("compute_capability", [80, 90])
@pytest.mark.parametrize("tiles, num_warps", [((128, 128, 64), 8), ((64, 64, 32), 4)])
def test_loop_finder_finds_the_k_loop(compute_capability, tiles, num_warps):
    bm, bn, bk = tiles
    report = static_kernel_report(
        _k_loop_kernel,
        {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "i32"},
        {"BM": bm, "BN": bn, "BK": bk},
        compute_capability=compute_capability,
        num_warps=num_warps,
        num_stages=3,
    )
    loop = report.inner_loop
    assert loop is not None
    assert loop.mma_flops == 2 * bm * bn * bk
    total = sum(report.sass_opcodes.values())
    assert 0 < loop.instructions < total
    assert report.instructions_per_mflop == pytest.approx(
        loop.instructions * num_warps / (2 * bm * bn * bk / 1e6)
    )
    assert report.ctas_per_sm >= 1 and not report.exceeds_shared_memory


def _listing(*lines: str) -> str:
    """A cuobjdump-style listing: one instruction per 16 bytes from address 0."""
    return "\n".join(f"        /*{16 * i:04x}*/   {line} ;" for i, line in enumerate(lines))


def test_finder_prefers_the_innermost_and_cheapest_mma_loop():
    sass = _listing(
        "MOV R1, R2",  # 0x00
        "HMMA.16816.F32.BF16 R4, R8, R12, R4",  # 0x10: outer loop start
        "FADD R1, R1, R2",  # 0x20: masked inner loop start
        "HMMA.16816.F32.BF16 R4, R8, R12, R4",
        "FMUL R1, R1, R2",
        "ISETP.GE.AND P0, PT, R1, R2, PT",
        "@!P0 BRA 0x20",  # 0x60: 5-instruction loop
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24",  # 0x70: unmasked loop start
        "IADD3 R1, R1, 0x1, RZ",
        "@P1 BRA 0x70",  # 0x90: 3-instruction loop
        "FADD R3, R3, R3",  # 0xa0: a loop without MMA
        "@P2 BRA 0xa0",
        "@P3 BRA 0x10",  # 0xc0: the outer loop holds both
        "BRA 0xd0",  # 0xd0: the trailing self-branch is no loop
    )
    loop = innermost_mma_loop(sass, num_warps=8)
    assert (loop.start, loop.end, loop.instructions) == (0x70, 0x90, 3)
    assert loop.mma_flops == 2 * 64 * 128 * 16 * 2  # one HGMMA per warpgroup, 2 of them
    only_hmma = innermost_mma_loop(sass.replace("HGMMA.64x128x16.F32.BF16", "NOP"), 4)
    assert (only_hmma.start, only_hmma.instructions) == (0x20, 5)
    assert only_hmma.mma_flops == 2 * 16 * 8 * 16 * 4  # one HMMA per warp
    assert innermost_mma_loop(_listing("HMMA.16816.F32 R4, R8, R12, R4", "EXIT"), 4) is None


def test_a_loop_is_its_head_to_its_last_back_edge():
    """Two back-edges to one head (a `continue`) make one loop, and a loop without MMAs
    inside an MMA loop (a wait) does not hide the MMA loop."""
    sass = _listing(
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24",  # 0x00: loop head
        "@P0 BRA 0x0",  # 0x10: early back-edge
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24",
        "SYNCS.PHASECHK.TRANS64 P1, [UR4], R2",  # 0x30: a wait loop inside
        "@!P1 BRA 0x30",
        "@P2 BRA 0x0",  # 0x50: last back-edge
        "EXIT",
    )
    loop = innermost_mma_loop(sass, num_warps=4)
    assert (loop.start, loop.end, loop.instructions) == (0x0, 0x50, 6)
    assert loop.mma_flops == 2 * (2 * 64 * 64 * 16)


@pytest.mark.parametrize(
    "args, expected",
    [
        ((90, 4, 64, 0), 8),  # registers: 65536 / (64 * 32 * 4)
        ((90, 8, 255, 0), 1),  # 256 registers a thread at 256 threads fill the SM
        ((90, 4, 32, 100 * 1024), 2),  # shared memory: 228 KiB / (100 + 1 KiB)
        ((90, 1, 16, 0), 32),  # the CTA limit
        ((80, 8, 128, 0), 2),
    ],
)
def test_ctas_per_sm(args, expected):
    assert ctas_per_sm(*args) == expected


def test_shared_memory_limit_per_cta():
    assert max_shared_memory_per_cta(90) == 227 * 1024
    assert max_shared_memory_per_cta(80) == 163 * 1024


def test_ptxas_log_statistics_read_spills_and_wgmma_serialization():
    """The counts and ptxas' C7515 notice (serialized warpgroup MMAs, which no
    instruction count shows), as ptxas 12.8 words them."""
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to non wgmma instructions defining accumulator registers of a wgmma \
between start and end of the pipeline stage in the function 'k'
ptxas info    : Used 255 registers, used 1 barriers"""
    stats = ptxas_log_statistics(log.replace("\\\n", ""))
    assert stats == dict(
        registers=255, spill_store_bytes=12, spill_load_bytes=20, stack_bytes=16,
        serialized_wgmma=True,
    )  # fmt: skip
    clean = ptxas_log_statistics(log.split("ptxas info    : (C7515)")[0])
    assert clean["serialized_wgmma"] is False


def test_exp2s_beside_an_mma_in_flight_are_those_between_an_hgmma_and_its_wait():
    """`InnerLoop.mufu_beside_mma`: the MUFUs issued after an HGMMA and before the
    WARPGROUP.DEPBAR that waits for it (the softmax overlap); those after the wait, or
    before the MMA is issued, run beside no MMA."""
    sass = _listing(
        "MUFU.EX2 R1, R2",  # 0x00: loop head, before any MMA
        "WARPGROUP.ARRIVE",
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
        "MUFU.EX2 R3, R4",  # beside the QK^T in flight
        "MUFU.EX2 R5, R6",  # beside it too
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "MUFU.EX2 R7, R8",  # after the wait
        "@!P0 BRA 0x0",
    )
    loop = innermost_mma_loop(sass, num_warps=4)
    assert (loop.mufu, loop.mufu_beside_mma) == (4, 2)


def test_cta_barriers_are_the_loops_bar_syncs_of_every_thread():
    """`InnerLoop.cta_barriers`: BAR.SYNC of the whole CTA in the loop body (which holds
    its warpgroups in step); a named barrier of some warps (a thread count as second
    operand: a warp-specialized partition's), an arrive, and a barrier outside the loop
    do not count."""
    sass = _listing(
        "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x00: outside the loop
        "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x10: loop head
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",
        "BAR.SYNC 0x1, 0x100",
        "BAR.ARV 0x2, 0x100",
        "BAR.SYNC 0x3",
        "@!P0 BRA 0x10",
    )
    loop = innermost_mma_loop(sass, num_warps=8)
    assert (loop.start, loop.cta_barriers) == (0x10, 2)


def test_loop_spills_are_counted_in_the_loop_only():
    """LDL / STL inside the innermost MMA loop count; those outside do not."""
    sass = """
        /*0000*/  STL [R1], R2 ;
        /*0010*/  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/  LDL R3, [R1+0x4] ;
        /*0030*/  @P0 BRA 0x10 ;
        /*0040*/  LDL R4, [R1+0x8] ;
    """
    loop = innermost_mma_loop(sass, num_warps=4)
    assert (loop.start, loop.end, loop.spill_instructions, loop.spill_stores) == (0x10, 0x30, 1, 0)


@pytest.mark.parametrize(
    "body, spills",
    [
        ("LDL R3, [R1+0x4] ;", False),  # one reload an iteration: tolerated
        ("LDL R3, [R1+0x4] ;\n/*0028*/ LDL R5, [R1+0x8] ;", True),
        ("STL [R1+0x4], R3 ;", True),  # any store
    ],
)
def test_loop_spills_tolerate_one_reload_and_no_store(body, spills):
    """`KernelReport.loop_spills`: more than `LOOP_RELOADS_TOLERATED` spill loads, or any
    spill store, in the innermost MMA loop."""
    sass = f"""
        /*0010*/  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/  {body}
        /*0030*/  @P0 BRA 0x10 ;
    """
    report = _hopper_report(sass, spill_store_bytes=4, spill_load_bytes=4, stack_bytes=8)
    assert report.loop_spills is spills


def _hopper_report(sass: str, **fields) -> KernelReport:
    """A report of an sm_90 kernel at 8 warps whose SASS is `sass`, other fields zero
    but where `fields` sets them."""
    base = dict(
        kernel="k", compute_capability=90, num_warps=8, num_stages=2, registers=255,
        spill_store_bytes=0, spill_load_bytes=0, stack_bytes=0, shared_memory_bytes=0,
        uses_wgmma=True, uses_mma=True, sass_opcodes={},
        inner_loop=innermost_mma_loop(sass, num_warps=8),
    )  # fmt: skip
    return KernelReport(**(base | fields))


def test_the_proxy_counts_the_tiles_work_not_repeated_mmas():
    """Given the work a loop iteration owes its tile (`loop_work_flops`), the report sets
    it against what the loop's MMAs execute (`mma_redundancy`) and prices instructions
    per MFLOP of that work: warps that compute the same product twice pay twice the
    instructions for it. Without it, the proxy is per executed MFLOP as before; a
    warp-specialized kernel's consumers (`loop_warps`) run the loop, not its producer."""
    sass = """
        /*0010*/  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/  FADD R3, R3, R4 ;
        /*0030*/  @P0 BRA 0x10 ;
    """
    executed = 2 * 64 * 128 * 16 * 2  # one HGMMA per warpgroup, two warpgroups
    unknown = _hopper_report(sass)
    assert unknown.mma_redundancy is None
    assert unknown.instructions_per_mflop == pytest.approx(3 * 8 / (executed / 1e6))
    once = _hopper_report(sass, loop_work_flops=executed)
    assert once.mma_redundancy == 1.0
    assert once.instructions_per_mflop == pytest.approx(unknown.instructions_per_mflop)
    twice = _hopper_report(sass, loop_work_flops=executed // 2)
    assert twice.mma_redundancy == 2.0
    assert twice.instructions_per_mflop == pytest.approx(2 * once.instructions_per_mflop)
    # 12 warps of which 8 run the loop: its HGMMAs are two warpgroups' work, not three
    consumers = _hopper_report(sass, num_warps=12, loop_warps=8, loop_work_flops=executed)
    assert consumers.mma_redundancy == 1.0
    assert consumers.instructions_per_mflop == pytest.approx(once.instructions_per_mflop)
