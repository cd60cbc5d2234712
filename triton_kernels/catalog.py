"""Every Triton kernel of the package as an offline-compilable variant: its parameter
types, its constexprs and its launch configuration, as the bridge launches it.

Pure Python (no JAX). The static report (`python -m bench report`), the tests of the
default configurations and the autotuner's pruning compile kernels from these variants
with no GPU present, so they must describe the very launch the bridge makes: the same
pointer element types (the shift placeholder is float32: the unshifted kernel), the same
constexprs, the default configuration of `default_attention_config` / `gmm_config`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import triton

from triton_kernels.block_sparse.backward import block_sparse_dkdv_kernel, block_sparse_dq_kernel
from triton_kernels.block_sparse.config import BLOCK_SPARSE_TWO_CTA_TILES, block_sparse_config
from triton_kernels.block_sparse.forward import INTERVALS, block_sparse_forward_kernel
from triton_kernels.config import descriptor_type
from triton_kernels.flash_attention.backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
)
from triton_kernels.flash_attention.config import (
    DQ_REDUCE_DKDV_TILE,
    ONE_STAGE_TWO_CTA_TILE,
    OVERLAPPED_DKDV_TILE,
    OVERLAPPED_FORWARD_TILE,
    STREAMED_TILES,
    TWO_CTA_BACKWARD_TILE,
    WARP_SPECIALIZED_DKDV_TILE,
    WARP_SPECIALIZED_FORWARD_TILE,
    AttentionFeatures,
    AttentionKernelConfig,
    default_attention_config,
)
from triton_kernels.flash_attention.constexprs import (
    attention_constexprs,
    attention_num_warps,
    block_sparse_constexprs,
    finds_bad_rows_in_kernel,
)
from triton_kernels.flash_attention.forward import attention_forward_kernel
from triton_kernels.grouped_matmul.config import (
    HOPPER_WARP_SPECIALIZED_GMM,
    HOPPER_WARP_SPECIALIZED_TGMM,
    GroupedMatmulConfig,
    gmm_config,
    tgmm_config,
    tgmm_warp_specializes,
    warp_specialized_gmm_config,
)
from triton_kernels.grouped_matmul.kernels import gmm_kernel, tgmm_kernel, tgmm_walk_kernel

TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

ATTENTION_KERNELS = {
    "forward": attention_forward_kernel,
    "backward_dkdv": attention_backward_dkdv_kernel,
    "backward_dq": attention_backward_dq_kernel,
}

BLOCK_SPARSE_KERNELS = {
    "forward": block_sparse_forward_kernel,
    "backward_dkdv": block_sparse_dkdv_kernel,
    "backward_dq": block_sparse_dq_kernel,
}

CAUSAL = AttentionFeatures(causal=True)
"""The report's attention problem: causal, no other option."""

