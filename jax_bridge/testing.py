"""Helpers that users and the project's tests share: random attention inputs in both
layouts, an `assert_allclose` that says where and how badly arrays differ, a device-synced
`timer`, and `get_memory_usage`.

    inputs = generate_attention_inputs(2, 128, 8, 64, jnp.bfloat16, 0, num_kv_heads=2,
                                       layout="packed")
    out = varlen_attention(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens, inputs.cu_seqlens)
    assert_allclose(out, attention_reference(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens,
                                             inputs.cu_seqlens), rtol=2e-2, atol=2e-2)

Imports only jax and numpy (no test framework), so it is safe to use from user code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "AttentionInputs",
    "Timer",
    "assert_allclose",
    "generate_attention_inputs",
    "get_memory_usage",
    "random_document_lengths",
    "timer",
]

Layout = Literal["padded", "packed"]


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Random attention inputs and their document metadata, in one of two layouts.

    packed (`varlen_attention`): q [batch * seq_len, num_heads, head_dim]; k, v
      [batch * seq_len, num_kv_heads, head_dim]; `cu_seqlens` int32 [num_docs + 1] with
      0 = cu[0] < cu[1] < ... < cu[-1] = batch * seq_len (every document non-empty);
      `segment_ids` is None.
    padded (`flash_attention`): q [batch, seq_len, num_heads, head_dim]; k, v
      [batch, seq_len, num_kv_heads, head_dim]; `segment_ids` int32 [batch, seq_len]:
      documents numbered 1, 2, ... from the start of each row, then 0 for padding (only at
      the end of a row); `cu_seqlens` is None.

    `max_seqlen` is the longest document's length (a Python int), `num_docs` the number of
    documents over the whole batch.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    layout: Layout
    max_seqlen: int
    num_docs: int
    cu_seqlens: jax.Array | None = None
    segment_ids: jax.Array | None = None


def random_document_lengths(rng: np.random.Generator, total: int, num_docs: int) -> np.ndarray:
    """int32 [num_docs] positive lengths summing to `total`, cut at distinct random points
    (uneven, as packed real documents are). Needs 1 <= num_docs <= total."""
    if not 1 <= num_docs <= total:
        raise ValueError(f"need 1 <= num_docs <= total, got num_docs={num_docs}, total={total}")
    # num_docs - 1 distinct cuts in [1, total): consecutive differences are all >= 1.
    cuts = np.sort(rng.choice(np.arange(1, total), num_docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _host_rng(key: jax.Array) -> np.random.Generator:
    """A numpy generator seeded from a JAX key: the metadata are host data, drawn there."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(key) if typed else key  # raw uint32 keys are their own data
    return np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist())


def _padded_segment_ids(
    rng: np.random.Generator, batch: int, seq_len: int, docs_per_sequence: int, padding: bool
) -> np.ndarray:
    """int32 [batch, seq_len]: per row `docs_per_sequence` documents numbered from 1, then
    zeros. With `padding` each row keeps a random length in [docs_per_sequence, seq_len]."""
    ids = np.zeros((batch, seq_len), np.int32)
    for row in range(batch):
        valid = int(rng.integers(docs_per_sequence, seq_len + 1)) if padding else seq_len
        lengths = random_document_lengths(rng, valid, docs_per_sequence)
        ids[row, :valid] = np.repeat(np.arange(1, docs_per_sequence + 1, dtype=np.int32), lengths)
    return ids


