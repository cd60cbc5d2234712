"""The package root re-exports the splash API, as jax_bridge's root does."""

import pallas_tpu
from pallas_tpu import splash


def test_root_exports_every_public_splash_name():
    assert set(pallas_tpu.__all__) == set(splash.__all__) | {"splash"}
    for name in splash.__all__:
        assert getattr(pallas_tpu, name) is getattr(splash, name), name


def test_process_mask_from_the_root():
    mask = pallas_tpu.CausalMask((256, 256))
    info, _ = pallas_tpu.process_mask(mask, (128, 128))
    assert isinstance(info, pallas_tpu.MaskInfo)
    # Causal over 2x2 blocks: the two diagonal blocks are partial, the one below full,
    # the one above empty (never visited).
    assert int((info.block_mask > 0).sum()) == 3
