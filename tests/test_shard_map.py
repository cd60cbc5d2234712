"""Every op inside `jax.shard_map` with its default settings (`check_vma=True`), on 4 of
the 8 fake CPU devices, forward and gradient, against the same op run unsharded.

Data-parallel attention: each device holds its own packed tokens and cu_seqlens; the
unsharded run packs all four shards into one batch (block-sparse attention: one batch
entry per device, against the op on each entry). Expert-parallel grouped matmul: each
device holds a quarter of the experts (`group_offset`), every device sees every token, and
a `psum` over the expert axis combines the rows. Last, a mesh of every CPU device, which
the Pallas backend refuses under JAX 0.10 (its TPU interpreter would never return).

Both sides are float32 runs of one op, each within its op's float64-derived bound of the
oracle (the attention tests' tol, the grouped matmul tests' element-wise bound): they
are compared at twice the attention bound, and at the grouped matmul bound, which counts
two float32 paths already.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bridge import (
    block_sparse_attention,
    grouped_matmul,
    transposed_grouped_matmul,
    varlen_attention,
)
from pallas_tpu.splash import CausalMask, DocumentMask, FullMask, make_splash_mha
from pallas_tpu.splash.common import batches_in_grid
from tests.attention.helpers import assert_close, attention_tolerance
from tests.devices import first_devices
from tests.grouped_matmul import helpers as gm

IMPLEMENTATIONS = ("xla", "triton")
# Off a TPU the Pallas kernels run in the TPU interpreter inside a checked shard_map.
ATTENTION_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "pallas")
SHARDS = 4


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(first_devices(SHARDS)), ("d",))


def _attention_problem():
    rng = np.random.default_rng(7)
    tokens = 48  # per shard; documents differ between shards, some empty, plus padding
    lengths = [[20, 0, 25], [1, 40, 3], [47, 0, 0], [10, 10, 10]]
    cu = np.array([np.concatenate([[0], np.cumsum(lens)]) for lens in lengths], np.int32)
    q = jnp.asarray(rng.standard_normal((SHARDS * tokens, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((SHARDS * tokens, 2, 32)), jnp.float32) for _ in "kv")
    sinks = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    return q, k, v, sinks, jnp.asarray(cu), lengths


def _global_cu(cu, lengths, tokens=48):
    """Unsharded cu_seqlens: every shard's documents, then its padding as an empty-key run."""
    bounds = [0]
    for s, lens in enumerate(lengths):
        for length in lens:
            bounds.append(bounds[-1] + length)
        bounds.append((s + 1) * tokens)  # the shard's padding: one more sequence
    return np.asarray(bounds, np.int32)


@pytest.mark.parametrize("implementation", ATTENTION_IMPLEMENTATIONS)
def test_data_parallel_attention_forward_and_gradient(mesh, implementation):
    q, k, v, sinks, cu, lengths = _attention_problem()
    options = dict(causal=True, sliding_window=(17, None), implementation=implementation)

    def local(q, k, v, cu, sinks):
        return varlen_attention(q, k, v, cu[0], cu[0], sinks=sinks, **options)

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d"), P("d"), P("d"), P()), out_specs=P("d")
    )
    # The padding of each shard attends only itself in the unsharded run: compare only
    # the real tokens, where both runs mean the same thing.
    g_cu = jnp.asarray(_global_cu(cu, lengths))
    real = np.concatenate([s * 48 + np.arange(sum(lens)) for s, lens in enumerate(lengths)])

    def unsharded(q, k, v, sinks):
        return varlen_attention(q, k, v, g_cu, g_cu, sinks=sinks, **options)

    weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    out = jax.jit(sharded)(q, k, v, cu, sinks)
    expected = unsharded(q, k, v, sinks)
    tol = 2 * attention_tolerance(q, k, cu_q=g_cu, cu_k=g_cu, sinks=sinks)
    assert_close(out[real], expected[real], tol, "out")
    assert_close(sharded(q, k, v, cu, sinks), out, tol, "out, eager")

    def loss(fn):
        return lambda q, k, v, s: jnp.sum(fn(q, k, v, s)[real] * weights[real])

    grads = jax.jit(jax.grad(loss(lambda *a: sharded(*a[:3], cu, a[3])), (0, 1, 2, 3)))(
        q, k, v, sinks
    )
    expected_grads = jax.grad(loss(unsharded), (0, 1, 2, 3))(q, k, v, sinks)
    for name, got, want in zip("q k v sinks".split(), grads, expected_grads, strict=True):
        assert_close(got, want, tol, f"d{name}")


