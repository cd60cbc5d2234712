"""What `make test` leaves to `make test-all`: the `slow` tests, decided in this one table.

`make test` must finish in minutes on 2 cores and still run every op x backend x feature
at least once; `make test-all` (CI) runs everything. A family of tests that repeats one
check over a grid (every target and dtype compiled, every head_dim's static report, the
same interpreter run at a larger shape) is marked `slow` here, except for the cases its
QUICK patterns keep: the representative one(s) that `make test` still runs.

Patterns are pytest node ids where `*` matches anything (and nothing else is special, so
`[...]` is literal). A pattern that matches no collected test while its file was
collected is an error, so the table cannot go stale silently; a test renamed out of a
pattern runs in `make test`, never in neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# (pattern, why it is slow): every matching test is `slow` unless a QUICK pattern keeps it.
SLOW: tuple[tuple[str, str], ...] = (
    # --- compiled by the real compilers for compile-only chips (seconds to a minute each)
    ("tests/aot/test_compile_*", "XLA:TPU / Mosaic / XLA:GPU compiles of whole programs"),
    # --- offline Triton compiles (Triton to cubin, ptxas, cuobjdump: seconds each)
    ("tests/attention/test_lowering.py::test_static_report_*", "one offline compile each"),
    ("tests/attention/test_lowering.py::test_dkdv_groups_not_a_power_of_two*", "offline compile"),
    ("tests/attention/test_lowering.py::test_lowers_*", "4 kernels lowered each"),
    ("tests/attention/test_lowering.py::test_two_sided_window_lowers_for_cuda", "4 kernels"),
    ("tests/block_sparse/test_triton.py::test_static_report_at_default_configs*", "compile"),
    ("tests/grouped_matmul/test_lowering.py::test_*", "offline compiles"),
    ("tests/aot/test_targets.py::test_plain_jit_over_a_gpu_mesh_*[a100]", "as [h100]"),
    # --- the same check over more cases (each an XLA compile of forward + backward, and a
    # Triton-interpreter or Pallas interpret-mode run: several seconds per backend)
    (
        "tests/attention/test_conformance.py::test_forward_and_gradients_match_reference[*",
        "QUICK keeps a set of cases that holds every feature, dtype and head layout",
    ),
    ("tests/attention/test_conformance.py::test_fully_masked_rows[minus_inf-*", "as None"),
    (
        "tests/attention/test_conformance.py::test_random_sequences_match_reference*",
        "random lengths on top of the fixed cases",
    ),
    (
        "tests/attention/test_robustness.py::test_a_poisoned_document_or_padding_*",
        "one poison per place and backend kept",
    ),
    ("tests/attention/test_ring.py::test_ring_equals_whole_sequence[*", "a mesh program each"),
    (
        "tests/attention/test_ring.py::test_ring_equals_flash_attention_and_skips_by_causality",
        "work counts also checked by test_ring_equals_whole_sequence",
    ),
    # --- measured heaviest in the quick suite (tens of seconds to minutes each)
    ("tests/block_sparse/test_conformance.py::test_traced_documents_per_head[*", "pallas"),
    ("tests/block_sparse/test_conformance.py::test_alibi_against_oracle[triton]", "as xla"),
    ("tests/block_sparse/test_conformance.py::test_hypothesis_mask_mix", "a mix of masks"),
    ("tests/block_sparse/test_conformance.py::test_mask_against_oracle[*", "QUICK: 11"),
    ("tests/block_sparse/test_conformance.py::test_score_mod_against_oracle[*", "QUICK: 1"),
    ("tests/block_sparse/test_conformance.py::test_vmap_of_traced_documents_and_remat[*", "1"),
    ("tests/block_sparse/test_conformance.py::test_traced_documents_under_jit[triton]", "2 kept"),
    ("tests/block_sparse/test_triton.py::test_lowers_for_cuda_with_each_element_rule[80]", "sm_90"),
    ("tests/test_shard_map.py::*[pallas]", "Pallas interpret mode on 4 devices: minutes"),
    ("tests/test_shard_map.py::test_data_parallel_block_sparse_attention_*[triton]", "xla"),
    ("tests/test_bench_cli.py::test_host_layer_json_and_plot", "the whole host-layer section"),
    ("tests/test_bench_cli.py::test_kernel_report_lists_every_kernel_with_the_proxy", "compiles"),
    ("tests/test_bench_train_at_scale.py::*", "a 1B-parameter step compiled for a target"),
    ("tests/attention/test_pallas.py::test_block_sizes_as_config[blocks0]", "as blocks1"),
    ("tests/attention/test_shift.py::test_shift_matches_the_dense_oracle[*", "QUICK: 2 cases"),
    ("tests/attention/test_shift.py::test_bottom_right_shift_is_no_shift[xla]", "as triton"),
    ("tests/attention/test_ring.py::test_pallas_kernels_in_the_ring", "a pallas ring program"),
    ("tests/attention/test_robustness.py::test_vmap_over_queries_with_shared_keys[*", "QUICK: xla"),
    ("tests/attention/test_robustness.py::test_flash_attention_conventions_are_accepted[*", "xla"),
    ("tests/attention/test_xla.py::test_block_sizes_match_reference[*", "QUICK keeps one"),
    ("tests/attention/test_triton.py::test_large_scores_and_a_negative_scale[*", "one kept"),
    ("tests/attention/test_triton.py::test_config_overrides_give_the_same_numbers[*", "one kept"),
    ("tests/attention/test_triton.py::test_persistent_programs_walk_the_tile_list[*", "one kept"),
    *(
        (f"tests/block_sparse/test_conformance.py::test_mask_against_oracle[{m}-*", why)
        for m, why in (
            ("chunked_causal", "a token rule, as causal and sliding_window"),
            ("predicate", "predicate_in_kernel runs the same predicate"),
            ("prefix_lm", "prefix_lm_and_documents holds it"),
        )
    ),
    ("tests/attention/test_shift.py::test_shifted_kernels_lower_for_cuda", "4 kernels lowered"),
    (
        "tests/attention/test_ring.py::test_make_mesh_explicit_axes_and_inputs_sharded_otherwise",
        "a second mesh program of the xla ring",
    ),
)

# Exceptions to SLOW: the cases `make test` keeps of each slow family.
QUICK: tuple[str, ...] = (
    # the TPU kernels compiled for one TPU in bf16 (tests/aot/test_no_host_loops.py compiles
    # every op's Triton path for an H100 in bf16, forward and backward)
    "tests/aot/test_compile_splash.py::*[tpu-v6e-bfloat16]",
    "tests/aot/test_compile_splash.py::test_default_block_table_matches_block_sizes",
    # the Hopper head_dim 128 reports: every kernel x feature set, one persistent launch
    "tests/attention/test_lowering.py::test_static_report_at_default_configs[90-128-*-row-a-program]",
    "tests/attention/test_lowering.py::test_static_report_at_default_configs[90-128-backward_dkdv-causal-persistent]",
    "tests/attention/test_lowering.py::test_static_report_float32[64-*",
    "tests/attention/test_lowering.py::test_static_report_preprocess[128]",
    "tests/attention/test_lowering.py::test_dkdv_groups_not_a_power_of_two[3-causal]",
    "tests/attention/test_lowering.py::test_lowers_with_every_option[90-bfloat16-80]",
    "tests/block_sparse/test_triton.py::test_static_report_at_default_configs[*-128-True-True-90]",
    "tests/grouped_matmul/test_lowering.py::test_gmm_and_tgmm_lower_for_cuda[bfloat16-90]",
    "tests/grouped_matmul/test_lowering.py::test_gmm_gradient_lowers_to_three_kernels[True-90]",
    "tests/grouped_matmul/test_lowering.py::test_default_tiling_compiles_without_spills_*[90-*",
    "tests/grouped_matmul/test_lowering.py::test_default_precision_compiles_exact_float32_products",
    "tests/grouped_matmul/test_lowering.py::test_even_k_drops_the_k_masks_from_the_loop[gmm]",
    # attention conformance: every mask side, the soft cap, sinks, ALiBi, GQA 2 and 3,
    # odd head dims, fp16 and bf16
    *(
        f"tests/attention/test_conformance.py::test_forward_and_gradients_match_reference[{c}-*"
        for c in (
            "everything",
            "window_both_sinks",
            "window_right_alibi",
            "d40_causal_soft_cap_sinks",
            "gqa3_causal_window_alibi_sinks",
            "bf16_causal_window_sinks",
            "fp16_d48_all_options",
        )
    ),
    "tests/attention/test_robustness.py::test_a_poisoned_document_or_padding_*[q-nan-True-document-*",
    *(
        f"tests/attention/test_shift.py::test_shift_matches_the_dense_oracle[{c}-*"
        for c in (
            "causal_window_everything_mqa",
            "rows_past_the_last_sequence",
        )
    ),
    "tests/block_sparse/test_conformance.py::test_traced_documents_per_head[pallas]",
    "tests/block_sparse/test_conformance.py::test_score_mod_against_oracle[relative_bias-xla]",
    "tests/block_sparse/test_conformance.py::test_vmap_of_traced_documents_and_remat[pallas]",
    # block-sparse masks: each backend's token rule, documents, table, predicate and heads
    *(
        f"tests/block_sparse/test_conformance.py::test_mask_against_oracle[{case}]"
        for case in (
            "causal-xla",
            "causal-pallas",
            "causal-triton",
            "documents-xla",
            "documents-pallas",
            "documents-triton",
            "multi_head-pallas",
            "predicate_in_kernel-xla",
            "sliding_window-triton",
            "random_blocks-pallas",
            "prefix_lm_and_documents-triton",
        )
    ),
    "tests/attention/test_robustness.py::test_vmap_over_queries_with_shared_keys[xla]",
    "tests/attention/test_robustness.py::test_flash_attention_conventions_are_accepted[xla]",
    "tests/attention/test_xla.py::test_block_sizes_match_reference[(16, 32)]",
    "tests/attention/test_triton.py::test_large_scores_and_a_negative_scale[True-3.0]",
    "tests/attention/test_triton.py::test_config_overrides_give_the_same_numbers[per_kernel]",
    "tests/attention/test_triton.py::test_persistent_programs_walk_the_tile_list[3]",
    "tests/attention/test_ring.py::test_ring_equals_whole_sequence[R1-*",
    "tests/attention/test_ring.py::test_ring_equals_whole_sequence[R2-contiguous-*",
)


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")) + r"\Z")


_SLOW = [(_regex(p), p) for p, _ in SLOW]
_QUICK = [(_regex(p), p) for p in QUICK]


def is_slow(nodeid: str) -> bool:
    """True when SLOW marks `nodeid` and no QUICK pattern keeps it."""
    return any(r.match(nodeid) for r, _ in _SLOW) and not any(r.match(nodeid) for r, _ in _QUICK)


def unmatched_patterns(nodeids: Iterable[str]) -> list[str]:
    """The patterns that match none of `nodeids` although their file is among them."""
    nodeids = list(nodeids)
    files = {n.split("::")[0] for n in nodeids}
    stale = []
    for regex, pattern in [*_SLOW, *_QUICK]:
        file_pattern = _regex(pattern.split("::")[0])
        in_run = any(file_pattern.match(f) for f in files)
        if in_run and not any(regex.match(n) for n in nodeids):
            stale.append(pattern)
    return stale
