"""Grouped matmul kernels (gmm, tgmm) and their launch configs."""
