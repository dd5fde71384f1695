"""The search against the checkpointing recipes on the H100 profiles in ../shared/gpu-profiles
(cost model only, no GPU needed): each recipe's predicted peak and step, and the search's plan at
that peak. Usage: python benches/recipes_on_gpu_profiles.py [PARTICLES ITERATIONS]"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import tensorplace as tp

MiB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    particles, iterations = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (100, 50)
    paths = sorted(glob.glob(os.path.join(HERE, "..", "..", "shared", "gpu-profiles", "*.plan.json")))
    if not paths:
        raise SystemExit("no profiles in ../shared/gpu-profiles (the steering repo's shared/ folder beside the checkout)")
    for path in paths:
        with open(path) as f:
            profile = json.load(f)["profile"]
        retain = tp.evaluate(profile, ["retain"] * len(profile["units"]), 2**50)
        print(f"{os.path.basename(path)}: all-retain {retain['peak_bytes'] / MiB:.0f} MiB, {retain['step_time'] * 1e3:.1f} ms")
        print("| recipe | recipe peak | recipe step | search peak | search step | search actions | search time |")
        print("|---|---|---|---|---|---|---|")
        for recipe in ("checkpoint-blocks", "swap-all", "sqrt"):
            base = tp.plan_profile(profile, 2**50, recipe)
            budget = base.predicted["peak_bytes"]
            t0 = time.perf_counter()
            found = tp.plan_profile(profile, budget, "pso", particles=particles, iterations=iterations)
            elapsed = time.perf_counter() - t0
            c = found.counts()
            print(f"| {recipe} | {budget / MiB:.0f} MiB | {base.predicted['step_time'] * 1e3:.1f} ms | "
                  f"{found.predicted['peak_bytes'] / MiB:.0f} MiB | {found.predicted['step_time'] * 1e3:.1f} ms | "
                  f"{c['retain']}/{c['swap']}/{c['recompute']} | {elapsed:.1f} s |")


if __name__ == "__main__":
    main()
