"""The training step and loop: optax AdamW on float32 masters, one jitted step per batch.

`Trainer` owns the model flavour (ours or the dense twin), the mesh, the sharded
parameters and optimizer state, and counters of the step's traces and compilations (the
step must compile once: the packing changes every step, the shapes never do; a trace
count alone misses a recompile for new input shardings, which reuses the trace).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from examples.train_lm.config import ModelConfig, TrainConfig
from examples.train_lm.data import PackedBatch
from examples.train_lm.kernels import AXES, DENSE, ROWS, our_kernels
from examples.train_lm.model import Kernels, init_params, loss_fn

EXPERT_WEIGHTS = ("w_up", "w_down")
# The event JAX records for every XLA compilation (`jax.monitoring`).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA compilations while entered: `with counter: ...`, then `counter.count`.

    Counts every compilation in the process meanwhile (JAX reports them on one monitoring
    event), so enter it around the calls to be counted only.
    """

    def __init__(self) -> None:
        self.count = 0

    def _listen(self, event: str, duration: float, **metadata: Any) -> None:
        if event == COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def make_mesh(data: int = 1, expert: int = 1, context: int = 1) -> Mesh:
    """A ("data", "expert", "context") mesh over the first data * expert * context devices,
    with automatic axes (XLA partitions everything outside the kernels' shard_maps)."""
    count = data * expert * context
    return jax.make_mesh(
        (data, expert, context),
        AXES,
        axis_types=(AxisType.Auto,) * 3,
        devices=jax.devices()[:count],
    )


def param_specs(params: Any) -> Any:
    """Experts' weights [blocks, E, ...] sharded over "expert"; everything else replicated."""

    def spec(path, leaf) -> P:
        name = getattr(path[-1], "key", None)
        return P(None, "expert") if name in EXPERT_WEIGHTS else P()

    return jax.tree_util.tree_map_with_path(spec, params)


def batch_spec() -> PackedBatch:
    return PackedBatch(P(ROWS, "context"), P(ROWS, "context"), P(ROWS))


def optimizer(train: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, train.learning_rate, train.warmup_steps, max(train.steps, train.warmup_steps + 1)
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=train.weight_decay),
    )


def _check_fits(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> None:
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    if tuple(sizes) != AXES:
        raise ValueError(f"Trainer: the mesh axes must be {AXES}, got {tuple(sizes)}")
    row_shards = sizes["data"] * sizes["expert"]
    problems = [
        (train.rows % row_shards, f"rows ({train.rows}) % data*expert ({row_shards})"),
        (train.seq_len % sizes["context"], f"seq_len ({train.seq_len}) % context"),
        (model.num_experts % sizes["expert"], f"num_experts ({model.num_experts}) % expert"),
    ]
    for remainder, what in problems:
        if remainder:
            raise ValueError(f"Trainer: {what} must be 0 on mesh {sizes}")


@dataclasses.dataclass
class Trainer:
    """One model flavour ("ours" or "dense") on one mesh (None: the default device)."""

    model: ModelConfig
    train: TrainConfig
    flavour: str = "ours"
    mesh: Mesh | None = None
    traces: int = 0  # of the step's body
    compiles: int = 0  # XLA compilations during `step` calls

    def __post_init__(self):
        if self.flavour not in ("ours", "dense"):
            raise ValueError(f"Trainer: flavour must be 'ours' or 'dense', got {self.flavour!r}")
        if self.mesh is not None:
            _check_fits(self.model, self.train, self.mesh)
        self.kernels: Kernels = our_kernels(self.mesh) if self.flavour == "ours" else DENSE
        self.tx = optimizer(self.train)
        self._step = None  # built by init(), which knows the state's shardings

    def loss(self, params: Any, batch: PackedBatch, **kwargs: Any) -> jax.Array:
        return loss_fn(params, batch, config=self.model, kernels=self.kernels, **kwargs)

    def init(self, key: jax.Array) -> tuple[Any, Any]:
        """Parameters and optimizer state, placed with `param_specs` on the mesh (without
        one: committed to the default device)."""
        params = init_params(self.model, key)
        params = jax.device_put(params, jax.tree.map(self._sharding, param_specs(params)))
        opt_state = jax.jit(self.tx.init)(params)
        opt_state = jax.device_put(
            opt_state, jax.tree.map(self._replicated_unless_spread, opt_state)
        )
        # The step gets and returns the state with these shardings from its first call on,
        # so every call hits one compiled program. (Uncommitted state, as init_params
        # returns it, compiled the first call apart from the later ones, which receive
        # the step's committed outputs.)
        state_shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
        self._step = jax.jit(
            self._step_body, donate_argnums=(0, 1), out_shardings=(*state_shardings, None)
        )
        return params, opt_state

    def _sharding(self, spec: P) -> Sharding:
        """`spec` on the mesh, or the default device when there is no mesh."""
        if self.mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.mesh, spec)

    def _replicated_unless_spread(self, x: jax.Array) -> Sharding:
        """x's sharding if it spans the mesh, else replicated (optax's step counts land
        on one device)."""
        replicated = self._sharding(P())
        return x.sharding if x.sharding.device_set == replicated.device_set else replicated

    def place(self, batch: PackedBatch) -> PackedBatch:
        """The host batch on the mesh (rows over data x expert, sequence over context), or
        on the default device without one."""
        placed = (
            jax.device_put(x, self._sharding(spec))
            for x, spec in zip(batch, batch_spec(), strict=True)
        )
        return PackedBatch(*placed)

    def _step_body(self, params, opt_state, batch):
        self.traces += 1  # Python runs this only while tracing
        loss, grads = jax.value_and_grad(self.loss)(params, batch)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return params, opt_state, {"loss": loss, "grad_norm": norm}

    def step(self, params, opt_state, batch: PackedBatch):
        """One optimizer step (the inputs' buffers are donated); after `init`."""
        if self._step is None:
            raise RuntimeError("Trainer.step: call init() first (it places the state)")
        counter = CompileCounter()
        with counter:
            out = self._step(params, opt_state, self.place(batch))
        self.compiles += counter.count
        return out


def run(trainer: Trainer, batches: Iterable[PackedBatch], steps: int, key=None) -> Iterator[dict]:
    """Trains for `steps` steps; yields {"step", "loss", "grad_norm"} (floats) per step."""
    params, opt_state = trainer.init(jax.random.key(trainer.train.seed) if key is None else key)
    source = iter(batches)
    for step in range(steps):
        params, opt_state, metrics = trainer.step(params, opt_state, next(source))
        yield {"step": step, **{k: float(v) for k, v in metrics.items()}}


def losses_summary(losses: list[float], width: int = 8) -> str:
    """First / last `width`-step mean losses, as a line (width at most half the run)."""
    width = max(1, min(width, len(losses) // 2))
    head, tail = np.mean(losses[:width]), np.mean(losses[-width:])
    return f"loss {head:.3f} (first {width} steps) -> {tail:.3f} (last {width})"
