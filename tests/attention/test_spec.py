"""Tests for `AttentionSpec`: defaults, causal's effect on the window, validation, hashing."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from jax_bridge.attention.spec import AttentionSpec


def test_defaults():
    spec = AttentionSpec.create(64)
    assert spec == AttentionSpec(0.125, False, None, None, None)
    assert AttentionSpec.create(80).softmax_scale == pytest.approx(1 / math.sqrt(80))
    assert AttentionSpec.create(80, softmax_scale=0.3).softmax_scale == 0.3
    assert isinstance(AttentionSpec.create(64, softmax_scale=2).softmax_scale, float)
    assert AttentionSpec.create(64, softmax_scale=-0.5).softmax_scale == -0.5
    assert AttentionSpec.create(64, logits_soft_cap=np.float32(5.0)).logits_soft_cap == 5.0


@pytest.mark.parametrize(
    "window, expected",
    [(None, (None, 0)), ((7, None), (7, 0)), ((None, 3), (None, 0)), ((2, 0), (2, 0))],
)
def test_causal_forces_window_right_to_zero(window, expected):
    spec = AttentionSpec.create(64, causal=True, sliding_window=window)
    assert (spec.window_left, spec.window_right) == expected
    direct = AttentionSpec(1.0, causal=True, window_right=5)
    assert direct.window_right == 0
    # Without causal, the window is kept as given.
    assert AttentionSpec.create(64, sliding_window=(None, 3)).window_right == 3


@pytest.mark.parametrize(
    "window, name",
    [
        ((-1, None), "window_left"),
        ((None, -2), "window_right"),
        ((True, None), "window_left"),
        ((None, 1.5), "window_right"),
        ((2.0, 3), "window_left"),
        ((1, 2, 3), "sliding_window"),
        ((1,), "sliding_window"),
        (4, "sliding_window"),
    ],
)
def test_bad_windows_raise_naming_them(window, name):
    with pytest.raises(ValueError, match=name):
        AttentionSpec.create(64, sliding_window=window)


@pytest.mark.parametrize("field", ["window_left", "window_right"])
def test_bad_window_fields_raise_naming_them(field):
    with pytest.raises(ValueError, match=field):
        AttentionSpec(1.0, **{field: -1})


@pytest.mark.parametrize("cap", [0.0, -1.0, math.inf, -math.inf, math.nan, True, "5"])
def test_bad_soft_cap_raises_naming_it(cap):
    with pytest.raises(ValueError, match="logits_soft_cap"):
        AttentionSpec.create(64, logits_soft_cap=cap)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        AttentionSpec(1.0, logits_soft_cap=cap)


# 0 too: every score 0 (a uniform average, zero dQ and dK), almost always a bug such as
# `1 // head_dim**0.5`; a negative scale is valid math and kept.
@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, True, "0.5", None, 0, 0.0])
def test_bad_softmax_scale_raises_naming_it(scale):
    if scale is not None:  # None means "default" for create
        with pytest.raises(ValueError, match="softmax_scale"):
            AttentionSpec.create(64, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        AttentionSpec(scale)


def test_frozen_and_hashable():
    spec = AttentionSpec.create(64, causal=True, sliding_window=(8, None), logits_soft_cap=5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.causal = False
    same = AttentionSpec.create(64, causal=True, sliding_window=(8, 4), logits_soft_cap=5)
    assert spec == same and hash(spec) == hash(same)
    assert len({spec, same, AttentionSpec.create(64)}) == 2

    # Usable as a static jit argument: equal specs share one compilation.
    fn = jax.jit(lambda x, spec: x * spec.softmax_scale, static_argnums=1)
    fn(np.float32(1.0), spec)
    fn(np.float32(1.0), same)
    assert fn._cache_size() == 1
