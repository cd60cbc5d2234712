"""Launch-parameter tuning: params, heuristics, cache keys and an opt-in autotuner.

* `params`: `FwdParams` / `BwdParams`, partial launch configs that merge and convert to
  the kernels' configs.
* `heuristics`: warps and stages for a tile, each op's defaults (the kernels' tables),
  the candidate grids.
* `device`, `keys`: what a tuned config is valid for, and canonical cache keys.
* `cache`: the JSON `TuningCache` (atomic writes; corrupt or foreign files ignored).
* `autotune`: the timer of candidates (`autotune.autotune`, re-exported as
  `jax_bridge.autotune`), and the tunable ops (GPU only). The function is deliberately
  not bound here: it would hide its module of the same name (and `monkeypatch`es of it).

Imports `core`, `launch` and the kernels' configs; the ops (`attention`,
`grouped_matmul`) only inside the functions that tune them, and no op imports this
package, so it never closes an import cycle.
"""

from jax_bridge.tuning.autotune import (
    TuneResult,
    prune_candidates,
    static_report_prune,
    tune_attention,
    tune_grouped_matmul,
)
from jax_bridge.tuning.cache import CACHE_DIR_ENV, TuningCache, default_cache_path
from jax_bridge.tuning.device import (
    device_compute_capability,
    device_fingerprint,
    get_device_platform,
)
from jax_bridge.tuning.heuristics import (
    attention_candidates,
    attention_features,
    default_attention_configs,
    default_grouped_matmul_config,
    default_params,
    grouped_matmul_candidates,
    select_num_stages,
    select_num_warps,
)
from jax_bridge.tuning.keys import abstractify, cache_key, short_hash, stable_json
from jax_bridge.tuning.params import (
    BwdParams,
    FwdParams,
    attention_configs,
    attention_kernel_config,
)

__all__ = [
    "CACHE_DIR_ENV",
    "BwdParams",
    "FwdParams",
    "TuneResult",
    "TuningCache",
    "abstractify",
    "attention_candidates",
    "attention_configs",
    "attention_features",
    "attention_kernel_config",
    "cache_key",
    "default_attention_configs",
    "default_cache_path",
    "default_grouped_matmul_config",
    "default_params",
    "device_compute_capability",
    "device_fingerprint",
    "get_device_platform",
    "grouped_matmul_candidates",
    "prune_candidates",
    "select_num_stages",
    "select_num_warps",
    "short_hash",
    "stable_json",
    "static_report_prune",
    "tune_attention",
    "tune_grouped_matmul",
]
