#!/usr/bin/env bash
# The device check, 8-9 minutes on one H100 (more if the bench rows crash and rerun); within
# a device call's 10-minute limit run it as two calls, `tma bench` (~5 min) then `ncu`:
#   bash bench/gpu_check.sh [STEP...]      (from anywhere; OUT=<dir> to choose where results go)
# STEPs, in this order, the first three by default:
#   tma    kernels with tensor descriptors (TMA) alone, on the device (the default dK/dV
#          kernel at d=128 on sm_90 is one); if they pass, `bench` also times the TMA A/B
#          anchors (`gpu-check --tma`); then gmm and the varlen kernels with
#          descriptors the launch encodes (`--host-descriptors`) and the warp-specialized
#          kernels, whose A/B rows `bench` times if they pass too (`--warp-specialized`),
#          and the warp-specialized dK/dV apart (`--warp-specialized-dkdv`);
#   bench  `python -m bench gpu-check`: every GPU row with its anchors, JSON under
#          $OUT/bench/results/ (copy it to bench/results/: the README's figures come from there),
#          and its verdicts in summary.txt (`gpu-check --verdicts`: A/B anchors, issue 27's bars);
#   ncu    one Nsight Compute profile per op (ours on one attention, one grouped matmul
#          and one block-sparse row): time per kernel, ours against the XLA work around them; then the
#          attention kernels' occupancy, stall and memory sections (16 x 1024, ~1 min)
#          and grouped matmul's speed-of-light and memory sections (m 32768, < 75 s);
#   quick-tests  the conformance tests of the Triton backend on the device (100 s);
#   tests  (alone: `bash bench/gpu_check.sh tests`, `make gpu-tests`, about 5 minutes, a
#          device call of its own) every GPU conformance test but the Pallas backend's (the
#          TPU kernels, interpreted off a TPU: the CPU suite runs them), and the splash
#          kernels' interpreted arithmetic on the device once;
#   suite  (alone, a device call of its own, up to SUITE_LIMIT_S = 540 s) the whole quick
#          suite on the device (`-m "not slow"`), the Pallas backend's tests left to the
#          CPU: what `make test` proves here, on the GPU (a test of the CPU path runs the
#          interpreter there or skips); stopped at its limit with SIGINT, it still lists
#          the failures it met;
#   tune   (alone, a device call of its own: about 5 minutes) `python -m bench tune`: every
#          candidate launch config of attention and grouped matmul timed on one problem
#          each against the default, winners in $OUT/tuning.json (for the per-arch tables).
# The carried jax-triton wheel (bench/wheels/, committed: 17 KB) is installed first if
# jax_triton does not import (the GPU machine has no network). Every step has its own time
# limit; a step failing does not stop the next. $OUT ends with summary.txt, the JSON and
# one archive of the logs (gpu_check_logs.tgz), as the device tool returns 8 files at most.
# BENCH_COMMIT=<hash> names the commit where the copy has no .git; GPU_CHECK_ARGS adds
# arguments to gpu-check; BENCH_BUDGET_S (260) is the bench rows' budget (cases not started
# by then are skipped: every row with the anchors a user would pick runs first, then each
# row's A/B anchors, which compile kernels of their own; GPU_CHECK_ARGS="--ab only" runs
# those alone, in a second call: without the `tma` step there, add by hand the flags the
# first call's gates granted, as summary.txt lists them), its step's time limit 30 s more. On a CPU: GPU_TEST_PLATFORMS=cpu PYTHON=.venv/bin/python
# GPU_CHECK_ARGS="--dry-run --rows m64" bash bench/gpu_check.sh tma bench ncu (the `tma`
# gate stays shut: the copy skips).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
PY="${PYTHON:-python3}"
steps=" ${*:-tma bench ncu} "
for step in $steps; do
  case "$step" in
    tma | bench | ncu | quick-tests | tests | suite | tune) ;;
    *) echo "gpu_check.sh: unknown step '$step' (tma bench ncu quick-tests tests suite tune)" >&2; exit 2 ;;
  esac
done
# JAX and PyTorch (the anchors) share the GPU in one process: no preallocation. The tests'
# conftest picks the CPU unless told otherwise. Inductor compiles FlexAttention in its own
# process, not a pool of workers left running beside the timed calls.
export XLA_PYTHON_CLIENT_PREALLOCATE=false TORCHINDUCTOR_COMPILE_THREADS=1
logs="$OUT/logs"
mkdir -p "$OUT/bench/results" "$logs"
summary="$OUT/summary.txt"
note() { echo "[gpu_check $(date -u +%T)] $*" | tee -a "$summary"; }
pack() { tar czf "$OUT/gpu_check_logs.tgz" -C "$OUT" logs && rm -r "$logs"; }
trap pack EXIT
# pytest on the device (GPU_TEST_PLATFORMS=cpu to try the script on a CPU), failures with
# their tracebacks:
gpu_pytest=(env JAX_PLATFORMS="${GPU_TEST_PLATFORMS:-cuda}" RAGGED_KERNELS_PTX_CACHE_DIR=
  "$PY" -m pytest -q --tb=short -p no:cacheprovider)
