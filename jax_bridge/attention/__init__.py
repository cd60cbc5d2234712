"""Varlen attention: `api` (the public op), `padded` (the [batch, seq] layout), `spec`
(the semantics), `reference` (the dense oracle) and one module per backend."""
