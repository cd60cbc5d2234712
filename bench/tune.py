"""`python -m bench tune`: tune the Triton kernels' launch configs on this GPU.

    python -m bench tune [--op attention|grouped_matmul] [--dry-run] [--force]
                         [--cache PATH] [--head-dim D] [--dtype DTYPE] [--arch CC]
                         [--repeats N]

On a GPU: times the candidate configs of each op on a representative problem (attention:
8 causal documents of 1024 tokens, 16 query and 4 key/value heads; grouped matmul: the
Mixtral-like 8192 x 2048 x 1408 over 64 experts, forward and gradient), after pruning
every candidate whose offline-compiled kernel spills registers in its inner loop, has
its warpgroup MMAs serialized or exceeds shared memory (`static_report_prune`), and
stores each winner in the tuning cache (printed; `--cache` or `RAGGED_KERNELS_CACHE_DIR`
moves it). Winners already cached are reported, not re-timed, unless `--force`.

Without a GPU there is nothing to time (the XLA backend has no launch parameters and
Triton's CPU interpreter says nothing about a GPU): it says so and exits 0. `--dry-run`
works anywhere: it lists each op's candidates and prunes them by the static report,
compiling offline for `--arch` (default: the GPU's, else 90), and times nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

OPS = ("attention", "grouped_matmul")
ATTENTION_DOCS, ATTENTION_DOC_LEN, Q_HEADS, KV_HEADS = 8, 1024, 16, 4
# The catalog's (`triton_kernels.catalog`, whose static reports prune the candidates),
# spelled here so that the CLI starts without importing Triton.
GMM_PROBLEM, GMM_GROUPS = (8192, 2048, 1408), 64


def _parser() -> argparse.ArgumentParser:
    from bench.kernel_report import arch_argument, head_dim_argument
    from jax_bridge.launch.report import SM_LIMITS

    parser = argparse.ArgumentParser(
        prog="python -m bench tune", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("--op", choices=OPS, action="append", help="op to tune (default: all)")
    parser.add_argument(
        "--dry-run", action="store_true", help="list and prune the candidates, time nothing"
    )
    parser.add_argument("--force", action="store_true", help="re-time ops already cached")
    parser.add_argument("--cache", type=Path, metavar="PATH", help="the tuning cache file")
    parser.add_argument(
        "--head-dim", type=head_dim_argument, default=128, help="attention head_dim, 16..256"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument(
        "--arch",
        type=arch_argument,
        choices=sorted(SM_LIMITS),
        metavar="CC",
        help=f"--dry-run's compile target, of {sorted(SM_LIMITS)} (default: the GPU's, else 90)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per candidate")
    return parser


def _kernel_report(variant: Any, compute_capability: int) -> Any:
    """The static report of a `triton_kernels.catalog` variant (compiled offline)."""
    from jax_bridge.launch.report import variant_report

    return variant_report(variant, compute_capability)


def attention_report_fn(
    kind: str,
    head_dim: int,
    dtype: str,
    compute_capability: int,
    features: Any,
    descriptors: bool = False,
) -> Callable[[Any], Any]:
    """params -> the static report of attention kernel `kind` at those params (over the
    defaults a launch with `descriptors` takes, as `tune_attention` times them)."""
    from jax_bridge.tuning import attention_kernel_config, default_attention_configs
    from triton_kernels.catalog import attention_variant

    defaults = default_attention_configs(head_dim, dtype, compute_capability, features, descriptors)

    def report(params: Any) -> Any:
        config = attention_kernel_config(kind, params, getattr(defaults, kind))
        variant = attention_variant(
            kind, head_dim, compute_capability, dtype, features, config=config
        )
        return _kernel_report(variant, compute_capability)

    return report


def grouped_matmul_report_fn(dtype: str, compute_capability: int) -> Callable[[Any], Iterator]:
    """params -> the static reports of the kernels one config of `grouped_matmul` and its
    gradient launches (gmm, gmm with transposed rhs, tgmm over token-major lhs), compiled
    one by one as they are read: pruning stops at the first kernel with a problem. The
    op's default config stands for the op without `config=` (as `tune_grouped_matmul`
    times it): each kernel at its own default; any other config as the op launches each
    kernel with it (`as_launched`)."""
    from jax_bridge.tuning import default_grouped_matmul_config
    from triton_kernels.catalog import grouped_matmul_variant

    default = default_grouped_matmul_config(GMM_PROBLEM, dtype, compute_capability)
    names = ("gmm", "gmm_transposed", "tgmm_token_major")
    element_bytes = 4 if dtype == "float32" else 2

    def reports(params: Any) -> Iterator:
        config = params.to_grouped_matmul_config(default)
        for name in names:
            launched = None
            if config != default:
                launched = as_launched(config, name, element_bytes, compute_capability)
            variant = grouped_matmul_variant(name, compute_capability, dtype, GMM_PROBLEM, launched)
            yield _kernel_report(variant, compute_capability)

    return reports


def as_launched(config: Any, name: str, element_bytes: int, compute_capability: int) -> Any:
    """The `GroupedMatmulConfig` the op launches kernel `name` (a `GMM_KERNELS` key of
    `triton_kernels.catalog`) with, given `config=config`: with the pipeline stages that
    fit the GPU's shared memory where the config's do not (one config reaches gmm and
    tgmm, whose stages hold other tiles: `GroupedMatmulConfig.within_shared_memory`, as
    jax_bridge.grouped_matmul's launches fit it). The catalog's variant specializes tgmm
    where the op does."""
    from jax_bridge.launch.report import max_shared_memory_per_cta

    limit = max_shared_memory_per_cta(compute_capability)
    return config.within_shared_memory(element_bytes, name.startswith("tgmm"), limit)


def _descriptors(cc: int | None) -> bool:
    """Whether launches here take tensor descriptors (TMA): on a GPU, what jaxlib allows;
    in a dry run (no GPU), what an sm_90 machine with a recent jaxlib would."""
    from jax_bridge.launch.target import tensor_descriptors_available
    from jax_bridge.tuning import get_device_platform

    if get_device_platform() == "gpu":
        return tensor_descriptors_available()
    return (cc or 0) >= 90


def _candidates_and_reports(op: str, args: argparse.Namespace, cc: int) -> list[tuple]:
    """[(name, candidates, report_fn)] of `op`: one per kernel kind for attention."""
    from jax_bridge.tuning import attention_candidates, grouped_matmul_candidates
    from triton_kernels.flash_attention.config import KINDS, AttentionFeatures

    descriptors = _descriptors(cc)
    if op == "grouped_matmul":
        candidates = grouped_matmul_candidates(
            GMM_PROBLEM, dtype=args.dtype, compute_capability=cc, descriptors=descriptors
        )
        return [("grouped_matmul.fwd_bwd", candidates, grouped_matmul_report_fn(args.dtype, cc))]
    features = AttentionFeatures(causal=True)
    return [
        (
            f"varlen_attention.{kind}",
            attention_candidates(
                kind,
                head_dim=args.head_dim,
                dtype=args.dtype,
                compute_capability=cc,
                features=features,
                descriptors=descriptors,
            ),
            attention_report_fn(kind, args.head_dim, args.dtype, cc, features, descriptors),
        )
        for kind in KINDS
    ]


def dry_run(ops: Sequence[str], args: argparse.Namespace, cc: int) -> None:
    """Lists each op's candidates (the default first) and what the static report prunes."""
    from jax_bridge.tuning import prune_candidates, static_report_prune

    for op in ops:
        for name, candidates, report_fn in _candidates_and_reports(op, args, cc):
            print(f"\n## {name} ({args.dtype}, sm_{cc}): {len(candidates)} candidates")
            print("  compiling each offline for the static report ...", flush=True)
            start = time.perf_counter()
            pruned = prune_candidates(candidates, static_report_prune(report_fn))
            for i, candidate in enumerate(candidates):
                verdict = f"pruned: {pruned[candidate]}" if candidate in pruned else "keep"
                print(f"  {candidate}{'  [default]' if i == 0 else ''}\n      {verdict}")
            kept = len(candidates) - len(pruned)
            print(f"  {kept} kept, {len(pruned)} pruned ({time.perf_counter() - start:.0f} s)")


def _print_result(name: str, candidates: Sequence, result: Any) -> None:
    if result.from_cache:
        print(f"  {name}: {result.best} ({result.times[result.best] * 1e3:.3f} ms, cached)")
        return
    best_s, default_s = result.times[result.best], result.times.get(candidates[0])
    versus = f", default {default_s * 1e3:.3f} ms ({default_s / best_s:.2f}x)" if default_s else ""
    print(f"  {name}: {result.best} {best_s * 1e3:.3f} ms{versus}")
    print(
        f"    timed {len(result.times)}, pruned {len(result.pruned)}, failed {len(result.failed)}"
    )
    for candidate, error in result.failed.items():
        print(f"    failed {candidate}: {error[:200]}")


def tune(ops: Sequence[str], args: argparse.Namespace, cache: Any, cc: int | None) -> None:
    """Times every op's candidates on this GPU (compute capability `cc`; None: not an
    NVIDIA GPU, so no static report prunes) and stores the winners in `cache`."""
    import jax
    import jax.numpy as jnp

    from jax_bridge.tuning import (
        default_grouped_matmul_config,
        static_report_prune,
        tune_attention,
        tune_grouped_matmul,
    )

    dtype, keys = jnp.dtype(args.dtype), jax.random.split(jax.random.key(0), 3)
    common = dict(cache=cache, force=args.force, repeats=args.repeats)
    for op in ops:
        found = _candidates_and_reports(op, args, cc)
        prune = {name: static_report_prune(fn) if cc else None for name, _, fn in found}
        print(f"\n## {op}")
        if op == "grouped_matmul":
            (m, k, n), (name, candidates, _) = GMM_PROBLEM, found[0]
            lhs = jax.random.normal(keys[0], (m, k), dtype)
            rhs = jax.random.normal(keys[1], (GMM_GROUPS, k, n), dtype) * k**-0.5
            sizes = jnp.full((GMM_GROUPS,), m // GMM_GROUPS, jnp.int32)
            result = tune_grouped_matmul(
                lhs, rhs, sizes, candidates=candidates, prune=prune[name], **common
            )
            _print_result(name, candidates, result)
            default = default_grouped_matmul_config(GMM_PROBLEM, args.dtype, cc)
            best = result.best.to_grouped_matmul_config(default)
            print("  grouped_matmul(...) as it is: the default wins" if best == default
                  else f"  grouped_matmul(..., config={best})")  # fmt: skip
            continue
        tokens = ATTENTION_DOCS * ATTENTION_DOC_LEN
        q = jax.random.normal(keys[0], (tokens, Q_HEADS, args.head_dim), dtype)
        k, v = jax.random.normal(keys[1], (2, tokens, KV_HEADS, args.head_dim), dtype)
        cu = jnp.arange(ATTENTION_DOCS + 1, dtype=jnp.int32) * ATTENTION_DOC_LEN
        by_kind = {name.rsplit(".", 1)[1]: fn for name, fn in prune.items()}
        configs, results = tune_attention(q, k, v, cu, cu, causal=True, prune=by_kind, **common)
        for (name, candidates, _), result in zip(found, results.values(), strict=True):
            _print_result(name, candidates, result)
        print(f"  varlen_attention(..., config={configs})")


def main(argv: Sequence[str]) -> int:
    """The command line; returns the exit status (0, also when there is no GPU)."""
    args = _parser().parse_args(argv)
    from jax_bridge.tuning import TuningCache, device_compute_capability, get_device_platform

    ops = list(dict.fromkeys(args.op or OPS))
    cache = TuningCache(args.cache)
    platform = get_device_platform()
    if args.dry_run:
        dry_run(ops, args, args.arch or device_compute_capability() or 90)
        print(f"\ndry run: nothing timed, nothing stored (the cache is {cache.path})")
        return 0
    if platform != "gpu":
        print(
            f"python -m bench tune: nothing to tune on {platform}: the XLA backend has no "
            "launch parameters (its tiles follow from the shapes), and timing Triton's CPU "
            "interpreter says nothing about a GPU. Run it on a GPU, or list the candidates "
            "and the static report's pruning with --dry-run."
        )
        return 0
    import jax

    print(f"tuning {', '.join(ops)} on {jax.devices()[0].device_kind}")
    tune(ops, args, cache, device_compute_capability())
    print(f"\nwinners stored in {cache.path}")
    return 0


if __name__ == "__main__":
    from bench.__main__ import _prefer_cpu_without_gpu

    _prefer_cpu_without_gpu(fake_devices=False)
    raise SystemExit(main(sys.argv[1:]))