# gate NAME LIMIT WORKERS MUST LABEL PYTEST_ARGS...: the tests in a process of their own
# (log $logs/NAME.txt); true if they all passed within LIMIT seconds and one whose name
# holds MUST ran on the device (PASSED, not skipped).
gate() {
  local name=$1 limit=$2 workers=$3 must=$4 label=$5
  shift 5
  timeout "$limit" "${gpu_pytest[@]}" -rA -n "$workers" "$@" >"$logs/$name.txt" 2>&1
  local rc=$?
  note "$label ($name.txt): exit $rc -- $(tail -1 "$logs/$name.txt")"
  [ "$rc" -eq 0 ] && grep -q "^PASSED .*$must" "$logs/$name.txt"
}

note "start on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); steps:$steps"
# The kernels' PTX compiled beforehand on a CPU (`make gpu-ptx-cache`, the device call's
# carry): the bench rows then compile none of them again (jax_bridge/launch/ptx_cache.py).
# The tests compile their own, as without the carry (`gpu_pytest` turns it off).
if [ -d .ptx-cache ]; then
  export RAGGED_KERNELS_PTX_CACHE_DIR="$PWD/.ptx-cache"
  note "carried PTX cache: $(find .ptx-cache -name '*.json.gz' | wc -l) kernels"
fi
if ! "$PY" -c "import jax_triton" 2>/dev/null; then
  "$PY" -m pip install --no-deps --no-index bench/wheels/jax_triton-0.3.1-py3-none-any.whl \
    >"$logs/pip.txt" 2>&1
  note "installed the carried jax-triton wheel: exit $?"
fi

# Kernels with device-side tensor descriptors first, in their own process: a copy, then our
# attention and gmm kernels with `tma` against their references. Only if the copy ran on
# the device (not skipped) and all passed do the bench rows time the TMA A/B anchors (a
# kernel that faults on the device ends its process). Ours takes TMA for dK/dV by default
# on an H100 whatever this step says: should it fail, read the bench rows with that in mind.
tma_flag=""
if [[ $steps == *" tma "* ]] && gate tma 100 8 copies_on_a_hopper_gpu "TMA kernels" \
  tests/launch/test_kernel_needs.py tests/attention/test_triton.py \
  tests/grouped_matmul/test_triton.py \
  -k "(tma or hopper) and not warp_specialized and not warp-specialized and not host"; then
  tma_flag="--tma"
  # Descriptors the launch encodes (jaxlib's, from Triton's metadata), apart: their rows'
  # gate (the launch layer's copy kernel, then gmm and the three varlen kernels: 54 tests,
  # 2 of them skipped there).
  if gate host_descriptors 150 6 "writes_every_row_once.*tma-host" "host-side descriptors" \
    tests/launch/test_host_descriptors.py tests/grouped_matmul/test_triton.py \
    tests/attention/test_triton.py -k "host and not warp-specialized"; then
    tma_flag="$tma_flag --host-descriptors"
  fi
  # Warp-specialized kernels (a producer warpgroup, two consumers: 12 warps), and their
  # A/B rows only if they ran right; the warp-specialized dK/dV apart, its rows' gate.
  if gate warp_specialized 90 6 warp_specialized_kernel_multiplies_on_a_hopper_gpu \
    "warp-specialized kernels" tests/launch/test_kernel_needs.py \
    tests/grouped_matmul/test_triton.py tests/attention/test_triton.py \
    -k "warp_specialized and hopper_gpu and not dkdv"; then
    tma_flag="$tma_flag --warp-specialized"
    if gate warp_specialized_dkdv 60 2 warp_specialized_dkdv_gives "warp-specialized dK/dV" \
      tests/attention/test_triton.py -k "warp_specialized_dkdv and hopper_gpu"; then
      tma_flag="$tma_flag --warp-specialized-dkdv"
    fi
  fi
fi

if [[ $steps == *" bench "* ]]; then
  json="$OUT/bench/results/gpu-check-$(date -u +%Y%m%dT%H%MZ).json"
  budget="${BENCH_BUDGET_S:-260}"
  timeout $((budget + 30)) "$PY" -m bench gpu-check --budget-s "$budget" --json "$json" \
    $tma_flag ${GPU_CHECK_ARGS:-} >"$logs/gpu_check.txt" 2>&1
  rc=$?
  note "bench rows (gpu_check.txt, $(basename "$json")): exit $rc -- $(grep -m1 '^PTX cache' "$logs/gpu_check.txt")"
  # Each A/B anchor against the default and issue 27's bars, into the summary itself.
  if [ -s "$json" ]; then
    "$PY" -m bench gpu-check --verdicts "$json" >"$logs/verdicts.txt" 2>&1
    note "verdicts (verdicts.txt, below): exit $?"
    cat "$logs/verdicts.txt" >>"$summary"
  fi
  if [ "$rc" -gt 1 ] && [ "$rc" -ne 124 ]; then
    # A crash, not a failed check or the time limit: again without PyTorch in the process.
    timeout 120 "$PY" -m bench gpu-check --no-torch --budget-s 90 \
      --json "${json%.json}-no-torch.json" ${GPU_CHECK_ARGS:-} >"$logs/gpu_check_no_torch.txt" 2>&1
    note "bench rows without PyTorch (gpu_check_no_torch.txt): exit $?"
  fi
