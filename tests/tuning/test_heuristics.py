"""Heuristics: warps and stages with real numbers; defaults and candidates are valid for
every supported head_dim, dtype, GPU and feature set, and come from the kernels' tables."""

import dataclasses
import functools
import itertools

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_bridge.tuning.heuristics import (
    ATTENTION_FEATURES,
    DEFAULT_SHARED_MEMORY_LIMIT,
    GROUPED_MATMUL_FEATURES,
    attention_candidates,
    attention_features,
    default_attention_configs,
    default_grouped_matmul_config,
    default_params,
    grouped_matmul_candidates,
    select_num_stages,
    select_num_warps,
    shared_memory_limit_for,
)
from jax_bridge.tuning.params import BwdParams, FwdParams, attention_kernel_config
from triton_kernels.flash_attention.config import (
    HEAD_MAJOR_DKDV_TILE,
    HEAD_MAJOR_DQ_ATOMIC_TILE,
    KINDS,
    ONE_STAGE_TWO_CTA_TILE,
    OVERLAPPED_DKDV_TILE,
    OVERLAPPED_FORWARD_TILE,
    TWO_CTA_BACKWARD_TILE,
    WARP_SPECIALIZED_DKDV_TILE,
    WARP_SPECIALIZED_FORWARD_TILE,
    AttentionFeatures,
    AttentionKernelConfig,
    block_d,
    default_attention_config,
)
from triton_kernels.grouped_matmul.config import (
    HOPPER_WARP_SPECIALIZED_GMM,
    HOPPER_WARP_SPECIALIZED_TGMM,
    gmm_config,
    tgmm_config,
    warp_specialized_gmm_config,
)

DTYPES = ("float16", "bfloat16", "float32")
# The fields each attention kernel's params set (all of them: candidates and defaults are
# complete, the options included).
_FIELDS = {
    "forward": {
        "q_blocksize", "kv_blocksize", "num_warps", "num_stages", "tma", "warp_specialize",
        "overlap_softmax", "host_descriptors",
    },
    "backward_dkdv": {
        "q_blocksize", "kv_blocksize", "num_warps", "num_stages", "tma", "warp_specialize",
        "overlap_softmax", "host_descriptors", "head_major",
    },
    "backward_dq": {
        "dq_q_blocksize", "dq_kv_blocksize", "dq_num_warps", "dq_num_stages", "dq_tma",
        "dq_host_descriptors",
    },
}  # fmt: skip
CAPABILITIES = (None, 80, 86, 89, 90, 100, 120)
KIB = 1024


@pytest.mark.parametrize(
    "q_block, kv_block, head_dim, dtype, warps",
    [
        (128, 64, 64, jnp.bfloat16, 8),  # 128 x 64: two Hopper warpgroups of m64
        (128, 64, 128, "float16", 8),
        (16, 128, 128, "bfloat16", 8),  # dK/dV: the stationary key tile decides
        (64, 32, 256, "bfloat16", 8),  # 64 x 256 elements
        (128, 32, 32, "bfloat16", 4),  # 128 x 32 = 4096 elements
        (64, 64, 64, "bfloat16", 4),
        (16, 16, 16, "float16", 4),
        (16, 16, 16, "float32", 8),  # exact fp32 products: 8 warps share small tiles
        (32, 16, 256, jnp.float32, 8),
    ],
)
def test_select_num_warps(q_block, kv_block, head_dim, dtype, warps):
    assert select_num_warps(q_block, kv_block, head_dim, dtype) == warps


def test_select_num_warps_agrees_with_the_hopper_16bit_tables():
    for head_dim in (64, 128, 256):
        for kind in KINDS:
            config = default_attention_config(head_dim, "bfloat16", 90, kind)
            warps = select_num_warps(config.block_m, config.block_n, head_dim, "bfloat16")
            assert warps == config.num_warps, (head_dim, kind, config)