@pytest.mark.parametrize("implementation", ATTENTION_IMPLEMENTATIONS)
def test_data_parallel_block_sparse_attention_forward_and_gradient(mesh, implementation):
    """One batch entry per device, each with its own traced documents (windowed inside),
    sinks and ALiBi slopes (not in the splash kernels) replicated: equal to the op on
    each entry's static mask."""
    q, k, v, sinks, cu, _ = _attention_problem()
    to_batch = lambda x: x.reshape(SHARDS, -1, *x.shape[1:])  # [4, 48, heads, dim]
    q, k, v = to_batch(q), to_batch(k), to_batch(v)
    slopes = jnp.asarray(np.random.default_rng(2).uniform(0.05, 0.3, 4), jnp.float32)
    slopes = None if implementation == "pallas" else slopes
    options = dict(sinks=sinks, alibi_slopes=slopes, implementation=implementation)
    documents = lambda cu: DocumentMask(cu, shape=(48, 48), window=(17, 0))

    def local(q, k, v, cu, sinks):
        return block_sparse_attention(q, k, v, documents(cu[0]), **(options | dict(sinks=sinks)))

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d"), P("d"), P("d"), P()), out_specs=P("d")
    )

    def unsharded(q, k, v, sinks):
        one = lambda i: block_sparse_attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], documents(np.asarray(cu[i])),
            **(options | dict(sinks=sinks)),
        )  # fmt: skip
        entries = [one(i) for i in range(SHARDS)]
        return jnp.concatenate(entries)

    tokens = lambda x: x.reshape(-1, *x.shape[2:])  # every pair of every entry: a bound
    tol = 2 * attention_tolerance(tokens(q), tokens(k), sinks=sinks, slopes=slopes)
    assert_close(jax.jit(sharded)(q, k, v, cu, sinks), unsharded(q, k, v, sinks), tol, "out")
    weights = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
    loss = lambda fn: lambda q, k, v, s: jnp.sum(fn(q, k, v, s) * weights)
    grads = jax.jit(jax.grad(loss(lambda *a: sharded(*a[:3], cu, a[3])), (0, 1, 2, 3)))(
        q, k, v, sinks
    )
    expected = jax.grad(loss(unsharded), (0, 1, 2, 3))(q, k, v, sinks)
    for name, got, want in zip("q k v sinks".split(), grads, expected, strict=True):
        assert_close(got, want, tol, f"d{name}")