fi

if [[ $steps == *" ncu "* ]]; then
  if command -v ncu >/dev/null; then
    # (16 block-sparse documents: its kernels' second, CAREFUL, launches on clean data)
    for key in "16x1024 causal" "m8192 G64" "tok 16 documents"; do
      name="ncu_${key// /_}"
      # Autotuning off: under ncu every candidate kernel XLA tries would be profiled.
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 45 \
        ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
        "$PY" -m bench gpu-check --profile "$key" >"$logs/$name.txt" 2>&1
      note "ncu $key ($name.txt): exit $?"
      "$PY" -m bench gpu-check --ncu-summary "$logs/$name.txt" 2>&1 | tee "$logs/${name}_summary.txt" \
        | tail -1 | while read -r line; do note "  $line"; done
    done
    # What limits our attention kernels (the backward most: Flex's takes 0.6-0.75 of its
    # time): occupancy, issue efficiency, stall reasons and memory traffic of the forward,
    # dQ and dK/dV kernels of one 16 x 1024 fwd+bwd. --profile launches them in the order
    # fwd (warm-up), fwd (timed), then fwd, dq, dkdv (fwd+bwd) and so on: skip two.
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 90 \
      ncu --clock-control none -k "regex:attention_(forward|backward_dq|backward_dkdv)_kernel" \
      --launch-skip 2 --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      "$PY" -m bench gpu-check --profile "16x1024 causal" >"$logs/ncu_detail.txt" 2>&1
    note "ncu sections of the attention kernels (ncu_detail.txt): exit $?"
    grep -E "attention_[a-z_]+_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued Instruction|No Eligible" \
      "$logs/ncu_detail.txt" | while read -r line; do note "  $line"; done
    # Grouped matmul's kernels of one m 32768 fwd+bwd (the forward's gmm, the input
    # gradient's gmm, the weight gradient's tgmm): bound by L2 or DRAM traffic, or by
    # neither? (gmm's Hopper tile was chosen for its L2 traffic.) --profile launches gmm
    # twice (the forward's warm-up and timed calls) before the fwd+bwd: skip two.
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 75 \
      ncu --clock-control none -k "regex:^t?gmm_kernel$" --launch-skip 2 --launch-count 3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      "$PY" -m bench gpu-check --profile "m32768 G32" >"$logs/ncu_gmm_detail.txt" 2>&1
    note "ncu sections of the grouped matmul kernels (ncu_gmm_detail.txt): exit $?"
    grep -E "gmm_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Achieved Occupancy" \
      "$logs/ncu_gmm_detail.txt" | while read -r line; do note "  $line"; done
  else
    note "ncu not found: no kernel profile"
  fi
fi

conformance=(tests/attention/test_conformance.py tests/grouped_matmul/test_conformance.py
  tests/block_sparse/test_conformance.py)
if [[ $steps == *" quick-tests "* ]]; then
  timeout 100 "${gpu_pytest[@]}" -rfE -n 12 "${conformance[@]}" -k "triton" >"$logs/quick_tests.txt" 2>&1
  note "GPU tests, Triton backend (quick_tests.txt): exit $? -- $(tail -1 "$logs/quick_tests.txt")"
fi
if [[ $steps == *" tests "* ]]; then
  timeout 480 "${gpu_pytest[@]}" -rfE -n 12 "${conformance[@]}" tests/launch/test_kernel_needs.py \
    tests/attention/test_triton.py tests/grouped_matmul/test_triton.py -k "not pallas" \
    >"$logs/tests.txt" 2>&1
  note "GPU tests (tests.txt): exit $? -- $(tail -1 "$logs/tests.txt")"
  # Interpreted on a GPU, the splash kernels' float32 dots must not fall to TF32.
  timeout 60 "${gpu_pytest[@]}" -rfE tests/splash/test_kernels.py \
    -k "matches_reference or exactly" >"$logs/splash_tests.txt" 2>&1
  note "splash kernels interpreted on the GPU (splash_tests.txt): exit $? -- $(tail -1 "$logs/splash_tests.txt")"
fi
if [[ $steps == *" suite "* ]]; then
  timeout -s INT -k 30 "${SUITE_LIMIT_S:-540}" "${gpu_pytest[@]}" -rfE -n 12 -m "not slow" \
    -k "not pallas" tests >"$logs/suite.txt" 2>&1
  note "the quick suite on the device (suite.txt): exit $? -- $(tail -1 "$logs/suite.txt")"
  grep -E "^(FAILED|ERROR) " "$logs/suite.txt" | while read -r line; do note "  $line"; done
fi
if [[ $steps == *" tune "* ]]; then
  timeout 420 "$PY" -m bench tune --force --cache "$OUT/tuning.json" >"$logs/tune.txt" 2>&1
  note "tuning (tune.txt, tuning.json): exit $?"
  grep -E "^  [a-z_.]+: |config=" "$logs/tune.txt" | while read -r line; do note "  $line"; done
fi
note "done"