# The heads of the static problem: GQA, so the kv-head arithmetic is in the kernel.
_Q_HEADS, _KV_HEADS = 8, 2
# A Mixtral-like expert layer for the grouped matmul kernels (their M, K, N are constexpr)
# over 64 experts (tgmm's default depends on the rows per group).
GMM_PROBLEM, GMM_GROUPS = (8192, 2048, 1408), 64
GMM_LONG = (32768, 4096, 2048)  # over GMM_GROUPS: 512 rows a group


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One kernel at one launch configuration, ready for `static_kernel_report`.

    Attributes:
      name: what the report calls it, e.g. "attention_forward".
      kernel: the `@triton.jit` function.
      signature: Triton type of every runtime parameter ("*bf16", "i32", ...).
      constexprs: the value of every `tl.constexpr` parameter.
      num_warps, num_stages: the launch configuration.
      description: the problem it was specialised for (dtype, head_dim, features).
    """

    name: str
    kernel: triton.JITFunction
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any]
    num_warps: int
    num_stages: int
    description: str

    @property
    def loop_work_flops(self) -> int | None:
        """The tensor-core FLOPs one iteration of its inner loop owes its tile
        (`launched_loop_work`, from its kernel and constexprs), which the static report sets
        against the FLOPs its MMAs execute (`KernelReport.mma_redundancy`); None for a
        kernel without a tensor-core loop."""
        work = launched_loop_work(self.kernel.__name__, self.constexprs)
        return None if work is None else work[1]


# The tile products one iteration of each attention kernel's loop computes: the forward
# QK^T and PV; dQ QK^T, dO V^T and dS K; dK/dV K Q^T, V dO^T, P^T dO and dS^T Q, and dS K
# where it adds dQ too (DQ_ATOMIC). The block-sparse kernels' loops compute the same.
_LOOP_PRODUCTS = {"forward": 2, "backward_dq": 3, "backward_dkdv": 4}


def loop_work_flops(kind: str, constexprs: Mapping[str, Any]) -> int:
    """The tensor-core FLOPs one iteration of a kernel's inner loop owes its tile, from
    its constexprs: 2 x BLOCK_M x BLOCK_K x BLOCK_N for grouped matmul (`kind` "matmul"),
    2 x BLOCK_M x BLOCK_N x BLOCK_D for each of an attention kernel's products (`kind` in
    forward/backward_dkdv/backward_dq; the head dim padded to its tile, as the MMAs run
    it)."""
    c = constexprs
    if kind == "matmul":
        return 2 * c["BLOCK_M"] * c["BLOCK_K"] * c["BLOCK_N"]
    products = _LOOP_PRODUCTS[kind] + bool(c.get("DQ_ATOMIC", False))
    return products * 2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_D"]


# The loop each kernel (by the name its PTX gives it) owes its tile: `loop_work_flops`'s
# kind. The schedule and row-statistics kernels have no tensor-core loop.
_LOOP_KIND_BY_KERNEL_NAME = {
    **{kernel.__name__: kind for kind, kernel in ATTENTION_KERNELS.items()},
    **{kernel.__name__: kind for kind, kernel in BLOCK_SPARSE_KERNELS.items()},
    **{kernel.__name__: "matmul" for kernel in (gmm_kernel, tgmm_kernel, tgmm_walk_kernel)},
}


def launched_loop_work(kernel_name: str, constexprs: Mapping[str, Any]) -> tuple[str, int] | None:
    """(the tile, as "128x64" or, for grouped matmul, "128x64x256" = M x K x N, and
    `loop_work_flops`) of a kernel built elsewhere, known by its name and the constexprs it
    was compiled with (a `KernelVariant`, or the preflight's kernels, which jax-triton builds
    from a launch); None for a kernel without a tensor-core loop."""
    kind = _LOOP_KIND_BY_KERNEL_NAME.get(kernel_name)
    if kind is None:
        return None
    c = constexprs
    dims = ("BLOCK_M", "BLOCK_K", "BLOCK_N") if kind == "matmul" else ("BLOCK_M", "BLOCK_N")
    return "x".join(str(c[d]) for d in dims), loop_work_flops(kind, c)


_ATTENTION_SCALARS = dict(
    total_q="i32",
    num_chunks="i32",
    softmax_scale="fp32",
    logits_soft_cap="fp32",
    window_left="i32",
    window_right="i32",
)
_FLOAT32_POINTERS = {
    "lse_ptr",
    "d_lse_ptr",
    "lse_log2_ptr",
    "delta_ptr",
    "dq_accum_ptr",
    "sinks_ptr",
    "alibi_slopes_ptr",
    "shift_ptr",
}
_INT32_POINTERS = {"cu_seqlens_q_ptr", "cu_seqlens_k_ptr", "chunk_indices_ptr"}


def _loading_tags(config: Any) -> tuple[str, str]:
    """(name suffix, description suffix) of a config's loading and scheduling options:
    "_tma" / " tma" for tensor descriptors, "_ws" / " warp-specialized" for a
    warp-specialized loop, "_overlap" / " overlapped softmax" for `overlap_softmax` (the
    forward's or dK/dV's), "_head_major" / " head-major" for dK/dV's `head_major`,
    "_persistent" / " persistent" for gmm's persistent walk, "_host" / " host
    descriptors" for descriptors encoded by the launch (gmm's, the streamed arrays of
    attention's kernels)."""
    tags = [
        ("tma", "_tma", " tma"),
        ("host_descriptors", "_host", " host descriptors"),
        ("warp_specialize", "_ws", " warp-specialized"),
        ("overlap_softmax", "_overlap", " overlapped softmax"),
        ("head_major", "_head_major", " head-major"),
        ("persistent", "_persistent", " persistent"),
    ]
    on = [(name, words) for field, name, words in tags if getattr(config, field, False)]
    return "".join(name for name, _ in on), "".join(words for _, words in on)


