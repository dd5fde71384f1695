#!/usr/bin/env bash
# The session's third GPU run, after peak_gap.py found the profile's constant memory 1 MiB short
# (cuBLASLt's workspace of the backward's thread, allocated by the profile's replay step after its
# memory step started): the GPU tests of the accounting, then the tiny GPT's peers table again.
#   OUT=DIR bash docs/gpu-runs/2026-11-29-h200/run3.sh
set -u
export PYTHONUNBUFFERED=1
SECONDS=0
R=/tmp/results
mkdir -p "$R"
L=$OUT/run.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$L" 2>&1
export PYTHONPATH=/tmp/site
echo "== installed at ${SECONDS}s" >> "$L"
timeout -k 5 50 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py \
  -k "workspaces or close_frees_everything" > "$R/cuda-tests.log" 2>&1
echo "== cuda-tests: exit $? at ${SECONDS}s" >> "$L"; tail -n 15 "$R/cuda-tests.log" >> "$L"
timeout -k 5 45 python3 -m tensorplace.bench peers --model gpt6s --batch 1 --seq 64 --device cuda --repeats 9 \
  --particles 100 --iterations 50 --time-limit 20 --json "$R/peers-tiny-gpt.json" > "$R/peers-tiny-gpt.log" 2>&1
echo "== peers-tiny-gpt: exit $? at ${SECONDS}s" >> "$L"
tar czf "$OUT/results.tgz" -C "$R" . && echo "== packed at ${SECONDS}s" >> "$L"
