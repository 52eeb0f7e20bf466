#!/usr/bin/env bash
# compute-sanitizer over the cuda tests (on a GPU): memcheck and synccheck over the whole cuda
# suite, racecheck over the built-in and kernel tests. racecheck detects hazards on shared
# memory only (its documentation: "a run time shared memory data access hazard detector"), and
# deviceop's only kernels with __shared__ are the row-wise built-ins (kernels/_rowwise.py,
# exercised by tests/test_builtins.py; tests/test_builtins.py::test_racecheck_scope checks that
# no other source declares shared memory). The rest of the suite launches kernels without shared
# memory (elementwise built-ins, the tests' spin kernels, which take minutes each under
# racecheck) and cuBLAS's. Logs and each tool's ERROR SUMMARY go to $OUT.
# synccheck leaves out cuBLAS's nvjet kernels (launched by deviceop's GEMM and by PyTorch in the
# interop tests): on the H100 it cannot allocate the memory to track their launches and reports
# each as an "Internal Sanitizer Error" (16,495 of them over the suite), not a hazard; they are
# NVIDIA's kernels, and memcheck still covers them.
# Tests that need work to be still in flight can fail under a sanitizer, which serialises
# launches: those failures are listed in the logs and are not sanitizer errors.
# Usage: bash experiments/sanitize.sh [memcheck|synccheck|racecheck ...]
set -u -o pipefail
OUT=${OUT:-/tmp/deviceop-out}
mkdir -p "$OUT"
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
# DEVICEOP_SANITIZER=1: the test that faults on purpose skips itself
export PYTHONUNBUFFERED=1 DEVICEOP_SANITIZER=1 DEVICEOP_CACHE_DIR=${DEVICEOP_CACHE_DIR:-/tmp/deviceop-cache}
status=0
tools=("$@")
[ ${#tools[@]} = 0 ] && tools=(memcheck synccheck racecheck)
for tool in "${tools[@]}"; do
  extra=()
  case "$tool" in
    racecheck) tests="tests/test_builtins.py tests/test_kernels.py" ;;
    synccheck) tests="tests"; extra=(--kernel-name-exclude kns=nvjet) ;;
    *) tests="tests" ;;
  esac
  timeout "${SAN_TIMEOUT:-540}" "$CS" --tool "$tool" "${extra[@]}" --print-limit 50 python3 -m pytest -q -p no:cacheprovider $tests -k cuda \
    >"$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool: exit $? ($(grep -c '^FAILED' "$OUT/sanitizer_$tool.log") tests failed); $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
  grep -qE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$OUT/sanitizer_$tool.log" || status=1
done
exit $status