def attention_signature(kernel: triton.JITFunction, dtype_name: str) -> dict[str, str]:
    """Types of an attention kernel's runtime parameters: q/k/v/out and their gradients in
    `dtype_name`; statistics, per-head vectors and the shift placeholder float32; offsets
    int32."""
    element = TRITON_TYPES[dtype_name]
    signature = {}
    for name in kernel.arg_names:
        if name in _ATTENTION_SCALARS:
            signature[name] = _ATTENTION_SCALARS[name]
        elif name in _FLOAT32_POINTERS:
            signature[name] = "*fp32"
        elif name in _INT32_POINTERS:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{element}"
    return signature


def attention_variant(
    kind: str,
    head_dim: int,
    compute_capability: int,
    dtype_name: str = "bfloat16",
    features: AttentionFeatures = CAUSAL,
    config: AttentionKernelConfig | None = None,
    persistent: bool = False,
    descriptors: bool = False,
    dq_atomic: bool = False,
) -> KernelVariant:
    """One attention kernel (`kind` in forward/backward_dkdv/backward_dq) at its default
    configuration for the problem, or at `config`; `persistent`: the launch that walks
    the tile list (segment ids' mostly empty lists); `descriptors`: the default where
    tensor descriptors can be launched (`default_attention_config`'s); `dq_atomic`: the
    dK/dV kernel that accumulates dQ too (`AttentionConfigs.dq_atomic`)."""
    if config is None:
        config = default_attention_config(
            head_dim, dtype_name, compute_capability, kind, features=features,
            persistent=persistent, descriptors=descriptors, dq_atomic=dq_atomic,
        )  # fmt: skip
    kernel = ATTENTION_KERNELS[kind]
    # float32 multiplies exactly by default ("ieee"; 16-bit inputs ignore the setting); an
    # lse cotangent adds one load a row, outside the loop, so the report leaves it out.
    constexprs = attention_constexprs(
        kind, config, features, num_q_heads=_Q_HEADS, num_kv_heads=_KV_HEADS,
        head_dim=head_dim, softmax_scale=head_dim**-0.5, input_precision="ieee",
        persistent=persistent, dq_atomic=dq_atomic,
    )  # fmt: skip
    signature = attention_signature(kernel, dtype_name)
    if config.host_descriptors:  # the streamed tiles' arrays: the launch's descriptors
        box = descriptor_type(TRITON_TYPES[dtype_name], config.descriptor_box(kind, head_dim))
        signature |= dict.fromkeys(STREAMED_TILES[kind].parameters, box)
    return KernelVariant(
        name=f"attention_{kind}"
        + ("_persistent" if persistent else "")
        + _loading_tags(config)[0]
        + ("_dq_atomic" if dq_atomic else ""),
        kernel=kernel,
        signature=signature,
        constexprs=constexprs,
        num_warps=attention_num_warps(config, persistent),
        num_stages=config.num_stages,
        description=f"{dtype_name} d={head_dim} {features.describe()} "
        f"{config.block_m}x{config.block_n}" + _loading_tags(config)[1],
    )


def tma_variant(
    kind: str, head_dim: int, compute_capability: int, host: bool = False
) -> KernelVariant:
    """An attention kernel (bf16, causal) with `tma`, its streamed tiles through
    device-side tensor descriptors (sm_90 and up): its default config where descriptors
    can be launched (dK/dV at sm_90, d=128: 64x128 with `tma`, what a GPU with a recent
    jaxlib runs), with `tma` set on the others' default tiles; `host`: through the
    launch's descriptors over the whole arrays."""
    default = default_attention_config(head_dim, "bfloat16", compute_capability, kind,
                                       features=CAUSAL, descriptors=True)  # fmt: skip
    config = dataclasses.replace(default, tma=True, host_descriptors=host)
    return attention_variant(kind, head_dim, compute_capability, config=config)


