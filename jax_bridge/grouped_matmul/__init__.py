"""Grouped matmul (gmm, tgmm): `api` (the public ops), `checks`, `metadata` (the tile
work list), `reference` (the dense oracle) and one module per backend."""
