"""Block-sparse FlashAttention-2 kernels (forward, dQ, dK/dV) driven by per-tile lists,
and their launch configurations."""
