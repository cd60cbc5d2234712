"""The GPU path of grouped matmul, proven on a CPU.

Lowering for cuda runs jax_triton's real lowering, which compiles every Triton kernel to
a cubin for the given compute capability; the static reports read registers, spills
and the tensor-core instructions off the compiled kernels at the default tiling; float32's
default precision must compile the same kernel as `precision="highest"`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jax_bridge.grouped_matmul.api import grouped_matmul, transposed_grouped_matmul
from jax_bridge.launch.lowering import lower_for_cuda
from jax_bridge.launch.report import KernelReport, compile_offline, variant_report
from triton_kernels.catalog import (
    GMM_KERNELS,
    GMM_TMA_KERNELS,
    default_variants,
    gmm_tma_variant,
    grouped_matmul_variant,
    persistent_gmm_variant,
    tgmm_walk_variant,
)
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig
from triton_kernels.grouped_matmul.kernels import tgmm_kernel, tgmm_walk_kernel

SDS = jax.ShapeDtypeStruct
M, K, N, GROUPS = 8192, 2048, 1408, 64  # a Mixtral-like expert layer


def _kernel_calls(hlo: str) -> int:
    return hlo.count("@triton_kernel_call")


@pytest.mark.parametrize("compute_capability", [80, 90])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gmm_and_tgmm_lower_for_cuda(compute_capability, dtype):
    pytest.importorskip("jax_triton")

    def forward(lhs, rhs, sizes, tokens):
        out = grouped_matmul(lhs, rhs, sizes, implementation="triton")
        weights = transposed_grouped_matmul(lhs.T, tokens, sizes, implementation="triton")
        return out, weights

    hlo = lower_for_cuda(
        forward,
        SDS((512, 256), dtype),
        SDS((8, 256, 384), dtype),
        SDS((8,), jnp.int32),
        SDS((512, 384), dtype),
        compute_capability=compute_capability,
    )
    # Each with its metadata kernel (XLA merges equal ones when it compiles the module).
    assert _kernel_calls(hlo) == 4


@pytest.mark.parametrize("compute_capability", [80, 90])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_gradient_lowers_to_three_matmul_kernels(compute_capability, transpose_rhs):
    """Forward gmm, then d_lhs (gmm) and d_rhs (tgmm) in the backward pass; with an
    expert-parallel offset and accumulation into an existing output."""
    pytest.importorskip("jax_triton")

    def loss(lhs, rhs, existing, sizes, offset):
        out = grouped_matmul(
            lhs,
            rhs,
            sizes,
            group_offset=offset,
            existing_out=existing,
            transpose_rhs=transpose_rhs,
            implementation="triton",
        )
        return jnp.sum(out * out)

    rhs_shape = (4, 384, 256) if transpose_rhs else (4, 256, 384)
    hlo = lower_for_cuda(
        jax.grad(loss, argnums=(0, 1, 2)),
        SDS((512, 256), jnp.bfloat16),
        SDS(rhs_shape, jnp.bfloat16),
        SDS((512, 384), jnp.float32),
        SDS((16,), jnp.int32),
        SDS((), jnp.int32),
        compute_capability=compute_capability,
    )
    assert _kernel_calls(hlo) == 6  # three matmuls, each with its metadata kernel


@functools.cache
def _report(variant: str, compute_capability: int, problem=(M, K, N)) -> KernelReport:
    """The kernel at `grouped_matmul`'s default tiling for `problem` (bf16)."""
    return variant_report(
        grouped_matmul_variant(variant, compute_capability, problem=problem), compute_capability
    )


@pytest.mark.parametrize("variant", GMM_KERNELS)
@pytest.mark.parametrize("compute_capability", [80, 86, 90])
def test_default_tiling_compiles_without_spills_on_tensor_cores(variant, compute_capability):
    report = _report(variant, compute_capability)
    assert not report.spills, report.summary()
    assert report.uses_mma, report.summary()
    # Hopper must use its warpgroup MMA (HGMMA); Ampere has only HMMA.
    assert report.uses_wgmma == (compute_capability >= 90), report.summary()


