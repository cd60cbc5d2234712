"""Cache keys: `abstractify`, `stable_json` and `short_hash` as property tests.

Invariants: equal shapes and dtypes give equal keys, whatever the values or the array
type; a different shape, dtype or structure gives a different key; `stable_json` is
canonical (dict order does not matter) and injective (values that differ in value or in
type never share a text); anything without a canonical encoding is refused.
"""

import dataclasses
import enum
import hashlib
import json
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from jax_bridge.tuning.keys import abstractify, cache_key, short_hash, stable_json
from jax_bridge.tuning.params import BwdParams, FwdParams

SDS = jax.ShapeDtypeStruct
# Dtypes that JAX keeps as they are without x64 (so the key sees them unchanged).
DTYPES = ["float16", "bfloat16", "float32", "int32", "int8", "uint8", "bool"]

shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)
dtypes = st.sampled_from(DTYPES)
array_kinds = st.sampled_from(["numpy", "jax", "sds"])


def _array(kind: str, shape: tuple, dtype: str, fill: int):
    if kind == "sds":
        return SDS(shape, jnp.dtype(dtype))
    values = np.full(shape, fill).astype(jnp.dtype(dtype))
    return values if kind == "numpy" else jnp.asarray(values)


@given(shapes, dtypes, array_kinds, array_kinds, st.integers(0, 3), st.integers(0, 3))
def test_equal_shapes_and_dtypes_give_equal_keys(shape, dtype, kind_a, kind_b, fill_a, fill_b):
    a, b = _array(kind_a, shape, dtype, fill_a), _array(kind_b, shape, dtype, fill_b)
    assert abstractify(a) == abstractify(b) == SDS(shape, jnp.dtype(dtype))
    assert stable_json(abstractify(a)) == stable_json(abstractify(b))
    assert short_hash(abstractify((a, 3))) == short_hash(abstractify((b, 3)))


@given(shapes, dtypes, shapes, dtypes, array_kinds)
def test_different_shapes_or_dtypes_give_different_keys(shape_a, dtype_a, shape_b, dtype_b, kind):
    assume((shape_a, dtype_a) != (shape_b, dtype_b))
    a, b = _array(kind, shape_a, dtype_a, 0), _array(kind, shape_b, dtype_b, 0)
    assert stable_json(abstractify(a)) != stable_json(abstractify(b))
    assert short_hash(abstractify([a])) != short_hash(abstractify([b]))


@given(shapes, dtypes)
def test_abstractify_keeps_structure_scalars_and_none(shape, dtype):
    tree = {"x": np.zeros(shape, jnp.dtype(dtype)), "opts": (None, 3, 0.5, "causal", True)}
    abstract = abstractify(tree)
    assert jax.tree.structure(abstract) == jax.tree.structure(tree)
    assert abstract["x"] == SDS(shape, jnp.dtype(dtype))
    assert abstract["opts"] == (None, 3, 0.5, "causal", True)
    # The same leaves in another container are another key.
    other = {"x": tree["x"], "opts": list(tree["opts"])}
    assert stable_json(abstractify(other)) != stable_json(abstract)


def test_abstractify_canonicalizes_like_jax_and_refuses_unknown_leaves():
    # Without x64, a float64 numpy array enters a computation as float32.
    assert abstractify(np.zeros((2, 3))) == SDS((2, 3), jnp.float32)
    assert abstractify(np.float32(1.5)) == SDS((), jnp.float32)
    with pytest.raises(TypeError, match="cannot make a cache key of a object leaf"):
        abstractify([object()])


# --- stable_json: canonical and injective over JSON-like values ----------------------

# A small domain, with the values an encoding is likeliest to confuse (1, 1.0 and True;
# -0.0 and 0.0; lists and tuples; keys that look like the encoding's own tags), so that
# independently drawn values are often equal or nearly so.
LEAVES = st.sampled_from(
    [None, True, False, 0, 1, 0.0, -0.0, 1.0, float("nan"), float("inf"), -math.inf, "", "1"]
)
KEYS = st.sampled_from(["a", "b", "$tuple", "$dict", "$float", "$x"])
VALUES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(KEYS, children, max_size=3),
    ),
    max_leaves=8,
)


