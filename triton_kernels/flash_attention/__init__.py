"""Varlen FlashAttention-2 kernels: forward, backward and their launch configs."""
