"""Ring attention: context parallelism for `[batch, seq, heads, head_dim]` on a JAX mesh.

The sequence axis is sharded over one mesh axis of size R. Each device keeps its query
shard; the key/value shards (with their segment ids) travel round the ring by `ppermute`,
one hop per step, so after R steps every query shard has met every key shard and no device
ever holds more than one foreign shard. Each step runs the local varlen kernel (Triton on
GPUs, splash on TPUs, blockwise XLA elsewhere: `jax_bridge.attention.api.BACKENDS`) with its
log-sum-exp, and partial results merge exactly: `lse = logaddexp(lse_a, lse_b)`,
`out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`.

Chunks and pairs
----------------
A shard is one chunk of the sequence (`"contiguous"`: rank r holds chunk r of R) or two
(`"load_balanced"`: rank r holds chunks r and 2R - 1 - r of 2R, `reorder_sequence`'s
order). A step meets every query chunk of the device with every key chunk it holds: a
chunk *pair*. Chunks are contiguous in global position, so within a pair every document
is one run of queries and one run of keys, exactly a packed varlen sequence; the run
pairing is `flash_attention`'s segment-id pairing. Global positions fix the mask: query
at position p may see key p' of the same document iff `p - left <= p' <= p + right` (and
p' <= p under `causal`). For a pair whose query run starts at global a and key run at c,
that is the varlen rule with query 0 at key position `shift = a - c`.

Each pair is classified from the runs alone (O(tokens)), before any kernel runs:
  * skip: no document meets within the window (e.g. a key chunk after the query chunk
    under `causal`): no kernel, no merge;
  * full: every meeting document is entirely allowed (a key chunk before the query chunk
    under `causal`): the kernel runs without a mask (no causal, no window);
  * masked: the rest; the kernel runs with the call's mask and the shift. Without a
    window this happens only on a chunk's own diagonal, where the bottom-right alignment
    already is the shift, so the backends need the shift only for sliding windows.
A step does work iff one of its pairs is not skipped. Under `causal` with contiguous
chunks rank r works on r + 1 steps (the last rank on all R); with the balanced order every
rank does the same work, two half-pairs per step after the first (any R, odd included).

Backward
--------
A `custom_vjp` per device. The reverse ring carries K, V, their segment ids and the dK/dV
accumulators one hop the other way per step; each pair's backward runs the backend's
backward with the *final* output and log-sum-exp (so P and delta are the global ones),
adding into the travelling dK/dV and the resident dQ. After the last step the
accumulators take one more hop and are home. No device ever holds the full sequence.
Sinks join the softmax once, after the ring; their gradient is summed over the ring.

Scope of testing: on 8 fake CPU devices (`--xla_force_host_platform_device_count`), ring
sizes 1, 2, 3, 4 and 8, both layouts, with the XLA backend; the Triton kernels (through
Triton's interpreter) and the splash kernels (Pallas interpret mode, in an unchecked
`shard_map`: off-TPU a checked one needs Pallas' slow TPU interpreter) on a ring of 2.
Nothing here is host-side or per-device Python: the same program runs on a
multi-controller (multi-host) mesh, but that was not tested on real hosts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bridge.attention.api import (
    BACKENDS,
    REVERSE_MODE_ONLY,
    _check_config,
    _make_spec,
)
from jax_bridge.attention.options import AttentionOptions
from jax_bridge.attention.padded import segment_ids_to_cu_seqlens
from jax_bridge.attention.sinks import apply_sink_limits, row_delta, sink_gradient
from jax_bridge.core.autodiff import first_order_only, refuse_forward_mode
from jax_bridge.core.backend import resolve_implementation
from jax_bridge.core.precision import canonicalize_precision
from jax_bridge.core.sharding import jit_shard_map
from jax_bridge.core.validation import (
    as_int32,
    check_bool,
    check_head_dim,
    check_per_head,
    check_qkv_arrays,
    is_traced,
    naming_op,
)
from jax_bridge.core.vma import cotangent_like, varying_like
from jax_bridge.host.context_parallel import inverse_load_balanced_positions

__all__ = ["RingStats", "ring_attention", "ring_attention_shard"]

_OP = "ring_attention"
SEQUENCE_LAYOUTS = ("contiguous", "load_balanced")
_F32 = jnp.float32
_SKIP, _MASKED, _FULL = 0, 1, 2


class RingStats(NamedTuple):
    """Work done by each device of the ring (int32 [ring_size] each, global arrays).

    active_steps: ring steps in which the device ran at least one kernel (of R).
    kernel_calls: chunk pairs it computed (of R for contiguous, 4R for load_balanced).
    """

    active_steps: jax.Array
    kernel_calls: jax.Array


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static half of one ring attention call (the custom_vjp's nondiff argument)."""

    axis_name: Any
    ring_size: int
    batch: int
    chunks: int  # per shard: 1 (contiguous) or 2 (load_balanced)
    chunk_len: int
    masked: AttentionOptions  # the call's mask
    full: AttentionOptions  # the same call without causal or window

    @property
    def needs_shift(self) -> bool:
        spec = self.masked.spec
        return spec.window_left is not None or (spec.window_right is not None and not spec.causal)

    def chunk_start(self, rank: jax.Array, chunk: int) -> jax.Array:
        """Global position of the first token of the shard's `chunk`-th chunk on `rank`."""
        index = rank if chunk == 0 else 2 * self.ring_size - 1 - rank
        return (index * self.chunk_len).astype(jnp.int32)


