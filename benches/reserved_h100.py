"""Predicted reserved peaks of the H100 plans against the recorded allocator traces
(../shared/gpu-profiles, ../shared/gpu-traces; docs/benchmarks.md, "Reserved memory on the H100").

    python benches/reserved_h100.py [--shared ../shared] [--json out.json]

Each recording is matched with a plan of the profile: unplanned -> all retain; checkpoint around
every block -> the checkpoint-blocks recipe; a tensorplace plan -> the plan in the profile file
(GPT) or a plan searched again at the recording's budget with the file's settings (ResNet-50,
whose file holds a plan for another budget). Predicted = the plan's allocation sequence simulated
under the recording's alloc_conf, with the profile's constant memory as the initial live bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, List

import tensorplace as tp

MiB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows: List[Dict[str, Any]] = []
    cases = [
        ("resnet50-b128-pso-cut0.8", "resnet50", ["unplanned", "checkpoint-per-block", "tensorplace-5519MiB"]),
        ("gpt-b16-pso-cut0.5", "gpt", ["unplanned", "checkpoint-per-block", "tensorplace-16827MiB"]),
    ]
    for fname, model, scenarios in cases:
        data = json.load(open(os.path.join(a.shared, "gpu-profiles", f"{fname}.plan.json")))
        prof = data["profile"]
        n = len(prof["units"])
        for scenario in scenarios:
            if scenario == "unplanned":
                actions, budget, starts, how = ["retain"] * n, 2**62, None, "retain"
            elif scenario == "checkpoint-per-block":
                p = tp.plan_profile(prof, 2**62, "checkpoint-blocks")
                actions, budget, starts, how = p.actions, 2**62, p.segment_starts, "checkpoint-blocks"
            elif data["budget_bytes"] // MiB == int(scenario.split("-")[1].removesuffix("MiB")):
                actions, budget, starts, how = data["actions"], data["budget_bytes"], data.get("segment_starts"), "plan in the profile file"
            else:
                mib = int(scenario.split("-")[1].removesuffix("MiB"))
                s = data["settings"]
                t = time.perf_counter()
                p = tp.plan_profile(prof, mib * MiB, "pso", particles=s["particles"], iterations=s["iterations"], seed=s["seed"])
                actions, budget, starts = p.actions, p.budget_bytes, p.segment_starts
                how = f"pso {s['particles']}x{s['iterations']} seed {s['seed']} at {mib} MiB ({time.perf_counter() - t:.1f} s)"
            for suffix in ("", "-expandable"):
                path = os.path.join(a.shared, "gpu-traces", f"alloc-{model}-{scenario}{suffix}.json")
                if not os.path.exists(path):
                    continue
                trace = json.load(open(path))
                conf = trace.get("alloc_conf", "")
                r = tp.evaluate(prof, actions, budget, segment_starts=starts, reserved=True, alloc_conf=conf)
                counts = {k: actions.count(k) for k in ("retain", "swap", "recompute")}
                row = {
                    "model": model, "scenario": scenario, "alloc_conf": conf, "plan": how, "counts": counts,
                    "recorded_counts": trace.get("plan_counts"),
                    "recorded_allocated_mib": trace["max_allocated"] / MiB,
                    "recorded_reserved_mib": trace["max_reserved"] / MiB,
                    "predicted_allocated_mib": r["peak_bytes"] / MiB,
                    "predicted_reserved_mib": r["reserved_bytes"] / MiB,
                    "recorded_at_start_mib": [trace["at_start"]["allocated"] / MiB, trace["at_start"]["reserved"] / MiB],
                    "constant_mib": sum(prof["memory"].values()) / MiB,
                }
                rows.append(row)
    print("| model | recording | alloc_conf | plan | allocated rec / pred MiB | reserved rec / pred MiB | reserved error | overhead rec / pred MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = 100 * (r["predicted_reserved_mib"] - r["recorded_reserved_mib"]) / r["recorded_reserved_mib"]
        orec = r["recorded_reserved_mib"] - r["recorded_allocated_mib"]
        opred = r["predicted_reserved_mib"] - r["predicted_allocated_mib"]
        print(f"| {r['model']} | {r['scenario']} | {r['alloc_conf'] or '(default)'} | {r['plan']} | "
              f"{r['recorded_allocated_mib']:.0f} / {r['predicted_allocated_mib']:.0f} | "
              f"{r['recorded_reserved_mib']:.0f} / {r['predicted_reserved_mib']:.0f} | {err:+.1f}% | {orec:.0f} / {opred:.0f} |")
    for r in rows:
        if r["recorded_counts"]:
            print(f"{r['model']} {r['scenario']} {r['alloc_conf']!r}: plan counts {r['counts']}, recorded run's {r['recorded_counts']}")
    # Reserved budgets on the same profiles: the recording's budget as a reserved budget.
    print()
    print("| model | reserved budget MiB | alloc_conf | allocated budget searched MiB | predicted allocated / reserved MiB | rounds | time (allocated-kind plan) |")
    print("|---|---|---|---|---|---|---|")
    for fname, model, mib in (("resnet50-b128-pso-cut0.8", "resnet50", 5519), ("gpt-b16-pso-cut0.5", "gpt", 16827)):
        data = json.load(open(os.path.join(a.shared, "gpu-profiles", f"{fname}.plan.json")))
        s = data["settings"]
        kw = dict(particles=s["particles"], iterations=s["iterations"], seed=s["seed"])
        t = time.perf_counter()
        tp.plan_profile(data["profile"], mib * MiB, **kw)
        t_alloc = time.perf_counter() - t
        for conf in ("", "expandable_segments:True"):
            t = time.perf_counter()
            try:
                p = tp.plan_profile(data["profile"], mib * MiB, budget_kind="reserved", alloc_conf=conf, **kw)
            except tp.BudgetError as e:
                print(f"| {model} | {mib} | {conf or '(default)'} | refused: smallest reserved budget found {e.args[1] / MiB:.0f} MiB | | | |")
                continue
            t_res = time.perf_counter() - t
            pr = p.predicted
            rows.append({"model": model, "reserved_budget_mib": mib, "alloc_conf": conf,
                         "allocated_budget_mib": p.budget_bytes / MiB, "predicted_allocated_mib": pr["peak_bytes"] / MiB,
                         "predicted_reserved_mib": pr["reserved_bytes"] / MiB, "predicted_step_time": pr["step_time"],
                         "rounds": p.settings["reserved_search"]["rounds"], "seconds": t_res, "seconds_allocated": t_alloc})
            print(f"| {model} | {mib} | {conf or '(default)'} | {p.budget_bytes / MiB:.0f} | {pr['peak_bytes'] / MiB:.0f} / "
                  f"{pr['reserved_bytes'] / MiB:.0f} | {len(p.settings['reserved_search']['rounds'])} | "
                  f"{t_res:.1f} s ({t_alloc:.1f} s) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
