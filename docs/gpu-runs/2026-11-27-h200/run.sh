#!/usr/bin/env bash
# one GPU session (2026-11-27): every step under its own timeout, results in $OUT as they come
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
TOTAL=${TOTAL:-520}
L=$OUT/all.log
python3 -m pip install -q --no-index --no-deps --no-compile --target "$PWD/.site" .whl/*.whl >> $L 2>&1
export PYTHONPATH="$PWD/.site"
nvidia-smi --query-gpu=name,memory.total --format=csv >> $L 2>&1
python3 -c "import torch, tensorplace; print(torch.__version__, tensorplace.__file__)" >> $L 2>&1
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local left=$((TOTAL - SECONDS - 5)); [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 25 ]; then echo "== $name skipped at ${SECONDS}s" >> $L; return; fi
  echo "== $name (limit $limit, at ${SECONDS}s): $*" >> $L
  timeout -k 5 "$limit" "$@" > /tmp/$name.log 2>&1; local rc=$?
  grep -v "Warning\|warn(\|^  \|USDT" /tmp/$name.log | tail -n 40 >> $L
  echo "== $name: exit $rc after ${SECONDS}s" >> $L
}
step cuda-tests 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py
cp /tmp/cuda-tests.log $OUT/ 2>/dev/null
step compiled-gpt6 170 python3 benches/compiled_engine.py --model gpt6 --batch 8 --seq 256 --device cuda --repeats 5 \
  --methods --at-checkpoint --json $OUT/compiled.jsonl
export CUBLAS_WORKSPACE_CONFIG=:4096:8
mkdir -p /tmp/gp
step gpt12-recompute 150 python3 benches/gpu_plans.py --out /tmp/gp --model gpt12 --batch 16 --seq 1024 --repeats 2 \
  --fractions 0.5 --methods recompute-all
cp /tmp/gp/gpu-plans.jsonl $OUT/gpu-plans.jsonl 2>/dev/null
step compiled-gpt12 200 python3 benches/compiled_engine.py --model gpt12 --batch 16 --seq 1024 --device cuda --repeats 3 \
  --methods --at-checkpoint --json $OUT/compiled.jsonl
echo "== all done at ${SECONDS}s" >> $L
