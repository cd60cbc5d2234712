"""The attention kernels on the GPU path, checked on a machine without a GPU.

* Lowering: `lower_for_cuda` runs jax_triton's real lowering (Triton compiles every kernel
  for the given compute capability) and the module must hold the kernel calls.
* Static report: the kernels compiled offline at their default launch configurations
  (causal) must not spill registers: bf16 for head_dim <= 128, where they must also use
  tensor cores, and Hopper's warpgroup MMA (wgmma) on sm_90; float32 (exact "ieee"
  products, on CUDA cores) at head_dim 64 and 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_triton")

from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.attention.triton import (
    attention_backward_triton,
    attention_forward_triton,
)
from jax_bridge.launch.lowering import lower_for_cuda
from jax_bridge.launch.report import static_kernel_report
from triton_kernels.flash_attention.backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
)
from triton_kernels.flash_attention.config import (
    block_d,
    default_attention_config,
    preprocess_block_t,
)
from triton_kernels.flash_attention.forward import attention_forward_kernel

TOTAL_Q, TOTAL_K, BATCH = 384, 256, 3
Q_HEADS, KV_HEADS = 8, 2

S = jax.ShapeDtypeStruct


def _lower_forward(spec, dtype, head_dim, compute_capability, per_head=()):
    """Lowers the forward; `per_head` names float32 [Hq] options (sinks, alibi_slopes)."""

    def forward(q, k, v, cu_q, cu_k, *vectors):
        extra = dict(zip(per_head, vectors, strict=True))
        return attention_forward_triton(q, k, v, cu_q, cu_k, spec, **extra)

    return lower_for_cuda(
        forward,
        S((TOTAL_Q, Q_HEADS, head_dim), dtype),
        S((TOTAL_K, KV_HEADS, head_dim), dtype),
        S((TOTAL_K, KV_HEADS, head_dim), dtype),
        S((BATCH + 1,), jnp.int32),
        S((BATCH + 1,), jnp.int32),
        *(S((Q_HEADS,), jnp.float32) for _ in per_head),
        compute_capability=compute_capability,
    )


def _lower_backward(spec, dtype, head_dim, compute_capability, per_head=()):
    def backward(q, k, v, out, lse, d_out, cu_q, cu_k, *vectors):
        extra = dict(zip(per_head, vectors, strict=True))
        return attention_backward_triton(q, k, v, out, lse, d_out, cu_q, cu_k, spec, **extra)

    q = S((TOTAL_Q, Q_HEADS, head_dim), dtype)
    kv = S((TOTAL_K, KV_HEADS, head_dim), dtype)
    return lower_for_cuda(
        backward,
        q,
        kv,
        kv,
        q,
        S((Q_HEADS, TOTAL_Q), jnp.float32),
        q,
        S((BATCH + 1,), jnp.int32),
        S((BATCH + 1,), jnp.int32),
        *(S((Q_HEADS,), jnp.float32) for _ in per_head),
        compute_capability=compute_capability,
    )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("compute_capability", [80, 90])
def test_lowers_for_cuda(compute_capability, dtype, head_dim):
    spec = AttentionSpec(head_dim**-0.5, causal=True)
    forward = _lower_forward(spec, dtype, head_dim, compute_capability)
    assert forward.count("triton_kernel_call") == 1
    backward = _lower_backward(spec, dtype, head_dim, compute_capability)
    assert backward.count("triton_kernel_call") == 3  # preprocess, dK/dV, dQ


@pytest.mark.parametrize(
    "compute_capability, dtype, head_dim",
    [(90, jnp.bfloat16, 80), (80, jnp.float16, 192), (90, jnp.float32, 96)],
)
def test_lowers_with_every_option(compute_capability, dtype, head_dim):
    """Every constexpr branch (windows, soft cap, sinks, ALiBi, padded head dim, exact
    fp32 products) compiles for the GPU, not only under the interpreter."""
    spec = AttentionSpec(0.1, causal=True, window_left=64, logits_soft_cap=30.0)
    per_head = ("sinks", "alibi_slopes")
    forward = _lower_forward(spec, dtype, head_dim, compute_capability, per_head)
    assert forward.count("triton_kernel_call") == 1
    backward = _lower_backward(spec, dtype, head_dim, compute_capability, per_head)
    assert backward.count("triton_kernel_call") == 3
    two_sided = AttentionSpec(0.1, window_left=32, window_right=16)
    assert "triton_kernel_call" in _lower_backward(two_sided, dtype, head_dim, compute_capability)


# --- static report ------------------------------------------------------------------------

_SCALARS = dict(
    total_q="i32",
    softmax_scale="fp32",
    logits_soft_cap="fp32",
    window_left="i32",
    window_right="i32",
)
_KERNELS = {
    "forward": attention_forward_kernel,
    "backward_dkdv": attention_backward_dkdv_kernel,
    "backward_dq": attention_backward_dq_kernel,
}


def _signature(kernel, element: str) -> dict[str, str]:
    """Triton types of a kernel's runtime parameters: tensors of `element`, float32
    statistics and per-head vectors, int32 offsets."""
    float32 = {"lse_ptr", "delta_ptr", "sinks_ptr", "alibi_slopes_ptr"}
    int32 = {"cu_seqlens_q_ptr", "cu_seqlens_k_ptr", "chunk_indices_ptr"}
    signature = {}
    for name in kernel.arg_names:
        if name in _SCALARS:
            signature[name] = _SCALARS[name]
        elif name in float32:
            signature[name] = "*fp32"
        elif name in int32:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{element}"
    return signature


_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def attention_kernel_report(
    kind: str, head_dim: int, compute_capability: int, dtype_name: str = "bfloat16", config=None
):
    """The static report of one kernel (causal, GQA) at its default configuration for
    `dtype_name`, or at `config`."""
    if config is None:
        config = default_attention_config(head_dim, dtype_name, compute_capability, kind)
    kernel = _KERNELS[kind]
    constexprs = dict(
        NUM_Q_HEADS=Q_HEADS,
        NUM_KV_HEADS=KV_HEADS,
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d(head_dim),
        HAS_WINDOW_LEFT=False,
        HAS_WINDOW_RIGHT=True,
        HAS_SOFT_CAP=False,
        HAS_ALIBI=False,
        DOT_PRECISION=config.fp32_dot_precision if dtype_name == "float32" else "ieee",
    )
    if kind == "forward":
        constexprs["HAS_SINKS"] = False
    return static_kernel_report(
        kernel,
        _signature(kernel, _TRITON_TYPES[dtype_name]),
        constexprs,
        compute_capability=compute_capability,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


@pytest.mark.parametrize("kind", list(_KERNELS))
@pytest.mark.parametrize(
    "compute_capability, head_dim", [(80, 64), (80, 128), (90, 64), (90, 128), (90, 256)]
)
def test_static_report_at_default_configs(compute_capability, head_dim, kind):
    report = attention_kernel_report(kind, head_dim, compute_capability)
    print(report.summary())
    assert report.uses_mma
    if head_dim <= 128:
        assert not report.spills, report.summary()
    if compute_capability >= 90:
        assert report.uses_wgmma, report.summary()


@pytest.mark.parametrize("kind", list(_KERNELS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_static_report_float32(head_dim, kind):
    """float32 defaults to exact products, which run on CUDA cores (no mma for "ieee"
    fp32): the small default tiles must still not spill."""
    config = default_attention_config(head_dim, "float32", 90, kind)
    assert config.fp32_dot_precision == "ieee"
    report = attention_kernel_report(kind, head_dim, 90, "float32")
    print(report.summary())
    assert not report.spills, report.summary()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_static_report_preprocess(head_dim):
    report = static_kernel_report(
        attention_backward_preprocess_kernel,
        _signature(attention_backward_preprocess_kernel, "bf16"),
        dict(
            NUM_Q_HEADS=Q_HEADS,
            HEAD_DIM=head_dim,
            BLOCK_T=preprocess_block_t(head_dim),
            BLOCK_D=block_d(head_dim),
        ),
        compute_capability=90,
        num_warps=4,
        num_stages=1,
    )
    assert not report.spills, report.summary()
