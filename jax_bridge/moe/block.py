"""An example mixture-of-experts feed-forward block, on one device and expert-parallel.

The block (T tokens, E experts, top-k routing):

    logits  = x @ router                               [T, E], float32
    ids, v  = top_k(logits, k)                         [T, k] each
    weights = softmax(v)                               over the k chosen logits only
    rows    = route(x, ids, E)                         [T*k, hidden], sorted by expert
    h       = gelu(grouped_matmul(rows, w_up))         [T*k, ffn]   (tanh approximation)
    y       = grouped_matmul(h, w_down)                [T*k, hidden]
    out     = unroute(y, routing, weights)             [T, hidden]: sum_j weights * y

The softmax runs after the top-k (the Mixtral convention): each token's weights sum to
1, and the router gets gradient through its k chosen logits only. Top-k ties go to the
lower expert id (`jax.lax.top_k`).

`expert_parallel_moe_feed_forward` runs the same block in `jax.shard_map` with the
experts' weights sharded over one mesh axis (device `d` holds experts `[d*L, (d+1)*L)`,
L = E / D), in one of two ways:

* `dispatch="replicated"`: every device sees every token, routes all of them, computes
  only its experts' rows (`grouped_matmul(..., group_offset=d * L)`; other rows are
  zero) and a `psum` adds the devices' outputs. Simple; the FLOPs split, the tokens do not.
* `dispatch="all_to_all"`: tokens are sharded over the same axis and exchanged with
  `jax.lax.all_to_all` (`jax_bridge.moe.dispatch`): each device computes only the rows
  routed to its experts. With the default capacity nothing is dropped and the result
  equals the single-device block.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bridge.core.autodiff import refuse_forward_mode
from jax_bridge.core.precision import canonicalize_precision
from jax_bridge.core.sharding import jit_shard_map
from jax_bridge.core.validation import check_array, check_static_int, naming_op
from jax_bridge.grouped_matmul.api import grouped_matmul
from jax_bridge.moe.dispatch import all_to_all_combine, all_to_all_dispatch
from jax_bridge.moe.routing import route, unroute

DISPATCHES = ("replicated", "all_to_all")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """The block's weights (a pytree; gradients come back as `MoEParams`).

    Attributes:
      router: [hidden, E].
      w_up: [E, hidden, ffn].
      w_down: [E, ffn, hidden].
    """

    router: Any
    w_up: Any
    w_down: Any


def init_moe_params(
    key: jax.Array, *, hidden: int, ffn: int, num_experts: int, dtype: Any = jnp.float32
) -> MoEParams:
    """Random `MoEParams`: normal weights scaled by 1/sqrt(fan-in), so activations keep
    unit scale.

    Args:
      key: a JAX PRNG key.
      hidden, ffn, num_experts: the model width, each expert's inner width, the experts.
      dtype: the weights' dtype (drawn in float32, then cast).

    Returns:
      `MoEParams` with router [hidden, num_experts], w_up [num_experts, hidden, ffn] and
      w_down [num_experts, ffn, hidden].
    """
    k_router, k_up, k_down = jax.random.split(key, 3)

    def normal(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / fan_in**0.5).astype(dtype)

    return MoEParams(
        router=normal(k_router, (hidden, num_experts), hidden),
        w_up=normal(k_up, (num_experts, hidden, ffn), hidden),
        w_down=normal(k_down, (num_experts, ffn, hidden), ffn),
    )


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_router_inputs(x: Any, router: Any) -> None:
    """x [T, hidden] and router [hidden, E], both floating (a ValueError for a shape, a
    TypeError for anything else; `naming_op` prefixes the op)."""
    check_array("x", x, "[tokens, hidden]", floating=True)
    check_array("router", router, "[hidden, E]", floating=True)
    if router.shape[0] != x.shape[1]:
        raise ValueError(
            f"router must have shape [hidden={x.shape[1]}, E] (hidden: the columns of x), "
            f"got shape {tuple(router.shape)}."
        )


# Why `refuse_forward_mode` refuses, and what it offers instead.
_WHY_REVERSE_MODE = "its experts' products are grouped matmuls, custom_vjp functions"
_REVERSE_MODE = "Reverse mode works: jax.grad, jax.vjp, jax.jacrev."


def _check_block(op: str, x: Any, params: Any, top_k: Any) -> int:
    """Shapes and dtypes of one block call (global arrays), and no forward-mode tangent
    (a NotImplementedError naming `op`); returns top_k."""
    if not isinstance(params, MoEParams):
        raise TypeError(f"{op}: params must be MoEParams, got {type(params).__name__}.")
    weights = ((f"params.{f.name}", getattr(params, f.name)) for f in dataclasses.fields(params))
    for name, array in (("x", x), *weights):
        if not _is_array(array):
            raise TypeError(f"{op}: {name} must be an array, got {type(array).__name__}.")
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{op}: x must be a floating array of shape [tokens, hidden], got "
            f"{x.dtype}{list(x.shape)}."
        )
    hidden = x.shape[1]
    if params.router.ndim != 2 or params.router.shape[0] != hidden:
        raise ValueError(
            f"{op}: params.router must have shape [hidden={hidden}, num_experts], got "
            f"{tuple(params.router.shape)}."
        )
    experts = params.router.shape[1]
    if params.w_up.ndim != 3 or params.w_up.shape[:2] != (experts, hidden):
        raise ValueError(
            f"{op}: params.w_up must have shape [num_experts={experts}, hidden={hidden}, "
            f"ffn], got {tuple(params.w_up.shape)}."
        )
    ffn = params.w_up.shape[2]
    if tuple(params.w_down.shape) != (experts, ffn, hidden):
        raise ValueError(
            f"{op}: params.w_down must have shape [num_experts, ffn, hidden] = "
            f"{(experts, ffn, hidden)}, got {tuple(params.w_down.shape)}."
        )
    for name in ("router", "w_up", "w_down"):
        if getattr(params, name).dtype != x.dtype:
            raise TypeError(
                f"{op}: params.{name} has dtype {getattr(params, name).dtype}, x has "
                f"{x.dtype}; cast them to one dtype."
            )
    with naming_op(op):
        top_k = check_static_int(top_k, "top_k", minimum=1)
        if top_k > experts:
            raise ValueError(f"top_k must lie in [1, {experts}], got {top_k}.")
    refuse_forward_mode(
        op, x, params.router, params.w_up, params.w_down, works=_REVERSE_MODE,
        why=_WHY_REVERSE_MODE,
    )  # fmt: skip
    return top_k


def top_k_router(
    x: jax.Array, router: jax.Array, top_k: int, precision: Any = None
) -> tuple[jax.Array, jax.Array]:
    """The k best experts of each token and their softmax weights.

    Args:
      x: [T, hidden]. router: [hidden, E]. top_k: static int in [1, E].
      precision: of the logits' matmul, as in `jax.lax.dot` (None: HIGHEST).

    Returns:
      (expert_ids int32 [T, k], in decreasing logit order; weights float32 [T, k], the
      softmax of the k chosen logits, summing to 1 per token).
    """
    with naming_op("top_k_router"):
        _check_router_inputs(x, router)
        precision = canonicalize_precision(precision, "top_k_router")
        top_k = check_static_int(top_k, "top_k", minimum=1)
        if top_k > router.shape[1]:
            raise ValueError(f"top_k must lie in [1, {router.shape[1]}], got {top_k}.")
    logits = jnp.dot(x, router, precision=precision, preferred_element_type=jnp.float32)
    values, expert_ids = jax.lax.top_k(logits, top_k)
    return expert_ids.astype(jnp.int32), jax.nn.softmax(values, axis=-1)


def expert_feed_forward(
    rows: jax.Array,
    group_sizes: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    group_offset: jax.Array | int | None = None,
    implementation: str = "auto",
    precision: Any = None,
) -> jax.Array:
    """`gelu(rows @ w_up[e]) @ w_down[e]` for the rows of each expert e: two gmms.

    Args:
      rows: [m, hidden], sorted by expert. group_sizes: int32 [E_total].
      w_up: [E, hidden, ffn]. w_down: [E, ffn, hidden]; E = E_total without an offset.
      group_offset: the weights hold experts `[offset, offset + E)` (expert parallelism).

    Returns:
      float32 [m, hidden]; rows of other experts and past `sum(group_sizes)` are zero
      (gmm leaves them zero and gelu(0) = 0).
    """
    gmm = functools.partial(
        grouped_matmul,
        group_offset=group_offset,
        implementation=implementation,
        precision=precision,
    )
    h = jax.nn.gelu(gmm(rows, w_up, group_sizes), approximate=True)
    return gmm(h.astype(w_down.dtype), w_down, group_sizes)


def _block(x, params, *, top_k, implementation, precision, group_offset=None):
    """The block on this device's tokens; with `group_offset`, only its experts' part."""
    ids, weights = top_k_router(x, params.router, top_k, precision)
    routing = route(x, ids, params.router.shape[1])
    y = expert_feed_forward(
        routing.sorted_x,
        routing.group_sizes,
        params.w_up,
        params.w_down,
        group_offset=group_offset,
        implementation=implementation,
        precision=precision,
    )
    return unroute(y, routing, weights)  # float32 [T, hidden]


_jitted_block = jax.jit(_block, static_argnames=("top_k", "implementation", "precision"))


def moe_feed_forward(
    x: jax.Array,
    params: MoEParams,
    *,
    top_k: int = 2,
    implementation: str = "auto",
    precision: Any = None,
) -> jax.Array:
    """The MoE feed-forward block on one device (see the module docstring).

    Args:
      x: [T, hidden], floating; the params must have its dtype.
      params: `MoEParams` with router [hidden, E], w_up [E, hidden, ffn],
        w_down [E, ffn, hidden].
      top_k: experts per token, a static int in [1, E].
      implementation: passed to `grouped_matmul` ("auto": Triton on GPUs, else XLA).
      precision: of the router matmul and both gmms (None: HIGHEST, exact float32).

    Returns:
      [T, hidden] in x's dtype (computed in float32).
    """
    top_k = _check_block("moe_feed_forward", x, params, top_k)
    precision = canonicalize_precision(precision, "moe_feed_forward")  # hashable, static
    # Jitted (inlined under an outer jit): eagerly, each op would dispatch on its own.
    out = _jitted_block(x, params, top_k=top_k, implementation=implementation, precision=precision)
    return out.astype(x.dtype)


def _check_mesh(x, params, mesh, axis_name, dispatch, capacity) -> None:
    """The expert axis exists and divides the experts (and, for all_to_all, the tokens)."""
    op = "expert_parallel_moe_feed_forward"
    if not isinstance(mesh, Mesh) or axis_name not in mesh.axis_names:
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"{op}: axis_name {axis_name!r} is not an axis of mesh ({names}).")
    if dispatch not in DISPATCHES:
        raise ValueError(f"{op}: dispatch must be one of {DISPATCHES}, got {dispatch!r}.")
    devices = mesh.shape[axis_name]
    experts = params.router.shape[1]
    if experts % devices:
        raise ValueError(
            f"{op}: num_experts ({experts}) must be a multiple of the size of axis "
            f"{axis_name!r} ({devices})."
        )
    if dispatch == "all_to_all" and x.shape[0] % devices:
        raise ValueError(
            f"{op}: with dispatch='all_to_all' the tokens ({x.shape[0]}) are sharded over "
            f"axis {axis_name!r} and must be a multiple of its size ({devices})."
        )
    if capacity is not None:
        if dispatch != "all_to_all":
            raise ValueError(f"{op}: capacity applies to dispatch='all_to_all' only.")
        with naming_op(op):
            check_static_int(capacity, "capacity", minimum=1)


def expert_parallel_moe_feed_forward(
    x: jax.Array,
    params: MoEParams,
    *,
    mesh: Mesh,
    axis_name: str,
    top_k: int = 2,
    dispatch: str = "replicated",
    capacity: int | None = None,
    implementation: str = "auto",
    precision: Any = None,
) -> jax.Array:
    """`moe_feed_forward` with the experts sharded over `mesh` axis `axis_name`.

    Runs in `jax.shard_map` (check_vma=True): device d of the axis holds experts
    `[d*L, (d+1)*L)` of w_up and w_down (L = E / D); the router is replicated. Other mesh
    axes see replicated inputs. Forward and gradient equal the single-device block's
    (with `capacity=None`).

    Args:
      x: [T, hidden] (global); params: global `MoEParams` (sharded here as needed).
      mesh, axis_name: the mesh and its expert axis of size D; E % D == 0.
      top_k, implementation, precision: as in `moe_feed_forward`.
      dispatch: "replicated" (every device routes every token; psum combines) or
        "all_to_all" (tokens sharded over the axis too, T % D == 0; exchanged with
        `all_to_all_dispatch` / `all_to_all_combine`).
      capacity: all_to_all only: rows per (source, destination) device pair; None sends
        every copy (no drops). Copies past it contribute zero (`jax_bridge.moe.dispatch`).

    Returns:
      [T, hidden] in x's dtype: replicated over the mesh ("replicated") or sharded over
      `axis_name` ("all_to_all"). Inputs of any sharding are resharded first (auto or
      explicit mesh axes); on explicit axes, eager code that consumes the output runs
      under `jax.set_mesh(mesh)`, as JAX requires.
    """
    op = "expert_parallel_moe_feed_forward"
    top_k = _check_block(op, x, params, top_k)
    _check_mesh(x, params, mesh, axis_name, dispatch, capacity)
    precision = canonicalize_precision(precision, op)  # hashable: a cache key below
    block = _sharded_block(mesh, axis_name, dispatch, top_k, capacity, implementation, precision)
    return block(x, params)


def _replicated_body(x, params, *, axis_name, top_k, capacity, implementation, precision):
    """Per device: every token, this device's L experts; a psum combines."""
    del capacity  # every copy is computed by the device that holds its expert
    offset = jax.lax.axis_index(axis_name) * params.w_up.shape[0]  # L local experts
    out = _block(
        x,
        params,
        top_k=top_k,
        implementation=implementation,
        precision=precision,
        group_offset=offset,
    )
    # The devices' expert ranges partition the copies: the psum adds each copy once.
    return jax.lax.psum(out, axis_name).astype(x.dtype)