# -------------------------------------------------------------------------- pairs


class _Pair(NamedTuple):
    """One (query chunk, key chunk) pair as a packed varlen problem."""

    cu_q: jax.Array  # int32 [sequences + 1] into the [batch * chunk_len] query axis
    cu_k: jax.Array  # int32 [sequences + 1] into the key axis
    shift: jax.Array  # int32 [sequences]: key position of each run's query 0
    kind: jax.Array  # int32 scalar: _SKIP, _MASKED or _FULL


def _pair(ring: _Ring, q_ids, kv_ids, q_start: jax.Array, kv_start: jax.Array) -> _Pair:
    """Runs, shifts and class of one pair; q_ids / kv_ids int32 [batch, chunk_len] or None
    (each batch row one document), q_start / kv_start the chunks' global positions."""
    if q_ids is None:
        cu_q = cu_k = jnp.arange(ring.batch + 1, dtype=jnp.int32) * ring.chunk_len
    else:
        cu_q, cu_k = segment_ids_to_cu_seqlens(q_ids, kv_ids)
    # Both flattened axes have rows of chunk_len tokens, so row offsets cancel.
    shift = (q_start - kv_start) + cu_q[:-1] - cu_k[:-1]
    n, m = jnp.diff(cu_q), jnp.diff(cu_k)
    # Over a run pair, key minus query position spans [-shift - n + 1, -shift + m - 1].
    nearest, farthest = -shift - n + 1, -shift + m - 1
    spec = ring.masked.spec
    meet = (n > 0) & (m > 0)
    some, every = meet, meet
    if spec.window_left is not None:
        some &= farthest >= -spec.window_left
        every &= nearest >= -spec.window_left
    if spec.window_right is not None:
        some &= nearest <= spec.window_right
        every &= farthest <= spec.window_right
    kind = jnp.where(
        jnp.any(some), jnp.where(jnp.all(every | ~meet), _FULL, _MASKED), _SKIP
    ).astype(jnp.int32)
    return _Pair(cu_q, cu_k, shift.astype(jnp.int32), kind)


def _merge(acc: tuple, part: tuple) -> tuple:
    """Two softmax-normalised partials over disjoint keys -> their exact union.

    acc, part: (out float32 [T, Hq, D], lse float32 [Hq, T]). A side with lse = -inf
    (no key) weighs exactly 0, so two empty sides stay (0, -inf) instead of NaN.
    """
    (out_a, lse_a), (out_b, lse_b) = acc, part
    lse = jnp.logaddexp(lse_a, lse_b)
    anchor = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight = lambda x: jnp.where(x == -jnp.inf, 0.0, jnp.exp(x - anchor)).T[..., None]
    return out_a * weight(lse_a) + out_b.astype(_F32) * weight(lse_b), lse


def _split(ring: _Ring, x: jax.Array | None, flat: bool = True) -> list | None:
    """[batch, chunks * chunk_len, ...] -> per chunk [batch * chunk_len, ...] (flat) or
    [batch, chunk_len, ...]."""
    if x is None:
        return None
    size = ring.chunk_len
    parts = [x[:, c * size : (c + 1) * size] for c in range(ring.chunks)]
    return [p.reshape(-1, *p.shape[2:]) for p in parts] if flat else parts


