#!/usr/bin/env bash
# The same session's second GPU run, after run.sh found (1) a CUDA test that held its own reference
# to the source it checked the backend had dropped and (2) the peers table's measured peaks leaving
# out cuBLAS's workspaces that every plan's predicted peak counts (the searched rows of the tiny
# models were given budgets below any plan's bound). The two tests, then the peers tables again.
#   OUT=DIR bash docs/gpu-runs/2026-11-29-h200/run2.sh   # DIR/run.log as it goes, DIR/results.tgz at the end
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
DEADLINE=${DEADLINE:-250}
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
step cuda-tests 60 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py \
  -k "close_frees_everything or workspaces_a_plan_predicts"
step peers-tiny-gpt 45 $B peers --model gpt6s --batch 1 --seq 64 --device cuda --repeats 9 --particles 100 \
  --iterations 50 --time-limit 20 --json "$R/peers-tiny-gpt.json"
step peers-tiny-resnet18 45 $B peers --model resnet18 --batch 2 --image 32 --classes 10 --device cuda --repeats 9 \
  --particles 100 --iterations 50 --time-limit 20 --json "$R/peers-tiny-resnet18.json"
step peers-resnet50-b64 70 $B peers --model resnet50 --batch 64 --image 224 --classes 1000 --device cuda \
  --repeats 5 --particles 100 --iterations 50 --time-limit 30 --json "$R/peers-resnet50-b64.json"
tar czf "$OUT/results.tgz" -C "$R" . && echo "== packed at ${SECONDS}s" >> "$L"
