"""Argument checks shared by the packed-sequence layer and the ops built on it.

Every check has two modes, chosen by whether the value is known on the host:

* **concrete** (numpy arrays, Python lists, JAX arrays outside a trace): the check runs
  now and raises ``ValueError``/``TypeError`` naming the argument and what was expected;
* **traced** (inside ``jax.jit``, ``vmap``, ``checkify``...): shape, rank and dtype are still
  known and are checked at trace time; checks on *values* go through
  ``jax.experimental.checkify.debug_check``. Wrapping a function with
  ``checkify.checkify`` turns them into a reported error; under plain ``jax.jit`` they are
  dropped, so every function stays jittable. (``checkify.check`` would instead make every
  plain ``jax.jit`` caller fail to trace, which is why the debug flavour is used.)

Messages passed to ``debug_check`` are format strings, so they never contain braces.
``traced_value_checks(False)`` leaves the traced checks out of the program (what
``jax.export`` needs: it cannot serialize their effect). ``debug_checks()`` is the
opposite switch, for debugging: within it the traced checks also raise under plain
``jax.jit``, through a host callback.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import operator
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# JAX user contexts, hence part of jit's cache key.
_traced_value_checks = jax.make_user_context(True)
# The public ops whose checks run now (`naming_op`, outermost first), named in the messages
# of traced checks: a JAX user context, so part of jit's cache key (a jitted helper traced
# under one op is traced again under another, its messages naming each).
_checking_ops = jax.make_user_context(())
_debug_checks = jax.make_user_context(False)


@contextlib.contextmanager
def traced_value_checks(enabled: bool) -> Iterator[None]:
    """Within `traced_value_checks(False)` checks on traced values are not staged out
    (concrete values are still checked)."""
    with _traced_value_checks(bool(enabled)):
        yield


@contextlib.contextmanager
def debug_checks() -> Iterator[None]:
    """Within: checks on traced values raise under plain `jax.jit` too, for debugging.

    Functions traced inside (jit caches them apart) run each value check (cu_seqlens,
    group sizes, segment ids...) as a host callback that raises a ValueError with the
    check's message when it fails; the call then fails with a runtime error quoting it.
    Each check costs a device-to-host transfer: leave it off in training. (Outside it,
    `checkify.checkify(jax.jit(f))` reports the same checks without the callbacks.)
    """
    with _debug_checks(True):
        yield


def _raise_unless(ok: Any, *, message: str) -> None:
    """Host side of a debug check: `ok` is the predicate's value (batched under vmap)."""
    if not np.all(np.asarray(ok)):
        raise ValueError(message)


def is_traced(x: Any) -> bool:
    """True when ``x`` is an abstract value inside a JAX transformation (no host value)."""
    return isinstance(x, jax.core.Tracer)


def host_value(x: Any) -> np.ndarray | None:
    """``x`` on the host where every part of it is concrete (an array, a scalar, a list),
    else None: where any part is traced, or an array is not all on this host. Static
    sizes and immediate checks read it: under an outer ``jax.jit`` the ``jnp.asarray`` a
    check returns is a tracer, even of a NumPy constant the jitted function closes over."""
    for leaf in jax.tree.leaves(x):
        if is_traced(leaf) or (isinstance(leaf, jax.Array) and not leaf.is_fully_addressable):
            return None
    return np.asarray(x)


def require(predicate: Any, message: str) -> None:
    """Assert a scalar boolean ``predicate``: raise now if concrete, else checkify-check.

    Args:
      predicate: a Python/numpy bool (concrete) or a traced boolean scalar.
      message: the ``ValueError`` text; also the checkify message, so no braces.
    """
    if is_traced(predicate):
        if _traced_value_checks.value:
            # Raised later, outside `naming_op`: the ops' names go into the message now,
            # as `naming_op` would have put them, outermost first.
            for op in reversed(_checking_ops.value):
                if not message.startswith(f"{op}:"):
                    message = f"{op}: {message}"
            checkify.debug_check(predicate, message)
            if _debug_checks.value:
                jax.debug.callback(functools.partial(_raise_unless, message=message), predicate)
    elif not bool(predicate):
        raise ValueError(message)


