"""Pallas kernels for TPU (splash-style block-sparse attention). Imports JAX, never jax_bridge."""
