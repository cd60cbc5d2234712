"""Benchmark: ring attention (context parallelism, `jax_bridge.attention.ring`) against an
all-gather baseline, per ring size R in (1, 2, 4, 8), causal with packed documents.

Three parts, each per R (only R <= the number of JAX devices; larger R print a skipped
line and return a skipped row):

* bytes: what one device sends per ring step and in total, from shapes and dtypes.
  Forward: R - 1 hops of its K, V and int32 segment-id shard. Backward: R - 1 hops of K,
  V, ids and the float32 dK/dV accumulators, then one more hop of dK/dV home. Baseline:
  an all-gather receives (R - 1) / R of the global K, V and ids once; its backward
  reduce-scatters dK/dV (the transpose of the gather) and keeps the gathered K/V.
* balance: the allowed (query, key) pairs per device, counted exactly from the mask in
  numpy (same segment id > 0, key position <= query position), and the chunk pairs that
  need a kernel, for the "contiguous" and "load_balanced" layouts; max / mean over
  devices; for the bench's packed documents and for one causal document per row (ids all
  1, the case the load-balanced order is built for). Where a ring size is timed,
  `RingStats` (kernel_calls, active_steps) from `ring_attention(..., return_stats=True)`
  must equal the numpy count, in both cases (the row's check).
* wall time on the CPU of `ring_attention(implementation="xla")`, forward and
  forward + backward (`jax.grad` of the sum wrt q, k, v), against the all-gather baseline
  written here with `jax.shard_map`: every device gathers K, V, segment ids and token
  positions (`lax.all_gather(tiled=True)`) and computes dense masked attention for its own
  query shard against the whole sequence in plain jnp (scores [B, Hq, seq / R, seq]).
  Both are checked against dense masked attention on the global arrays (`dense_reference`:
  `jax.nn.dot_product_attention` with the boolean mask, float32 at HIGHEST precision):
  outputs by max abs difference (<= 1e-4), gradients by max abs difference / max
  |reference| (<= 1e-4). Load-balanced inputs go through
  `reorder_sequence` first and results back with `to_contiguous=True`; the reordering is
  outside the timed functions (a model keeps the balanced order throughout).

On a CPU the R devices are fake (`--xla_force_host_platform_device_count`) and share the
machine's cores, so the times measure the overhead of each sharded program, not a
speed-up, and the ring's hops are memory copies, not links. This module never sets
XLA_FLAGS (JAX may already be running). A ring's program holds one attention per chunk
pair (one pair contiguous, four load-balanced) and kind of pair: on a 2-core CPU the
forwards compile in 5-10 s, the forward + backward in 8 s (contiguous) and 25 s
(load-balanced), whatever R. So the quick default (seq 1024) times one ring size, R = 4
(or the largest below it): the forward of both layouts and the contiguous forward +
backward; bytes and balance are reported for every R.
`python -m bench --full` uses seq 4096 and times every R and both layouts in both
directions (many minutes on a CPU).

Timed rows carry the useful FLOPs of the whole sequence (`_Bench.forward_flops`: allowed
causal entries only, 4 * head_dim per entry and query head; forward + backward 3.5x; the
conventions of bench/report.py); every row carries `params` {"seq_len", "ring_size"}.

Run with `python -m bench ring_attention`, or with fake devices:
XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.ring_attention [--full]
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bench.report import FWD_BWD_FLOP_FACTOR as REPORT_FACTORS
from bench.report import BenchRow
from bench.timing import repeat_seconds
from jax_bridge import reorder_sequence
from jax_bridge.attention.ring import ring_attention
from jax_bridge.host.context_parallel import load_balanced_positions

SECTION = "ring_attention"
AXIS = "cp"
BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 1, 4, 2, 64
QUICK_SEQ, FULL_SEQ = 1024, 4096
RING_SIZES = (1, 2, 4, 8)
QUICK_RING = 4  # quick: time this R only (or the largest R there are devices for)
LAYOUTS = ("contiguous", "load_balanced")
# float32: ours and the reference differ by summation order only.
OUTPUT_TOLERANCE = 1e-4  # max abs difference (outputs are O(1))
GRAD_TOLERANCE = 1e-4  # max abs difference / max |reference gradient|
KIB = 2**10
FWD_BWD_FLOP_FACTOR = REPORT_FACTORS["attention"]  # bench/report.py


# ------------------------------------------------------------------------- inputs


def segment_ids(seq: int, seed: int = 0) -> np.ndarray:
    """int32 [BATCH, seq]: documents of seq/10 .. seq/3 tokens (so that most shard
    boundaries fall inside a document, at every R > 1; with the default seed, at 256, 1024
    and 4096 tokens, one does at every R), then seq/32 tokens of padding (id 0)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(BATCH):
        lengths = rng.integers(seq // 10, seq // 3, size=seq)
        ids = np.repeat(np.arange(1, seq + 1), lengths)[:seq]
        ids[seq - seq // 32 :] = 0
        rows.append(ids)
    return np.stack(rows).astype(np.int32)


def _inputs(seq: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((BATCH, seq, Q_HEADS, HEAD_DIM), np.float32)
    k, v = (rng.standard_normal((BATCH, seq, KV_HEADS, HEAD_DIM), np.float32) for _ in range(2))
    return tuple(jax.device_put(x) for x in (q, k, v, segment_ids(seq)))


def positions(seq: int, ring_size: int, layout: str) -> np.ndarray:
    """int32 [seq]: natural position of the token stored at each index of `layout`."""
    if layout == "load_balanced":
        return load_balanced_positions(seq, ring_size)
    return np.arange(seq, dtype=np.int32)


# -------------------------------------------------------------------------- bytes


def ring_bytes(seq: int, ring_size: int, itemsize: int = 4) -> dict[str, int]:
    """Bytes one device sends (= receives) in the ring and in the all-gather baseline.

    Keys: fwd_step / fwd_total (K, V, ids per hop, R - 1 hops), bwd_step / bwd_total
    (K, V, ids and float32 dK/dV per hop, R - 1 hops, plus one dK/dV hop home),
    gather (the baseline's all-gather: (R - 1) / R of the global K, V, ids),
    scatter (its backward's reduce-scatter of dK/dV, in K's dtype), kv_shard (one K+V
    shard), kv_full (the global K+V).
    """
    shard = BATCH * seq // ring_size
    kv = 2 * shard * KV_HEADS * HEAD_DIM * itemsize
    ids = shard * 4
    dkv = 2 * shard * KV_HEADS * HEAD_DIM * 4
    hops = ring_size - 1
    return {
        "fwd_step": kv + ids,
        "fwd_total": hops * (kv + ids),
        "bwd_step": kv + ids + dkv,
        "bwd_total": hops * (kv + ids + dkv) + (dkv if ring_size > 1 else 0),
        "gather": hops * (kv + ids),
        "scatter": hops * 2 * shard * KV_HEADS * HEAD_DIM * itemsize,
        "kv_shard": kv,
        "kv_full": ring_size * kv,
    }


def _kib(n: float) -> str:
    return f"{n / KIB:.0f} KiB" if n < 10 * 2**20 else f"{n / 2**20:.0f} MiB"


def step_flops(seq: int, ring_size: int) -> int:
    """Forward FLOPs of one unmasked (query shard, key shard) pair: QK^T and PV."""
    shard = seq // ring_size
    return 4 * BATCH * Q_HEADS * HEAD_DIM * shard * shard


# ------------------------------------------------------------------------ balance


def allowed_mask(ids: np.ndarray) -> np.ndarray:
    """bool [batch, seq, seq] in natural order: query p may attend key p' (causal)."""
    pos = np.arange(ids.shape[1])
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
    return same & (pos[None, None, :] <= pos[None, :, None])


def expected_work(allowed: np.ndarray, ring_size: int, layout: str) -> dict[str, np.ndarray]:
    """Per device: allowed (query, key) pairs of its query rows, chunk pairs with one
    allowed pair (= RingStats.kernel_calls) and key shards with one (= active_steps)."""
    seq = allowed.shape[1]
    stored = positions(seq, ring_size, layout)
    chunks = 2 if layout == "load_balanced" else 1
    chunk_pos = stored.reshape(ring_size, chunks, -1)  # [device, chunk, chunk_len]
    pairs, calls, steps = (np.zeros(ring_size, np.int64) for _ in range(3))
    for r in range(ring_size):
        pairs[r] = allowed[:, chunk_pos[r].reshape(-1)].sum()
        for s in range(ring_size):
            busy = [allowed[:, qc][:, :, kc].any() for qc in chunk_pos[r] for kc in chunk_pos[s]]
            calls[r] += sum(busy)
            steps[r] += any(busy)
    return {"pairs": pairs, "kernel_calls": calls, "active_steps": steps}


def imbalance(x: np.ndarray) -> float:
    """max over devices / mean."""
    return float(np.max(x) / np.mean(x)) if np.mean(x) > 0 else 1.0


# ----------------------------------------------------------------------- baseline


def _dense_attention(q, k_all, v_all, ids, ids_all, pos, pos_all) -> jax.Array:
    """Queries q [b, length, hq, d] (segment ids [b, length], natural positions [length])
    attend every key of k_all / v_all [b, seq, hkv, d] (ids_all [b, seq], pos_all [seq])
    of their document at or before their position; the scores as one dense array. Padding
    queries (id <= 0) output 0."""
    b, length, hq, d = q.shape
    group = hq // k_all.shape[2]
    qg = q.reshape(b, length, k_all.shape[2], group, d)
    s = jnp.einsum("blhgd,bshd->bhgls", qg, k_all, precision=lax.Precision.HIGHEST)
    s = s / np.sqrt(d).astype(np.float32)
    allowed = (ids[:, :, None] == ids_all[:, None, :]) & (ids[:, :, None] > 0)
    allowed &= pos_all[None, None, :] <= pos[None, :, None]  # [b, length, seq]
    s = jnp.where(allowed[:, None, None], s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bhgls,bshd->blhgd", p, v_all, precision=lax.Precision.HIGHEST)
    return out.reshape(b, length, hq, d).astype(q.dtype)


def dense_reference(q, k, v, ids, allowed) -> jax.Array:
    """The oracle: causal attention within documents over the whole (unsharded) sequence
    in natural order, [b, seq, hq, d], by `jax.nn.dot_product_attention` with the dense
    boolean mask `allowed` [b, seq, seq] (`allowed_mask(ids)`; JAX's code, not the
    baseline's); padding queries (id 0) output 0."""
    with jax.default_matmul_precision("highest"):
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=allowed[:, None],
            implementation="xla",  # one mask for every head
        )
    return jnp.where((ids > 0)[:, :, None, None], out, 0.0)


def all_gather_attention(q, k, v, ids, pos, *, mesh: Mesh) -> jax.Array:
    """Causal attention with the sequence sharded over `AXIS`: each device all-gathers K,
    V, segment ids and positions, then attends its query shard to the whole sequence with
    a dense mask from global positions (any layout: `pos` holds each stored token's
    natural position). Padding queries (id <= 0) output 0."""
    seq = P(None, AXIS)

    def body(q, k, v, ids, pos):
        gather = functools.partial(lax.all_gather, axis_name=AXIS, tiled=True)
        k_all, v_all, ids_all = (gather(x, axis=1) for x in (k, v, ids))
        pos_all = gather(pos, axis=0)
        return _dense_attention(q, k_all, v_all, ids, ids_all, pos, pos_all)

    return jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, seq, P(AXIS)), out_specs=seq)(
        q, k, v, ids, pos
    )


# ------------------------------------------------------------------------- timing


def _mesh(ring_size: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:ring_size]), (AXIS,))


