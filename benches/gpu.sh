#!/usr/bin/env bash
# The GPU box's first run (docs/gpu.md): within 10 minutes on one H100, every command under its own
# time limit, everything measured on the GPU (--device cuda). Each command writes its figures as
# JSON into $OUT as soon as it ends (the longer ones also as they go) and its output into
# $OUT/NAME.log; a failing or timed-out command does not stop the others. The runs that go to the
# memory limit (maxbatch) come last.
#   OUT=gpu-results bash benches/gpu.sh            # TOTAL=570 (seconds for everything), EXTRA=1 (more)
set -u
OUT=${OUT:-gpu-results}
TOTAL=${TOTAL:-570}        # the whole script's deadline: each limit below is cut to what is left of it
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="$PYTHON -m tensorplace.bench"
fails=0
SECONDS=0

run() {  # run NAME LIMIT CMD...: CMD under `timeout` (LIMIT seconds, less if the deadline is nearer)
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL - SECONDS - 5))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "== $name: skipped, ${left}s left of TOTAL=${TOTAL}s"
        fails=$((fails + 1))
        return
    fi
    echo "== $name (limit ${limit}s, at ${SECONDS}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    [ $rc = 124 ] && echo "!! $name hit its limit of ${limit}s"
    [ $rc = 0 ] || fails=$((fails + 1))
}
step() {  # step NAME LIMIT ARGS...: one bench command, its figures in $OUT/NAME.json
    local name=$1 limit=$2
    shift 2
    run "$name" "$limit" $B "$@" --json "$OUT/$name.json"
}

R50=(--model resnet50 --batch 128 --image 224 --classes 1000 --device "$DEVICE")
GPT=(--model gpt12 --batch 16 --seq 1024 --device "$DEVICE")

# 1. The CUDA tests: the CUDA backend, state swaps, the bench's --device cuda.
run cuda-tests 50 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py tests/test_state_swaps.py \
    tests/test_bench.py::test_device_cuda_puts_everything_on_the_gpu
# 2. Profiles to send back (plan them anywhere), and plans from them.
step profile-resnet50 45 profile "${R50[@]}" --repeats 3 -o "$OUT/resnet50-b128.profile.json"
step profile-gpt12 50 profile "${GPT[@]}" --repeats 3 -o "$OUT/gpt12-b16.profile.json"
step plan-resnet50 25 plan "$OUT/resnet50-b128.profile.json" --budget 6GiB --particles 100 --iterations 50 \
    -o "$OUT/resnet50-b128.plan.json"
step plan-gpt12 25 plan "$OUT/gpt12-b16.profile.json" --budget 16GiB --particles 100 --iterations 50 \
    -o "$OUT/gpt12-b16.plan.json"
# 3. The peers tables, planned on those profiles: each row on its own, a limit per row, a line per row.
step peers-resnet50 100 peers "${R50[@]}" --profile "$OUT/resnet50-b128.profile.json" --time-limit 40
step peers-gpt12 125 peers "${GPT[@]}" --profile "$OUT/gpt12-b16.profile.json" --time-limit 50 --repeats 2
# 4. Largest batch in a budget (measured at the limit: last).
step maxbatch-resnet50 80 maxbatch --model resnet50 --image 224 --classes 1000 --device "$DEVICE" --memory 16GiB \
    --probe-batches 32 64 --methods pso unplanned --tries 2 --repeats 1
step maxbatch-gpt12 70 maxbatch --model gpt12 --seq 1024 --device "$DEVICE" --memory 8GiB --probe-batches 2 4 \
    --methods pso unplanned --tries 2 --repeats 1
echo "== done after ${SECONDS}s: $fails command(s) failed or were skipped; results in $OUT"

if [ "${EXTRA:-0}" = 1 ]; then  # beyond the 10 minutes: planned against unplanned and predicted
    TOTAL=$((SECONDS + ${EXTRA_TOTAL:-300}))
    step demo-resnet50 100 demo "${R50[@]}" --fraction 0.5 --iterations 50 --particles 100
    step accuracy-resnet50 150 accuracy "${R50[@]}" --fractions 0.3 0.5 --iterations 50 --particles 100
    step timeline-resnet50 40 timeline --plan "$OUT/resnet50-b128.plan.json" --png "$OUT/timeline-resnet50.png"
fi
exit $((fails > 0))
