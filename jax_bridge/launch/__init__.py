"""Launching Triton kernels from JAX: the launch target, `triton_call`, the interpreter
adapter, lowering for cuda without a GPU and the static kernel report. Imports `core`
only (and `jax_triton` lazily, when a kernel launches on a GPU)."""
