"""Static configuration of the splash kernels: block sizes and segment ids."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import numpy as np

NUM_LANES = 128  # TPU vreg lane width: the minor dimension of every tile.
NUM_SUBLANES = 8  # TPU vreg sublane count: the second-minor dimension of a tile.

# JAX splash's default logit of a masked pair (see kernel.MASK_VALUE_BOUND for ours).
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
DEFAULT_BLOCK = 512  # forward blocks when none is given, capped at the sequence length
_DEFAULT_CANDIDATES = (512, 256, 128)


class SegmentIds(NamedTuple):
    """Packed-sequence ids: a (q, kv) pair attends only if its ids are equal.

    Attributes:
      q: int32 [q_len]
      kv: int32 [kv_len]
    """

    q: jax.Array
    kv: jax.Array


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_block(length: int) -> int:
    """The largest of 512/256/128 dividing `length`, else min(512, length).

    The fallback fails validation with a message naming the block, which is what a
    sequence length that no multiple of 128 divides deserves (pad it).
    """
    for block in _DEFAULT_CANDIDATES:
        if block <= length and length % block == 0:
            return block
    return min(DEFAULT_BLOCK, length)


class QKVLayout(enum.IntEnum):
    """Physical layout of q / k / v in JAX splash's kernels (its enum, same values).

    Only HEAD_DIM_MINOR ([..., seq_len, head_dim]) exists in ours: `BlockSizes` refuses
    SEQ_MINOR. The logical interface is head_dim-minor either way, so dropping the
    argument changes no result.
    """

    HEAD_DIM_MINOR = 1  # [..., seq_len, head_dim]
    SEQ_MINOR = 2  # [..., head_dim, seq_len]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (JAX splash's field names).

    Forward: `block_q` x `block_kv` blocks of the mask, the kv block walked in
    `block_kv_compute` slices. dK/dV: `block_q_dkv` x `block_kv_dkv`, computed in
    `block_kv_dkv_compute` slices. dQ: `block_q_dq` x `block_kv_dq`.

    None means "default"; `resolve` fills every None in one place. As in JAX, a given
    `block_kv` (`block_kv_dkv`) also fills an unset `block_kv_compute`
    (`block_kv_dkv_compute`) at construction. For the splash kernels every block is a
    multiple of 128: kv blocks are the lane axis of the forward and dQ tiles, q blocks the
    lane axis of the dK/dV tile and of the per-row lse / delta vectors
    (`block_sparse_attention`'s XLA and Triton backends take other sizes: its docstring).

    JAX compatibility fields:
      use_fused_bwd_kernel: JAX computes dQ inside its dK/dV kernel; ours always runs
        its own dQ kernel, over the dK/dV blocks when this is True (so, as in JAX,
        block_q_dq / block_kv_dq must then be unset). Same gradients up to rounding.
      q_layout, k_layout, v_layout: only `QKVLayout.HEAD_DIM_MINOR` (ValueError else).
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_kv_compute: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_kv_dkv_compute: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    use_fused_bwd_kernel: bool = False
    q_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR
    k_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR
    v_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR

    def __post_init__(self):
        # JAX fills the compute slices from their memory blocks when built.
        if self.block_kv_compute is None and self.block_kv is not None:
            object.__setattr__(self, "block_kv_compute", self.block_kv)
        if self.block_kv_dkv_compute is None and self.block_kv_dkv is not None:
            object.__setattr__(self, "block_kv_dkv_compute", self.block_kv_dkv)
        if not isinstance(self.use_fused_bwd_kernel, bool):
            raise TypeError(
                f"BlockSizes.use_fused_bwd_kernel must be a bool, got {self.use_fused_bwd_kernel!r}"
            )
        if self.use_fused_bwd_kernel and (
            self.block_q_dq is not None or self.block_kv_dq is not None
        ):
            raise ValueError(
                "BlockSizes: block_q_dq / block_kv_dq must be unset with "
                "use_fused_bwd_kernel=True (dQ then uses the dK/dV blocks)"
            )
        for name in ("q_layout", "k_layout", "v_layout"):
            layout = getattr(self, name)
            if layout != QKVLayout.HEAD_DIM_MINOR:
                raise ValueError(
                    f"BlockSizes.{name}={layout!r}: pallas_tpu.splash's kernels read q, k "
                    "and v head_dim-minor only (QKVLayout.HEAD_DIM_MINOR). The layout is a "
                    "physical choice of JAX's kernels, not a change of meaning: drop it."
                )

    @property
    def has_backward_blocks(self) -> bool:
        """JAX's property: every backward block is given (the dQ ones unless fused).
        JAX refuses to differentiate without them; ours fills them from the forward's."""
        needed = [self.block_q_dkv, self.block_kv_dkv, self.block_kv_dkv_compute]
        if not self.use_fused_bwd_kernel:
            needed += [self.block_q_dq, self.block_kv_dq]
        return all(b is not None for b in needed)

    @classmethod
    def get_default(cls) -> BlockSizes:
        """JAX's default: 128 for every block. (`BlockSizes()`, all unset, lets `resolve`
        pick up to 512 per block instead, which runs faster on a TPU.)"""
        return cls(*([NUM_LANES] * 8))

    def for_padding(self, q_len: int, kv_len: int) -> tuple[BlockSizes, int, int]:
        """These sizes for sequences that will be padded to whole blocks, and the padded
        lengths (a multiple of every block the three kernels use).

        An unset block_q / block_kv becomes a multiple of 128 (a TPU lane row), at most
        `DEFAULT_BLOCK`, no larger than its length rounded up to 128; other fields stay as
        given (`resolve` fills them).
        """

        def default(length: int) -> int:
            return min(DEFAULT_BLOCK, NUM_LANES * max(_cdiv(length, NUM_LANES), 1))

        sizes = dataclasses.replace(
            self, block_q=self.block_q or default(q_len), block_kv=self.block_kv or default(kv_len)
        )
        q_multiple = max(sizes.block_q, sizes.block_q_dkv or 0, sizes.block_q_dq or 0)
        kv_multiple = max(sizes.block_kv, sizes.block_kv_dkv or 0, sizes.block_kv_dq or 0)
        return (
            sizes,
            q_multiple * _cdiv(q_len, q_multiple),
            kv_multiple * _cdiv(kv_len, kv_multiple),
        )

    def resolve(self, q_len: int, kv_len: int) -> BlockSizes:
        """Every field filled and validated against the sequence lengths.

        Defaults: forward blocks 512 (the largest of 512/256/128 that divides the
        length); `block_kv_compute` = `block_kv`; backward blocks = the forward's;
        `block_kv_dkv_compute` = `block_kv_dkv`.

        Raises:
          ValueError: naming the field, for a block that is not a positive multiple of
            128, does not divide its sequence length, or whose compute slice does not
            divide it.
        """
        pick = lambda value, default: default if value is None else value
        block_q = pick(self.block_q, _default_block(q_len))
        block_kv = pick(self.block_kv, _default_block(kv_len))
        block_kv_dkv = pick(self.block_kv_dkv, block_kv)
        block_q_dkv = pick(self.block_q_dkv, block_q)
        # Fused (JAX: dQ inside the dK/dV kernel): our dQ kernel takes the dK/dV blocks.
        fused = self.use_fused_bwd_kernel
        dq_default = (block_q_dkv, block_kv_dkv) if fused else (block_q, block_kv)
        resolved = BlockSizes(
            block_q=block_q,
            block_kv=block_kv,
            block_kv_compute=pick(self.block_kv_compute, block_kv),
            block_q_dkv=block_q_dkv,
            block_kv_dkv=block_kv_dkv,
            block_kv_dkv_compute=pick(self.block_kv_dkv_compute, block_kv_dkv),
            block_q_dq=pick(self.block_q_dq, dq_default[0]),
            block_kv_dq=pick(self.block_kv_dq, dq_default[1]),
        )
        resolved.validate(q_len, kv_len)
        return resolved

    def validate(self, q_len: int, kv_len: int) -> None:
        """Checks a resolved instance; see `resolve`."""
        for name in BLOCK_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")
            if value % NUM_LANES:
                raise ValueError(
                    f"BlockSizes.{name}={value} must be a multiple of {NUM_LANES} "
                    "(the TPU lane width)"
                )
        lengths = {"q": q_len, "kv": kv_len}
        for name in (
            "block_q",
            "block_q_dkv",
            "block_q_dq",
            "block_kv",
            "block_kv_dkv",
            "block_kv_dq",
        ):
            side = "q" if name.startswith("block_q") else "kv"
            value = getattr(self, name)
            if lengths[side] % value:
                raise ValueError(
                    f"BlockSizes.{name}={value} must divide {side}_len={lengths[side]} "
                    f"(pad the sequence to a multiple of {value} or pick another block)"
                )
        for memory, compute in (
            ("block_kv", "block_kv_compute"),
            ("block_kv_dkv", "block_kv_dkv_compute"),
        ):
            if getattr(self, memory) % getattr(self, compute):
                raise ValueError(
                    f"BlockSizes.{compute}={getattr(self, compute)} must divide "
                    f"{memory}={getattr(self, memory)}"
                )


