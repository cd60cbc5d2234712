"""What is specific to the Triton backend of block_sparse_attention: its tile lists, its
element rules, its cuda lowering and its kernels' static report. (Its numbers against the
oracle are in test_conformance.py, with every other backend.)"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_bridge import block_sparse_attention
from jax_bridge.block_sparse import tile_lists as tile_lists_module
from jax_bridge.block_sparse import triton as block_sparse_triton
from jax_bridge.block_sparse.masks import FULL, PARTIAL, head_groups, padded_shape
from jax_bridge.block_sparse.tile_lists import (
    INTERVALS,
    PREDICATE,
    TABLE,
    TOKENS,
    element_rule,
    tile_lists,
)
from pallas_tpu.splash import (
    BlockSizes,
    CausalMask,
    ChunkedCausalMask,
    DocumentMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    PredicateMask,
    PrefixLMMask,
)
from tests.attention.helpers import assert_close, assert_equal_to_rounding
from tests.block_sparse.test_conformance import (
    _inputs,
    _loss,
    _random_block_mask,
    _tolerance,
    check,
)
from tests.launches import record_launches
from triton_kernels.block_sparse.backward import block_sparse_dkdv_kernel, block_sparse_dq_kernel
from triton_kernels.block_sparse.forward import block_sparse_forward_kernel
from triton_kernels.flash_attention.config import AttentionConfigs, AttentionKernelConfig


def _block_classes(dense: np.ndarray, block_shape) -> np.ndarray:
    """EMPTY / PARTIAL / FULL of each block of a dense mask padded with False."""
    bq, bk = block_shape
    rows, cols = -(-dense.shape[0] // bq) * bq, -(-dense.shape[1] // bk) * bk
    padded = np.zeros((rows, cols), bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    blocks = padded.reshape(rows // bq, bq, cols // bk, bk)
    return np.where(blocks.all((1, 3)), FULL, np.where(blocks.any((1, 3)), PARTIAL, 0))


@hypothesis.given(
    q_len=st.integers(1, 70),
    kv_len=st.integers(1, 70),
    block=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
    kv_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lists_visit_exactly_the_nonempty_tiles_full_first_heaviest_first(
    q_len, kv_len, block, kv_major, seed
):
    """Invariant: for each stationary tile, its list is the set of non-empty tiles of the
    other side, full ones first (`counts` = (full, total)); a partial tile's table block
    is its element mask; the program order visits every stationary tile of every group
    once, by non-increasing work."""
    rng = np.random.default_rng(seed)
    dense = [rng.random((q_len, kv_len)) < p for p in (0.1, 0.6)]
    dense[1][:, : kv_len // 2] = True  # some full tiles
    mask = MultiHeadMask([NumpyMask(dense[0]), NumpyMask(dense[1]), NumpyMask(dense[0])])
    groups = head_groups(mask, 3)
    lists = tile_lists(groups, block, q_len, kv_len, kv_major)
    for g in range(len(groups)):
        classes = _block_classes(dense[g % 2], block)
        if kv_major:
            classes = classes.T
        assert lists.counts.shape[1] == classes.shape[0]
        for tile, row in enumerate(classes):
            full, total = lists.counts[g, tile]
            visited = lists.tiles[g, tile, :total]
            assert full == np.sum(row == FULL) and total == np.sum(row != 0)
            assert set(visited) == set(np.flatnonzero(row))
            assert np.all(row[visited[:full]] == FULL) and np.all(row[visited[full:]] == PARTIAL)
            for other, code in zip(visited[full:], lists.codes[g, tile, full:total], strict=True):
                q_tile, kv_tile = (other, tile) if kv_major else (tile, other)
                rows = slice(q_tile * block[0], (q_tile + 1) * block[0])
                cols = slice(kv_tile * block[1], (kv_tile + 1) * block[1])
                want = np.zeros(block, bool)
                part = dense[g % 2][rows, cols]
                want[: part.shape[0], : part.shape[1]] = part
                np.testing.assert_array_equal(lists.table[code] != 0, want)
    work = lists.counts[..., 1]
    if kv_major:
        per_tile = sum(len(h) * work[g] for g, (h, _) in enumerate(groups))
        assert sorted(lists.items) == list(range(work.shape[1]))
        assert np.all(np.diff(per_tile[lists.items]) <= 0)
    else:
        pairs = {(int(t), int(g)) for t, g in lists.items}
        assert pairs == {(t, g) for g in range(len(groups)) for t in range(work.shape[1])}
        assert np.all(np.diff(work[lists.items[:, 1], lists.items[:, 0]]) <= 0)


def _rule_values(rule, q_len: int, kv_len: int) -> np.ndarray:
    """The element rule's mask on the real rectangle, evaluated with numpy as the kernel
    does (intervals: lo <= kv row <= hi; tokens: same document, window, prefix)."""
    if rule.mode == INTERVALS:
        lo, hi = (np.asarray(rule.arrays[i])[:q_len, None] for i in (0, 2))
        kv = np.arange(kv_len)[None, :]
        return (kv >= lo) & (kv <= hi)
    q_doc, kv_doc, q_pos, kv_pos = (np.asarray(a)[:n] for a, n in zip(
        rule.arrays, (q_len, kv_len, q_len, kv_len), strict=True
    ))  # fmt: skip
    q, kv = q_pos[:, None].astype(np.int64), kv_pos[None, :].astype(np.int64)
    inside = np.ones((q_len, kv_len), bool)
    left, right = rule.window
    if left is not None:
        inside &= kv >= q - left
    if right is not None:
        inside &= kv <= q + right
    if rule.prefix is not None:
        inside |= kv < rule.prefix
    return (q_doc[:, None] == kv_doc[None, :]) & inside


def _segment_ids(rng, length: int) -> np.ndarray:
    """Ascending positive document ids, then padding (0)."""
    ids = np.sort(rng.integers(1, 4, length))
    ids[length - int(rng.integers(0, length // 3 + 1)) :] = 0
    return ids.astype(np.int32)


@hypothesis.given(
    kind=st.sampled_from(["causal", "local", "chunked", "prefix", "documents", "segments"]),
    q_len=st.integers(1, 60),
    kv_len=st.integers(1, 60),
    seed=st.integers(0, 2**16),
    intervals=st.booleans(),
)
def test_position_rules_equal_the_mask(kind, q_len, kv_len, seed, intervals):
    """Invariant: a mask with a position rule gets the INTERVALS rule (each row one run
    of kv rows) or, where that form is not taken, the TOKENS rule, and the rule equals
    the mask on every (q, kv) pair; padded query rows allow nothing (intervals: lo > hi)
    and padded tokens belong to no document. Every mask here has one run a row."""
    rng = np.random.default_rng(seed)
    shape = (q_len, kv_len)
    offset = int(rng.integers(-5, 10))
    mask = {
        "causal": lambda: CausalMask(shape, offset=offset),
        "local": lambda: LocalMask(
            shape, (int(rng.integers(0, 9)), int(rng.integers(0, 4))), offset
        ),
        "chunked": lambda: ChunkedCausalMask(shape, chunk_size=int(rng.integers(1, 20))),
        "prefix": lambda: PrefixLMMask(shape, int(rng.integers(0, kv_len + 1)), offset=offset),
        "documents": lambda: DocumentMask(
            np.r_[0, np.sort(rng.integers(0, min(shape) + 1, 2)), min(shape)].astype(np.int32),
            shape=shape,
            window=(int(rng.integers(0, 6)), 0),
        ),
        "segments": lambda: DocumentMask.from_segment_ids(
            *(_segment_ids(rng, n) for n in shape), causal=bool(rng.integers(2))
        ),
    }[kind]()
    q_tokens, kv_tokens = padded_shape(q_len, kv_len, (32, 32))
    with pytest.MonkeyPatch.context() as patch:
        if not intervals:
            patch.setattr(tile_lists_module, "_interval_rule", lambda mask, q_tokens: None)
        rule = element_rule(((tuple(range(2)), mask),), q_tokens, kv_tokens)
    assert rule.mode == (INTERVALS if intervals else TOKENS)
    np.testing.assert_array_equal(_rule_values(rule, q_len, kv_len), np.asarray(mask[:, :]))
    if intervals:
        lo, hi = (np.asarray(rule.arrays[i]) for i in (0, 2))
        assert len(lo) == q_tokens and np.all(lo[q_len:] > hi[q_len:])
        assert np.all((lo >= 0) & (hi < kv_len))  # never a padded key
    else:
        q_doc, kv_doc = (np.asarray(a) for a in rule.arrays[:2])
        assert np.all(q_doc[q_len:] == -1) and np.all(kv_doc[kv_len:] == -2)


def test_other_masks_read_the_table_and_predicates_their_kernel_function():
    shape = (40, 40)
    predicate = PredicateMask(shape, lambda q, kv: q >= kv, triton_predicate=object.__call__)
    table = [
        NumpyMask(np.tri(40, dtype=bool)),
        CausalMask(shape) | LocalMask(shape, (2, 2), 0),
        PredicateMask(shape, lambda q, kv: q >= kv),
    ]
    for mask in table:
        assert element_rule((((0,), mask),), 64, 64).mode == TABLE
    assert element_rule((((0,), predicate),), 64, 64).mode == PREDICATE
    assert element_rule((((0,), CausalMask(shape)),), 64, 64).mode == INTERVALS
    # kv positions other than the row numbers: the token rule
    moved = CausalMask(shape, kv_sequence=np.arange(40)[::-1].copy())
    assert element_rule((((0,), moved),), 64, 64).mode == TOKENS
    two_groups = head_groups(MultiHeadMask([CausalMask(shape), LocalMask(shape, (2, 2), 0)]), 2)
    assert element_rule(two_groups, 64, 64).mode == TABLE


@pytest.mark.parametrize("compute_capability", [80, 90])
def test_lowers_for_cuda_with_each_element_rule(compute_capability):
    """jax_triton's real lowering (Triton to PTX and cubin, no GPU): forward, dQ and dK/dV,
    each launched twice (the second CAREFUL), for row intervals, a token rule, the table
    and an in-kernel predicate, and a score hook with its derivative after ALiBi, in
    bfloat16."""
    from jax_bridge import block_sparse_attention
    from jax_bridge.launch.lowering import lower_for_cuda
    from tests.block_sparse.test_conformance import SCORE_MODS, _every_fifth, _every_fifth_triton

    length = 256
    shape = (length, length)
    calls = [
        (PrefixLMMask(shape, 40), None),
        (CausalMask(shape, kv_sequence=np.arange(length)[::-1].copy()), None),
        (NumpyMask(np.random.default_rng(0).random(shape) < 0.3), None),
        (PredicateMask(shape, _every_fifth, triton_predicate=_every_fifth_triton), None),
        (CausalMask(shape), SCORE_MODS["square_cap"]),
    ]
    spec = lambda heads: jax.ShapeDtypeStruct((1, length, heads, 64), jnp.bfloat16)
    for mask, hook in calls:

        def step(q, k, v, mask=mask, hook=hook):
            slopes = None if hook is None else jnp.linspace(0.1, 0.4, 4)

            def loss(q, k, v):
                out = block_sparse_attention(
                    q, k, v, mask, score_mod=hook, alibi_slopes=slopes, implementation="triton"
                )
                return jnp.sum(out.astype(jnp.float32))

            return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

        text = lower_for_cuda(
            step, spec(4), spec(2), spec(2), compute_capability=compute_capability
        )
        assert text.count("triton_kernel_call") == 6


# The forward finds the rows that see a non-finite value after its loops, not in them
# (a select on the accumulator serialized the loop's wgmma); on sm_90 that cold pass
# costs the light d=128 tile a few bytes of spill outside the loops (4 B under Triton
# 3.6, 12 B under 3.9).
_FORWARD_SPILL_OUTSIDE_LOOP = 16
# dK/dV at d=128 (64x64 on Ampere-class GPUs) with a soft cap and ALiBi on sm_86 under
# Triton 3.6: 8 B loaded once, none in its loop.
_DKDV_SPILL_OUTSIDE_LOOP = 8


@pytest.mark.parametrize("compute_capability", [80, 86, 90])
@pytest.mark.parametrize(
    ("head_dim", "soft_cap", "alibi"),
    [(64, False, False), (128, False, False), (128, True, False), (128, True, True)],
)
@pytest.mark.parametrize("kind", ["forward", "backward_dq", "backward_dkdv"])
def test_static_report_at_default_configs(compute_capability, head_dim, soft_cap, alibi, kind):
    """The default tiles (bf16, a causal mask's token rule, GQA; a soft cap, and ALiBi
    too, in the register-heavy cases): no spills (the forward: none in its loop, at most
    `_FORWARD_SPILL_OUTSIDE_LOOP` bytes outside), tensor cores, wgmma on sm_90 and not
    serialized; there, without either, the full-tile loop costs at most 10% more
    warp-instructions per MFLOP than the varlen kernel's unmasked loop. dK/dV: none in
    its loop, at most `_DKDV_SPILL_OUTSIDE_LOOP` bytes outside."""
    from jax_bridge.launch.report import variant_report
    from triton_kernels.catalog import attention_variant, block_sparse_variant

    variant = block_sparse_variant(
        kind, head_dim, compute_capability, soft_cap=soft_cap, alibi=alibi
    )
    report = variant_report(variant, compute_capability)
    print(variant.description, report.summary(), report.instructions_per_mflop)
    allowed = {"forward": _FORWARD_SPILL_OUTSIDE_LOOP, "backward_dkdv": _DKDV_SPILL_OUTSIDE_LOOP}
    allowed = allowed.get(kind, 0)
    spilled = max(report.spill_store_bytes, report.spill_load_bytes)
    assert not report.loop_spills and spilled <= allowed, report.summary()
    assert report.uses_mma, report.summary()
    if compute_capability >= 90:
        assert report.uses_wgmma and not report.serialized_wgmma, report.summary()
        if not soft_cap:
            varlen = variant_report(attention_variant(kind, head_dim, compute_capability), 90)
            assert report.instructions_per_mflop <= 1.1 * varlen.instructions_per_mflop


# The careful relaunch (programs that met a non-finite value) at the default sm_90 tiles:
# dK/dV spills a few bytes outside its loops (up to 8 B under either Triton, one or four query
# heads a kv head).
_CAREFUL_SPILL_OUTSIDE_LOOP = 16


@pytest.mark.parametrize("heads", [(16, 16), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("kind", ["forward", "backward_dq", "backward_dkdv"])
def test_static_report_of_the_careful_relaunch(kind, heads):
    """The second launch's kernels (CAREFUL) at the default sm_90 tiles (bf16, d=128, a
    causal mask's token rule), with one query head a kv head and with a GQA group: wgmma
    not serialized, nothing spilled in a loop. Under Triton 3.9 dK/dV's NaN select on its
    accumulators inside the loop serialized its wgmma with one query head a kv head (the
    bench rows' layout; the catalog's GQA group hid it): it only notes a non-finite row
    there, and `_keys_seeing_bad_rows` finds the key rows after the loops."""
    from jax_bridge.launch.report import variant_report
    from triton_kernels.catalog import block_sparse_variant

    variant = block_sparse_variant(kind, 128, 90)
    constexprs = {**variant.constexprs, "CAREFUL": True}
    constexprs.update(NUM_Q_HEADS=heads[0], NUM_KV_HEADS=heads[1])
    report = variant_report(dataclasses.replace(variant, constexprs=constexprs), 90)
    print(variant.description, heads, report.summary())
    assert report.uses_wgmma and not report.serialized_wgmma, report.summary()
    spilled = max(report.spill_store_bytes, report.spill_load_bytes)
    assert not report.loop_spills and spilled <= _CAREFUL_SPILL_OUTSIDE_LOOP, report.summary()


# dQ at d=256 takes the varlen table's 128x32 on sm_90: under Triton 3.6 it spills 24-68 B
# a thread outside its loops, once a program (none under 3.9).
_DQ_256_SPILL_OUTSIDE_LOOPS = 68


@pytest.mark.parametrize(("soft_cap", "alibi"), [(False, False), (True, True)])
def test_static_report_of_the_dq_at_head_dim_256(soft_cap, alibi):
    """dQ's default at d=256 (sm_90, bf16, a causal mask's token rule, GQA; a soft cap and
    ALiBi too): a stationary tile of 128 query rows, so each warpgroup owns m64 of them;
    no spill in its loop, at most `_DQ_256_SPILL_OUTSIDE_LOOPS` bytes outside it under
    3.6 (none under 3.9), wgmma not serialized, and without options the full-tile loop
    within 10% of the varlen kernel's."""
    from jax_bridge.launch.report import variant_report
    from tests.attention.test_lowering import TRITON_3_6
    from triton_kernels.catalog import attention_variant, block_sparse_variant

    variant = block_sparse_variant("backward_dq", 256, 90, soft_cap=soft_cap, alibi=alibi)
    assert variant.constexprs["BLOCK_M"] == 128, variant.description
    report = variant_report(variant, 90)
    print(variant.description, report.summary(), report.instructions_per_mflop)
    allowed = _DQ_256_SPILL_OUTSIDE_LOOPS if TRITON_3_6 else 0
    spilled = max(report.spill_store_bytes, report.spill_load_bytes)
    assert not report.loop_spills and spilled <= allowed, report.summary()
    assert report.uses_wgmma and not report.serialized_wgmma, report.summary()
    if not soft_cap:
        varlen = variant_report(attention_variant("backward_dq", 256, 90), 90)
        assert report.instructions_per_mflop <= 1.1 * varlen.instructions_per_mflop


