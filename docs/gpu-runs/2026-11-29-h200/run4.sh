#!/usr/bin/env bash
# A later session's GPU run (same day, HEAD 29afc50): the whole CUDA test set of benches/gpu.sh,
# then the tiny ResNet-18's peers table, not re-run after run 3's fix of the profile's workspace
# (its searched rows measured 0.7 MiB over their budgets in run 2), and the tiny GPT's again.
#   OUT=DIR bash docs/gpu-runs/2026-11-29-h200/run4.sh   # DIR/run.log as it goes, DIR/results.tgz at the end
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
DEADLINE=${DEADLINE:-280}
R=/tmp/results
mkdir -p "$R"
L=$OUT/run.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$L" 2>&1
export PYTHONPATH=/tmp/site
echo "== installed at ${SECONDS}s" >> "$L"
step() {  # step NAME LIMIT CMD...: output in $R/NAME.log, its end in run.log
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5)); [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 20 ]; then echo "== $name skipped at ${SECONDS}s" >> "$L"; return; fi
  echo "== $name (limit ${limit}s, at ${SECONDS}s): $*" >> "$L"
  timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
  echo "== $name: exit $? at ${SECONDS}s" >> "$L"
  grep -v "Warning\|warn(\|^  warnings\|USDT" "$R/$name.log" | tail -n 30 >> "$L"
}
B="python3 -m tensorplace.bench"
step cuda-tests 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py tests/test_state_swaps.py \
  tests/test_bench.py::test_device_cuda_puts_everything_on_the_gpu
step peers-tiny-resnet18 50 $B peers --model resnet18 --batch 2 --image 32 --classes 10 --device cuda --repeats 9 \
  --particles 100 --iterations 50 --time-limit 20 --json "$R/peers-tiny-resnet18.json"
step peers-tiny-gpt 45 $B peers --model gpt6s --batch 1 --seq 64 --device cuda --repeats 9 --particles 100 \
  --iterations 50 --time-limit 20 --json "$R/peers-tiny-gpt.json"
tar czf "$OUT/results.tgz" -C "$R" . && echo "== packed at ${SECONDS}s" >> "$L"
