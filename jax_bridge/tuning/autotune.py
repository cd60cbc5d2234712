"""The autotuner: time candidate launch params of an op on this device, keep the fastest.

Opt-in only: nothing here runs unless called (`autotune`, `tune_attention`,
`tune_grouped_matmul`, or `python -m bench tune`); the ops themselves never tune on a
first call. The winner is stored in the JSON `TuningCache` under (op, device
fingerprint, abstract arguments), so the next call with the same shapes on the same
device and software returns it without timing anything.

Order of work in `autotune`: cache lookup (unless `force`), then pruning (`prune`, e.g.
`static_report_prune`: spills in the inner loop, serialized MMAs or too much shared
memory in the offline-compiled kernel) before anything is compiled for the device, then
one compile-and-warm call per remaining candidate and `repeats` timed calls (median). A
candidate that raises is recorded as failed; only when every candidate is pruned or
failed is it an error.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import jax
import jax.numpy as jnp

from jax_bridge.launch.target import tensor_descriptors_available
from jax_bridge.tuning.cache import TuningCache
from jax_bridge.tuning.device import (
    device_compute_capability,
    device_fingerprint,
    get_device_platform,
)
from jax_bridge.tuning.heuristics import (
    attention_candidates,
    default_attention_configs,
    default_grouped_matmul_config,
    grouped_matmul_candidates,
    shared_memory_limit_for,
)
from jax_bridge.tuning.keys import abstractify
from jax_bridge.tuning.params import BwdParams, FwdParams, attention_configs
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionFeatures

if TYPE_CHECKING:
    from jax_bridge.launch.report import KernelReport

__all__ = [
    "TuneResult",
    "autotune",
    "prune_candidates",
    "static_report_prune",
    "tune_attention",
    "tune_grouped_matmul",
]

P = TypeVar("P", FwdParams, BwdParams)
Prune = Callable[[Any], str | None]


def _empty() -> Mapping:
    return types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class TuneResult(Generic[P]):
    """What one `autotune` call found.

    Attributes:
      best: the fastest candidate (or the cached winner).
      times: median seconds of every timed candidate, in candidate order; from the cache,
        only the winner's stored time.
      pruned: why each candidate was skipped before timing (e.g. "... spills 64 B").
      failed: the error of each candidate that raised while compiling or running.
      from_cache: True when `best` came from the cache and nothing was timed.
    """

    best: P
    times: Mapping[P, float]
    pruned: Mapping[P, str] = dataclasses.field(default_factory=_empty)
    failed: Mapping[P, str] = dataclasses.field(default_factory=_empty)
    from_cache: bool = False


def autotune(
    op: str,
    build: Callable[[P], Callable[..., Any]],
    args: tuple,
    candidates: Sequence[P],
    *,
    prune: Prune | None = None,
    cache: TuningCache | None = None,
    repeats: int = 5,
    force: bool = False,
    static: Any = None,
    timer: Callable[[], float] = time.perf_counter,
) -> TuneResult[P]:
    """The fastest of `candidates` for `build(candidate)(*args)` on the default device.

    Args:
      op: the cache's name for what is tuned (e.g. "grouped_matmul.fwd_bwd").
      build: candidate -> the function to time, called as `fn(*args)`; jit it inside
        `build` (the first call compiles and is not timed).
      args: the arguments of the timed calls. The cache key holds their pytree
        structure, shapes and dtypes (`abstractify`), never their values.
      candidates: `FwdParams` or `BwdParams`, all of one type; duplicates are dropped.
        Order breaks ties (the first of equal times wins): put the default first.
      prune: candidate -> a reason to skip it untimed, or None (`static_report_prune`).
        A prune that raises skips its candidate with the error as the reason.
      cache: where winners are stored; None: `TuningCache()` (the user's cache dir).
      repeats: timed calls per candidate (the median is kept), >= 1.
      force: time the candidates even when the cache holds a winner (and replace it).
      static: extra JSON-encodable values that select the entry besides `args` (e.g.
        {"causal": True}: options that change the work but are not arrays).
      timer: the clock, in seconds (injectable for tests).

    Raises:
      RuntimeError naming `op` when every candidate was pruned or failed.
    """
    candidates = _check_candidates(op, candidates, repeats)
    cache = TuningCache() if cache is None else cache
    device = device_fingerprint()
    key_args = {"args": abstractify(args), "static": static}
    if not force:
        cached = _cached_result(cache, op, device, key_args, type(candidates[0]))
        if cached is not None:
            return cached
    pruned = prune_candidates(candidates, prune)
    times: dict[P, float] = {}
    failed: dict[P, str] = {}
    for candidate in candidates:
        if candidate in pruned:
            continue
        try:
            times[candidate] = _median_seconds(build(candidate), args, repeats, timer)
        except Exception as err:  # a config the compiler or the device refuses
            failed[candidate] = f"{type(err).__name__}: {err}"
    if not times:
        reasons = {**pruned, **failed}
        detail = "; ".join(f"{c}: {why}" for c, why in reasons.items())
        raise RuntimeError(f"autotune({op!r}): every candidate was pruned or failed: {detail}")
    best = min(times, key=times.__getitem__)  # min keeps the first of equal times
    try:
        cache.put(op, device, key_args, best.to_dict(), times[best])
    except OSError as err:  # the measurement stands even where it cannot be stored
        warnings.warn(
            f"autotune({op!r}): could not store the winner in {cache.path} ({err}); "
            "returning it uncached.",
            stacklevel=2,
        )
    return TuneResult(
        best=best,
        times=types.MappingProxyType(times),
        pruned=types.MappingProxyType(pruned),
        failed=types.MappingProxyType(failed),
    )


def _check_candidates(op: str, candidates: Sequence[P], repeats: int) -> list[P]:
    candidates = list(dict.fromkeys(candidates))
    if not candidates:
        raise ValueError(f"autotune({op!r}): no candidates.")
    kinds = {type(c) for c in candidates}
    if len(kinds) != 1 or not kinds <= {FwdParams, BwdParams}:
        names = sorted(k.__name__ for k in kinds)
        raise TypeError(
            f"autotune({op!r}): candidates must be all FwdParams or all BwdParams, got {names}."
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"autotune({op!r}): repeats must be an int >= 1, got {repeats!r}.")
    return candidates


def _cached_result(
    cache: TuningCache, op: str, device: str, key_args: Any, kind: type[P]
) -> TuneResult[P] | None:
    entry = cache.get(op, device, key_args)
    if entry is None:
        return None
    try:
        best = kind.from_dict(entry["params"])
    except (TypeError, ValueError) as err:  # a hand-edited or foreign entry: tune again
        warnings.warn(f"tuning cache {cache.path}: {op}: {err}; tuning again.", stacklevel=3)
        return None
    return TuneResult(best, types.MappingProxyType({best: entry["time_s"]}), from_cache=True)


def prune_candidates(candidates: Iterable[P], prune: Prune | None) -> dict[P, str]:
    """{candidate: reason} for each candidate `prune` rejects (in candidate order); a
    prune that raises rejects its candidate with the error as the reason."""
    if prune is None:
        return {}
    reasons = {}
    for candidate in candidates:
        try:
            reason = prune(candidate)
        except Exception as err:  # e.g. the offline compile refused the config
            reason = f"static check failed: {type(err).__name__}: {err}"
        if reason:
            reasons[candidate] = reason
    return reasons


def _median_seconds(
    fn: Callable[..., Any], args: tuple, repeats: int, timer: Callable[[], float]
) -> float:
    """Median of `repeats` synchronised calls after one compile-and-warm call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = timer()
        jax.block_until_ready(fn(*args))
        times.append(timer() - start)
    return statistics.median(times)


def static_report_prune(
    report_fn: Callable[[Any], KernelReport | Iterable[KernelReport]],
    *,
    shared_memory_limit: int | None = None,
) -> Prune:
    """A `prune` from static kernel reports: skip candidates whose every iteration pays
    for what the compiler made of them, or that cannot launch.

    Pruned: spills inside the innermost tensor-core loop (`KernelReport.loop_spills`), or
    any spill in a kernel without such a loop (where the report cannot tell); warpgroup
    MMAs that ptxas serialized; more shared memory than a program may use. Spills outside
    the loop are kept: a program pays them once, beside hundreds of instructions an
    iteration. FlexAttention's dK/dV config on an H100 (64x128, 8 warps, three stages),
    whose backward ran ~1.35x ours there, spills 76-140 B a thread under Triton 3.6 in
    our kernel and in Flex's own, one reload an iteration; our dK/dV default spills
    32 / 32 B outside its loop there (4 x 4096 causal, `gpu-check --compile-for h100`).

    Args:
      report_fn: candidate -> the `KernelReport` of the kernel it launches, or an
        iterable of those of several kernels (a generator compiles only up to the first
        with a problem), e.g. `static_kernel_report` at the candidate's config (compiled
        offline: no GPU needed).
      shared_memory_limit: bytes; None: the limit of each report's compute capability
        (`jax_bridge.tuning.heuristics.SHARED_MEMORY_LIMITS`).
    """

    def prune(candidate: Any) -> str | None:
        reports = report_fn(candidate)
        for report in [reports] if hasattr(reports, "spills") else reports:
            if reason := _prune_reason(report, shared_memory_limit):
                return f"{report.kernel} {reason}"
        return None

    return prune


def _prune_reason(report: KernelReport, shared_memory_limit: int | None) -> str | None:
    """Why `static_report_prune` skips the kernel of `report`, or None."""
    loop = report.inner_loop
    if report.loop_spills:
        return (
            f"spills in its inner loop ({loop.spill_instructions} local-memory accesses an "
            f"iteration, {loop.spill_stores} of them stores)"
        )
    if loop is None and report.spills:
        spilled = report.spill_store_bytes + report.spill_load_bytes
        return f"spills {spilled} B (stores and loads per thread)"
    if report.serialized_wgmma:
        return "has its warpgroup MMAs serialized by ptxas"
    limit = shared_memory_limit or shared_memory_limit_for(report.compute_capability)
    if report.shared_memory_bytes > limit:
        return (
            f"needs {report.shared_memory_bytes} B of shared memory, "
            f"over the {limit} B of sm_{report.compute_capability}"
        )
    return None


# -------------------------------------------------------------------- the tunable ops


def _require_gpu(what: str) -> None:
    # XLA's grouped matmul and attention have no launch parameters to tune (their tiles
    # follow from the shapes), and Triton's interpreter times nothing a GPU would do.
    if get_device_platform() != "gpu":
        raise RuntimeError(
            f"{what}: nothing to tune without a GPU (the default device is "
            f"{get_device_platform()}): the XLA backend has no launch parameters and "
            "timing Triton's CPU interpreter says nothing about a GPU."
        )


def tune_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    with_gradient: bool = True,
    candidates: Sequence[FwdParams] | None = None,
    prune: Prune | None = None,
    cache: TuningCache | None = None,
    repeats: int = 5,
    force: bool = False,
    timer: Callable[[], float] = time.perf_counter,
) -> TuneResult[FwdParams]:
    """Tunes `grouped_matmul(..., implementation="triton", config=...)` on this GPU.

    Args:
      lhs: [m, k]; rhs: [num_groups, k, n]; group_sizes: int32 [num_groups]: a
        representative problem (the cache key holds its shapes and dtypes).
      with_gradient: time the forward and its gradient (gmm, transposed gmm and tgmm all
        run with the one config the op takes, tgmm with fewer stages where its shared
        memory needs them); False: the forward only.
      candidates: default `grouped_matmul_candidates` for the shape and this GPU (with
        its warp-specialized tiles where tensor descriptors can be launched). The op's
        default config (`default_grouped_matmul_config`, the first candidate) is timed
        as the op runs without `config=`: each gradient launch then takes its own
        kernel's default (tgmm's differs from gmm's on Hopper).
      prune, cache, repeats, force, timer: as `autotune`.

    Returns:
      The `TuneResult`; `result.best.to_grouped_matmul_config(
      default_grouped_matmul_config(...))` is the op's `config=`, unless it is that
      default: then the op without `config=` is what won.
    """
    from jax_bridge.grouped_matmul.api import grouped_matmul  # ops never import tuning

    _require_gpu("tune_grouped_matmul")
    (m, k), n = lhs.shape, rhs.shape[2]
    capability = device_compute_capability()
    if candidates is None:
        candidates = grouped_matmul_candidates(
            (m, k, n),
            dtype=lhs.dtype,
            compute_capability=capability,
            descriptors=tensor_descriptors_available(),
        )

    default = default_grouped_matmul_config((m, k, n), lhs.dtype, capability)

    def build(params: FwdParams) -> Callable[..., Any]:
        config = params.to_grouped_matmul_config(default)
        config = None if config == default else config
        gmm = lambda x, w, sizes: grouped_matmul(
            x, w, sizes, implementation="triton", config=config
        )
        if not with_gradient:
            return jax.jit(gmm)
        loss = lambda x, w, sizes: jnp.sum(gmm(x, w, sizes))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    return autotune(
        "grouped_matmul.fwd_bwd" if with_gradient else "grouped_matmul.fwd",
        build,
        (lhs, rhs, group_sizes),
        candidates,
        prune=prune,
        cache=cache,
        repeats=repeats,
        force=force,
        timer=timer,
    )


