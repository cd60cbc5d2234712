"""What every attention test shares: inputs, the float64 oracle, the tolerances and the
comparisons.

The oracle (`oracle_value_and_grads`) runs the dense reference in float64 on the same
(rounded) inputs, so its own rounding is negligible and the comparison measures the
backend's error alone; the tolerance must then bound that error on every machine and BLAS
build (the Triton interpreter multiplies with numpy's BLAS, XLA:CPU with its own kernels:
any summation order, FMA or not).

Tolerance (`attention_tolerance`), relative to `|expected| + max|expected|` of each array
(outputs, lse and gradients alike):

    float32   C * u * (S + sqrt(L)),  u = 2^-24, C = 8
    16-bit    that plus TOLERANCES[dtype] (float16 2e-3, bfloat16 1.6e-2: four units of
              roundoff of the dtype: the result's rounding plus the kernels' roundings of
              probabilities and score gradients to the input dtype before the products)

S bounds every exponent the softmax evaluates, `|scale| * max |q.k|` over all query/key
pairs of a head (plus the largest |sink| and ALiBi bias): scores, their running max and
log-sum-exp are float32 numbers of that size, so each probability exp(s - lse) carries a
relative error of a few u * S whatever the order of operations (scaling, the log2(e)
multiply, the max subtraction, exp2: about four roundings of numbers up to S). L, the
longest reduction (head dim, keys per query, queries per key), sets the sums' own
rounding: u * L in the worst case, but for sums of terms of either sign in any order
(blocked BLAS kernels, FMA or not) the error stays below a small multiple of
u * sqrt(L) with overwhelming probability (Higham and Mary's probabilistic bound), which
C covers.
The output and lse take those errors once, the gradients through dS = P * (dP - delta) and
one more sum about twice: C = 8 covers both with room for a factor two. The issue this
came from: |q.k| in the hundreds made a fixed 1e-4 fail on one OpenBLAS kernel; with S in
the bound such a problem gets the tolerance its scores call for (~6e-4), and ordinary
ones (S ~ 5, L ~ 40) keep ~5e-6. Margins observed (tests/margins.py): at most ~0.15.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention.reference import allowed_mask
from tests import margins

TOLERANCES = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1.6e-2,
}
U32 = 2.0**-24  # float32 unit roundoff
C = 8  # see the module docstring: the gradients' chain, with a factor two to spare


def tolerance(dtype) -> float:
    """The 16-bit part of the tolerance: TOLERANCES[dtype] (0 for float32)."""
    dtype = jnp.dtype(dtype)
    return 0.0 if dtype == jnp.float32 else TOLERANCES[dtype]


def score_bound(q, k, softmax_scale=None, sinks=None, slopes=None) -> float:
    """S: the largest |exponent| the softmax of q [Tq, Hq, D] against k [Tk, Hkv, D]
    can see: |scale| * max |q.k| over every (query, key) pair of every head (documents
    and masks ignored: an upper bound), plus max |finite sink| and max slope * the
    longest ALiBi distance."""
    q64, k64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k))
    head_dim, group = q64.shape[-1], q64.shape[1] // k64.shape[1]
    scale = head_dim**-0.5 if softmax_scale is None else abs(float(softmax_scale))
    largest = 0.0
    for h in range(k64.shape[1]):
        qs = q64[:, h * group : (h + 1) * group].reshape(-1, head_dim)
        if qs.size and k64.shape[0]:
            largest = max(largest, float(np.abs(qs @ k64[:, h].T).max()))
    bound = scale * largest
    if sinks is not None:
        finite = np.asarray(sinks, np.float64)
        bound += float(np.abs(finite[np.isfinite(finite)]).max(initial=0.0))
    if slopes is not None:
        bound += float(np.abs(np.asarray(slopes)).max()) * max(q64.shape[0], k64.shape[0])
    return bound


def attention_tolerance(q, k, dtype=None, cu_q=None, cu_k=None, **bound_args) -> float:
    """C * u * (S + sqrt(L)) + TOLERANCES[dtype] (see the module docstring); `bound_args` are
    `score_bound`'s. dtype defaults to q's. L is the head dim or the longest document
    (from cu_q / cu_k; without them every row counts, an upper bound)."""
    lengths = [q.shape[0] if cu_q is None else np.diff(np.asarray(cu_q)).max(initial=0)]
    lengths.append(k.shape[0] if cu_k is None else np.diff(np.asarray(cu_k)).max(initial=0))
    longest = max(q.shape[-1], *(int(n) for n in lengths))
    rounding = C * U32 * (score_bound(q, k, **bound_args) + np.sqrt(longest))
    return rounding + tolerance(q.dtype if dtype is None else dtype)


def cu_seqlens(lengths) -> np.ndarray:
    """int32 [len(lengths) + 1]: the packed offsets of sequences of `lengths`."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def make_inputs(
    seed: int,
    lengths,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    pad: tuple[int, int] = (0, 0),
) -> dict:
    """Fresh standard-normal inputs for per-sequence (len_q, len_k) `lengths`.

    `pad` = (query rows, key rows) of packing after cu_seqlens[-1]: random values too, so
    that only the semantics (they belong to no sequence) can make them vanish. Returns
    q, k, v (in `dtype`), cu_q, cu_k (numpy int32), float32 sinks and ALiBi slopes, and
    float32 cotangents d_out [total_q, Hq, D] and d_lse [Hq, total_q].
    """
    rng = np.random.default_rng(seed)
    cu_q = cu_seqlens([lq for lq, _ in lengths])
    cu_k = cu_seqlens([lk for _, lk in lengths])
    total_q, total_k = int(cu_q[-1]) + pad[0], int(cu_k[-1]) + pad[1]

    def draw(*shape, as_dtype=dtype):
        # Rounded by numpy (ml_dtypes: to nearest even, as XLA): no program to compile.
        return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(as_dtype))

    return dict(
        q=draw(total_q, num_q_heads, head_dim),
        k=draw(total_k, num_kv_heads, head_dim),
        v=draw(total_k, num_kv_heads, head_dim),
        cu_q=cu_q,
        cu_k=cu_k,
        sinks=draw(num_q_heads, as_dtype=jnp.float32),
        slopes=jnp.asarray(rng.uniform(0.02, 0.4, num_q_heads), jnp.float32),
        # Rounded to the input dtype: the cotangent a 16-bit output receives.
        d_out=draw(total_q, num_q_heads, head_dim).astype(jnp.float32),
        d_lse=draw(num_q_heads, total_q, as_dtype=jnp.float32),
    )


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)  # exact for 16-bit values too (ml_dtypes)


