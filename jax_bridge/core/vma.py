"""Varying manual axes: what makes an op's loops and custom_vjp rules type-check inside
`jax.shard_map` with its default `check_vma=True`.

Inside `shard_map`, JAX types every value with the mesh axes along which it varies. A
`while_loop` whose carry starts as a constant (`jnp.zeros`, invariant) but is updated from
sharded inputs (varying) fails to type-check, and so does a custom_vjp backward whose
cotangent comes out of an opaque call (`pure_callback`, a Triton kernel) typed invariant
while its primal input varies. `varying_like` gives such values the axes of the arrays
they are computed from; outside `shard_map` it returns its argument unchanged.
"""

from __future__ import annotations

from typing import Any

import jax


def _vma(x: Any) -> frozenset[str]:
    """The manual mesh axes `x` varies along (jax 0.10 keeps them in `aval.mat.varying`,
    earlier releases in `aval.vma`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def varying_like(tree: Any, *like: Any) -> Any:
    """`tree` with every leaf marked varying along each manual axis any of `like` varies on.

    Args:
      tree: a pytree of arrays (None leaves are kept).
      like: arrays (or None) whose varying axes the result must carry.
    """
    axes = frozenset().union(*(_vma(x) for x in like if x is not None))
    if not axes:
        return tree

    def cast(leaf: Any) -> Any:
        missing = tuple(sorted(axes - _vma(leaf)))
        if not missing:
            return leaf
        if hasattr(jax.lax, "pcast"):  # jax >= 0.9
            return jax.lax.pcast(leaf, missing, to="varying")
        return jax.lax.pvary(leaf, missing)

    return jax.tree_util.tree_map(cast, tree)


def cotangent_like(cotangent: Any, primal: Any) -> Any:
    """`cotangent` typed as a custom_vjp backward must return it for `primal`.

    Missing varying axes are added (`varying_like`); axes the cotangent varies on but the
    primal does not are summed over (`psum`), as JAX's own transpose of the implicit
    broadcast of an invariant input does: e.g. replicated sinks used on sharded tokens.
    """
    if cotangent is None or primal is None:
        return cotangent
    extra = tuple(sorted(_vma(cotangent) - _vma(primal)))
    if extra:
        cotangent = jax.lax.psum(cotangent, extra)
    return varying_like(cotangent, primal)
