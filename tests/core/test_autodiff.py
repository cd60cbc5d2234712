"""Forward-mode autodiff of the custom_vjp ops: a refusal that names the op.

`jax.jvp`, `jax.jacfwd` and `jax.hessian` (jacfwd of jacrev) used to fail with JAX's
generic "can't apply forward-mode autodiff (jvp) to a custom_vjp function". Each op now
raises a NotImplementedError naming it and saying what works; grouped matmul's
second derivative by reverse mode (`jacrev(jacrev)`, the documented Hessian) matches
JAX's Hessian of the dense reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import (
    block_sparse_attention,
    flash_attention,
    grouped_matmul,
    grouped_matmul_reference,
    transposed_grouped_matmul,
    varlen_attention,
)
from pallas_tpu.splash import CausalMask


def _normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_attention_forward_mode_is_refused_naming_the_op():
    q, k, v = _normal(0, 12, 2, 16), _normal(1, 12, 1, 16), _normal(2, 12, 1, 16)
    cu = np.array([0, 5, 12], np.int32)
    varlen = lambda q: varlen_attention(q, k, v, cu, cu, implementation="xla")
    for transform in (lambda f: jax.jvp(f, (q,), (q,)), lambda f: jax.jacfwd(f)(q)):
        with pytest.raises(NotImplementedError, match=r"varlen_attention: forward-mode.*jax\.grad"):
            transform(varlen)
    padded = lambda q: flash_attention(q, k[None], v[None], implementation="xla")
    with pytest.raises(NotImplementedError, match="flash_attention: forward-mode"):
        jax.jvp(padded, (q[None],), (q[None],))


def test_block_sparse_forward_mode_is_refused_naming_the_op():
    q, k, v = _normal(4, 1, 16, 2, 8), _normal(5, 1, 16, 2, 8), _normal(6, 1, 16, 2, 8)
    attend = lambda q: block_sparse_attention(q, k, v, CausalMask((16, 16)), implementation="xla")
    with pytest.raises(NotImplementedError, match="block_sparse_attention: forward-mode"):
        jax.jvp(attend, (q,), (q,))
    with pytest.raises(NotImplementedError, match="block_sparse_attention: forward-mode"):
        jax.hessian(lambda q: jnp.sum(jnp.sin(attend(q))))(q)


def _gmm_problem(seed: int = 3):
    sizes = jnp.asarray([3, 0, 4], jnp.int32)
    return _normal(seed, 8, 3), _normal(seed + 1, 3, 3, 2), sizes


def test_grouped_matmul_forward_mode_is_refused_naming_the_op():
    lhs, rhs, sizes = _gmm_problem()
    gmm = lambda lhs: grouped_matmul(lhs, rhs, sizes, implementation="xla")
    with pytest.raises(NotImplementedError, match=r"grouped_matmul: forward-mode.*jacrev"):
        jax.jvp(gmm, (lhs,), (lhs,))
    tgmm = lambda rhs2: transposed_grouped_matmul(lhs.T, rhs2, sizes, implementation="xla")
    with pytest.raises(NotImplementedError, match="transposed_grouped_matmul: forward-mode"):
        jax.jvp(tgmm, (lhs,), (lhs,))
    # jax.hessian is jacfwd over jacrev: the tangent reaches the op inside the gradient.
    loss = lambda lhs: jnp.sum(jnp.sin(gmm(lhs)))
    with pytest.raises(NotImplementedError, match="grouped_matmul: forward-mode"):
        jax.hessian(loss)(lhs)


def test_grouped_matmul_hessian_by_reverse_mode_matches_the_reference():
    lhs, rhs, sizes = _gmm_problem(5)

    def loss(op, lhs, rhs):
        return jnp.sum(jnp.sin(op(lhs, rhs, sizes)))

    ours = lambda lhs, rhs, sizes: grouped_matmul(lhs, rhs, sizes, implementation="xla")
    got = jax.jacrev(jax.jacrev(lambda *a: loss(ours, *a), (0, 1)), (0, 1))(lhs, rhs)
    with jax.enable_x64(True):
        wide = lambda x: jnp.asarray(np.asarray(x, np.float64))
        want = jax.hessian(lambda *a: loss(grouped_matmul_reference, *a), (0, 1))(
            wide(lhs), wide(rhs)
        )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # float32 products of O(1) values over k = 3 terms, then sin/cos: ~1e-6 absolute.
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5)
