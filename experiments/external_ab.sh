#!/usr/bin/env bash
# An external step's host cost, A/B: the library at commit OLD against the working tree (NEW),
# each built, run in turn RUNS times (experiments/external_cost.py --steps-only), so that a
# change of the host's speed during the call falls on both alike; prints each run and the medians.
# JSON per run under $OUT (ext_old_<i>.json, ext_new_<i>.json, packed as ext_ab.tar.gz).
#   OUT=/tmp/out bash experiments/external_ab.sh OLD [RUNS]
set -u -o pipefail
OLD=${1:?usage: external_ab.sh OLD_COMMIT [RUNS]}
RUNS=${2:-8}
OUT=${OUT:-/tmp/deviceop-out}
. experiments/ab_trees.sh
for r in $(seq 1 "$RUNS"); do
  for v in old new; do
    d=$NEW
    [ $v = old ] && d=/tmp/old
    (cd $d && PYTHONPATH=$d$SITE timeout 120 python3 experiments/external_cost.py --steps-only --reps 300 \
      --out "$OUT/ext_${v}_$r.json" >/dev/null 2>&1) || { echo "$v $r failed"; exit 1; }
  done
done
python3 - "$OUT" <<'PY'
import glob
import json
import statistics
import sys

out = sys.argv[1]
for v in ("old", "new"):
    rs = [json.load(open(f))["steps"] for f in sorted(glob.glob(f"{out}/ext_{v}_*.json"))]
    for k in ("external_over_direct_us", "external_wrapped_over_direct_us", "external_noop_us", "adapter_over_direct_us", "direct_us"):
        xs = [r[k] for r in rs]
        print(v, k, "median", round(statistics.median(xs), 2), "runs", [round(x, 2) for x in xs])
PY
tar czf /tmp/ext_ab.tar.gz -C "$OUT" $(cd "$OUT" && ls ext_*.json) && rm "$OUT"/ext_*.json && mv /tmp/ext_ab.tar.gz "$OUT/"