_BLOCK_SPARSE_SCALARS = dict.fromkeys(
    ("q_len", "kv_len", "n_tiles", "width", "window_left", "window_right", "prefix"), "i32"
) | dict(softmax_scale="fp32", logits_soft_cap="fp32")
_BLOCK_SPARSE_TENSORS = {
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "d_out_ptr",
    "out_ptr",
    "dq_ptr",
    "dk_ptr",
    "dv_ptr",
}


def block_sparse_signature(kernel: triton.JITFunction, dtype_name: str) -> dict[str, str]:
    """Types of a block-sparse kernel's runtime parameters (its first launch's): q/k/v/out
    and their gradients in `dtype_name`; statistics and sinks float32; the mask table, the
    non-finite row flags and the redo flags int8; lists and token arrays int32."""
    element = TRITON_TYPES[dtype_name]
    signature = {}
    for name in kernel.arg_names:
        if name in _BLOCK_SPARSE_SCALARS:
            signature[name] = _BLOCK_SPARSE_SCALARS[name]
        elif name in _BLOCK_SPARSE_TENSORS or name.endswith("_clean_ptr"):
            signature[name] = f"*{element}"
        elif name in _FLOAT32_POINTERS:
            signature[name] = "*fp32"
        elif name in ("table_ptr", "row_flags_ptr") or name.endswith("_bad_ptr"):
            signature[name] = "*i8"
        elif name.startswith("redo_") or name.endswith("_in_ptr"):
            # the first of the two launches: its flags, and placeholders for the
            # outputs a second launch aliases (`jax_bridge.block_sparse.triton`)
            signature[name] = "*i8"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
    return signature


def block_sparse_variant(
    kind: str,
    head_dim: int,
    compute_capability: int,
    dtype_name: str = "bfloat16",
    config: AttentionKernelConfig | None = None,
    soft_cap: bool = False,
    alibi: bool = False,
) -> KernelVariant:
    """One block-sparse kernel (`kind` in forward/backward_dkdv/backward_dq) as a causal
    mask launches it (partial tiles by their rows' kv intervals), with or without a soft
    cap and ALiBi, at its default configuration or at `config`."""
    if config is None:
        config = block_sparse_config(
            head_dim, dtype_name, compute_capability, kind, soft_cap=soft_cap, alibi=alibi
        )
    kernel = BLOCK_SPARSE_KERNELS[kind]
    causal_rule = dict(
        MASK_MODE=INTERVALS.value, HAS_LEFT=False, HAS_RIGHT=False, HAS_PREFIX=False, PREDICATE=None
    )
    constexprs = block_sparse_constexprs(
        kind, config, causal_rule, num_q_heads=_Q_HEADS, num_kv_heads=_KV_HEADS,
        head_dim=head_dim, softmax_scale=head_dim**-0.5, input_precision="ieee",
        soft_cap=soft_cap, alibi=alibi, sinks=False, score_mod=None, score_mod_grad=None,
        group_width=_Q_HEADS, find_bad_rows=finds_bad_rows_in_kernel(compute_capability),
        has_d_lse=True,  # the op's backward always gets lse's cotangent (zeros if unused)
    )  # fmt: skip
    name_tag, description_tag = _loading_tags(config)
    return KernelVariant(
        name=f"block_sparse_{kind}{name_tag}",
        kernel=kernel,
        signature=block_sparse_signature(kernel, dtype_name),
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        description=f"{dtype_name} d={head_dim} causal{'+soft_cap' if soft_cap else ''}"
        f"{'+alibi' if alibi else ''} {config.block_m}x{config.block_n}{description_tag}",
    )


# name: (kernel, config function, layout constexprs). The launches of a training step:
# gmm (forward), gmm_transposed (the input gradient), tgmm_token_major (the weight
# gradient); the other two cover `existing_out` and tgmm's [k, m] layout.
GMM_KERNELS = {
    "gmm": (gmm_kernel, gmm_config, dict(TRANSPOSE_RHS=False, ACCUMULATE=False)),
    "gmm_transposed": (gmm_kernel, gmm_config, dict(TRANSPOSE_RHS=True, ACCUMULATE=False)),
    "gmm_transposed_accumulate": (
        gmm_kernel,
        functools.partial(gmm_config, accumulate=True),
        dict(TRANSPOSE_RHS=True, ACCUMULATE=True),
    ),
    "tgmm_token_major": (
        tgmm_kernel,
        functools.partial(tgmm_config, lhs_token_major=True, num_groups=GMM_GROUPS),
        dict(LHS_TOKEN_MAJOR=True, ACCUMULATE=False),
    ),
    "tgmm": (tgmm_kernel, tgmm_config, dict(LHS_TOKEN_MAJOR=False, ACCUMULATE=True)),
}
# The launches that can take their tiles through tensor descriptors (tgmm: over a
# token-major lhs, the weight gradient).
GMM_TMA_KERNELS = ("gmm", "gmm_transposed_accumulate", "tgmm_token_major")