@pytest.mark.parametrize(
    "args, error, text",
    [
        ((48, 64, 64, "bfloat16"), ValueError, "q_block must be a power of two"),
        ((64, 8, 64, "bfloat16"), ValueError, "kv_block must be a power of two"),
        ((64, 64, 0, "bfloat16"), ValueError, "head_dim must be an int >= 1"),
        ((64, 64, 64, "int8"), ValueError, "dtype must be one of"),
    ],
)
def test_select_num_warps_refuses_bad_arguments(args, error, text):
    with pytest.raises(error, match=text):
        select_num_warps(*args)


def test_select_num_stages():
    # K and V tiles of 64 x 128 bf16 per stage: 32 KiB.
    assert select_num_stages(32 * KIB, shared_memory_limit=99 * KIB) == 3
    assert select_num_stages(32 * KIB, shared_memory_limit=227 * KIB) == 4  # max_stages
    assert select_num_stages(32 * KIB, shared_memory_limit=227 * KIB, max_stages=6) == 6
    assert select_num_stages(128 * KIB, shared_memory_limit=99 * KIB) == 1  # never 0
    # No GPU here: the documented default, the smallest limit (sm_86/89), is used.
    assert select_num_stages(32 * KIB) == DEFAULT_SHARED_MEMORY_LIMIT // (32 * KIB) == 3
    with pytest.raises(ValueError, match="must be >= 1"):
        select_num_stages(0)
    with pytest.raises(TypeError, match="must be an int"):
        select_num_stages(1.5)
    with pytest.raises(TypeError, match="max_stages must be an int"):
        select_num_stages(10, shared_memory_limit=99 * KIB, max_stages=2.5)


def test_shared_memory_limits():
    assert shared_memory_limit_for(80) == 163 * KIB
    assert shared_memory_limit_for(86) == shared_memory_limit_for(89) == 99 * KIB
    assert shared_memory_limit_for(90) == 227 * KIB
    # B200 and B300, whose defaults are Hopper's tables; consumer Blackwell and GB10
    assert shared_memory_limit_for(100) == shared_memory_limit_for(103) == 227 * KIB
    assert shared_memory_limit_for(120) == shared_memory_limit_for(121) == 99 * KIB
    assert shared_memory_limit_for(None) == shared_memory_limit_for(75) == 99 * KIB


def test_attention_defaults_are_the_tables_for_every_head_dim_dtype_and_gpu():
    for dtype in DTYPES:
        for capability in CAPABILITIES:
            for head_dim in range(16, 257):
                fwd, bwd = default_params(
                    "attention", compute_capability=capability, dtype=dtype, head_dim=head_dim
                )
                # Complete params: every field of the attention kernels is decided.
                assert set(fwd.to_dict()) == _FIELDS["forward"]
                assert set(bwd.to_dict()) == {f.name for f in dataclasses.fields(BwdParams)}
                table = default_attention_configs(head_dim, dtype, capability)
                assert fwd == FwdParams.from_attention_config(table.forward)
                assert bwd == BwdParams.from_attention_configs(
                    table.backward_dkdv, table.backward_dq
                )
                for kind in KINDS:
                    expected = default_attention_config(head_dim, dtype, capability, kind)
                    assert getattr(table, kind) == expected


@given(
    st.sets(st.sampled_from(sorted(ATTENTION_FEATURES))),
    st.integers(16, 256),
    st.sampled_from(DTYPES),
    st.sampled_from(CAPABILITIES),
)
def test_attention_defaults_for_every_feature_set(features, head_dim, dtype, capability):
    fwd, bwd = default_params(
        "attention",
        compute_capability=capability,
        dtype=dtype,
        head_dim=head_dim,
        features=features,
    )
    on = AttentionFeatures(**dict.fromkeys(features, True))
    assert attention_features(features) == attention_features(on) == on
    expected = default_attention_config(head_dim, dtype, capability, "forward", features=on)
    assert (
        fwd.to_attention_config(expected) == expected == FwdParams().to_attention_config(expected)
    )
    dkdv = default_attention_config(head_dim, dtype, capability, "backward_dkdv", features=on)
    assert bwd.to_dkdv_config(dkdv) == dkdv