def tune_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    causal: bool = False,
    candidates: Mapping[str, Sequence[FwdParams] | Sequence[BwdParams]] | None = None,
    prune: Mapping[str, Prune] | None = None,
    cache: TuningCache | None = None,
    repeats: int = 5,
    force: bool = False,
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[AttentionConfigs, dict[str, TuneResult]]:
    """Tunes the three Triton attention kernels of `varlen_attention` on this GPU.

    One kernel at a time (a coordinate search; the kernels' tiles are independent):
    the forward on the forward's time, then dK/dV and then dQ on the time of the forward
    and gradient, with the kernels already tuned fixed at their winners and the others
    at their defaults.

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_k: a representative problem, as
        `varlen_attention` takes it (the cache key holds shapes, dtypes and `causal`).
      causal: the mask to tune for.
      candidates: kernel kind -> its candidates (`FwdParams` for "forward", `BwdParams`
        setting that kernel's fields for the others); default `attention_candidates`.
      prune: kernel kind ("forward", "backward_dkdv", "backward_dq") -> its `prune`.
      cache, repeats, force, timer: as `autotune`.

    Returns:
      (the `AttentionConfigs` to pass as `config=`, the `TuneResult` of each kind).
    """
    from jax_bridge.attention.api import varlen_attention  # ops never import tuning
    from jax_bridge.attention.schedule import call_walks_tile_lists

    _require_gpu("tune_attention")
    head_dim, dtype = q.shape[2], q.dtype
    capability = device_compute_capability()
    features = AttentionFeatures(causal=bool(causal))
    # The defaults untuned calls of this problem run (dK/dV may take TMA; many sequences
    # walk tile lists, at their own tiles); candidates set every field.
    descriptors = tensor_descriptors_available()
    persistent = call_walks_tile_lists(cu_seqlens_q)
    defaults = default_attention_configs(
        head_dim, dtype, capability, features, descriptors, persistent
    )
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    attention = lambda config, *a: varlen_attention(
        *a, causal=causal, implementation="triton", config=config
    )
    tuned = {"forward": FwdParams(), "backward": BwdParams()}
    results = {}
    for kind in ("forward", "backward_dkdv", "backward_dq"):

        def build(params, kind=kind):
            fwd = params if kind == "forward" else tuned["forward"]
            bwd = tuned["backward"].merge(params) if kind != "forward" else None
            config = attention_configs(fwd, bwd, defaults)
            if kind == "forward":
                return jax.jit(lambda *a: attention(config, *a))
            loss = lambda *a: jnp.sum(attention(config, *a).astype(jnp.float32))
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

        chosen = (candidates or {}).get(kind) or attention_candidates(
            kind,
            head_dim=head_dim,
            dtype=dtype,
            compute_capability=capability,
            features=features,
            descriptors=descriptors,
            persistent=persistent,
        )
        results[kind] = autotune(
            f"varlen_attention.{kind}",
            build,
            args,
            chosen,
            prune=(prune or {}).get(kind),
            cache=cache,
            repeats=repeats,
            force=force,
            static=features,
            timer=timer,
        )
        key = "forward" if kind == "forward" else "backward"
        tuned[key] = tuned[key].merge(results[kind].best)
    return attention_configs(tuned["forward"], tuned["backward"], defaults), results