def grouped_matmul_variant(
    name: str,
    compute_capability: int,
    dtype_name: str = "bfloat16",
    problem: tuple[int, int, int] = GMM_PROBLEM,
    config: GroupedMatmulConfig | None = None,
) -> KernelVariant:
    """One grouped matmul kernel (a key of `GMM_KERNELS`) at its default configuration
    for `problem` = (m, k, n) over `GMM_GROUPS` groups (which tgmm's default depends on),
    or at `config`."""
    kernel, make_config, layout = GMM_KERNELS[name]
    m, k, n = problem
    element_bytes = 4 if dtype_name == "float32" else 2
    if config is None:
        config = make_config(
            m,
            k,
            n,
            element_bytes=element_bytes,
            compute_capability=compute_capability,
        )
    if kernel is tgmm_kernel:  # as the op launches it (Triton fails some tgmm consumers)
        config = config.replace(warp_specialize=tgmm_warp_specializes(config))
        if config.persistent and layout["LHS_TOKEN_MAJOR"] and not config.tma:
            return tgmm_walk_variant(compute_capability, problem, config, dtype_name)
    element = TRITON_TYPES[dtype_name]
    types = {"lhs_ptr": f"*{element}", "rhs_ptr": f"*{element}"}
    if config.host_descriptors and kernel is gmm_kernel:  # tensor descriptors, as launched
        types = _gmm_descriptor_types(element, config, layout["TRANSPOSE_RHS"])
    types |= {"init_ptr": "*fp32", "out_ptr": "*fp32", "num_groups": "i32"}
    signature = {
        a: types.get(a, "*i32") for a in kernel.arg_names if a.endswith("_ptr") or a in types
    }
    constexprs = dict(
        **config.shape_constexprs(m, k, n),
        INPUT_PRECISION="ieee",  # the launch's: float32 exact by default, 16-bit always
        **layout,
    )
    constexprs["TMA"] = config.tma
    constexprs["WARP_SPECIALIZE"] = config.warp_specialize
    if kernel is gmm_kernel:
        constexprs["PERSISTENT"] = config.persistent
        constexprs["HOST_DESCRIPTORS"] = config.host_descriptors
    return KernelVariant(
        name=name + _loading_tags(config)[0],
        kernel=kernel,
        signature=signature,
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        description=f"{dtype_name} m={m} k={k} n={n} "
        f"{config.block_m}x{config.block_k}x{config.block_n}" + _loading_tags(config)[1],
    )


def _gmm_descriptor_types(element: str, config: GroupedMatmulConfig, transposed: bool):
    """gmm's lhs and rhs as tensor descriptors (`GroupedMatmulConfig.host_descriptors`):
    their Triton types, boxes as the bridge encodes them."""
    lhs, rhs = config.descriptor_boxes(transposed)
    return {"lhs_ptr": descriptor_type(element, lhs), "rhs_ptr": descriptor_type(element, rhs)}


