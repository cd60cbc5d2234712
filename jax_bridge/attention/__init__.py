"""Varlen attention: `api` (the public op), `options` (its static half), `padded` (the
[batch, seq] layout), `spec` (the semantics), `reference` (the dense oracle) and one
module per backend."""
