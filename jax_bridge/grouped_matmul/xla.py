"""The XLA implementation of gmm and tgmm: a loop over row tiles, or `ragged_dot_general`.

Two strategies, one rule (`ragged_dot_is_faster`) choosing between them per platform:

* **Tiles** (CPU and GPU): walk the `cdiv(m, tm) + num_groups - 1` (group, tile) slots
  of `make_group_metadata`, exactly the work items of the Triton gmm kernel, in a
  `fori_loop` over the real chunks. Each chunk is one `[tm, k] x [k, n]` product
  (gmm) or `[k, tm] x [tm, n]` product (tgmm), so the work is the dense per-group work
  plus at most one partial tile per group. Rows outside the chunk's group are
  removed by *selection*, never by multiplying with a 0/1 mask: NaN or Inf in one
  group's rows or weights cannot reach another group's rows (gmm: a product row depends
  on its own lhs row only, and foreign rows are selected away; tgmm: foreign rows are
  selected to zero on both operands before they are contracted). The loop is ordinary
  `dynamic_slice` code, so it batches under `jax.vmap` (shared weights, batched group
  sizes, batched offsets) and jits with traced sizes and offsets.
* **ragged_dot** (TPU): `jax.lax.ragged_dot_general`, which XLA lowers natively there.
  On CPU XLA expands it into one dense product per group (num_groups times the work:
  25-40x slower than the tiles at 64 groups) and mixes NaN across groups; it has no
  `vmap` rule, so under `vmap` it falls back to the tiles (`jax.custom_batching`).

Measured on this project's 2-core CPU (float32, `python -m bench grouped_matmul`):
m=8192, k=2048, n=1408: the tiles take 0.9-1.3x the time of a jitted per-group `jnp.dot`
loop at 64 groups and ~1.1x at 8 (forward; forward+backward 0.4-1.1x), ragged_dot 10x
(8 groups) to 75x (64 groups) the tiles' time; already at m=256, k=n=64 with 8 groups the
tiles are 3x faster. Only at toy sizes (m <= 64, k, n <= 32) is ragged_dot faster, by
~0.15 ms of loop overhead,
which does not pay for losing NaN isolation and vmap, so CPU always runs the tiles. GPU
runs the tiles as well: `auto` picks Triton there, and XLA's GPU ragged_dot has not been
measured against them (no GPU on the machines this was built on).

Backend contract (see `jax_bridge.grouped_matmul.api`): `gmm`, `tgmm`.

Semantics match the Triton path: products accumulate in float32 (float64 for float64
operands or output), rows of no local group keep `existing_out` bit for bit (or are
zero), empty groups of tgmm give zeros (or their `existing_out`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.core.vma import varying_like
from jax_bridge.grouped_matmul.metadata import (
    chunk_row_bounds,
    local_group_bounds,
    make_group_metadata,
)
from jax_bridge.grouped_matmul.options import MatmulOptions

# Platforms whose XLA lowers ragged_dot to a grouped kernel rather than a dense product
# per group (see the module docstring for the measurements behind this set).
RAGGED_DOT_PLATFORMS = frozenset({"tpu"})

# Row tile bounds (powers of two). Below 64 rows the per-chunk loop overhead shows at
# small k, n; above 256 the partial tiles at group boundaries cost more than the larger
# products gain (both measured at m=8192, k=2048, n=1408 with 8 and 64 groups).
_MIN_TILE_ROWS, _MAX_TILE_ROWS = 64, 256


def ragged_dot_is_faster(platform: str | None = None) -> bool:
    """The one rule choosing the XLA strategy: True runs `ragged_dot_general`, False tiles.

    Args:
      platform: a JAX platform name ("cpu", "gpu", "cuda", "rocm", "tpu"); None is
        `jax.default_backend()`, the platform the op is traced for.
    """
    return (jax.default_backend() if platform is None else platform) in RAGGED_DOT_PLATFORMS


def tile_rows(m: int, num_groups: int) -> int:
    """Rows per tile: the power of two <= the mean group size, clamped to [64, 256], <= m.

    The mean group size bounds the waste: a chunk list holds at most `num_groups - 1`
    tiles more than `cdiv(m, tm)`, so with `tm <= m / num_groups` the padding rows are at
    most about the real rows (measured: 1.2-1.3x the per-group loop at 64 groups).
    """
    mean = max(m // max(num_groups, 1), 1)
    tm = 1 << (mean.bit_length() - 1)
    return max(min(min(max(tm, _MIN_TILE_ROWS), _MAX_TILE_ROWS), m), 1)


def _accumulator_dtype(*dtypes) -> np.dtype:
    """float32, or float64 when an operand or the output is float64."""
    return np.dtype(jnp.promote_types(jnp.float32, jnp.result_type(*dtypes)))


def _slot_rows(meta, lo: jax.Array, hi: jax.Array, s: jax.Array, tm: int, m: int):
    """(first row of slot s's tile, [tm] bool: the tile rows slot s computes).

    The tile starts at the slot's first row, shifted up to end at row m where it would
    pass it (so `dynamic_slice` never clamps it behind our back); the mask keeps exactly
    the rows `[lo[s], hi[s])` of the slot, so shifted-in rows are never computed twice.
    """
    start = jnp.minimum(meta.chunk_row_start[s], m - tm)
    rows = start + jnp.arange(tm, dtype=jnp.int32)
    return start, (rows >= lo[s]) & (rows < hi[s])


def gmm_tiles(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    preferred_element_type: jnp.dtype,
    transpose_rhs: bool,
    precision: jax.lax.Precision,
) -> jax.Array:
    """`out[rows of g] = lhs[rows of g] @ rhs[g]` (+ existing_out) for local groups g.

    lhs: [m, k]; rhs: [num_groups, k, n] ([num_groups, n, k] if `transpose_rhs`);
    group_sizes: int32 [num_groups_total]; existing_out: [m, n] or None -> [m, n].
    """
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = np.dtype(preferred_element_type)
    if m == 0 or n == 0 or k == 0:  # nothing to multiply: every row keeps its init
        return existing_out if existing_out is not None else jnp.zeros((m, n), out_dtype)
    tm = tile_rows(m, num_groups)
    meta = make_group_metadata(
        group_sizes,
        m=m,
        block_m=tm,
        group_offset=0 if group_offset is None else group_offset,
        num_groups=num_groups,
    )
    lo, hi = chunk_row_bounds(meta, tm)
    acc = _accumulator_dtype(lhs.dtype, out_dtype)
    accumulate = existing_out is not None
    # The carry holds every row's final value; a row no chunk covers keeps its init, and
    # existing_out -> acc -> out_dtype is exact (acc is at least as wide).
    init = existing_out.astype(acc) if accumulate else jnp.zeros((m, n), acc)
    init = varying_like(init, lhs, rhs, group_sizes, group_offset, existing_out)
    contract = (((1,), (1 if transpose_rhs else 0,)), ((), ()))  # weights: [k, n] or [n, k]

    def chunk(s, out):
        start, inside = _slot_rows(meta, lo, hi, s, tm, m)
        tile = jax.lax.dynamic_slice_in_dim(lhs, start, tm)  # [tm, k]
        weights = jax.lax.dynamic_index_in_dim(rhs, meta.chunk_group[s], keepdims=False)
        product = jax.lax.dot_general(
            tile, weights, contract, precision=precision, preferred_element_type=acc
        )  # [tm, n]; row i depends on tile row i and the chunk's own weights only
        block = jax.lax.dynamic_slice_in_dim(out, start, tm)
        # Each row lies inside exactly one chunk, so without existing_out its block rows
        # are still the zeros of init: select the product instead of adding to them.
        new = block + product if accumulate else product
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(inside[:, None], new, block), start, axis=0
        )

    out = jax.lax.fori_loop(0, meta.num_chunks[0], chunk, init)
    return out.astype(out_dtype)


def tgmm_tiles(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int,
    group_offset: jax.Array | None,
    existing_out: jax.Array | None,
    preferred_element_type: jnp.dtype,
    lhs_token_major: bool,
    precision: jax.lax.Precision,
) -> jax.Array:
    """`out[g] = lhs[:, rows of g] @ rhs[rows of g]` (+ existing_out) for local groups g.

    lhs: [k, m] ([m, k] if `lhs_token_major`); rhs: [m, n]; group_sizes: int32
    [num_groups_total]; existing_out: [num_groups, k, n] or None -> [num_groups, k, n].
    """
    token_axis = 0 if lhs_token_major else 1
    m, k = lhs.shape[token_axis], lhs.shape[1 - token_axis]
    n = rhs.shape[1]
    out_dtype = np.dtype(preferred_element_type)
    if m == 0 or n == 0 or k == 0:  # every group is empty, or its product is
        if existing_out is not None:
            return existing_out
        return jnp.zeros((num_groups, k, n), out_dtype)
    tm = tile_rows(m, num_groups)
    meta = make_group_metadata(
        group_sizes,
        m=m,
        block_m=tm,
        group_offset=0 if group_offset is None else group_offset,
        num_groups=num_groups,
    )
    lo, hi = chunk_row_bounds(meta, tm)
    acc = _accumulator_dtype(lhs.dtype, out_dtype)
    init = (
        existing_out.astype(acc) if existing_out is not None else jnp.zeros((num_groups, k, n), acc)
    )
    init = varying_like(init, lhs, rhs, group_sizes, group_offset, existing_out)
    contract = (((token_axis,), (0,)), ((), ()))

    def chunk(s, out):
        start, inside = _slot_rows(meta, lo, hi, s, tm, m)
        # Foreign rows are selected to zero on BOTH operands: 0 * NaN would be NaN.
        lhs_tile = jax.lax.dynamic_slice_in_dim(lhs, start, tm, axis=token_axis)
        lhs_tile = jnp.where(inside[:, None] if lhs_token_major else inside[None, :], lhs_tile, 0)
        rhs_tile = jnp.where(inside[:, None], jax.lax.dynamic_slice_in_dim(rhs, start, tm), 0)
        product = jax.lax.dot_general(
            lhs_tile, rhs_tile, contract, precision=precision, preferred_element_type=acc
        )  # [k, n]
        group = meta.chunk_group[s]
        total = jax.lax.dynamic_index_in_dim(out, group, keepdims=False) + product
        return jax.lax.dynamic_update_index_in_dim(out, total, group, axis=0)

    out = jax.lax.fori_loop(0, meta.num_chunks[0], chunk, init)
    return out.astype(out_dtype)


# --- ragged_dot (TPU) ---------------------------------------------------------------


def _local_sizes(
    group_sizes: jax.Array, m: int, group_offset: jax.Array | None, num_groups: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sizes of the local groups, first local row, one past the last local row)."""
    starts, ends = local_group_bounds(
        group_sizes,
        m=m,
        group_offset=0 if group_offset is None else group_offset,
        num_groups=num_groups,
    )
    return ends - starts, starts[0], ends[-1]


def _with_tile_batching(ragged_fn, tiles_fn):
    """`ragged_fn(*arrays)`, batched under `jax.vmap` by vmapping `tiles_fn` instead
    (ragged_dot has no batching rule). Both take the same positional arrays (or None)."""
    fn = jax.custom_batching.custom_vmap(ragged_fn)

    @fn.def_vmap
    def _rule(axis_size, in_batched, *args):
        in_axes = tuple(jax.tree.map(lambda b: 0 if b else None, x) for x in in_batched)
        return jax.vmap(tiles_fn, in_axes=in_axes, axis_size=axis_size)(*args), True

    return fn


def gmm_ragged_dot(lhs, rhs, group_sizes, group_offset, existing_out, *, options):
    """gmm through `ragged_dot_general` (same arrays and result as `gmm_tiles`).

    `ragged_dot_general` has no `group_offset`: its groups start at row 0. With an offset
    the local rows `[start, end)` are rotated to the top, multiplied, and rotated back;
    rows past the local groups come out zero.
    """
    m = lhs.shape[0]
    sizes, first_row, end_row = _local_sizes(group_sizes, m, group_offset, rhs.shape[0])
    if group_offset is not None:
        lhs = jnp.roll(lhs, -first_row, axis=0)
    dimension_numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if options.transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out_dtype = options.preferred_element_type
    acc = _accumulator_dtype(lhs.dtype, out_dtype)
    out = jax.lax.ragged_dot_general(
        lhs,
        rhs,
        sizes,
        dimension_numbers,
        precision=options.precision,
        preferred_element_type=acc,
    )
    if group_offset is not None:
        out = jnp.roll(out, first_row, axis=0)
    if existing_out is None:
        return out.astype(out_dtype)
    rows = jnp.arange(m)[:, None]
    local = (rows >= first_row) & (rows < end_row)
    return jnp.where(local, (existing_out.astype(acc) + out).astype(out_dtype), existing_out)


def tgmm_ragged_dot(lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, options):
    """tgmm through `ragged_dot_general` (same arrays and result as `tgmm_tiles`)."""
    token_axis = 0 if options.lhs_token_major else 1
    m = lhs.shape[token_axis]
    sizes, first_row, _ = _local_sizes(group_sizes, m, group_offset, num_groups)
    if group_offset is not None:
        lhs = jnp.roll(lhs, -first_row, axis=token_axis)
        rhs = jnp.roll(rhs, -first_row, axis=0)
    dimension_numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([token_axis], [0]), ([], [])),
        lhs_ragged_dimensions=[token_axis],
        rhs_group_dimensions=[],
    )
    acc = _accumulator_dtype(lhs.dtype, options.preferred_element_type)
    out = jax.lax.ragged_dot_general(
        lhs, rhs, sizes, dimension_numbers, precision=options.precision, preferred_element_type=acc
    )
    if existing_out is not None:
        out = existing_out.astype(acc) + out
    return out.astype(options.preferred_element_type)


