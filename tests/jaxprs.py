"""Walking a jaxpr with the jaxprs nested in it (loops, branches, jit, custom_vjp, Pallas
kernels), for tests that assert on every value or equation a program holds."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.extend.core


def _jaxprs_in_params(params):
    # jax >= 0.9 has it in jax.extend.core; the package allows jax 0.8.2.
    find = getattr(jax.extend.core, "jaxprs_in_params", None) or jax.core.jaxprs_in_params
    return find(params)


def all_jaxprs(jaxpr: jax.extend.core.Jaxpr) -> Iterator[jax.extend.core.Jaxpr]:
    """`jaxpr` and every jaxpr nested in its equations' parameters, depth first."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for inner in _jaxprs_in_params(eqn.params):
            yield from all_jaxprs(inner)


def all_eqns(jaxpr: jax.extend.core.Jaxpr) -> Iterator[jax.extend.core.JaxprEqn]:
    """Every equation of `jaxpr` and of the jaxprs nested in it."""
    for inner in all_jaxprs(jaxpr):
        yield from inner.eqns


def dot_precisions(jaxpr: jax.extend.core.Jaxpr) -> list:
    """The `precision` of every dot_general in `jaxpr` and the jaxprs nested in it."""
    return [e.params["precision"] for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