def require_all(condition: Any, message: str) -> None:
    """:func:`require` that every element of the boolean array ``condition`` holds."""
    if is_traced(condition):
        require(jnp.all(condition), message)
    else:
        require(np.all(np.asarray(condition)), message)


def _host_or_device(x: Any) -> Any:
    """``np`` for values we can read on the host, ``jnp`` for traced ones."""
    return jnp if is_traced(x) else np


def check_static_int(value: Any, name: str, *, minimum: int = 0) -> int:
    """Check that ``value`` is a static Python/numpy integer ``>= minimum`` and return it.

    Sizes that decide an output shape must be static; a traced value is a TypeError that
    says to pass it as a static argument.
    """
    if is_traced(value):
        raise TypeError(
            f"{name} decides an output shape, so it must be a static Python int, not a traced "
            "value; mark it static (e.g. jax.jit(..., static_argnames=...))."
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}: {value!r}.")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def check_chunk_size(chunk_size: Any, name: str = "chunk_size") -> int:
    """Check that a chunk/block size is a static positive int and return it."""
    return check_static_int(chunk_size, name, minimum=1)


def check_integer_dtype(x: jax.Array | np.ndarray, name: str, *, signed: bool = False) -> None:
    """TypeError unless ``x`` has an integer dtype (signed if ``signed``); bool is rejected."""
    kind = jnp.signedinteger if signed else jnp.integer
    if not jnp.issubdtype(x.dtype, kind):
        expected = "a signed integer dtype (int32/int64)" if signed else "an integer dtype"
        raise TypeError(f"{name} must have {expected}, got {x.dtype}.")


def check_rank(x: jax.Array | np.ndarray, rank: int, name: str, shape_doc: str) -> None:
    """ValueError unless ``x.ndim == rank``; ``shape_doc`` spells the expected shape."""
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}.")


ATTENTION_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_array(name: str, x: Any, shape_doc: str, *, floating: bool = False) -> None:
    """`x` an array of the rank `shape_doc` spells (e.g. "[tokens, hidden]"), of a floating
    dtype where `floating`: a TypeError for a non-array or a dtype, a ValueError for a
    rank, each naming `name` (`naming_op` prefixes the op)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array of shape {shape_doc}, got {type(x).__name__}.")
    if x.ndim != shape_doc.count(",") + 1:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}.")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}.")


def check_qkv_arrays(op: str, q: Any, k: Any, v: Any, *, q_doc: str, kv_doc: str) -> None:
    """An attention op's q, k, v: arrays of q's rank (`q_doc` spells q's shape, e.g.
    "[tokens, heads, head_dim]"; `kv_doc` k's), one float16 / bfloat16 / float32 dtype,
    v of k's shape, k's head_dim (last axis) q's, and the query heads (second-last axis)
    a multiple of the kv heads (GQA). Errors name `op` and the argument."""
    rank = len(q_doc.split(","))
    for name, x, doc in (("q", q, q_doc), ("k", k, kv_doc), ("v", v, kv_doc)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}.")
        if x.ndim != rank:
            raise ValueError(f"{op}: {name} must have shape {doc}, got {tuple(x.shape)}.")
        if jnp.dtype(x.dtype) not in ATTENTION_DTYPES:
            raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32, got {x.dtype}.")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{op}: q, k and v must share one dtype; q is {q.dtype} but {name} is {x.dtype}."
            )
    if k.shape[-1] != q.shape[-1]:  # first: a wrong k must not read as a wrong v
        raise ValueError(
            f"{op}: k's head_dim ({k.shape[-1]}) must equal q's head_dim ({q.shape[-1]})."
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{op}: v must have the shape of k {kv_doc}, got k {tuple(k.shape)} and v "
            f"{tuple(v.shape)}."
        )
    num_q_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    if num_kv_heads == 0:
        raise ValueError(
            f"{op}: k and v must have at least one head (num_kv_heads >= 1), got k "
            f"{tuple(k.shape)}."
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"{op}: q's num_q_heads ({num_q_heads}) must be a multiple of k's num_kv_heads "
            f"({num_kv_heads})."
        )


def check_bool(op: str, value: Any, name: str) -> bool:
    """A static switch (`causal`, `return_lse`, ...): a Python or NumPy bool, as a bool. A
    string or a number would be taken for its truthiness ("no" is true): a TypeError."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{op}: {name} must be a bool, got {value!r}.")
    return bool(value)


