"""KernelConfig: one validation for every kernel's launch configuration."""

import dataclasses

import pytest

from triton_kernels.config import KernelConfig, multiplies_by_mma_sync, pipeline_buffers
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig
from triton_kernels.grouped_matmul.config import GroupedMatmulConfig

CONFIGS = {
    "attention": lambda **kw: AttentionKernelConfig(**{"block_m": 64, "block_n": 32, **kw}),
    "grouped_matmul": lambda **kw: GroupedMatmulConfig(
        **{"block_m": 64, "block_k": 32, "block_n": 128, **kw}
    ),
}


@pytest.mark.parametrize("kind", CONFIGS)
def test_valid_configs_are_frozen_and_hashable(kind):
    config = CONFIGS[kind](num_warps=8, num_stages=3)
    assert isinstance(config, KernelConfig)
    assert hash(config) == hash(CONFIGS[kind](num_warps=8, num_stages=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_warps = 4
    assert config.replace(num_stages=1).num_stages == 1


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize(
    "override, error, text",
    [
        ({"block_m": 48}, ValueError, "block_m must be a power of two >= 16"),
        ({"block_m": 8}, ValueError, "block_m must be a power of two >= 16"),
        ({"block_m": 64.0}, TypeError, "block_m must be an int"),
        ({"block_m": True}, TypeError, "block_m must be an int"),
        ({"num_warps": 3}, ValueError, "num_warps must be one of"),
        ({"num_warps": 32}, ValueError, "num_warps must be one of"),
        ({"num_stages": 0}, ValueError, "num_stages must be an int >= 1"),
        ({"num_stages": 2.0}, TypeError, "num_stages must be an int"),
        ({"num_warps": 4.0}, TypeError, "num_warps must be an int"),  # 4.0 in NUM_WARPS
        ({"num_warps": True}, TypeError, "num_warps must be an int"),
    ],
)
def test_every_config_is_validated_by_the_base(kind, override, error, text):
    with pytest.raises(error, match=text) as info:
        CONFIGS[kind](**override)
    assert CONFIGS[kind]().__class__.__name__ in str(info.value)


def test_replace_validates_too():
    with pytest.raises(ValueError, match="block_n"):
        CONFIGS["attention"]().replace(block_n=100)


def test_attention_configs_hold_one_config_per_kernel():
    fwd = AttentionKernelConfig(32, 16)
    configs = AttentionConfigs(forward=fwd)
    assert configs.forward is fwd and configs.backward_dq is None
    with pytest.raises(TypeError, match=r"AttentionConfigs\.backward_dq"):
        AttentionConfigs(backward_dq=(32, 16))
    with pytest.raises(TypeError, match="for_every_kernel takes an AttentionKernelConfig"):
        AttentionConfigs.for_every_kernel(GroupedMatmulConfig(16, 16, 16))


def test_pipeline_buffers_follow_the_mma():
    """Triton keeps a buffer a stage where the MMAs read shared memory asynchronously
    (sm_90, sm_100, products of 64 rows or more), one fewer where mma.sync reads it into
    registers (sm_80-89, sm_120): 2 stages there await each copy before its MMAs."""
    for capability in (90, 100, 103):
        assert not multiplies_by_mma_sync(capability)
        assert [pipeline_buffers(s, capability) for s in (1, 2, 3)] == [1, 2, 3]
        # wgmma and tcgen05 take 64 rows or more: a narrower product runs on mma.sync.
        assert not multiplies_by_mma_sync(capability, rows=64)
        assert multiplies_by_mma_sync(capability, rows=32)
        assert [pipeline_buffers(s, capability, rows=32) for s in (1, 2, 3)] == [1, 1, 2]
    for capability in (80, 86, 89, 120, None):
        assert multiplies_by_mma_sync(capability)
        assert [pipeline_buffers(s, capability) for s in (1, 2, 3)] == [1, 1, 2]