@given(
    st.tuples(st.integers(1, 20000), st.integers(1, 8192), st.integers(1, 8192)),
    st.sampled_from(DTYPES),
    st.sampled_from(CAPABILITIES),
    st.sets(st.sampled_from(sorted(GROUPED_MATMUL_FEATURES))),
)
def test_grouped_matmul_defaults_are_what_the_op_runs(shape, dtype, capability, features):
    target = dict(element_bytes=jnp.dtype(dtype).itemsize, compute_capability=capability)
    accumulate = "accumulate" in features  # existing_out: gmm's Hopper tile would spill
    gmm = functools.partial(gmm_config, accumulate=accumulate)
    for op, make in (("grouped_matmul", gmm), ("transposed_grouped_matmul", tgmm_config)):
        fwd, bwd = default_params(
            op, compute_capability=capability, dtype=dtype, shape=shape, features=features
        )
        assert bwd is None  # the gradient matmuls take their own kernels' defaults
        # the op without tiling/config arguments launches its kernel's own default
        # (tests/grouped_matmul/test_triton.py records the op's launches)
        expected = make(*shape, **target)
        assert fwd == FwdParams.from_grouped_matmul_config(expected)
        transposed = op == "transposed_grouped_matmul"
        got = default_grouped_matmul_config(shape, dtype, capability, transposed, accumulate)
        assert got == expected