def assert_close(actual, expected, tol: float, name: str = "") -> None:
    """|a - e| <= tol * (|e| + max|e|) elementwise, and `actual` finite everywhere.

    On failure the message names the worst element: its index, both values and its error
    in units of the allowed error.
    """
    actual, expected = _f64(actual), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    bad = ~np.isfinite(actual)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} non-finite element(s), first at "
        f"{tuple(int(i) for i in np.argwhere(bad)[0])} (never written?)"
    )
    if actual.size == 0:
        return
    scale = float(np.max(np.abs(expected))) or 1.0
    allowed = tol * (np.abs(expected) + scale)
    ratio = np.abs(actual - expected) / allowed
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    margins.record(name, ratio[worst])
    assert ratio[worst] <= 1.0, (
        f"{name}: worst element {tuple(int(i) for i in worst)}: got {actual[worst]!r}, "
        f"expected {expected[worst]!r}, error {ratio[worst]:.3g}x the allowed "
        f"{tol:g} * (|expected| + {scale:.4g}); {int((ratio > 1).sum())} of {ratio.size} off"
    )


def assert_equal_to_rounding(actual, expected, name: str = "") -> None:
    """Equal bit for bit on a CPU; on an accelerator, but for a few roundings in the
    arrays' dtype, non-finite exactly where the other is: two builds of one kernel (one
    with an option that adds a select, a CAREFUL relaunch) may contract a multiply-add
    differently on a GPU."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"{name}: NaN")
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=name)
    assert_close(actual[finite], expected[finite], 8 * float(jnp.finfo(expected.dtype).eps), name)


def assert_lse_close(actual, expected, tol: float, name: str = "lse") -> None:
    """float32 log-sum-exp: -inf exactly where the oracle's is, close elsewhere."""
    actual, expected = np.asarray(actual), _f32(expected)
    assert actual.dtype == np.float32, f"{name}: dtype {actual.dtype}"
    assert not np.isnan(actual).any(), f"{name}: NaN (never written?)"
    np.testing.assert_array_equal(
        np.isneginf(actual), np.isneginf(expected), err_msg=f"{name}: -inf rows differ"
    )
    finite = np.isfinite(expected)
    assert_close(actual[finite], expected[finite], tol, name)


