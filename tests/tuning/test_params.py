"""FwdParams / BwdParams: frozen, hashable, validated; merge and conversions as documented."""

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_bridge.tuning.params import (
    BOOL_FIELDS,
    BwdParams,
    FwdParams,
    attention_configs,
    attention_kernel_config,
)
from triton_kernels.flash_attention.config import (
    OVERLAPPED_DKDV_TILE,
    OVERLAPPED_FORWARD_TILE,
    WARP_SPECIALIZED_DKDV_TILE,
    AttentionConfigs,
    AttentionKernelConfig,
)
from triton_kernels.grouped_matmul.config import (
    HOPPER_WARP_SPECIALIZED_GMM,
    HOPPER_WARP_SPECIALIZED_TGMM,
    GroupedMatmulConfig,
    warp_specialized_gmm_config,
)

BLOCKS = st.sampled_from([None, 16, 32, 64, 128, 256])
WARPS = st.sampled_from([None, 1, 2, 4, 8, 16])
STAGES = st.one_of(st.none(), st.integers(1, 6))
FLAG = st.sampled_from([None, False, True])


def _params(cls):
    fields = {}
    for field in dataclasses.fields(cls):
        if "blocksize" in field.name:
            fields[field.name] = BLOCKS
        elif field.name.endswith("num_warps"):
            fields[field.name] = WARPS
        elif field.name in BOOL_FIELDS:
            fields[field.name] = FLAG
        else:
            fields[field.name] = STAGES
    return st.builds(cls, **fields)


ANY_PARAMS = st.one_of(_params(FwdParams), _params(BwdParams))


def test_frozen_hashable_and_equal_by_value():
    a = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
    b = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=2)
    # Same field values, different kernels: never equal.
    assert FwdParams(num_warps=8) != BwdParams(num_warps=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_warps = 4


def test_repr_shows_only_set_fields():
    assert (
        repr(FwdParams(q_blocksize=64, num_stages=2)) == "FwdParams(q_blocksize=64, num_stages=2)"
    )
    assert repr(BwdParams()) == "BwdParams()"


@pytest.mark.parametrize("cls", [FwdParams, BwdParams])
@pytest.mark.parametrize(
    "field, value, error, text",
    [
        ("q_blocksize", 48, ValueError, "q_blocksize must be a power of two >= 16"),
        ("q_blocksize", 8, ValueError, "q_blocksize must be a power of two >= 16"),
        ("kv_blocksize", 64.0, TypeError, "kv_blocksize must be an int or None"),
        ("kv_blocksize", True, TypeError, "kv_blocksize must be an int or None"),
        ("num_warps", 3, ValueError, "num_warps must be one of (1, 2, 4, 8, 16)"),
        ("num_warps", 32, ValueError, "num_warps must be one of"),
        ("num_stages", 0, ValueError, "num_stages must be an int >= 1"),
        ("num_stages", "2", TypeError, "num_stages must be an int or None"),
        ("tma", 1, TypeError, "tma must be a bool or None"),
    ],
)
def test_invalid_fields_name_class_and_field(cls, field, value, error, text):
    with pytest.raises(error, match=re.escape(f"{cls.__name__}.{text}")):
        cls(**{field: value})


def test_bwd_dq_fields_are_validated():
    with pytest.raises(ValueError, match=r"BwdParams\.dq_q_blocksize"):
        BwdParams(dq_q_blocksize=24)
    with pytest.raises(ValueError, match=r"BwdParams\.dq_num_warps"):
        BwdParams(dq_num_warps=6)
    with pytest.raises(ValueError, match=r"BwdParams\.dq_num_stages"):
        BwdParams(dq_num_stages=0)


@given(st.data())
def test_merge_override_wins_where_set(data):
    cls = data.draw(st.sampled_from([FwdParams, BwdParams]))
    base, override = data.draw(_params(cls)), data.draw(_params(cls))
    merged = base.merge(override)
    for field in dataclasses.fields(cls):
        mine, theirs = getattr(base, field.name), getattr(override, field.name)
        assert getattr(merged, field.name) == (mine if theirs is None else theirs)
    # Identities: merging nothing, or an empty override, or itself changes nothing;
    # merging is idempotent.
    assert base.merge(None) == base.merge(cls()) == base.merge(base) == base
    assert merged.merge(override) == merged


def test_merge_refuses_the_other_kind():
    with pytest.raises(TypeError, match=r"FwdParams\.merge takes a FwdParams, got BwdParams"):
        FwdParams().merge(BwdParams())


@given(ANY_PARAMS)
def test_to_dict_round_trips_and_holds_only_set_fields(params):
    values = params.to_dict()
    assert None not in values.values()
    assert type(params).from_dict(values) == params
    assert hash(type(params).from_dict(values)) == hash(params)


def test_from_dict_refuses_unknown_fields():
    with pytest.raises(ValueError, match=r"FwdParams has no field\(s\) \['block_q'\]"):
        FwdParams.from_dict({"block_q": 64})
    with pytest.raises(ValueError, match="power of two"):
        FwdParams.from_dict({"q_blocksize": 100})


def test_attention_config_keeps_the_default_where_unset():
    default = AttentionKernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    assert FwdParams().to_attention_config(default) == default
    config = FwdParams(kv_blocksize=32, num_stages=2).to_attention_config(default)
    assert config == AttentionKernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)
    assert FwdParams.from_attention_config(config).to_attention_config(default) == config
    with pytest.raises(ValueError, match=r"\['blocksize_m'\] do not apply to attention"):
        FwdParams(blocksize_m=64).to_attention_config(default)


