"""What `compile` and `cycles` share: tracing for a target, and reading the compiled
program's text (our kernels, custom calls, collectives and `while` loops).

Both import it and neither imports the other's helpers, so the imports of the package
run one way: compile -> cycles -> common -> targets.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator

from jax_bridge.aot.targets import CompileTarget
from jax_bridge.core.backend import compiling_for_platform
from jax_bridge.launch.target import cuda_lowering

__all__ = ["COLLECTIVES", "KERNEL_CALLS", "parse_compiled_text", "tracing_for", "while_loops"]

# Custom calls that are kernels of ours (the rest are the compilers' own plumbing).
KERNEL_CALLS = ("tpu_custom_call", "triton_kernel_call", "__gpu$xla.gpu.triton")
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")

_CUSTOM_CALL = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*custom_call_target="([^"]+)"', re.MULTILINE)
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = \S+(?: \S+)*? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(",
    re.MULTILINE,
)
_WHILE = re.compile(r"^\s*(?:ROOT )?%\S+ = .* while\(.*$", re.MULTILINE)
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def parse_compiled_text(text: str) -> tuple[dict[str, int], tuple[str, ...], dict[str, int]]:
    """(custom calls by target, our kernels' instruction names, collectives by kind)."""
    calls = _CUSTOM_CALL.findall(text)
    counts = collections.Counter(target for _, target in calls)
    kernels = tuple(name for name, target in calls if target in KERNEL_CALLS)
    collectives = collections.Counter(_COLLECTIVE.findall(text))
    return dict(sorted(counts.items())), kernels, dict(sorted(collectives.items()))


def while_loops(text: str) -> list[str]:
    """The `while` loops of an optimized HLO text, each as its op name (the JAX function
    it came from) or, without one, its instruction. On a GPU XLA runs each with a host
    round trip an iteration (its condition read back to decide on the next)."""
    return [
        match.group(1) if (match := _OP_NAME.search(line)) else line.strip()
        for line in _WHILE.findall(text)
    ]


@contextlib.contextmanager
def tracing_for(target: CompileTarget) -> Iterator[None]:
    """Ops traced within pick the target's kernels and configurations."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(compiling_for_platform(target.platform))
        if target.compute_capability is not None:
            stack.enter_context(cuda_lowering(target.compute_capability))
        yield