def default_variants(
    compute_capability: int, head_dims: tuple[int, ...] = (64, 128)
) -> list[KernelVariant]:
    """Every Triton kernel at its default configuration (bf16; attention causal, GQA):
    what `python -m bench report` lists."""
    variants = []
    for head_dim in head_dims:
        for kind in ATTENTION_KERNELS:
            variants.append(attention_variant(kind, head_dim, compute_capability))
        for kind in ATTENTION_KERNELS:  # the launch of many sequences (segment ids)
            variants.append(attention_variant(kind, head_dim, compute_capability, persistent=True))
        if compute_capability >= 90:  # streamed tiles by tensor descriptors (TMA), to compare
            # (not head-major dK/dV's: by descriptors it spills in its loop at every tile
            # tried, 124-1264 B at d=256 under Triton 3.6 and 3.9)
            kinds = [kind for kind in ATTENTION_KERNELS if not _head_major_default(
                kind, head_dim, compute_capability)]  # fmt: skip
            variants += [tma_variant(kind, head_dim, compute_capability) for kind in kinds]
            variants += [  # and through the launch's descriptors
                tma_variant(kind, head_dim, compute_capability, host=True) for kind in kinds
            ]
        if compute_capability == 90 and head_dim == 128:  # the softmax overlap
            for kind, tile in (("forward", OVERLAPPED_FORWARD_TILE),
                               ("backward_dkdv", OVERLAPPED_DKDV_TILE)):  # fmt: skip
                config = AttentionKernelConfig(*tile, overlap_softmax=True)
                variants.append(attention_variant(kind, head_dim, 90, config=config))
            # and the backward at one warpgroup a CTA, two CTAs an SM
            config = AttentionKernelConfig(*TWO_CTA_BACKWARD_TILE, tma=True)
            for kind in ("backward_dkdv", "backward_dq"):
                variant = attention_variant(kind, head_dim, 90, config=config)
                variants.append(dataclasses.replace(variant, name=variant.name + "_two_ctas"))
            # and the forward and dQ at one stage, two CTAs an SM, by pointers
            config = AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE)
            for kind in ("forward", "backward_dq"):
                variant = attention_variant(kind, head_dim, 90, config=config)
                variants.append(dataclasses.replace(variant, name=variant.name + "_two_ctas"))
            # and warp-specialized (Hopper's partitioning: 12 warps)
            for kind, tile in (("forward", WARP_SPECIALIZED_FORWARD_TILE),
                               ("backward_dkdv", WARP_SPECIALIZED_DKDV_TILE)):  # fmt: skip
                config = AttentionKernelConfig(*tile, tma=True, warp_specialize=True)
                variants.append(attention_variant(kind, head_dim, 90, config=config))
        # the dK/dV kernel that accumulates dQ too (`AttentionConfigs.dq_atomic`), and on
        # sm_90 at d=128 with its dQ shares added by bulk tensor reductions (`tma`)
        variants.append(
            attention_variant("backward_dkdv", head_dim, compute_capability, dq_atomic=True)
        )
        if compute_capability == 90 and head_dim == 128:
            config = AttentionKernelConfig(*DQ_REDUCE_DKDV_TILE, tma=True)
            variants.append(
                attention_variant("backward_dkdv", head_dim, 90, config=config, dq_atomic=True)
            )
        for kind in BLOCK_SPARSE_KERNELS:
            variants.append(block_sparse_variant(kind, head_dim, compute_capability))
        if compute_capability == 90 and head_dim == 128:  # the A/B row's one warpgroup a CTA
            for kind, tile in BLOCK_SPARSE_TWO_CTA_TILES.items():
                variant = block_sparse_variant(
                    kind, head_dim, 90, config=AttentionKernelConfig(*tile)
                )
                variants.append(dataclasses.replace(variant, name=variant.name + "_two_ctas"))
            # and the softmax overlap, at the varlen A/B rows' tiles
            for kind, tile in (("forward", OVERLAPPED_FORWARD_TILE),
                               ("backward_dkdv", OVERLAPPED_DKDV_TILE)):  # fmt: skip
                config = AttentionKernelConfig(*tile, overlap_softmax=True)
                variants.append(block_sparse_variant(kind, head_dim, 90, config=config))
    variants += [grouped_matmul_variant(name, compute_capability) for name in GMM_KERNELS]
    # the weight gradient over longer groups (512 rows each): its own default tile on sm_90
    variants.append(
        grouped_matmul_variant("tgmm_token_major", compute_capability, problem=GMM_LONG)
    )
    if compute_capability >= 90:  # gmm's tiles by tensor descriptors (TMA), to compare
        variants += [gmm_tma_variant(name, compute_capability) for name in GMM_TMA_KERNELS]
        variants.append(gmm_tma_variant("gmm", compute_capability, host=True))
    # gmm persistent (a program per CTA the GPU holds), by pointers and (sm_90) by TMA,
    # and the weight gradient's tgmm walking splits of the groups, at both problems
    variants.append(persistent_gmm_variant(compute_capability, tma=False))
    if compute_capability >= 90:  # with descriptors built by each program, or the launch's
        variants.append(persistent_gmm_variant(compute_capability, tma=True))
        variants.append(persistent_gmm_variant(compute_capability, tma=True, host=True))
    variants += [tgmm_walk_variant(compute_capability, p) for p in (GMM_PROBLEM, GMM_LONG)]
    if compute_capability == 90:  # and warp-specialized (Hopper's partitioning)
        for name, tiling in (
            ("gmm", HOPPER_WARP_SPECIALIZED_GMM[0]),
            ("tgmm_token_major", HOPPER_WARP_SPECIALIZED_TGMM),
        ):
            config = warp_specialized_gmm_config(*GMM_PROBLEM, tiling)
            variants.append(grouped_matmul_variant(name, compute_capability, config=config))
    return variants


