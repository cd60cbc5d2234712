"""Methods of Triton's interpreter builder swapped for as long as a launch runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from triton.runtime import interpreter as triton_interpreter


@contextlib.contextmanager
def builder_patched(patches: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Within: `InterpreterBuilder`'s methods named in `patches` are those given (a name
    it lacks is added); on exit each is restored, or removed where it was added."""
    builder = triton_interpreter.InterpreterBuilder
    saved = {name: vars(builder).get(name) for name in patches}
    for name, patched in patches.items():
        setattr(builder, name, patched)
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(builder, name)
            else:
                setattr(builder, name, original)