def test_grouped_matmul_config_keeps_the_default_where_unset():
    default = GroupedMatmulConfig(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=4)
    assert FwdParams().to_grouped_matmul_config(default) == default
    config = FwdParams(blocksize_n=256, num_stages=2).to_grouped_matmul_config(default)
    assert config == GroupedMatmulConfig(128, 64, 256, num_warps=8, num_stages=2)
    assert FwdParams.from_grouped_matmul_config(config).to_grouped_matmul_config(default) == config
    with pytest.raises(ValueError, match=r"\['q_blocksize'\] do not apply to grouped matmul"):
        FwdParams(q_blocksize=64).to_grouped_matmul_config(default)


def test_from_fwd_params_mirrors_the_tiles_for_dkdv_and_copies_them_for_dq():
    fwd = FwdParams(q_blocksize=128, kv_blocksize=32, num_warps=8, num_stages=3)
    bwd = BwdParams.from_fwd_params(fwd)
    # dK/dV: the key tile is stationary (the forward's query tile size), queries stream.
    assert (bwd.kv_blocksize, bwd.q_blocksize) == (128, 32)
    # dQ: the forward's structure, the forward's tiles.
    assert (bwd.dq_q_blocksize, bwd.dq_kv_blocksize) == (128, 32)
    assert bwd.num_warps == bwd.dq_num_warps == 8
    assert bwd.num_stages == bwd.dq_num_stages == 3
    assert BwdParams.from_fwd_params(FwdParams()) == BwdParams()  # unset stays unset
    assert BwdParams.from_fwd_params(FwdParams(q_blocksize=64)).to_dict() == {
        "kv_blocksize": 64,
        "dq_q_blocksize": 64,
    }


def test_attention_configs_fill_each_kernel_from_its_default():
    defaults = AttentionConfigs(
        forward=AttentionKernelConfig(128, 64, num_warps=8, num_stages=3),
        backward_dkdv=AttentionKernelConfig(16, 128, num_warps=8, num_stages=2),
        backward_dq=AttentionKernelConfig(128, 32, num_warps=8, num_stages=2),
    )
    assert attention_configs(None, None, defaults) == defaults
    configs = attention_configs(
        FwdParams(num_stages=2),
        BwdParams(q_blocksize=32, dq_kv_blocksize=64, dq_num_warps=4),
        defaults,
    )
    assert configs.forward == AttentionKernelConfig(128, 64, num_warps=8, num_stages=2)
    assert configs.backward_dkdv == AttentionKernelConfig(32, 128, num_warps=8, num_stages=2)
    assert configs.backward_dq == AttentionKernelConfig(128, 64, num_warps=4, num_stages=2)
    atomic = dataclasses.replace(defaults, dq_atomic=True)
    assert attention_configs(FwdParams(num_stages=2), None, atomic).dq_atomic
    with pytest.raises(ValueError, match=r"defaults\.\['backward_dq'\] must be set"):
        attention_configs(None, None, AttentionConfigs(defaults.forward, defaults.backward_dkdv))


def test_attention_configs_names_a_swapped_or_wrong_argument():
    from jax_bridge.tuning.heuristics import default_attention_configs

    defaults = default_attention_configs(64, "bfloat16", 90, ())
    with pytest.raises(TypeError, match="attention_configs: fwd must be a FwdParams"):
        attention_configs(BwdParams(), FwdParams(), defaults)
    with pytest.raises(TypeError, match="attention_configs: defaults must be an AttentionConfigs"):
        attention_configs(None, None, {"forward": None})


