"""Varlen (packed) attention: argument checks, the backend table and the custom_vjp.

The math lives elsewhere: `spec` states the semantics, `reference` is the dense oracle,
and each backend (`xla`: blockwise plain JAX; `triton`: the Triton kernels, on a GPU or
through Triton's interpreter) is one module with the contract stated above `_attention`.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention import pallas, triton, xla
from jax_bridge.attention.options import AttentionOptions
from jax_bridge.attention.sinks import apply_sink_limits
from jax_bridge.attention.spec import AttentionSpec
from jax_bridge.core.autodiff import first_order_only, refuse_forward_mode
from jax_bridge.core.backend import BackendTable
from jax_bridge.core.precision import canonicalize_precision
from jax_bridge.core.validation import (
    as_int32,
    calling_op,
    check_bool,
    check_cu_seqlens,
    check_head_dim,
    check_per_head,
    check_qkv_arrays,
    check_static_int,
    is_traced,
    naming_op,
    require,
)
from jax_bridge.core.vma import cotangent_like
from pallas_tpu.splash.config import BlockSizes
from triton_kernels.flash_attention.config import (
    KINDS,
    AttentionConfigs,
    AttentionKernelConfig,
    block_d,
)

__all__ = ["AttentionOptions", "varlen_attention"]

_OP = "varlen_attention"
# What `refuse_forward_mode` offers instead, for every attention op.
REVERSE_MODE_ONLY = "Reverse mode works (jax.grad, jax.vjp, jax.jacrev), first order only."
BACKENDS = BackendTable(_OP, {"xla": xla, "triton": triton, "pallas": pallas})


def varlen_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    return_lse: bool = False,
    precision: Any = None,
    config: AttentionConfigs | AttentionKernelConfig | BlockSizes | None = None,
    implementation: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over packed variable-length sequences (FlashAttention varlen layout).

    Sequence b owns query rows `[cu_seqlens_q[b], cu_seqlens_q[b+1])` and key/value rows
    `[cu_seqlens_k[b], cu_seqlens_k[b+1])`; tokens never attend across sequences. Rows at
    or past `cu_seqlens_q[-1]` (trailing padding) attend nothing: output 0, lse -inf (or
    the sink), zero gradients; so do rows before `cu_seqlens_q[0]`, on every backend,
    where a traced cu_seqlens not starting at 0 went unchecked.

    Masks are aligned at the bottom-right corner when a sequence's query and key lengths
    differ (FlashAttention >= 2.1): query i sits at key position
    `diag(i) = i + len_k - len_q`. Causal, len_q = 2, len_k = 5 (x = attended):

        keys:     0 1 2 3 4
        query 0:  x x x x .      diag(0) = 3
        query 1:  x x x x x      diag(1) = 4

    With len_q > len_k the first len_q - len_k queries see no key under `causal`: their
    output is 0 and their log-sum-exp -inf (or the sink's logit, with sinks).

    Args:
      q: [total_q, num_q_heads, head_dim].
      k, v: [total_k, num_kv_heads, head_dim]; num_q_heads % num_kv_heads == 0
        (GQA; num_kv_heads == 1 is MQA). Query head h reads kv head h // group.
        float16, bfloat16 or float32, all the same. head_dim: any value the backend runs
        (`jax_bridge.attention.triton.HEAD_DIMS` = 16..256, e.g. 80, 96 or 192; the XLA
        backend takes any head_dim >= 1). Every backend accumulates in float32.
      cu_seqlens_q, cu_seqlens_k: int32 [batch + 1], starting at 0, non-decreasing, with
        `cu_seqlens_q[-1] <= total_q` and `cu_seqlens_k[-1] <= total_k`. May be traced
        (under jit the value checks are `checkify` checks).
      max_seqlen_q, max_seqlen_k: optional static upper bounds on the sequence lengths,
        accepted for FlashAttention API compatibility. They are validated (a Python int,
        at least the longest sequence: a `checkify` check under jit) and otherwise unused:
        neither implementation needs them (the Triton grids are sized by the token
        totals), so different values do not cause recompilation.
      causal: keys right of the (bottom-right aligned) diagonal are masked.
      sliding_window: (left, right): keys with diag(i) - left <= j <= diag(i) + right
        are attended; None (or -1, FlashAttention's convention) on a side is unbounded,
        and so is any side of 2^30 or more. With `causal`, right is 0.
      logits_soft_cap: scores become cap * tanh(s / cap) (before ALiBi and masking);
        None or 0.0 (FlashAttention's `softcap=0.0`) is off.
      softmax_scale: multiplies q.k (finite, non-zero; negative is valid); default
        1 / sqrt(head_dim).
      sinks: [num_q_heads] learnable logits, one per head, that join every row's softmax
        denominator and carry no value. They receive a gradient.
      alibi_slopes: [num_q_heads]; adds -slope[h] * |diag(i) - j| to the scores. Treated
        as a constant: its gradient is zero.
      return_lse: also return the log-sum-exp.
      precision: how float32 inputs are multiplied, as in `jax.lax.dot`; None (the
        default) is `Precision.HIGHEST`, exact float32 products on every backend. DEFAULT
        allows TF32 on NVIDIA GPUs, HIGH three TF32 passes (`jax_bridge.core.precision`).
      config: the Triton kernels' launch configuration: an `AttentionConfigs` (one
        `AttentionKernelConfig` per kernel, None fields keep their defaults), or one
        `AttentionKernelConfig` for all three kernels (its `warp_specialize` for the
        forward only, `overlap_softmax` for the forward and dK/dV; dK/dV's own config
        may take `warp_specialize` too). None: chosen by head_dim, dtype and GPU.
        `AttentionConfigs(dq_atomic=True)` makes the backward FlashAttention-2's
        (dQ added by float32 atomics from the dK/dV kernel, no dQ kernel; dQ's sums then
        run in no fixed order). With implementation="pallas": a splash `BlockSizes`
        (multiples of 128; None fields default; the packed axes are padded to the
        blocks). XLA ignores either kind.
      implementation: "auto" (Triton on GPUs, the Pallas splash kernels on TPUs, XLA
        elsewhere), "triton" (on a CPU it runs through Triton's interpreter: slow),
        "pallas" (off a TPU in Pallas' interpret mode: slow; no `alibi_slopes`; float32
        products at the TPU's default dot precision) or "xla".

    Returns:
      out: [total_q, num_q_heads, head_dim] in q's dtype; with `return_lse`, also
      lse: float32 [num_q_heads, total_q], the natural-log log-sum-exp of each row's
      scaled, capped, biased, masked scores (and sink).

    Differentiation: reverse mode (`jax.grad`/`jax.vjp`) for q, k, v and sinks; the
    cu_seqlens get no (float0) cotangent and alibi_slopes a zero one. The lse output is
    differentiable too (its cotangent flows into q, k and sinks). Forward mode (`jax.jvp`,
    `jax.jacfwd`; the op is a custom_vjp) and higher-order derivatives (grad of grad,
    `jax.hessian`) are not supported: both raise a NotImplementedError naming this op.

    Transforms: `jax.jit`, `jax.vmap` over any argument (the Triton kernels loop over the
    batch; folding a batch into the packed token axis is one launch instead), `jax.remat`,
    and `jax.shard_map` with its default `check_vma=True` (e.g. data parallelism: each
    device its own packed tokens and cu_seqlens).

    Non-finite sinks: a NaN sink makes its head's outputs NaN, on every row (padding rows,
    which see only the sink, and rows that see no key included); a +inf sink takes all
    of the probability (output 0, lse +inf); -inf is no sink.

    Raises:
      TypeError / ValueError naming the offending argument.
    """
    impl = BACKENDS.resolve(implementation)
    _check_qkv(q, k, v, impl)
    total_q, num_q_heads, head_dim = q.shape
    total_k = k.shape[0]
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q, "q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k, "k")
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"{_OP}: cu_seqlens_q and cu_seqlens_k must describe the same batch, got shapes "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}."
        )
    spec = _make_spec(head_dim, causal, sliding_window, logits_soft_cap, softmax_scale)
    sinks = check_per_head(_OP, sinks, "sinks", num_q_heads)
    alibi_slopes = check_per_head(_OP, alibi_slopes, "alibi_slopes", num_q_heads)
    if alibi_slopes is not None:
        # Documented as a constant; stop_gradient also keeps JVP-style tracers out.
        alibi_slopes = jax.lax.stop_gradient(alibi_slopes)
    _check_max_seqlen(max_seqlen_q, cu_q, "max_seqlen_q")
    _check_max_seqlen(max_seqlen_k, cu_k, "max_seqlen_k")
    options = AttentionOptions(
        implementation=impl,
        precision=canonicalize_precision(precision, _OP),
        config=_check_config(config, impl, head_dim=head_dim),
        spec=spec,
        op=calling_op(_OP),
    )
    refuse_forward_mode(_OP, q, k, v, sinks, works=REVERSE_MODE_ONLY)
    if not check_bool(_OP, return_lse, "return_lse"):
        return _attention_output(options, q, k, v, cu_q, cu_k, sinks, alibi_slopes)
    return _attention(options, q, k, v, cu_q, cu_k, sinks, alibi_slopes)


