#!/usr/bin/env bash
# one GPU session (2026-11-27, second): every step under its own timeout, results in $OUT as they come.
#   run from the repository root with the wheels in .whl:  OUT=DIR bash docs/gpu-runs/2026-11-27b-h200/run.sh
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
TOTAL=${TOTAL:-520}
L=$OUT/all.log
python3 -m pip install -q --no-index --no-deps --no-compile --target "$PWD/.site" .whl/*.whl >> $L 2>&1
export PYTHONPATH="$PWD/.site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $L 2>&1
python3 -c "import torch, tensorplace; print(torch.__version__, torch.cuda.get_device_name(), tensorplace.__file__)" >> $L 2>&1
step() {  # step NAME LIMIT CMD...: output in $OUT/NAME.log, a summary in all.log
  local name=$1 limit=$2; shift 2
  local left=$((TOTAL - SECONDS - 5)); [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 25 ]; then echo "== $name skipped at ${SECONDS}s" >> $L; return; fi
  echo "== $name (limit $limit, at ${SECONDS}s): $*" >> $L
  timeout -k 5 "$limit" "$@" > $OUT/$name.log 2>&1; local rc=$?
  grep -v "Warning\|warn(\|^  warnings\|USDT" $OUT/$name.log | tail -n 40 >> $L
  echo "== $name: exit $rc after ${SECONDS}s" >> $L
}
B="python3 -m tensorplace.bench"
# issue 17/18: the CUDA backend (in-place and never-started swaps are new since the last GPU run)
step cuda-tests 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py tests/test_state_swaps.py
# issue 17: executor cost per moved unit on the GPU (the 193-unit tiny stack, CudaBackend)
step overhead 60 python3 benches/executor_overhead.py --device cuda --rounds 21 --json $OUT/overhead.json
# issue 17: peers of ResNet-50 b64 (checkpoint-blocks against torch's checkpoint per block)
step peers-r50 100 $B peers --model resnet50 --batch 64 --image 224 --classes 1000 --device cuda \
  --repeats 5 --particles 100 --iterations 50 --time-limit 30 --json $OUT/peers-r50.json
# issue 18: swap-all, recompute-all and PSO plans of ResNet-50 b128, predicted against measured peaks
mkdir -p $OUT/plans
step plans-r50 90 python3 benches/gpu_plans.py --out $OUT/plans --model resnet50 --batch 128 --image 224 \
  --classes 1000 --device cuda --fractions 0.5 0.3
# issue 19: plans made for the compiled engine (plan_compiled) on the GPU, GPT6 b8 s256
step compiled-gpt6 150 python3 benches/compiled_model.py --model gpt6 --batch 8 --seq 256 --device cuda \
  --repeats 5 --json $OUT/compiled-gpt6.jsonl
# issue 18: a reserved-budget plan under the process's memory fraction (its own process)
export CUBLAS_WORKSPACE_CONFIG=:4096:8
step reserved-r50 70 python3 benches/gpu_plans.py --out $OUT/plans --model resnet50 --batch 128 --image 224 \
  --classes 1000 --device cuda --reserved 5519MiB
echo "== all done at ${SECONDS}s" >> $L
