"""Ring attention on 2..8 fake CPU devices against a dense oracle on the whole sequence.

The oracle is written here from the definition (global positions, segment ids, window),
independent of the varlen machinery the ring reuses. Work skipping is checked against
the same dense mask: a ring step (or chunk pair) must run a kernel exactly when one of its
(query, key) pairs is allowed.

Numerics: the oracle and its gradients run in float64 (`_float64`) and every comparison
uses the attention helpers' `assert_close` with `attention_tolerance` of the problem
(`_tolerance`: score bound over all rows, longest reduction the whole sequence), so the
bound follows the scores' size and is recorded by tests/margins.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bridge import flash_attention, reorder_sequence
from jax_bridge.attention.ring import ring_attention, ring_attention_shard
from tests.attention.helpers import assert_close, attention_tolerance
from tests.devices import first_devices

BATCH, SEQ, HEAD_DIM = 2, 48, 16


def _mesh(ring_size: int) -> Mesh:
    return Mesh(np.array(first_devices(ring_size)), ("cp",))


def _segment_ids(rng) -> np.ndarray:
    """Documents of random lengths (some crossing every shard boundary) and padding."""
    rows = []
    for _ in range(BATCH):
        lengths = rng.integers(1, 20, size=SEQ)
        ids = np.repeat(np.arange(1, SEQ + 1), lengths)[:SEQ]
        ids[rng.integers(SEQ // 2, SEQ) :] = 0  # trailing padding
        rows.append(ids)
    return np.stack(rows).astype(np.int32)


def _allowed(ids: np.ndarray, causal: bool, window) -> np.ndarray:
    """bool [batch, seq, seq] in natural order: query p may attend key p'."""
    pos = np.arange(SEQ)
    diff = pos[None, :] - pos[:, None]  # p' - p
    allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
    left, right = window if window is not None else (None, None)
    right = 0 if causal else right
    if left is not None:
        allowed &= diff >= -left
    if right is not None:
        allowed &= diff <= right
    return allowed


def _oracle(q, k, v, allowed, sinks=None):
    """Dense float32 attention over the whole sequence; a row with nothing allowed is 0."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(q.shape[-1])
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
        s = jnp.concatenate([s, column], axis=-1)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def _tolerance(q, k, sinks=None) -> float:
    """`attention_tolerance` of [batch, seq, heads, dim] inputs: rows of every batch
    entry in one score bound (an upper bound), reductions up to the whole sequence."""
    flat = lambda x: jnp.asarray(x).reshape(-1, *x.shape[2:])
    return attention_tolerance(flat(q), flat(k), cu_q=[0, SEQ], cu_k=[0, SEQ], sinks=sinks)


def _float64(fn, *args):
    """`fn(*args)` in float64: inputs widened (exactly) under jax.enable_x64; numpy float64
    leaves."""
    with jax.enable_x64(True):
        wide = [None if a is None else jnp.asarray(np.asarray(a, np.float64)) for a in args]
        return jax.tree.map(lambda x: np.asarray(x, np.float64), fn(*wide))


def _oracle64(q, k, v, allowed, sinks=None) -> np.ndarray:
    return _float64(lambda q, k, v, s: _oracle(q, k, v, allowed, s), q, k, v, sinks)


def _oracle_grads64(q, k, v, allowed, sinks, weights, argnums):
    """Gradients of sum(oracle * weights) in float64, for `argnums` of (q, k, v, sinks)."""

    def grads(q, k, v, s, w):
        loss = lambda q, k, v, s: jnp.sum(_oracle(q, k, v, allowed, s) * w)
        return jax.grad(loss, argnums)(q, k, v, s)

    return _float64(grads, q, k, v, sinks, weights)


def _device_positions(ring_size: int, layout: str) -> np.ndarray:
    """[R, chunks, chunk_len]: natural positions of each device's chunks."""
    order = np.arange(SEQ)
    if layout == "load_balanced":
        order = np.asarray(reorder_sequence(order[None], ring_size))[0]
        return order.reshape(ring_size, 2, -1)
    return order.reshape(ring_size, 1, -1)


def _expected_work(allowed: np.ndarray, ring_size: int, layout: str):
    """Per device (steps with an allowed pair, chunk pairs with an allowed pair)."""
    chunks = _device_positions(ring_size, layout)
    steps, calls = np.zeros(ring_size, int), np.zeros(ring_size, int)
    for rank in range(ring_size):
        for step in range(ring_size):
            source = (rank - step) % ring_size
            busy = [allowed[:, qc][:, :, kc].any() for qc in chunks[rank] for kc in chunks[source]]
            calls[rank] += sum(busy)
            steps[rank] += any(busy)
    return steps, calls


