"""The Triton backend of block-sparse attention: the kernels of
`triton_kernels.block_sparse`, launched through `triton_call` (on a GPU, or on a CPU
through Triton's interpreter).

Backend contract: see `jax_bridge.block_sparse.api`. Each kernel gets its own tile lists
(`tile_lists`) for its own tile shape: the forward and dQ kernels keep a query tile and
visit key tiles, the dK/dV kernel the reverse. Every stationary tile of every head gets a
program (a tile with nothing to visit writes zeros, lse -inf or the sink, and exits), so
every output element is written; programs take the heaviest tiles first. Tile shapes
are the varlen kernels' defaults for the device, unless `block_sizes` gives them:
(block_q, block_kv) for the forward, (block_q_dq, block_kv_dq) for dQ and (block_q_dkv,
block_kv_dkv) for dK/dV; a kernel's `config` (`options.config`) gives its whole launch
configuration, tile, warps and stages.

Each kernel is launched twice (`_launch_twice`): first reading the operands as given,
then, CAREFUL, again for only the programs whose results the first found non-finite,
with the non-finite rows isolated (`triton_kernels.block_sparse.forward` says why).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.block_sparse.checks import TRITON_BLOCK_FIELDS
from jax_bridge.block_sparse.masks import head_groups, join_mask, padded_shape
from jax_bridge.block_sparse.options import BlockSparseOptions
from jax_bridge.block_sparse.tile_lists import (
    TABLE,
    ElementRule,
    TileLists,
    element_rule,
    tile_lists,
)
from jax_bridge.core.precision import triton_input_precision
from jax_bridge.launch.target import follow_lowering_platform, launch_target
from jax_bridge.launch.triton_call import float32_or_placeholder, triton_call
from triton_kernels.block_sparse.backward import block_sparse_dkdv_kernel, block_sparse_dq_kernel
from triton_kernels.block_sparse.config import block_sparse_config
from triton_kernels.block_sparse.forward import block_sparse_forward_kernel
from triton_kernels.flash_attention.config import MAX_HEAD_DIM, MIN_HEAD_DIM
from triton_kernels.flash_attention.constexprs import (
    block_sparse_constexprs,
    finds_bad_rows_in_kernel,
)

HEAD_DIMS = (MIN_HEAD_DIM, MAX_HEAD_DIM)


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """One call's launch plan: each kernel's config, the head groups, the rule and
    whether ALiBi is on."""

    configs: dict[str, Any]
    groups: tuple[tuple[tuple[int, ...], Any], ...]
    rule: ElementRule
    q_len: int
    kv_len: int
    has_alibi: bool

    def lists(self, kind: str) -> TileLists:
        config = self.configs[kind]
        block_shape = (config.block_m, config.block_n)
        kv_major = kind == "backward_dkdv"
        return tile_lists(self.groups, block_shape, self.q_len, self.kv_len, kv_major)

    def group_heads(self) -> np.ndarray:
        """int32 [G, width]: each group's query heads, -1 padded."""
        width = max(len(heads) for heads, _ in self.groups)
        rows = [list(heads) + [-1] * (width - len(heads)) for heads, _ in self.groups]
        return np.asarray(rows, np.int32)

    def head_group(self, num_q_heads: int) -> np.ndarray:
        """int32 [Hq]: each query head's group."""
        group = np.zeros(num_q_heads, np.int32)
        for g, (heads, _) in enumerate(self.groups):
            group[list(heads)] = g
        return group


def _config(options: BlockSparseOptions, kind: str, head_dim: int, dtype, alibi: bool) -> Any:
    chosen = None if options.config is None else getattr(options.config, kind)
    if chosen is not None:  # its tile agrees with block_sizes' (`checks.check_config`)
        return chosen
    capability = launch_target().compute_capability
    soft_cap = options.logits_soft_cap is not None
    config = block_sparse_config(
        head_dim, jnp.dtype(dtype).name, capability, kind, soft_cap=soft_cap, alibi=alibi
    )
    given = options.block_sizes
    if given is None:
        return config
    block_q, block_kv = (getattr(given, name) for name in TRITON_BLOCK_FIELDS[kind])
    return dataclasses.replace(
        config, block_m=block_q or config.block_m, block_n=block_kv or config.block_n
    )


def _plan(options: BlockSparseOptions, mask_arrays, q, k, alibi) -> _Plan:
    _, q_len, num_q_heads, head_dim = q.shape
    kv_len = k.shape[1]
    has_alibi = alibi is not None
    configs = {
        kind: _config(options, kind, head_dim, q.dtype, has_alibi) for kind in TRITON_BLOCK_FIELDS
    }
    mask = join_mask(options.mask, mask_arrays)
    groups = head_groups(mask, num_q_heads)
    # Token arrays cover every kernel's padded rows and columns.
    padded = [padded_shape(q_len, kv_len, (c.block_m, c.block_n)) for c in configs.values()]
    q_tokens, kv_tokens = (max(p[i] for p in padded) for i in (0, 1))
    rule = element_rule(groups, q_tokens, kv_tokens)
    return _Plan(configs, groups, rule, q_len, kv_len, has_alibi)