# The careful relaunch of head-major dK/dV at d=256 with one query head a kv head spills
# outside its loops (the cold pass over the flagged rows and the stores): 16-64 B under
# Triton 3.6, 80-288 B under 3.9 (with a soft cap and ALiBi the most); key-major 16x64's
# spilled 56-92 B there. It runs for the programs that met a non-finite value only.
_CAREFUL_HEAD_MAJOR_SPILL_OUTSIDE_LOOP = 288


@pytest.mark.parametrize("careful", [False, True], ids=["first-launch", "careful"])
@pytest.mark.parametrize("heads", [(16, 16), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize(("soft_cap", "alibi"), [(False, False), (True, True)])
def test_static_report_of_the_head_major_dkdv_at_head_dim_256(soft_cap, alibi, heads, careful):
    """dK/dV's default at d=256 on sm_90 is the varlen kernel's head-major tile (its
    products' rows are the head dim, so neither warpgroup repeats one: key-major 16x64
    ran K Q^T and V dO^T in both): each product once, no spill in a loop (a soft cap and
    ALiBi too, either launch, one or four query heads a kv head) nor, but in the careful
    relaunch, outside, wgmma not serialized, and without options the full-tile loop
    within 10% of the varlen kernel's."""
    from jax_bridge.launch.report import variant_report
    from triton_kernels.catalog import attention_variant, block_sparse_variant

    variant = block_sparse_variant("backward_dkdv", 256, 90, soft_cap=soft_cap, alibi=alibi)
    assert variant.constexprs["HEAD_MAJOR"], variant.description
    constexprs = {**variant.constexprs, "CAREFUL": careful}
    constexprs.update(NUM_Q_HEADS=heads[0], NUM_KV_HEADS=heads[1])
    report = variant_report(dataclasses.replace(variant, constexprs=constexprs), 90)
    print(variant.description, heads, report.summary(), report.instructions_per_mflop)
    assert report.mma_redundancy == 1.0, report.summary()
    allowed = _CAREFUL_HEAD_MAJOR_SPILL_OUTSIDE_LOOP if careful else 0
    spilled = max(report.spill_store_bytes, report.spill_load_bytes)
    assert not report.loop_spills and spilled <= allowed, report.summary()
    assert report.uses_wgmma and not report.serialized_wgmma, report.summary()
    if not (soft_cap or careful) and heads == (8, 2):
        varlen = variant_report(attention_variant("backward_dkdv", 256, 90), 90)
        assert report.instructions_per_mflop <= 1.1 * varlen.instructions_per_mflop


@pytest.mark.parametrize("kind", ["forward", "backward_dkdv"])
def test_overlapped_softmax_issues_exp2s_beside_an_mma(kind):
    """`overlap_softmax` at the varlen A/B rows' tiles (sm_90, d=128, bf16, causal): the
    forward's full-tile loop issues every exp2 while the next tile's QK^T wgmma is in
    flight (none without the overlap); dK/dV issues dP's wgmma before the first exp2
    (after it without the overlap), and under Triton 3.6, whose code the device
    assembles, ptxas keeps exp2s beside it (3.9's code it makes wait for dP first); no
    spill, not serialized. The careful relaunch (programs that met a non-finite value)
    too, but for a few bytes of spill outside the loop (32 B with the forward's overlap
    under 3.6)."""
    from jax_bridge.launch.report import compile_offline, variant_report
    from tests.attention.test_lowering import TRITON_3_6
    from triton_kernels.catalog import block_sparse_variant
    from triton_kernels.flash_attention.config import (
        OVERLAPPED_DKDV_TILE,
        OVERLAPPED_FORWARD_TILE,
    )

    tile = {"forward": OVERLAPPED_FORWARD_TILE, "backward_dkdv": OVERLAPPED_DKDV_TILE}[kind]
    variants = {
        overlap: block_sparse_variant(
            kind, 128, 90, config=AttentionKernelConfig(*tile, overlap_softmax=overlap)
        )
        for overlap in (False, True)
    }
    reports = {overlap: variant_report(variant, 90) for overlap, variant in variants.items()}
    for report in reports.values():
        print(report.summary(), report.inner_loop)
        assert not report.spills and not report.serialized_wgmma, report.summary()
    assert reports[False].inner_loop.mufu_beside_mma == 0
    loop = reports[True].inner_loop
    if kind == "forward":
        assert loop.mufu_beside_mma == loop.mufu > 0
    else:
        for overlap, variant in variants.items():
            ttgir = compile_offline(
                variant.kernel, variant.signature, variant.constexprs, compute_capability=90,
                num_warps=variant.num_warps, num_stages=variant.num_stages,
            ).asm["ttgir"]  # fmt: skip
            before_exp2 = ttgir[: ttgir.index("math.exp2")].count("ttng.warp_group_dot ")
            assert before_exp2 == (2 if overlap else 1)  # QK^T, then dP where overlapped
        if TRITON_3_6:
            assert loop.mufu_beside_mma > 0
    careful = dataclasses.replace(
        variants[True], constexprs={**variants[True].constexprs, "CAREFUL": True}
    )
    report = variant_report(careful, 90)
    assert not report.loop_spills and not report.serialized_wgmma, report.summary()
    assert report.spill_store_bytes <= 32, report.summary()


def _use_rule(monkeypatch, rule: str) -> None:
    """Documents take the INTERVALS rule; "tokens" makes them take the TOKENS one."""
    if rule == "tokens":
        monkeypatch.setattr(tile_lists_module, "_interval_rule", lambda mask, q_tokens: None)


@pytest.mark.parametrize("rule", ["intervals", "tokens", "table"])
@pytest.mark.parametrize("find_in_kernel", [False, True], ids=["copy-of-v", "in-kernel"])
def test_forward_isolates_non_finite_values_either_way(monkeypatch, find_in_kernel, rule):
    """V's non-finite rows found by the forward kernel in its partial tiles (sm_90 and up)
    or read from the bridge's copy and flags (sm_80..89), in the second (CAREFUL) launch
    that the first's non-finite results call for: the same outputs, and a NaN or an
    infinity in one document's V reaches exactly the rows that see it. Rows of the other
    documents are the clean call's, bit for bit within each path. The same documents as
    intervals, as a token rule and as a table of partial blocks (the in-kernel path finds
    the rows after its loop, evaluating the mask transposed)."""
    from jax_bridge import block_sparse_attention
    from jax_bridge.block_sparse import triton as block_sparse_triton

    monkeypatch.setattr(block_sparse_triton, "finds_bad_rows_in_kernel", lambda cc: find_in_kernel)
    _use_rule(monkeypatch, rule)
    length = 96
    cu = np.array([0, 30, 70, 96], np.int32)
    mask = DocumentMask(cu, shape=(length, length), causal=True)
    if rule == "table":
        doc = np.searchsorted(cu, np.arange(length), side="right")
        mask = NumpyMask((doc[:, None] == doc[None, :]) & np.tri(length, dtype=bool))
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, 2, 32)), jnp.float32) for _ in "qkv")

    def attend(v):
        return block_sparse_attention(q, k, v, mask, implementation="triton")

    clean = np.asarray(attend(v))
    bad = np.asarray(attend(v.at[:, 40, 0].set(jnp.nan).at[:, 75, 1, 3].set(jnp.nan)))[0]
    seen = np.zeros((length, 2), bool)  # (query row, head): MHA, so kv head = query head
    seen[40:70, 0] = True  # document 2's causal rows from 40
    seen[75:96, 1] = True  # document 3's from 75
    assert np.isnan(bad[seen]).any(axis=-1).all()
    assert_equal_to_rounding(bad[~seen], clean[0][~seen], "unseen rows")
    reference = block_sparse_attention(q, k, v, mask, implementation="xla")
    np.testing.assert_allclose(clean, np.asarray(reference), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rule", ["intervals", "tokens"])
@pytest.mark.parametrize("find_in_kernel", [False, True], ids=["copy-of-k", "in-kernel"])
def test_dq_isolates_non_finite_keys_either_way(monkeypatch, find_in_kernel, rule):
    """K's non-finite rows found by the dQ kernel in its partial tiles (sm_90 and up) or
    read from the bridge's copy and flags, in its second launch: dQ is NaN in exactly the
    rows that see them, and every other row is the clean call's, bit for bit."""
    from jax_bridge import block_sparse_attention
    from jax_bridge.block_sparse import triton as block_sparse_triton

    monkeypatch.setattr(block_sparse_triton, "finds_bad_rows_in_kernel", lambda cc: find_in_kernel)
    _use_rule(monkeypatch, rule)
    length = 96
    mask = DocumentMask(np.array([0, 30, 70, 96], np.int32), shape=(length, length), causal=True)
    rng = np.random.default_rng(9)
    q, k, v, w = (jnp.asarray(rng.normal(size=(1, length, 2, 32)), jnp.float32) for _ in "qkvw")

    def dq(k):
        loss = lambda q: jnp.sum(w * block_sparse_attention(q, k, v, mask, implementation="triton"))
        return np.asarray(jax.grad(loss)(q))[0]

    clean, bad = dq(k), dq(k.at[:, 40, 0].set(jnp.nan).at[:, 75, 1, 3].set(jnp.inf))
    seen = np.zeros((length, 2), bool)  # (query row, head): MHA, so kv head = query head
    seen[40:70, 0] = True
    seen[75:96, 1] = True
    assert np.isnan(bad[seen]).any(axis=-1).all()
    assert_equal_to_rounding(bad[~seen], clean[~seen], "unseen rows")


@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("rule", ["intervals", "tokens"])
@pytest.mark.parametrize("find_in_kernel", [False, True], ids=["xla-flags", "dq-flags"])
def test_dkdv_isolates_non_finite_queries_and_cotangents(monkeypatch, find_in_kernel, rule, group):
    """A NaN in one query row and an infinity in one row of the output's cotangent reach
    exactly the key rows those queries see (causal, inside their document): dK there is
    non-finite (through the scores or dS), and so is dV for the cotangent's row (the NaN
    query's forward row has no mass, lse -inf: it adds nothing to dV). Every other row is
    the clean call's, bit for bit: the partial tiles around them read those rows as 0,
    flagged by the dQ kernel (sm_90 and up) or by XLA (sm_80..89), and the second launch
    finds the key rows that see them over every query head of the kv head's group."""
    from jax_bridge import block_sparse_attention
    from jax_bridge.block_sparse import triton as block_sparse_triton

    monkeypatch.setattr(block_sparse_triton, "finds_bad_rows_in_kernel", lambda cc: find_in_kernel)
    _use_rule(monkeypatch, rule)
    length = 96
    mask = DocumentMask(np.array([0, 30, 70, 96], np.int32), shape=(length, length), causal=True)
    rng = np.random.default_rng(10)
    q, w = (jnp.asarray(rng.normal(size=(1, length, 2 * group, 32)), jnp.float32) for _ in "qw")
    k, v = (jnp.asarray(rng.normal(size=(1, length, 2, 32)), jnp.float32) for _ in "kv")

    def dkdv(q, w):
        attend = lambda k, v: block_sparse_attention(q, k, v, mask, implementation="triton")
        _, vjp = jax.vjp(attend, k, v)
        return [np.asarray(g)[0] for g in vjp(w)]

    (dk, dv), (bad_dk, bad_dv) = (
        dkdv(q, w),
        # query head 0 is kv head 0's; the last query head is kv head 1's
        dkdv(q.at[:, 40, 0].set(jnp.nan), w.at[:, 75, 2 * group - 1, 3].set(jnp.inf)),
    )
    seen = np.zeros((length, 2), bool)  # (key row, kv head)
    seen[30:41, 0] = True  # query 40 of document 2 (rows 30..69) sees keys 30..40
    seen[70:76, 1] = True  # query 75 of document 3 sees keys 70..75
    assert not np.isfinite(bad_dk[seen]).all(axis=-1).any()
    assert not np.isfinite(bad_dv[70:76, 1]).all(axis=-1).any()
    assert_equal_to_rounding(bad_dk[~seen], dk[~seen], "unseen dk")
    assert_equal_to_rounding(bad_dv[~seen], dv[~seen], "unseen dv")


# ----------------------------------------------------------------- launch configurations

_CONFIGS = AttentionConfigs(
    forward=AttentionKernelConfig(32, 16, 4, 3),
    backward_dq=AttentionKernelConfig(16, 32, 2, 1),
    backward_dkdv=None,  # the default, tiled by block_sizes below
)
_AGREEING_BLOCKS = BlockSizes(block_q=32, block_q_dkv=16, block_kv_dkv=16)


def test_config_gives_each_kernel_its_tile_warps_and_stages(monkeypatch):
    """`config` sets a kernel's whole launch (tile, warps, stages; both of its launches,
    the plain one and the careful one); a kernel it leaves None keeps its default warps
    and stages at block_sizes' tile; one AttentionKernelConfig reaches all three."""
    q, k, v, _, _ = _inputs(3, 40)
    mask = CausalMask((40, 40))
    options = block_sparse_triton.BlockSparseOptions(
        mask=mask, softmax_scale=1.0, implementation="triton"
    )
    default = block_sparse_triton._config(options, "backward_dkdv", 16, q.dtype, False)
    launches = record_launches(monkeypatch, block_sparse_triton)

    def loss(q, k, v):
        out = block_sparse_attention(q, k, v, mask, implementation="triton", config=_CONFIGS,
                                     block_sizes=_AGREEING_BLOCKS)  # fmt: skip
        return jnp.sum(out)

    jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    kernels = (block_sparse_forward_kernel, block_sparse_dq_kernel, block_sparse_dkdv_kernel)
    seen = {
        kernel: {(x.constexprs["BLOCK_M"], x.constexprs["BLOCK_N"], x.num_warps, x.num_stages)
                 for x in launches if x.kernel is kernel}
        for kernel in kernels
    }  # fmt: skip
    assert seen == {
        block_sparse_forward_kernel: {(32, 16, 4, 3)},
        block_sparse_dq_kernel: {(16, 32, 2, 1)},
        block_sparse_dkdv_kernel: {(16, 16, default.num_warps, default.num_stages)},
    }
    launches.clear()
    one = AttentionKernelConfig(16, 32, 2, 2)
    jax.grad(lambda q: jnp.sum(block_sparse_attention(
        q, k, v, mask, implementation="triton", config=one)))(q)  # fmt: skip
    assert {(x.constexprs["BLOCK_M"], x.constexprs["BLOCK_N"], x.num_warps, x.num_stages)
            for x in launches} == {(16, 32, 2, 2)}  # fmt: skip


@pytest.mark.parametrize(
    "config, block_sizes",
    [(_CONFIGS, _AGREEING_BLOCKS), (AttentionKernelConfig(16, 32, 2, 2), None)],
    ids=["per-kernel", "one-for-all"],
)
def test_config_gives_the_float64_numbers(config, block_sizes):
    """Launch configurations other than the defaults (tiles unequal and across the
    documents' edges, 1-4 warps, 1-3 stages) give the float64 oracle's out, lse and
    gradients, with sinks, on documents of 1, 59 and 90 tokens."""
    q, k, v, sinks, weights = _inputs(21, 150, num_q_heads=4, num_kv_heads=2, head_dim=32)
    mask = DocumentMask(np.array([0, 1, 60, 150], np.int32), shape=(150, 150), causal=True)
    check("triton", mask, q, k, v, sinks, weights, config=config, block_sizes=block_sizes)


def test_overlapped_softmax_reaches_the_forward_and_dkdv_kernels(monkeypatch):
    """One config with `overlap_softmax` for every kernel gives it to the forward and
    dK/dV (both of each one's launches), not to dQ (its own config with it is refused
    where configs are built)."""
    q, k, v, _, _ = _inputs(3, 40)
    launches = record_launches(monkeypatch, block_sparse_triton)
    config = AttentionKernelConfig(16, 16, overlap_softmax=True)
    jax.grad(lambda q: jnp.sum(block_sparse_attention(
        q, k, v, CausalMask((40, 40)), implementation="triton", config=config)))(q)  # fmt: skip
    overlap = {}
    for launch in launches:
        overlap.setdefault(launch.kernel, []).append(launch.constexprs.get("OVERLAP_SOFTMAX"))
    assert overlap == {
        block_sparse_forward_kernel: [True, True],
        block_sparse_dq_kernel: [None, None],
        block_sparse_dkdv_kernel: [True, True],
    }


def _tile_list_case(case: str, seed: int, block_kv: int) -> tuple[object, dict]:
    """(mask, op kwargs) over 150 tokens whose query tiles' lists hold no full tile, one
    and many: "documents-nan" (documents of 1, 59 and 90 tokens), "local-soft-cap" (a
    40-token window, a soft cap), "random-blocks-alibi" (random 16 x `block_kv` blocks
    drawn by `seed`, a fully masked row among them; ALiBi)."""
    if case == "documents-nan":
        return DocumentMask(np.array([0, 1, 60, 150], np.int32), shape=(150, 150), causal=True), {}
    if case == "local-soft-cap":
        return LocalMask((150, 150), (40, 0), 0), dict(logits_soft_cap=6.0)
    mask = NumpyMask(_random_block_mask(seed, 150, 150, block_q=16, block_kv=block_kv))
    return mask, dict(alibi_slopes=jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32))


