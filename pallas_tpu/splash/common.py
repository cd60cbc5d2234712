"""Pieces shared by the forward, dQ and dK/dV splash kernels.

Two tile orientations exist. The forward and dQ kernels walk (head, q block, kv block)
and compute tiles [block_q, block_kv] (kv on the lane axis). The dK/dV kernel walks
(kv block, head, q block) and computes transposed tiles [block_kv, block_q] (q on the
lane axis). `Traversal` maps a grid position to blocks for both, and the helpers below
bring per-token vectors (segment ids, positions, documents) to a tile in either one.

Per-token vectors live in HBM in the layout their tile wants, so that a block load is a
plain (8, 128)-aligned copy: the side of the tile on sublanes reads a lane-broadcast
column [len, 128]; the side on lanes reads a sublane-broadcast row [8, len].
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_tpu.splash.config import NUM_LANES, NUM_SUBLANES, KernelOptions, SegmentIds
from pallas_tpu.splash.isolation import isolated_dot
from pallas_tpu.splash.mask_info import ElementMask, MaskInfo

EMPTY, PARTIAL, FULL = 0, 1, 2  # MaskInfo.block_mask values
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b

Ref = Any


@dataclasses.dataclass(frozen=True)
class BodyStatic:
    """Everything static a kernel body (forward, dQ or dK/dV) needs."""

    options: KernelOptions
    trav: Traversal
    block_kv_compute: int
    grid_width: int
    rule: Callable | None  # ElementMask.rule (static)
    has_block_mask: bool
    has_sinks: bool = False  # forward only: the backward takes sinks outside the kernels


def block_entry(ref: Ref, h, row, col) -> jax.Array:
    """ref[h, row, col] as int32; head 0 when the schedule is shared by every head.

    Scalar-memory arrays may be int8/int16 (`downcast_smem_data`), hence the upcast.
    """
    head = 0 if ref.shape[0] == 1 else h
    return ref[head, row, col].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Traversal:
    """How a kernel's grid position maps to a MaskInfo cell and to blocks.

    Every index function takes `(*grid_ids, data_next, block_mask, mask_next)`, the
    signature of a `PrefetchScalarGridSpec` index map, so the same functions serve the
    BlockSpecs and the kernel bodies (which pass `pl.program_id`s and the refs).

    Attributes:
      kv_in_lanes: True for forward/dQ (grid (h, qi, j), tile [bq, bkv], the loaded
        block is a kv block); False for dK/dV (grid (ki, h, j), tile [bkv, bq], the
        loaded block is a q block).
      block_q, block_kv: memory block sizes of this traversal.
      group: q heads per kv head (GQA); kv head = h // group.
    """

    kv_in_lanes: bool
    block_q: int
    block_kv: int
    group: int

    def cell(self, a, b, c) -> tuple[Any, Any, Any]:
        """(h, q row, kv col) of the MaskInfo cell at grid position (a, b, c)."""
        return (a, b, c) if self.kv_in_lanes else (b, c, a)

    def head(self, *args) -> Any:
        return self.cell(*args[:3])[0]

    def kv_head(self, *args) -> Any:
        h = self.head(*args)
        # In h's dtype: under jax_enable_x64 a Python int would be int64, which lax.div refuses.
        return h if self.group == 1 else lax.div(h, jnp.asarray(self.group, h.dtype))

    def q_block(self, *args) -> Any:
        h, row, col = self.cell(*args[:3])
        return row if self.kv_in_lanes else block_entry(args[3], h, row, col)

    def kv_block(self, *args) -> Any:
        h, row, col = self.cell(*args[:3])
        # Forward/dQ: the UNSHRUNK kv block from data_next (the grid column may be a
        # compacted index); dK/dV: the grid's kv axis is never shrunk.
        return block_entry(args[3], h, row, col) if self.kv_in_lanes else col

    def kind(self, *args) -> jax.Array:
        """block_mask at this grid position: EMPTY, PARTIAL or FULL."""
        return block_entry(args[4], *self.cell(*args[:3]))

    def mask_block(self, *args) -> Any:
        return block_entry(args[5], *self.cell(*args[:3]))


class MaskOperands(NamedTuple):
    """Per-token mask inputs of a kernel (HBM arrays, their BlockSpecs, or their refs).

    None fields are absent (pytrees drop them). Segment ids apply to every computed
    block; the element mask (`partial` blocks, or `q_sequence` with the optional
    positions and documents) only to partial blocks.
    """

    q_segment: Any = None
    kv_segment: Any = None
    q_sequence: Any = None
    kv_sequence: Any = None
    q_document: Any = None
    kv_document: Any = None
    partial: Any = None

    @property
    def has_block_mask(self) -> bool:
        """Whether partial blocks have an element mask to apply."""
        return self.partial is not None or self.q_sequence is not None


def _column(x: jax.Array) -> jax.Array:
    """[len] -> [len, 128], every lane a copy (sublane axis = tokens)."""
    return lax.broadcast_in_dim(x.astype(jnp.int32), (x.shape[0], NUM_LANES), (0,))


def _row(x: jax.Array) -> jax.Array:
    """[len] -> [8, len], every sublane a copy (lane axis = tokens)."""
    return lax.broadcast_in_dim(x.astype(jnp.int32), (NUM_SUBLANES, x.shape[0]), (1,))


def mask_operands(
    kv_in_lanes: bool,
    element_mask: ElementMask | None,
    partial_mask_blocks: jax.Array | None,
    segment_ids: SegmentIds | None,
) -> MaskOperands:
    """The per-token arrays in the layout of one tile orientation.

    Exactly one element-mask source is used: the loaded `partial_mask_blocks` when
    present, else the `element_mask` evaluated in the kernel.
    """
    q_layout, kv_layout = (_column, _row) if kv_in_lanes else (_row, _column)
    lay_q = lambda x: None if x is None else q_layout(x)
    lay_kv = lambda x: None if x is None else kv_layout(x)
    ops = MaskOperands()
    if segment_ids is not None:
        ops = ops._replace(q_segment=lay_q(segment_ids.q), kv_segment=lay_kv(segment_ids.kv))
    if partial_mask_blocks is not None:
        blocks = partial_mask_blocks
        # Dynamic masks keep [heads, q_blocks, kv_blocks, ...] leading axes: flatten them.
        return ops._replace(partial=blocks.reshape(-1, *blocks.shape[-2:]))
    if element_mask is not None:
        ops = ops._replace(
            q_sequence=lay_q(element_mask.q_sequence),
            kv_sequence=lay_kv(element_mask.kv_sequence),
            q_document=lay_q(element_mask.q_document),
            kv_document=lay_kv(element_mask.kv_document),
        )
    return ops


def mask_specs(ops: MaskOperands, trav: Traversal) -> MaskOperands:
    """BlockSpecs for `mask_operands(...)` on this traversal (None where absent)."""
    bq, bkv = trav.block_q, trav.block_kv
    if trav.kv_in_lanes:
        q_spec = pl.BlockSpec((bq, NUM_LANES), lambda *a: (trav.q_block(*a), 0))
        kv_spec = pl.BlockSpec((NUM_SUBLANES, bkv), lambda *a: (0, trav.kv_block(*a)))
        partial_shape = (None, bq, bkv)
    else:
        q_spec = pl.BlockSpec((NUM_SUBLANES, bq), lambda *a: (0, trav.q_block(*a)))
        kv_spec = pl.BlockSpec((bkv, NUM_LANES), lambda *a: (trav.kv_block(*a), 0))
        partial_shape = (None, bkv, bq)
    partial_spec = pl.BlockSpec(partial_shape, lambda *a: (trav.mask_block(*a), 0, 0))
    sides = MaskOperands(q_spec, kv_spec, q_spec, kv_spec, q_spec, kv_spec, partial_spec)
    return MaskOperands(*(None if x is None else s for x, s in zip(ops, sides, strict=True)))


@dataclasses.dataclass(frozen=True)
class TileView:
    """One compute tile: [block_q, width] (kv in lanes) or [width, block_q].

    Attributes:
      trav: the traversal (orientation and block sizes).
      start: offset of the tile's first kv row inside the loaded kv block.
      width: kv extent of the tile (a compute slice of the kv block).
    """

    trav: Traversal
    start: int
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        bq = self.trav.block_q
        return (bq, self.width) if self.trav.kv_in_lanes else (self.width, bq)

    @property
    def kv_axis(self) -> int:
        return 1 if self.trav.kv_in_lanes else 0

    def q_side(self, ref: Ref) -> jax.Array:
        """A q-side vector block broadcast to the tile."""
        if self.trav.kv_in_lanes:  # ref: [bq, 128] column
            return jnp.tile(ref[...], (1, self.width // NUM_LANES))
        return jnp.broadcast_to(ref[:1, :], self.shape)  # ref: [8, bq] row

    def kv_side(self, ref: Ref) -> jax.Array:
        """A kv-side vector block (this tile's slice) broadcast to the tile."""
        kv = pl.ds(self.start, self.width)
        if self.trav.kv_in_lanes:  # ref: [8, bkv] row
            return jnp.broadcast_to(ref[:1, kv], self.shape)
        return jnp.tile(ref[kv, :], (1, self.trav.block_q // NUM_LANES))  # [bkv, 128]

    def kv_positions(self, kv_block) -> jax.Array:
        """Global kv index of every tile element (the default kv positions)."""
        offset = kv_block * self.trav.block_kv + self.start
        return offset + lax.broadcasted_iota(jnp.int32, self.shape, self.kv_axis)

    def partial(self, ref: Ref) -> jax.Array:
        kv = pl.ds(self.start, self.width)
        return ref[:, kv] if self.trav.kv_in_lanes else ref[kv, :]


def _and(terms: list[jax.Array]) -> jax.Array | None:
    return functools.reduce(jnp.logical_and, terms) if terms else None


def _element_term(refs: MaskOperands, tile: TileView, rule, kv_block) -> jax.Array | None:
    """rule(q_pos, kv_pos) & (q_doc == kv_doc), from the in-kernel ElementMask refs."""
    terms = []
    if rule is not None:
        q_pos = tile.q_side(refs.q_sequence)
        if refs.kv_sequence is not None:
            kv_pos = tile.kv_side(refs.kv_sequence)
        else:
            kv_pos = tile.kv_positions(kv_block)
        allowed = rule(q_pos, kv_pos)
        if allowed.dtype != jnp.bool_:
            raise ValueError(f"mask rule must return bool, got {allowed.dtype}")
        terms.append(allowed)
    if refs.q_document is not None:
        terms.append(tile.q_side(refs.q_document) == tile.kv_side(refs.kv_document))
    return _and(terms)


def tile_mask(
    refs: MaskOperands, tile: TileView, rule, kv_block, *, partial_block: bool
) -> jax.Array | None:
    """bool tile of allowed pairs, or None when every pair is allowed.

    `partial_block` (static) selects whether the element mask applies: full blocks skip
    it by definition of block_mask == FULL; segment ids apply to every block.
    """
    terms = []
    if partial_block and refs.partial is not None:
        terms.append(tile.partial(refs.partial))
    elif partial_block and refs.q_sequence is not None:
        term = _element_term(refs, tile, rule, kv_block)
        if term is not None:
            terms.append(term)
    if refs.q_segment is not None:
        terms.append(tile.q_side(refs.q_segment) == tile.kv_side(refs.kv_segment))
    return _and(terms)


def logits(a: jax.Array, b: jax.Array, softmax_scale: float, soft_cap: float | None):
    """(scaled, capped) logits of a @ b.T in float32; scaled is what the cap saw.

    a: [m, d], b: [n, d] -> both [m, n].
    """
    scaled = lax.dot_general(a, b, NT_DIMS, preferred_element_type=jnp.float32)
    if softmax_scale != 1.0:
        scaled = scaled * softmax_scale
    if soft_cap is None:
        return scaled, scaled
    return scaled, soft_cap * jnp.tanh(scaled / soft_cap)


def soft_cap_grad(ds: jax.Array, scaled: jax.Array, soft_cap: float | None) -> jax.Array:
    """d/d(scaled) of c * tanh(scaled / c) applied to ds: ds * (1 - tanh^2)."""
    if soft_cap is None:
        return ds
    t = jnp.tanh(scaled / soft_cap)
    return ds * (1.0 - t * t)


def apply_mask(s: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Masked logits are -inf: they contribute exp(-inf) = 0 everywhere."""
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def fit_lanes(x: jax.Array, width: int) -> jax.Array:
    """[rows, 128] lane-broadcast vector -> [rows, width] (tile, then trim)."""
    reps = -(-width // NUM_LANES)
    return jnp.tile(x, (1, reps))[:, :width] if width != NUM_LANES else x


def scalar_prefetch(
    info: MaskInfo, has_block_mask: bool, flagged: tuple[jax.Array, ...], block: int
) -> tuple:
    """The grid spec's scalar-prefetch arrays: (data_next, block_mask), and where partial
    blocks have an element mask also (mask_next, `nonfinite_blocks(*flagged, block)`), a
    dummy mask_next when None.

    Without a block mask no block is partial in the kernel: it never reads mask_next or
    the non-finite flags, and neither computes nor copies them into scalar memory. The
    dummy is never read either: `mask_block` runs only when partial blocks are loaded.
    """
    data_next, block_mask = jnp.asarray(info.data_next), jnp.asarray(info.block_mask)
    if not has_block_mask:
        return data_next, block_mask
    mask_next = info.mask_next
    if mask_next is None:
        mask_next = jnp.zeros((1, 1, 1), jnp.int32)
    return data_next, block_mask, jnp.asarray(mask_next), nonfinite_blocks(*flagged, block=block)


def split_prefetch(refs: tuple, has_block_mask: bool) -> tuple[tuple, Any, tuple]:
    """A kernel's (data_next, block_mask, mask_next) refs, its non-finite flags ref and
    its other refs, from what follows data_next and block_mask (`scalar_prefetch`);
    None for the refs a kernel without a block mask is not given."""
    data_next, block_mask, *rest = refs
    if not has_block_mask:
        return (data_next, block_mask, None), None, tuple(rest)
    mask_next, nonfinite, *rest = rest
    return (data_next, block_mask, mask_next), nonfinite, tuple(rest)


def nonfinite_blocks(*xs: jax.Array, block: int) -> jax.Array:
    """int8 [heads, len // block]: 1 where a block of rows of any of `xs` (each [heads,
    len, features], the same heads and len) holds a NaN or an Inf, else 0.

    One pass over the inputs outside the kernels; inside, a partial block pays for the
    isolating product (`block_product`) only where this says it must.
    """
    heads, length = xs[0].shape[:2]
    flags = [jnp.any(~jnp.isfinite(x.reshape(heads, length // block, -1)), axis=-1) for x in xs]
    return functools.reduce(jnp.logical_or, flags).astype(jnp.int8)


def nonfinite_entry(ref: Ref, h, block) -> jax.Array:
    """The `nonfinite_blocks` flag of (head h, block) as int32; head 0 for shared k/v."""
    return ref[0 if ref.shape[0] == 1 else h, block].astype(jnp.int32)


# libtpu's static profile reads every scalar-memory value as 0 (EMPTY): a body guarded by
# the block's kind is never priced. For static cost estimates only, `pricing_blocks_as`
# compiles every grid step as a block of one kind (a JAX user context: part of jit's key).
_priced_kind = jax.make_user_context(None)
PRICED_KINDS = ("full", "partial", "isolating")


@contextlib.contextmanager
def pricing_blocks_as(kind: str) -> Iterator[None]:
    """Within, kernels compile every grid step as a block of one kind, whatever the
    MaskInfo says: "full", "partial" (finite values: the plain product) or "isolating"
    (a partial block whose values hold a NaN or Inf). For libtpu's static cycle estimate
    (`bench aot`), never for results."""
    if kind not in PRICED_KINDS:
        raise ValueError(f"kind must be one of {PRICED_KINDS}, got {kind!r}")
    with _priced_kind(kind):
        yield


def block_product(
    weights: jax.Array, values: jax.Array, dims, nonfinite: Callable[[], jax.Array]
) -> jax.Array:
    """float32 weights . values (dot_general `dims`) for a partial block, which may mix
    documents: where `nonfinite()` (a traced scalar, `nonfinite_entry`; read here, so
    that full blocks never load it) says the values hold a NaN or Inf, the isolating
    product keeps a zero weight from meeting them (`isolation.py`); elsewhere the plain
    product, which then equals it."""
    weights = weights.astype(values.dtype)
    isolating = lambda: isolated_dot(weights, values, dims)
    plain = lambda: lax.dot_general(weights, values, dims, preferred_element_type=jnp.float32)
    # Priced, a branch costs its dearer side: each kind compiles the side it runs.
    if _priced_kind.value == "isolating":
        return isolating()
    if _priced_kind.value == "partial":
        return plain()
    return lax.cond(nonfinite() != 0, isolating, plain)


def tile_product(weights, values, dims, nonfinite, partial_block: bool) -> jax.Array:
    """float32 weights . values of one tile: `block_product` in a partial block (which
    may mix documents), the plain product in a full one (one document's pairs)."""
    if partial_block:
        return block_product(weights, values, dims, nonfinite)
    weights = weights.astype(values.dtype)
    return lax.dot_general(weights, values, dims, preferred_element_type=jnp.float32)


def run_by_kind(kind: jax.Array, has_block_mask: bool, body: Callable[[bool], None]) -> None:
    """Runs body(partial_block) for non-empty blocks; empty blocks are never computed.

    With an element mask, partial and full blocks get separate traced bodies so that
    full blocks skip the mask arithmetic.
    """
    if _priced_kind.value is not None:
        body(_priced_kind.value != "full" and has_block_mask)
        return
    if not has_block_mask:
        pl.when(kind != EMPTY)(lambda: body(False))
        return
    pl.when(kind == PARTIAL)(lambda: body(True))
    pl.when(kind == FULL)(lambda: body(False))


def check_mask_info(info: MaskInfo, trav: Traversal, heads: int, q_len: int, kv_len: int):
    """Raises ValueError when `info` was built for other block sizes or head counts."""
    q_blocks, kv_blocks = q_len // trav.block_q, kv_len // trav.block_kv
    shape = tuple(info.data_next.shape)
    if len(shape) != 3 or shape[0] not in (1, heads) or tuple(info.block_mask.shape) != shape:
        raise ValueError(
            f"MaskInfo.data_next/block_mask must be [1 or {heads}, q_blocks, kv_blocks] "
            f"and equal, got {shape} and {tuple(info.block_mask.shape)}"
        )
    fixed, compacted = (q_blocks, kv_blocks) if trav.kv_in_lanes else (kv_blocks, q_blocks)
    got_fixed, got_compacted = (shape[1], shape[2]) if trav.kv_in_lanes else (shape[2], shape[1])
    if got_fixed != fixed or not 0 < got_compacted <= compacted:
        raise ValueError(
            f"MaskInfo of shape {shape} does not fit blocks ({trav.block_q}, "
            f"{trav.block_kv}) of q_len={q_len}, kv_len={kv_len}: was it built with "
            "the same block sizes (and the dK/dV processing for the dK/dV kernel)?"
        )
    if info.partial_mask_blocks is not None:
        want = (trav.block_q, trav.block_kv) if trav.kv_in_lanes else (trav.block_kv, trav.block_q)
        got = tuple(info.partial_mask_blocks.shape[-2:])
        if got != want:
            raise ValueError(f"MaskInfo.partial_mask_blocks blocks are {got}, expected {want}")


def _varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: ManualAxisType; earlier: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _most_varying(like: tuple[jax.Array, ...]) -> jax.Array | None:
    """The input varying over the most `shard_map` axes (None outside shard_map)."""
    best = max(like, key=lambda x: len(_varying_axes(x)))
    return best if _varying_axes(best) else None


def out_struct(shape, dtype, *like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel output type varying over the same shard_map axes as its inputs, as
    `shard_map`'s default check_vma=True asks of a pallas_call's outputs."""
    source = _most_varying(like)
    if source is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    aval = jax.typeof(source)
    if getattr(aval, "mat", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)


# JAX 0.10's TPU interpreter never returns inside a shard_map whose mesh holds every CPU
# device (its device threads wait on each other at 0% CPU: seen with jax 0.10.2 on
# meshes of 2 of 2, 4 of 4 and 8 of 8 CPU devices, where 3 of 4, 4 of 5 and 4 of 8
# finish; jax 0.11.2 finishes 4 of 4; 0.11.0 and 0.11.1 not tried).
FIRST_JAX_WITHOUT_THE_INTERPRETER_DEADLOCK = (0, 11)


def _refuse_the_interpreter_deadlock() -> None:
    """A ValueError, at trace time, where JAX's TPU interpreter would hang (above)."""
    if jax.__version_info__ >= FIRST_JAX_WITHOUT_THE_INTERPRETER_DEADLOCK:
        return
    if _mesh_platform() != "cpu":
        return
    mesh_size = jax.sharding.get_abstract_mesh().size
    cpu_devices = jax.device_count("cpu")
    if mesh_size >= cpu_devices:
        raise ValueError(
            f"JAX {'.'.join(map(str, jax.__version_info__))}'s Pallas TPU interpreter never "
            f"returns inside a shard_map whose mesh holds every CPU device ({mesh_size} of "
            f"{cpu_devices}; fixed in JAX 0.11). Leave a device out of the mesh (e.g. "
            "--xla_force_host_platform_device_count=2N for a mesh of N), use JAX >= 0.11, "
            "trace the shard_map with check_vma=False (the plain interpreter, which "
            "finishes), or, through block_sparse_attention or varlen_attention, "
            "implementation='xla' or 'triton'."
        )


def _interpret_mode(interpret: bool, like: tuple[jax.Array, ...]):
    """pallas_call's `interpret=`: off a TPU inside a checked shard_map the plain HLO
    interpreter cannot type its constants (JAX limitation), the TPU interpreter can."""
    if interpret and _most_varying(like) is not None:
        _refuse_the_interpreter_deadlock()
        return pltpu.InterpretParams()
    return interpret


def batches_in_grid(infos: tuple[MaskInfo, ...], element_mask: ElementMask | None) -> bool:
    """Whether `jax.vmap` of the kernels over these MaskInfos makes the batch a grid axis
    of each kernel: none has a block mask (with one, its scalar prefetch holds the
    example's non-finite flags, `scalar_prefetch`, and Pallas batches the call as a loop
    of kernels, whose carry a checked `shard_map` refuses), and they are not interpreted
    inside a mesh off a TPU (JAX 0.10's TPU interpreter indexes a batched grid wrongly)."""
    partial = any(
        mask_operands(True, element_mask, info.partial_mask_blocks, None).has_block_mask
        for info in infos
    )
    return not partial and _mesh_platform() in (None, "tpu")


def _mesh_platform() -> str | None:
    """The platform of the mesh being traced for (inside `shard_map`, or under
    `jax.set_mesh`), read from its abstract mesh; None where no mesh is set."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return None if device is None else device.platform


def pallas_call(kernel: Callable[..., None], *, interpret: bool | None, like, **params):
    """`pl.pallas_call(kernel, **params)`, compiled by Mosaic or interpreted.

    `interpret=None` follows the platform the program is compiled for, not the host:
    Mosaic for TPU devices (real or compile-only), Pallas' interpreter elsewhere. Under a
    mesh (inside `shard_map`) the mesh's devices name that platform at trace time;
    otherwise a `jax.lax.platform_dependent` holds both forms and only the branch of the
    lowering platform is compiled. (Inside a checked shard_map the interpreter has
    ordered effects, which a platform_dependent branch cannot have: hence the mesh.)
    True / False force the interpreter / Mosaic.

    Args:
      kernel, params: as `pl.pallas_call`'s.
      like: the array operands whose shard_map typing the outputs follow.

    Returns:
      A function of the pallas_call's operands.
    """

    def call(mode: bool, *operands):
        launch = pl.pallas_call(kernel, interpret=_interpret_mode(mode, like), **params)
        if not mode:
            return launch(*operands)
        # Interpreted, the kernels' dots are XLA's on the host platform, fixed when traced:
        # at default precision a GPU takes float32 products in TF32 (~1e-3). The
        # interpreter stands in for the TPU kernels' arithmetic: exact products everywhere.
        with jax.default_matmul_precision("highest"):
            return launch(*operands)

    def run(*operands):
        if interpret is not None:
            return call(interpret, *operands)
        platform = _mesh_platform()
        if platform is not None:
            return call(platform != "tpu", *operands)
        return lax.platform_dependent(
            *operands, tpu=functools.partial(call, False), default=functools.partial(call, True)
        )

    return run