def test_attention_kernel_config_takes_each_kernels_fields():
    """One kernel's config from its params: the backward kernels share `BwdParams`, each
    reading its own fields (dK/dV the unprefixed ones, dQ the `dq_` ones), and agree with
    `attention_configs`' field of that kernel."""
    default = AttentionKernelConfig(64, 64, num_warps=4, num_stages=2)
    bwd = BwdParams(q_blocksize=32, num_stages=3, dq_kv_blocksize=16, dq_num_warps=8)
    fwd = FwdParams(kv_blocksize=128, num_warps=8)
    expected = {
        "forward": AttentionKernelConfig(64, 128, num_warps=8, num_stages=2),
        "backward_dkdv": AttentionKernelConfig(32, 64, num_warps=4, num_stages=3),
        "backward_dq": AttentionKernelConfig(64, 16, num_warps=8, num_stages=2),
    }
    defaults = AttentionConfigs(default, default, default)
    together = attention_configs(fwd, bwd, defaults)
    for kind, config in expected.items():
        params = fwd if kind == "forward" else bwd
        assert attention_kernel_config(kind, params, default) == config == getattr(together, kind)
    assert attention_kernel_config("backward_dq", None, default) == default
    with pytest.raises(TypeError, match="params of backward_dq must be a BwdParams or None"):
        attention_kernel_config("backward_dq", fwd, default)
    with pytest.raises(TypeError, match="default must be an AttentionKernelConfig, got None"):
        attention_kernel_config("forward", fwd, AttentionConfigs().forward)
    with pytest.raises(ValueError, match="kind must be one of"):
        attention_kernel_config("backward", bwd, default)


# --- the kernels' options: warp specialization and the softmax overlap -----------------


def test_bool_fields_are_exactly_the_fields_typed_bool():
    typed_bool = {
        field.name
        for cls in (FwdParams, BwdParams)
        for field in dataclasses.fields(cls)
        if field.type == "bool | None"
    }
    assert typed_bool == BOOL_FIELDS
    assert {"warp_specialize", "overlap_softmax"} <= {f.name for f in dataclasses.fields(FwdParams)}
    bwd = {f.name for f in dataclasses.fields(BwdParams)}
    assert {"warp_specialize", "overlap_softmax"} <= bwd  # dK/dV's


@pytest.mark.parametrize(
    "cls, field", [(FwdParams, "warp_specialize"), (FwdParams, "overlap_softmax"),
                   (BwdParams, "warp_specialize"), (BwdParams, "overlap_softmax"),
                   (BwdParams, "dq_tma")],
)  # fmt: skip
@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_option_fields_take_only_bools(cls, field, value):
    with pytest.raises(TypeError, match=re.escape(f"{cls.__name__}.{field} must be a bool")):
        cls(**{field: value})
    assert getattr(cls(**{field: True}), field) is True


# A default with every option off, unlike each config below: what the conversions give
# back comes from the params, not from the default.
_PLAIN_ATTENTION = AttentionKernelConfig(64, 64, num_warps=8, num_stages=1)
_PLAIN_GMM = GroupedMatmulConfig(64, 64, 64, num_warps=8, num_stages=1)


@pytest.mark.parametrize(
    "config",
    [
        AttentionKernelConfig(*OVERLAPPED_FORWARD_TILE, overlap_softmax=True),
        AttentionKernelConfig(128, 128, num_warps=4, num_stages=2, tma=True, warp_specialize=True),
    ],
    ids=["overlapped", "warp_specialized"],
)
def test_forward_options_round_trip(config):
    params = FwdParams.from_attention_config(config)
    stored = params.to_dict()
    assert stored["overlap_softmax"] is config.overlap_softmax
    assert stored["warp_specialize"] is config.warp_specialize
    assert FwdParams.from_dict(stored).to_attention_config(_PLAIN_ATTENTION) == config
    # Set to False, an option is off even over a default that has it on.
    off = FwdParams(overlap_softmax=False, warp_specialize=False)
    assert off.to_attention_config(config) == dataclasses.replace(
        config, overlap_softmax=False, warp_specialize=False
    )