# ---------------------------------------------------------------------------- checks


def _check_qkv(q: Any, k: Any, v: Any, implementation: str, op: str = _OP) -> None:
    check_qkv_arrays(
        op, q, k, v, q_doc="[tokens, heads, head_dim]", kv_doc="[total_k, num_kv_heads, head_dim]"
    )
    check_head_dim(op, q.shape[2], BACKENDS[implementation].HEAD_DIMS, implementation)


def _check_cu_seqlens(cu: Any, name: str, total: int, array_name: str) -> jax.Array:
    arr = cu if is_traced(cu) else np.asarray(cu)
    if arr.ndim != 1:
        raise ValueError(f"{_OP}: {name} must have shape [batch + 1], got {tuple(arr.shape)}.")
    # Converted to int32 when the values fit; then non-empty, from 0, non-decreasing.
    cu = check_cu_seqlens(as_int32(arr, f"{_OP}: {name}"), f"{_OP}: {name}")
    require(
        cu[-1] <= total,
        f"{_OP}: {name}[-1] (the number of real tokens) exceeds {array_name}.shape[0] = {total}.",
    )
    return cu


def _make_spec(
    head_dim: int,
    causal: Any,
    sliding_window: Any,
    logits_soft_cap: Any,
    softmax_scale: Any,
    op: str = _OP,
) -> AttentionSpec:
    check_bool(op, causal, "causal")
    if sliding_window is not None:
        if not isinstance(sliding_window, tuple | list) or len(sliding_window) != 2:
            raise ValueError(
                f"{op}: sliding_window must be a pair (left, right) of ints >= 0 or None, "
                f"got {sliding_window!r}."
            )
        sliding_window = tuple(_window_side(side, sliding_window, op) for side in sliding_window)
    if isinstance(logits_soft_cap, numbers.Real) and logits_soft_cap == 0:
        logits_soft_cap = None  # FlashAttention's softcap=0.0: off
    for name, value in (("logits_soft_cap", logits_soft_cap), ("softmax_scale", softmax_scale)):
        if value is not None and (
            is_traced(value) or isinstance(value, bool) or not isinstance(value, numbers.Real)
        ):
            raise TypeError(f"{op}: {name} must be a static Python float or None, got {value!r}.")
    try:
        return AttentionSpec.create(
            head_dim,
            causal=bool(causal),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            softmax_scale=softmax_scale,
        )
    except ValueError as err:  # the spec's messages name the argument already
        raise ValueError(f"{op}: {err}") from None