def _unsplit(ring: _Ring, parts: list, dtype) -> jax.Array:
    """Inverse of `_split`: per chunk [batch * chunk_len, ...] -> [batch, seq, ...]."""
    shaped = [p.reshape(ring.batch, ring.chunk_len, *p.shape[1:]) for p in parts]
    return jnp.concatenate(shaped, axis=1).astype(dtype)


def _pairs(ring: _Ring, q_ids: list | None, q_rank, kv_ids: list | None, kv_rank):
    """Every (query chunk i, key chunk j, _Pair) met in one step."""
    for i in range(ring.chunks):
        for j in range(ring.chunks):
            pair = _pair(
                ring,
                None if q_ids is None else q_ids[i],
                None if kv_ids is None else kv_ids[j],
                ring.chunk_start(q_rank, i),
                ring.chunk_start(kv_rank, j),
            )
            yield i, j, pair


def _backend_args(ring: _Ring, pair: _Pair, full: bool) -> tuple[AttentionOptions, Any]:
    if full:
        return ring.full, None
    return ring.masked, pair.shift if ring.needs_shift else None


# ------------------------------------------------------------------------ forward


def _forward_step(ring: _Ring, acc: list, q: list, q_ids, q_rank, kv: tuple, kv_rank):
    """Meets the resident query chunks with one shard of keys; returns (acc, calls)."""
    k, v, kv_ids = kv
    calls = jnp.int32(0)
    for i, j, pair in _pairs(ring, q_ids, q_rank, kv_ids, kv_rank):

        def attend(acc_i, full, i=i, j=j, pair=pair):
            options, shift = _backend_args(ring, pair, full)
            backend = BACKENDS[options.implementation]
            with naming_op(_OP):  # a backend's refusal at trace time
                part = backend.forward(
                    q[i], k[j], v[j], pair.cu_q, pair.cu_k, None, None, options, shift=shift
                )
            return _merge(acc_i, part)

        branches = [
            lambda a: a,
            functools.partial(attend, full=False),
            functools.partial(attend, full=True),
        ]
        acc[i] = lax.switch(pair.kind, branches, acc[i])
        calls += (pair.kind != _SKIP).astype(jnp.int32)
    return acc, calls


def _forward(ring: _Ring, q, k, v, ids, sinks):
    """Per device: (out [batch, seq, Hq, D], lse per query chunk [Hq, batch * chunk_len],
    stats int32 [1, 2] = (active steps, kernel calls))."""
    rank = lax.axis_index(ring.axis_name)
    q_chunks, q_ids = _split(ring, q), _split(ring, ids, flat=False)
    num_q = q.shape[2]
    acc = [
        (
            jnp.zeros((*c.shape[:2], v.shape[-1]), _F32),
            jnp.full((num_q, c.shape[0]), -jnp.inf, _F32),
        )
        for c in q_chunks
    ]
    acc = varying_like(acc, q, k, v)
    kv = (_split(ring, k), _split(ring, v), q_ids)
    acc, calls = _forward_step(ring, acc, q_chunks, q_ids, rank, kv, rank)
    stats = varying_like(jnp.stack([(calls > 0).astype(jnp.int32), calls]), q)
    perm = [(r, (r + 1) % ring.ring_size) for r in range(ring.ring_size)]

    def hop(step, carry):
        kv, acc, stats = carry
        kv = lax.ppermute(kv, ring.axis_name, perm)  # now holds rank - step's shard
        acc, calls = _forward_step(
            ring, acc, q_chunks, q_ids, rank, kv, (rank - step) % ring.ring_size
        )
        return kv, acc, stats + jnp.stack([(calls > 0).astype(jnp.int32), calls])

    _, acc, stats = lax.fori_loop(1, ring.ring_size, hop, (kv, acc, stats))
    outs, lses = [], []
    for out, lse in acc:
        if sinks is not None:
            # The sink joins each row's softmax once: one more merge, with no value.
            sink = jnp.broadcast_to(sinks.astype(_F32)[:, None], lse.shape)
            out, lse = apply_sink_limits(*_merge((out, lse), (jnp.zeros_like(out), sink)), sinks)
        outs.append(out)
        lses.append(lse)
    return _unsplit(ring, outs, q.dtype), lses, stats[None]


