"""benches/gpu.sh, checked here without a GPU: every bench command line it runs parses, every
command runs under its own `timeout`, and the limits add up to its deadline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A stand-in for python3: parses the bench's arguments (and checks the test files named) instead
# of running anything, and records each command line.
FAKE = f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
with open(os.environ["CALLS"], "a") as f:
    f.write(" ".join(args) + "\\n")
if args[:2] == ["-m", "tensorplace.bench"]:
    from tensorplace.bench import parser
    parser().parse_args(args[2:])
elif args[:1] in (["benches/gpu_plans.py"], ["benches/executor_overhead.py"]):
    import runpy
    runpy.run_path(args[0], run_name="checked")["arguments"]().parse_args(args[1:])
elif args[:2] == ["-m", "pytest"]:
    missing = [a.split("::")[0] for a in args[2:] if a.startswith("tests/") and not os.path.exists(a.split("::")[0])]
    sys.exit(f"missing test files {{missing}}" if missing else 0)
else:
    sys.exit(f"unexpected command {{args}}")
"""


def test_gpu_script_runs_every_command_under_a_limit_within_ten_minutes(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "out"), CALLS=str(calls))
    r = subprocess.run(["bash", "benches/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = calls.read_text().splitlines()
    bench = [line.split()[2] for line in lines if line.startswith("-m tensorplace.bench")]
    assert bench == ["peers", "peers", "peers"], bench
    assert sum(line.startswith("-m pytest") for line in lines) == 1
    plans = [line for line in lines if line.startswith("benches/gpu_plans.py")]
    assert len(plans) == 2 and sum("--reserved" in line for line in plans) == 1, plans
    # the models of the issues, all on the GPU
    assert any("peers --model resnet50 --batch 64 --image 224 --classes 1000 --device cuda" in line for line in lines)
    assert any("peers --model gpt12 --batch 16 --seq 1024 --device cuda" in line for line in lines)
    assert any("peers --model gpt6s --batch 1 --seq 64 --device cuda" in line for line in lines)  # host-bound
    assert any(line.startswith("benches/executor_overhead.py") and "--device cuda" in line for line in lines)
    assert all("--model resnet50 --batch 128 --image 224 --classes 1000 --device cuda" in line for line in plans)
    measuring = [line for line in lines if re.search(r"tensorplace\.bench (profile|peers|maxbatch)", line)]
    assert all("--device cuda" in line for line in measuring + plans), measuring
    assert all("--time-limit" in line for line in lines if " peers " in line)
    # each under its own limit; the limits within the script's deadline of 470 s
    limits = [int(m) for m in re.findall(r"\(limit (\d+)s", r.stdout)]
    assert len(limits) == len(lines) and sum(limits) <= 470, (limits, r.stdout)
    script = (ROOT / "benches" / "gpu.sh").read_text()
    assert 'timeout -k 10 "$limit"' in script


def test_gpu_script_cuts_its_limits_to_its_deadline(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    for total, skipped in (("60", False), ("20", True)):
        env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "out"), CALLS=str(tmp_path / "calls.txt"),
                   TOTAL=total)
        r = subprocess.run(["bash", "benches/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        limits = [int(m) for m in re.findall(r"\(limit (\d+)s", r.stdout)]
        assert all(x <= int(total) - 5 for x in limits), (total, limits)
        assert limits or skipped
        if skipped:  # a command the deadline leaves under 20 s for is skipped, and counts as not done
            assert r.returncode == 1 and r.stdout.count(": skipped, ") == 7 and not limits, r.stdout


def test_gpu_plans_script_runs_on_the_cpu(tmp_path):
    """benches/gpu_plans.py's rows on a CPU (no CUDA counters): every plan trains bitwise equal
    and within its predicted peak, one JSON line per row."""
    cmd = [sys.executable, "benches/gpu_plans.py", "--out", str(tmp_path), "--device", "cpu", "--model", "resnet18",
           "--batch", "8", "--image", "32", "--classes", "10", "--repeats", "1", "--particles", "10",
           "--iterations", "5", "--fractions", "0.3", "--methods", "swap-all", "recompute-all", "pso"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    rows = {row["row"]: row for row in map(json.loads, (tmp_path / "gpu-plans.jsonl").read_text().splitlines())}
    assert set(rows) == {"unplanned", "profile", "swap-all", "recompute-all", "pso@0.3"}, rows
    for name in ("swap-all", "recompute-all"):
        row = rows[name]
        assert "error" not in row, row
        assert row["bitwise"] is True and row["peak_bytes"] <= row["predicted_peak_bytes"], row
        assert row["counts"][name.split("-")[0]] == sum(row["counts"].values()), row
    assert (tmp_path / "resnet18-b8.retain.plan.json").exists()