@pytest.mark.parametrize(
    "dkdv",
    [
        AttentionKernelConfig(*OVERLAPPED_DKDV_TILE, overlap_softmax=True),
        AttentionKernelConfig(*WARP_SPECIALIZED_DKDV_TILE, tma=True, warp_specialize=True),
        AttentionKernelConfig(32, 64, 8, 1, head_major=True),
    ],
    ids=["overlapped", "warp_specialized", "head_major"],
)
def test_backward_options_round_trip(dkdv):
    dq = AttentionKernelConfig(128, 64, num_warps=8, num_stages=2, tma=True)
    params = BwdParams.from_attention_configs(dkdv, dq)
    assert params.dq_tma is True and params.tma is dkdv.tma
    assert params.overlap_softmax is dkdv.overlap_softmax
    assert params.warp_specialize is dkdv.warp_specialize
    assert params.head_major is dkdv.head_major
    again = BwdParams.from_dict(params.to_dict())
    assert again == params
    assert again.to_dkdv_config(_PLAIN_ATTENTION) == dkdv
    assert again.to_dq_config(_PLAIN_ATTENTION) == dq
    # Each kernel's own converter sets that kernel's fields only.
    assert BwdParams.from_dkdv_config(dkdv).merge(BwdParams.from_dq_config(dq)) == params
    assert set(BwdParams.from_dq_config(dq).to_dict()) == {
        "dq_q_blocksize", "dq_kv_blocksize", "dq_num_warps", "dq_num_stages", "dq_tma",
        "dq_host_descriptors",
    }  # fmt: skip


@pytest.mark.parametrize(
    "tiling", [*HOPPER_WARP_SPECIALIZED_GMM, HOPPER_WARP_SPECIALIZED_TGMM], ids=str
)
def test_grouped_matmul_warp_specialize_round_trips(tiling):
    config = warp_specialized_gmm_config(8192, 2048, 1408, tiling)
    assert config.warp_specialize and config.tma  # the constants' config, as launched
    params = FwdParams.from_grouped_matmul_config(config)
    assert params.to_dict()["warp_specialize"] is True and params.overlap_softmax is None
    assert FwdParams.from_dict(params.to_dict()).to_grouped_matmul_config(_PLAIN_GMM) == config


def test_host_descriptors_round_trip_for_gmm_and_every_attention_kernel():
    """`host_descriptors` (the kernel's descriptors encoded by the launch) round-trips
    through params and their dict for gmm and attention's three kernels (dQ's as
    `dq_host_descriptors`; a backward seeded by the forward's params takes it in both),
    and needs `tma` (the configs' own errors)."""
    config = dataclasses.replace(_PLAIN_GMM, tma=True, persistent=True, host_descriptors=True)
    params = FwdParams.from_grouped_matmul_config(config)
    assert params.to_dict()["host_descriptors"] is True
    assert FwdParams.from_dict(params.to_dict()).to_grouped_matmul_config(_PLAIN_GMM) == config
    with pytest.raises(ValueError, match="host_descriptors=True needs tma=True"):
        FwdParams(host_descriptors=True).to_grouped_matmul_config(_PLAIN_GMM)
    forward = dataclasses.replace(_PLAIN_ATTENTION, tma=True, host_descriptors=True)
    params = FwdParams.from_attention_config(forward)
    assert FwdParams.from_dict(params.to_dict()).to_attention_config(_PLAIN_ATTENTION) == forward
    with pytest.raises(ValueError, match="host_descriptors=True needs tma=True"):
        FwdParams(host_descriptors=True).to_attention_config(_PLAIN_ATTENTION)
    seeded = BwdParams.from_fwd_params(params)
    assert seeded.host_descriptors is True and seeded.dq_host_descriptors is True
    assert seeded.to_dq_config(_PLAIN_ATTENTION) == forward
    dkdv = dataclasses.replace(forward, block_m=forward.block_n, block_n=forward.block_m)
    assert seeded.to_dkdv_config(_PLAIN_ATTENTION) == dkdv
    assert BwdParams.from_dict(BwdParams.from_dq_config(forward).to_dict()) == BwdParams(
        dq_q_blocksize=forward.block_m, dq_kv_blocksize=forward.block_n,
        dq_num_warps=forward.num_warps, dq_num_stages=forward.num_stages, dq_tma=True,
        dq_host_descriptors=True,
    )  # fmt: skip
    held = BwdParams.from_dict(BwdParams.from_dkdv_config(dkdv).to_dict())
    assert held.host_descriptors is True and held.dq_host_descriptors is None
    assert held.to_dkdv_config(_PLAIN_ATTENTION) == dkdv
    without_tma = (("to_dkdv_config", BwdParams(host_descriptors=True)),
                   ("to_dq_config", BwdParams(dq_host_descriptors=True)))  # fmt: skip
    for convert, params in without_tma:
        with pytest.raises(ValueError, match="host_descriptors=True needs tma=True"):
            getattr(params, convert)(_PLAIN_ATTENTION)


