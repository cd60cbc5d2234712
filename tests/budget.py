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
    ("tests/attention/test_lowering.py::test_static_report_*", "offline compiles"),
    ("tests/attention/test_lowering.py::test_dkdv_groups_not_a_power_of_two*", "offline compile"),
    ("tests/attention/test_lowering.py::test_lowers_*", "4 kernels lowered each"),
    ("tests/attention/test_lowering.py::test_two_sided_window_lowers_for_cuda", "4 kernels"),
    ("tests/attention/test_lowering.py::test_two_cta_backward_runs_*", "4 offline compiles"),
    ("tests/block_sparse/test_triton.py::test_static_report_at_default_configs*", "compile"),
    ("tests/block_sparse/test_triton.py::test_static_report_of_the_careful_*", "QUICK: 1"),
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
    ("tests/block_sparse/test_conformance.py::test_score_mod_against_oracle[*", "QUICK: 2"),
    ("tests/block_sparse/test_conformance.py::test_vmap_of_traced_documents_and_remat[*", "1"),
    ("tests/block_sparse/test_conformance.py::test_traced_documents_under_jit[triton]", "2 kept"),
    (
        "tests/block_sparse/test_triton.py::test_lowers_for_cuda_with_each_element_rule[*",
        "every element rule lowered: a block-sparse program is compiled for an H100 in aot",
    ),
    (
        "tests/block_sparse/test_triton.py::test_overlapped_softmax_gives_the_float64_*",
        "QUICK keeps the documents with a NaN; the window and ALiBi cases, 14-22 s each",
    ),
    ("tests/test_shard_map.py::*[pallas]", "Pallas interpret mode on 4 devices: minutes"),
    ("tests/test_shard_map.py::test_data_parallel_block_sparse_attention_*[triton]", "xla"),
    ("tests/test_bench_cli.py::test_host_layer_json_and_plot", "the whole host-layer section"),
    ("tests/test_bench_cli.py::test_kernel_report_lists_every_kernel_with_the_proxy", "compiles"),
    ("tests/test_bench_train_at_scale.py::*", "a 1B-parameter step compiled for a target"),
    ("tests/test_bench_ring_attention.py::test_the_section_*", "three ring programs compiled"),
    ("tests/attention/test_pallas.py::test_block_sizes_as_config[blocks0]", "as blocks1"),
    ("tests/attention/test_shift.py::test_shift_matches_the_dense_oracle[*", "QUICK: 2 cases"),
    ("tests/attention/test_shift.py::test_bottom_right_shift_is_no_shift[*", "shifts: QUICK"),
    ("tests/attention/test_ring.py::test_pallas_kernels_in_the_ring", "a pallas ring program"),
    ("tests/attention/test_robustness.py::test_vmap_over_queries_with_shared_keys[*", "QUICK: xla"),
    ("tests/attention/test_robustness.py::test_flash_attention_conventions_are_accepted[*", "xla"),
    ("tests/attention/test_xla.py::test_block_sizes_match_reference[*", "conformance: default"),
    ("tests/attention/test_triton.py::test_large_scores_and_a_negative_scale[*", "one kept"),
    ("tests/attention/test_triton.py::test_config_overrides_give_the_same_numbers[*", "one kept"),
    ("tests/attention/test_triton.py::test_one_stage_tiles_over_several_key_tiles[*", "A/B tile"),
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
    # --- measured in a whole quick run on a quiet 2-core machine (29 minutes before these)
    # The example model: whole training steps on 1 and 8 devices (a minute or two each);
    # the ops in it are tested on their own, the step's compile count stays quick.
    ("tests/train_lm/test_model.py::test_first_steps_*", "a decoder, three flavours, 2 meshes"),
    ("tests/train_lm/test_model.py::test_the_losses_of_training_*", "24 steps, twice"),
    ("tests/train_lm/test_model.py::test_nan_in_one_document_*", "each op's NaN test is quick"),
    ("tests/train_lm/test_model.py::test_the_step_compiles_once_on_every_mesh[one*", "a step"),
    ("tests/train_lm/test_cli.py::test_train_lm_trains_*", "the CLI trains a model"),
    ("tests/train_lm/test_cli.py::test_bench_train_*", "trains two models"),
    ("tests/test_readme.py::test_readme_example_runs[0]", "an 8192-token program, H100 + TPU"),
    ("tests/test_readme.py::test_readme_example_runs[5]", "the block-sparse tour: 6 programs"),
    ("tests/test_readme.py::test_readme_example_runs[8]", "a ring on 4 devices"),
    ("tests/test_shard_map.py::test_data_parallel_block_sparse_*", "splash/test_sharding: 1"),
    ("tests/splash/test_sharding.py::test_sharded_kernel_equals_unsharded[*", "QUICK keeps 1"),
    ("tests/tuning/test_autotune.py::test_tune_attention_end_to_end", "as grouped matmul"),
    ("tests/tuning/test_bench_tune.py::test_dry_run_prunes_*", "a pretend-GPU tune is quick"),
    ("tests/tuning/test_bench_tune.py::test_dry_run_compiles_*", "15 offline compiles"),
    ("tests/test_bench_aot.py::test_memory_rows_at_small_sizes", "compiles each row for targets"),
    ("tests/block_sparse/test_conformance.py::test_alibi_against_oracle[*", "_matches_varlen"),
    ("tests/block_sparse/test_conformance.py::test_length_one_and_uneven_kv[xla]", "2 kept"),
    ("tests/block_sparse/test_conformance.py::test_non_finite_sinks_follow_one_rule[xla]", "2"),
    ("tests/block_sparse/test_conformance.py::test_large_logits_*[xla]", "as triton"),
    ("tests/attention/test_conformance.py::test_flash_attention_segment_ids_with_padding[*", "3"),
    ("tests/attention/test_conformance.py::test_rows_before_the_first_sequence_*[pallas]", "2"),
    ("tests/attention/test_robustness.py::test_flash_attention_padding_filled_*[*", "triton"),
    ("tests/attention/test_robustness.py::test_non_finite_sinks_follow_one_rule[xla]", "2 kept"),
    ("tests/splash/test_kernels.py::test_factory_with_project_masks", "each mask in _reference"),
    ("tests/splash/test_kernels.py::test_matches_reference[causal]", "random kept"),
    ("tests/splash/test_kernels.py::test_shrink_grid_on_and_off_agree", "block shapes test"),
    ("tests/moe/test_block.py::test_gradients_match_the_dense_oracle[2]", "as [1]"),
    ("tests/moe/test_expert_parallel.py::test_sharded_block_equals_the_single_device_*[*", "1"),
    ("tests/moe/test_expert_parallel.py::test_make_mesh_explicit_*[replicated]", "all_to_all"),
    ("tests/host/test_cu_seqlens.py::test_jit_matches_eager_and_reference[*", "QUICK keeps 2"),
    # --- the second pass (quick suite at 14 minutes): one case per backend and feature
    ("tests/block_sparse/test_conformance.py::test_length_one_and_uneven_kv[pallas]", "triton"),
    ("tests/block_sparse/test_conformance.py::test_non_finite_sinks_follow_one_rule[pallas]", "1"),
    ("tests/splash/test_kernels.py::test_factory_with_document_mask", "_project_masks holds it"),
    ("tests/splash/test_kernels.py::test_document_term_alone", "documents in test_gqa_segments"),
    ("tests/splash/test_kernels.py::test_matches_reference[full]", "random kept"),
    ("tests/splash/test_kernels.py::test_element_mask_with_documents[global]", "per_document"),
    ("tests/splash/test_kernels.py::test_mqa_and_rectangular", "GQA and kv != q elsewhere"),
    ("tests/attention/test_ring.py::test_ring_equals_whole_sequence[R1-*", "a ring of 2 kept"),
    ("tests/attention/test_shift.py::test_shift_matches_the_dense_oracle[rows_past_*", "1 kept"),
    ("tests/grouped_matmul/test_conformance.py::test_gmm_matches_references[*", "QUICK: 8"),
    ("tests/grouped_matmul/test_conformance.py::test_gmm_gradients[*", "QUICK: 1 case"),
    ("tests/grouped_matmul/test_conformance.py::test_tgmm_gradients[None-*", "[1] kept"),
    ("tests/grouped_matmul/test_conformance.py::test_gmm_half_precision[*", "QUICK: 2 cases"),
    ("tests/grouped_matmul/test_xla_tiles.py::test_gmm_tiles_match_both_oracles[*", "QUICK: 2"),
    ("tests/grouped_matmul/test_xla_tiles.py::test_tgmm_tiles_match_both_oracles[*", "QUICK: 2"),
    ("tests/grouped_matmul/test_xla_tiles.py::test_nan_and_inf_stay_in_their_expert[*", "3"),
    ("tests/grouped_matmul/test_xla_tiles.py::test_vmap_gmm_shared_weights_*[lhs]", "and_sizes"),
    ("tests/grouped_matmul/test_xla_tiles.py::test_vmap_batched_group_offset_*", "conformance"),
    ("tests/grouped_matmul/test_xla_tiles.py::test_gmm_gradients_match_grad_of_the_*[*", "1"),
    ("tests/test_shard_map.py::test_data_parallel_attention_forward_and_gradient[*", "test_ring"),
    ("tests/core/test_autodiff.py::test_grouped_matmul_hessian_by_reverse_mode_*", "refusals kept"),
    ("tests/tuning/test_bench_tune.py::test_tune_on_a_pretend_gpu_*", "autotune's end-to-end"),
    ("tests/attention/test_pallas.py::test_block_sizes_as_config[*", "splash block-shape tests"),
    ("tests/attention/test_conformance.py::test_flash_attention_half_precision[*", "QUICK: 3"),
    # --- the third pass (quick suite at 10:45)
    ("tests/test_readme.py::test_readme_example_runs[7]", "expert parallelism on a mesh"),
    ("tests/aot/test_targets.py::test_plain_jit_over_a_gpu_mesh_*[h100]", "compile_for kept"),
    ("tests/aot/test_targets.py::test_estimated_cycles_of_a_tpu_kernel", "the TPU compile kept"),
    ("tests/test_helpers.py::test_inputs_run_through_the_ops_in_both_layouts", "every op"),
    ("tests/train_lm/test_model.py::test_the_step_compiles_once_on_every_mesh[data2]", "1 mesh"),
    ("tests/test_bench_host_layer.py::test_rows_time_one_call_inside_a_step_*", "make bench"),
    ("tests/test_bench_block_sparse.py::test_timed_rows_check_ours_*[16 documents]", "random"),
    ("tests/attention/test_conformance.py::test_forward_*[window_both_sinks-xla]", "pallas"),
    ("tests/attention/test_conformance.py::test_forward_*[window_both_sinks-triton]", "pallas"),
    ("tests/attention/test_api.py::test_valid_calls_pass_checkify_index_checks", "3 programs"),
    ("tests/splash/test_kernels.py::test_matches_reference[local]", "random kept"),
    ("tests/aot/test_targets.py::test_pallas_follows_the_compile_target_*", "auto_picks kept"),
    # --- the fourth pass (quick suite at 11:11 on a slower machine, 2026-12-05)
    (
        "tests/test_bench_gpu_check.py::test_dry_run_checks_the_varlen_rows_against_*",
        "every varlen A/B anchor through the interpreter (~90 s); the other sections' kept",
    ),
    ("tests/attention/test_triton.py::test_overlapped_softmax_gives_the_default_numbers[*", "1"),
    ("tests/block_sparse/test_triton.py::test_overlapped_softmax_issues_*[backward_dkdv]", "fwd"),
    ("tests/attention/test_lowering.py::test_default_dkdv_takes_tma_*[not-causal]", "causal"),
    ("tests/attention/test_triton.py::test_warp_specialized_dkdv_gives_*[two-sided-window]", "1"),
    ("tests/attention/test_triton.py::test_dq_atomic_matches_the_reference[*", "QUICK: 1 case"),
    (
        "tests/launch/test_gpu_launches_interpreted.py::test_*attention[*",
        "the sm_90 launches interpreted (5-11 s each); QUICK keeps causal sm_90",
    ),
    (
        "tests/launch/test_gpu_launches_interpreted.py::test_*small_shared_memory_gpus[*d64]",
        "sm_86's light tiles interpreted (~6 s each): d=128 kept",
    ),
    (
        "tests/launch/test_gpu_launches_interpreted.py::test_*small_shared_memory_gpus[*d256]",
        "sm_86's d=256 tiles interpreted: d=128 kept",
    ),
    (
        "tests/launch/test_gpu_launches_interpreted.py::test_*small_shared_memory_gpus[sm_120*",
        "sm_120's d=128 (dK/dV as sm_86's): sm_86's kept",
    ),
    # --- the fifth pass (quick suite at 8:48 on a quiet machine, 13:17 beside other work,
    # 2026-12-05): the A/B options' repeated grids, and whole programs compiled twice
    *(
        (
            f"tests/test_bench_preflight.py::{name}",
            "gpu-check --compile-for of a varlen row and its A/B anchors, one fixture (30-45"
            " s): `make test-device-stack` runs the same preflight on the device's stack",
        )
        for name in (
            "test_compile_for_compiles_a_varlen_row_with_its_anchors",
            "test_verdicts_set_the_changed_kernels_beside_each_ab_row",
        )
    ),
    (
        "tests/aot/test_no_host_loops.py::test_block_sparse_*",
        "block-sparse fwd+bwd compiled for an H100 (30-45 s); varlen, flash and gmm kept",
    ),
    ("tests/attention/test_triton.py::test_dq_atomic_by_tma_reduction_*[*", "QUICK: 2 cases"),
    ("tests/attention/test_triton.py::test_dq_atomic_keeps_a_poisoned_*[*", "QUICK: 2 cases"),
    ("tests/attention/test_triton.py::test_dq_atomic_under_vmap_and_jit", "vmap: conformance"),
    ("tests/block_sparse/test_triton.py::test_overlapped_softmax_issues_*[*", "varlen's kept"),
    # --- the sixth pass (quick suite at 10:39 on 2026-12-06, 8:53 on the same machine that
    # morning with another run beside it): the host-side descriptors' repeated cases, and
    # the two longest single tests
    (
        "tests/test_bench_gpu_check.py::test_dry_run_checks_grouped_matmul_and_block_sparse_*",
        "every grouped matmul and block-sparse A/B anchor through the interpreter (33 s), as"
        " the varlen rows'; the runner's own tests kept",
    ),
    (
        "tests/splash/test_port.py::test_a_jax_splash_script_runs_with_only_its_import_changed",
        "a whole ported script (20 s); each kernel against JAX's splash kept",
    ),
    ("tests/attention/test_triton.py::test_host_descriptors_keep_a_poisoned_*[*", "QUICK: 1"),
    ("tests/attention/test_triton.py::test_host_descriptors_keep_poisoned_queries_*[*", "QUICK: 1"),
    # --- the seventh pass (CI ran the quick suite in 9:59 on 2026-12-06, 4:40 here that
    # day): target checks whose numbers the interpreter checks in `make test`, and the
    # second and later cases of grids that `make test` keeps one of
    (
        "tests/test_bench_preflight.py::test_the_kernels_a_row_launches_are_recorded_*",
        "ptxas over a row's kernels: `make test-device-stack` runs the whole preflight",
    ),
    ("tests/attention/test_lowering.py::test_warp_specialized_kernels_lower_*[*", "numbers"),
    ("tests/attention/test_lowering.py::test_warp_specialized_configs_in_a_persistent_*", "ws"),
    ("tests/attention/test_lowering.py::test_default_dkdv_takes_tma_*[old-jaxlib]", "causal"),
    ("tests/attention/test_lowering.py::test_the_kernels_with_host_*[*", "host numbers kept"),
    ("tests/attention/test_lowering.py::test_overlapped_softmax_issues_*[*", "numbers kept"),
    ("tests/attention/test_lowering.py::test_dkdv_tma_default_has_a_clean_shorter_loop[*", "tma"),
    ("tests/attention/test_lowering.py::test_dq_atomic_by_tma_reduction_adds_by_*", "numbers"),
    ("tests/attention/test_lowering.py::test_dkdv_groups_not_a_power_of_two[*", "numbers"),
    ("tests/attention/test_triton.py::test_dq_atomic_with_very_negative_scores[*", "QUICK: 2"),
    ("tests/block_sparse/test_triton.py::test_forward_isolates_non_finite_*[*", "QUICK: 2"),
    ("tests/block_sparse/test_triton.py::test_dq_isolates_non_finite_keys_*[*", "QUICK: 2"),
    ("tests/block_sparse/test_triton.py::test_dkdv_isolates_non_finite_*[*", "QUICK: 2"),
    ("tests/block_sparse/test_triton.py::test_config_gives_the_float64_numbers[per-kernel]", "1"),
    ("tests/launch/test_gpu_launches_interpreted.py::test_grouped_matmul[sm_80]", "sm_90 kept"),
    ("tests/splash/test_kernels.py::test_fully_masked_rows[True]", "[False] kept"),
    # --- the eighth pass (quick suite at 8:07-9:33 on 2026-12-07, nothing beside it): the
    # second case of interpreted GPU launches and static reports whose first stays quick
    (
        "tests/launch/test_gpu_launches_interpreted.py::test_*_at_head_dim_256[sm_80]",
        "sm_80's d=256 tiles interpreted (9-14 s each): sm_90's kept",
    ),
    (
        "tests/launch/test_gpu_launches_interpreted.py::test_*dq_by_atomics[sm_80-d64]",
        "sm_80's d=128 kept",
    ),
    ("tests/block_sparse/test_triton.py::test_static_report_of_the_dq_*[False-False]", "1 kept"),
    ("tests/test_shard_map.py::test_pallas_block_sparse_*_a_shard[full]", "causal's lax.map kept"),
    # --- head-major dK/dV (2026-12-08): interpreted twice each (head-major, key-major)
    ("tests/attention/test_triton.py::test_head_major_dkdv_gives_the_float64_*[*", "QUICK: 2"),
    (
        "tests/block_sparse/test_triton.py::test_head_major_dkdv_gives_the_float64_*[*",
        "QUICK keeps the documents with a NaN; the window and ALiBi cases, 9-11 s each",
    ),
    ("tests/block_sparse/test_triton.py::test_static_report_of_the_head_major_*[*", "QUICK: 1"),
)