# ----------------------------------------------------------------------- backward


def _backward_step(ring: _Ring, grads: tuple, res: tuple, q_rank, kv: tuple, kv_rank):
    """Adds one key shard's pairs into (dq chunks, dk chunks, dv chunks)."""
    q, out, d_out, lse, q_ids = res
    k, v, kv_ids = kv
    dq, dk, dv = grads
    for i, j, pair in _pairs(ring, q_ids, q_rank, kv_ids, kv_rank):

        def gradients(acc, full, i=i, j=j, pair=pair):
            options, shift = _backend_args(ring, pair, full)
            backend = BACKENDS[options.implementation]
            with naming_op(_OP):
                dq_p, dk_p, dv_p, _ = backend.backward(
                    q[i], k[j], v[j], out[i], lse[i], d_out[i], None,
                    pair.cu_q, pair.cu_k, None, None, options, shift=shift,
                )  # fmt: skip
            return tuple(a + b.astype(_F32) for a, b in zip(acc, (dq_p, dk_p, dv_p), strict=True))

        branches = [
            lambda a: a,
            functools.partial(gradients, full=False),
            functools.partial(gradients, full=True),
        ]
        dq[i], dk[j], dv[j] = lax.switch(pair.kind, branches, (dq[i], dk[j], dv[j]))
    return dq, dk, dv


def _backward(ring: _Ring, q, k, v, ids, sinks, out, lse, d_out):
    """Per device: (dq, dk, dv, d_sinks) by the reverse ring (see the module docstring)."""
    rank = lax.axis_index(ring.axis_name)
    q_chunks, q_ids = _split(ring, q), _split(ring, ids, flat=False)
    out_chunks, d_out_chunks = _split(ring, out), _split(ring, d_out)
    d_sinks = None
    if sinks is not None:
        d_sinks = sum(
            sink_gradient(sinks, l, row_delta(o, g, None))
            for o, g, l in zip(out_chunks, d_out_chunks, lse, strict=True)
        )
    res = (q_chunks, out_chunks, d_out_chunks, lse, q_ids)
    zeros = lambda parts: [jnp.zeros(p.shape, _F32) for p in parts]
    kv = (_split(ring, k), _split(ring, v), q_ids)
    grads = varying_like((zeros(q_chunks), zeros(kv[0]), zeros(kv[1])), q, k, v, d_out)
    grads = _backward_step(ring, grads, res, rank, kv, rank)
    back = [(r, (r - 1) % ring.ring_size) for r in range(ring.ring_size)]

    def hop(step, carry):
        kv, (dq, dk, dv) = carry
        # dK/dV travel with their K/V: a shard's gradient is always next to it.
        kv, (dk, dv) = lax.ppermute((kv, (dk, dv)), ring.axis_name, back)
        grads = _backward_step(ring, (dq, dk, dv), res, rank, kv, (rank + step) % ring.ring_size)
        return kv, grads

    _, (dq, dk, dv) = lax.fori_loop(1, ring.ring_size, hop, (kv, grads))
    if ring.ring_size > 1:  # one last hop takes every dK/dV home
        dk, dv = lax.ppermute((dk, dv), ring.axis_name, back)
    return (
        _unsplit(ring, dq, q.dtype),
        _unsplit(ring, dk, k.dtype),
        _unsplit(ring, dv, v.dtype),
        d_sinks,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, ids, sinks):
    out, _, stats = _forward(ring, q, k, v, ids, sinks)
    return out, stats


