#!/usr/bin/env bash
# compute-sanitizer over the cuda tests (on a GPU): memcheck over the whole cuda suite, synccheck
# and racecheck over the whole suite less what is said below. Logs and each tool's ERROR SUMMARY go to $OUT.
# racecheck runs one process per test file, RACE_JOBS at a time (its instrumentation makes the
# suite take far longer than a time limit of minutes allows when run as one process), and leaves out kernels
# that have no shared memory and only slow it down: the tests' spin kernels (slow_*, which
# spin for a set number of cycles and take minutes each under racecheck). racecheck detects
# hazards on shared memory only (its documentation: "a run time shared memory data access
# hazard detector"); deviceop's kernels with __shared__ are the row-wise built-ins
# (kernels/_rowwise.py; tests/test_builtins.py::test_racecheck_scope checks no other source
# declares it).
# racecheck also leaves out cuBLAS's other kernels (names with gemm, xmma, cutlass or
# splitKreduce), and the tests whose work is mostly cuBLAS's (tests/test_gemm.py and the
# examples' service, GEMM queue, speech loop, and its encoder in deviceop kernels): on the H100
# and the H200 a cuBLAS kernel running under racecheck, instrumented or not, ends in "The
# Sanitizer failed to handle a hardware exception" and CUDA_ERROR_ILLEGAL_ADDRESS, and the
# context is lost for the rest of the file (memcheck runs the same tests clean). It deselects
# the tests that launch from several host threads at once (names with "thread"): there the
# sanitizer stops tracking launches ("Detected a failure to track a kernel launch") and one
# such test hangs. A shared-memory hazard is a property of
# one launch, and each deviceop kernel those tests launch is also launched from one thread by
# other tests; memcheck and synccheck run them all.
# synccheck leaves out cuBLAS's nvjet kernels (launched by deviceop's GEMM and by
# PyTorch in the interop tests): on the H100 the sanitizer cannot allocate the memory to track
# their launches and reports each as an "Internal Sanitizer Error" (16,495 of them over the
# suite under synccheck), not a hazard; they are NVIDIA's kernels, and memcheck still covers them.
# synccheck also leaves out the examples' tests that run transformer models in PyTorch (the
# service's load test, the speech loop with wav2vec 2.0): on the H200 their cuDNN attention
# kernel (cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_*, which uses cuda::barrier)
# overflows the barriers synccheck tracks ("Detected overflow of tracked cuda::barrier
# structures"), then fails its launch ("unspecified launch failure" in the example's process,
# one error in the summary); with --num-cuda-barriers raised the example passes but the
# sanitizer cannot track cuDNN's and PyTorch's launches ("Internal Sanitizer Error ... Unable to
# allocate enough memory"). These are NVIDIA's and PyTorch's kernels; memcheck runs those tests.
# Tests that need work to be still in flight can fail under a sanitizer, which serialises
# launches: those failures are listed in the logs and are not sanitizer errors.
# Every tool runs with --show-backtrace device: the host backtrace the sanitizer takes at each
# API call materialises the calling Python frames and never releases them, so their locals (the
# tensors a launch was given) stay alive and the tests that count memory going back fail.
# Usage: bash tests/sanitize.sh [memcheck|synccheck|racecheck ...]
set -u -o pipefail
OUT=${OUT:-/tmp/deviceop-out}
mkdir -p "$OUT"
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
# DEVICEOP_SANITIZER=1: the test that faults on purpose skips itself
export PYTHONUNBUFFERED=1 DEVICEOP_SANITIZER=1 DEVICEOP_CACHE_DIR=${DEVICEOP_CACHE_DIR:-/tmp/deviceop-cache}
status=0
tools=("$@")
[ ${#tools[@]} = 0 ] && tools=(memcheck synccheck racecheck)
NVJET=(--kernel-name-exclude kns=nvjet)
BT=(--show-backtrace device)
# what racecheck runs: the cuda tests, less those that launch from several host threads and
# those whose cuBLAS kernels the sanitizer cannot run (see above)
RACE_K='cuda and not thread and not test_service_load_test and not test_gemm_queue and not test_asr_stream and not test_asr_kernel_encoder'
racecheck_file() {  # one test file under racecheck: its log, then its summary line
  local f=$1 log
  log="$OUT/racecheck_$(basename "$f" .py).log"
  if ! python3 -m pytest -q -p no:cacheprovider --collect-only "$f" -k "$RACE_K" >/dev/null 2>&1; then
    echo "$f: no cuda tests to run" | tee "$log"
    return
  fi
  timeout "${SAN_TIMEOUT:-540}" "$CS" --tool racecheck --show-backtrace device --kernel-name-exclude kns=nvjet --kernel-name-exclude kns=gemm \
    --kernel-name-exclude kns=xmma --kernel-name-exclude kns=cutlass --kernel-name-exclude kns=splitKreduce \
    --kernel-name-exclude kns=slow_ \
    --print-limit 50 python3 -m pytest -q -p no:cacheprovider "$f" -k "$RACE_K" >"$log" 2>&1
  echo "$f exit $?: $(grep -E 'RACECHECK SUMMARY' "$log" | tail -1)"
}
export -f racecheck_file
export CS OUT RACE_K
for tool in "${tools[@]}"; do
  log="$OUT/sanitizer_$tool.log"
  if [ "$tool" = racecheck ]; then
    ls tests/test_*.py | grep -v '^tests/test_gemm.py$' | xargs -P "${RACE_JOBS:-8}" -I{} bash -c 'racecheck_file {}' >"$OUT/racecheck_files.txt"
    : >"$log"
    for f in tests/test_*.py; do
      [ -f "$OUT/racecheck_$(basename "$f" .py).log" ] || continue
      echo "######## $f" >>"$log"
      cat "$OUT/racecheck_$(basename "$f" .py).log" >>"$log"
      rm -f "$OUT/racecheck_$(basename "$f" .py).log"
    done
    files=$(grep -vc 'no cuda tests' "$OUT/racecheck_files.txt")
    clean=$(grep -c 'RACECHECK SUMMARY: 0 hazards displayed' "$OUT/racecheck_files.txt")
    { echo "######## per file"; sort "$OUT/racecheck_files.txt"; } >>"$log"
    rm -f "$OUT/racecheck_files.txt"
    internal=$(grep -c 'Internal Sanitizer Error' "$log")
    echo "racecheck: $clean of $files test files with cuda tests: 0 hazards; $(grep -c '^FAILED' "$log") tests failed; $internal internal sanitizer errors"
    [ "$files" -gt 0 ] && [ "$clean" = "$files" ] && [ "$internal" = 0 ] || status=1
    continue
  fi
  extra=()
  [ "$tool" = synccheck ] && extra=("${NVJET[@]}")
  sel=cuda
  [ "$tool" = synccheck ] && sel='cuda and not test_service_load_test and not (test_asr_stream and wav2vec2)'
  timeout "${SAN_TIMEOUT:-540}" "$CS" --tool "$tool" "${BT[@]}" "${extra[@]}" --print-limit 50 python3 -m pytest -q -p no:cacheprovider tests -k "$sel" \
    >"$log" 2>&1
  echo "$tool: exit $? ($(grep -c '^FAILED' "$log") tests failed); $(grep -E 'ERROR SUMMARY' "$log" | tail -1)"
  grep -qE 'ERROR SUMMARY: 0 errors' "$log" || status=1
done
exit $status
