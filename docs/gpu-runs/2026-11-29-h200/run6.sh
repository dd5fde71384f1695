#!/usr/bin/env bash
# Not run yet (no GPU host was lent after run 5). After run5 found the search of 29afc50 2x
# slower than ec2d814's at 16 threads: the planner's thread scaling with the polish's free swaps
# and tidying scored one per thread at once (5199c17), the polish's starts and the restarts run
# at once (48bae61), and a relinking step's first two changes evaluated first (ba183ff; 5199c17
# had one per thread).
# Carried in .whl/planner: `plan_file_new`, `plan_file_29afc50` and `plan_file_ec2d814`, release
# builds of rust_core/examples/plan_file.rs (`cargo build --release --example plan_file`, at
# 48bae61 or later, at 29afc50 and at ec2d814), with mobilenet_v2.json, resnet50.json and
# inception_v3.json written by `tensorplace.examples.profile(name, batch_size=32)` and
# ../shared/gpu-profiles/gpt-b16-pso-cut0.5.plan.json.
#   OUT=DIR bash docs/gpu-runs/2026-11-29-h200/run6.sh
set -u
SECONDS=0
L=$OUT/run.log
P=.whl/planner
mkdir -p /tmp/r
nproc >> "$L"
one() {  # one BUILD THREADS
  local b=$1 t=$2
  [ "$SECONDS" -gt 200 ] && { echo "== $b threads $t skipped at ${SECONDS}s" >> "$L"; return; }
  echo "== $b threads $t at ${SECONDS}s" >> "$L"
  timeout -k 5 60 "$P/plan_file_$b" --threads "$t" --fractions 0.75 "$P/mobilenet_v2.json" >> "/tmp/r/$b-t$t.jsonl" 2>> "$L"
  timeout -k 5 60 "$P/plan_file_$b" --threads "$t" --fractions 0.5 "$P/gpt-b16-pso-cut0.5.plan.json" >> "/tmp/r/$b-t$t.jsonl" 2>> "$L"
  timeout -k 5 60 "$P/plan_file_$b" --threads "$t" --fractions 0.25 "$P/resnet50.json" >> "/tmp/r/$b-t$t.jsonl" 2>> "$L"
}
one new 16; one ec2d814 16; one 29afc50 16; one new 8; one new 4; one new 2
[ "$SECONDS" -lt 150 ] && timeout -k 5 60 "$P/plan_file_new" --threads 16 --fractions 0.5 "$P/inception_v3.json" >> /tmp/r/new-t16.jsonl 2>> "$L"
[ "$SECONDS" -lt 180 ] && timeout -k 5 60 "$P/plan_file_ec2d814" --threads 16 --fractions 0.5 "$P/inception_v3.json" >> /tmp/r/ec2d814-t16.jsonl 2>> "$L"
echo "== done at ${SECONDS}s" >> "$L"
for f in /tmp/r/*.jsonl; do sed "s/^{/{\"run\":\"$(basename $f .jsonl)\",/" "$f"; done > "$OUT/all.jsonl"