def _ring_fwd(ring: _Ring, q, k, v, ids, sinks):
    out, lse, stats = first_order_only(functools.partial(_forward, ring), _OP)(q, k, v, ids, sinks)
    return (out, stats), (q, k, v, ids, sinks, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    q, k, v, ids, sinks, out, lse = residuals
    d_out = cotangents[0]
    backward = first_order_only(functools.partial(_backward, ring), _OP)
    dq, dk, dv, d_sinks = backward(q, k, v, ids, sinks, out, lse, d_out)
    if sinks is not None:
        # Sinks are replicated over the ring: their gradient sums every device's rows.
        d_sinks = cotangent_like(d_sinks.astype(sinks.dtype), sinks)
    dq, dk, dv = (cotangent_like(d, x) for d, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, None, d_sinks


_ring.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------- API


def ring_attention_shard(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: Any,
    segment_ids: jax.Array | None = None,
    causal: bool = False,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    sinks: jax.Array | None = None,
    sequence_layout: str = "contiguous",
    implementation: str = "auto",
    precision: Any = None,
    config: Any = None,
    return_stats: bool = False,
) -> jax.Array | tuple[jax.Array, RingStats]:
    """Ring attention on this device's shard: call it inside `jax.shard_map`.

    The sequence axis is sharded over the mesh axis `axis_name` (of size R) in
    `sequence_layout` order; everything else is as `ring_attention`, whose docstring
    states the semantics. Use it inside your own `shard_map` over a larger mesh (batch or
    heads sharded over other axes): it communicates over `axis_name` only.

    Args:
      q: [batch, seq / R, num_q_heads, head_dim], this device's shard.
      k, v: [batch, seq / R, num_kv_heads, head_dim].
      segment_ids: int [batch, seq / R] or None.
      sinks: [num_q_heads], replicated over `axis_name`.
      Others: as `ring_attention`.

    Returns:
      out: like q; with `return_stats`, also this device's `RingStats` (int32 scalars).
    """
    ring_size = lax.axis_size(axis_name)
    ring, ids, sinks = _plan(
        q, k, v, segment_ids, sinks, axis_name, ring_size, causal, sliding_window,
        logits_soft_cap, softmax_scale, sequence_layout, implementation, precision, config,
    )  # fmt: skip
    return_stats = check_bool(_OP, return_stats, "return_stats")
    out, stats = _ring(ring, q, k, v, ids, sinks)
    return (out, RingStats(stats[0, 0], stats[0, 1])) if return_stats else out


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str,
    segment_ids: jax.Array | None = None,
    causal: bool = False,
    sliding_window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    sinks: jax.Array | None = None,
    sequence_layout: str = "contiguous",
    implementation: str = "auto",
    precision: Any = None,
    config: Any = None,
    return_stats: bool = False,
) -> jax.Array | tuple[jax.Array, RingStats]:
    """Self-attention with the sequence sharded over a mesh axis (context parallelism).

    Computes what `flash_attention(q, k, v, q_segment_ids=segment_ids, ...)` computes on
    the whole sequence, without any device holding more than its own query shard and one
    key/value shard (see the module docstring for the ring, the pairs and the skipping).
    Query at global position p attends key p' of the same document (same segment id > 0;
    ids <= 0 are padding and output 0) iff `p - left <= p' <= p + right`, with
    right = 0 under `causal`. Documents may cross shard boundaries; each must be one
    contiguous run of its row (in the natural order).

    Args:
      q: [batch, seq, num_q_heads, head_dim], a global array (any sharding: it is
        resharded to `P(None, axis_name)`).
      k, v: [batch, seq, num_kv_heads, head_dim]; num_q_heads % num_kv_heads == 0.
      mesh: the `jax.sharding.Mesh`; axis_name: its axis of size R that shards seq.
        Other mesh axes see replicated inputs; to shard batch or heads over them too,
        call `ring_attention_shard` inside your own `shard_map`.
      segment_ids: int [batch, seq] or None (each row one document).
      causal, sliding_window, logits_soft_cap, softmax_scale, sinks, precision, config:
        as `varlen_attention` (no ALiBi). With implementation="pallas", no
        sliding_window (its kernels do not take the per-document shift yet).
      sequence_layout: "contiguous" (natural order; seq % R == 0) or "load_balanced":
        seq (and segment_ids) already in `reorder_sequence(x, R)` order (seq % 2R == 0),
        which gives every rank the same causal work. The output is in the same order.
        Concrete segment_ids of several documents a row, reordered for another R, are
        refused (their documents read as scattered runs); without segment_ids, or with
        one document a row, no check can tell and the numbers are wrong.
      implementation: the local kernel: "auto" (Triton on GPUs, Pallas on TPUs, XLA
        elsewhere), "triton", "pallas" or "xla". Off a TPU, "pallas" inside this
        function's checked `shard_map` runs Pallas' TPU interpreter: minutes per call;
        use `ring_attention_shard` in a `shard_map(check_vma=False)` to try it there.
      return_stats: also return `RingStats` (per device: steps that did work, pairs
        computed), e.g. to check the balance of a layout.

    Returns:
      out: [batch, seq, num_q_heads, head_dim] in q's dtype, sharded like the input
      layout (`P(None, axis_name)`); with `return_stats` also `RingStats`. Inputs of any
      sharding are resharded first, on meshes with auto or explicit axes alike; on
      explicit axes (`jax.make_mesh`'s default) eager code that consumes the output must
      run under `jax.set_mesh(mesh)`, as JAX requires of explicitly sharded arrays.

    Differentiation: reverse mode in q, k, v and sinks (a reverse ring; the segment ids
    get none); forward mode (`jax.jvp`, `jax.jacfwd`) and higher-order derivatives raise
    NotImplementedError. Works under `jax.jit` and `jax.remat`; `jax.vmap` adds a batch
    of rings (tested on q), though folding it into `batch` is one ring.

    Tested on fake CPU devices (ring sizes 1, 2, 3, 4, 8); the code has no host-side
    gather or per-device Python, so it is the same on a multi-host mesh (not tested).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_OP}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{_OP}: axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}."
        )
    ring_size = mesh.shape[axis_name]
    # Shapes and dtypes first, on the arrays as passed (inside the shard_map the same
    # checks would quote per-shard shapes, and a wrong-rank segment_ids would fail in
    # the resharding before them).
    impl, _, _ = _check_arguments(q, k, v, segment_ids, sinks, sequence_layout, implementation)
    _check_config(config, impl, op=_OP, head_dim=q.shape[-1])
    _check_global(q, k, v, segment_ids, ring_size, sequence_layout)
    if isinstance(sliding_window, list):  # static options key the cache: hashable
        sliding_window = tuple(sliding_window)
    # Validated before the cache lookup: a cached configuration equal to a bad one
    # (causal=1 == True) must not skip the checks.
    _make_spec(q.shape[3], causal, sliding_window, logits_soft_cap, softmax_scale, op=_OP)
    return_stats = check_bool(_OP, return_stats, "return_stats")
    precision = canonicalize_precision(precision, _OP)
    static = dict(
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_scale=softmax_scale,
        sequence_layout=sequence_layout,
        implementation=implementation,
        precision=precision,
        config=config,
    )
    refuse_forward_mode(_OP, q, k, v, sinks, works=REVERSE_MODE_ONLY)
    has = (segment_ids is not None, sinks is not None)
    try:
        run = _sharded_ring(mesh, axis_name, *has, **static)
    except TypeError:  # an unhashable option: build it for this call only
        run = _sharded_ring.__wrapped__(mesh, axis_name, *has, **static)
    out, stats = run(q, k, v, segment_ids, sinks)
    return (out, RingStats(stats[:, 0], stats[:, 1])) if return_stats else out


@functools.lru_cache(maxsize=64, typed=True)
def _sharded_ring(mesh: Mesh, axis_name, has_ids: bool, has_sinks: bool, **static):
    """The jitted `shard_map` of one configuration, built once: run eagerly, a shard_map
    executes op by op (a minute for a small ring on a CPU); under an outer jit or grad
    the inner jit is inlined."""
    seq = P(None, axis_name)

    def body(q, k, v, ids, sinks):
        out, stats = ring_attention_shard(
            q, k, v, axis_name=axis_name, segment_ids=ids, sinks=sinks, return_stats=True,
            **static,
        )  # fmt: skip
        return out, jnp.stack([stats.active_steps, stats.kernel_calls])[None]

    in_specs = (seq, seq, seq, seq if has_ids else None, P() if has_sinks else None)
    return jit_shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(seq, P(axis_name)))


# -------------------------------------------------------------------------- checks


def _check_rank(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or x.ndim != 4:
            shape = getattr(x, "shape", type(x).__name__)
            raise ValueError(
                f"{_OP}: {name} must have shape [batch, seq, heads, head_dim], got {shape}."
            )


def _check_global(q, k, v, segment_ids, ring_size: int, layout: str) -> None:
    """Global shapes the shards must divide; documents contiguous (when concrete)."""
    _check_rank(q, k, v)
    seq = q.shape[1]
    chunks = 2 * ring_size if layout == "load_balanced" else ring_size
    if layout in SEQUENCE_LAYOUTS and seq % chunks:
        raise ValueError(
            f"{_OP}: q's seq ({seq}) must be divisible by {chunks} for "
            f"sequence_layout={layout!r} on a ring of {ring_size}."
        )
    if segment_ids is None or is_traced(segment_ids) or layout not in SEQUENCE_LAYOUTS:
        return
    ids = np.asarray(segment_ids)
    if ids.shape != q.shape[:2] or not np.issubdtype(ids.dtype, np.integer):
        return  # _check_arguments has named it
    hint = ""
    if layout == "load_balanced":
        ids = ids[:, inverse_load_balanced_positions(ids.shape[1], ring_size)]
        # A sequence reordered for another ring size reads as scattered documents.
        hint = (
            f" With sequence_layout='load_balanced' they are read in "
            f"reorder_sequence(x, {ring_size}) order: the mesh axis has {ring_size} "
            f"device(s); reorder for that ring size."
        )
    for row in ids:
        run_ids = row[np.flatnonzero(np.diff(row, prepend=row[:1] - 1))]
        run_ids = run_ids[run_ids > 0]
        if len(np.unique(run_ids)) != len(run_ids):
            raise ValueError(
                f"{_OP}: segment_ids must hold each document as one contiguous run per row "
                f"(in the natural order); an id reappears after a different id.{hint}"
            )


def _plan(
    q, k, v, segment_ids, sinks, axis_name, ring_size, causal, sliding_window,
    logits_soft_cap, softmax_scale, layout, implementation, precision, config,
):  # fmt: skip
    """Validates one shard's arguments; returns (_Ring, int32 segment ids | None, sinks)."""
    impl, ids, sinks = _check_arguments(q, k, v, segment_ids, sinks, layout, implementation)
    batch, seq = q.shape[:2]
    chunks = 2 if layout == "load_balanced" else 1
    if seq % chunks:
        raise ValueError(f"{_OP}: a load_balanced shard holds two chunks; its seq {seq} is odd.")
    spec = _make_spec(q.shape[3], causal, sliding_window, logits_soft_cap, softmax_scale, op=_OP)
    masked = AttentionOptions(
        implementation=impl,
        precision=canonicalize_precision(precision, _OP),
        config=_check_config(config, impl, op=_OP, head_dim=q.shape[3]),
        spec=spec,
    )
    full_spec = dataclasses.replace(spec, causal=False, window_left=None, window_right=None)
    ring = _Ring(
        axis_name, ring_size, batch, chunks, seq // chunks, masked,
        dataclasses.replace(masked, spec=full_spec),
    )  # fmt: skip
    if impl == "pallas" and ring.needs_shift:
        raise ValueError(
            f"{_OP}: implementation='pallas' does not take sliding_window yet (its kernels "
            "align every document bottom-right); use implementation='xla' or 'triton'."
        )
    return ring, ids, sinks


def _check_arguments(q, k, v, segment_ids, sinks, layout, implementation):
    """(implementation, int32 segment ids | None, sinks) after the checks of shapes and
    dtypes. `ring_attention` runs them on the global arrays before its `shard_map` (so
    errors quote the shapes the user passed), `ring_attention_shard` on its shard."""
    _check_rank(q, k, v)
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(
            f"{_OP}: sequence_layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}."
        )
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{_OP}: q and k must have the same [batch, seq] (self-attention over one "
            f"sequence), got q {tuple(q.shape)} and k {tuple(k.shape)}."
        )
    impl = resolve_implementation(implementation, op=_OP, supported=tuple(BACKENDS.backends))
    check_qkv_arrays(
        _OP,
        q,
        k,
        v,
        q_doc="[batch, seq, num_q_heads, head_dim]",
        kv_doc="[batch, seq, num_kv_heads, head_dim]",
    )
    check_head_dim(_OP, q.shape[3], BACKENDS[impl].HEAD_DIMS, impl)
    ids = _check_ids(segment_ids, tuple(q.shape[:2]))
    return impl, ids, check_per_head(_OP, sinks, "sinks", q.shape[2])


def _check_ids(ids: Any, shape: tuple[int, int]) -> jax.Array | None:
    if ids is None:
        return None
    if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{_OP}: segment_ids must hold integer ids, got {getattr(ids, 'dtype', ids)}."
        )
    if tuple(ids.shape) != shape:
        raise ValueError(
            f"{_OP}: segment_ids must have q's [batch, seq] = {shape}, got {tuple(ids.shape)}."
        )
    # Wrapped to int32, two documents' ids could become one (or padding's 0).
    return jnp.asarray(as_int32(ids, f"{_OP}: segment_ids"))
