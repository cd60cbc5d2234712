"""The one precision rule: canonical forms, the package default, the Triton mapping."""

import dataclasses

import jax
import pytest

from jax_bridge.core.options import OpOptions
from jax_bridge.core.precision import (
    DEFAULT_PRECISION,
    canonicalize_precision,
    triton_input_precision,
)

P = jax.lax.Precision


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, P.HIGHEST),
        (P.DEFAULT, P.DEFAULT),
        (P.HIGH, P.HIGH),
        ("highest", P.HIGHEST),
        ("HIGHEST", P.HIGHEST),
        ("float32", P.HIGHEST),
        ("tensorfloat32", P.HIGH),
        ("bfloat16", P.DEFAULT),
        ((P.DEFAULT, P.HIGHEST), P.HIGHEST),
        (("default", "high"), P.HIGH),
    ],
)
def test_accepted_forms(given, expected):
    assert canonicalize_precision(given, "op") is expected


def test_the_default_is_exact_float32():
    assert DEFAULT_PRECISION is P.HIGHEST
    assert triton_input_precision(canonicalize_precision(None, "op")) == "ieee"


@pytest.mark.parametrize("bad", ["exact", 3, (P.HIGH,), (P.HIGH, P.HIGH, P.HIGH), 1.5])
def test_bad_precision_names_the_op(bad):
    with pytest.raises(ValueError, match="my_op: precision must be"):
        canonicalize_precision(bad, "my_op")


def test_triton_mapping_follows_jax_meaning():
    assert [triton_input_precision(p) for p in (P.DEFAULT, P.HIGH, P.HIGHEST)] == [
        "tf32",
        "tf32x3",
        "ieee",
    ]


def test_options_are_hashable_and_compare_by_value():
    a = OpOptions(implementation="xla")
    b = OpOptions(implementation="xla", precision=P.HIGHEST)
    assert a == b and hash(a) == hash(b)
    assert dataclasses.replace(a, precision=P.DEFAULT) != a
    with pytest.raises(TypeError):
        OpOptions("xla")  # keyword-only: subclasses add fields freely
