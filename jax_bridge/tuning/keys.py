"""Cache keys: the abstract arguments of a call and a canonical JSON text of them.

Invariants (tested as properties):

* `abstractify` keeps exactly what a compiled kernel depends on: the pytree structure,
  each array's shape and dtype (never its values, its sharding or whether it is a numpy
  or JAX array), and Python scalars and None as they are.
* `stable_json` is canonical and injective: equal inputs give the same text, whatever
  the dict insertion order; inputs that differ (in value or in type: 1, 1.0 and True;
  a list and a tuple) give different texts. `short_hash` inherits both, up to sha256
  collisions.
* Nothing unknown is encoded by guesswork: an object `stable_json` has no rule for is a
  TypeError, so a key never silently depends on a `repr` or an object id.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from typing import Any

import jax
import numpy as np

__all__ = ["abstractify", "cache_key", "short_hash", "stable_json"]

# Encoded values that are not plain JSON are one-key objects whose key starts with "$";
# a user dict with such a key is wrapped as {"$dict": ...}, so decoding (and hence the
# encoding) is unambiguous.
_TAG = "$"


def abstractify(pytree: Any) -> Any:
    """The pytree with every array leaf replaced by `jax.ShapeDtypeStruct(shape, dtype)`.

    Array leaves are JAX arrays (tracers included), numpy arrays and scalars, and
    `ShapeDtypeStruct`s; their dtype is canonicalised as JAX does on entry to a
    computation (float64 becomes float32 unless x64 is enabled). Python scalars (bool,
    int, float, str) stay values and None stays None (it is an empty pytree node). Any
    other leaf is a TypeError.
    """

    def leaf(x: Any) -> Any:
        if isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic):
            # The dtype the compiled computation sees (float64 is float32 without x64).
            return jax.ShapeDtypeStruct(tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype))
        raise TypeError(
            f"abstractify: cannot make a cache key of a {type(x).__name__} leaf; pass "
            "arrays, ShapeDtypeStructs, Python scalars or None."
        )

    return jax.tree.map(leaf, pytree)


def _encode(obj: Any) -> Any:
    """`obj` as plain JSON values (see the module docstring for the tags)."""
    if isinstance(obj, enum.Enum):  # before int and str: an IntEnum is an int, a StrEnum a str
        return {f"{_TAG}enum": f"{_qualname(type(obj))}.{obj.name}"}
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {f"{_TAG}float": repr(obj)}
    if isinstance(obj, list):
        return [_encode(x) for x in obj]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        fields = {name: _encode(getattr(obj, name)) for name in obj._fields}
        return {f"{_TAG}namedtuple": {"type": _qualname(type(obj)), "fields": fields}}
    if isinstance(obj, tuple):
        return {f"{_TAG}tuple": [_encode(x) for x in obj]}
    if isinstance(obj, dict):
        return _encode_dict(obj)
    if isinstance(obj, jax.ShapeDtypeStruct):
        shape = [int(d) for d in obj.shape]
        return {f"{_TAG}array": {"shape": shape, "dtype": np.dtype(obj.dtype).name}}
    if isinstance(obj, np.dtype) or _is_scalar_type(obj):
        return {f"{_TAG}dtype": np.dtype(obj).name}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {f"{_TAG}dataclass": {"type": _qualname(type(obj)), "fields": fields}}
    raise TypeError(
        f"stable_json: no canonical encoding for {type(obj).__name__} ({obj!r:.80}); use "
        "JSON values, tuples, dataclasses, enums, dtypes or ShapeDtypeStructs "
        "(arrays: abstractify them first)."
    )


def _encode_dict(obj: dict) -> dict:
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise TypeError(f"stable_json: dict keys must be str, got {bad[0]!r}.")
    encoded = {k: _encode(v) for k, v in obj.items()}
    return {f"{_TAG}dict": encoded} if any(k.startswith(_TAG) for k in obj) else encoded


def _is_scalar_type(obj: Any) -> bool:
    """A numpy scalar type (np.float32, ml_dtypes.bfloat16) or a JAX one (jnp.bfloat16)."""
    if not isinstance(obj, type):
        return False
    return issubclass(obj, np.generic) or isinstance(getattr(obj, "dtype", None), np.dtype)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def stable_json(obj: Any) -> str:
    """The canonical JSON text of `obj`: sorted keys, no whitespace, ASCII only.

    Encodes JSON values (None, bool, int, finite and non-finite floats, str, lists, dicts
    with str keys), tuples and namedtuples, `jax.ShapeDtypeStruct`s (shape and dtype
    name), numpy and JAX dtypes, enums and dataclass instances (qualified type name and
    every field), recursively.
    Raises TypeError for anything else.
    """
    return json.dumps(_encode(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def short_hash(obj: Any) -> str:
    """The first 16 hex digits of the sha256 of `stable_json(obj)`."""
    return hashlib.sha256(stable_json(obj).encode()).hexdigest()[:16]


def cache_key(op: str, device: str, abstract_args: Any) -> str:
    """The key of one tuning-cache entry, e.g. "grouped_matmul-0123456789abcdef"."""
    return f"{op}-{short_hash({'op': op, 'device': device, 'args': abstract_args})}"
