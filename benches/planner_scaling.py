"""Search time against unit count (issue 21): PSO on the TinyGPT profiles of
rust_core/tests/data (benches/tinygpt_profiles.py makes them) at 30% of the way from the lower
bound to the unplanned peak, with the default settings, with 100 particles x 50 iterations, and
the default search without its block-wise levels (`unitwise`).

Prints one JSON line per (profile, settings, repeat): units, seconds, evaluations, the predicted
step time, and the fitted growth exponent of the medians at the end.

Usage: nice python benches/planner_scaling.py [--units 255 505 1005] [--repeats 3]
       [--settings default small] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import tensorplace as tp

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "rust_core", "tests", "data")
# default: the defaults (block-wise above 400 units); unitwise: the same search over single units
# (500 x 500, no block-wise levels: the search before block-wise, evaluated incrementally)
SETTINGS = {"default": {}, "small": {"particles": 100, "iterations": 50}, "unitwise": {"block_wise": False}}


def load(units: int) -> dict:
    with open(os.path.join(DATA, f"tinygpt-{units}.json")) as f:
        return json.load(f)


def budget_at(profile: dict, fraction: float) -> int:
    lb, peak = tp.lower_bound(profile), tp.unplanned_peak(profile)
    return int(lb + fraction * (peak - lb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, nargs="+", default=[65, 125, 255, 505, 1005, 2005])
    ap.add_argument("--settings", nargs="+", default=["default", "small"], choices=sorted(SETTINGS))
    ap.add_argument("--fraction", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None, help="append the JSON lines to this file")
    args = ap.parse_args()
    medians: dict = {}
    out = open(args.json, "a") if args.json else None
    for units in args.units:
        profile = load(units)
        budget = budget_at(profile, args.fraction)
        for name in args.settings:
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                plan = tp.plan_profile(profile, budget, "pso", **SETTINGS[name])
                elapsed = time.perf_counter() - t0
                times.append(elapsed)
                row = {"units": units, "settings": name, "repeat": r, "budget": budget, "seconds": round(elapsed, 3),
                       "evaluations": plan.to_dict()["convergence"]["evaluations"],
                       "step_time": plan.predicted["step_time"], "peak_bytes": plan.predicted["peak_bytes"],
                       "counts": plan.counts()}
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
            medians.setdefault(name, []).append((units, statistics.median(times)))
    for name, pts in medians.items():
        if len(pts) >= 2:
            xs = [math.log(u) for u, _ in pts]
            ys = [math.log(t) for _, t in pts]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            print(f"{name}: time ~ units^{k:.2f} over {[u for u, _ in pts]}")


if __name__ == "__main__":
    main()