# The interpreter's row max over a NaN query row (the reduction warns; a GPU does not).
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("case", ["documents-nan", "local-soft-cap", "random-blocks-alibi"])
def test_head_major_dkdv_gives_the_float64_numbers_and_the_key_major_ones(case):
    """dK/dV head-major (`AttentionKernelConfig.head_major`: dK^T = Q^T dS, dV^T = dO^T
    P, its tiles' scores, score hooks and element masks as the forward's) over query
    tiles whose lists hold no full tile, one and many (documents of 1, 59 and 90 tokens,
    a window with a soft cap, random blocks with a fully masked row and ALiBi), GQA,
    sinks: the float64 oracle's gradients, and the key-major kernel's at the same tile;
    with a NaN in one query row (the careful relaunch's rows flagged by dQ), the same
    elements of dK and dV NaN: every key that sees the row in dK, none that does not."""
    q, k, v, sinks, weights = _inputs(33, 150, num_q_heads=4, num_kv_heads=2, head_dim=32)
    mask, kwargs = _tile_list_case(case, seed=7, block_kv=32)

    def configs(head_major):
        dkdv = AttentionKernelConfig(16, 32, head_major=head_major)
        return AttentionConfigs(backward_dkdv=dkdv)

    check("triton", mask, q, k, v, sinks, weights, config=configs(True), block_sizes=None,
          **kwargs)  # fmt: skip
    tol = _tolerance(q, k, kwargs, sinks)
    if case == "documents-nan":
        q = q.at[:, 110, 3, 7].set(jnp.nan)

    def run(head_major):
        options = dict(implementation="triton", config=configs(head_major), **kwargs)
        grad = jax.grad(lambda q, k, v: _loss(block_sparse_attention, mask, weights, options)(
            q, k, v, sinks)[0], (1, 2))  # fmt: skip
        return jax.jit(grad)(q, k, v)

    for name, got, want in zip(("dk", "dv"), run(True), run(False), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), f"{name}'s NaN")
        if case == "documents-nan":  # keys 60..110 of kv head 1 see row 110 of head 3
            seeing = np.zeros(got.shape, bool)
            seeing[0, 60:111, 1] = True
            assert not np.isnan(got[~seeing]).any(), name
            assert name == "dv" or np.isnan(got[0, 60:111, 1]).any(-1).all()
        finite = np.isfinite(want)  # two float32 runs, each within tol of the oracle
        assert_close(got[finite], want[finite], 2 * tol, f"{name} vs the key-major kernel")