def _copies_in_flight(variant, compute_capability: int) -> set[int]:
    """The copies each `async_wait` of the compiled kernel leaves in flight (TTGIR)."""
    compiled = compile_offline(
        variant.kernel, variant.signature, variant.constexprs,
        compute_capability=compute_capability, num_warps=variant.num_warps,
        num_stages=variant.num_stages,
    )  # fmt: skip
    return {int(n) for n in re.findall(r"async_wait[^\n]*num = (\d+)", compiled.asm["ttgir"])}


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("variant", GMM_KERNELS)
@pytest.mark.parametrize("compute_capability", [80, 86, 90])
def test_default_tiling_keeps_copies_in_flight(variant, compute_capability, dtype_name):
    """Every default launch without wgmma pipelines its loads: its loop waits with copies
    still in flight (at two stages an mma.sync GPU awaits each copy before its MMAs; the
    defaults take three there, halving the reduction step on sm_86 to fit), float32's FMA
    dots too, which no longer spill (at a 64-element reduction step they spilled 7-20 KiB
    a thread). A wgmma loop (Hopper, 16 bits) keeps a buffer a stage and runs its MMAs
    asynchronously, so a copy issued after a wait still overlaps them: its waits do not
    say (at 2 stages they leave none in flight), and only its spills are checked."""
    kernel = grouped_matmul_variant(variant, compute_capability, dtype_name, problem=(M, K, N))
    if compute_capability < 90 or dtype_name == "float32":
        assert max(_copies_in_flight(kernel, compute_capability)) >= 1, kernel.description
    report = variant_report(kernel, compute_capability)
    assert not report.spills, report.summary()


@pytest.mark.parametrize("compute_capability", [80, 90])
def test_weight_gradient_over_long_groups_at_its_default(compute_capability):
    """tgmm over a token-major lhs of 512 rows a group (m 32768 over the catalog's 64
    groups): on sm_90 the [128, 256] output tile at 8 warps (two warpgroups), with no
    spill and wgmma that ptxas does not serialize (at 128 x 128 and 8 warps, Triton 3.6's
    code is serialized); elsewhere the default tile, spill-free on tensor cores."""
    variant = grouped_matmul_variant("tgmm_token_major", compute_capability,
                                     problem=(32768, 4096, 2048))  # fmt: skip
    report = variant_report(variant, compute_capability)
    print(report.summary())
    assert not report.spills and report.uses_mma, report.summary()
    if compute_capability == 90:
        tiles = tuple(variant.constexprs[f"BLOCK_{a}"] for a in "MKN")
        assert (tiles, variant.num_warps) == ((128, 128, 256), 8)
        assert report.uses_wgmma and not report.serialized_wgmma, report.summary()


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_persistent_gmm_compiles_for_an_h100(tma):
    """gmm persistent at Hopper's default tile, by pointers and through descriptors (the
    weights' 3-D): no spill, wgmma not serialized, the same pipeline's shared memory as
    a program a tile, and with `tma` the bulk tensor copies in the loop."""
    report = variant_report(persistent_gmm_variant(90, tma), 90)
    default = variant_report(grouped_matmul_variant("gmm", 90), 90)
    print(report.summary(), report.instructions_per_mflop)
    assert not report.spills and report.uses_wgmma and not report.serialized_wgmma
    assert report.shared_memory_bytes - default.shared_memory_bytes in range(0, 1024)
    assert (report.sass_opcodes.get("UTMALDG", 0) > 0) == tma, report.summary()


@pytest.mark.parametrize("persistent", [False, True], ids=["a_program_a_tile", "persistent"])
def test_gmm_with_host_descriptors_builds_none_on_the_device(persistent):
    """gmm with the launch's descriptors (`host_descriptors`) at Hopper's default tile:
    the same bulk tensor copies and pipeline as with descriptors each program builds, but
    no descriptor-building (`tensormap`) instruction in its PTX, no prefetch or flush of a
    descriptor in global memory (UTMACCTL, UTMACMDFLUSH) and no global scratch; no spill,
    wgmma not serialized."""
    make = functools.partial(persistent_gmm_variant, 90, True) if persistent else (
        functools.partial(gmm_tma_variant, "gmm", 90))  # fmt: skip
    built, given = (variant_report(make(host=host), 90) for host in (False, True))
    print(given.summary(), given.instructions_per_mflop)
    assert not given.spills and given.uses_wgmma and not given.serialized_wgmma
    assert given.sass_opcodes.get("UTMALDG") == built.sass_opcodes.get("UTMALDG") > 0
    assert given.shared_memory_bytes == built.shared_memory_bytes
    for building in ("UTMACCTL", "UTMACMDFLUSH"):
        assert building in built.sass_opcodes and building not in given.sass_opcodes
    variant = make(host=True)
    compiled = compile_offline(variant.kernel, variant.signature, variant.constexprs,
                               compute_capability=90, num_warps=variant.num_warps,
                               num_stages=variant.num_stages)  # fmt: skip
    assert "tensormap" not in compiled.asm["ptx"] and compiled.metadata.global_scratch_size == 0


