"""What every attention test shares: inputs, the tolerance table and the comparisons.

Tolerances (`TOLERANCES`, one row per input dtype, relative to the largest magnitude of
the reference array, applied to outputs and gradients alike):

    float32   1e-5    exact float32 products on every backend (Precision.HIGHEST, the
                      default); only the order of float32 sums differs.
    float16   2e-3    four units of roundoff (u = 2^-11 ~ 4.9e-4): one rounding of the
    bfloat16  1.6e-2  result to the input dtype, plus the kernels' roundings of the
                      probabilities / score gradients to the input dtype before the
                      tensor-core products (u = 2^-8 ~ 3.9e-3 for bfloat16).

The oracle always sees the same rounded 16-bit inputs, upcast to float32, so the table
measures the backend's own rounding only. The log-sum-exp is float32 on every backend and
its scores are exact products of the (rounded) inputs: `LSE_TOLERANCE` = 1e-5 for every
dtype. (Observed on the suite: at most about a third of each bound.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_bridge.attention.reference import allowed_mask

TOLERANCES = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1.6e-2,
}
LSE_TOLERANCE = 1e-5


def tolerance(dtype) -> float:
    return TOLERANCES[jnp.dtype(dtype)]


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
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(as_dtype)

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


def assert_close(actual, expected, tol: float, name: str = "") -> None:
    """|a - e| <= tol * (|e| + max|e|) elementwise, and `actual` finite everywhere.

    On failure the message names the worst element: its index, both values and its error
    in units of the allowed error.
    """
    actual, expected = _f32(actual), _f32(expected)
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
    assert ratio[worst] <= 1.0, (
        f"{name}: worst element {tuple(int(i) for i in worst)}: got {actual[worst]!r}, "
        f"expected {expected[worst]!r}, error {ratio[worst]:.3g}x the allowed "
        f"{tol:g} * (|expected| + {scale:.4g}); {int((ratio > 1).sum())} of {ratio.size} off"
    )


def assert_lse_close(actual, expected, name: str = "lse") -> None:
    """float32 log-sum-exp: -inf exactly where the oracle's is, close elsewhere."""
    actual, expected = np.asarray(actual), _f32(expected)
    assert actual.dtype == np.float32, f"{name}: dtype {actual.dtype}"
    assert not np.isnan(actual).any(), f"{name}: NaN (never written?)"
    np.testing.assert_array_equal(
        np.isneginf(actual), np.isneginf(expected), err_msg=f"{name}: -inf rows differ"
    )
    finite = np.isfinite(expected)
    assert_close(actual[finite], expected[finite], LSE_TOLERANCE, name)


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


def dense_segment_attention(q, k, v, q_ids, kv_ids, causal=False, **kwargs):
    """jax.nn.dot_product_attention with the equivalent dense mask; padding rows -> 0.

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
    out = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)[:, None], **kwargs)
    return jnp.where(jnp.asarray(mask.any(-1))[:, :, None, None], out, 0.0)


def padded_inputs(seed, batch, q_seq, kv_seq, num_q_heads, num_kv_heads, head_dim=32):
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q = draw(batch, q_seq, num_q_heads, head_dim)
    k = draw(batch, kv_seq, num_kv_heads, head_dim)
    v = draw(batch, kv_seq, num_kv_heads, head_dim)
    return q, k, v, draw(*q.shape)
