"""`KernelConfig`: the base of every kernel's launch configuration.

A config is a frozen (hashable) dataclass of block sizes, `num_warps` and `num_stages`.
The rules every Triton kernel here shares are checked once, in this base: each field
named `block_*` is a power of two of at least `MIN_BLOCK` (tl.dot's smallest operand
dimension), `num_warps` a power of two up to 16 and `num_stages` a positive int.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

MIN_BLOCK = 16
NUM_WARPS = (1, 2, 4, 8, 16)


def check_block(size: Any, name: str) -> int:
    """`size` if it is a power of two >= MIN_BLOCK; TypeError/ValueError naming `name`."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"{name} must be an int, got {size!r}.")
    if size < MIN_BLOCK or size & (size - 1):
        raise ValueError(
            f"{name} must be a power of two >= {MIN_BLOCK} (a Triton block), got {size}."
        )
    return size


def multiplies_by_mma_sync(compute_capability: int | None, rows: int | None = None) -> bool:
    """Whether Triton lowers `tl.dot` to mma.sync on `compute_capability`: sm_80-89 and
    sm_120 and up; on sm_90-119 (wgmma on sm_90, tcgen05 from sm_100) a product of fewer
    than 64 `rows` too (they take 64 or more; None: as many). None for the GPU (none
    named) counts as mma.sync, whose pipelines keep the fewer buffers."""
    if compute_capability is None or not 90 <= compute_capability < 120:
        return True
    return rows is not None and rows < 64


def pipeline_buffers(
    num_stages: int, compute_capability: int | None, rows: int | None = None
) -> int:
    """The operand tiles a loop of `num_stages` stages keeps in shared memory, as Triton
    (3.6 and 3.9) allocates them: as many where its MMAs read shared memory
    asynchronously (wgmma, tcgen05), one fewer where they multiply by mma.sync
    (`multiplies_by_mma_sync` of `compute_capability` and the products' `rows`). There 2
    stages are one buffer whose copy each step awaits before its MMAs (TTGIR:
    `async_wait` of 0 outstanding copies), so no load is in flight beside them; 3 stages
    keep one step's copy in flight. (On sm_90 float32's FMA loops keep one fewer too, 3
    buffers at 4 stages: counting one a stage there overestimates, so their stages still
    fit.)"""
    if multiplies_by_mma_sync(compute_capability, rows):
        return max(1, num_stages - 1)
    return num_stages


def descriptor_type(element: str, block_shape: Sequence[int]) -> str:
    """A Triton signature's tensor-descriptor type of `element`s (Triton's name: "bf16")
    and `block_shape`, e.g. `tensordesc<bf16[128, 64]>`: a kernel parameter that the
    launch passes as a descriptor (`jax_bridge.launch.host_descriptors`)."""
    return f"tensordesc<{element}[{', '.join(map(str, block_shape))}]>"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base of the kernels' launch configurations; subclasses declare the fields.

    Subclasses are frozen dataclasses with `block_*` fields, `num_warps` and
    `num_stages`, and optionally options declared `bool` (among them `tma` and
    `warp_specialize`, which needs `tma` and 4 warps); `__post_init__` validates them all.
    """

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for field in dataclasses.fields(self):
            if field.name.startswith("block_"):
                check_block(getattr(self, field.name), f"{kind}.{field.name}")
            # Declared `bool` (a string under postponed annotations): a bool it must be.
            value = getattr(self, field.name)
            if field.type in (bool, "bool") and not isinstance(value, bool):
                raise TypeError(f"{kind}.{field.name} must be a bool, got {value!r}.")
        num_warps, num_stages = getattr(self, "num_warps", 4), getattr(self, "num_stages", 1)
        for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
            # 4.0 == 4, but Triton's launch takes ints only.
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{kind}.{name} must be an int, got {value!r}.")
        if num_warps not in NUM_WARPS:
            raise ValueError(f"{kind}.num_warps must be one of {NUM_WARPS}, got {num_warps!r}.")
        if num_stages < 1:
            raise ValueError(f"{kind}.num_stages must be an int >= 1, got {num_stages!r}.")
        if getattr(self, "warp_specialize", False) and not (self.tma and num_warps == 4):
            raise ValueError(
                f"{kind}.warp_specialize needs tma=True (its producer warpgroup loads through "
                "tensor descriptors) and num_warps=4 (Triton specializes only 4-warp "
                f"kernels on Hopper, into 12: a producer and two consumers), got tma={self.tma}, "
                f"num_warps={num_warps}."
            )

    def replace(self, **changes: Any) -> KernelConfig:
        """A copy with `changes` applied (validated like the original)."""
        return dataclasses.replace(self, **changes)