def test_a_persistent_config_reaches_the_kernel_the_op_launches():
    """The catalog (and so `bench tune`'s static pruning) compiles, for a persistent
    config, the kernel the op launches with it: the walk for the weight gradient by
    pointers, tgmm a program a tile through descriptors or over a [k, m] lhs, gmm with
    PERSISTENT."""
    config = GroupedMatmulConfig(64, 128, 128, persistent=True)
    launched = {
        name: grouped_matmul_variant(name, 90, config=config)
        for name in ("gmm", "tgmm_token_major", "tgmm")
    }
    assert launched["gmm"].constexprs["PERSISTENT"] is True
    assert launched["tgmm_token_major"].kernel is tgmm_walk_kernel
    assert launched["tgmm"].kernel is tgmm_kernel
    tma = dataclasses.replace(config, tma=True)
    assert grouped_matmul_variant("tgmm_token_major", 90, config=tma).kernel is tgmm_kernel


@pytest.mark.parametrize("problem", [(8192, 2048, 1408), (32768, 4096, 2048)])
def test_the_weight_gradients_walk_compiles_for_an_h100(problem):
    """`tgmm_walk_kernel` at the token-major tgmm's Hopper tiles (64 x 128 x 128 and 128 x
    128 x 256): no spill, wgmma not serialized (the accumulator zeroed at a branch's end
    becomes the MMA's use-accumulator flag, no select into it), and its output tile's
    pass through shared memory beside the pipeline's within an H100's 227 KiB; its loop
    holds the group's store, so per MFLOP it runs more than the kernel a group (bench
    report: 1112 / 734 against 341 / 308 under 3.9)."""
    report = variant_report(tgmm_walk_variant(90, problem), 90)
    print(report.summary(), report.instructions_per_mflop)
    assert not report.spills and report.uses_wgmma and not report.serialized_wgmma
    assert report.sass_opcodes.get("FSEL", 0) == 0, report.summary()
    assert not report.exceeds_shared_memory, report.summary()


# Under Triton 3.6 / 3.9 (sm_90), instructions per MFLOP with even K and N against
# uneven: gmm 223 / 229 against 271 / 277 (128x64x256), with transposed rhs and
# existing_out 252 / 278 against 275 / 309, tgmm over token-major lhs (64-row steps: 64
# groups) 319 / 341 against 378 / 399 (at 128-row steps 287 / 340 against 336 / 360),
# tgmm 706 / 727 against 875 / 896.
_EVEN_RATIOS = {"gmm": 0.95, "gmm_transposed_accumulate": 0.95, "tgmm_token_major": 0.95,
                "tgmm": 0.95}  # fmt: skip


@pytest.mark.parametrize("variant, ratio", _EVEN_RATIOS.items(), ids=_EVEN_RATIOS.keys())
def test_even_k_drops_the_k_masks_from_the_loop(variant, ratio):
    """K (N) a multiple of its tile compiles the loop without k (column) masks: fewer
    instructions per MFLOP than the same tiles on a K and N that are not."""
    even = _report(variant, 90)
    uneven = _report(variant, 90, (M, K - 48, N - 8))
    assert even.inner_loop.mma_flops == uneven.inner_loop.mma_flops
    assert even.instructions_per_mflop < ratio * uneven.instructions_per_mflop


def test_default_precision_compiles_exact_float32_products():
    """float32: the default precision lowers to the very kernel call (the compiled kernel
    rides in it) of precision="highest" (exact "ieee" products), not to that of
    Precision.DEFAULT (TF32)."""
    pytest.importorskip("jax_triton")

    def kernel_calls(**precision):
        module = lower_for_cuda(
            lambda lhs, rhs, sizes: grouped_matmul(
                lhs, rhs, sizes, implementation="triton", **precision
            ),
            SDS((256, 128), jnp.float32),
            SDS((4, 128, 128), jnp.float32),
            SDS((4,), jnp.int32),
            compute_capability=90,
        )
        return [line for line in module.splitlines() if "@triton_kernel_call" in line]

    default = kernel_calls()
    assert len(default) == 2  # the metadata kernel, gmm
    assert default == kernel_calls(precision="highest")
    assert default != kernel_calls(precision=jax.lax.Precision.DEFAULT)