def unattended(cu_q, cu_k, total_q: int, total_k: int, spec) -> tuple[np.ndarray, np.ndarray]:
    """(query rows that see no key [total_q], key rows no query sees [total_k]) under `spec`."""
    allowed = allowed_mask(cu_q, cu_k, total_q, total_k, spec)
    return ~allowed.any(axis=1), ~allowed.any(axis=0)


def upcast(x):
    return None if x is None else jnp.asarray(x).astype(jnp.float32)


def value_and_grads(fn, q, k, v, sinks, d_out, d_lse=None):
    """(out, lse, grads) of `fn(q, k, v, sinks) -> (out, lse)` in one jitted call.

    The loss is sum(out * d_out), plus sum(lse * d_lse) over finite lse when `d_lse` is
    given (without it the lse cotangent is a symbolic zero). grads: dq, dk, dv and, with
    sinks, d_sinks.
    """

    def loss(q, k, v, sinks):
        out, lse = fn(q, k, v, sinks)
        value = jnp.sum(out.astype(jnp.float32) * d_out)
        if d_lse is not None:
            value += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return value, (out, lse)

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    return out, lse, grads


def oracle_value_and_grads(fn, q, k, v, sinks, d_out, d_lse=None):
    """`value_and_grads` of the oracle `fn` in float64: every input (16-bit ones as their
    exact values) upcast under `jax.enable_x64`; results as float64 numpy arrays (the lse
    as `fn` returns it, float32, then widened: its rounding is u * |lse|, within every
    tolerance)."""
    with jax.enable_x64(True):
        wide = lambda x: None if x is None else jnp.asarray(_f64(x))
        out, lse, grads = value_and_grads(
            fn, wide(q), wide(k), wide(v), wide(sinks), wide(d_out), wide(d_lse)
        )
        as64 = lambda x: np.asarray(x, np.float64)
        return as64(out), as64(lse), tuple(as64(g) for g in grads)


def exact_dot_product_attention(*args, **kwargs):
    """jax.nn.dot_product_attention with float32 products: at default precision a GPU
    multiplies float32 in TF32 (about 1e-3 relative), far from the bounds the tests hold
    the kernels to. The precision is fixed when each dot is traced, so the gradients'
    dots (traced from the forward's) keep it too."""
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(*args, **kwargs)


def dense_segment_attention(q, k, v, q_ids, kv_ids, causal=False, **kwargs):
    """`exact_dot_product_attention` with the equivalent dense mask; padding rows -> 0.

    `causal` builds the per-document mask with bottom-right alignment: the document's
    query t (of n) may see its key u (of m) when u <= t + m - n.
    """
    mask = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] > 0)
    if causal:

        def rank_and_count(ids):  # position within the document and document length
            same = ids[:, :, None] == ids[:, None, :]
            before = np.tril(np.ones((ids.shape[1],) * 2, bool), -1)
            return (same & before).sum(-1), same.sum(-1)

        qt, qn = rank_and_count(q_ids)
        ku, km = rank_and_count(kv_ids)
        mask &= ku[:, None, :] <= qt[:, :, None] + km[:, None, :] - qn[:, :, None]
    out = exact_dot_product_attention(q, k, v, mask=jnp.asarray(mask)[:, None], **kwargs)
    return jnp.where(jnp.asarray(mask.any(-1))[:, :, None, None], out, 0.0)


def padded_inputs(seed, batch, q_seq, kv_seq, num_q_heads, num_kv_heads, head_dim=32):
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32))

    q = draw(batch, q_seq, num_q_heads, head_dim)
    k = draw(batch, kv_seq, num_kv_heads, head_dim)
    v = draw(batch, kv_seq, num_kv_heads, head_dim)
    return q, k, v, draw(*q.shape)