@pytest.mark.parametrize("mask", ["causal", "full"])
def test_pallas_block_sparse_attention_with_several_examples_a_shard(mask):
    """Two batch entries a device: equal to the op on the whole batch, forward and
    gradient. The Pallas backend maps its kernels over the batch itself (xla's and
    triton's take it in their grids): under jax.vmap alone a checked shard_map had
    refused it, a causal mask's per-example scalar prefetch making vmap a loop whose
    carry did not vary over the mesh axis, a full one's batch grid axis indexed wrongly
    by the TPU interpreter (`batches_in_grid`)."""
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 128, 2, 16)), jnp.float32) for _ in "qkv")
    block_mask = {"causal": CausalMask((128, 128)), "full": FullMask((128, 128))}[mask]
    op = lambda q, k, v: block_sparse_attention(q, k, v, block_mask, implementation="pallas")
    two = Mesh(np.array(first_devices(2)), ("b",))
    sharded = jax.shard_map(op, mesh=two, in_specs=(P("b"),) * 3, out_specs=P("b"))
    tokens = lambda x: x.reshape(-1, *x.shape[2:])  # every pair of every entry: a bound
    tol = 2 * attention_tolerance(tokens(q), tokens(k))
    assert_close(jax.jit(sharded)(q, k, v), op(q, k, v), tol, "out")
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * weights)
    grads = jax.jit(jax.grad(loss(sharded), (0, 1, 2)))(q, k, v)
    for name, got, want in zip("qkv", grads, jax.grad(loss(op), (0, 1, 2))(q, k, v), strict=True):
        assert_close(got, want, tol, f"d{name}")


def test_the_batch_is_a_grid_axis_only_without_partial_blocks_or_the_tpu_interpreter():
    """`batches_in_grid`: a full mask's kernels take the batch as a grid axis (vmap),
    a causal mask's load partial blocks (a loop), and inside a CPU mesh (the TPU
    interpreter) neither does."""
    full, causal = (make_splash_mha(m((256, 256))) for m in (FullMask, CausalMask))
    of = lambda kernel: batches_in_grid((kernel.masks.fwd, kernel.masks.dkv), kernel.masks.element)
    assert of(full) and not of(causal)
    inside = []
    probe = lambda x: inside.append(of(full)) or x
    mesh = Mesh(np.array(first_devices(2)), ("b",))
    jax.shard_map(probe, mesh=mesh, in_specs=P("b"), out_specs=P("b"))(jnp.zeros(2))
    assert inside == [False]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_expert_parallel_grouped_matmul_forward_and_gradient(mesh, implementation):
    rng = np.random.default_rng(3)
    num_experts, m, k, n = 8, 70, 32, 24
    sizes = jnp.asarray([9, 0, 14, 1, 7, 20, 0, 11], jnp.int32)  # sum 62 < m
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((num_experts, k, n)), jnp.float32)
    local_experts = num_experts // SHARDS

    def local(lhs, rhs):
        offset = jax.lax.axis_index("d") * local_experts
        out = grouped_matmul(lhs, rhs, sizes, group_offset=offset, implementation=implementation)
        return jax.lax.psum(out, "d")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    unsharded = lambda lhs, rhs: grouped_matmul(lhs, rhs, sizes, implementation=implementation)
    out_oracle = gm.gmm_float64(lhs, rhs, sizes)
    gm.assert_close(jax.jit(sharded)(lhs, rhs), unsharded(lhs, rhs), name="out", oracle=out_oracle)

    weights = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    loss = lambda fn: lambda lhs, rhs: jnp.sum(fn(lhs, rhs) * weights)
    grads = jax.jit(jax.grad(loss(sharded), (0, 1)))(lhs, rhs)
    expected = jax.grad(loss(unsharded), (0, 1))(lhs, rhs)
    oracles = (  # d lhs = weights rhs^T, d rhs[g] = lhs[rows of g]^T weights[rows of g]
        gm.gmm_float64(weights, rhs, sizes, transpose_rhs=True),
        gm.tgmm_float64(lhs.T, weights, sizes, num_groups=num_experts),
    )
    for name, got, want, oracle in zip(("lhs", "rhs"), grads, expected, oracles, strict=True):
        gm.assert_close(got, want, name=f"d{name}", oracle=oracle)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_expert_parallel_transposed_grouped_matmul_gradient(mesh, implementation):
    rng = np.random.default_rng(4)
    num_experts, m, k, n = 8, 40, 16, 24
    sizes = jnp.asarray([3, 5, 0, 9, 2, 8, 6, 4], jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((k, m)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    local_experts = num_experts // SHARDS

    def local(lhs, rhs):
        offset = jax.lax.axis_index("d") * local_experts
        return transposed_grouped_matmul(
            lhs,
            rhs,
            sizes,
            group_offset=offset,
            num_groups=local_experts,
            implementation=implementation,
        )

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P()), out_specs=P("d"))
    unsharded = lambda lhs, rhs: transposed_grouped_matmul(
        lhs, rhs, sizes, implementation=implementation
    )
    out_oracle = gm.tgmm_float64(lhs, rhs, sizes, num_groups=num_experts)
    gm.assert_close(jax.jit(sharded)(lhs, rhs), unsharded(lhs, rhs), name="out", oracle=out_oracle)
    weights = jnp.asarray(rng.standard_normal((num_experts, k, n)), jnp.float32)
    loss = lambda fn: lambda lhs, rhs: jnp.sum(fn(lhs, rhs) * weights)
    grads = jax.jit(jax.grad(loss(sharded), (0, 1)))(lhs, rhs)
    expected = jax.grad(loss(unsharded), (0, 1))(lhs, rhs)
    oracles = (  # d lhs[:, rows of g] = weights[g] rhs[rows of g]^T, d rhs[rows of g] =
        # lhs[:, rows of g]^T weights[g]
        gm.gmm_float64(rhs, weights, sizes, transpose_rhs=True).T,
        gm.gmm_float64(lhs.T, weights, sizes),
    )
    for name, got, want, oracle in zip(("lhs", "rhs"), grads, expected, oracles, strict=True):
        gm.assert_close(got, want, name=f"d{name}", oracle=oracle)