def _problem(seed: int, num_q: int, num_kv: int, with_ids: bool):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((BATCH, SEQ, num_q, HEAD_DIM)), jnp.float32)
    k, v = (
        jnp.asarray(rng.standard_normal((BATCH, SEQ, num_kv, HEAD_DIM)), jnp.float32) for _ in "kv"
    )
    ids = _segment_ids(rng) if with_ids else None
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(num_q), jnp.float32)
    return q, k, v, ids, weights, sinks


def _ring_fn(ring_size, layout, ids, **kw):
    """q, k, v (natural order) -> (out natural order, stats), through the layout."""
    mesh = _mesh(ring_size)
    balanced = layout == "load_balanced"
    to_layout = (lambda x: reorder_sequence(x, ring_size)) if balanced else (lambda x: x)
    back = (
        (lambda x: reorder_sequence(x, ring_size, to_contiguous=True))
        if balanced
        else (lambda x: x)
    )
    ids_in = None if ids is None else to_layout(jnp.asarray(ids))
    implementation = kw.pop("implementation", "xla")

    def run(q, k, v, sinks=None):
        out, stats = ring_attention(
            to_layout(q), to_layout(k), to_layout(v),
            mesh=mesh, axis_name="cp", segment_ids=ids_in, sinks=sinks,
            sequence_layout=layout, implementation=implementation,
            return_stats=True, **kw,
        )  # fmt: skip
        return back(out), stats

    return run


CASES = [
    # ring, layout, causal, window, documents, (q heads, kv heads), sinks, gradients
    (1, "contiguous", True, None, True, (4, 2), False, True),
    (2, "load_balanced", True, None, True, (4, 2), True, True),
    (3, "contiguous", False, (5, 3), True, (2, 2), False, True),
    (3, "load_balanced", True, (9, None), True, (2, 1), False, True),
    (4, "contiguous", True, None, False, (2, 2), False, True),
    (4, "load_balanced", False, None, True, (4, 2), False, False),
    (8, "load_balanced", True, None, True, (4, 2), False, True),
    (8, "contiguous", True, (6, None), True, (2, 2), True, False),
    (2, "contiguous", False, (None, 4), False, (2, 1), False, False),
]


@pytest.mark.parametrize(
    "ring_size, layout, causal, window, docs, heads, with_sinks, grads",
    CASES,
    ids=[f"R{c[0]}-{c[1]}-causal{int(c[2])}-w{c[3]}-docs{int(c[4])}" for c in CASES],
)
def test_ring_equals_whole_sequence(
    ring_size, layout, causal, window, docs, heads, with_sinks, grads
):
    q, k, v, ids, weights, sinks = _problem(ring_size, *heads, docs)
    ids_np = ids if docs else np.ones((BATCH, SEQ), np.int32)
    allowed = _allowed(ids_np, causal, window)
    sinks = sinks if with_sinks else None
    run = jax.jit(_ring_fn(ring_size, layout, ids, causal=causal, sliding_window=window))
    out, stats = run(q, k, v, sinks)
    tol = _tolerance(q, k, sinks)
    assert_close(out, _oracle64(q, k, v, allowed, sinks), tol, "out")
    steps, calls = _expected_work(allowed, ring_size, layout)
    np.testing.assert_array_equal(stats.active_steps, steps)
    np.testing.assert_array_equal(stats.kernel_calls, calls)
    if not grads:
        return
    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    loss = lambda q, k, v, s: jnp.sum(run(q, k, v, s)[0] * weights)
    got = jax.grad(loss, argnums)(q, k, v, sinks)
    want = _oracle_grads64(q, k, v, allowed, sinks, weights, argnums)
    for name, g, w in zip("q k v sinks".split(), got, want, strict=False):
        assert_close(g, w, tol, f"d{name}")


def test_ring_equals_flash_attention_and_skips_by_causality():
    """Contiguous causal ring: rank r works on exactly r + 1 steps; the balanced order
    gives every rank the same number of pair kernels."""
    q, k, v, ids, _, _ = _problem(11, 4, 2, True)
    want = flash_attention(q, k, v, q_segment_ids=jnp.asarray(ids), causal=True)
    ones = np.ones((BATCH, SEQ), np.int32)
    for layout in ("contiguous", "load_balanced"):
        out, _ = jax.jit(_ring_fn(4, layout, ids, causal=True))(q, k, v)
        # Two float32 runs, each within tol of the oracle.
        assert_close(out, np.asarray(want, np.float64), 2 * _tolerance(q, k), f"{layout} out")
        _, stats_dense = jax.jit(_ring_fn(4, layout, None, causal=True))(q, k, v)
        expected = _expected_work(_allowed(ones, True, None), 4, layout)
        np.testing.assert_array_equal(stats_dense.active_steps, expected[0])
        if layout == "contiguous":
            np.testing.assert_array_equal(stats_dense.active_steps, [1, 2, 3, 4])
        else:
            np.testing.assert_array_equal(stats_dense.kernel_calls, [3 + 2 * 3] * 4)


