"""Grouped matmul (gmm, tgmm): `api` (the public ops), `options` (their static half),
`checks`, `metadata` (the tile work list), `reference` (the dense oracle) and one module
per backend."""
