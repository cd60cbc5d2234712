"""The model and training configurations, with the sizes the example, its tests and the
at-scale compile use."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE transformer over bytes.

    Layers come in blocks of `block_pattern`: each entry is a layer's attention window
    (None: global causal attention; an int w: causal, each query sees its w previous keys
    and itself). `num_blocks` blocks are scanned, so layers = num_blocks * len(pattern).
    """

    vocab: int = 256  # byte-level tokens
    hidden: int = 64
    num_blocks: int = 2
    block_pattern: tuple[int | None, ...] = (32, None)  # a sliding-window layer, a global one
    num_q_heads: int = 4
    num_kv_heads: int = 2  # GQA
    head_dim: int = 16
    ffn: int = 128  # per expert
    num_experts: int = 4
    top_k: int = 2
    rope_base: float = 10_000.0
    sinks: bool = True  # a learnable sink logit per head and layer (gpt-oss style)

    @property
    def num_layers(self) -> int:
        return self.num_blocks * len(self.block_pattern)

    def parameter_count(self) -> int:
        """Every parameter: embeddings, per-layer attention, norms, router and experts."""
        attention = self.hidden * self.head_dim * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        experts = self.num_experts * 2 * self.hidden * self.ffn + self.hidden * self.num_experts
        per_layer = attention + experts + 2 * self.hidden + self.num_q_heads
        return 2 * self.vocab * self.hidden + self.hidden + self.num_layers * per_layer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run: packed rows of `seq_len` tokens, `rows` of them per step (global batch)."""

    seq_len: int = 256
    rows: int = 4
    steps: int = 40
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    max_documents: int = 16  # per row: cu_seqlens has max_documents + 1 entries
    min_document: int = 8  # shorter pieces of text are not used as documents
    seed: int = 0

    def __post_init__(self) -> None:
        # A row shorter than the shortest document holds no document: every target would
        # be padding and the loss a constant 0 (nothing to train on).
        if self.min_document < 2:
            raise ValueError(
                f"TrainConfig: min_document must be >= 2 (a document of one token has no "
                f"next-token target), got {self.min_document}"
            )
        if self.seq_len < self.min_document:
            raise ValueError(
                f"TrainConfig: seq_len ({self.seq_len}) must be at least min_document "
                f"({self.min_document}): a shorter row holds no document to train on"
            )


TINY = ModelConfig()
# About 1B parameters, 8 experts top-2: the configuration compiled at scale (bench/train_aot).
ONE_BILLION = ModelConfig(
    vocab=32_768,
    hidden=1024,
    num_blocks=6,
    block_pattern=(4096, None),
    num_q_heads=16,
    num_kv_heads=4,
    head_dim=64,
    ffn=4608,
    num_experts=8,
    top_k=2,
)