def _all_to_all_body(x, params, *, axis_name, top_k, capacity, implementation, precision):
    """Per device: its own tokens, routed to the experts' devices and back."""
    ids, weights = top_k_router(x, params.router, top_k, precision)
    routing = route(x, ids, params.router.shape[1])
    sent = all_to_all_dispatch(routing, axis_name, capacity=capacity)
    y = expert_feed_forward(
        sent.x,
        sent.group_sizes,
        params.w_up,  # [L, hidden, ffn]: this device's experts, in local id order
        params.w_down,
        implementation=implementation,
        precision=precision,
    )
    y_sorted = all_to_all_combine(y, sent, axis_name)
    return unroute(y_sorted, routing, weights).astype(x.dtype)


@functools.lru_cache(maxsize=64)
def _sharded_block(mesh, axis_name, dispatch, top_k, capacity, implementation, precision):
    """The jitted `shard_map` of one configuration, built once: run eagerly, a
    shard_map executes op by op (minutes for this block on a CPU); under an outer
    jit or grad the inner jit is inlined."""
    body = _replicated_body if dispatch == "replicated" else _all_to_all_body
    body = functools.partial(
        body,
        axis_name=axis_name,
        top_k=top_k,
        capacity=capacity,
        implementation=implementation,
        precision=precision,
    )
    tokens = P() if dispatch == "replicated" else P(axis_name)
    specs = MoEParams(router=P(), w_up=P(axis_name), w_down=P(axis_name))
    return jit_shard_map(body, mesh=mesh, in_specs=(tokens, specs), out_specs=tokens)