def _pallas_attention_over(devices: list, op: str):
    """`op` (varlen or block-sparse attention, Pallas backend) in a shard_map over
    `devices`, jitted: one 32-token causal document a device, 2 heads of 16."""
    shards = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    rng = np.random.default_rng(3)
    if op == "varlen_attention":
        q, k, v = (jnp.asarray(rng.standard_normal((32 * shards, 2, 16)), jnp.float32)
                   for _ in "qkv")  # fmt: skip
        cu = jnp.tile(jnp.asarray([[0, 32]], jnp.int32), (shards, 1))

        def local(q, k, v, cu):
            return varlen_attention(q, k, v, cu[0], cu[0], causal=True, implementation="pallas")

        operands = (q, k, v, cu)
    else:
        q, k, v = (jnp.asarray(rng.standard_normal((shards, 32, 2, 16)), jnp.float32)
                   for _ in "qkv")  # fmt: skip

        def local(q, k, v):
            mask = DocumentMask(np.asarray([0, 32], np.int32), causal=True)
            return block_sparse_attention(q, k, v, mask, implementation="pallas")

        operands = (q, k, v)
    specs = (P("d"),) * len(operands)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("d"))), operands


@pytest.mark.parametrize("op", ["varlen_attention", "block_sparse_attention"])
def test_pallas_over_every_cpu_device_is_refused_where_jax_would_hang(op):
    """JAX 0.10's TPU interpreter never returns inside a shard_map whose mesh holds every
    CPU device (`pallas_tpu.splash.common`): there the op refuses when traced, naming
    itself and the way out; a mesh that leaves a device out, or a later JAX, traces."""
    cpu = jax.devices("cpu")
    if len(cpu) < 2:
        pytest.skip("needs 2 CPU devices or more (the conftest gives a CPU run 8)")
    fewer, _ = _pallas_attention_over(cpu[:-1], op)
    every, operands = _pallas_attention_over(cpu, op)
    jax.eval_shape(fewer, *(x[: x.shape[0] * (len(cpu) - 1) // len(cpu)] for x in operands))
    if jax.__version_info__ >= (0, 11):
        jax.eval_shape(every, *operands)
    else:
        with pytest.raises(ValueError, match=rf"^{op}: .*every CPU device .*Leave a device out"):
            jax.eval_shape(every, *operands)
