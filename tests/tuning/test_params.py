"""FwdParams / BwdParams: frozen, hashable, validated; merge and conversions as documented."""

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_bridge.tuning.params import BwdParams, FwdParams, attention_configs
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig

BLOCKS = st.sampled_from([None, 16, 32, 64, 128, 256])
WARPS = st.sampled_from([None, 1, 2, 4, 8, 16])
STAGES = st.one_of(st.none(), st.integers(1, 6))
TMA = st.sampled_from([None, False, True])


def _params(cls):
    fields = {}
    for field in dataclasses.fields(cls):
        if "blocksize" in field.name:
            fields[field.name] = BLOCKS
        elif field.name.endswith("num_warps"):
            fields[field.name] = WARPS
        elif field.name.endswith("tma"):
            fields[field.name] = TMA
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