def _normal_qkv(
    key: jax.Array,
    lead: tuple[int, ...],
    heads: tuple[int, int],
    head_dim: int,
    dtype: Any,
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [*lead, heads[0], head_dim], k and v [*lead, heads[1], head_dim]: one normal draw
    split three ways (one random-number program per shape, not three)."""
    q_heads, kv_heads = heads
    draw = scale * jax.random.normal(key, (*lead, q_heads + 2 * kv_heads, head_dim), jnp.float32)
    splits = (q_heads, q_heads + kv_heads)
    return tuple(part.astype(dtype) for part in jnp.split(draw, splits, axis=-2))


def generate_attention_inputs(
    batch: int,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    key: jax.Array | int = 0,
    *,
    num_kv_heads: int | None = None,
    layout: Layout = "padded",
    docs_per_sequence: int = 1,
    padding: bool = False,
    scale: float = 1.0,
) -> AttentionInputs:
    """Random q, k, v (standard normal times `scale`, in `dtype`) and document metadata.

    Args:
      batch, seq_len: packed: `batch * seq_len` tokens in all; padded: the leading shape.
      num_heads: query heads; `num_kv_heads` (default: num_heads) must divide it (GQA).
      dtype: of q, k and v (drawn in float32, then cast).
      key: a JAX PRNG key or an int seed; the same key gives the same inputs.
      layout: "packed" (FlashAttention varlen) or "padded" (see `AttentionInputs`).
      docs_per_sequence: documents per `seq_len` tokens: packed, `batch * docs_per_sequence`
        documents of random positive lengths summing to `batch * seq_len`; padded, that
        many documents per row.
      padding: padded layout only: rows end in a random amount of padding (id 0).

    Runs eagerly (not under `jax.jit`): the metadata are concrete host values.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    sizes = {"batch": batch, "seq_len": seq_len, "num_heads": num_heads, "head_dim": head_dim}
    sizes |= {"num_kv_heads": num_kv_heads, "docs_per_sequence": docs_per_sequence}
    if bad := {k: n for k, n in sizes.items() if not (isinstance(n, numbers.Integral) and n >= 1)}:
        raise ValueError(f"sizes must be positive ints, got {bad}")
    batch, seq_len, num_heads, head_dim = (int(n) for n in (batch, seq_len, num_heads, head_dim))
    num_kv_heads, docs_per_sequence = int(num_kv_heads), int(docs_per_sequence)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    if docs_per_sequence > seq_len:
        raise ValueError(f"docs_per_sequence={docs_per_sequence} > seq_len={seq_len}")
    key = jax.random.key(int(key)) if isinstance(key, numbers.Integral) else key
    data_key, meta_key = jax.random.split(key)
    rng = _host_rng(meta_key)
    lead = (batch * seq_len,) if layout == "packed" else (batch, seq_len)
    q, k, v = _normal_qkv(data_key, lead, (num_heads, num_kv_heads), head_dim, dtype, scale)
    if layout == "packed":
        lengths = random_document_lengths(rng, batch * seq_len, batch * docs_per_sequence)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return AttentionInputs(
            q, k, v, layout, int(lengths.max()), len(lengths), cu_seqlens=jnp.asarray(cu_seqlens)
        )
    ids = _padded_segment_ids(rng, batch, seq_len, docs_per_sequence, padding)
    lengths = np.stack([np.bincount(row, minlength=docs_per_sequence + 1)[1:] for row in ids])
    return AttentionInputs(
        q, k, v, layout, int(lengths.max()), batch * docs_per_sequence, segment_ids=jnp.asarray(ids)
    )


# ---------------------------------------------------------------------- assert_allclose


def _as_numpy(x: Any) -> np.ndarray:
    """float64 (complex128 for complex) numpy copy: 16-bit floats compare exactly there."""
    array = np.asarray(x)
    return array.astype(np.complex128 if np.iscomplexobj(array) else np.float64)


def assert_allclose(
    actual: Any, expected: Any, *, rtol: float, atol: float, err_msg: str = ""
) -> None:
    """Raises AssertionError unless |actual - expected| <= atol + rtol * |expected| everywhere.

    Shapes must be equal. NaN must meet NaN (NaN against a number fails, both ways); an
    infinity must meet the same infinity. The message names how many elements fail (and how
    many of them are NaN mismatches), the worst one's index, both values and its absolute
    and relative errors: the worst is the element furthest past its tolerance, a NaN
    mismatch first.
    """
    raw_a, raw_e = np.asarray(actual), np.asarray(expected)
    a, e = _as_numpy(raw_a), _as_numpy(raw_e)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: actual {a.shape}, expected {e.shape}. {err_msg}")
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(a - e)  # NaN where either is NaN or where inf meets inf
        allowed = atol + rtol * np.abs(e)
        if raw_a.dtype.kind in "biu" and raw_e.dtype.kind in "biu":
            # float64 holds integers exactly only up to 2**53: compare Python ints (an int
            # against a float tolerance compares exactly too).
            exact = np.abs(raw_a.astype(object) - raw_e.astype(object))
            close = np.asarray(exact <= allowed, bool).reshape(a.shape)
        else:
            # Exact equality covers equal infinities; the tolerance applies to finite pairs
            # only (inf <= inf would pass -inf against inf); NaN compares False.
            finite = np.isfinite(a) & np.isfinite(e)
            close = (a == e) | (nan_a & nan_e) | (finite & (error <= allowed))
    failing = ~close
    count = int(failing.sum())
    if count == 0:
        return
    nan_mismatch = nan_a != nan_e
    if nan_mismatch.any():  # the worst of all: report the first one
        flat = int(np.argmax(nan_mismatch))
    else:  # the element furthest past its tolerance (an infinite error included)
        # Ranked by error over tolerance, then by the error itself: with a zero tolerance
        # every ratio is inf, and the largest error must still win.
        with np.errstate(divide="ignore", invalid="ignore"):
            excess = np.where(failing, np.nan_to_num(error / allowed, nan=np.inf), -np.inf)
            size = np.where(failing, np.nan_to_num(error, nan=np.inf), -np.inf)
        flat = int(np.lexsort((size.ravel(), excess.ravel()))[-1])
    worst = np.unravel_index(flat, a.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = error[worst] / np.abs(e[worst])
    raise AssertionError(
        f"Not equal to tolerance rtol={rtol:g}, atol={atol:g}: {count} of {a.size} elements "
        f"({100 * count / a.size:.3g}%) differ, {int(nan_mismatch.sum())} of them NaN "
        f"mismatches\nworst at index {tuple(int(i) for i in worst)}: actual "
        f"{a[worst].item()!r}, expected {e[worst].item()!r}, abs error {error[worst]:.6g}, "
        f"rel error {relative:.6g}" + (f"\n{err_msg}" if err_msg else "")
    )


# ------------------------------------------------------------------------------ timer


class Timer:
    """The clock of one `timer()` block. `seconds` is readable after the block ends."""

    def __init__(self) -> None:
        self._pending: list[Any] = []
        self._seconds: float | None = None

    def block_on(self, *values: Any) -> Any:
        """Registers values (any pytrees of arrays) whose computation the block's time
        includes: the clock stops only when they are ready. Returns its argument (one value)
        or the tuple of them."""
        self._pending.extend(values)
        return values[0] if len(values) == 1 else values

    @property
    def seconds(self) -> float:
        if self._seconds is None:
            raise RuntimeError("Timer.seconds is set when the `with timer()` block ends")
        return self._seconds


@contextlib.contextmanager
def timer(*inputs: Any) -> Iterator[Timer]:
    """Wall seconds of a block, with JAX's asynchronous dispatch accounted for.

        with timer(x) as t:
            y = t.block_on(f(x))
        print(t.seconds)

    `inputs` are made ready before the clock starts (their computation is not timed). At
    the end of the block the clock stops after `jax.block_until_ready` on every value
    passed to `t.block_on`; when none were, after `jax.effects_barrier()`, which waits for
    pending side effects only (hand results to `block_on` for an exact time).
    """
    jax.block_until_ready(inputs)
    clock = Timer()
    start = time.perf_counter()
    yield clock
    if clock._pending:
        jax.block_until_ready(clock._pending)
    else:
        jax.effects_barrier()
    clock._seconds = time.perf_counter() - start


# ----------------------------------------------------------------------- memory usage


def _host_memory() -> dict[str, int]:
    """This process's resident memory in bytes: current and peak from /proc on Linux, the
    peak from getrusage elsewhere (kilobytes on Linux, bytes on macOS)."""
    usage: dict[str, int] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM"):  # "  123456 kB"
                    key = "host_rss_bytes" if name == "VmRSS" else "host_peak_rss_bytes"
                    usage[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "host_peak_rss_bytes" not in usage:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        usage["host_peak_rss_bytes"] = peak if sys.platform == "darwin" else peak * 1024
    return usage


def get_memory_usage(device: jax.Device | None = None) -> dict[str, int]:
    """Memory figures in bytes for `device` (default: the first JAX device).

    Where the backend reports them (GPU, TPU), the device's `memory_stats()`: e.g.
    `bytes_in_use`, `peak_bytes_in_use`, `bytes_limit`. Otherwise (the CPU backend has
    none) this process's resident memory: `host_rss_bytes` (where /proc exists) and
    `host_peak_rss_bytes`. The keys say which one you got.
    """
    device = jax.devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):  # some backends raise instead of None
        stats = None
    if stats:
        return {name: int(value) for name, value in stats.items() if isinstance(value, int)}
    return _host_memory()