def _overlap_configs(overlap: bool) -> AttentionConfigs:
    """16x16 forward and dK/dV tiles (dQ's default), their softmax overlapped or not."""
    tile = AttentionKernelConfig(16, 16, overlap_softmax=overlap)
    return AttentionConfigs(forward=tile, backward_dkdv=tile)


@pytest.mark.parametrize("case", ["documents-nan", "local-soft-cap", "random-blocks-alibi"])
def test_overlapped_softmax_gives_the_float64_numbers_and_the_plain_loops(case):
    """`overlap_softmax` in the forward's and dK/dV's configs (the forward's full tiles
    each issue QK^T a tile ahead of their softmax; dK/dV issues dP before P's exp2s) on
    query tiles whose lists hold no full tile, one and many (documents of 1, 59 and 90
    tokens, a window, random blocks with a fully masked row, with ALiBi: each tile's
    positions), GQA, sinks: the float64 oracle's out, lse and gradients, and the loops'
    without the overlap bit for bit (the same steps in the same order), with a NaN in one
    document's V too (rows that see it NaN alike, through the careful relaunch)."""
    q, k, v, sinks, weights = _inputs(31, 150, num_q_heads=4, num_kv_heads=2, head_dim=32)
    mask, kwargs = _tile_list_case(case, seed=5, block_kv=16)
    check("triton", mask, q, k, v, sinks, weights, config=_overlap_configs(True),
          block_sizes=None, **kwargs)  # fmt: skip
    if case == "documents-nan":
        v = v.at[:, 100, 1, 5].set(jnp.nan)

    def run(overlap):
        options = dict(implementation="triton", config=_overlap_configs(overlap), **kwargs)
        grad = jax.value_and_grad(
            _loss(block_sparse_attention, mask, weights, options), (0, 1, 2, 3), has_aux=True
        )
        (_, (out, lse)), grads = jax.jit(grad)(q, k, v, sinks)
        return out, lse, *grads

    overlapped, plain = run(True), run(False)
    if case == "documents-nan":  # the third document's rows from 100 see it, in kv head 1
        assert np.isnan(np.asarray(overlapped[0])[0, 100:, 2:]).any(-1).all()
        assert not np.isnan(np.asarray(overlapped[0])[0, :100]).any()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), overlapped, plain,
                               strict=True):  # fmt: skip
        assert_equal_to_rounding(got, want, f"{name} vs the loops without the overlap")