def test_tma_gmm_lowers_for_an_h100_with_its_global_scratch(monkeypatch):
    """A config with `tma`: every launch of forward + backward carries the scratch of its
    two descriptors (128 bytes each) to jaxlib: both gmm launches (the forward and d_lhs:
    lhs and rhs) and tgmm (d_rhs: lhs and rhs over a group's rows)."""
    pytest.importorskip("jax_triton")
    from jax_bridge import GroupedMatmulConfig
    from tests.launch.recording import record_triton_kernels

    recorded = record_triton_kernels(monkeypatch, (0, 11, 2))
    config = GroupedMatmulConfig(block_m=128, block_k=64, block_n=128, num_warps=8, tma=True)

    def loss(lhs, rhs, sizes):
        out = grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton")
        return out.astype(jnp.float32).sum()

    lower_for_cuda(
        jax.value_and_grad(loss, argnums=(0, 1)),  # the value keeps the forward's launch
        SDS((512, 256), jnp.bfloat16),
        SDS((8, 256, 384), jnp.bfloat16),
        SDS((8,), jnp.int32),
        compute_capability=90,
    )
    gmm = recorded.of("gmm_kernel")
    assert len(gmm) == 2 and all(call[7:] == (256, 128) for call in gmm)
    (tgmm,) = recorded.of("tgmm_kernel")
    assert tgmm[1] == 8 and tgmm[7:] == (256, 128)


def test_warp_specialized_tgmm_lowers_for_an_h100_with_its_own_warps(monkeypatch):
    """The weight gradient's tgmm warp-specialized (`GroupedMatmulConfigs.tgmm`, 4 warps
    asked): 12 warps and its descriptors' scratch reach jaxlib, gmm's launches keep their
    defaults (no scratch). gmm's warp-specialized tile given to every kernel compiles in
    tgmm unspecialized (block_k 64 with block_n 256: its consumers do not compile)."""
    pytest.importorskip("jax_triton")
    from jax_bridge import GroupedMatmulConfigs
    from tests.launch.recording import record_triton_kernels
    from triton_kernels.grouped_matmul.config import (
        HOPPER_WARP_SPECIALIZED_GMM,
        HOPPER_WARP_SPECIALIZED_TGMM,
        warp_specialized_gmm_config,
    )

    recorded = record_triton_kernels(monkeypatch, (0, 11, 2))
    shapes = SDS((512, 256), jnp.bfloat16), SDS((8, 256, 384), jnp.bfloat16), SDS((8,), jnp.int32)

    def lower(config: GroupedMatmulConfig | GroupedMatmulConfigs) -> tuple:
        def loss(lhs, rhs, sizes):
            out = grouped_matmul(lhs, rhs, sizes, config=config, implementation="triton")
            return out.astype(jnp.float32).sum()

        recorded.calls.clear()
        lower_for_cuda(jax.grad(loss, argnums=(0, 1)), *shapes, compute_capability=90)
        return recorded.of("tgmm_kernel"), recorded.of("gmm_kernel")

    tgmm_config = warp_specialized_gmm_config(512, 256, 384, HOPPER_WARP_SPECIALIZED_TGMM)
    (tgmm,), (d_lhs,) = lower(GroupedMatmulConfigs(tgmm=tgmm_config))
    assert tgmm[1] == 12 and tgmm[7:] == (256, 128)
    assert len(d_lhs) == 7
    gmm_config = warp_specialized_gmm_config(512, 256, 384, HOPPER_WARP_SPECIALIZED_GMM[0])
    (tgmm,), (d_lhs,) = lower(gmm_config)
    assert tgmm[1] == 4 and tgmm[7:] == (256, 128)
    assert d_lhs[1] == 12