def test_default_params_refuses_unknown_ops_features_and_missing_sizes():
    with pytest.raises(ValueError, match="op must be one of"):
        default_params("softmax", compute_capability=90, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['dropout'\]"):
        default_params(
            "attention", compute_capability=90, dtype="bfloat16", head_dim=64, features={"dropout"}
        )
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['causal'\]"):
        default_params(
            "grouped_matmul",
            compute_capability=90,
            dtype="bfloat16",
            shape=(64, 64, 64),
            features={"causal"},
        )
    with pytest.raises(ValueError, match="needs head_dim"):
        default_params("attention", compute_capability=90, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"needs shape=\(m, k, n\)"):
        default_params("grouped_matmul", compute_capability=90, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        default_params("attention", compute_capability=90, dtype="float64", head_dim=64)
    # JAX's "9.0" (or 9.0) would miss every table key and fall back silently.
    for capability in ("9.0", 9.0, True):
        with pytest.raises(TypeError, match="default_params: compute_capability must be an int"):
            default_params(
                "attention", compute_capability=capability, dtype="bfloat16", head_dim=64
            )
        with pytest.raises(TypeError, match="default_attention_configs: compute_capability"):
            default_attention_configs(64, "bfloat16", capability)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capability", [80, 86, 90])
def test_attention_candidates(kind, dtype, capability):
    for head_dim in (16, 64, 80, 128, 256):
        candidates = attention_candidates(
            kind, head_dim=head_dim, dtype=dtype, compute_capability=capability
        )
        assert len(candidates) == len(set(candidates)) > 1
        assert all(type(c) is (FwdParams if kind == "forward" else BwdParams) for c in candidates)
        assert all(set(c.to_dict()) == _FIELDS[kind] for c in candidates)
        default = default_attention_config(head_dim, dtype, capability, kind)
        configs = [attention_kernel_config(kind, c, default) for c in candidates]
        assert configs[0] == default  # the default first: it wins ties
        limit = shared_memory_limit_for(capability)
        itemsize = jnp.dtype(dtype).itemsize
        for config in configs[1:]:
            if config.overlap_softmax:  # `_hopper_options`' tiles, not the grid's
                continue
            # The operand tiles alone (the estimate adds scratch): the stationary ones
            # and a buffer of the two streamed a stage, one fewer where mma.sync runs.
            stationary = config.block_n if kind == "backward_dkdv" else config.block_m
            streamed = config.block_m if kind == "backward_dkdv" else config.block_n
            wgmma = 90 <= capability < 120 and stationary >= 64
            buffers = config.num_stages if wgmma else config.num_stages - 1
            assert buffers >= 1, config  # mma.sync's 1 stage is not searched
            tiles = (1 if kind == "forward" else 2) * stationary + buffers * 2 * streamed
            assert tiles * block_d(head_dim) * itemsize <= limit, config


@pytest.mark.parametrize(
    ("capability", "kind", "tile", "stages"),
    [
        # K and V (32 KiB) and at 3 stages two buffers of Q and dO with their row stats
        # (65 KiB), with the scores' scratch (8 KiB: 64 keys < 128): 105 KiB (the
        # compiled kernel's) of 99. At 2 stages one buffer: 72.5 KiB.
        (86, "backward_dkdv", (64, 64), (2,)),
        # Q (32 KiB) and at 2 stages the one buffer of K and V (64 KiB) of mma.sync.
        (86, "forward", (128, 128), (2,)),
        (80, "forward", (128, 128), (2, 3)),  # 160 KiB at 3 stages, of 163
        (90, "forward", (128, 128), (2, 3)),  # 224 KiB of 227: a buffer a stage
        (90, "backward_dq", (128, 64), (2, 3)),  # 160 KiB at 3 stages
    ],
)
def test_attention_candidates_take_the_deepest_stages_that_fit(capability, kind, tile, stages):
    """The grid's stage counts (bf16, d=128) follow the kernel's shared memory: its
    stationary tiles and one buffer fewer than the stages on mma.sync GPUs, where 1 stage
    (the buffer of 2, no copy in flight) is not searched."""
    candidates = attention_candidates(
        kind, head_dim=128, dtype="bfloat16", compute_capability=capability
    )
    default = default_attention_config(128, "bfloat16", capability, kind)
    configs = [attention_kernel_config(kind, c, default) for c in candidates]
    found = {c.num_stages for c in configs if (c.block_m, c.block_n) == tile and not c.tma}
    assert found == set(stages)  # the default among them, where it is this tile


@pytest.mark.parametrize("kind", KINDS)
def test_attention_candidates_take_narrow_tiles_past_head_dim_128(kind):
    """Past d=128 the mma.sync GPUs' grids also hold stationary tiles of 32 rows at 4
    warps (the 99 KiB GPUs' defaults' shape there); Hopper's, whose wgmma takes 64 rows a
    warpgroup, and every grid at d=128 do not."""
    rows = "block_n" if kind == "backward_dkdv" else "block_m"
    for capability, head_dim, narrow in ((80, 256, True), (86, 256, True), (120, 256, True),
                                         (90, 256, False), (86, 128, False)):  # fmt: skip
        default = default_attention_config(head_dim, "bfloat16", capability, kind)
        candidates = attention_candidates(
            kind, head_dim=head_dim, dtype="bfloat16", compute_capability=capability
        )
        grid = [attention_kernel_config(kind, c, default) for c in candidates[1:]]
        found = [c for c in grid if getattr(c, rows) == 32 and not c.overlap_softmax]
        assert bool(found) is narrow, (capability, head_dim)
        assert all(c.num_warps == 4 for c in found)


def test_attention_candidates_leave_out_tiles_that_never_fit():
    """On a 99 KiB GPU at d=256 a dK/dV tile of 128 keys holds K and V in 128 KiB, a dQ
    tile of 128 queries Q and dO: the grid leaves them out, and every candidate fits."""
    for kind, rows in (("backward_dkdv", "block_n"), ("backward_dq", "block_m")):
        default = default_attention_config(256, "bfloat16", 86, kind)
        candidates = attention_candidates(
            kind, head_dim=256, dtype="bfloat16", compute_capability=86
        )
        configs = [attention_kernel_config(kind, c, default) for c in candidates]
        assert len(configs) > 1 and all(getattr(c, rows) < 128 for c in configs)
        for config in configs:
            assert config.shared_memory_bytes(kind, 256, 2, 86) <= 99 * KIB, config


@pytest.mark.parametrize("kind", KINDS)
def test_attention_candidates_search_tma_for_hopper_dkdv(kind):
    """With descriptors on sm_90 (bf16, d=128) dK/dV's 128-key tiles of 32 and 64 queries
    are searched by pointers and through descriptors, its default (64x128 with TMA)
    first; the forward and dQ only by pointers (slower with TMA on an H100), but for the
    warp-specialized forward, the backward's kernels at one warpgroup a CTA
    (`TWO_CTA_BACKWARD_TILE`), which need descriptors, and the forward and dQ at one
    stage, two CTAs an SM (`ONE_STAGE_TWO_CTA_TILE`). Without descriptors: by pointers
    only."""
    candidates = attention_candidates(
        kind, head_dim=128, dtype="bfloat16", compute_capability=90,
        features=("causal",), descriptors=True,
    )  # fmt: skip
    default = default_attention_config(
        128, "bfloat16", 90, kind, features=attention_features(("causal",)), descriptors=True
    )
    configs = [attention_kernel_config(kind, c, default) for c in candidates]
    assert configs[0] == default
    specialized = [c for c in configs if c.warp_specialize]
    assert len(specialized) == (kind != "backward_dq") and all(c.tma for c in specialized)
    two_ctas = AttentionKernelConfig(*TWO_CTA_BACKWARD_TILE, tma=True)
    assert (two_ctas in configs) is (kind != "forward")
    one_stage_tma = AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE, tma=True)
    assert (one_stage_tma in configs) is (kind != "backward_dkdv")
    configs = [c for c in configs if not c.warp_specialize and c not in (two_ctas, one_stage_tma)]
    with_tma = {(c.block_m, c.block_n, c.num_stages) for c in configs if c.tma}
    by_pointers = {(c.block_m, c.block_n, c.num_stages) for c in configs if not c.tma}
    if kind == "backward_dkdv":
        twins = {t for t in by_pointers if t[1] == 128 and t[0] >= 32}
        assert default.tma and with_tma == twins and (64, 128, 2) in with_tma
    else:
        assert not with_tma and by_pointers
    plain = attention_candidates(
        kind, head_dim=128, dtype="bfloat16", compute_capability=90, features=("causal",)
    )
    assert not any(attention_kernel_config(kind, c, default).tma for c in plain)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_candidates(transposed, dtype):
    for shape in ((8192, 2048, 1408), (96, 64, 128), (20, 16, 16)):
        candidates = grouped_matmul_candidates(
            shape, dtype=dtype, compute_capability=90, transposed=transposed
        )
        assert len(candidates) == len(set(candidates)) >= 1
        default = default_grouped_matmul_config(shape, dtype, 90, transposed)
        assert candidates[0] == FwdParams.from_grouped_matmul_config(default)
        for candidate in candidates:
            config = candidate.to_grouped_matmul_config(default)
            # Tiles never exceed their dimension rounded up to a power of two (>= 16).
            m, k, n = shape
            assert config.block_n <= max(16, 1 << (n - 1).bit_length())
            assert config.block_k <= max(16, 1 << (k - 1).bit_length())
            assert config.block_m <= max(16, 1 << (m - 1).bit_length())
    # A tiny problem shrinks every tiling to the same config: one candidate, and its
    # persistent launch.
    for tiny_transposed in (False, True):
        tiny = grouped_matmul_candidates(
            (16, 16, 16), dtype=dtype, compute_capability=90, transposed=tiny_transposed
        )
        assert [c.persistent for c in tiny] == [False, True]


def test_a_lone_feature_name_is_one_feature_not_its_letters():
    one = dict(compute_capability=90, dtype="bfloat16")
    gmm = dict(one, shape=(64, 64, 64))
    assert default_params("grouped_matmul", features="accumulate", **gmm) == default_params(
        "grouped_matmul", features={"accumulate"}, **gmm
    )
    attention = dict(one, head_dim=64)
    assert default_params("attention", features="causal", **attention) == default_params(
        "attention", features={"causal"}, **attention
    )


def test_tuning_sees_the_tma_default_where_descriptors_launch():
    """Where descriptors can be launched, the tuner's default is what untuned calls run
    (Hopper's dK/dV with TMA at 64x128), its first candidate is that tile, and params
    that set only tiles keep the default's `tma`."""
    from jax_bridge.tuning.params import attention_configs

    causal = {"causal"}
    defaults = default_attention_configs(128, jnp.bfloat16, 90, causal, descriptors=True)
    dkdv = defaults.backward_dkdv
    assert (dkdv.block_m, dkdv.block_n, dkdv.tma) == (64, 128, True)
    assert not default_attention_configs(128, jnp.bfloat16, 90, causal).backward_dkdv.tma
    first = attention_candidates(
        "backward_dkdv", head_dim=128, dtype=jnp.bfloat16, compute_capability=90,
        features=causal, descriptors=True,
    )[0]  # fmt: skip
    assert (first.q_blocksize, first.kv_blocksize) == (64, 128)
    tuned = attention_configs(FwdParams(num_stages=3), BwdParams(num_stages=3), defaults)
    assert tuned.backward_dkdv.tma and tuned.backward_dkdv.num_stages == 3
    assert not tuned.forward.tma and not tuned.backward_dq.tma


# --- the kernels' off-by-default options: the softmax overlap, warp specialization ------


def _with_options(kind, candidates, default):
    """The configs of the candidates with `warp_specialize` or `overlap_softmax` on."""
    configs = [attention_kernel_config(kind, c, default) for c in candidates]
    return [c for c in configs if c.warp_specialize or c.overlap_softmax]


@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hopper_candidates_hold_the_overlap_and_warp_specialization(capability, dtype):
    """sm_90 and up, 16 bits: the forward's and dK/dV's overlapped tiles (the constants of
    the kernels' config module); with descriptors and a head_dim that is a power of two,
    the warp-specialized forward and dK/dV (`WARP_SPECIALIZED_FORWARD_TILE`,
    `WARP_SPECIALIZED_DKDV_TILE`, tma) and dK/dV and dQ at one warpgroup a CTA
    (`TWO_CTA_BACKWARD_TILE`, tma); dQ takes neither `overlap_softmax` nor
    `warp_specialize`. The forward and dQ at one stage, two CTAs an SM
    (`ONE_STAGE_TWO_CTA_TILE`), at every head dim up to 128 by pointers, and by
    descriptors where those launch. They come after the default and the grid."""
    expected = {
        "forward": [AttentionKernelConfig(*OVERLAPPED_FORWARD_TILE, overlap_softmax=True)],
        "backward_dkdv": [AttentionKernelConfig(*OVERLAPPED_DKDV_TILE, overlap_softmax=True)],
        "backward_dq": [],
    }
    specialized = {
        kind: [AttentionKernelConfig(*tile, tma=True, warp_specialize=True)]
        for kind, tile in (("forward", WARP_SPECIALIZED_FORWARD_TILE),
                           ("backward_dkdv", WARP_SPECIALIZED_DKDV_TILE))
    }  # fmt: skip
    two_ctas = AttentionKernelConfig(*TWO_CTA_BACKWARD_TILE, tma=True)
    one_stage = AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE)
    one_stage_tma = one_stage.replace(tma=True)
    for kind in KINDS:
        for head_dim, descriptors in ((128, True), (128, False), (80, True), (64, True)):
            args = dict(head_dim=head_dim, dtype=dtype, compute_capability=capability)
            candidates = attention_candidates(kind, **args, descriptors=descriptors)
            default = default_attention_config(
                head_dim, dtype, capability, kind, descriptors=descriptors
            )
            found = _with_options(kind, candidates, default)
            powers_of_two = head_dim == block_d(head_dim)
            ws = specialized.get(kind, []) if descriptors and powers_of_two else []
            assert found == expected[kind] + ws, (kind, head_dim, descriptors)
            configs = [attention_kernel_config(kind, c, default) for c in candidates]
            backward = kind != "forward" and descriptors and powers_of_two
            assert (two_ctas in configs) is backward, (kind, head_dim, descriptors)
            # by pointers, two CTAs an SM at one stage: the forward and dQ
            assert (one_stage in configs) is (kind != "backward_dkdv"), (kind, head_dim)
            by_descriptors = kind != "backward_dkdv" and descriptors and powers_of_two
            assert (one_stage_tma in configs) is by_descriptors, (kind, head_dim, descriptors)
            assert configs[0] == default and configs[len(configs) - len(found) :] == found
            assert len(candidates) == len(set(candidates))
    for kind in ("forward", "backward_dq"):  # past d=128 two CTAs of it do not fit
        default = default_attention_config(256, dtype, capability, kind, descriptors=True)
        candidates = attention_candidates(
            kind, head_dim=256, dtype=dtype, compute_capability=capability, descriptors=True
        )
        configs = [attention_kernel_config(kind, c, default) for c in candidates]
        assert one_stage not in configs and one_stage_tma not in configs