def _common_arguments(plan: _Plan, lists: TileLists, options: BlockSparseOptions) -> tuple:
    """The kernels' shared arguments after their group map: lists, rule, lengths, scalars."""
    n_tiles, width = lists.shape
    table = lists.table if plan.rule.mode == TABLE else np.zeros((1,), np.int8)
    arrays = (lists.counts, lists.tiles, lists.codes, table, *plan.rule.arrays)
    return (
        *(jnp.asarray(x) for x in arrays),
        plan.q_len,
        plan.kv_len,
        n_tiles,
        width,
        np.float32(options.softmax_scale),
        np.float32(options.logits_soft_cap or 1.0),
        *plan.rule.scalars(),
    )


def _launch(
    plan: _Plan,
    options: BlockSparseOptions,
    kind: str,
    q,
    k,
    *,
    sinks: bool = False,
    find_bad_rows: bool = False,
    has_d_lse: bool = False,
) -> dict:
    """The launch keywords of kernel `kind`: warps, stages, name and the constexprs
    (`block_sparse_constexprs`; find_bad_rows, has_d_lse: as the arguments passed)."""
    config = plan.configs[kind]
    score_mod = options.score_mod
    constexprs = block_sparse_constexprs(
        kind,
        config,
        plan.rule.flags(),
        num_q_heads=q.shape[2],
        num_kv_heads=k.shape[2],
        head_dim=q.shape[-1],
        softmax_scale=options.softmax_scale,
        input_precision=triton_input_precision(options.precision, q.dtype),
        soft_cap=options.logits_soft_cap is not None,
        alibi=plan.has_alibi,
        sinks=sinks,
        score_mod=None if score_mod is None else score_mod.triton_fn,
        score_mod_grad=None if score_mod is None else score_mod.triton_grad,
        group_width=plan.group_heads().shape[1],
        find_bad_rows=find_bad_rows,
        has_d_lse=has_d_lse,
    )
    return dict(
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        name=_KERNEL_NAMES[kind],
        **constexprs,
    )


_KERNEL_NAMES = {
    "forward": "block_sparse_attention_fwd",
    "backward_dq": "block_sparse_attention_bwd_dq",
    "backward_dkdv": "block_sparse_attention_bwd_dkdv",
}


def _isolated(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x with its non-finite rows zeroed, int8 [B, L, H] flags of those rows) for x
    [B, L, H, D]: what the partial tiles' isolating products read (one fused pass).

    Behind an optimization barrier, XLA cannot constant-fold the flags when x is a
    broadcast constant (the cotangent of `sum(out)`): at 8192 tokens x 8 heads its
    evaluator spent minutes on that reduce, for nothing at run time."""
    x = jax.lax.optimization_barrier(x)
    bad = jnp.logical_not(jnp.all(jnp.isfinite(x), axis=-1))
    return jnp.where(bad[..., None], jnp.zeros((), x.dtype), x), bad.astype(jnp.int8)


def _query_row_flags(q: jax.Array, d_out: jax.Array) -> jax.Array:
    """int8 [B, L, H]: bit 0 where q's row holds a NaN or an infinity, bit 1 where
    d_out's does (the dK/dV kernel's row flags; behind an optimization barrier as
    `_isolated`'s)."""
    q, d_out = jax.lax.optimization_barrier((q, d_out))
    bad = lambda x: jnp.logical_not(jnp.all(jnp.isfinite(x), axis=-1)).astype(jnp.int8)
    return bad(q) | (bad(d_out) * 2)


def _isolation(x: jax.Array, find_bad_rows: bool) -> tuple[jax.Array, jax.Array]:
    """A kernel's (clean copy, flags) arguments for operand x: `_isolated(x)`, or, for a
    FIND_BAD_ROWS kernel, x itself and a placeholder for the flags, neither read."""
    return (x, jnp.zeros((1,), jnp.int8)) if find_bad_rows else _isolated(x)


