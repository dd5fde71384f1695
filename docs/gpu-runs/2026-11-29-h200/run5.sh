#!/usr/bin/env bash
# The planner's thread scaling on the GPU host's 16 CPU cores (no GPU work): the default PSO
# search (rust_core/examples/plan_file, release builds of 29afc50 ("head") and ec2d814, carried in
# .whl/planner with mobilenet_v2.json and resnet50.json written by
# `tensorplace.examples.profile(name, batch_size=32)` and ../shared/gpu-profiles/gpt-b16-pso-cut0.5.plan.json)
# at 1 to 16 threads. Raw rows: run5/all.jsonl (97.6 s).
#   OUT=DIR bash docs/gpu-runs/2026-11-29-h200/run5.sh
set -u
SECONDS=0
L=$OUT/run.log
P=.whl/planner
mkdir -p /tmp/r
nproc >> "$L"; lscpu | grep -i "model name" >> "$L"
for t in 1 2 4 8 16; do
  for b in head ec2d814; do
    [ "$b" = ec2d814 ] && [ "$t" != 1 ] && [ "$t" != 16 ] && continue
    [ "$SECONDS" -gt 230 ] && { echo "== $b threads $t skipped at ${SECONDS}s" >> "$L"; continue; }
    echo "== $b threads $t at ${SECONDS}s" >> "$L"
    timeout -k 5 60 "$P/plan_file_$b" --threads "$t" --fractions 0.75 "$P/mobilenet_v2.json" >> "/tmp/r/$b-t$t.jsonl" 2>> "$L"
    timeout -k 5 60 "$P/plan_file_$b" --threads "$t" --fractions 0.5 "$P/gpt-b16-pso-cut0.5.plan.json" >> "/tmp/r/$b-t$t.jsonl" 2>> "$L"
    timeout -k 5 90 "$P/plan_file_$b" --threads "$t" --fractions 0.25 "$P/resnet50.json" >> "/tmp/r/$b-t$t.jsonl" 2>> "$L"
  done
done
echo "== done at ${SECONDS}s" >> "$L"
for f in /tmp/r/*.jsonl; do sed "s/^{/{\"run\":\"$(basename $f .jsonl)\",/" "$f"; done > "$OUT/all.jsonl"