def test_head_major_dkdv_candidates_past_head_dim_128_on_hopper():
    """dK/dV head-major (`HEAD_MAJOR_DKDV_TILE`, `HEAD_MAJOR_DQ_ATOMIC_TILE`) is searched
    where Hopper's wgmma runs it past head_dim 128 (sm_90, 16-bit; the default there is
    one of them): not at d=128, on Blackwell, mma.sync GPUs or float32, nor for other
    kernels."""
    tiles = {HEAD_MAJOR_DKDV_TILE, HEAD_MAJOR_DQ_ATOMIC_TILE}
    for kind, head_dim, capability, dtype in itertools.product(
        KINDS, (128, 192, 256), (80, 90, 100), ("bfloat16", "float32")
    ):
        args = dict(head_dim=head_dim, dtype=dtype, compute_capability=capability)
        default = default_attention_config(head_dim, dtype, capability, kind)
        configs = [
            attention_kernel_config(kind, c, default) for c in attention_candidates(kind, **args)
        ]
        found = {(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in configs if c.head_major}
        searched = (kind, capability, dtype) == ("backward_dkdv", 90, "bfloat16") and head_dim > 128
        assert found == (tiles if searched else set()), (kind, head_dim, capability, dtype)


@pytest.mark.parametrize("kind", ["forward", "backward_dq"])
def test_one_stage_two_cta_candidates_only_where_two_ctas_fit(kind):
    """`ONE_STAGE_TWO_CTA_TILE` is searched on the wgmma GPUs only (sm_90-119), a program
    a tile: not on sm_120/121 (mma.sync, 99 KiB: one CTA of it, its loops spill), nor
    for a persistent walk (its dQ spills in the loop under Triton 3.9)."""
    one_stage = AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE)
    for capability, persistent, searched in ((90, False, True), (100, False, True),
                                             (90, True, False), (120, False, False),
                                             (121, False, False), (80, False, False)):  # fmt: skip
        args = dict(head_dim=128, dtype="bfloat16", compute_capability=capability)
        candidates = attention_candidates(kind, **args, persistent=persistent)
        default = default_attention_config(128, "bfloat16", capability, kind, persistent=persistent)
        configs = [attention_kernel_config(kind, c, default) for c in candidates]
        assert (one_stage in configs) is searched, (capability, persistent)