def _same(a, b) -> bool:
    """Equality that also tells 1, 1.0 and True, -0.0 and 0.0, lists and tuples apart."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@given(VALUES, VALUES)
def test_stable_json_is_injective(a, b):
    assert (stable_json(a) == stable_json(b)) == _same(a, b)


def _reordered(value):
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list | tuple):
        return type(value)(_reordered(x) for x in value)
    return value


@given(VALUES)
def test_stable_json_is_canonical(value):
    text = stable_json(value)
    assert stable_json(_reordered(value)) == text  # dict insertion order is irrelevant
    # Sorted keys, no whitespace, ASCII: re-dumping the parsed text changes nothing.
    assert json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")) == text
    assert text.isascii()
    assert short_hash(value) == hashlib.sha256(text.encode()).hexdigest()[:16]


class _Mode(enum.Enum):
    FAST = 1
    SAFE = 2


class _Level(enum.IntEnum):
    ONE = 1


class _Name(enum.StrEnum):
    FAST = "fast"


class _Pair(NamedTuple):
    left: int
    right: int


@dataclasses.dataclass(frozen=True)
class _Point:
    x: int
    y: int


def test_stable_json_encodes_the_documented_types_deterministically():
    assert stable_json({"b": 1, "a": (1, 2)}) == '{"a":{"$tuple":[1,2]},"b":1}'
    assert stable_json(SDS((2, 3), jnp.bfloat16)) == (
        '{"$array":{"dtype":"bfloat16","shape":[2,3]}}'
    )
    # A dtype is one key however it is spelled.
    spellings = [jnp.bfloat16, jnp.dtype("bfloat16"), np.dtype(jnp.bfloat16)]
    assert len({stable_json(d) for d in spellings}) == 1
    assert stable_json(jnp.float32) == stable_json(np.float32) == '{"$dtype":"float32"}'
    assert stable_json(_Mode.FAST) != stable_json(_Mode.SAFE)
    # Enums that are also ints or strs are tagged as enums, not encoded as their values.
    assert stable_json(_Level.ONE) != stable_json(1)
    assert stable_json(_Name.FAST) != stable_json("fast")
    assert stable_json(_Pair(1, 2)) != stable_json((1, 2))
    assert stable_json(_Point(1, 2)) != stable_json(_Point(2, 1))
    assert stable_json(FwdParams(num_warps=8)) != stable_json(BwdParams(num_warps=8))
    assert stable_json(jax.lax.Precision.HIGHEST) != stable_json(jax.lax.Precision.DEFAULT)


@pytest.mark.parametrize(
    "value, text",
    [
        (object(), "no canonical encoding for object"),
        (np.zeros(3), "abstractify them first"),
        ({1: "a"}, "dict keys must be str"),
        ({1.5, 2.5}, "no canonical encoding for set"),
        (b"bytes", "no canonical encoding for bytes"),
    ],
)
def test_stable_json_refuses_what_it_cannot_encode(value, text):
    with pytest.raises(TypeError, match=text):
        stable_json([value])


def test_cache_key_names_the_op_and_depends_on_op_device_and_args():
    args = abstractify((np.zeros((4, 8), np.float32),))
    key = cache_key("grouped_matmul.fwd", "gpu-h100-sm90-0123", args)
    assert key.startswith("grouped_matmul.fwd-") and len(key.split("-")[-1]) == 16
    assert key == cache_key("grouped_matmul.fwd", "gpu-h100-sm90-0123", args)
    assert key != cache_key("grouped_matmul.fwd_bwd", "gpu-h100-sm90-0123", args)
    assert key != cache_key("grouped_matmul.fwd", "gpu-a100-sm80-0123", args)
    assert key != cache_key("grouped_matmul.fwd", "gpu-h100-sm90-0123", abstractify((args,)))