def _head_major_default(kind: str, head_dim: int, compute_capability: int) -> bool:
    """Whether kernel `kind`'s default (bf16, causal) is head-major dK/dV."""
    config = default_attention_config(head_dim, "bfloat16", compute_capability, kind,
                                      features=CAUSAL)  # fmt: skip
    return config.head_major


def persistent_gmm_variant(compute_capability: int, tma: bool, host: bool = False) -> KernelVariant:
    """The forward gmm at its default tile (bf16), persistent, by pointers or with `tma`
    (`host`: the launch's descriptors)."""
    m, k, n = GMM_PROBLEM
    default = gmm_config(m, k, n, element_bytes=2, compute_capability=compute_capability)
    config = dataclasses.replace(default, tma=tma, persistent=True, host_descriptors=host)
    return grouped_matmul_variant("gmm", compute_capability, config=config)


def tgmm_walk_variant(
    compute_capability: int,
    problem: tuple[int, int, int] = GMM_PROBLEM,
    config: GroupedMatmulConfig | None = None,
    dtype_name: str = "bfloat16",
) -> KernelVariant:
    """`tgmm_walk_kernel` (the weight gradient's tgmm, persistent) at `config` (default:
    the token-major tgmm's default tile for `problem` over `GMM_GROUPS` groups), two
    splits, its output in its inputs' dtype as the weight gradient launches it (a float32
    output tile of 16-bit inputs would pass through shared memory beside the pipeline's:
    320 KiB at m 32768's 128 x 128 x 256)."""
    m, k, n = problem
    element_bytes = 4 if dtype_name == "float32" else 2
    if config is None:
        config = tgmm_config(m, k, n, element_bytes=element_bytes,
                             compute_capability=compute_capability, lhs_token_major=True,
                             num_groups=GMM_GROUPS)  # fmt: skip
    element = f"*{TRITON_TYPES[dtype_name]}"
    types = {"lhs_ptr": element, "rhs_ptr": element, "init_ptr": element, "out_ptr": element}
    signature = {
        a: types.get(a, "i32" if a == "num_groups" else "*i32")
        for a in tgmm_walk_kernel.arg_names
        if a.endswith("_ptr") or a == "num_groups"
    }
    constexprs = dict(**config.shape_constexprs(m, k, n), ACCUMULATE=False,
                      INPUT_PRECISION="ieee", SPLITS=2, GROUP_CHUNK=GMM_GROUPS)  # fmt: skip
    return KernelVariant(
        name="tgmm_token_major_walk",
        kernel=tgmm_walk_kernel,
        signature=signature,
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        description=f"{dtype_name} m={m} k={k} n={n} "
        f"{config.block_m}x{config.block_k}x{config.block_n} walk",
    )


def gmm_tma_variant(name: str, compute_capability: int, host: bool = False) -> KernelVariant:
    """A grouped matmul kernel of `GMM_TMA_KERNELS` at its default tile (bf16) with `tma`
    (`host`, gmm's launches only: the launch's descriptors)."""
    _, make_config, _ = GMM_KERNELS[name]
    m, k, n = GMM_PROBLEM
    default = make_config(m, k, n, element_bytes=2, compute_capability=compute_capability)
    config = dataclasses.replace(default, tma=True, host_descriptors=host)
    return grouped_matmul_variant(name, compute_capability, config=config)
