"""`python -m bench ring_attention`: its oracle against a float64 numpy loop, and the
section's own checks at a reduced size (the ring against the oracle, RingStats against
the numpy count)."""

from __future__ import annotations

import jax
import numpy as np

from bench import ring_attention
from tests.attention.helpers import assert_close, attention_tolerance


def _numpy_attention(q, k, v, ids) -> np.ndarray:
    """float64, one (batch, query, head) at a time: softmax over the keys of the query's
    document at or before it; 0 for padding (id 0) queries."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq, q_heads, dim = q.shape
    group = q_heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for i in range(seq):
            keys = [j for j in range(i + 1) if ids[b, j] == ids[b, i] > 0]
            for h in range(q_heads):
                if not keys:
                    continue
                scores = k[b, keys, h // group] @ q[b, i, h] / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[b, i, h] = weights @ v[b, keys, h // group] / weights.sum()
    return out


def test_the_oracle_is_causal_attention_within_documents() -> None:
    rng = np.random.default_rng()
    seq = 48
    q = rng.standard_normal((1, seq, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, seq, 2, 8)).astype(np.float32) for _ in range(2))
    # Random document boundaries, trailing padding, and one length-1 document.
    ids = np.repeat(np.arange(1, 7), [10, 1, 13, 9, 7, 8])[None].astype(np.int32)
    ids[:, -5:] = 0
    allowed = ring_attention.allowed_mask(ids)
    got = np.asarray(jax.jit(ring_attention.dense_reference)(q, k, v, ids, allowed))
    expected = _numpy_attention(q, k, v, ids)
    assert_close(got, expected, attention_tolerance(q[0], k[0]), "out")
    assert not got[0, -5:].any()


def test_the_bench_segment_ids_cross_every_shard_boundary_and_end_in_padding() -> None:
    """The section's own documents (seed 0): some run across every shard boundary at
    every ring size (another seed can put a boundary exactly on a shard's edge)."""
    seq = 256
    ids = ring_attention.segment_ids(seq)
    assert ids.shape == (ring_attention.BATCH, seq)
    assert (ids[:, -(seq // 32) :] == 0).all() and (ids[:, : -(seq // 32)] > 0).all()
    for ring_size in ring_attention.RING_SIZES[1:]:
        shard = seq // ring_size
        # Documents are longer than seq / 10 and shorter than seq / 3: some run across.
        across = [ids[0, s - 1] == ids[0, s] > 0 for s in range(shard, seq, shard)]
        assert any(across), ring_size


def test_the_section_checks_the_ring_against_the_oracle(monkeypatch, capsys) -> None:
    monkeypatch.setattr(ring_attention, "QUICK_SEQ", 256)
    monkeypatch.setattr(ring_attention, "QUICK_RING", 2)
    rows = ring_attention.main()
    timed = [row for row in rows if row.times]
    assert {row.op for row in timed} == {"ring_attention fwd", "ring_attention fwd+bwd"}
    assert all(row.ok for row in timed)
    # RingStats agreed with the numpy count at the timed ring size, in both cases.
    checked = [row for row in rows if row.op.startswith("ring work") and row.ok is not None]
    assert len(checked) == 2 and all(row.ok for row in checked)
    assert "DIFFERS" not in capsys.readouterr().out