def test_vmap_and_empty_inputs():
    q, k, v, _, _, _ = _problem(6, 2, 2, False)
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=_mesh(2), axis_name="cp", causal=True)
    stacked = jnp.stack([q, q[::-1]])
    batched = jax.vmap(ring, in_axes=(0, None, None))(stacked, k, v)
    for i in range(2):
        single = np.asarray(ring(stacked[i], k, v), np.float64)
        assert_close(batched[i], single, _tolerance(stacked[i], k), f"batch {i}")
    assert ring(q[:0], k[:0], v[:0]).shape == (0, *q.shape[1:])
    assert ring(q[:, :0], k[:, :0], v[:, :0]).shape == (BATCH, 0, *q.shape[2:])


def test_make_mesh_explicit_axes_and_inputs_sharded_otherwise():
    """`jax.make_mesh` gives explicit axes, where a jitted shard_map refuses inputs not
    laid out as its spec: the op reshards them (here batch over "data", heads over "cp")."""
    q, k, v, ids, weights, sinks = _problem(21, 4, 2, True)
    mesh = jax.make_mesh((2, 2), ("data", "cp"), devices=first_devices(4))
    assert jax.sharding.AxisType.Explicit in mesh.axis_types
    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    placed = [put(x, P("data", None, "cp")) for x in (q, k, v)]
    ring = lambda q, k, v, s: ring_attention(
        q, k, v, mesh=mesh, axis_name="cp", segment_ids=put(ids, P("data")), sinks=s,
        causal=True, implementation="xla",
    )  # fmt: skip
    allowed = _allowed(ids, True, None)
    tol = _tolerance(q, k, sinks)
    assert_close(ring(*placed, sinks), _oracle64(q, k, v, allowed, sinks), tol, "out")
    loss = lambda *a: jnp.sum(ring(*a) * weights)
    got = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*placed, sinks)
    want = _oracle_grads64(q, k, v, allowed, sinks, weights, (0, 1, 2, 3))
    for name, g, w in zip("q k v sinks".split(), got, want, strict=True):
        assert_close(g, w, tol, f"d{name}")


