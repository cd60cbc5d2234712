"""Tunable launch parameters: `FwdParams` and `BwdParams`.

A params object is a frozen (hashable) dataclass whose fields are all `int | None` but
those of `BOOL_FIELDS`, `bool | None` (the kernels' on/off options: tensor descriptors,
warp specialization, the softmax overlap): None means "the op's default decides", so a
params object is a *partial* launch configuration that can be merged with another
(`merge`: the override's set fields win) and stored as a small JSON dict (`to_dict` /
`from_dict`). The conversions at the bottom turn params into the kernels' own, complete
configs (`AttentionKernelConfig`, `GroupedMatmulConfig`), filling every unset field from
a default config, and back.

Validation is the kernels' (`triton_kernels.config`): block sizes are powers of two
>= 16, `num_warps` one of (1, 2, 4, 8, 16), `num_stages` an int >= 1; the rules that
join fields (`warp_specialize` needs `tma` and 4 warps, excludes `overlap_softmax`) are
checked where params become a kernel config, by that config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, Self

from triton_kernels.config import NUM_WARPS, check_block
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig

__all__ = ["BOOL_FIELDS", "BwdParams", "FwdParams", "attention_configs", "attention_kernel_config"]

BOOL_FIELDS = frozenset(
    {"tma", "dq_tma", "warp_specialize", "overlap_softmax", "persistent", "host_descriptors",
     "dq_host_descriptors", "head_major"}
)  # fmt: skip
"""The params' bool fields, by name (every other field is an int): what `_check_field`
and the tuning cache's entry check (`jax_bridge.tuning.cache`) test against."""

# Fields of one op only: a conversion to the other op's config refuses them.
_ATTENTION_FIELDS = ("q_blocksize", "kv_blocksize", "overlap_softmax")
_MATMUL_FIELDS = ("blocksize_m", "blocksize_k", "blocksize_n", "persistent")

# Each kernel config's fields and the params fields that hold them (config -> params):
# the one table every conversion below reads, both ways. dK/dV (`BwdParams`' unprefixed
# fields) holds every field of `AttentionKernelConfig` under the same names, the forward
# (`FwdParams`) every one but dK/dV's `head_major`; dQ no option but `tma` and
# `host_descriptors`.
_LAUNCH = {"num_warps": "num_warps", "num_stages": "num_stages", "tma": "tma"}
_ATTENTION_KERNEL = {
    "block_m": "q_blocksize", "block_n": "kv_blocksize", **_LAUNCH,
    "warp_specialize": "warp_specialize", "overlap_softmax": "overlap_softmax",
    "host_descriptors": "host_descriptors",
}  # fmt: skip
_DKDV = {**_ATTENTION_KERNEL, "head_major": "head_major"}
_MATMUL = {"block_m": "blocksize_m", "block_k": "blocksize_k", "block_n": "blocksize_n",
           **_LAUNCH, "warp_specialize": "warp_specialize", "persistent": "persistent",
           "host_descriptors": "host_descriptors"}  # fmt: skip
_DQ = {"block_m": "dq_q_blocksize", "block_n": "dq_kv_blocksize", "num_warps": "dq_num_warps",
       "num_stages": "dq_num_stages", "tma": "dq_tma",
       "host_descriptors": "dq_host_descriptors"}  # fmt: skip