def _window_side(side: Any, window: Any, op: str = _OP) -> int | None:
    """One side of a sliding window: an int >= 0, or None (unbounded). -1 also means
    unbounded, as FlashAttention's `window_size=(-1, -1)` does."""
    if side is None:
        return None
    if is_traced(side):  # it sizes the kernels' tile ranges: a value known when tracing
        raise TypeError(
            f"{op}: sliding_window entries must be static Python ints or None, got a traced "
            f"value in {window!r}."
        )
    if isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < -1:
        raise ValueError(
            f"{op}: sliding_window entries must be ints >= 0, -1 or None (unbounded), "
            f"got {window!r}."
        )
    return None if side == -1 else int(side)


def _check_config(
    config: Any, implementation: str, op: str = _OP, head_dim: int | None = None
) -> AttentionConfigs | BlockSizes | None:
    """Triton takes launch configs; Pallas takes splash tile sizes; XLA ignores both (a
    program written for one accelerator, `implementation="auto"` with its config, also
    runs on a CPU). With `head_dim`, a Triton config's kernels with `tma` are checked
    against it here, not when a gradient is first traced (a descriptor's tile is a whole
    row)."""
    if implementation == "pallas" and isinstance(config, (BlockSizes, type(None))):
        return config
    if implementation == "xla" and isinstance(config, BlockSizes):
        return None
    if implementation != "pallas" and isinstance(config, AttentionKernelConfig):
        config = AttentionConfigs.for_every_kernel(config)
    if implementation != "pallas" and (config is None or isinstance(config, AttentionConfigs)):
        if implementation == "triton" and config is not None and head_dim is not None:
            _check_tma_head_dim(config, head_dim, op)
        return config
    expected = (
        "a splash BlockSizes"
        if implementation == "pallas"
        else "an AttentionConfigs or an AttentionKernelConfig"
    )
    raise TypeError(
        f"{op}: config for implementation={implementation!r} must be {expected} or None, "
        f"got {type(config).__name__}."
    )


def _check_tma_head_dim(configs: AttentionConfigs, head_dim: int, op: str) -> None:
    """ValueError naming the kernel if a config with `tma` meets a head_dim that is not a
    power of two (a descriptor's tile is the whole row)."""
    for kind in KINDS:
        config = getattr(configs, kind)
        if config is not None and config.tma and block_d(head_dim) != head_dim:
            raise ValueError(
                f"{op}: config tma=True ({kind}) needs a head_dim that is a power of two (a "
                f"descriptor's tile is the whole row), got {head_dim}"
            )


