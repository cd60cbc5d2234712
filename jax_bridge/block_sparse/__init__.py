"""Block-sparse attention from one mask algebra: `api` (the public op and its backend
table), `options` (its static half), `checks`, `masks` (padding, the static / traced
split, block lists and counts), `reference` (the dense oracle), `common` (sinks, delta)
and one module per backend."""