# --- the backend contract -------------------------------------------------------------
# Jitted with the options static, so that eager calls compile once per shape and options:
# run op by op, the tile loop's concrete trip count turned `fori_loop` into a `scan` over
# a fresh closure, compiled anew on every call. Under an outer jit they are inlined.


@functools.partial(jax.jit, static_argnames=("options",))
def gmm(lhs, rhs, group_sizes, group_offset, existing_out, options: MatmulOptions) -> jax.Array:
    """The backend contract's gmm: `gmm_tiles`, or `gmm_ragged_dot` where it is faster."""
    tiles = functools.partial(
        _gmm_tiles_positional,
        preferred_element_type=options.preferred_element_type,
        transpose_rhs=options.transpose_rhs,
        precision=options.precision,
    )
    if not ragged_dot_is_faster():
        return tiles(lhs, rhs, group_sizes, group_offset, existing_out)
    ragged = functools.partial(gmm_ragged_dot, options=options)
    return _with_tile_batching(ragged, tiles)(lhs, rhs, group_sizes, group_offset, existing_out)


@functools.partial(jax.jit, static_argnames=("num_groups", "options"))
def tgmm(
    lhs, rhs, group_sizes, group_offset, existing_out, num_groups: int, options: MatmulOptions
) -> jax.Array:
    """The backend contract's tgmm: `tgmm_tiles`, or `tgmm_ragged_dot` where it is faster."""
    tiles = functools.partial(
        _tgmm_tiles_positional,
        num_groups=num_groups,
        preferred_element_type=options.preferred_element_type,
        lhs_token_major=options.lhs_token_major,
        precision=options.precision,
    )
    if not ragged_dot_is_faster():
        return tiles(lhs, rhs, group_sizes, group_offset, existing_out)
    ragged = functools.partial(tgmm_ragged_dot, num_groups=num_groups, options=options)
    return _with_tile_batching(ragged, tiles)(lhs, rhs, group_sizes, group_offset, existing_out)


def _gmm_tiles_positional(lhs, rhs, group_sizes, group_offset, existing_out, **static):
    return gmm_tiles(
        lhs, rhs, group_sizes, group_offset=group_offset, existing_out=existing_out, **static
    )


def _tgmm_tiles_positional(lhs, rhs, group_sizes, group_offset, existing_out, **static):
    return tgmm_tiles(
        lhs, rhs, group_sizes, group_offset=group_offset, existing_out=existing_out, **static
    )
