#!/usr/bin/env bash
# A GPU machine in one command: build the core in place, run the tests on it, then the benchmarks.
# Results (the benchmarks' document, the logs) go to $OUT.
# Usage: [SKIP_TESTS=1] [TESTS_PART=K/N] [SKIP_BENCH=1] [QUICK=1] bash benchmarks/gpu_suite.sh [benchmark ...]
#   SKIP_TESTS=1: the benchmarks only (the tests ran in an earlier run)
#   TESTS_PART=K/N: the K-th of N parts of the test files (every N-th file from the K-th, in
#                 name order), where a job's time limit is shorter than the whole suite
#   SKIP_BENCH=1: the tests only
#   QUICK=1:      the benchmarks' quick profile (fewer repeats and sizes)
#   benchmark:    a subset (python -m benchmarks --list names them); default: all
set -u -o pipefail
OUT=${OUT:-/tmp/deviceop-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export DEVICEOP_CACHE_DIR=${DEVICEOP_CACHE_DIR:-/tmp/deviceop-cache}
# wheels a machine without network lacks (cp312, manylinux), carried in the ignored .whl/:
# nvmath-python, trio with outcome and sortedcontainers, pytest-asyncio, sniffio, webrtcvad-wheels
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site || exit 1
fi
status=0
# the compiled core, built in place as pip install -e does (Cython, cuda.h from the toolkit)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 setup.py -q build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1 || { echo "core build FAILED"; tail -n 30 "$OUT/build.log"; exit 1; }
rm -rf build
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m deviceop info | tail -n 3
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  tests=(tests)
  if [ -n "${TESTS_PART:-}" ]; then
    k=${TESTS_PART%/*} n=${TESTS_PART#*/}
    if ! [[ "$k" =~ ^[0-9]+$ && "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$k" -lt 1 ] || [ "$k" -gt "$n" ]; then
      echo "TESTS_PART is K/N with 1 <= K <= N, got '$TESTS_PART'"; exit 2
    fi
    mapfile -t tests < <(ls tests/test_*.py | sort | awk -v k="$k" -v n="$n" '(NR - k) % n == 0')
    echo "tests, part $TESTS_PART: ${tests[*]}"
  fi
  # (Ray's tests start a cluster: minutes on a fresh machine; tests/test_examples.py runs them)
  timeout 480 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" "${tests[@]}" -k "not test_ray_" 2>&1 \
    | tee "$OUT/pytest.log" | tail -n 25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  quick=()
  [ "${QUICK:-0}" = 1 ] && quick=(--quick)
  python3 -m benchmarks "${quick[@]}" --out "$OUT/benchmarks.json" "$@" 2>"$OUT/benchmarks.log" || status=1
fi
exit $status