def test_warp_specialized_gmm_lowers_for_an_h100_with_its_own_warps(monkeypatch):
    """A warp-specialized config (4 warps asked): the gmm kernel compiles to a producer
    warpgroup and two consumers, and jaxlib is told 12 warps (and the descriptors'
    scratch); the metadata kernel keeps its 4."""
    pytest.importorskip("jax_triton")
    from jax_bridge import GroupedMatmulConfig
    from tests.launch.recording import record_triton_kernels

    recorded = record_triton_kernels(monkeypatch, (0, 11, 2))
    config = GroupedMatmulConfig(
        block_m=128, block_k=64, block_n=128, num_warps=4, num_stages=4, tma=True,
        warp_specialize=True,
    )  # fmt: skip
    lower_for_cuda(
        lambda lhs, rhs, sizes: grouped_matmul(
            lhs, rhs, sizes, config=config, implementation="triton"
        ),
        SDS((512, 256), jnp.bfloat16),
        SDS((8, 256, 384), jnp.bfloat16),
        SDS((8,), jnp.int32),
        compute_capability=90,
    )
    (gmm,) = recorded.of("gmm_kernel")
    assert gmm[1] == 12 and gmm[7:] == (256, 128)
    (schedule,) = recorded.of("gmm_schedule_kernel")
    assert schedule[1] == 4


@pytest.mark.parametrize("kernel", ["gmm", "tgmm_token_major"])
def test_static_report_of_warp_specialized_gmm_shows_its_partitions(kernel):
    """The catalog's warp-specialized gmm and tgmm at sm_90: 12 warps whose register
    budgets are set per warpgroup (USETMAXREG: the producer gives registers to the
    consumers), tiles by bulk tensor copies, wgmma, no spill, within the shared memory
    limit (its `shared_memory_bytes`), and a shorter consumer loop per MFLOP than the
    by-pointer default's."""
    (variant,) = [v for v in default_variants(90, (128,)) if v.name == f"{kernel}_tma_ws"]
    report = variant_report(variant, 90)
    print(report.summary())
    assert report.num_warps == 12 and report.sass_opcodes.get("USETMAXREG", 0) > 0
    # the two consumer warpgroups run the loop, each its own half of the tile
    assert report.loop_warps == 8 and report.mma_redundancy == 1.0, report.mma_redundancy
    assert report.sass_opcodes.get("UTMALDG", 0) > 0 and "LDGSTS" not in report.sass_opcodes
    assert report.uses_wgmma and not report.spills and not report.serialized_wgmma
    assert not report.exceeds_shared_memory
    assert report.instructions_per_mflop < _report(kernel, 90).instructions_per_mflop


@pytest.mark.parametrize(
    "kernel, tiling",
    [("gmm", (64, 128, 128)), ("gmm", (128, 64, 128)), ("tgmm_token_major", (128, 64, 128)),
     ("tgmm_token_major", (64, 128, 256))],
)  # fmt: skip
def test_warp_specialized_shared_memory_is_what_the_compiler_allocates(kernel, tiling):
    """`GroupedMatmulConfig.shared_memory_bytes` of a warp-specialized kernel, which the
    op's stage fitting trusts, against the compiled kernel's (sm_90, bf16, 3 stages):
    within the compiler's few hundred bytes of barriers, for hand-off tiles of 64 rows
    (gmm's block_m, tgmm's block_k: they take 128 rows' space) and of 128."""
    config = GroupedMatmulConfig(*tiling, num_warps=4, num_stages=3, tma=True, warp_specialize=True)
    report = variant_report(grouped_matmul_variant(kernel, 90, config=config), 90)
    estimate = config.shared_memory_bytes(2, transposed=kernel.startswith("tgmm"))
    assert report.num_warps == 12, report.summary()
    assert 0 <= report.shared_memory_bytes - estimate < 1024, (report.shared_memory_bytes, estimate)


@pytest.mark.parametrize("variant", GMM_TMA_KERNELS)
def test_static_report_of_tma_gmm_shows_bulk_tensor_copies(variant):
    """The default sm_90 tile with `tma`: lhs and rhs tiles by bulk tensor copies
    (UTMALDG, no per-thread LDGSTS), wgmma, no spills, and fewer loop instructions per
    MFLOP than the same tile by pointers."""
    report = variant_report(gmm_tma_variant(variant, 90), 90)
    print(report.summary())
    assert report.sass_opcodes.get("UTMALDG", 0) > 0 and "LDGSTS" not in report.sass_opcodes
    assert report.uses_wgmma and not report.spills, report.summary()
    assert report.instructions_per_mflop < _report(variant, 90).instructions_per_mflop
