#!/usr/bin/env bash
# Sampled native profiles (py-spy --native) of the one-thread queue with batch=1 (empty ops and
# GEMMs, experiments/queue_split.py) and of the speech example's eager deviceop loop beside the
# blocking PyTorch loop, each summed by experiments/stacks.py. Writes under $OUT (set it).
# PYSPY: the py-spy binary (default: py-spy on PATH); RATE: samples per second (default 1000;
# --native pauses the process at each sample); WHAT: queue, asr or all (default).
set -u
: "${OUT:?set OUT}"
mkdir -p "$OUT"
PYSPY=${PYSPY:-py-spy}
RATE=${RATE:-1000}
WHAT=${WHAT:-all}
rec() { "$PYSPY" record --native -r "$RATE" -f raw -o "$OUT/$1.raw" -- "${@:2}" >"$OUT/$1.log" 2>&1 || tail "$OUT/$1.log"; }
# sum RAW NAME ARGS...: RAW.raw summed into NAME_stacks.{txt,json}
sum() { python3 experiments/stacks.py "$OUT/$1.raw" --top 40 "${@:3}" --out "$OUT/$2_stacks.json" >"$OUT/$2_stacks.txt" 2>&1; cat "$OUT/$2_stacks.txt"; }
F=(--frame epoll --frame await_op --frame _worker --frame start_sliced --frame arm --frame _poll
   --frame "libcuda" --frame cuLaunch --frame cuGraphLaunch --frame cuStreamWriteValue --frame cuEventRecord
   --frame "finish" --frame retire --frame "task_step" --frame _drive --frame "Lanes." --frame "Run." --frame start_batch
   --frame "sleep (asyncio" --frame "WorkQueue._add" --frame "WorkQueue.run" --frame "Lanes.add")
for kind in $([ "$WHAT" = asr ] || echo noop gemm); do
  rec "queue_b1_$kind" python3 experiments/queue_split.py --kinds "$kind" --batches 1 --items 20000 --reps 3 \
    --out "$OUT/queue_b1_${kind}_sampled.json"
  echo "== queue batch=1, $kind (inside WorkQueue's run)"
  sum "queue_b1_$kind" "queue_b1_$kind" --within "queue (queue_split.py" --without importlib "${F[@]}"
done
[ "$WHAT" = queue ] && exit 0
rec asr python3 examples/asr_stream/run.py --loops deviceop-torch,torch-blocking --rounds 1 --out "$OUT/asr_sampled.json"
A=(--frame "Encoder." --frame "interop" --frame "_torch.py" --frame await_op --frame start_sliced --frame epoll
   --frame cuLaunch --frame "libtorch" --frame "eager_op" --frame "arm" --frame "finish" --frame "to_numpy"
   --frame "from_numpy" --frame "_enqueue_rest")
echo "== asr, deviceop: the chunk's task"
sum asr asr_deviceop --within "process (run.py" "${A[@]}"
echo "== asr, blocking: the chunk's call"
sum asr asr_blocking --within "_torch_chunk (run.py" "${A[@]}"
