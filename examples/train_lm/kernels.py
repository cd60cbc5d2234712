"""The two kernel sets of model.py: ours (the package's ops) and the dense twin's.

Ours, on a mesh with axes ("data", "expert", "context") or on one device (mesh None):
* attention: `varlen_attention` on each device's rows, packed end to end (each row's
  cu_seqlens shifted by the row's offset; a row's trailing padding becomes one more
  "document" that nothing else sees); with a context axis of size > 1, `ring_attention_shard`
  over it, documents given by segment ids;
* experts: `top_k_router` / `route`, then, with an expert axis of size > 1,
  `all_to_all_dispatch` to the devices holding the experts, `expert_feed_forward`
  (two grouped matmuls) and `all_to_all_combine` back, then `unroute`.
Both run inside their own `jax.shard_map` over the mesh: rows sharded over
("data", "expert"), the sequence over "context", experts' weights over "expert"; the
rest of the step is left to XLA's partitioner.

The twin: `jax.nn.dot_product_attention` with a dense [S, S + 1] mask (the extra key
carries the sink logit as a bias and a zero value) and a loop over all experts with a
dense gate, under plain jit (XLA partitions it as it likes). Same parameters, same math.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from examples.train_lm.model import Kernels, Layout
from jax_bridge import (
    all_to_all_combine,
    all_to_all_dispatch,
    resolve_implementation,
    ring_attention_shard,
    route,
    top_k_router,
    unroute,
    varlen_attention,
)
from jax_bridge.moe import expert_feed_forward

AXES = ("data", "expert", "context")
ROWS = ("data", "expert")  # the batch's rows are sharded over both (expert = data for non-MoE)


def _window(window: int | None) -> tuple[int, int] | None:
    return None if window is None else (window, 0)


def _local_attend(q, k, v, sinks, layout: Layout, window, *, context: str | None):
    """This device's rows: varlen over its packed rows, or the ring over `context`."""
    if context is not None:
        # The ring's TPU (Pallas) kernels take no sliding window yet: a windowed layer
        # runs the ring's blockwise XLA backend there ("auto" is Pallas on TPU and fails).
        auto = resolve_implementation("auto", op="ring", supported=("triton", "pallas"))
        implementation = "xla" if window is not None and auto == "pallas" else "auto"
        return ring_attention_shard(
            q, k, v, axis_name=context, segment_ids=layout.segment_ids, causal=True,
            sliding_window=_window(window), sinks=sinks, implementation=implementation,
        )  # fmt: skip
    rows, seq = q.shape[:2]
    offsets = (jnp.arange(rows, dtype=jnp.int32) * seq)[:, None]
    cu = jnp.concatenate([(layout.cu_seqlens + offsets).reshape(-1), jnp.array([rows * seq])])
    flat = [t.reshape(rows * seq, *t.shape[2:]) for t in (q, k, v)]
    out = varlen_attention(
        *flat, cu.astype(jnp.int32), cu.astype(jnp.int32), causal=True,
        sliding_window=_window(window), sinks=sinks,
    )  # fmt: skip
    return out.reshape(q.shape)


def _local_experts(x, router, w_up, w_down, top_k, *, expert: str | None):
    """This device's tokens through the experts (exchanged over `expert` when sharded)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    ids, weights = top_k_router(x, router, top_k)
    routing = route(x, ids, router.shape[1])
    if expert is None:
        y = expert_feed_forward(routing.sorted_x, routing.group_sizes, w_up, w_down)
    else:
        sent = all_to_all_dispatch(routing, expert)
        y = all_to_all_combine(
            expert_feed_forward(sent.x, sent.group_sizes, w_up, w_down), sent, expert
        )
    return unroute(y, routing, weights).astype(x.dtype).reshape(shape)


def our_kernels(mesh: Mesh | None = None) -> Kernels:
    """The package's kernels; on `mesh` (axes AXES), each inside its own shard_map."""
    if mesh is None:
        return Kernels(
            functools.partial(_local_attend, context=None),
            functools.partial(_local_experts, expert=None),
        )
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    context = "context" if sizes.get("context", 1) > 1 else None
    expert = "expert" if sizes.get("expert", 1) > 1 else None
    tokens = P(ROWS, "context")

    def attend(q, k, v, sinks, layout, window):
        body = functools.partial(_local_attend, window=window, context=context)
        specs = Layout(P(ROWS), tokens, tokens)
        sink_spec = None if sinks is None else P()
        return jax.shard_map(
            lambda q, k, v, s, lay: body(q, k, v, s, lay),
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, sink_spec, specs),
            out_specs=tokens,
        )(q, k, v, sinks, layout)

    def experts(x, router, w_up, w_down, top_k):
        body = functools.partial(_local_experts, top_k=top_k, expert=expert)
        return jax.shard_map(
            lambda x, r, u, d: body(x, r, u, d),
            mesh=mesh,
            in_specs=(tokens, P(), P("expert"), P("expert")),
            out_specs=tokens,
        )(x, router, w_up, w_down)

    return Kernels(attend, experts)


def dense_mask(layout: Layout, window: int | None) -> jax.Array:
    """bool [B, 1, S, S]: same document (not padding), key not after the query, and within
    the window."""
    seg, pos = layout.segment_ids, layout.positions
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    delta = pos[:, :, None] - pos[:, None, :]
    allowed = same & (delta >= 0)
    if window is not None:
        allowed &= delta <= window
    return allowed[:, None]


def dense_attend(q, k, v, sinks, layout: Layout, window):
    mask = dense_mask(layout, window)
    if sinks is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    # The sink as one more key: zero key and value, its logit as a bias, always allowed.
    batch, seq = q.shape[:2]
    k, v = (jnp.concatenate([t, jnp.zeros_like(t[:, :1])], 1) for t in (k, v))
    mask = jnp.concatenate([mask, jnp.ones((batch, 1, seq, 1), bool)], -1)
    bias = jnp.zeros((1, q.shape[2], 1, seq + 1), jnp.float32)
    bias = bias.at[0, :, 0, -1].set(sinks.astype(jnp.float32)).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, implementation="xla")


def dense_experts(x, router, w_up, w_down, top_k):
    """Every expert on every token, weighted by a dense gate (zero off the top-k)."""
    logits = jnp.einsum("bsh,he->bse", x, router, preferred_element_type=jnp.float32)
    values, ids = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(values, axis=-1)
    gate = jnp.sum(jax.nn.one_hot(ids, router.shape[1]) * weights[..., None], axis=-2)
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(router.shape[1]):
        h = jnp.einsum("bsh,hf->bsf", x, w_up[e], preferred_element_type=jnp.float32)
        h = jax.nn.gelu(h, approximate=True).astype(x.dtype)
        y = jnp.einsum("bsf,fh->bsh", h, w_down[e], preferred_element_type=jnp.float32)
        out = out + gate[..., e : e + 1] * y
    return out.astype(x.dtype)


DENSE = Kernels(dense_attend, dense_experts)