@pytest.mark.parametrize("kind", KINDS)
def test_below_sm_90_and_for_float32_no_option_is_a_candidate(kind):
    for capability, dtype in ((80, "bfloat16"), (86, "float16"), (89, "bfloat16"),
                              (None, "bfloat16"), (90, "float32")):  # fmt: skip
        for head_dim in (64, 128):
            args = dict(head_dim=head_dim, dtype=dtype, compute_capability=capability)
            candidates = attention_candidates(kind, **args, descriptors=True)
            default = default_attention_config(head_dim, dtype, capability, kind)
            configs = [attention_kernel_config(kind, c, default) for c in candidates]
            assert not any(c.warp_specialize or c.overlap_softmax for c in configs)
            if capability != 90:  # no descriptors below sm_90, whatever jaxlib says
                assert not any(c.tma for c in configs)
                assert candidates == attention_candidates(kind, **args, descriptors=False)


@pytest.mark.parametrize("transposed", [False, True], ids=["gmm", "tgmm"])
def test_grouped_matmul_candidates_hold_the_warp_specialized_tiles_on_hopper(transposed):
    shape = (8192, 2048, 1408)
    tiles = (HOPPER_WARP_SPECIALIZED_TGMM,) if transposed else HOPPER_WARP_SPECIALIZED_GMM
    expected = [
        FwdParams.from_grouped_matmul_config(warp_specialized_gmm_config(*shape, t)) for t in tiles
    ]
    args = dict(dtype="bfloat16", transposed=transposed)
    plain = grouped_matmul_candidates(shape, compute_capability=90, **args)
    hopper = grouped_matmul_candidates(shape, compute_capability=90, descriptors=True, **args)
    if not transposed:  # and gmm's default tile persistent through descriptors
        expected.append(dataclasses.replace(plain[0], tma=True, persistent=True))
    assert hopper == plain + expected
    assert all(p.tma is True and p.warp_specialize is not p.persistent for p in expected)
    assert not any(p.warp_specialize or p.tma for p in plain)
    # Nowhere else: below sm_90, for float32, over rows that are not 16-byte multiples.
    for capability, dtype, problem in (
        (80, "bfloat16", shape),
        (89, "bfloat16", shape),
        (90, "float32", shape),
        (90, "bfloat16", (8192, 2048, 1404)),
        (90, "bfloat16", (8192, 2044, 1408)),
    ):
        candidates = grouped_matmul_candidates(
            problem, dtype=dtype, compute_capability=capability, transposed=transposed,
            descriptors=True,
        )  # fmt: skip
        assert not any(c.warp_specialize for c in candidates), (capability, dtype, problem)
        assert candidates == grouped_matmul_candidates(
            problem, dtype=dtype, compute_capability=capability, transposed=transposed
        )