def _launch_twice(*args: Any, out_shape: tuple, grid: tuple[int, int, int], **launch: Any):
    """A block-sparse kernel's outputs (one per `out_shape` entry) from its two launches.

    The kernel's parameters after `args`: redo_in_ptr, one input per output (what the
    second launch's outputs alias), the outputs, redo_ptr. The first launch reads its
    operands as given and sets an int8 flag (one a program, zeroed ahead) for each
    program whose result holds a NaN or an infinity; the second (CAREFUL) takes those
    flags and the first's outputs, which it overwrites only for flagged programs. The
    first launch's aliased inputs are placeholders, never read."""
    placeholder = jnp.zeros((1,), jnp.int8)
    flags = jax.ShapeDtypeStruct((math.prod(grid),), jnp.int8)
    *outputs, redo = triton_call(
        *args, placeholder, *(placeholder for _ in out_shape),
        out_shape=(*out_shape, flags), grid=grid, zeroed_outputs=(len(out_shape),), **launch,
    )  # fmt: skip
    first_output = len(args) + 1  # the argument index of the first aliased output
    *outputs, _ = triton_call(
        *args, redo, *outputs,
        out_shape=(*out_shape, jax.ShapeDtypeStruct((1,), jnp.int8)), grid=grid,
        input_output_aliases={first_output + i: i for i in range(len(out_shape))},
        **(launch | dict(CAREFUL=True)),
    )  # fmt: skip
    return tuple(outputs)


def _hook_heads(options: BlockSparseOptions, num_q_heads: int) -> jax.Array:
    """int32 [Hq]: the head number the score hook sees for each query head of the call."""
    heads = options.hook_heads or range(num_q_heads)
    return jnp.asarray(np.asarray(heads, np.int32))


@follow_lowering_platform
def forward(q, k, v, sinks, alibi, mask_arrays, options: BlockSparseOptions):
    """(out [B, Lq, Hq, D] in q's dtype, lse float32 [B, Hq, Lq]); see the api."""
    batch, q_len, num_q_heads, _ = q.shape
    plan = _plan(options, mask_arrays, q, k, alibi)
    lists = plan.lists("forward")
    group_heads = plan.group_heads()
    find_bad_rows = finds_bad_rows_in_kernel(launch_target().compute_capability)
    return _launch_twice(
        q,
        k,
        v,
        *_isolation(v, find_bad_rows),
        float32_or_placeholder(sinks),
        float32_or_placeholder(alibi),
        _hook_heads(options, num_q_heads),
        jnp.asarray(lists.items),
        jnp.asarray(group_heads),
        *_common_arguments(plan, lists, options),
        kernel=block_sparse_forward_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_q_heads, q_len), jnp.float32),
        ),
        grid=(lists.items.shape[0], group_heads.shape[1], batch),
        **_launch(
            plan, options, "forward", q, k, sinks=sinks is not None, find_bad_rows=find_bad_rows
        ),
    )


@follow_lowering_platform
def backward(
    q, k, v, out, lse, d_out, d_lse, sinks, alibi, mask_arrays, options: BlockSparseOptions
):
    """(dq, dk, dv) in the inputs' dtypes; see the api."""
    del sinks  # lse includes the sink
    batch = q.shape[0]
    plan = _plan(options, mask_arrays, q, k, alibi)
    per_head = (float32_or_placeholder(alibi), _hook_heads(options, q.shape[2]))
    lists = plan.lists("backward_dq")
    group_heads = plan.group_heads()
    find_bad_rows = finds_bad_rows_in_kernel(launch_target().compute_capability)
    # The non-finite rows of q and dO, which dK/dV's partial tiles read as zeros: flagged
    # by the dQ kernel where it finds bad rows itself, else by XLA.
    flags_shape = q.shape[:3] if find_bad_rows else (1,)
    # The row statistics dK/dV reads (lse in log2 units, delta), from the dQ kernel.
    stats = jax.ShapeDtypeStruct(lse.shape, jnp.float32)
    dq, row_flags, lse_log2, delta = _launch_twice(
        q, k, v, d_out, out, lse.astype(jnp.float32), float32_or_placeholder(d_lse),
        *per_head, *_isolation(k, find_bad_rows), jnp.asarray(lists.items),
        jnp.asarray(group_heads), *_common_arguments(plan, lists, options),
        kernel=block_sparse_dq_kernel,
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(flags_shape, jnp.int8),
            stats, stats,
        ),
        grid=(lists.items.shape[0], group_heads.shape[1], batch),
        **_launch(
            plan, options, "backward_dq", q, k, find_bad_rows=find_bad_rows,
            has_d_lse=d_lse is not None,
        ),
    )  # fmt: skip
    if not find_bad_rows:
        row_flags = _query_row_flags(q, d_out)
    lists = plan.lists("backward_dkdv")
    dk, dv = _launch_twice(
        q, k, v, d_out, lse_log2, delta, *per_head, row_flags, jnp.asarray(lists.items),
        jnp.asarray(plan.head_group(q.shape[2])), *_common_arguments(plan, lists, options),
        kernel=block_sparse_dkdv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(lists.items.shape[0], k.shape[2], batch),
        **_launch(plan, options, "backward_dkdv", q, k),
    )  # fmt: skip
    return dq, dk, dv