def test_nan_in_one_document_stays_there():
    q, k, v, ids, _, _ = _problem(5, 2, 2, True)
    poisoned = ids[0] == ids[0, SEQ // 4]  # a document of row 0
    k = k.at[0, np.flatnonzero(poisoned)[0]].set(jnp.nan)
    out, _ = jax.jit(_ring_fn(3, "contiguous", ids, causal=False))(q, k, v)
    clean = np.ones((BATCH, SEQ), bool)
    clean[0, poisoned] = False
    assert np.isfinite(np.asarray(out)[clean]).all()
    assert np.isnan(np.asarray(out)[0, poisoned]).all()


def test_triton_kernels_in_the_ring():
    """The Triton kernels (through the interpreter) run the same pairs, shift included,
    forward and backward (whose pairs take the ring's merged out and lse, not their own
    forward's), sinks' gradient (summed over the ring) included."""
    q, k, v, ids, weights, sinks = _problem(3, 2, 1, True)
    window = (7, None)
    allowed = _allowed(ids, True, window)
    run = jax.jit(
        _ring_fn(2, "load_balanced", ids, causal=True, sliding_window=window,
                 implementation="triton")
    )  # fmt: skip
    out, stats = run(q, k, v, sinks)
    tol = _tolerance(q, k, sinks)
    assert_close(out, _oracle64(q, k, v, allowed, sinks), tol, "out")
    np.testing.assert_array_equal(
        stats.kernel_calls, _expected_work(allowed, 2, "load_balanced")[1]
    )
    loss = lambda q, k, v, s: jnp.sum(run(q, k, v, s)[0] * weights)
    got = jax.grad(loss, (0, 1, 2, 3))(q, k, v, sinks)
    want = _oracle_grads64(q, k, v, allowed, sinks, weights, (0, 1, 2, 3))
    for name, g, w in zip(("q", "k", "v", "sinks"), got, want, strict=True):
        assert_close(g, w, tol, f"d{name}")


def test_pallas_kernels_in_the_ring():
    """The splash kernels (Pallas interpret mode), forward and gradients, through
    `ring_attention_shard` in a user's shard_map. Unchecked (check_vma=False): off-TPU a
    checked shard_map needs Pallas' TPU interpreter, minutes per call at any size."""
    q, k, v, ids, weights, _ = _problem(4, 2, 1, True)
    allowed = _allowed(ids, True, None)
    seq = P(None, "cp")
    run = jax.shard_map(
        lambda q, k, v, ids: ring_attention_shard(
            q, k, v, axis_name="cp", segment_ids=ids, causal=True, implementation="pallas"
        ),
        mesh=_mesh(2),
        in_specs=(seq,) * 4,
        out_specs=seq,
        check_vma=False,
    )
    ids = jnp.asarray(ids)
    out = jax.jit(run)(q, k, v, ids)
    tol = _tolerance(q, k)
    assert_close(out, _oracle64(q, k, v, allowed), tol, "out")
    loss = lambda q, k, v: jnp.sum(run(q, k, v, ids) * weights)
    got = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    want = _oracle_grads64(q, k, v, allowed, None, weights, (0, 1, 2))
    for name, g, w in zip("qkv", got, want, strict=True):
        assert_close(g, w, tol, f"d{name}")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sequence_layout="zigzag"), ValueError, "sequence_layout"),
        (dict(sequence_layout="load_balanced", ring=5), ValueError, "divisible by 10"),
        (dict(ring=5), ValueError, "divisible by 5"),
        (dict(implementation="pallas", sliding_window=(4, 0)), ValueError, "pallas"),
        (dict(axis_name="sp"), ValueError, "axis_name"),
        (dict(segment_ids=np.tile(np.repeat([1, 2, 1], 16), (BATCH, 1))), ValueError, "contiguous"),
        (dict(segment_ids=np.ones((BATCH, SEQ), np.float32)), TypeError, "integer"),
        # int64 ids past int32 would wrap: 2**32 + 1 into document 1's id
        (
            dict(segment_ids=np.tile(np.repeat([1, 2**32 + 1, 3], 16), (BATCH, 1))),
            ValueError,
            "ring_attention: segment_ids holds values that do not fit int32",
        ),
        (dict(causal=1), TypeError, "causal"),
        (dict(return_stats="no"), TypeError, "return_stats must be a bool"),
        (dict(sinks=jnp.ones(3)), ValueError, "sinks"),
        (dict(implementation="cuda"), ValueError, "ring_attention: implementation must be"),
        (dict(segment_ids=np.ones(SEQ, np.int32)), ValueError, r"\[batch, seq\] = \(2, 48\)"),
        (dict(config=object()), TypeError, "config"),
        # Reordered for a ring of 4, run on a ring of 2: the error names the ring size.
        (
            dict(
                sequence_layout="load_balanced",
                segment_ids=reorder_sequence(np.tile(np.repeat([1, 2, 3], 16), (BATCH, 1)), 4),
            ),
            ValueError,
            r"reorder_sequence\(x, 2\) order: the mesh axis has 2 device",
        ),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    q, k, v, _, _, _ = _problem(0, 2, 2, False)
    ring = kwargs.pop("ring", 2)
    kwargs.setdefault("axis_name", "cp")
    with pytest.raises(error, match=match) as info:
        ring_attention(q, k, v, mesh=_mesh(ring), **kwargs)
    assert "ring_attention" in str(info.value)


def test_k_must_match_q_sequence():
    q, k, v, _, _, _ = _problem(0, 2, 2, False)
    with pytest.raises(ValueError, match="ring_attention: q and k must have the same") as info:
        ring_attention(q, k[:, :24], v[:, :24], mesh=_mesh(2), axis_name="cp")
    assert "q (2, 48, 2, 16) and k (2, 24, 2, 16)" in str(info.value)  # as passed, not shards


def test_shape_errors_quote_the_arrays_as_passed():
    q, k, v, _, _, _ = _problem(0, 2, 2, False)
    with pytest.raises(ValueError, match=r"ring_attention: v must have the shape of k") as info:
        ring_attention(q, k, v[..., :1, :], mesh=_mesh(2), axis_name="cp")
    assert "k (2, 48, 2, 16) and v (2, 48, 1, 16)" in str(info.value)


def test_forward_mode_is_refused_naming_the_op():
    q, k, v, _, _, _ = _problem(0, 2, 2, False)
    run = lambda q: ring_attention(q, k, v, mesh=_mesh(2), axis_name="cp")
    with pytest.raises(NotImplementedError, match="ring_attention: forward-mode"):
        jax.jvp(run, (q,), (q,))
