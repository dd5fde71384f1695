#!/usr/bin/env bash
# One GPU session (2026-11-29): benches/gpu.sh at this commit, then the tiny ResNet-18's peers on
# the GPU (issue 17's CPU tiny-kernel model). Run from the repository root, the wheels in .whl:
#   OUT=DIR bash docs/gpu-runs/2026-11-29-h200/run.sh   # DIR/run.log as it goes, DIR/results.tgz at the end
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
DEADLINE=${DEADLINE:-545}   # seconds for everything; gpu.sh gets TOTAL of them
R=/tmp/results
mkdir -p "$R"
L=$OUT/run.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$L" 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$L" 2>&1
python3 -c "import torch, tensorplace; print(torch.__version__, torch.cuda.get_device_name(), tensorplace.__file__)" >> "$L" 2>&1
echo "== installed at ${SECONDS}s" >> "$L"
OUT=$R TOTAL=${TOTAL:-470} bash benches/gpu.sh >> "$L" 2>&1
left=$((DEADLINE - SECONDS - 5))
[ $left -le 60 ] || left=60
if [ $left -ge 30 ]; then
  echo "== peers-tiny-resnet18 (limit ${left}s, at ${SECONDS}s)" >> "$L"
  timeout -k 5 $left python3 -m tensorplace.bench peers --model resnet18 --batch 2 --image 32 --classes 10 \
    --device cuda --repeats 9 --particles 100 --iterations 50 --time-limit 20 \
    --json "$R/peers-tiny-resnet18.json" > "$R/peers-tiny-resnet18.log" 2>&1
  echo "== peers-tiny-resnet18: exit $? at ${SECONDS}s" >> "$L"
  tail -n 25 "$R/peers-tiny-resnet18.log" >> "$L"
else
  echo "== peers-tiny-resnet18 skipped at ${SECONDS}s" >> "$L"
fi
tar czf "$OUT/results.tgz" -C "$R" . && echo "== packed at ${SECONDS}s: $(du -h "$OUT/results.tgz" | cut -f1)" >> "$L"
