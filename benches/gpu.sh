#!/usr/bin/env bash
# The tensorplace-bench runs for a GPU machine (docs/gpu.md). Every command writes its figures
# as JSON into $OUT as soon as it ends; a failing command does not stop the others. Runs that may
# run out of memory (maxbatch confirms batches near the limit) come last.
#   OUT=gpu-results MEMORY=8GiB bash benches/gpu.sh
set -u
OUT=${OUT:-gpu-results}
MEMORY=${MEMORY:-8GiB}
mkdir -p "$OUT"
B="python3 -m tensorplace.bench"
fails=0
step() {  # step NAME ARGS...: one bench command, its output in $OUT/NAME.log, figures in $OUT/NAME.json
    local name=$1
    shift
    echo "== $name: tensorplace-bench $*"
    $B "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    [ $rc = 0 ] || { echo "!! $name failed (exit $rc)"; fails=$((fails + 1)); }
}

# Profiles (to plan anywhere) of the two models measured so far on the H100.
step profile-resnet50 profile --model resnet50 --batch 128 --image 224 --classes 1000 -o "$OUT/resnet50-b128.profile.json"
step profile-gpt12 profile --model gpt12 --batch 16 --seq 1024 -o "$OUT/gpt12-b16.profile.json"
# Plans from them (the same command works on a laptop).
step plan-resnet50 plan "$OUT/resnet50-b128.profile.json" --budget "$MEMORY" -o "$OUT/resnet50-b128.plan.json"
step timeline-resnet50 timeline --plan "$OUT/resnet50-b128.plan.json" --png "$OUT/timeline-resnet50.png"
# Planned against unplanned, measured; predicted against measured.
step demo-resnet50 demo --model resnet50 --batch 128 --image 224 --classes 1000 --fraction 0.5
step demo-gpt12 demo --model gpt12 --batch 16 --seq 1024 --fraction 0.5
step accuracy-resnet50 accuracy --model resnet50 --batch 128 --image 224 --classes 1000 --fractions 0.3 0.5
# The peers table: checkpoint recipes and save_on_cpu against plans at their memory, measured.
step peers-resnet18 peers --model resnet18 --batch 64 --image 224 --classes 1000
step peers-gpt12 peers --model gpt12 --batch 8 --seq 1024
# Largest batch per method in $MEMORY (measured at the limit: last).
step maxbatch-resnet18 maxbatch --model resnet18 --image 224 --classes 1000 --memory "$MEMORY" --probe-batches 32 64
step maxbatch-gpt12 maxbatch --model gpt12 --seq 1024 --memory "$MEMORY" --probe-batches 2 4
echo "$fails command(s) failed; results in $OUT"
exit $((fails > 0))