def _check_field(kind: str, name: str, value: Any) -> None:
    """TypeError/ValueError naming `kind.name` unless `value` is None or valid for `name`."""
    if value is None:
        return
    where = f"{kind}.{name}"
    if name in BOOL_FIELDS:
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be a bool or None, got {value!r}.")
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where} must be an int or None, got {value!r}.")
    if "blocksize" in name:
        check_block(value, where)
    elif name.endswith("num_warps") and value not in NUM_WARPS:
        raise ValueError(f"{where} must be one of {NUM_WARPS} or None, got {value!r}.")
    elif name.endswith("num_stages") and value < 1:
        raise ValueError(f"{where} must be an int >= 1 or None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class _Params:
    """Validation, merge and dict conversion shared by `FwdParams` and `BwdParams`."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_field(type(self).__name__, field.name, getattr(self, field.name))

    def __repr__(self) -> str:  # only the set fields: the rest is "the default decides"
        fields = ", ".join(f"{name}={value}" for name, value in self.to_dict().items())
        return f"{type(self).__name__}({fields})"

    def merge(self, override: Self | None) -> Self:
        """A copy in which every field `override` sets (not None) replaces this one's."""
        if override is None:
            return self
        if type(override) is not type(self):
            raise TypeError(
                f"{type(self).__name__}.merge takes a {type(self).__name__}, "
                f"got {type(override).__name__}."
            )
        return dataclasses.replace(self, **override.to_dict())

    def to_dict(self) -> dict[str, int | bool]:
        """The set (non-None) fields by name, e.g. {"q_blocksize": 128, "num_warps": 8}."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """The inverse of `to_dict`; ValueError naming unknown keys (validated as usual)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; it has {sorted(known)}.")
        return cls(**values)

    def _pick(self, field: str, default: int | bool) -> int | bool:
        value = getattr(self, field)
        return default if value is None else value

    @classmethod
    def _from_config(cls, config: Any, fields: Mapping[str, str]) -> Self:
        """Params setting the `fields` (config field -> params field) of `config`."""
        return cls(**{mine: getattr(config, theirs) for theirs, mine in fields.items()})

    def _to_config(self, default: Any, fields: Mapping[str, str]) -> Any:
        """`default` with each of `fields` (config field -> params field) these params set
        (the config's own ValueError where the result's fields do not go together)."""
        picked = {
            theirs: self._pick(mine, getattr(default, theirs)) for theirs, mine in fields.items()
        }
        return dataclasses.replace(default, **picked)

    def _refuse(self, fields: tuple[str, ...], target: str) -> None:
        # A grouped-matmul tile in an attention conversion (or vice versa) is a mistake
        # that would otherwise be ignored silently.
        stray = [name for name in fields if getattr(self, name) is not None]
        if stray:
            raise ValueError(f"{type(self).__name__}: {stray} do not apply to {target}.")


def _check_held(
    config: AttentionKernelConfig, held: Collection[str], where: str, params: str = "BwdParams"
) -> None:
    """ValueError naming `where` if `config` turns on an option (a bool field) that the
    params have no field for (`held`: the config fields they hold; dQ and the forward
    lack some): converting it would drop the option silently."""
    dropped = [
        f.name
        for f in dataclasses.fields(config)
        if getattr(config, f.name) is True and f.name not in held
    ]
    if dropped:
        raise ValueError(
            f"{where}: {params} has no field for {dropped} of this kernel's config "
            f"(AttentionConfigs refuses them there), got {config}."
        )


@dataclasses.dataclass(frozen=True, repr=False)
class FwdParams(_Params):
    """Launch parameters of a forward kernel; every field None = the default decides.

    Attributes:
      q_blocksize, kv_blocksize: attention's query and key tile rows (the forward
        kernel's `block_m`, `block_n`).
      blocksize_m, blocksize_k, blocksize_n: grouped matmul's tile (`block_m`, `block_k`,
        `block_n` of `GroupedMatmulConfig`).
      num_warps, num_stages: the launch's warps and software-pipeline stages.
      tma: the kernel's streamed tiles through tensor descriptors (Hopper's bulk tensor
        copies; see `AttentionKernelConfig.tma`, `GroupedMatmulConfig.tma`).
      warp_specialize: the kernel's loop split into a producer warpgroup of copies and
        consumer warpgroups of MMAs (needs `tma` and 4 warps; see
        `AttentionKernelConfig.warp_specialize`, `GroupedMatmulConfig.warp_specialize`).
      overlap_softmax: attention only: each key tile's QK^T issued before the previous
        tile's softmax, so that both run at once (`AttentionKernelConfig.overlap_softmax`;
        excludes `warp_specialize`).
      persistent: grouped matmul only: gmm launches a program per CTA the GPU holds, each
        walking the tile list, and the weight gradient's tgmm (by pointers) walks the
        rows of splits of the groups (`GroupedMatmulConfig.persistent`; excludes
        `warp_specialize`).
      host_descriptors: with `tma`: the kernel's descriptors encoded by the launch
        (`GroupedMatmulConfig.host_descriptors`; attention's forward kernel,
        `AttentionKernelConfig.host_descriptors`; the backward kernels': `BwdParams`).
    """

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    blocksize_m: int | None = None
    blocksize_k: int | None = None
    blocksize_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tma: bool | None = None
    warp_specialize: bool | None = None
    overlap_softmax: bool | None = None
    persistent: bool | None = None
    host_descriptors: bool | None = None

    @classmethod
    def from_attention_config(cls, config: AttentionKernelConfig) -> FwdParams:
        """Every field of the forward kernel's `config` as params; ValueError if it turns
        on dK/dV's `head_major`, which they cannot hold."""
        _check_held(config, _ATTENTION_KERNEL, "FwdParams.from_attention_config", "FwdParams")
        return cls._from_config(config, _ATTENTION_KERNEL)

    @classmethod
    def from_grouped_matmul_config(cls, config: GroupedMatmulConfig) -> FwdParams:
        """Every field of a grouped matmul `config` as params."""
        return cls._from_config(config, _MATMUL)

    def to_attention_config(self, default: AttentionKernelConfig) -> AttentionKernelConfig:
        """The forward kernel's config: the set fields, the rest from `default`.

        Raises the config's own ValueError where the fields it ends with do not go
        together (e.g. `warp_specialize` without `tma`), and ValueError for grouped
        matmul fields."""
        self._refuse(_MATMUL_FIELDS, "attention")
        return self._to_config(default, _ATTENTION_KERNEL)

    def to_grouped_matmul_config(self, default: GroupedMatmulConfig) -> GroupedMatmulConfig:
        """A grouped matmul config: the set fields, the rest from `default` (the config's
        own ValueError where they do not go together; ValueError for attention fields)."""
        self._refuse(_ATTENTION_FIELDS, "grouped matmul")
        return self._to_config(default, _MATMUL)


@dataclasses.dataclass(frozen=True, repr=False)
class BwdParams(_Params):
    """Launch parameters of attention's two backward kernels; None = the default decides.

    Attributes:
      q_blocksize, kv_blocksize, num_warps, num_stages: the dK/dV kernel, which keeps a
        key tile of `kv_blocksize` rows stationary and streams query tiles of
        `q_blocksize` rows (its `block_m`, `block_n`).
      dq_q_blocksize, dq_kv_blocksize, dq_num_warps, dq_num_stages: the dQ kernel, which
        keeps a query tile stationary and streams key tiles (the forward's structure).
      tma, dq_tma: the dK/dV (dQ) kernel's streamed tiles through tensor descriptors.
      host_descriptors, dq_host_descriptors: with `tma` (`dq_tma`): the dK/dV kernel's Q
        and dO (the dQ kernel's K and V) through descriptors the launch encodes
        (`AttentionKernelConfig.host_descriptors`).
      warp_specialize: the dK/dV kernel's query loop split into a producer warpgroup of
        copies and consumer warpgroups (`AttentionKernelConfig.warp_specialize`).
      overlap_softmax: the dK/dV kernel issues each query tile's dP before P's exp2s
        (`AttentionKernelConfig.overlap_softmax`). The dQ kernel has neither option (it
        refuses both).
      head_major: the dK/dV kernel accumulates dK^T and dV^T, head-dim major
        (`AttentionKernelConfig.head_major`; dK/dV's alone).
    """

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dq_q_blocksize: int | None = None
    dq_kv_blocksize: int | None = None
    dq_num_warps: int | None = None
    dq_num_stages: int | None = None
    tma: bool | None = None
    dq_tma: bool | None = None
    host_descriptors: bool | None = None
    dq_host_descriptors: bool | None = None
    warp_specialize: bool | None = None
    overlap_softmax: bool | None = None
    head_major: bool | None = None

    @classmethod
    def from_fwd_params(cls, fwd: FwdParams) -> BwdParams:
        """A starting point for the backward from forward params (a tuning seed).

        The dQ kernel has the forward's structure (stationary query tile, streamed key
        tiles), so it takes the forward's tiles as they are; the dK/dV kernel is the
        mirror image (stationary key tile, streamed query tiles), so it takes them
        swapped. Warps, stages, `tma` and `host_descriptors` carry over, `overlap_softmax`
        to dK/dV only (dQ refuses it); `warp_specialize` does not (dK/dV's takes its own
        tile, `WARP_SPECIALIZED_DKDV_TILE`); unset fields stay unset. The backward holds
        more tiles in registers than the forward, so check the result with the static
        report (`static_report_prune`) before trusting it.
        """
        fwd._refuse(_MATMUL_FIELDS, "attention's backward")
        return cls(
            q_blocksize=fwd.kv_blocksize,
            kv_blocksize=fwd.q_blocksize,
            num_warps=fwd.num_warps,
            num_stages=fwd.num_stages,
            dq_q_blocksize=fwd.q_blocksize,
            dq_kv_blocksize=fwd.kv_blocksize,
            dq_num_warps=fwd.num_warps,
            dq_num_stages=fwd.num_stages,
            tma=fwd.tma,
            dq_tma=fwd.tma,
            host_descriptors=fwd.host_descriptors,
            dq_host_descriptors=fwd.host_descriptors,
            overlap_softmax=fwd.overlap_softmax,
        )

    @classmethod
    def from_dkdv_config(cls, config: AttentionKernelConfig) -> BwdParams:
        """The dK/dV kernel's `config` as params that set its fields only (every field
        of `AttentionKernelConfig` has one)."""
        _check_held(config, _DKDV, "BwdParams.from_dkdv_config")
        return cls._from_config(config, _DKDV)

    @classmethod
    def from_dq_config(cls, config: AttentionKernelConfig) -> BwdParams:
        """The dQ kernel's `config` as params that set its `dq_*` fields only; ValueError
        if it turns on an option they cannot hold (`warp_specialize`, `overlap_softmax`)."""
        _check_held(config, _DQ, "BwdParams.from_dq_config")
        return cls._from_config(config, _DQ)

    @classmethod
    def from_attention_configs(
        cls, dkdv: AttentionKernelConfig, dq: AttentionKernelConfig
    ) -> BwdParams:
        """Every field of the two backward kernels' configs as params (`from_dkdv_config`
        merged with `from_dq_config`, and their ValueErrors)."""
        return cls.from_dkdv_config(dkdv).merge(cls.from_dq_config(dq))

    def to_dkdv_config(self, default: AttentionKernelConfig) -> AttentionKernelConfig:
        """The dK/dV kernel's config: the set fields, the rest from `default` (the
        config's own ValueError where they do not go together)."""
        return self._to_config(default, _DKDV)

    def to_dq_config(self, default: AttentionKernelConfig) -> AttentionKernelConfig:
        """The dQ kernel's config: the set `dq_*` fields, the rest from `default`."""
        return self._to_config(default, _DQ)


# Each attention kernel's conversion from its params: the forward's from `FwdParams`, the
# backward kernels' from the `BwdParams` they share.
_KERNEL_CONVERSIONS = {
    "forward": (FwdParams, FwdParams.to_attention_config),
    "backward_dkdv": (BwdParams, BwdParams.to_dkdv_config),
    "backward_dq": (BwdParams, BwdParams.to_dq_config),
}


def attention_kernel_config(
    kind: str, params: FwdParams | BwdParams | None, default: AttentionKernelConfig
) -> AttentionKernelConfig:
    """The config of attention kernel `kind` ("forward", "backward_dkdv" or
    "backward_dq"): the set fields of its params (`FwdParams` for the forward,
    `BwdParams` for either backward kernel; None: all unset) over `default`, a complete
    `AttentionKernelConfig`. The backward kernels read their own fields of the shared
    `BwdParams` (dQ the `dq_` ones, dK/dV the others) and ignore the other kernel's."""
    if kind not in _KERNEL_CONVERSIONS:
        raise ValueError(
            f"attention_kernel_config: kind must be one of {tuple(_KERNEL_CONVERSIONS)}, "
            f"got {kind!r}."
        )
    params_type, convert = _KERNEL_CONVERSIONS[kind]
    _check_type("attention_kernel_config", f"params of {kind}", params, params_type, none=True)
    _check_type("attention_kernel_config", "default", default, AttentionKernelConfig)
    return convert(params or params_type(), default)


def _check_type(op: str, name: str, value: Any, expected: type, *, none: bool = False) -> None:
    """TypeError naming `op` and `name` unless `value` is an `expected` (or None, where
    `none`)."""
    if (value is None and none) or isinstance(value, expected):
        return
    article = "an" if expected.__name__[0] in "AEIOU" else "a"
    raise TypeError(
        f"{op}: {name} must be {article} {expected.__name__}{' or None' if none else ''}, "
        f"got {type(value).__name__}."
    )


def attention_configs(
    fwd: FwdParams | None, bwd: BwdParams | None, defaults: AttentionConfigs
) -> AttentionConfigs:
    """The `config=` of `varlen_attention`: the params' set fields over `defaults`.

    Args:
      fwd, bwd: the forward's and the backward kernels' params (None: all defaults).
      defaults: a complete `AttentionConfigs` (no None field; its `dq_atomic` is kept), e.g.
        `jax_bridge.tuning.heuristics.default_attention_configs(...)`.
    """
    _check_type("attention_configs", "fwd", fwd, FwdParams, none=True)
    _check_type("attention_configs", "bwd", bwd, BwdParams, none=True)
    _check_type("attention_configs", "defaults", defaults, AttentionConfigs)
    kinds = ("forward", "backward_dkdv", "backward_dq")
    missing = [kind for kind in kinds if getattr(defaults, kind) is None]
    if missing:
        raise ValueError(f"attention_configs: defaults.{missing} must be set, got None.")
    params = {"forward": fwd, "backward_dkdv": bwd, "backward_dq": bwd}
    configs = {
        kind: attention_kernel_config(kind, params[kind], getattr(defaults, kind)) for kind in kinds
    }
    return AttentionConfigs(**configs, dq_atomic=defaults.dq_atomic)