def _config_error(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


def test_options_a_kernel_refuses_raise_its_configs_own_error():
    # Warp specialization needs tma and 4 warps: the default below has neither.
    expected = _config_error(lambda: dataclasses.replace(_PLAIN_ATTENTION, warp_specialize=True))
    assert "warp_specialize needs tma=True" in expected
    with pytest.raises(ValueError) as info:
        FwdParams(warp_specialize=True).to_attention_config(_PLAIN_ATTENTION)
    assert str(info.value) == expected
    # The overlap and warp specialization exclude each other.
    both = dict(num_warps=4, tma=True, warp_specialize=True, overlap_softmax=True)
    expected = _config_error(lambda: AttentionKernelConfig(64, 64, num_stages=1, **both))
    assert "exclude each other" in expected
    with pytest.raises(ValueError) as info:
        FwdParams(**both).to_attention_config(_PLAIN_ATTENTION)
    assert str(info.value) == expected
    # dK/dV's overlap over a default the overlap excludes.
    specialized = AttentionKernelConfig(64, 64, 4, 1, tma=True, warp_specialize=True)
    with pytest.raises(ValueError, match="exclude each other"):
        BwdParams(overlap_softmax=True).to_dkdv_config(specialized)
    # Grouped matmul: the same rule, its own config's message.
    expected = _config_error(
        lambda: dataclasses.replace(_PLAIN_GMM, tma=True, warp_specialize=True)
    )
    assert expected.startswith("GroupedMatmulConfig.warp_specialize needs")
    with pytest.raises(ValueError) as info:
        FwdParams(tma=True, warp_specialize=True).to_grouped_matmul_config(_PLAIN_GMM)
    assert str(info.value) == expected


def test_the_overlap_is_attention_only():
    with pytest.raises(ValueError, match=r"\['overlap_softmax'\] do not apply to grouped matmul"):
        FwdParams(overlap_softmax=False).to_grouped_matmul_config(_PLAIN_GMM)
    # warp_specialize is both ops': no refusal either way.
    assert FwdParams(warp_specialize=False).to_grouped_matmul_config(_PLAIN_GMM) == _PLAIN_GMM
    assert FwdParams(warp_specialize=False).to_attention_config(_PLAIN_ATTENTION) == (
        _PLAIN_ATTENTION
    )


@pytest.mark.parametrize(
    "dkdv, dq, where, dropped",
    [
        (AttentionKernelConfig(64, 64), AttentionKernelConfig(64, 64, overlap_softmax=True),
         "from_dq_config", "['overlap_softmax']"),
        (AttentionKernelConfig(64, 64, tma=True, warp_specialize=True),
         AttentionKernelConfig(64, 64, tma=True, warp_specialize=True), "from_dq_config",
         "['warp_specialize']"),
    ],
)  # fmt: skip
def test_backward_configs_with_options_their_params_cannot_hold_are_refused(
    dkdv, dq, where, dropped
):
    with pytest.raises(ValueError, match=re.escape(f"BwdParams.{where}: BwdParams has no field "
                                                   f"for {dropped}")):  # fmt: skip
        BwdParams.from_attention_configs(dkdv, dq)


def test_forward_params_refuse_dkdv_s_head_major():
    """`head_major` is dK/dV's alone: `FwdParams` has no field for it, so a forward config
    with it (which `AttentionConfigs` refuses) is not converted with it silently dropped."""
    config = AttentionKernelConfig(32, 64, head_major=True)
    message = "FwdParams.from_attention_config: FwdParams has no field for ['head_major']"
    with pytest.raises(ValueError, match=re.escape(message)):
        FwdParams.from_attention_config(config)
    assert "head_major" not in {f.name for f in dataclasses.fields(FwdParams)}


def test_from_fwd_params_carries_the_overlap_to_dkdv_only():
    fwd = FwdParams(q_blocksize=128, tma=True, num_warps=4, warp_specialize=True)
    bwd = BwdParams.from_fwd_params(fwd)
    assert bwd.overlap_softmax is None and bwd.tma is bwd.dq_tma is True
    bwd = BwdParams.from_fwd_params(FwdParams(overlap_softmax=True))
    assert bwd.to_dict() == {"overlap_softmax": True}


def test_attention_configs_carry_the_options_to_their_kernels():
    defaults = AttentionConfigs(_PLAIN_ATTENTION, _PLAIN_ATTENTION, _PLAIN_ATTENTION)
    configs = attention_configs(
        FwdParams(num_warps=4, tma=True, warp_specialize=True),
        BwdParams(overlap_softmax=True),
        defaults,
    )
    assert configs.forward == AttentionKernelConfig(
        64, 64, num_warps=4, num_stages=1, tma=True, warp_specialize=True
    )
    assert configs.backward_dkdv == dataclasses.replace(_PLAIN_ATTENTION, overlap_softmax=True)
    assert configs.backward_dq == _PLAIN_ATTENTION
