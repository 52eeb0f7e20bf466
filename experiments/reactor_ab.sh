#!/usr/bin/env bash
# The await path's host cost, A/B: the library at commit OLD against the working tree (NEW), both
# built, each script run on one then the other, RUNS times (a drift of the host's speed falls on
# both): unless QUEUE=0 experiments/queue_split.py (a work-queue item's parts and WorkQueue per
# item), unless AWAIT=0 experiments/await_cost.py (await minus sync_on, over $AWAIT_LENGTHS,
# default the short ones up to 2 ms) and, unless
# BIMODAL=0, experiments/bimodal.py over $BIMODAL_STREAMS streams (default 4,8; BIMODAL_ARGS:
# more of its arguments, default --no-torch). JSON per run, packed into $OUT/reactor_ab.tar.gz.
# OLD: a commit, or a tar file of the old tree. PIN: a CPU list (taskset -c) every run is kept on
# (virtual machines have CPUs that run the same thread up to 2x slower: experiments/cpu_speed.py).
#   OUT=/tmp/out bash experiments/reactor_ab.sh OLD [RUNS]
set -u -o pipefail
OLD=${1:?usage: reactor_ab.sh OLD_COMMIT [RUNS]}
RUNS=${2:-2}
BIMODAL=${BIMODAL:-1}
BIMODAL_STREAMS=${BIMODAL_STREAMS:-4,8}
BIMODAL_ARGS=${BIMODAL_ARGS:---no-torch}
AWAIT=${AWAIT:-1}
AWAIT_LENGTHS=${AWAIT_LENGTHS:-1_kernel,20us,100us,2ms}
QUEUE=${QUEUE:-1}
OUT=${OUT:-/tmp/deviceop-out}
AB_COPY=experiments/queue_split.py  # the same script on both
. experiments/ab_trees.sh
run() {  # run VERSION SCRIPT ARGS...: in that tree
  local v=$1 d=$NEW
  shift
  [ "$v" = old ] && d=/tmp/old
  (cd $d && PYTHONPATH=$d$SITE timeout 300 ${PIN:+taskset -c "$PIN"} python3 "$@") || echo "$v: $* failed"
}
for r in $(seq 1 "$RUNS"); do
  for v in old new; do
    if [ "$QUEUE" != 0 ]; then
      echo "== $v run $r: queue_split"
      run $v experiments/queue_split.py --reps 3 --out "$OUT/queue_split_${v}_$r.json" | tail -6
    fi
    if [ "$AWAIT" != 0 ]; then
      echo "== $v run $r: await_cost"
      run $v experiments/await_cost.py --reps 400 --lengths "$AWAIT_LENGTHS" --loops uvloop,asyncio,trio \
        --no-policies --out "$OUT/await_cost_${v}_$r.json" | tail -12
    fi
    if [ "$BIMODAL" != 0 ]; then
      echo "== $v run $r: bimodal"
      run $v experiments/bimodal.py --streams "$BIMODAL_STREAMS" $BIMODAL_ARGS --out "$OUT/bimodal_${v}_$r.json" 2>&1 | tail -6
    fi
  done
done
# the device tool brings back a few files a call: one archive
tar czf /tmp/reactor_ab.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/reactor_ab.tar.gz "$OUT/"