# The int fields of BlockSizes (the others are JAX's fused-backward flag and layouts).
BLOCK_FIELDS = (
    "block_q",
    "block_kv",
    "block_kv_compute",
    "block_q_dkv",
    "block_kv_dkv",
    "block_kv_dkv_compute",
    "block_q_dq",
    "block_kv_dq",
)


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Static options shared by the forward, dQ and dK/dV kernels (hashable: a jit key).

    Attributes:
      softmax_scale: multiplies q . k before the soft cap.
      logits_soft_cap: c in s = c * tanh(s / c), or None for no cap.
      block_sizes: resolved against the sequence lengths by each kernel wrapper.
      interpret: True runs the Pallas kernels in interpret mode, False compiles them with
        Mosaic (TPU only), None follows the platform the program is lowered for (Mosaic
        for a TPU, interpret mode elsewhere; `common.pallas_call`).
    """

    softmax_scale: float = 1.0
    logits_soft_cap: float | None = None
    block_sizes: BlockSizes = BlockSizes()
    interpret: bool | None = False

    def __post_init__(self):
        # Python floats: a jit key hashes them, and a kernel closes over no array.
        object.__setattr__(
            self, "softmax_scale", _static_float(self.softmax_scale, "softmax_scale")
        )
        if self.logits_soft_cap is not None:
            cap = _static_float(self.logits_soft_cap, "logits_soft_cap")
            object.__setattr__(self, "logits_soft_cap", cap)
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {self.logits_soft_cap}")
        if not isinstance(self.block_sizes, BlockSizes):
            raise TypeError(
                f"block_sizes must be a splash BlockSizes, got {type(self.block_sizes).__name__}"
            )


def _static_float(value: object, name: str) -> float:
    """`value` as a Python float: a Python or NumPy real number, or a concrete 0-d array
    (a TypeError naming `name` for a traced value, a bool or anything else)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static number (a Python float, or a concrete scalar), got a "
            "traced value: the kernels are specialised on it"
        )
    if isinstance(value, bool | np.bool_) or np.ndim(value) != 0:
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