def _check_max_seqlen(hint: Any, cu: jax.Array, name: str) -> None:
    """Validates an (otherwise unused) max_seqlen hint: a static int >= every length."""
    if hint is None:
        return
    if is_traced(hint):  # check_static_int's reason (an output shape) is not this one's
        raise TypeError(
            f"{_OP}: {name} is a hint checked against cu_seqlens, so it must be a static "
            "Python int, not a traced value; mark it static or leave it None."
        )
    hint = check_static_int(hint, f"{_OP}: {name}")
    require(
        jnp.max(cu[1:] - cu[:-1], initial=0) <= hint,
        f"{_OP}: {name}={hint} is smaller than the longest sequence.",
    )


# ------------------------------------------------------------------- custom_vjp wiring
#
# Backend contract: every module in `BACKENDS` exports
#   HEAD_DIMS: (smallest, largest) head_dim it runs;
#   forward(q, k, v, cu_q, cu_k, sinks, alibi, options, shift=None) -> (out, lse);
#   backward(q, k, v, out, lse, d_out, d_lse, cu_q, cu_k, sinks, alibi, options,
#     shift=None) -> (dq, dk, dv, d_sinks), with d_lse None for a zero lse cotangent.
# Arrays are as documented on `varlen_attention`, already validated. `shift` (int32
# [batch] or None) puts query 0 of sequence b at key position shift[b] instead of the
# bottom-right len_k - len_q: ring attention's pieces of one document need it (a backend
# that lacks it raises NotImplementedError); varlen_attention never passes it.


def _forward(options: AttentionOptions, q, k, v, cu_q, cu_k, sinks, alibi):
    """(out [Tq, Hq, D], lse f32 [Hq, Tq]) by the chosen backend."""
    with naming_op(options.op):  # a backend's refusal at trace time (e.g. Pallas in a shard_map)
        backend = BACKENDS[options.implementation]
        out, lse = backend.forward(q, k, v, cu_q, cu_k, sinks, alibi, options)
    return (out, lse) if sinks is None else apply_sink_limits(out, lse, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(options: AttentionOptions, q, k, v, cu_q, cu_k, sinks, alibi):
    return _forward(options, q, k, v, cu_q, cu_k, sinks, alibi)


def _attention_fwd(options: AttentionOptions, q, k, v, cu_q, cu_k, sinks, alibi):
    # Only a second-order derivative differentiates the residuals' computation.
    forward = functools.partial(_forward, options)
    out, lse = first_order_only(forward, options.op)(q, k, v, cu_q, cu_k, sinks, alibi)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, sinks, alibi)


def _attention_bwd(options: AttentionOptions, residuals, cotangents):
    q, k, v, out, lse, cu_q, cu_k, sinks, alibi = residuals
    # The lse cotangent is zeros when lse does not reach the loss (symbolic zeros would
    # skip it, but JAX does not support them under an eager shard_map).
    d_out, d_lse = cotangents
    backward = functools.partial(BACKENDS[options.implementation].backward, options=options)
    with naming_op(options.op):
        dq, dk, dv, d_sinks = first_order_only(backward, options.op)(
            q, k, v, out, lse, d_out, d_lse, cu_q, cu_k, sinks, alibi
        )
    if sinks is not None:
        d_sinks = cotangent_like(d_sinks.astype(sinks.dtype), sinks)
    # Inside shard_map a cotangent must vary exactly where its primal does; kernel calls
    # (pure_callback, jax_triton) return values typed invariant.
    dq, dk, dv = (cotangent_like(d, x) for d, x in ((dq, q), (dk, k), (dv, v)))
    # cu_seqlens are integers (no cotangent: None) and ALiBi slopes are constants (None
    # is a zero cotangent).
    return dq, dk, dv, None, None, d_sinks, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_output(options: AttentionOptions, q, k, v, cu_q, cu_k, sinks, alibi):
    """`_attention`'s output alone: its backward knows that lse's cotangent is zero (d_lse
    None), where `_attention`'s would get a materialised array of zeros to read."""
    return _forward(options, q, k, v, cu_q, cu_k, sinks, alibi)[0]


def _attention_output_fwd(options: AttentionOptions, q, k, v, cu_q, cu_k, sinks, alibi):
    (out, _), residuals = _attention_fwd(options, q, k, v, cu_q, cu_k, sinks, alibi)
    return out, residuals


def _attention_output_bwd(options: AttentionOptions, residuals, d_out):
    return _attention_bwd(options, residuals, (d_out, None))


_attention_output.defvjp(_attention_output_fwd, _attention_output_bwd)
