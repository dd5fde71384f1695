#!/usr/bin/env bash
# The GPU box's first run (docs/gpu.md): within 10 minutes on one H100, every command under its own
# time limit, everything measured on the GPU (--device cuda). Each command writes its figures as
# JSON into $OUT as soon as it ends (the longer ones also as they go) and its output into
# $OUT/NAME.log; a failing or timed-out command does not stop the others. The runs that cap the
# process's memory run in their own processes (reserved, maxbatch).
#   OUT=gpu-results bash benches/gpu.sh            # TOTAL=470 (seconds for everything), EXTRA=1 (more)
set -u
OUT=${OUT:-gpu-results}
TOTAL=${TOTAL:-470}        # the whole script's deadline: each limit below is cut to what is left of it
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
run cuda-tests 80 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py tests/test_state_swaps.py \
    tests/test_bench.py::test_device_cuda_puts_everything_on_the_gpu
# 2. Issue 17: the peers table of ResNet-50 b64 (the batch of shared/gpu-runs/2026-11-26), each row
#    on its own with its own limit: tensorplace's checkpoint-blocks plan against torch's checkpoint.
step peers-resnet50-b64 70 peers --model resnet50 --batch 64 --image 224 --classes 1000 --device "$DEVICE" \
    --repeats 5 --particles 100 --iterations 50 --time-limit 30
# 3. Issue 18: swap-all, recompute-all and PSO plans of ResNet-50 b128, predicted against measured
#    allocated peaks (rows in $OUT/gpu-plans.jsonl, the profile in $OUT/resnet50-b128.retain.plan.json);
#    then a reserved-budget plan run with the process capped at its budget (its own process).
run plans-resnet50 60 "$PYTHON" benches/gpu_plans.py --out "$OUT" "${R50[@]}" --fractions 0.5 0.3
run reserved-resnet50 60 "$PYTHON" benches/gpu_plans.py --out "$OUT" "${R50[@]}" --reserved 5519MiB
# 4. Issue 17: the executor's host work per moved unit on the GPU (the 193-unit tiny stack, the CUDA
#    backend), and the tiny models' peers, host-bound on a GPU as on one CPU thread.
run overhead-cuda 40 "$PYTHON" benches/executor_overhead.py --device "$DEVICE" --rounds 21 --breakdown 10 --json "$OUT/overhead-cuda.json"
step peers-tiny-gpt 45 peers --model gpt6s --batch 1 --seq 64 --device "$DEVICE" --repeats 9 --particles 100 --iterations 50 \
    --time-limit 20
# 5. The GPT's peers table.
step peers-gpt12 110 peers "${GPT[@]}" --time-limit 40 --repeats 2 --particles 100 --iterations 50
echo "== done after ${SECONDS}s: $fails command(s) failed or were skipped; results in $OUT"

if [ "${EXTRA:-0}" = 1 ]; then  # beyond the 10 minutes: planned against unplanned and predicted
    TOTAL=$((SECONDS + ${EXTRA_TOTAL:-300}))
    step profile-resnet50 45 profile "${R50[@]}" --repeats 3 -o "$OUT/resnet50-b128.profile.json"
    step peers-resnet50 100 peers "${R50[@]}" --profile "$OUT/resnet50-b128.profile.json" --time-limit 40
    step maxbatch-resnet50 80 maxbatch --model resnet50 --image 224 --classes 1000 --device "$DEVICE" --memory 16GiB \
        --probe-batches 32 64 --methods pso unplanned --tries 2 --repeats 1
    step demo-resnet50 100 demo "${R50[@]}" --fraction 0.5 --iterations 50 --particles 100
    step accuracy-resnet50 150 accuracy "${R50[@]}" --fractions 0.3 0.5 --iterations 50 --particles 100
    # issue 19: plans made for the compiled engine, on the GPU (its cost model takes about 80 s to measure)
    run compiled-gpt6 200 "$PYTHON" benches/compiled_model.py --model gpt6 --batch 8 --seq 256 --device "$DEVICE" \
        --repeats 5 --fractions 0.25,0.75 --json "$OUT/compiled-gpt6.jsonl"
    step timeline-resnet50 40 timeline --plan "$OUT/resnet50-b128.retain.plan.json" --png "$OUT/timeline-resnet50.png"
fi
exit $((fails > 0))