def check_per_head(op: str, x: Any, name: str, num_q_heads: int) -> jax.Array | None:
    """None, or a float array of one value per query head (`sinks`, `alibi_slopes`):
    shape [num_q_heads] (ValueError) and a float dtype (TypeError); errors name `op`."""
    if x is None:
        return None
    x = x if is_traced(x) else jnp.asarray(x)
    if x.shape != (num_q_heads,):
        raise ValueError(
            f"{op}: {name} must have shape [num_q_heads] = ({num_q_heads},), got {tuple(x.shape)}."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: {name} must have a float dtype, got {x.dtype}.")
    return x


def check_cu_seqlens(cu_seqlens: Any, name: str = "cu_seqlens") -> jax.Array:
    """Validate cumulative sequence lengths and return them as a JAX array.

    ``cu_seqlens: [batch + 1]`` integer offsets into a packed token axis, sequence ``i``
    occupying tokens ``[cu_seqlens[i], cu_seqlens[i + 1])``. Required:

    * rank 1 with at least one entry (``[0]`` is an empty batch) -> ValueError;
    * a signed integer dtype (float, bool or unsigned) -> TypeError;
    * ``cu_seqlens[0] == 0`` -> ValueError. A non-zero start would leave tokens
      ``[0, cu_seqlens[0])`` owned by no sequence; offset windows should slice the
      packed array instead;
    * non-decreasing (every length ``>= 0``; equal neighbours are empty sequences) ->
      ValueError.

    The value checks (start, monotonicity) raise immediately on concrete input and are
    ``checkify`` checks when traced (see module docstring).
    """
    if is_traced(cu_seqlens):
        cu = cu_seqlens
    else:
        cu = np.asarray(cu_seqlens)
    check_rank(cu, 1, name, "[batch + 1]")
    if cu.shape[0] < 1:
        raise ValueError(f"{name} must have at least one entry (a leading 0), got shape (0,).")
    # Signed, because derived index arrays use -1 as their fill value.
    check_integer_dtype(cu, name, signed=True)
    xp = _host_or_device(cu)
    require(cu[0] == 0, f"{name} must start at 0.")
    require(
        xp.all(cu[1:] >= cu[:-1]),
        f"{name} must be non-decreasing (every sequence length >= 0).",
    )
    return jnp.asarray(cu)


def check_cu_seqlens_and_host(
    cu_seqlens: Any, name: str = "cu_seqlens"
) -> tuple[jax.Array, np.ndarray | None]:
    """`check_cu_seqlens`'s array, and the input on the host where it is concrete
    (`host_value`: None where traced), which static sizes and immediate checks read."""
    return check_cu_seqlens(cu_seqlens, name), host_value(cu_seqlens)


def check_token_capacity(real_tokens: Any, total_tokens: int, name: str) -> None:
    """Require that ``real_tokens`` (``cu_seqlens[-1]``: an int, or a traced scalar) fit
    in ``total_tokens`` packed slots."""
    require(
        real_tokens <= total_tokens,
        f"{name}={total_tokens} is smaller than cu_seqlens[-1], the number of real tokens.",
    )


def check_lengths(lengths: Any, name: str = "lengths", max_len: int | None = None) -> jax.Array:
    """Validate per-sequence lengths ``[batch]``: integer, ``>= 0`` and ``<= max_len``."""
    arr = lengths if is_traced(lengths) else np.asarray(lengths)
    check_rank(arr, 1, name, "[batch]")
    check_integer_dtype(arr, name)
    xp = _host_or_device(arr)
    require(xp.all(arr >= 0), f"{name} must be >= 0.")
    if max_len is not None:
        require(xp.all(arr <= max_len), f"{name} must be <= {max_len}.")
    return jnp.asarray(arr)


def check_mask(mask: Any, name: str = "mask", shape: tuple[int, int] | None = None) -> jax.Array:
    """Validate a token mask ``[batch, seq]`` of bool or integer dtype (nonzero = real token)."""
    arr = mask if is_traced(mask) else np.asarray(mask)
    check_rank(arr, 2, name, "[batch, seq]")
    if not (arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise TypeError(f"{name} must be bool or integer (1 = real token), got {arr.dtype}.")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(arr.shape)}.")
    return jnp.asarray(arr)


_INT32 = np.iinfo(np.int32)


def as_int32(x: Any, name: str) -> jax.Array | np.ndarray:
    """Integer indices or sizes as int32, the kernels' index type.

    Python lists and int64 arrays (e.g. `jnp.cumsum` under x64) are converted when every
    value fits; a value that does not is a ValueError naming `name` (a checkify check
    when traced). Non-integer dtypes (float, bool) are a TypeError.
    """
    arr = x if is_traced(x) else np.asarray(x)
    if arr.dtype == np.bool_ or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers (int32), got dtype {arr.dtype}.")
    if arr.dtype == np.int32:
        return arr
    # Bounds in arr's own dtype, and only the sides int32 can overflow: a Python -2**31
    # against a traced unsigned array would wrap to 2**31 and fail every value.
    info = np.iinfo(arr.dtype)
    fits = []
    if info.min < _INT32.min:
        fits.append(arr >= np.asarray(_INT32.min, arr.dtype))
    if info.max > _INT32.max:
        fits.append(arr <= np.asarray(_INT32.max, arr.dtype))
    if fits:
        require_all(
            functools.reduce(operator.and_, fits), f"{name} holds values that do not fit int32."
        )
    return arr.astype(np.int32) if isinstance(arr, np.ndarray) else arr.astype(jnp.int32)


@contextlib.contextmanager
def naming_op(op: str, replacing: tuple[str, ...] = ()) -> Iterator[None]:
    """Within: a TypeError or ValueError from a shared check is re-raised naming `op`.

    Shared checks word their messages by argument (`group_sizes must ...`); the public op
    that called them prefixes its name, once, so the user sees which call was wrong; a
    message that names one of the ops in `replacing` (a public op `op` is built on) names
    `op` instead. Checks on traced values (`require`) put it in their message when traced.
    Subclasses (JAX's own: a tracer converted to a bool, ...) pass unchanged, with a note
    naming `op`; other errors untouched.
    """
    with _checking_ops((*_checking_ops.value, op)):
        try:
            yield
        except (TypeError, ValueError) as err:
            message = str(err)
            for inner in replacing:
                if message.startswith(f"{inner}:"):
                    message = f"{op}:{message[len(inner) + 1 :]}"
            if not message.startswith(f"{op}:"):
                message = f"{op}: {message}"
            if message == str(err):
                raise
            if type(err) in (TypeError, ValueError):
                raise type(err)(message) from None
            err.add_note(f"(raised within {op})")  # a subclass may not take a message alone
            raise


def calling_op(op: str) -> str:
    """The public op a user called: the outermost within `naming_op`, else `op`. An op
    built on another (flash_attention on varlen_attention) keeps it in the static half of
    the call, so that an error raised later, outside its call (a second derivative's,
    traced after the call returned), still names it."""
    return _checking_ops.value[0] if _checking_ops.value else op


def check_head_dim(op: str, head_dim: int, head_dims: tuple[int, int], implementation: str) -> None:
    """q's head_dim within the (smallest, largest) the chosen backend runs."""
    smallest, largest = head_dims
    if not smallest <= head_dim <= largest:
        raise ValueError(
            f"{op}: q's head_dim must be in [{smallest}, {largest}] for "
            f"implementation={implementation!r}, got {head_dim}."
        )