_TO_PARAMS = {
    "forward": FwdParams.from_attention_config,
    "backward_dkdv": BwdParams.from_dkdv_config,
    "backward_dq": BwdParams.from_dq_config,
}


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize(
    "launch",
    [dict(persistent=True), dict(dq_atomic=True), dict(descriptors=True, persistent=True)],
    ids=["persistent", "dq_atomic", "descriptors-persistent"],
)
def test_reported_defaults_follow_the_launch(capability, launch):
    """`default_attention_configs`, `default_params` and `attention_candidates`' first
    candidate report the tiles a call launches (`default_attention_config` with the same
    launch: many sequences walk tile lists, dK/dV that adds dQ has its own tiles), which
    differ from the plain launch's: Hopper's forward at d=256 walking (128x32 against
    128x64), sm_80's at d=128; the dQ-atomic dK/dV at d=256."""
    causal = AttentionFeatures(causal=True)
    for head_dim in (64, 128, 256):
        configs = default_attention_configs(head_dim, jnp.bfloat16, capability, causal, **launch)
        assert configs.dq_atomic == launch.get("dq_atomic", False)
        fwd, bwd = default_params("attention", compute_capability=capability,
                                  dtype="bfloat16", head_dim=head_dim, features=causal,
                                  **launch)  # fmt: skip
        assert fwd == FwdParams.from_attention_config(configs.forward)
        assert bwd == BwdParams.from_attention_configs(configs.backward_dkdv, configs.backward_dq)
        for kind in KINDS:
            expected = default_attention_config(
                head_dim, "bfloat16", capability, kind, features=causal, **launch
            )
            assert getattr(configs, kind) == expected, (head_dim, kind)
            if "dq_atomic" not in launch:  # the tuner times the kernels, not dq_atomic
                first = attention_candidates(
                    kind, head_dim=head_dim, dtype="bfloat16", compute_capability=capability,
                    features=causal, **launch,
                )[0]  # fmt: skip
                assert first == _TO_PARAMS[kind](expected), (head_dim, kind)
    # (kernel, head_dim) whose tile the launch moves
    kind, wide = {
        ("persistent", 90): ("forward", 256), ("persistent", 80): ("forward", 128),
        ("dq_atomic", 90): ("backward_dkdv", 256), ("dq_atomic", 80): ("backward_dkdv", 256),
    }[("dq_atomic" if "dq_atomic" in launch else "persistent", capability)]  # fmt: skip
    plain, moved = (
        getattr(default_attention_configs(wide, jnp.bfloat16, capability, causal, **kw), kind)
        for kw in ({}, launch)
    )
    assert (plain.block_m, plain.block_n) != (moved.block_m, moved.block_n)


def test_default_params_of_grouped_matmul_refuse_attentions_launch():
    with pytest.raises(ValueError, match=r"'grouped_matmul'.*\['persistent'\] are attention's"):
        default_params("grouped_matmul", compute_capability=90, dtype="bfloat16",
                       shape=(256, 128, 128), persistent=True)  # fmt: skip