# Exceptions to SLOW: the cases `make test` keeps of each slow family.
QUICK: tuple[str, ...] = (
    "tests/attention/test_triton.py::test_host_descriptors_keep_a_poisoned_*[v-inf-True-padding]",
    "tests/attention/test_triton.py::test_host_descriptors_keep_poisoned_queries_*[causal-window-left-shifted-q-nan]",
    "tests/launch/test_gpu_launches_interpreted.py::test_varlen_attention[sm_90]",
    "tests/launch/test_gpu_launches_interpreted.py::test_block_sparse_attention[causal-sm_90]",
    # the TPU kernels compiled for one TPU in bf16 (tests/aot/test_no_host_loops.py compiles
    # every op's Triton path for an H100 in bf16, forward and backward)
    "tests/aot/test_compile_splash.py::*[tpu-v6e-bfloat16]",
    "tests/aot/test_compile_splash.py::test_default_block_table_matches_block_sizes",
    # the Hopper head_dim 128 reports: the forward with every option, the persistent dK/dV
    # (and sm_86's light dK/dV)
    "tests/attention/test_lowering.py::test_static_report_at_default_configs[90-128-backward_dkdv-causal-persistent]",
    "tests/attention/test_lowering.py::test_static_report_at_default_configs[86-128-backward_dkdv-causal-row-a-program]",
    "tests/attention/test_lowering.py::test_static_report_at_default_configs[90-128-forward-causal+window_left+soft_cap+alibi-row-a-program]",
    "tests/attention/test_lowering.py::test_static_report_float32[64-forward]",
    # d=256: Hopper's dQ (2 compiles) and the A100's dK/dV, causal
    "tests/attention/test_lowering.py::test_static_report_of_the_dq_at_head_dim_256",
    "tests/attention/test_lowering.py::test_static_report_of_the_ampere_dkdv_*[causal-row-a-program]",
    "tests/attention/test_lowering.py::test_lowers_with_every_option[90-bfloat16-80]",
    "tests/block_sparse/test_triton.py::test_static_report_at_default_configs[forward-128-True-True-90]",
    "tests/block_sparse/test_triton.py::test_static_report_of_the_careful_relaunch[backward_dkdv-mha]",
    "tests/block_sparse/test_triton.py::test_overlapped_softmax_gives_the_float64_*[documents-nan]",
    "tests/grouped_matmul/test_lowering.py::test_gmm_and_tgmm_lower_for_cuda[bfloat16-90]",
    "tests/grouped_matmul/test_lowering.py::test_gmm_gradient_lowers_to_three_matmul_kernels[True-90]",
    "tests/grouped_matmul/test_lowering.py::test_default_tiling_compiles_without_spills_*[90-gmm]",
    "tests/grouped_matmul/test_lowering.py::test_even_k_drops_the_k_masks_from_the_loop[gmm]",
    "tests/grouped_matmul/test_lowering.py::test_tma_gmm_lowers_for_an_h100_with_its_global_scratch",
    # attention conformance: every mask side, the soft cap, sinks, ALiBi, GQA 2 and 3,
    # odd head dims, fp16 and bf16
    *(
        f"tests/attention/test_conformance.py::test_forward_and_gradients_match_reference[{c}-*"
        for c in (
            "everything",
            "window_both_sinks",
            "d40_causal_soft_cap_sinks",
            "gqa3_causal_window_alibi_sinks",
            "fp16_d48_all_options",
        )
    ),
    # bf16 through triton; xla's and pallas's in test_flash_attention_half_precision
    "tests/attention/test_conformance.py::test_forward_*[bf16_causal_window_sinks-triton]",
    "tests/attention/test_robustness.py::test_a_poisoned_document_or_padding_*[q-nan-True-document-xla]",
    "tests/attention/test_robustness.py::test_a_poisoned_document_or_padding_*[q-nan-True-document-tr*",
    "tests/block_sparse/test_conformance.py::test_score_mod_against_oracle[square_cap-xla]",
    "tests/block_sparse/test_conformance.py::test_score_mod_against_oracle[relative_bias-triton]",
    "tests/block_sparse/test_conformance.py::test_vmap_of_traced_documents_and_remat[pallas]",
    # block-sparse masks: each backend's token rule, documents, table, predicate and heads
    *(
        f"tests/block_sparse/test_conformance.py::test_mask_against_oracle[{case}]"
        for case in (
            "causal-triton",
            "documents-xla",
            "documents-pallas",
            "multi_head-pallas",
            "predicate_in_kernel-xla",
            "sliding_window-triton",
            "random_blocks-pallas",
            "prefix_lm_and_documents-triton",
        )
    ),
    "tests/attention/test_robustness.py::test_vmap_over_queries_with_shared_keys[xla]",
    "tests/attention/test_robustness.py::test_flash_attention_conventions_are_accepted[xla]",
    "tests/attention/test_triton.py::test_large_scores_and_a_negative_scale[True-3.0]",
    "tests/attention/test_triton.py::test_config_overrides_give_the_same_numbers[per_kernel]",
    "tests/attention/test_triton.py::test_persistent_programs_walk_the_tile_list[spare0-tma]",
    "tests/attention/test_shift.py::test_shift_matches_the_dense_oracle[causal_window_everything_mqa-triton]",
    # xla's shifted backward: only ring attention passes a shift
    "tests/attention/test_shift.py::test_shift_matches_the_dense_oracle[causal-xla]",
    "tests/attention/test_triton.py::test_dq_atomic_with_very_negative_scores[full-fp32]",
    "tests/attention/test_triton.py::test_dq_atomic_with_very_negative_scores[causal-fp16]",
    "tests/block_sparse/test_triton.py::test_forward_isolates_non_finite_*[in-kernel-intervals]",
    "tests/block_sparse/test_triton.py::test_forward_isolates_non_finite_*[copy-of-v-tokens]",
    "tests/block_sparse/test_triton.py::test_dq_isolates_non_finite_keys_*[in-kernel-intervals]",
    "tests/block_sparse/test_triton.py::test_dq_isolates_non_finite_keys_*[copy-of-k-tokens]",
    "tests/block_sparse/test_triton.py::test_dkdv_isolates_non_finite_*[dq-flags-tokens-gqa]",
    "tests/block_sparse/test_triton.py::test_dkdv_isolates_non_finite_*[xla-flags-intervals-mha]",
    # (the ring's gradients, sinks' included, in make test: test_triton_kernels_in_the_ring)
    "tests/attention/test_ring.py::test_ring_equals_whole_sequence[R2-contiguous-*",
    "tests/splash/test_sharding.py::test_sharded_kernel_equals_unsharded[shards2-per_head_*",
    "tests/attention/test_conformance.py::test_flash_attention_segment_ids_with_padding[False-xla]",
    "tests/attention/test_conformance.py::test_flash_attention_segment_ids_with_padding[True-tr*",
    "tests/attention/test_conformance.py::test_flash_attention_segment_ids_with_padding[True-pa*",
    "tests/attention/test_robustness.py::test_flash_attention_padding_filled_*[triton]",
    "tests/moe/test_expert_parallel.py::test_sharded_block_equals_the_single_device_*[4-all*",
    "tests/host/test_cu_seqlens.py::test_jit_matches_eager_and_reference[lengths0]",
    "tests/host/test_cu_seqlens.py::test_jit_matches_eager_and_reference[lengths3]",
    *(
        f"tests/grouped_matmul/test_conformance.py::test_gmm_matches_references[{c}-*"
        for c in (
            "*-empty_groups_and_tail_rows",
            "*-offset_middle",
            "False-length_one_groups",
            "True-one_group_holds_every_row",
        )
    ),
    "tests/grouped_matmul/test_conformance.py::test_gmm_gradients[offset_existing_transposed-*",
    "tests/grouped_matmul/test_conformance.py::test_gmm_half_precision[float32-bf16-*",
    "tests/grouped_matmul/test_conformance.py::test_gmm_half_precision[same-fp16-*",
    "tests/grouped_matmul/test_xla_tiles.py::test_*_tiles_match_both_oracles[many_groups_*-False]",
    "tests/grouped_matmul/test_xla_tiles.py::test_*_tiles_match_both_oracles[empty_first_*-True]",
    "tests/grouped_matmul/test_xla_tiles.py::test_nan_and_inf_stay_in_their_expert[xla-rows-nan]",
    "tests/grouped_matmul/test_xla_tiles.py::test_nan_and_inf_stay_in_their_expert[*-weights-*",
    "tests/grouped_matmul/test_xla_tiles.py::test_gmm_gradients_match_grad_of_the_*[1-True]",
    "tests/attention/test_conformance.py::test_flash_attention_half_precision[bf16-xla]",
    "tests/attention/test_conformance.py::test_flash_attention_half_precision[fp16-triton]",
    "tests/attention/test_conformance.py::test_flash_attention_half_precision[bf16-pallas]",
    "tests/attention/test_triton.py::test_overlapped_softmax_gives_the_default_numbers[causal-tma]",
    "tests/attention/test_triton.py::test_dq_atomic_matches_the_reference[everything]",
    "tests/attention/test_triton.py::test_dq_atomic_by_tma_reduction_*[everything]",
    "tests/attention/test_triton.py::test_dq_atomic_by_tma_reduction_*[rows_past_the_last_*",
    "tests/attention/test_triton.py::test_dq_atomic_keeps_a_poisoned_*[k-inf]",
    "tests/attention/test_triton.py::test_dq_atomic_keeps_a_poisoned_*[v-inf-causal-tma-*",
    "tests/attention/test_triton.py::test_head_major_dkdv_gives_the_float64_*[causal-tma]",
    "tests/attention/test_triton.py::test_head_major_dkdv_gives_the_float64_*[soft-cap-window-*",
    "tests/block_sparse/test_triton.py::test_head_major_dkdv_gives_the_float64_*[documents-nan]",
    "tests/block_sparse/test_triton.py::test_static_report_of_the_head_major_*[False-False-mha-careful]",
    "tests/attention/test_lowering.py::test_static_report_of_the_hopper_dkdv_*[causal-row-a-program]",
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