def _ring_forward(mesh: Mesh, layout: str) -> Callable:
    def forward(q, k, v, ids):
        return ring_attention(
            q, k, v, mesh=mesh, axis_name=AXIS, segment_ids=ids, causal=True,
            sequence_layout=layout, implementation="xla", return_stats=True,
        )  # fmt: skip

    return forward


def _grad(forward: Callable) -> Callable:
    """d sum(forward(q, k, v, *rest)) / d (q, k, v)."""
    return jax.grad(lambda q, k, v, *rest: jnp.sum(forward(q, k, v, *rest)), argnums=(0, 1, 2))


def _ring_grad(mesh: Mesh, layout: str) -> Callable:
    return _grad(lambda q, k, v, ids: _ring_forward(mesh, layout)(q, k, v, ids)[0])


class _Compiled:
    """One function compiled once for its arguments: compile seconds, per-device temp
    bytes, and the executable."""

    def __init__(self, fn: Callable, *args: Any):
        start = time.perf_counter()
        self.run = jax.jit(fn).lower(*args).compile()
        self.compile_s = time.perf_counter() - start
        stats = self.run.memory_analysis()
        self.temp = getattr(stats, "temp_size_in_bytes", None) if stats else None


def _max_abs(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _max_rel(a, b) -> float:
    """Largest over leaves of max |a - b| / max |b|."""
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _natural(tree, ring_size: int, layout: str):
    if layout == "contiguous":
        return tree
    return jax.tree.map(lambda x: reorder_sequence(x, ring_size, to_contiguous=True), tree)


def _stored(tree, ring_size: int, layout: str):
    if layout == "contiguous":
        return tree
    return jax.tree.map(lambda x: reorder_sequence(x, ring_size), tree)


class _Bench:
    """The inputs, the reference results and the timing of one sequence length."""

    def __init__(self, seq: int, repeats: int):
        self.seq, self.repeats = seq, repeats
        self.q, self.k, self.v, self.ids = _inputs(seq)
        self.allowed = allowed_mask(np.asarray(self.ids))
        # Useful forward FLOPs: QK^T and PV (2 * HEAD_DIM each) per allowed entry and q head.
        self.forward_flops = 4.0 * HEAD_DIM * Q_HEADS * int(self.allowed.sum())

        args = (self.q, self.k, self.v, self.ids, self.allowed)
        self.ref_out = jax.jit(dense_reference)(*args)
        self.ref_grad = jax.jit(_grad(dense_reference))(*args)
        self.shape = f"B{BATCH} S{seq} Hq{Q_HEADS}/kv{KV_HEADS} D{HEAD_DIM} f32 causal"

    def args(self, ring_size: int, layout: str) -> tuple:
        """(q, k, v, ids) in `layout`'s order."""
        return _stored((self.q, self.k, self.v, self.ids), ring_size, layout)

    def time(self, fn: Callable, *args) -> tuple[_Compiled, tuple[float, ...], Any]:
        compiled = _Compiled(fn, *args)
        times, out = repeat_seconds(compiled.run, *args, repeats=self.repeats)
        return compiled, times, out

    def baseline(self, ring_size: int, grad: bool) -> dict[str, Any]:
        """The all-gather baseline timed in the contiguous order (its dense cost does not
        depend on the layout) and checked in both."""
        mesh = _mesh(ring_size)
        fn = functools.partial(all_gather_attention, mesh=mesh)
        fn = _grad(fn) if grad else fn
        pos = {lay: jnp.asarray(positions(self.seq, ring_size, lay)) for lay in LAYOUTS}
        compiled, times, _ = self.time(fn, *self.args(ring_size, "contiguous"), pos["contiguous"])
        errors = {}
        for layout in LAYOUTS:
            out = compiled.run(*self.args(ring_size, layout), pos[layout])
            errors[layout] = self._error(_natural(out, ring_size, layout), grad)
        return {"compiled": compiled, "times": times, "errors": errors}

    def _error(self, result, grad: bool) -> float:
        return _max_rel(result, self.ref_grad) if grad else _max_abs(result, self.ref_out)

    def ring(self, ring_size: int, layout: str, grad: bool) -> dict[str, Any]:
        mesh = _mesh(ring_size)
        fn = _ring_grad(mesh, layout) if grad else _ring_forward(mesh, layout)
        compiled, times, result = self.time(fn, *self.args(ring_size, layout))
        stats = None
        if not grad:
            result, ring_stats = result
            # The same executable on one causal document per row (ids all 1): the case
            # the load-balanced order is built for.
            q, k, v, ids = self.args(ring_size, layout)
            _, one_doc = compiled.run(q, k, v, jnp.ones_like(ids))
            stats = {
                case: {name: np.asarray(getattr(st, name)) for name in st._fields}
                for case, st in (("documents", ring_stats), ("one document", one_doc))
            }
        error = self._error(_natural(result, ring_size, layout), grad)
        return {"compiled": compiled, "times": times, "error": error, "stats": stats}


# ------------------------------------------------------------------------- report


def _print_bytes(seq: int, sizes: list[int]) -> list[BenchRow]:
    print(
        "  bytes sent per device (= received), from shapes: ring hops vs the all-gather "
        "baseline (AG) and its backward reduce-scatter of dK/dV (RS)"
    )
    print(
        f"  {'R':>2}  {'fwd step':>9}  {'fwd total':>9}  {'bwd step':>9}  {'bwd total':>9}"
        f"  {'AG recv':>9}  {'RS dK/dV':>9}  {'K+V held':>9}  {'AG K+V':>9}  step FLOP/B"
    )
    rows = []
    for r in sizes:
        b = ring_bytes(seq, r)
        intensity = step_flops(seq, r) / b["fwd_step"]
        held = (2 if r > 1 else 1) * b["kv_shard"]
        print(
            f"  {r:>2}  {_kib(b['fwd_step']):>9}  {_kib(b['fwd_total']):>9}  "
            f"{_kib(b['bwd_step']):>9}  {_kib(b['bwd_total']):>9}  {_kib(b['gather']):>9}  "
            f"{_kib(b['scatter']):>9}  {_kib(held):>9}  {_kib(b['kv_full']):>9}"
            f"  {intensity:>10.0f}"
        )
        hops = r - 1
        rows.append(
            BenchRow(
                SECTION,
                "ring bytes/device fwd|bwd",
                f"S{seq} R{r}",
                (
                    f"{hops}x{_kib(b['fwd_step'])} | {hops}x{_kib(b['bwd_step'])}"
                    f"+{_kib(b['bwd_total'] - hops * b['bwd_step'])}"
                )
                if r > 1
                else "no hops",
                baseline=f"AG {_kib(b['gather'])} | RS {_kib(b['scatter'])}",
                params={"seq_len": seq, "ring_size": r},
            )
        )
    print(
        "  K+V held: the ring's own shard plus the one in flight (the backward adds the "
        "same again in float32 dK/dV); AG K+V: the gathered sequence the baseline holds "
        "(and keeps for its backward). step FLOP/B: forward FLOPs of one unmasked shard "
        "pair per byte of one hop."
    )
    return rows


def _print_balance(seq: int, sizes: list[int], masks: dict, stats: dict) -> list[BenchRow]:
    print(
        "  causal work per device, max/mean over devices: allowed (query, key) pairs "
        "counted from the mask in numpy; chunk-pair kernel calls and active steps "
        "(RingStats where run, else numpy)"
    )
    rows = []
    for case, allowed in masks.items():
        for r in sizes:
            rows.append(_balance_row(seq, r, case, allowed, stats))
    return rows


def _balance_row(seq: int, r: int, case: str, allowed: np.ndarray, stats: dict) -> BenchRow:
    cells, ok = [], None
    for layout in LAYOUTS:
        expected = expected_work(allowed, r, layout)
        got = stats.get((r, layout), {}).get(case)
        match = None
        if got is not None:
            names = ("kernel_calls", "active_steps")
            match = all(np.array_equal(got[name], expected[name]) for name in names)
            ok = match if ok is None else ok and match
        source = expected if got is None else got
        checked = "" if got is None else f" (RingStats; numpy {'agrees' if match else 'DIFFERS'})"
        print(
            f"  {case:<12} R{r} {layout:<13} pairs {expected['pairs'].tolist()} "
            f"max/mean {imbalance(expected['pairs']):.2f}; kernel_calls "
            f"{source['kernel_calls'].tolist()} max/mean {imbalance(source['kernel_calls']):.2f}; "
            f"active_steps {source['active_steps'].tolist()}{checked}"
        )
        cells.append(
            f"{imbalance(expected['pairs']):.2f}x/{imbalance(source['kernel_calls']):.2f}x"
        )
    return BenchRow(
        SECTION,
        "ring work max/mean pairs/calls",
        f"S{seq} R{r} {'docs' if case == 'documents' else '1 doc'}",
        f"contig {cells[0]}",
        baseline=f"balanced {cells[1]}",
        ok=ok,
        params={"seq_len": seq, "ring_size": r},
    )


def _temp(compiled: _Compiled) -> str:
    return "?" if compiled.temp is None else _kib(compiled.temp)


def _timed_rows(bench: _Bench, ring_size: int, plan: dict, stats: dict) -> list[BenchRow]:
    """plan: {grad (bool): layouts to time}."""
    rows = []
    hop = f"hop {_kib(ring_bytes(bench.seq, ring_size)['fwd_step'])}" if ring_size > 1 else "no hop"
    for grad, layouts in plan.items():
        base = bench.baseline(ring_size, grad)
        name = "fwd+bwd" if grad else "fwd"
        tolerance = GRAD_TOLERANCE if grad else OUTPUT_TOLERANCE
        print(
            f"  R{ring_size} all-gather {name}: {np.median(base['times']) * 1e3:.1f} ms, "
            f"compile {base['compiled'].compile_s:.1f} s, temp {_temp(base['compiled'])}"
            f"/device, error {max(base['errors'].values()):.1e}"
        )
        for layout in layouts:
            ring = bench.ring(ring_size, layout, grad)
            if ring["stats"] is not None:
                stats[(ring_size, layout)] = ring["stats"]
            print(
                f"  R{ring_size} ring {layout} {name}: {np.median(ring['times']) * 1e3:.1f} ms, "
                f"compile {ring['compiled'].compile_s:.1f} s, temp "
                f"{_temp(ring['compiled'])}/device, error {ring['error']:.1e}"
            )
            ok = ring["error"] <= tolerance and base["errors"][layout] <= tolerance
            rows.append(
                BenchRow(
                    SECTION,
                    f"ring_attention {name}",
                    f"{bench.shape} R{ring_size} {hop}",
                    f"{jax.default_backend()} xla {layout}",
                    ring["times"],
                    baseline="all-gather dense",
                    baseline_times=base["times"],
                    ok=ok,
                    flops=bench.forward_flops * (FWD_BWD_FLOP_FACTOR if grad else 1),
                    params={"seq_len": bench.seq, "ring_size": ring_size},
                )
            )
    return rows


def main(*, full: bool = False) -> list[BenchRow]:
    """Prints the bytes, balance and timing tables; returns their rows (a skipped row
    for ring sizes above the device count). `full`: `python -m bench --full`'s sizes."""
    seq = FULL_SEQ if full else QUICK_SEQ
    devices = len(jax.devices())
    sizes = [r for r in RING_SIZES if r <= devices]
    timed = sizes if full else [max(r for r in sizes if r <= QUICK_RING)]
    # Quick: the forward of both layouts (both RingStats checked) and the contiguous
    # fwd+bwd (the load-balanced one compiles for 25 s); full: everything at every R.
    quick_plan = {False: LAYOUTS, True: ("contiguous",)}
    plans = dict.fromkeys(timed, dict.fromkeys((False, True), LAYOUTS) if full else quick_plan)
    bench = _Bench(seq, repeats=5 if full else 3)
    print(
        f"ring_attention: {bench.shape}, ring sizes {sizes}, timed {timed}, "
        f"{devices} {jax.default_backend()} device(s)"
    )
    if jax.default_backend() == "cpu":
        print(
            f"  the {devices} devices are fake CPU devices sharing {os.cpu_count()} cores: "
            "times measure each sharded program's overhead, not a speed-up"
        )
    rows = _print_bytes(seq, sizes)
    stats: dict = {}
    timed_rows = [row for r in timed for row in _timed_rows(bench, r, plans[r], stats)]
    one_document = allowed_mask(np.ones_like(np.asarray(bench.ids)))
    masks = {"documents": bench.allowed, "one document": one_document}
    rows += _print_balance(seq, sizes, masks, stats)
    rows += timed_rows
    skipped = [r for r in RING_SIZES if r > devices]
    if skipped:
        print(
            f"  ring sizes {skipped} skipped: {devices} device(s); set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before JAX starts to run them"
        )
        rows.append(
            BenchRow(
                SECTION,
                "ring_attention",
                f"S{seq} R{','.join(map(str, skipped))}",
                f"skipped: {devices} device(s)",
            )
        )
    return rows


if __name__ == "__main__":
    from bench.report import format_table

    print(format_table(main(full="--full" in sys.argv[1:])))
