"""The GPU rows as data: varlen and block-sparse attention, grouped matmul, their anchors.

Every case is a `bench.runner.Case`; `cases(sizes)` lists them in run order. Anchors:

* attention: JAX's cuDNN attention (`jax.nn.dot_product_attention(implementation="cudnn")`,
  equal documents as a batch, mixed lengths as a padded batch with `query_seq_lengths`,
  window masks with `local_window_size`, random block sparsity as a dense boolean mask);
  where PyTorch imports, its SDPA with the flash and the cuDNN backends (rows it can
  express: no mask, or causal) and compiled FlexAttention with the same mask as a
  `mask_mod` on the packed tokens (`create_block_mask(mask_mod, 1, 1, T, T)`);
* grouped matmul: `jax.lax.ragged_dot`, a dense matmul of the same FLOPs (cuBLAS: the
  roofline; unchecked), the operands' bytes moved once by XLA (the memory roof;
  unchecked) and, with PyTorch, `torch._grouped_mm(a, b, offs=cumsum)`.

`Sizes.gpu()` holds the issue's shapes (16384 tokens, 16 heads of 128, bfloat16);
`Sizes.tiny()` the same rows at toy sizes for a CPU (Triton's interpreter; cuDNN and
PyTorch then report themselves unavailable, and XLA's attention stands in for cuDNN).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal

import numpy as np

from bench.runner import Case, Impl

# bfloat16 on both sides: probabilities and outputs rounded to 8 mantissa bits, so their
# difference relative to the largest magnitude stays within a few units of 2^-8.
ATTENTION_TOLERANCE = 3e-2
# Grouped matmul accumulates in float32 on every side; the output and the gradients are
# bfloat16, as torch._grouped_mm's (one rounding each: 2^-8 relative).
MATMUL_TOLERANCE = 2e-2


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of every row; `gpu()` the issue's, `tiny()` a CPU's."""

    tokens: int
    heads: int
    gqa_heads: tuple[int, int]  # (query heads, kv heads)
    head_dim: int
    equal_docs: tuple[int, ...]  # document lengths of the equal-document rows
    mixed_docs: tuple[int, ...]  # the mixed-length row, longest first
    window: int
    block: int  # the random block-sparsity table's block
    matmuls: tuple[tuple[int, int, int, int], ...]  # (m, k, n, groups)
    attention_impl: str  # JAX's attention anchor: "cudnn" on a GPU
    # documents of the many-document row (the kernels' persistent launches past 60; the
    # CPU's 32 x 2: one token each would have gradients of exactly 0, nothing to compare)
    many_docs: int
    # (heads, head_dim) of the wide-head row: Gemma's 256 at the FLOPs of `heads` x
    # `head_dim`
    wide_head: tuple[int, int]

    @classmethod
    def gpu(cls) -> Sizes:
        return cls(
            16384, 16, (32, 8), 128, (1024, 4096, 16384), (7000, 4000, 2500, 1500, 900, 484),
            1024, 128, ((8192, 2048, 1408, 64), (32768, 4096, 2048, 32)), "cudnn", 64,
            (8, 256),
        )  # fmt: skip

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(
            64, 2, (4, 1), 16, (4, 16, 64), (28, 16, 10, 6, 4),
            16, 16, ((64, 32, 16, 4),), "xla", 32, (2, 32),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """An attention pattern over packed tokens: documents `doc_lens` (tokens never attend
    across them), causal or not, a causal window of `window` keys to the left, a random
    table `keep[q // block, kv // block]` of kept blocks."""

    doc_lens: tuple[int, ...]
    causal: bool = True
    window: int | None = None
    keep: np.ndarray | None = dataclasses.field(default=None, compare=False)
    block: int = 128

    @property
    def tokens(self) -> int:
        return sum(self.doc_lens)

    @property
    def equal_docs(self) -> bool:
        return len(set(self.doc_lens)) == 1

    def allowed_pairs(self) -> int:
        """(query, key) pairs the pattern allows, counted per document."""
        if self.keep is not None:  # one document, whole kept blocks
            return int(self.keep.sum()) * self.block**2
        if self.window is not None:  # one causal document: min(i, window) + 1 keys at row i
            rows = np.arange(self.tokens)
            return int(np.minimum(rows, self.window).sum() + self.tokens)
        lens = np.asarray(self.doc_lens, np.int64)
        return int((lens * (lens + 1) // 2).sum() if self.causal else (lens * lens).sum())

    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.doc_lens)]).astype(np.int32)


def random_blocks(tokens: int, block: int, density: float = 0.5, seed: int = 0) -> np.ndarray:
    """[tokens / block]^2 bool: each block kept with probability `density`, the diagonal
    always (no query row left without keys)."""
    blocks = tokens // block
    keep = np.random.default_rng(seed).random((blocks, blocks)) < density
    keep[np.arange(blocks), np.arange(blocks)] = True
    return keep


def _attention_inputs(tokens: int, q_heads: int, kv_heads: int, dim: int, seed: int):
    def draw() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        q, d_out = (rng.standard_normal((tokens, q_heads, dim), np.float32) for _ in range(2))
        k, v = (rng.standard_normal((tokens, kv_heads, dim), np.float32) for _ in range(2))
        return {"q": q, "k": k, "v": v, "d_out": d_out}

    return draw


# ------------------------------------------------------------------------------ JAX side


def _jax_bf16(*arrays: np.ndarray):
    import jax.numpy as jnp

    return tuple(jnp.asarray(a, jnp.bfloat16) for a in arrays)


