"""Grouped matmul (`gmm`) and its transpose (`tgmm`) for mixture-of-experts layers:
the public ops, their `custom_vjp` wiring and the choice of implementation.

Rows (tokens) are sorted by group (expert): group `i` owns rows
`[sum(group_sizes[:i]), sum(group_sizes[:i + 1]))`. The backends share the semantics
exactly: `triton` (the Triton kernels, on a GPU or through Triton's interpreter on a CPU)
and `xla` (a loop over the same row tiles; `ragged_dot_general` on TPU). `reference`
is the dense oracle.

Backend contract (every module in `_BACKENDS`):
  gmm(lhs, rhs, group_sizes, group_offset, existing_out, options) -> [m, n]
  tgmm(lhs, rhs, group_sizes, group_offset, existing_out, num_groups, options)
    -> [num_groups, k, n]
with the arrays of `grouped_matmul` / `transposed_grouped_matmul`, validated, and
`group_offset` None or an int32 scalar.

Gradients (with `t = transpose_rhs`):
  d_lhs = gmm(d_out, rhs, transpose_rhs=not t)
  d_rhs = tgmm(lhs.T, d_out)        (tgmm(d_out.T, lhs), i.e. transposed, when t)
  d_existing_out = d_out
The cotangent is cast to the inputs' dtype first (what the tensor cores multiply); the
tgmm kernel reads `lhs` in its `[m, k]` layout, so no transpose is materialised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.autodiff import refuse_forward_mode
from jax_bridge.core.backend import BackendTable
from jax_bridge.core.precision import canonicalize_precision
from jax_bridge.core.validation import check_bool, check_static_int, naming_op
from jax_bridge.core.vma import cotangent_like
from jax_bridge.grouped_matmul import checks, triton, xla
from jax_bridge.grouped_matmul.options import MatmulOptions
from jax_bridge.launch.target import interpreting
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig, GroupedMatmulConfigs

_BACKENDS = BackendTable("grouped_matmul", {"xla": xla, "triton": triton})
# What `refuse_forward_mode` offers instead (the gradients are grouped matmuls again).
_REVERSE_MODE = (
    "Reverse mode works to any order: jax.grad, jax.vjp, jax.jacrev, grad of grad; for a "
    "Hessian use jax.jacrev(jax.jacrev(f)) instead of jax.hessian."
)


def _options(op: str, implementation, interpret, precision, config, tiling, out_dtype, sizes, **kw):
    """Validated `MatmulOptions` of one public call of (m, k, n) `sizes`. A tiling
    callable is asked for them here, where a kernel of these sizes would ask it (no
    config replaces the tiling, no size is 0), so that a bad answer is refused on every
    backend; the Triton kernels ask again for each of their own sizes."""
    interpret = check_bool(op, interpret, "interpret")
    checks.check_tiling_arg(tiling)
    if 0 not in sizes and not _replaces_tiling(config):
        checks.resolve_tiling(tiling, *sizes)
    if config is not None and not isinstance(config, GroupedMatmulConfig | GroupedMatmulConfigs):
        raise TypeError(
            f"{op}: config must be a GroupedMatmulConfig, a GroupedMatmulConfigs or None, "
            f"got {type(config).__name__}."
        )
    return MatmulOptions(
        implementation=_BACKENDS.resolve(implementation, interpret=interpret),
        precision=canonicalize_precision(precision, op),
        config=config,
        interpret=interpret,
        preferred_element_type=out_dtype,
        tiling=tuple(tiling) if isinstance(tiling, list) else tiling,
        **kw,
    )


def _replaces_tiling(config: Any) -> bool:
    """Whether `config` gives every kernel its launch (one config, or both entries)."""
    if isinstance(config, GroupedMatmulConfigs):
        return config.gmm is not None and config.tgmm is not None
    return config is not None


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type: Any = jnp.float32,
    tiling: checks.TilingArg = None,
    group_offset: jax.Array | int | None = None,
    existing_out: jax.Array | None = None,
    transpose_rhs: bool = False,
    interpret: bool = False,
    precision: Any = None,
    implementation: str = "auto",
    config: GroupedMatmulConfig | GroupedMatmulConfigs | None = None,
) -> jax.Array:
    """Grouped matmul: `out[rows of group i] = lhs[rows of group i] @ rhs[i]`.

    Args:
      lhs: [m, k], rows sorted by group.
      rhs: [num_groups, k, n], or [num_groups, n, k] with `transpose_rhs=True`.
      group_sizes: int32 [num_groups_total], rows per group; `sum <= m`. Rows past the
        sum belong to no group. Without `group_offset`, `num_groups_total == num_groups`.
        Traced sizes are not checked: a negative one counts as 0, and the groups are cut
        at the m rows that exist, exactly (a sum past int32 does not wrap around).
      preferred_element_type: dtype of the result (None: the operands' dtype promoted to
        at least float32, e.g. float32 for bf16 and float64 for float64 operands);
        products accumulate in float32.
      tiling: `(tm, tk, tn)` block sizes of the Triton kernels (powers of two >= 16,
        shrunk to small dimensions), a callable `(m, k, n) -> (tm, tk, tn) | None`, or
        None (the default) to let each kernel's launch configuration choose for the GPU
        (`gmm_config`, and `tgmm_config` for the weight gradient): megablox's (128, 128,
        128), half the k step for float32; on Hopper at 16 bits gmm takes (128, 64, 256)
        without `existing_out`, and the weight gradient (64, 128, 128) where groups
        average at most 256 rows, (128, 128, 256) at 8 warps over longer ones. A tiling
        given here is used by the gradient's matmuls too, each at its own sizes. `m` need
        not be a multiple of `tm`.
      group_offset: int or int32 scalar (may be traced): `rhs` holds groups
        `[group_offset, group_offset + num_groups)` of those described by `group_sizes`
        (expert parallelism). Only their rows are computed. A traced offset is not
        checked: outside `[0, num_groups_total - num_groups]` it is taken as
        `jax.lax.dynamic_slice` takes a start (a negative one counts from the end, then
        it is clamped into that range), so the local groups are always real ones.
      existing_out: [m, n] of `preferred_element_type`: the result is added to it.
      transpose_rhs: `rhs` is stored `[num_groups, n, k]`.
      interpret: run the Triton kernels through Triton's interpreter (on the host, even
        where a GPU exists), as the API this op follows (megablox) runs its kernel in
        interpret mode. Selects implementation "triton".
      precision: how float32 inputs are multiplied, as in `jax.lax.dot`; None (the
        default) is `Precision.HIGHEST`, exact float32 products on every backend.
        DEFAULT allows TF32 on NVIDIA GPUs, HIGH three TF32 passes (see
        `jax_bridge.core.precision`). 16-bit inputs always multiply exactly with
        float32 accumulation.
      implementation: "auto" (Triton on GPUs, else XLA), "triton" or "xla".
      config: the Triton kernels' full launch configuration (block sizes, warps,
        stages), used as given for this call and its gradient's matmuls, but for pipeline
        stages where a launch could not hold them in shared memory (tgmm, the weight
        gradient, holds other tiles a stage than gmm); it replaces `tiling`. A
        `GroupedMatmulConfigs` gives each kernel its own (gmm: this call and the input
        gradient; tgmm: the weight gradient), its None entries left to `tiling` and the
        shape. None: `tiling` and the shape decide.

    Returns:
      [m, n] of `preferred_element_type`. Rows of groups outside the local range, and
      rows past `sum(group_sizes)`, are `existing_out`'s, or zero when it is None.

    Raises:
      TypeError / ValueError naming the argument for bad dtypes, shapes, tilings, and
      (when concrete) `group_sizes` summing past `m` or an out-of-range `group_offset`.
    """
    with naming_op("grouped_matmul"):
        transpose_rhs = check_bool("grouped_matmul", transpose_rhs, "transpose_rhs")
        checks.check_operands(lhs, rhs, lhs_doc="[m, k]", rhs_doc="[num_groups, k, n]")
        m, k = lhs.shape
        num_groups = rhs.shape[0]
        if num_groups < 1:
            raise ValueError(f"rhs must hold at least one group, got shape {tuple(rhs.shape)}.")
        rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
        n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        layout = (
            "[num_groups, n, k] (transpose_rhs=True)" if transpose_rhs else "[num_groups, k, n]"
        )
        checks.check_dimension("rhs", rhs_k, k, f"k of rhs {layout} vs lhs [m, k]")
        out_dtype = checks.check_preferred_element_type(preferred_element_type, lhs.dtype)
        checks.check_existing_out(existing_out, shape=(m, n), dtype=out_dtype)
        group_sizes, group_offset = checks.check_groups(
            group_sizes, group_offset, m=m, num_groups=num_groups
        )
        options = _options(
            "grouped_matmul",
            implementation,
            interpret,
            precision,
            config,
            tiling,
            out_dtype,
            (m, k, n),
            transpose_rhs=transpose_rhs,
        )
    refuse_forward_mode("grouped_matmul", lhs, rhs, existing_out, works=_REVERSE_MODE)
    return _gmm(lhs, rhs, group_sizes, group_offset, existing_out, options)


def transposed_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type: Any = jnp.float32,
    tiling: checks.TilingArg = None,
    group_offset: jax.Array | int | None = None,
    num_groups: int | None = None,
    existing_out: jax.Array | None = None,
    interpret: bool = False,
    precision: Any = None,
    implementation: str = "auto",
    config: GroupedMatmulConfig | GroupedMatmulConfigs | None = None,
) -> jax.Array:
    """Transposed grouped matmul (gmm's weight gradient): `out[i] = lhs[:, rows of i] @
    rhs[rows of i]`.

    Args:
      lhs: [k, m], columns sorted by group.
      rhs: [m, n], rows sorted by group.
      group_sizes: int32 [num_groups_total]; `sum <= m`; rows past the sum are ignored.
        Traced sizes and offsets are not checked: as in `grouped_matmul`.
      preferred_element_type: dtype of the result (None: the operands' dtype promoted to
        at least float32, e.g. float32 for bf16 and float64 for float64 operands);
        products accumulate in float32.
      tiling: `(tm, tk, tn)`, a callable `(m, k, n) -> (tm, tk, tn) | None`, or None
        (the default: `tgmm_config`'s, (128, 128, 128), (64, 128, 128) for float32); here
        `tm` is the step over a group's rows and a program owns a `[tk, tn]` tile.
      group_offset: int or int32 scalar (may be traced): compute groups
        `[group_offset, group_offset + num_groups)` only (a traced one out of range: as
        in `grouped_matmul`).
      num_groups: groups in the result, a static int >= 1 (TypeError / ValueError);
        defaults to `len(group_sizes)` and must be given with `group_offset`.
      existing_out: [num_groups, k, n] of `preferred_element_type`: added to the result.
      interpret, precision, implementation, config: as in `grouped_matmul`. This op's
        lhs [k, m] is read by pointers: tgmm's descriptors need the token-major lhs of
        grouped_matmul's weight gradient, so `tma` in one config reaches this call's
        gradient (its gmm launches) only, and in a `GroupedMatmulConfigs`' tgmm entry,
        which would reach nothing, it is refused.

    Returns:
      [num_groups, k, n] of `preferred_element_type`; an empty group gives zeros (or its
      `existing_out`).
    """
    # The checks it shares with grouped_matmul (the backend table's included) name this op.
    with naming_op("transposed_grouped_matmul", replacing=("grouped_matmul",)):
        checks.check_operands(lhs, rhs, lhs_doc="[k, m]", rhs_doc="[m, n]")
        k, m = lhs.shape
        n = rhs.shape[1]
        checks.check_dimension("rhs", rhs.shape[0], m, "m of rhs [m, n] vs lhs [k, m]")
        if num_groups is None:
            if group_offset is not None:
                raise ValueError("num_groups must be given with group_offset.")
            num_groups = np.shape(group_sizes)[0] if np.ndim(group_sizes) == 1 else 1
            if num_groups == 0:
                raise ValueError(
                    "group_sizes must hold at least one group (num_groups defaults to its "
                    "length), got shape (0,)."
                )
        num_groups = check_static_int(num_groups, "num_groups", minimum=1)
        out_dtype = checks.check_preferred_element_type(preferred_element_type, lhs.dtype)
        checks.check_existing_out(existing_out, shape=(num_groups, k, n), dtype=out_dtype)
        group_sizes, group_offset = checks.check_groups(
            group_sizes, group_offset, m=m, num_groups=num_groups,
            m_of="the columns of lhs [k, m]", groups_of="the result (num_groups)",
        )  # fmt: skip
        options = _options(
            "transposed_grouped_matmul",
            implementation,
            interpret,
            precision,
            config,
            tiling,
            out_dtype,
            (m, k, n),
        )
        _refuse_tgmm_descriptors(config)
    refuse_forward_mode("transposed_grouped_matmul", lhs, rhs, existing_out, works=_REVERSE_MODE)
    return _tgmm(lhs, rhs, group_sizes, group_offset, existing_out, num_groups, options)


def _refuse_tgmm_descriptors(config: GroupedMatmulConfig | GroupedMatmulConfigs | None) -> None:
    """ValueError for `tma` in a `GroupedMatmulConfigs`' tgmm entry: tgmm's descriptors
    span a group's rows of a token-major lhs ([m, k], as grouped_matmul's weight gradient
    has it), while this op's lhs is [k, m], read by pointers, and that entry reaches no
    other launch: the option would be dropped silently. (One config for every kernel
    keeps it: the gradient's gmm launches take it.)"""
    if isinstance(config, GroupedMatmulConfigs) and config.tgmm is not None and config.tgmm.tma:
        raise ValueError(
            "config.tgmm tma=True is for tgmm over a token-major lhs (grouped_matmul's "
            "weight gradient); this op's lhs [k, m] is read by pointers: pass tma=False "
            "in the tgmm entry."
        )


# --- gmm: implementation dispatch and custom_vjp -------------------------------------


def _interpreting_if(interpret: bool) -> contextlib.AbstractContextManager:
    """`interpret=True`: the Triton kernels launch through the interpreter, GPU or not;
    False leaves where they launch to the caller (an enclosing `interpreting()` holds)."""
    return interpreting() if interpret else contextlib.nullcontext()


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm(lhs, rhs, group_sizes, group_offset, existing_out, options: MatmulOptions):
    with _interpreting_if(options.interpret):
        return _BACKENDS[options.implementation].gmm(
            lhs, rhs, group_sizes, group_offset, existing_out, options
        )


def _gmm_fwd(lhs, rhs, group_sizes, group_offset, existing_out, options: MatmulOptions):
    # Forward over reverse (jax.hessian) reaches the rule with tangent-carrying inputs.
    refuse_forward_mode("grouped_matmul", lhs, rhs, existing_out, works=_REVERSE_MODE)
    out = _gmm(lhs, rhs, group_sizes, group_offset, existing_out, options)
    return out, (lhs, rhs, group_sizes, group_offset, existing_out is not None)


def _gmm_bwd(options: MatmulOptions, residuals, d_out):
    lhs, rhs, group_sizes, group_offset, accumulated = residuals
    grad = d_out.astype(lhs.dtype)
    d_lhs = _gmm(
        grad,
        rhs,
        group_sizes,
        group_offset,
        None,
        dataclasses.replace(
            options,
            preferred_element_type=np.dtype(lhs.dtype),
            transpose_rhs=not options.transpose_rhs,
        ),
    )
    weight_options = dataclasses.replace(
        options, preferred_element_type=np.dtype(rhs.dtype), lhs_token_major=True
    )
    num_groups = rhs.shape[0]
    if options.transpose_rhs:  # rhs: [g, n, k]; d_rhs[g] = d_out[rows].T @ lhs[rows]
        d_rhs = _tgmm(grad, lhs, group_sizes, group_offset, None, num_groups, weight_options)
    else:  # rhs: [g, k, n]; d_rhs[g] = lhs[rows].T @ d_out[rows]
        d_rhs = _tgmm(lhs, grad, group_sizes, group_offset, None, num_groups, weight_options)
    return _cotangents(lhs, rhs, d_lhs, d_rhs, d_out if accumulated else None)


def _cotangents(lhs, rhs, d_lhs, d_rhs, d_existing_out):
    """The custom_vjp's cotangents, each typed (inside shard_map) as its primal is;
    group sizes and the offset are integers (None)."""
    d_lhs, d_rhs = cotangent_like(d_lhs, lhs), cotangent_like(d_rhs, rhs)
    return d_lhs, d_rhs, None, None, d_existing_out


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# --- tgmm: implementation dispatch and custom_vjp ------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tgmm(lhs, rhs, group_sizes, group_offset, existing_out, num_groups: int, options):
    with _interpreting_if(options.interpret):
        return _BACKENDS[options.implementation].tgmm(
            lhs, rhs, group_sizes, group_offset, existing_out, num_groups, options
        )


def _tgmm_fwd(lhs, rhs, group_sizes, group_offset, existing_out, num_groups, options):
    refuse_forward_mode("transposed_grouped_matmul", lhs, rhs, existing_out, works=_REVERSE_MODE)
    out = _tgmm(lhs, rhs, group_sizes, group_offset, existing_out, num_groups, options)
    return out, (lhs, rhs, group_sizes, group_offset, existing_out is not None)


def _tgmm_bwd(num_groups: int, options: MatmulOptions, residuals, d_out):
    # out[g] = L[:, rows] @ R[rows] with L = lhs ([k, m]) or lhs.T (token major).
    lhs, rhs, group_sizes, group_offset, accumulated = residuals
    grad = d_out.astype(lhs.dtype)  # [g, k, n]
    lhs_rows = lhs if options.lhs_token_major else lhs.T  # [m, k]
    gmm_options = dataclasses.replace(options, lhs_token_major=False)
    # d_L.T[rows of g] = R[rows] @ d_out[g].T: gmm with d_out read as [g, n_out=k, k_in=n].
    d_lhs_rows = _gmm(
        rhs,
        grad,
        group_sizes,
        group_offset,
        None,
        dataclasses.replace(
            gmm_options, preferred_element_type=np.dtype(lhs.dtype), transpose_rhs=True
        ),
    )
    # d_R[rows of g] = L[:, rows].T @ d_out[g] = L.T[rows] @ d_out[g].
    d_rhs = _gmm(
        lhs_rows,
        grad,
        group_sizes,
        group_offset,
        None,
        dataclasses.replace(
            gmm_options, preferred_element_type=np.dtype(rhs.dtype), transpose_rhs=False
        ),
    )
    d_lhs = d_lhs_rows if options.lhs_token_major else d_lhs_rows.T
    return _cotangents(lhs, rhs, d_lhs, d_rhs, d_out if accumulated else None)


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)