def _to_numpy(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def _packed_canonical(result, grad: bool) -> list[np.ndarray]:
    """Ours (packed [T, H, D]): out, then dq, dk, dv."""
    return _to_numpy(result)


# What an A/B anchor of ours times (`Impl.forward`, `Impl.grad`): "both" passes, the
# "forward" alone (it changes the forward's kernels only), or "fwd+bwd" alone (it changes
# the backward's only: its forward would time the default's again).
Passes = Literal["both", "forward", "fwd+bwd"]
_PASSES: Mapping[str, Mapping[str, bool]] = MappingProxyType({
    "both": {},
    "forward": {"grad": False},
    "fwd+bwd": {"forward": False},
})  # fmt: skip


def varlen_impl(spec: MaskSpec, config=None, label: str = "", passes: Passes = "both") -> Impl:
    """Ours: the Triton varlen kernels on the packed documents, at their defaults or at
    `config` (an `AttentionConfigs`, for A/B rows: `label` names it; `passes`: what it
    times, `_PASSES`)."""
    from jax_bridge import varlen_attention

    window = None if spec.window is None else (spec.window, 0)

    def fn(q, k, v, cu):
        return varlen_attention(
            q, k, v, cu, cu, causal=spec.causal, sliding_window=window,
            implementation="triton", config=config,
        )  # fmt: skip

    def prepare(host):
        import jax.numpy as jnp

        q, k, v, d_out = _jax_bf16(host["q"], host["k"], host["v"], host["d_out"])
        return (q, k, v, jnp.asarray(spec.cu_seqlens())), d_out

    name = "ours triton varlen" + (f" {label}" if label else "")
    return Impl(name, fn, prepare, _packed_canonical, **_PASSES[passes])


def splash_mask(spec: MaskSpec):
    """The `pallas_tpu.splash` mask of a one-sequence spec (block-sparse rows)."""
    from pallas_tpu.splash import CausalMask, DocumentMask, LocalMask, PredicateMask

    shape = (spec.tokens, spec.tokens)
    if spec.keep is not None:
        keep, block = spec.keep, spec.block
        return PredicateMask(shape, lambda q, kv: keep[q // block, kv // block], name="random")
    if spec.window is not None:
        return LocalMask(shape, (spec.window, 0), 0)
    if len(spec.doc_lens) > 1:
        return DocumentMask(spec.cu_seqlens(), shape=shape, causal=spec.causal)
    return CausalMask(shape)


def block_sparse_impl(
    spec: MaskSpec, block_sizes=None, label: str = "", config=None, passes: Passes = "both"
) -> Impl:
    """Ours: the Triton block-sparse kernels with the spec's splash mask, at their default
    tiles or at `block_sizes` (a `BlockSizes`) and `config` (an `AttentionConfigs`), for
    A/B rows: `label` names them; `passes`: what it times (`_PASSES`)."""
    from jax_bridge import block_sparse_attention

    mask = splash_mask(spec)

    def fn(q, k, v):
        return block_sparse_attention(
            q, k, v, mask, block_sizes=block_sizes, config=config, implementation="triton"
        )

    def prepare(host):
        q, k, v, d_out = _jax_bf16(host["q"], host["k"], host["v"], host["d_out"])
        return (q[None], k[None], v[None]), d_out[None]

    def canonical(result, grad):  # [1, T, H, D] -> [T, H, D]
        return [x[0] for x in _to_numpy(result)]

    name = "ours triton block-sparse" + (f" {label}" if label else "")
    return Impl(name, fn, prepare, canonical, **_PASSES[passes])


def _padded_index(spec: MaskSpec) -> tuple[np.ndarray, int]:
    """Flat positions in a [docs, longest] padded batch of each packed token."""
    longest = max(spec.doc_lens)
    index = np.concatenate([d * longest + np.arange(n) for d, n in enumerate(spec.doc_lens)])
    return index, longest


def jax_attention_impl(spec: MaskSpec, implementation: str) -> Impl:
    """JAX's `dot_product_attention` (cuDNN on a GPU) in the layout the pattern allows:
    equal documents as a batch, unequal ones padded with `query_seq_lengths`, a window
    with `local_window_size`, a random block table as a dense boolean mask."""
    import jax
    import jax.numpy as jnp

    docs = len(spec.doc_lens)
    index, longest = _padded_index(spec)
    lengths = np.asarray(spec.doc_lens, np.int32)
    window = None if spec.window is None else (spec.window, 0)

    def batch(x):  # packed [T, H, D] -> [docs, longest, H, D]
        if spec.equal_docs:
            return x.reshape(docs, longest, *x.shape[1:])
        padded = np.zeros((docs * longest, *x.shape[1:]), x.dtype)
        padded[index] = x
        return padded.reshape(docs, longest, *x.shape[1:])

    def fn(q, k, v, lengths, mask):
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=spec.causal and mask is None,
            query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            local_window_size=window, implementation=implementation,
        )  # fmt: skip

    def prepare(host):
        q, k, v, d_out = _jax_bf16(*(batch(host[n]) for n in ("q", "k", "v", "d_out")))
        mask = None
        if spec.keep is not None:
            dense = np.kron(spec.keep, np.ones((spec.block, spec.block), bool))
            mask = jnp.asarray(dense)[None, None]
        seq = None if spec.equal_docs else jnp.asarray(lengths)
        return (q, k, v, seq, mask), d_out

    def canonical(result, grad):
        return [x.reshape(docs * longest, *x.shape[2:])[index] for x in _to_numpy(result)]

    return Impl(f"jax {implementation} attention", fn, prepare, canonical)


# ---------------------------------------------------------------------------- torch side


# True: the first two varlen rows time the dK/dV default before TMA and the backward at
# one warpgroup a CTA (`_dkdv_tile_before_tma`, `_two_ctas_backward`), the grouped matmul
# rows gmm with TMA as one more, forward only, and the weight gradient's tgmm with TMA,
# fwd+bwd only (`tgmm_impl`)
# (`gpu-check --tma`, which bench/gpu_check.sh passes once tensor-descriptor kernels ran on
# the device: a kernel that faults there would take the rest of the run's rows with it).
USE_TMA = False
# True: the grouped matmul rows also time gmm with TMA through descriptors the launch
# encodes (`GroupedMatmulConfig.host_descriptors`), one program a tile (forward only) and
# persistent (forward and fwd+bwd), and two varlen rows each varlen kernel with TMA by
# either kind of descriptor (`_forward_descriptors`, `_dq_descriptors`,
# `_dkdv_descriptors`; fwd+bwd for the backward's)
# (`gpu-check --host-descriptors`, which
# bench/gpu_check.sh passes once their device tests passed: jaxlib encodes them, not
# Triton's launcher).
USE_HOST_DESCRIPTORS = False
# True: the grouped matmul rows also time gmm warp-specialized at each of
# `HOPPER_WARP_SPECIALIZED_GMM`'s tiles, forward only, the weight gradient's tgmm at
# `HOPPER_WARP_SPECIALIZED_TGMM`, fwd+bwd only, and three varlen rows the
# warp-specialized forward (`_warp_specialized_forward`) (`gpu-check --warp-specialized`,
# which bench/gpu_check.sh passes once the warp-specialized device tests, the launch
# layer's matmul, gmm, tgmm and the forward, all passed: a kernel whose partitions
# deadlock would hang the run).
USE_WARP_SPECIALIZED = False
# True: the first two of those varlen rows also time the warp-specialized dK/dV
# (`_warp_specialized_dkdv`) (`gpu-check --warp-specialized-dkdv`, which
# bench/gpu_check.sh passes once its device test passed, apart from the others': Triton's
# partitioning of that loop is the newest).
USE_WARP_SPECIALIZED_DKDV = False

# False: no PyTorch anchors even where it imports (`gpu-check --no-torch`: should PyTorch's
# CUDA libraries clash with JAX's in one process).
USE_TORCH = True


def torch_available() -> bool:
    """Whether PyTorch imports (the GPU machine has it; the project never installs it)."""
    if not USE_TORCH:
        return False
    try:
        import torch  # noqa: F401
    except Exception:  # ImportError, or a broken install: no torch anchors either way
        return False
    return True


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_inputs(host, layout: Callable, *, diff: int = 3):
    """bfloat16 tensors in `layout` of q, k, v (gradients on), d_out."""
    import torch

    tensors = []
    for i, name in enumerate(("q", "k", "v", "d_out")):
        t = torch.from_numpy(layout(host[name])).to(_torch_device(), torch.bfloat16)
        tensors.append(t.requires_grad_(i < diff))
    return tuple(tensors[:3]), tensors[3]


def _torch_numpy(result, grad: bool, unlayout: Callable) -> list[np.ndarray]:
    outs = [result[0], *result[1]] if grad else [result]
    return [unlayout(t.detach().float().cpu().numpy()) for t in outs]


def sdpa_impl(spec: MaskSpec, backend: str) -> Impl:
    """PyTorch SDPA restricted to one backend (FLASH_ATTENTION or CUDNN_ATTENTION), equal
    documents as a batch [docs, H, L, D]; GQA through `enable_gqa`."""
    docs, length = len(spec.doc_lens), spec.doc_lens[0]

    def layout(x):  # [T, H, D] -> [docs, H, L, D]
        return np.ascontiguousarray(x.reshape(docs, length, *x.shape[1:]).transpose(0, 2, 1, 3))

    def unlayout(x):
        return x.transpose(0, 2, 1, 3).reshape(docs * length, *x.shape[1:2], x.shape[3])

    def fn(q, k, v):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=spec.causal, enable_gqa=q.shape[1] != k.shape[1]
            )

    return Impl(
        f"torch sdpa {backend.split('_')[0].lower()}",
        fn,
        lambda host: _torch_inputs(host, layout),
        lambda r, g: _torch_numpy(r, g, unlayout),
        framework="torch",
    )


def _give_triton_a_cache_dir() -> None:
    """Inductor's Triton compiles need a cache directory, and importing jax_triton sets
    TRITON_CACHE_DIR to "" (it turns Triton's cache off): FlexAttention then fails with
    "Could not create or locate cache dir". Called before each FlexAttention compile,
    since jax_triton may be imported between two of them."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-flex-triton-")


@functools.cache
def _compiled_flex():
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_mask_mod(spec: MaskSpec, device: str):
    """FlexAttention's mask_mod of the spec on the packed tokens."""
    import torch

    doc = torch.as_tensor(np.repeat(np.arange(len(spec.doc_lens)), spec.doc_lens), device=device)
    keep = None if spec.keep is None else torch.as_tensor(spec.keep, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = doc[q_idx] == doc[kv_idx]
        if spec.causal:
            allowed = allowed & (q_idx >= kv_idx)
        if spec.window is not None:
            allowed = allowed & (q_idx - kv_idx <= spec.window)
        if keep is not None:
            allowed = allowed & keep[q_idx // spec.block, kv_idx // spec.block]
        return allowed

    return mask_mod


def flex_impl(spec: MaskSpec) -> Impl:
    """Compiled FlexAttention on the packed tokens [1, H, T, D] with the spec's block mask."""
    state = {}

    def layout(x):  # [T, H, D] -> [1, H, T, D]
        return np.ascontiguousarray(x.transpose(1, 0, 2)[None])

    def unlayout(x):
        return x[0].transpose(1, 0, 2)

    def prepare(host):
        from torch.nn.attention.flex_attention import create_block_mask

        _give_triton_a_cache_dir()
        device = _torch_device()
        tokens = spec.tokens
        state["mask"] = create_block_mask(
            flex_mask_mod(spec, device), 1, 1, tokens, tokens, device=device
        )
        return _torch_inputs(host, layout)

    def fn(q, k, v):
        gqa = q.shape[1] != k.shape[1]
        return _compiled_flex()(q, k, v, block_mask=state["mask"], enable_gqa=gqa)

    return Impl(
        "torch flex_attention", fn, prepare, lambda r, g: _torch_numpy(r, g, unlayout),
        framework="torch",
    )  # fmt: skip


# ------------------------------------------------------------------------------- matmul


def group_sizes(m: int, groups: int, seed: int = 0) -> np.ndarray:
    """Uneven routing: Dirichlet popularity, a sixteenth of the experts empty; sums to m."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(groups, 0.7))
    weights[rng.choice(groups, size=groups // 16, replace=False)] = 0.0
    return rng.multinomial(m, weights / weights.sum()).astype(np.int32)


def _matmul_inputs(m: int, k: int, n: int, groups: int):
    def draw() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(1)
        return {
            "lhs": rng.standard_normal((m, k), np.float32),
            "rhs": rng.standard_normal((groups, k, n), np.float32) / np.sqrt(k),
            "d_out": rng.standard_normal((m, n), np.float32),
            "sizes": group_sizes(m, groups),
        }

    return draw


def _gmm_jax(fn: Callable, name: str, passes: Passes = "both") -> Impl:
    """A JAX grouped matmul row: bf16 lhs, rhs and output cotangent (an MoE layer's, and
    torch._grouped_mm's); `fn` returns bf16 (accumulating in float32); `passes`: what it
    times (`_PASSES`)."""

    def prepare(host):
        import jax.numpy as jnp

        lhs, rhs, d_out = _jax_bf16(host["lhs"], host["rhs"], host["d_out"])
        return (lhs, rhs, jnp.asarray(host["sizes"])), d_out

    return Impl(name, fn, prepare, lambda r, g: _to_numpy(r), **_PASSES[passes])


def grouped_matmul_impl(
    tma: bool = False,
    tiling: tuple[int, int, int] | None = None,
    op_tiling: tuple[int, int, int] | None = None,
    num_warps: int | None = None,
    warp_specialized: tuple[int, int, int, int] | None = None,
    host_descriptors: bool = False,
) -> Impl:
    """Ours. A/B rows against the default: `tma` or `tiling` (and `num_warps`): gmm's
    tiles through tensor descriptors (`host_descriptors`: encoded by the launch), or at
    `tiling`; `warp_specialized`: gmm
    warp-specialized at (tm, tk, tn, stages) (`warp_specialized_gmm_config`); these
    forward only (a `config=` reaches the weight gradient's tgmm launch as well, which
    would then run at gmm's tile); `op_tiling`: passed as the op's `tiling`, which every
    launch of the forward and the gradient takes at its own sizes (forward and fwd+bwd)."""
    from jax_bridge import grouped_matmul
    from triton_kernels.grouped_matmul.config import warp_specialized_gmm_config

    def fn(lhs, rhs, sizes):
        config = None
        if warp_specialized:
            config = warp_specialized_gmm_config(*lhs.shape, rhs.shape[2], warp_specialized)
        elif tma or tiling:
            config = _gmm_config(*lhs.shape, rhs.shape[2], tma, tiling, num_warps)
            config = dataclasses.replace(config, host_descriptors=host_descriptors)
        return grouped_matmul(
            lhs, rhs, sizes, config=config, tiling=op_tiling, implementation="triton",
            preferred_element_type=lhs.dtype,
        )  # fmt: skip

    name = "ours triton" + (" tma" if tma else "")
    name += " host descriptors" if host_descriptors else ""
    name += f" {'x'.join(map(str, tiling))}" if tiling else ""
    name += f" {num_warps} warps" if num_warps else ""
    name += f" tiling {'x'.join(map(str, op_tiling))}" if op_tiling else ""
    if warp_specialized:
        *tile, stages = warp_specialized
        name += f" warp-specialized {'x'.join(map(str, tile))} {stages} stages"
    return _gmm_jax(fn, name, "forward" if tma or tiling or warp_specialized else "both")


def persistent_gmm_impl(tma: bool = False, host_descriptors: bool = False) -> Impl:
    """Ours with gmm's launches (the forward and the input gradient) persistent
    (`GroupedMatmulConfig.persistent`: a program per CTA the GPU holds, walking the tile
    list), at their default tile, by pointers or (`tma`) through descriptors built once a
    program (`host_descriptors`: by the launch); tgmm keeps its default. Forward and
    fwd+bwd."""
    from jax_bridge import GroupedMatmulConfigs, grouped_matmul

    def fn(lhs, rhs, sizes):
        config = _gmm_config(*lhs.shape, rhs.shape[2], tma, None, None)
        config = dataclasses.replace(config, persistent=True, host_descriptors=host_descriptors)
        return grouped_matmul(
            lhs, rhs, sizes, config=GroupedMatmulConfigs(gmm=config), implementation="triton",
            preferred_element_type=lhs.dtype,
        )  # fmt: skip

    name = "ours triton, gmm persistent" + (" tma" if tma else "")
    return _gmm_jax(fn, name + (" host descriptors" if host_descriptors else ""))


def _weight_gradient_config(lhs, rhs, groups: int):
    """The weight gradient's tgmm config by default for this launch target (bf16,
    token-major lhs: [m, k], rhs: [groups, k, n])."""
    from jax_bridge.launch.target import launch_target
    from triton_kernels.grouped_matmul.config import tgmm_config

    (m, k), n = lhs.shape, rhs.shape[2]
    return tgmm_config(
        m, k, n, element_bytes=2, compute_capability=launch_target().compute_capability,
        lhs_token_major=True, num_groups=groups,
    )  # fmt: skip


def persistent_tgmm_impl(groups: int) -> Impl:
    """Ours with the weight gradient's tgmm alone persistent (`tgmm_walk_kernel`: each
    program walks its tile's rows through a split of the groups), at tgmm's default
    tile; gmm's launches keep theirs. Fwd+bwd only."""
    from jax_bridge import GroupedMatmulConfigs, grouped_matmul

    def fn(lhs, rhs, sizes):
        config = dataclasses.replace(_weight_gradient_config(lhs, rhs, groups), persistent=True)
        return grouped_matmul(
            lhs, rhs, sizes, config=GroupedMatmulConfigs(tgmm=config), implementation="triton",
            preferred_element_type=lhs.dtype,
        )  # fmt: skip

    return _gmm_jax(fn, "ours triton, tgmm persistent", passes="fwd+bwd")


def tgmm_impl(groups: int, warp_specialized: tuple[int, int, int, int] | None = None) -> Impl:
    """Ours with the weight gradient's tgmm alone changed, fwd+bwd only: its default tile
    through tensor descriptors (`tma`), or warp-specialized at (tm, tk, tn, stages)
    (`GroupedMatmulConfigs.tgmm`); gmm's launches keep their defaults."""
    from jax_bridge import GroupedMatmulConfigs, grouped_matmul
    from triton_kernels.grouped_matmul.config import warp_specialized_gmm_config

    def fn(lhs, rhs, sizes):
        if warp_specialized:
            config = warp_specialized_gmm_config(*lhs.shape, rhs.shape[2], warp_specialized)
        else:
            config = dataclasses.replace(_weight_gradient_config(lhs, rhs, groups), tma=True)
        return grouped_matmul(
            lhs, rhs, sizes, config=GroupedMatmulConfigs(tgmm=config), implementation="triton",
            preferred_element_type=lhs.dtype,
        )  # fmt: skip

    name = "ours triton, tgmm tma"
    if warp_specialized:
        *tile, stages = warp_specialized
        name += f" warp-specialized {'x'.join(map(str, tile))} {stages} stages"
    return _gmm_jax(fn, name, passes="fwd+bwd")


def _gmm_config(
    m: int, k: int, n: int, tma: bool, tiling: tuple[int, int, int] | None, num_warps: int | None
):
    """gmm's bf16 config for this launch target at `tiling` (None: the default), with
    `tma` and `num_warps` (None: the config's) as given."""
    from jax_bridge.launch.target import launch_target
    from triton_kernels.grouped_matmul.config import gmm_config

    capability = launch_target().compute_capability
    config = gmm_config(m, k, n, element_bytes=2, compute_capability=capability, tiling=tiling)
    return dataclasses.replace(config, tma=tma, num_warps=num_warps or config.num_warps)


# 64 groups of ~128 rows in 128-row tiles leave about half of each tile's rows to another
# group (the H100's ncu: gmm's grid 127 x 11 for 64 x 11 tiles of work); 64-row tiles
# multiply ~25% fewer rows. An A/B anchor until a GPU says which wins: the Hopper
# default's k and n tiles, 64 rows, at 4 warps (one warpgroup of m64n256; static report,
# sm_90, Triton 3.6: 255 warp-instructions per MFLOP, no spill; 370 at 8 warps).
_GMM_SMALL_GROUP_TILING = (64, 64, 256)
# The default before gmm took 128 x 64 x 256 tiles on Hopper (`gmm_default_tiling`, not
# yet timed there): the op at megablox's tiling runs every kernel as it did then.
_GMM_PREVIOUS_DEFAULT_TILING = (128, 128, 128)


def ragged_dot_impl() -> Impl:
    import jax
    import jax.numpy as jnp

    return _gmm_jax(
        lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.bfloat16),
        "jax ragged_dot",
    )


def dense_matmul_impl() -> Impl:
    """[m, k] @ [k, n]: the FLOPs of the routed rows as one cuBLAS call (the roofline)."""
    import jax.numpy as jnp

    def prepare(host):
        lhs, rhs = _jax_bf16(host["lhs"], host["rhs"][0])
        return (lhs, rhs), _jax_bf16(host["d_out"])[0]

    def fn(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.bfloat16)

    return Impl("dense matmul (roofline)", fn, prepare, None)


def memory_roof_impl() -> Impl:
    """The op's memory traffic without its arithmetic, by XLA: lhs and the weights read
    once and out written (a sum of each, broadcast); its gradient reads d_out once and
    writes d_lhs and d_rhs. Fewer bytes than any grouped matmul moves (the backward reads
    the weights and lhs again), so ours / this is a floor on how far from the bandwidth
    roof a row runs (m 8192 reads 369 MB of weights for 47 GFLOP). Unchecked."""
    import jax.numpy as jnp

    def fn(lhs, rhs, sizes):
        del sizes
        total = jnp.sum(lhs, dtype=jnp.float32) + jnp.sum(rhs, dtype=jnp.float32)
        return jnp.broadcast_to(total.astype(lhs.dtype), (lhs.shape[0], rhs.shape[2]))

    return dataclasses.replace(_gmm_jax(fn, "memory roof (XLA)"), canonical=None)


def one_group_impl() -> Impl:
    """Ours on the roofline's problem: every row in one group, [m, k] @ [k, n] as one
    grouped matmul (rhs [1, k, n]). Other work than the row's (no check): it says how far
    our kernels are from cuBLAS on a dense matmul, apart from anything grouping costs."""
    import jax.numpy as jnp

    from jax_bridge import grouped_matmul

    def prepare(host):
        lhs, rhs = _jax_bf16(host["lhs"], host["rhs"][:1])
        sizes = jnp.asarray([lhs.shape[0]], jnp.int32)
        return (lhs, rhs, sizes), _jax_bf16(host["d_out"])[0]

    def fn(lhs, rhs, sizes):
        return grouped_matmul(
            lhs, rhs, sizes, implementation="triton", preferred_element_type=lhs.dtype
        )

    return Impl("ours triton, one group", fn, prepare, None)


def torch_grouped_mm_impl() -> Impl:
    """`torch._grouped_mm(a, b, offs=cumsum(sizes) int32)`: bf16 out (its only output)."""

    def prepare(host):
        import torch

        device = _torch_device()
        lhs, rhs = (
            torch.from_numpy(host[n]).to(device, torch.bfloat16).requires_grad_(True)
            for n in ("lhs", "rhs")
        )
        offs = torch.from_numpy(np.cumsum(host["sizes"]).astype(np.int32)).to(device)
        d_out = torch.from_numpy(host["d_out"]).to(device, torch.bfloat16)
        return (lhs, rhs, offs), d_out

    def fn(a, b, offs):
        import torch

        return torch._grouped_mm(a, b, offs=offs)

    return Impl(
        "torch _grouped_mm", fn, prepare, lambda r, g: _torch_numpy(r, g, lambda x: x),
        framework="torch",
    )  # fmt: skip


# -------------------------------------------------------------------------------- cases


def _attention_case(
    section: str, op: str, key: str, spec: MaskSpec, heads: tuple[int, int], sizes: Sizes,
    ours: Impl, torch_anchors: list[Impl], variants: tuple[Impl, ...] = (),
    head_dim: int | None = None,
) -> Case:  # fmt: skip
    q_heads, kv_heads = heads
    dim = head_dim or sizes.head_dim
    shape = (
        f"{key} h{q_heads}" + (f"/{kv_heads}kv" if kv_heads != q_heads else "")
        + f" d{dim} bf16"
    )  # fmt: skip
    anchors = [jax_attention_impl(spec, sizes.attention_impl), *variants]
    if torch_available():
        anchors += [*torch_anchors, flex_impl(spec)]
    return Case(
        section, op, key, shape, "attention",
        4.0 * dim * q_heads * spec.allowed_pairs(),
        _attention_inputs(spec.tokens, q_heads, kv_heads, dim, seed=len(key)),
        ours, tuple(anchors), ATTENTION_TOLERANCE, 3,
        {"seq_len": max(spec.doc_lens), "total_tokens": spec.tokens},
    )  # fmt: skip


def _dkdv_tile_before_tma(spec: MaskSpec) -> tuple[Impl, ...]:
    """The A/B of the sm_90 dK/dV default: since 2026-11-27 light causal calls at d=128
    take it at 64x128 with TMA where jaxlib passes the descriptors' scratch
    (`default_attention_config`); the anchor is the tile before, 32x128 by pointers. (On
    the H100 that day, with the forward and dQ on TMA too: 4 x 4096 fwd+bwd 3.46 ms
    against 3.74, 16 x 1024 1.35 against 1.33; TMA at the default tiles alone made the
    forward 5% and fwd+bwd 3-12% slower.) fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    before = AttentionConfigs(backward_dkdv=AttentionKernelConfig(32, 128, 8, 2))
    return (varlen_impl(spec, before, "dkdv 32x128 by pointers", passes="fwd+bwd"),)


def _two_ctas_backward(spec: MaskSpec) -> Impl:
    """An A/B of the backward's CTA shape: dK/dV and dQ at `TWO_CTA_BACKWARD_TILE`
    (64x64, 4 warps, two stages, with `tma`), one warpgroup a CTA and two CTAs an SM,
    against the defaults' two warpgroups a CTA (dK/dV 64x128 with `tma`, dQ 128x64).
    Static report, sm_90, d=128, Triton 3.6: the same warp-instructions per MFLOP (dK/dV
    360 against 360, dQ 351 against 359), but the defaults' loops take 2-4 barriers of
    the whole CTA a tile, which hold their two warpgroups in step (neither's exp2s beside
    the other's MMAs); two CTAs of one warpgroup drift apart, at twice the reads of the
    streamed tiles. fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import TWO_CTA_BACKWARD_TILE

    config = AttentionKernelConfig(*TWO_CTA_BACKWARD_TILE, tma=True)
    two = AttentionConfigs(backward_dkdv=config, backward_dq=config)
    return varlen_impl(spec, two, "backward 64x64 4 warps", passes="fwd+bwd")


def _three_stage_tiles(spec: MaskSpec) -> Impl:
    """An A/B of pipeline depth: the forward and dQ at FlexAttention's H100 tiles for
    head_dim 128 (PyTorch's defaults: 128x64, 8 warps, three stages; ours default to two
    stages and, light and causal, a 128x128 forward). dK/dV keeps its default: Flex's
    64x128 at three stages spills 136-236 B under Triton 3.6 and 3.9 since dK/dV keeps its
    wgmma in flight. The static report cannot price a pipeline's depth."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    flex = AttentionConfigs(
        forward=AttentionKernelConfig(128, 64, 8, 3),
        backward_dq=AttentionKernelConfig(128, 64, 8, 3),
    )
    return varlen_impl(spec, flex, "three stages")


def _two_ctas_forward(spec: MaskSpec, tma: bool = False) -> Impl:
    """An A/B of the forward: 64x128 tiles at 4 warps and one stage fit two CTAs per SM
    (`ONE_STAGE_TWO_CTA_TILE`: 80 KiB of shared memory, 252 registers; the default,
    128x128 at 8 warps and two stages: one, 160 KiB, 255), so one program's start (Q's
    load, the first K and V) and end (the rescale, O's store) overlap the other's loop,
    and its loop runs 467 warp-instructions per MFLOP against 495 (static report, sm_90,
    d=128, causal, Triton 3.6, the device's; persistent, for many documents: 471 against
    492; under Triton 3.9 614 against 527, the loads' address arithmetic). Each of
    16 x 1024's query tiles sees 4.5 key tiles on average (1 to 8), of 64 x 256's at most
    2: the start and end weigh there. On long documents what it can win is one CTA's
    softmax beside the other's MMAs: the default's loop waits for QK^T's wgmma before the
    softmax and issues PV's after it, and its two warpgroups meet at the pipeline's
    barrier every tile, so the tensor cores idle through each tile's 16384 exp2. What it
    risks: at one stage each step loads its K and V at its top and waits for them (no
    asynchronous copy), which only the other CTA's loop hides, and K and V are read twice
    as often. With `tma` (`--tma`'s rows) K and V come by bulk tensor copies: one
    instruction a tile where the pointers' loads take 32 and their stores to shared
    memory 32 more (458 / 487 per MFLOP under Triton 3.6 / 3.9, 254 / 217 registers, no
    spill).
    Forward only (the backward is the default's)."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import ONE_STAGE_TWO_CTA_TILE

    two = AttentionConfigs(forward=AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE, tma=tma))
    name = "forward 64x128 4 warps 1 stage" + (" tma" if tma else "")
    return varlen_impl(spec, two, name, passes="forward")


def _two_ctas_dq(spec: MaskSpec, tma: bool = False) -> Impl:
    """An A/B of the dQ kernel as `_two_ctas_forward` of the forward: 64 query rows in
    128-key steps at 4 warps and one stage, two CTAs per SM (96 KiB), against the default
    128x64 at 8 warps and two stages (one CTA, 128 KiB): 291 warp-instructions per MFLOP
    against 359 under Triton 3.6 (305 against 422 under 3.9; static report, sm_90, d=128,
    causal), no spill in the loop (48 B outside it, stored once a program). Needs no
    descriptors, so it runs without `--tma` too, unlike `_two_ctas_backward`; with `tma`
    (`--tma`'s rows) 279 / 297 under 3.6 / 3.9, no spill in the loop (28 / 0 B outside).
    The forward and dK/dV are the default's: fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import ONE_STAGE_TWO_CTA_TILE

    two = AttentionConfigs(backward_dq=AttentionKernelConfig(*ONE_STAGE_TWO_CTA_TILE, tma=tma))
    name = "dq 64x128 4 warps 1 stage" + (" tma" if tma else "")
    return varlen_impl(spec, two, name, passes="fwd+bwd")


def _overlapped_forward(spec: MaskSpec) -> Impl:
    """An A/B of the forward's softmax overlap (`AttentionKernelConfig.overlap_softmax`,
    FlashAttention-3's intra-warpgroup overlap): each unmasked key tile's QK^T wgmma is
    issued before the previous tile's softmax, at `OVERLAPPED_FORWARD_TILE` (128x64, 8
    warps, three stages: the three-stage row's forward tile, so on the causal rows the two
    differ by the overlap alone; on the row without a right bound, which has no
    three-stage row, it differs from the default in tile and depth too). Static report,
    sm_90, Triton 3.6 and 3.9: all 34 of the loop's exp2s issued beside an MMA in flight
    (none in the default's), not serialized. Forward only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import OVERLAPPED_FORWARD_TILE

    config = AttentionKernelConfig(*OVERLAPPED_FORWARD_TILE, overlap_softmax=True)
    return varlen_impl(
        spec, AttentionConfigs(forward=config), "forward overlapped softmax", passes="forward"
    )


def _overlapped_dkdv(spec: MaskSpec) -> Impl:
    """An A/B of dK/dV's softmax overlap (`overlap_softmax` on its config): each query
    tile's dP = V dO^T issued before P's exp2s, at `OVERLAPPED_DKDV_TILE` (32x128 by
    pointers, what dK/dV runs without a right bound: the not-causal row's default, so
    there the two rows differ by the overlap alone; on causal rows compare it with
    `--tma`'s "dkdv 32x128 by pointers"). Static report, sm_90, Triton 3.6: 16 of the
    loop's 16 exp2s beside dP's wgmma in flight, none without. fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import OVERLAPPED_DKDV_TILE

    config = AttentionKernelConfig(*OVERLAPPED_DKDV_TILE, overlap_softmax=True)
    return varlen_impl(
        spec, AttentionConfigs(backward_dkdv=config), "dkdv overlapped softmax", passes="fwd+bwd"
    )


def _former_forward_tile(spec: MaskSpec) -> Impl:
    """An A/B of a forward tile taken without a device's word, against the one it
    replaced (128x64, three stages), on the rows whose default moved to 128x128 at two
    stages once the static report found it spill-free in its loops (sm_90, d=128, Triton
    3.6 / 3.9, warp-instructions per MFLOP of the key loop): the persistent launch of many
    documents (652 -> 492 / 702 -> 547; it stores 12 / 20 B a thread before its walk and
    reloads them once a tile) and a causal sliding window (692 -> 537 / 723 -> 543; 20-68
    / 0-8 B between its loops). Forward only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    former = AttentionConfigs(forward=AttentionKernelConfig(128, 64, 8, 3))
    return varlen_impl(spec, former, "forward 128x64 3 stages", passes="forward")


def _forward_descriptors(spec: MaskSpec) -> tuple[Impl, Impl]:
    """The A/B of the forward's descriptors: at its default tile (the light causal one on
    sm_90, 128x128, 8 warps, two stages) with `tma`, K and V through descriptors each
    program builds for its sequence (on the H100, 2026-11-27, with dQ's and dK/dV's on TMA
    too: 5% slower than by pointers on 4 x 4096) or through the launch's over all of K and
    V (`host_descriptors`: no descriptor work in a program; masked tiles zero the rows
    past their sequence in registers). Static report, sm_90, d=128, causal: 477 / 497
    warp-instructions in the full-tile loop under Triton 3.6 / 3.9 against 489 / 509 with
    the launch's, no spill, not serialized. Forward only."""
    return _descriptor_ab(spec, "forward", (128, 128, 8, 2), "forward")


def _dq_descriptors(spec: MaskSpec) -> tuple[Impl, Impl]:
    """The A/B of dQ's descriptors, as `_forward_descriptors` for the forward: at its
    default tile (sm_90, d=128, causal: 128x64, 8 warps, two stages) with `tma`, K and V
    through descriptors each program builds for its sequence, or through the launch's over
    all of K and V (`host_descriptors`; the key loop is the forward's, masked tiles zero
    the rows past their sequence). Static report, sm_90, d=128, causal: the full-tile loop
    277 / 298 warp-instructions under Triton 3.6 / 3.9 with a program's descriptors, 282 /
    309 with the launch's, 282 / 332 by pointers (the default); no spill in the loop, not
    serialized. The forward and dK/dV are the default's: fwd+bwd only."""
    return _descriptor_ab(spec, "backward_dq", (128, 64, 8, 2), "dq", passes="fwd+bwd")


def _dkdv_descriptors(spec: MaskSpec) -> tuple[Impl, Impl]:
    """The A/B of dK/dV's descriptors, as `_forward_descriptors`: at its default tile where
    descriptors can be launched (sm_90, d=128, causal: 64x128, 8 warps, two stages) with
    `tma`, Q and dO through descriptors each program builds for its sequence, or through
    the launch's over all of q and dO (`host_descriptors`; masked query tiles zero the
    rows past their sequence in registers, which the program's descriptors leave to the
    copy engine). Static report, sm_90, d=128, causal, Triton 3.6 / 3.9: 360 / 341
    warp-instructions per MFLOP with a program's descriptors, 384 / 356 with the
    launch's; under 3.6 the launch's spill 40 / 52 B a thread in the loop (a program's
    20 / 24 B outside it), none under 3.9. The forward and dQ are the default's: fwd+bwd
    only."""
    return _descriptor_ab(spec, "backward_dkdv", (64, 128, 8, 2), "dkdv", passes="fwd+bwd")


def _descriptor_ab(
    spec: MaskSpec, kind: str, tile: tuple[int, int, int, int], label: str, passes="forward"
) -> tuple[Impl, Impl]:
    """Kernel `kind` at `tile` (block_m, block_n, warps, stages) with `tma`, by each
    program's descriptors ("<label> tma") and by the launch's ("... host descriptors")."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    built = AttentionKernelConfig(*tile, tma=True)
    given = built.replace(host_descriptors=True)
    return tuple(
        varlen_impl(spec, AttentionConfigs(**{kind: config}), name, passes=passes)
        for config, name in ((built, f"{label} tma"), (given, f"{label} tma host descriptors"))
    )


def _dq_atomic_backward(spec: MaskSpec) -> Impl:
    """The A/B of the backward's two designs (`AttentionConfigs.dq_atomic`): dQ added
    by atomics from the dK/dV kernel (FlashAttention-2's; 5 tile products a tile pair, at
    32x128 on sm_90, d=128) against the default's dQ kernel, which recomputes QK^T and
    dO V^T (7 products). Static report, sm_90, d=128, causal, Triton 3.6: 612
    warp-instructions per MFLOP x 5 products against 360 x 4 (dK/dV, TMA) + 417 x 3 (dQ);
    what the instruction counts do not price is the atomics' traffic (16 KB a step:
    about 2 GB a 4 x 4096 backward). Its forward is the default's: fwd+bwd only."""
    from jax_bridge import AttentionConfigs

    return varlen_impl(spec, AttentionConfigs(dq_atomic=True), "dq by atomics", passes="fwd+bwd")


def _dq_by_tensor_reduction(spec: MaskSpec) -> Impl:
    """The dQ-atomic backward (`_dq_atomic_backward`) with its dK/dV tile through tensor
    descriptors: Q and dO by bulk copies, each step's dQ share added by one bulk tensor
    reduction instead of 8 vector atomics a thread (`DQ_REDUCE_DKDV_TILE`: the same
    32x128 tile, 540 against 612 warp-instructions per MFLOP under Triton 3.6). Beside
    "dq by atomics" it prices the atomics; beside the default, the design. Needs
    descriptors (with --tma); fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import DQ_REDUCE_DKDV_TILE

    dkdv = AttentionKernelConfig(*DQ_REDUCE_DKDV_TILE, tma=True)
    configs = AttentionConfigs(backward_dkdv=dkdv, dq_atomic=True)
    return varlen_impl(spec, configs, "dq by tma reduction", passes="fwd+bwd")


def _deep_dkdv_pipeline(spec: MaskSpec) -> Impl:
    """An A/B of the dK/dV kernel's pipeline depth, where it runs by pointers at 32x128
    (calls without a right bound): four stages instead of two, spill-free under Triton 3.6
    and 3.9 (128 KB of shared memory; 515 / 546 warp-instructions per MFLOP against 492 /
    528). FlexAttention's dK/dV takes three stages on an H100 (its backward ran ~1.4x our
    tensor throughput there, against our dK/dV with its wgmma serialized, since fixed);
    the static report cannot price a pipeline's depth. fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    deep = AttentionConfigs(backward_dkdv=AttentionKernelConfig(32, 128, 8, 4))
    return varlen_impl(spec, deep, "dkdv 4 stages", passes="fwd+bwd")


def _flex_dkdv_config(spec: MaskSpec) -> Impl:
    """An A/B of dK/dV at FlexAttention's H100 config for head_dim 128 (PyTorch's
    defaults: 64 queries a step into a 128-key tile, 8 warps, three stages, by pointers)
    against the default (the same tile at two stages with `tma`), on causal rows: without
    a right bound its loop spills (192 B a thread stored at 4 x 4096, Triton 3.6). On the
    H100 Flex's backward ran ~1.35x ours at 4 x 4096 (ours with dK/dV at 64x128 and
    `tma`), but ptxas had serialized that dK/dV's warpgroup MMAs (C7515, fixed since;
    compiled from the run's commit under Triton 3.6: 554 warp-instructions per MFLOP and
    serialized). Flex's kernels, instantiated by hand from its template for that row and
    compiled for sm_90 under Triton 3.6, run 491 (dK/dV) and 434 (dQ) against our 355
    and 359 now, and its dK/dV spills 128 B a thread. Ours at this config: 409 under 3.6
    at this row's shapes (`gpu-check --compile-for h100`), one reload an iteration (76 /
    88 B stored / loaded a thread in all; the catalog's GQA kernel: 419 / 398 under 3.6 /
    3.9, ten reloads under 3.9). The row tells whether the depth Flex has (a step's
    copies issued two steps ahead instead of one) gains more than those instructions
    cost. fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    flex = AttentionConfigs(backward_dkdv=AttentionKernelConfig(64, 128, 8, 3))
    return varlen_impl(spec, flex, "dkdv 64x128 3 stages", passes="fwd+bwd")


def _deep_forward(spec: MaskSpec) -> Impl:
    """An A/B of the forward's pipeline depth alone: its default tile (128x128, 8 warps)
    at three stages instead of two (224 KiB of shared memory, of the 227 a CTA may take;
    static report, sm_90, d=128, causal: 519 / 527 warp-instructions per MFLOP under
    Triton 3.6 / 3.9 against 495 / 527, no spill). The three-stage row changes the tile
    too (128x64). Forward only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    deep = AttentionConfigs(forward=AttentionKernelConfig(128, 128, 8, 3))
    return varlen_impl(spec, deep, "forward 128x128 3 stages", passes="forward")


def _warp_specialized_forward(spec: MaskSpec) -> Impl:
    """An A/B of Triton's Hopper warp specialization on the forward
    (`AttentionKernelConfig.warp_specialize`): a producer warpgroup copies Q, K and V, two
    consumer warpgroups of 64 rows compute, at 128x128 and two stages (176 KiB), in one
    loop whose every tile is masked. Static report, sm_90, d=128, consumer
    warp-instructions per MFLOP (3.6 / 3.9): 687 / 714 causal, 563 / 591 not causal,
    against the default's 491 / 527 and 495 / 527 (unmasked loops), no spill. What the
    count cannot price: no consumer waits on its own loads, and the two consumers, which
    meet at no barrier, drift out of phase (one's softmax beside the other's MMAs).
    Forward only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import WARP_SPECIALIZED_FORWARD_TILE

    forward = AttentionKernelConfig(*WARP_SPECIALIZED_FORWARD_TILE, tma=True, warp_specialize=True)
    return varlen_impl(
        spec, AttentionConfigs(forward=forward), "forward warp-specialized", passes="forward"
    )


def _warp_specialized_dkdv(spec: MaskSpec) -> Impl:
    """An A/B of warp specialization on dK/dV (`warp_specialize` on its config): a
    producer warpgroup copies Q and dO, two consumer warpgroups of 64 keys compute, at
    `WARP_SPECIALIZED_DKDV_TILE` (64-query steps into a 128-key tile, two stages) in one
    loop whose every tile is masked. Static report, sm_90, d=128, causal, consumer
    warp-instructions per MFLOP (3.6 / 3.9): 534 / 527 against the default's 360 / 341
    (unmasked loop; 64x128 at 8 warps with `tma` on causal rows, 32x128 by pointers
    without a right bound), whose loop takes 4 / 6 barriers of the whole CTA a tile
    against none. dK/dV is ~48% of a fwd+bwd; what the count cannot price is the two
    consumers out of phase. Causal rows only: at 4 x 4096 not causal its loop spills (524
    B a thread stored, Triton 3.6: `gpu-check --compile-for h100`). fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import WARP_SPECIALIZED_DKDV_TILE

    dkdv = AttentionKernelConfig(*WARP_SPECIALIZED_DKDV_TILE, tma=True, warp_specialize=True)
    return varlen_impl(
        spec, AttentionConfigs(backward_dkdv=dkdv), "dkdv warp-specialized", passes="fwd+bwd"
    )


def _wide_head_tiles(spec: MaskSpec) -> tuple[Impl, ...]:
    """A/B rows of the d=256 row (head dims 129-256: Gemma's), whose Hopper defaults moved
    by the static report alone: the forward at its former tile (128x32, two stages; 64-key
    steps since 2026-12-05) and dQ at its former 64x32 (both warpgroups computed QK^T and
    dO V^T: 5/3 of the work; 128x32 since 2026-12-06); and dK/dV, head-major since
    2026-12-08 (`HEAD_MAJOR_DKDV_TILE`, 32x64 at one stage: 629 / 645 warp-instructions
    per MFLOP of the tile's work under Triton 3.6 / 3.9, causal), against its former
    key-major 16x64 (three stages; both warpgroups computed K Q^T and V dO^T: 1690 /
    2361), head-major 16x64 at two stages (a pipelined copy, 908 / 957) and key-major
    by mma.sync at 64x32, 8 warps (each product once, 788 / 797; mma.sync peaks at
    about half wgmma's rate on an H100, which the count cannot settle)."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    forward = AttentionConfigs(forward=AttentionKernelConfig(128, 32, 8, 2))
    dq = AttentionConfigs(backward_dq=AttentionKernelConfig(64, 32, 8, 2))
    dkdv = {
        "dkdv 16x64 key-major": AttentionKernelConfig(16, 64, 8, 3),
        "dkdv 16x64 head-major 2 stages": AttentionKernelConfig(16, 64, 8, 2, head_major=True),
        "dkdv 64x32 mma.sync": AttentionKernelConfig(64, 32, 8, 2),
    }
    return (
        varlen_impl(spec, forward, "forward 128x32", passes="forward"),
        varlen_impl(spec, dq, "dq 64x32", passes="fwd+bwd"),
        *(
            varlen_impl(spec, AttentionConfigs(backward_dkdv=config), name, passes="fwd+bwd")
            for name, config in dkdv.items()
        ),
    )


def _sdpa(spec: MaskSpec) -> list[Impl]:
    return [sdpa_impl(spec, b) for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION")]


def varlen_cases(sizes: Sizes) -> list[Case]:
    """16 docs x 1024, 4 x 4096, 1 x 16384 causal; 4 x 4096 not causal; 4 x 4096 GQA; 64 x
    256 causal (past 60 documents the kernels launch persistent programs); the mixed
    lengths (padded cuDNN; no SDPA, which has no ragged batch); one document with a
    causal sliding window (cuDNN's local window, FlexAttention; no SDPA); 4 x 4096 causal
    at head_dim 256 (`Sizes.wide_head`)."""
    t, heads = sizes.tokens, (sizes.heads, sizes.heads)
    rows = [(f"{t // n}x{n} causal", MaskSpec((n,) * (t // n)), heads) for n in sizes.equal_docs]
    mid = sizes.equal_docs[1]
    many = sizes.many_docs
    rows += [
        (f"{t // mid}x{mid} not causal", MaskSpec((mid,) * (t // mid), causal=False), heads),
        (f"{t // mid}x{mid} causal GQA", MaskSpec((mid,) * (t // mid)), sizes.gqa_heads),
        # a packed batch of many documents: the kernels' persistent launches
        (f"{many}x{t // many} causal", MaskSpec((t // many,) * many), heads),
    ]

    # A/B anchors of the first two (causal) rows: three pipeline stages (the forward and dQ
    # at Flex's tiles), dK/dV at Flex's config, dQ by atomics, and with --tma the dK/dV
    # default before TMA, the backward at one warpgroup a CTA, dQ by bulk tensor reductions
    # and the forward and dQ of two CTAs per SM by descriptors; of those and the row without
    # a right bound, the forward at its default tile three stages deep, a forward and a dQ
    # of two CTAs per SM and the forward and dK/dV with their softmax overlapped; of the
    # many documents, the persistent forward at its former tile (128x64) and of two CTAs per
    # SM; with --host-descriptors, of the first two, each kernel at its default tile with
    # TMA (dK/dV at 64x128), its descriptors each program's or the launch's; of the row
    # without a right bound, dK/dV's pipeline four stages deep; of the window, the forward
    # at its former tile (128x64); with --warp-specialized, of the first two and the one
    # without a right bound, the warp-specialized forward (and with --warp-specialized-dkdv,
    # of the first two, dK/dV). An anchor that changes one pass only times that pass. Not on
    # the row without a right bound: dK/dV at Flex's config and warp-specialized, whose
    # loops spill there (192 and 524 B a thread stored, as `gpu-check --compile-for h100`
    # reads them under Triton 3.6): a timing of spills.
    def ab(i: int, spec: MaskSpec) -> tuple[Impl, ...]:
        if i == len(rows) - 1:
            return (_former_forward_tile(spec), _two_ctas_forward(spec))
        ws = (_warp_specialized_forward(spec),) if USE_WARP_SPECIALIZED else ()
        overlap = (_two_ctas_forward(spec), _two_ctas_dq(spec), _overlapped_forward(spec),
                   _overlapped_dkdv(spec))  # fmt: skip
        if not spec.causal:
            return (_deep_dkdv_pipeline(spec), _deep_forward(spec), *overlap, *ws)
        if i >= 2:
            return ()
        ws += (_warp_specialized_dkdv(spec),) if USE_WARP_SPECIALIZED_DKDV else ()
        depth = (_flex_dkdv_config(spec), _deep_forward(spec))
        tma = (*_dkdv_tile_before_tma(spec), _two_ctas_backward(spec),
               _dq_by_tensor_reduction(spec), _two_ctas_forward(spec, tma=True),
               _two_ctas_dq(spec, tma=True)) if USE_TMA else ()  # fmt: skip
        if USE_HOST_DESCRIPTORS:
            tma += (*_forward_descriptors(spec), *_dq_descriptors(spec), *_dkdv_descriptors(spec))
        return (_three_stage_tiles(spec), *depth, _dq_atomic_backward(spec), *overlap, *tma, *ws)

    cases = [
        _attention_case("attention", "varlen_attention", key, spec, h, sizes, varlen_impl(spec),
                        _sdpa(spec), variants=ab(i, spec))
        for i, (key, spec, h) in enumerate(rows)
    ]  # fmt: skip
    mixed = MaskSpec(sizes.mixed_docs)
    key = f"mixed {sizes.mixed_docs[0]}..{sizes.mixed_docs[-1]} causal"
    windowed = MaskSpec((t,), window=sizes.window)
    cases += [
        _attention_case("attention", "varlen_attention", key, mixed, heads, sizes,
                        varlen_impl(mixed), []),
        _attention_case("attention", "varlen_attention", f"1x{t} causal window {sizes.window}",
                        windowed, heads, sizes, varlen_impl(windowed), [],
                        variants=(_former_forward_tile(windowed),)),
    ]  # fmt: skip
    wide_heads, wide_dim = sizes.wide_head
    wide = MaskSpec((mid,) * (t // mid))
    cases.append(
        _attention_case("attention", "varlen_attention", f"{t // mid}x{mid} d{wide_dim} causal",
                        wide, (wide_heads, wide_heads), sizes, varlen_impl(wide), _sdpa(wide),
                        variants=_wide_head_tiles(wide), head_dim=wide_dim)
    )  # fmt: skip
    return cases


def _wide_block_sparse_dq(spec: MaskSpec) -> Impl:
    """An A/B of the block-sparse dQ tile: 128x128 against the default 128x64 (sm_90,
    d=128). Since partial tiles compare row intervals (INTERVALS) the wider tile is
    spill-free in its loops under Triton 3.6 and 3.9 (4 B outside them under 3.6), and
    runs 298 / 328 warp-instructions per MFLOP in its full-tile loop against 370 / 431,
    561 / 591 in its partial-tile loop against 655 / 692. (The varlen dQ spills at
    128x128 in its masked loop: 20-40 B.) Its forward is the default's: fwd+bwd only."""
    from pallas_tpu.splash import BlockSizes

    wide = BlockSizes(block_q_dq=128, block_kv_dq=128)
    return block_sparse_impl(spec, wide, "dq 128x128", passes="fwd+bwd")


def _two_ctas_block_sparse(spec: MaskSpec) -> Impl:
    """An A/B of the block-sparse kernels' CTA shape: one warpgroup a CTA, two CTAs an
    SM (`BLOCK_SPARSE_TWO_CTA_TILES`: the forward at 64x128 and one stage, dQ at 64x64
    and dK/dV at 32x64 at two, 4 warps; dK/dV spills at 64x64 by pointers), against the
    defaults' two warpgroups a CTA, whose loops take 2-4 barriers of the whole CTA a tile
    (`TWO_CTA_BACKWARD_TILE`'s comment). Static report, sm_90, d=128, Triton 3.6 / 3.9,
    warp-instructions per MFLOP: forward 539 / 564 against 504 / 526, dQ 417 / 437
    against 370 / 432, dK/dV 538 / 549 against 502 / 555; no spill in the loops (dK/dV's
    64 / 56 B outside its loop)."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.block_sparse.config import BLOCK_SPARSE_TWO_CTA_TILES

    tiles = BLOCK_SPARSE_TWO_CTA_TILES
    two = AttentionConfigs(**{kind: AttentionKernelConfig(*tile) for kind, tile in tiles.items()})
    return block_sparse_impl(spec, label="4 warps two CTAs", config=two)


def _flex_forward_block_sparse(spec: MaskSpec) -> Impl:
    """An A/B of the block-sparse forward's tile: FlexAttention's on an H100 at d=128
    (128x64, 8 warps, three stages) against the default 128x128 at two; narrower key
    tiles leave fewer masked elements in a sparse mask's partial tiles (a window's
    edges, a document's diagonal). Static report, sm_90, Triton 3.6 / 3.9: 683 / 729
    warp-instructions per MFLOP against 504 / 526, no spill. Forward only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    flex = AttentionConfigs(forward=AttentionKernelConfig(128, 64, 8, 3))
    return block_sparse_impl(spec, label="forward 128x64 3 stages", config=flex, passes="forward")


def _flex_dkdv_block_sparse(spec: MaskSpec) -> Impl:
    """An A/B of the block-sparse dK/dV tile: FlexAttention's H100 config at d=128 (64
    queries a step into a 128-key tile, 8 warps, three stages; `_flex_dkdv_config` for
    the varlen kernel) against the default 32x128 at two. Static report, sm_90, d=128,
    causal, Triton 3.6: 389 warp-instructions per MFLOP in its full-tile loop against
    502, no spill in the loop (64 / 72 B stored / loaded a thread outside it; at two
    stages it spills in the loop, 128 B; under 3.9 it spills in the loop at either
    depth). fwd+bwd only."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig

    flex = AttentionConfigs(backward_dkdv=AttentionKernelConfig(64, 128, 8, 3))
    return block_sparse_impl(spec, label="dkdv 64x128 3 stages", config=flex, passes="fwd+bwd")


def _overlapped_block_sparse(spec: MaskSpec) -> tuple[Impl, Impl]:
    """A/B rows of the softmax overlap in the block-sparse kernels (`overlap_softmax`,
    as `_overlapped_forward` and `_overlapped_dkdv` for the varlen ones): the forward's
    full tiles at `OVERLAPPED_FORWARD_TILE`, the "forward 128x64 3 stages" row's tile,
    so that the two differ by the overlap alone (forward only); dK/dV at
    `OVERLAPPED_DKDV_TILE`, its default on sm_90 at d=128, so that it differs from the
    default by the overlap alone (fwd+bwd). Static report, sm_90, d=128, Triton 3.6: the
    forward's full-tile loop issues 34 of 34 exp2s beside the next QK^T's wgmma, dK/dV
    16 of 16 beside dP's (none without), no spill, not serialized (the careful relaunch,
    which only programs that met a non-finite value run, spills 32 B outside the
    forward's loop)."""
    from jax_bridge import AttentionConfigs, AttentionKernelConfig
    from triton_kernels.flash_attention.config import (
        OVERLAPPED_DKDV_TILE,
        OVERLAPPED_FORWARD_TILE,
    )

    forward = AttentionKernelConfig(*OVERLAPPED_FORWARD_TILE, overlap_softmax=True)
    dkdv = AttentionKernelConfig(*OVERLAPPED_DKDV_TILE, overlap_softmax=True)
    return (
        block_sparse_impl(spec, label="forward overlapped softmax",
                          config=AttentionConfigs(forward=forward), passes="forward"),
        block_sparse_impl(spec, label="dkdv overlapped softmax",
                          config=AttentionConfigs(backward_dkdv=dkdv), passes="fwd+bwd"),
    )  # fmt: skip


def block_sparse_cases(sizes: Sizes) -> list[Case]:
    """At `sizes.tokens`: causal, causal window, 16 causal documents, random 50% blocks;
    A/B rows of the sparse ones (the window and the documents): one warpgroup a CTA,
    FlexAttention's forward and dK/dV tiles and the softmax overlap; of the documents
    also the dQ tile."""
    t, heads = sizes.tokens, (sizes.heads, sizes.heads)
    specs = {
        "causal": (MaskSpec((t,)), True),
        f"window {sizes.window}": (MaskSpec((t,), window=sizes.window), False),
        "16 documents": (MaskSpec((t // 16,) * 16), True),
        "random 50%": (
            MaskSpec((t,), causal=False, keep=random_blocks(t, sizes.block), block=sizes.block),
            False,
        ),
    }

    def ab(name: str, spec: MaskSpec) -> tuple[Impl, ...]:
        if name.startswith("causal") or name.startswith("random"):
            return ()
        dq = (_wide_block_sparse_dq(spec),) if "documents" in name else ()
        flex = (_flex_forward_block_sparse(spec), _flex_dkdv_block_sparse(spec))
        overlap = _overlapped_block_sparse(spec)
        return (_two_ctas_block_sparse(spec), *flex, *overlap, *dq)

    return [
        _attention_case("block_sparse", "block_sparse_attention", f"{t} tok {name}", spec, heads,
                        sizes, block_sparse_impl(spec), _sdpa(spec) if sdpa else [],
                        variants=ab(name, spec))
        for name, (spec, sdpa) in specs.items()
    ]  # fmt: skip


def matmul_cases(sizes: Sizes) -> list[Case]:
    """Grouped matmul at each (m, k, n, groups): ragged_dot, the dense roofline, the
    memory roof, torch."""
    from triton_kernels.grouped_matmul.config import (
        HOPPER_WARP_SPECIALIZED_GMM,
        HOPPER_WARP_SPECIALIZED_TGMM,
    )

    cases = []
    for m, k, n, groups in sizes.matmuls:
        ragged = ragged_dot_impl()
        # XLA's ragged_dot gradient asked 33 GB at m 32768 on the H100 (out of memory):
        # about two float32 arrays of m * k * groups. Past 2**31 such words, forward only.
        if m * k * groups > 2**31:
            ragged = dataclasses.replace(ragged, grad=False)
        anchors = [ragged, dense_matmul_impl(), one_group_impl(), memory_roof_impl()]
        anchors += [persistent_gmm_impl(), persistent_tgmm_impl(groups)]
        if USE_TMA:
            anchors += [grouped_matmul_impl(tma=True), persistent_gmm_impl(tma=True)]
            anchors.append(tgmm_impl(groups))
        if USE_HOST_DESCRIPTORS:
            anchors += [
                grouped_matmul_impl(tma=True, host_descriptors=True),
                persistent_gmm_impl(tma=True, host_descriptors=True),
            ]
        if USE_WARP_SPECIALIZED:
            anchors += [
                grouped_matmul_impl(warp_specialized=tiling)
                for tiling in HOPPER_WARP_SPECIALIZED_GMM
            ]
            anchors.append(tgmm_impl(groups, HOPPER_WARP_SPECIALIZED_TGMM))
        if m // groups <= 256:
            anchors.append(grouped_matmul_impl(tiling=_GMM_SMALL_GROUP_TILING, num_warps=4))
        anchors.append(grouped_matmul_impl(op_tiling=_GMM_PREVIOUS_DEFAULT_TILING))
        if torch_available():
            anchors.append(torch_grouped_mm_impl())
        cases.append(
            Case(
                "grouped_matmul", "grouped_matmul", f"m{m} G{groups}",
                f"m{m} k{k} n{n} G{groups} bf16", "matmul", 2.0 * m * k * n,
                _matmul_inputs(m, k, n, groups), grouped_matmul_impl(), tuple(anchors),
                MATMUL_TOLERANCE, 2, {"num_groups": groups, "m": m, "k": k, "n": n},
            )
        )  # fmt: skip
    return cases


# Run order: each op's first row early (a GPU check may run out of time), then the rest
# (m 32768 among the first: the budget had skipped it last, and gmm's Hopper tile awaits
# its first timing there; 4 x 4096 not causal too: its A/B rows, the softmax overlaps and
# dK/dV's deeper pipeline on the tile dK/dV runs there by default, compare one change
# each, and the budget had cut it last; the head_dim 256 row last, a question of its own).
ORDER = (
    "16x1024 causal", "m8192 G64", "tok causal", "4x4096 causal", "not causal", "m32768 G32",
    "tok 16 documents", "mixed", "64x256 causal", "causal GQA", "1x16384 causal",
    "tok window", "tok random", "d256 causal",
)  # fmt: skip


def cases(sizes: Sizes) -> list[Case]:
    """Every GPU row, in `ORDER` at the GPU sizes (declaration order otherwise: varlen,
    block-sparse, grouped matmul)."""
    found = [*varlen_cases(sizes), *block_sparse_cases(sizes), *matmul_cases(sizes)]

    def rank(case: Case) -> int:
        return next((i for i, key in enumerate(ORDER) if key in case.key), len(ORDER))

    return sorted(found, key=rank)


def is_ab_anchor(impl: Impl) -> bool:
    """Ours in another configuration, checked against ours (the verdicts' A/B rows); ours
    on other work (gmm on one group: a roof, unchecked) is not one."""
    return impl.name.startswith("ours ") and impl.canonical is not None


def ab_apart(found: Sequence[Case], ab: str) -> list[Case]:
    """`found` with its A/B anchors placed by `ab`: "with-row" (each case as it is),
    "after" (every case with its other anchors first, what issue 27's bars and a user's
    choice compare; then, in the same order, each case with ours and its A/B anchors
    alone, ours timed again beside them), or "only" (that second part alone). Each A/B
    anchor compiles kernels of its own (the first two varlen rows hold a dozen each), so
    within a budget "after" reaches every bar before the first A/B."""
    if ab not in ("with-row", "after", "only"):
        raise ValueError(f"ab_apart: ab must be 'with-row', 'after' or 'only', got {ab!r}")
    if ab == "with-row":
        return list(found)
    plain = [
        dataclasses.replace(case, anchors=tuple(a for a in case.anchors if not is_ab_anchor(a)))
        for case in found
    ]
    ab_parts = [
        dataclasses.replace(case, key=f"{case.key} (A/B)", anchors=ab_anchors,
                            ab_part=True)
        for case in found
        if (ab_anchors := tuple(a for a in case.anchors if is_ab_anchor(a)))
    ]  # fmt: skip
    return ab_parts if ab == "only" else plain + ab_parts
