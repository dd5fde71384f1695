"""Reserved budgets on the H100 profiles (../shared/gpu-profiles): the plan of
``plan_profile(..., budget_kind="reserved")`` against the fastest plan that planning at a sweep of
allocated budgets finds inside the same reserved budget (docs/benchmarks.md, "Reserved budgets").

    python benches/reserved_search.py [--shared ../shared] [--sweep 16] [--reserved 6]
        [--at resnet50:3776] [--particles 32 --iterations 32 --restarts 0 --relinks 0]
        [--json out.json] [--sweep-json sweep.json]

For each profile (its plan file embeds it): `--sweep` allocated budgets evenly from the lower
bound to the unplanned peak, each planned with PSO (seed 0) and its reserved peak simulated
under the profile's allocator settings; then `--reserved` reserved budgets evenly between the
lower bound and the unplanned peak (ends excluded), each planned with
``budget_kind="reserved"`` and the same search settings. "Sweep best" is the fastest sweep plan
whose reserved peak fits the reserved budget. "Tightening loop" is the search this one replaced
(at most 4 searches, each on the allocated budget less the last plan's reserved overshoot, then
the plan that needs the least allocated memory if it fits), emulated here with the same search
settings. `--at MODEL:MIB` adds a reserved budget. All times are the cost model's predictions.
`--sweep-json` reuses (or, when absent, writes) the sweep, which does not depend on the
reserved-budget search.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, List, Optional

import tensorplace as tp

MiB = 2**20
PROFILES = [("resnet50", "resnet50-b128-pso-cut0.8"), ("gpt", "gpt-b16-pso-cut0.5")]


def sweep(prof: Dict[str, Any], k: int, kw: Dict[str, Any]) -> List[Dict[str, Any]]:
    lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
    rows = []
    for i in range(k):
        a = lb + (up - lb) * i // (k - 1)
        t = time.perf_counter()
        try:
            p = tp.plan_profile(prof, a, **kw)
        except tp.BudgetError:
            rows.append({"allocated_budget": a, "step_time": None, "reserved_bytes": None})
            continue
        rows.append({"allocated_budget": a, "step_time": p.predicted["step_time"], "peak_bytes": p.predicted["peak_bytes"],
                     "reserved_bytes": p.predicted["reserved_bytes"], "seconds": time.perf_counter() - t})
        print(f"  sweep {a / MiB:.0f} MiB: {p.predicted['step_time'] * 1e3:.1f} ms, reserved "
              f"{p.predicted['reserved_bytes'] / MiB:.0f} MiB", flush=True)
    return rows


def tightening_loop(prof: Dict[str, Any], budget: int, kw: Dict[str, Any], rounds: int = 4) -> Optional[Dict[str, Any]]:
    """The reserved-budget search before this one (rust_core/src/reserved.rs until d2ee04f)."""
    a, last = budget, None
    for k in range(rounds):
        try:
            p = tp.plan_profile(prof, a, **kw)
        except tp.BudgetError:
            break
        r = p.predicted["reserved_bytes"]
        if r <= budget:
            return {"step_time": p.predicted["step_time"], "method": "pso", "allocated_budget": a, "searches": k + 1}
        if last == p.actions and k > 0:
            break
        last = p.actions
        a -= max(r - budget, 1)
        if a <= 0:
            break
    smallest, actions = tp._core.smallest_known_budget(json.dumps(prof))
    r = tp.evaluate(prof, actions, smallest, reserved=True)
    if r["reserved_bytes"] <= budget:
        name = "swap-all" if all(x == "swap" for x in actions) else "recompute-all"
        return {"step_time": r["step_time"], "method": name, "allocated_budget": smallest, "searches": None}
    return None


def best_fit(rows: List[Dict[str, Any]], budget: int) -> Optional[Dict[str, Any]]:
    fits = [r for r in rows if r["reserved_bytes"] is not None and r["reserved_bytes"] <= budget]
    return min(fits, key=lambda r: r["step_time"]) if fits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
    ap.add_argument("--sweep", type=int, default=16)
    ap.add_argument("--reserved", type=int, default=6)
    ap.add_argument("--particles", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=32)
    ap.add_argument("--restarts", type=int, default=0)
    ap.add_argument("--relinks", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep-json", default=None)
    ap.add_argument("--at", action="append", default=[], help="MODEL:MIB, an extra reserved budget")
    a = ap.parse_args()
    kw = dict(particles=a.particles, iterations=a.iterations, restarts=a.restarts, relinks=a.relinks, seed=0)
    cached = json.load(open(a.sweep_json)) if a.sweep_json and os.path.exists(a.sweep_json) else {}
    sweeps: Dict[str, Any] = {}
    rows: List[Dict[str, Any]] = []
    for model, fname in PROFILES:
        prof = json.load(open(os.path.join(a.shared, "gpu-profiles", f"{fname}.plan.json")))["profile"]
        lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
        key = f"{model} {a.sweep} {json.dumps(kw, sort_keys=True)}"
        if key not in cached:
            print(f"{model}: sweep of {a.sweep} allocated budgets", flush=True)
            cached[key] = sweep(prof, a.sweep, kw)
        sweeps[model] = cached[key]
        budgets = [lb + (up - lb) * j // (a.reserved + 1) for j in range(1, a.reserved + 1)]
        budgets += [int(x.split(":")[1]) * MiB for x in a.at if x.split(":")[0] == model]
        for budget in sorted(budgets):
            t = time.perf_counter()
            row: Dict[str, Any] = {"model": model, "reserved_budget": budget, "lower_bound": lb, "unplanned_peak": up}
            try:
                p = tp.plan_profile(prof, budget, budget_kind="reserved", **kw)
                search = p.settings["reserved_search"]
                row.update(step_time=p.predicted["step_time"], allocated_budget=p.budget_bytes, method=p.method,
                           reserved_bytes=p.predicted["reserved_bytes"], peak_bytes=p.predicted["peak_bytes"],
                           searches=sum(r["method"] == "pso" for r in search["rounds"]), fallback=search["fallback"],
                           expandable=search.get("expandable_segments"))
            except tp.BudgetError as e:
                row.update(step_time=None, refused=str(e), smallest=e.args[1])
            row["seconds"] = time.perf_counter() - t
            row["tightening_loop"] = tightening_loop(prof, budget, kw)
            ref = best_fit(sweeps[model], budget)
            row["sweep_best"] = ref
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "expandable"}), flush=True)
    if a.sweep_json:
        with open(a.sweep_json, "w") as f:
            json.dump(cached, f, indent=1)
    print()
    print("| model | reserved budget MiB | sweep best: ms (allocated budget MiB) | tightening loop: ms | reserved search: ms (allocated budget / peak / reserved MiB) | searches | vs sweep best |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref = r["sweep_best"]
        ref_txt = f"{ref['step_time'] * 1e3:.1f} ({ref['allocated_budget'] / MiB:.0f})" if ref else "none fits"
        if r["step_time"] is None:
            got = f"refused: smallest reserved budget found {r['smallest'] / MiB:.0f} MiB"
            vs = "" if ref is None else "MISSED"
            n = ""
        else:
            got = (f"{r['step_time'] * 1e3:.1f} ({r['allocated_budget'] / MiB:.0f} / {r['peak_bytes'] / MiB:.0f} / "
                   f"{r['reserved_bytes'] / MiB:.0f})" + (f", fallback {r['method']}" if r["fallback"] else ""))
            vs = f"{100 * (r['step_time'] / ref['step_time'] - 1):+.1f}%" if ref else "(sweep: none fits)"
            n = str(r["searches"])
        old = r["tightening_loop"]
        old_txt = "refused" if old is None else f"{old['step_time'] * 1e3:.1f}" + (f" ({old['method']})" if old["method"] != "pso" else "")
        print(f"| {r['model']} | {r['reserved_budget'] / MiB:.0f} | {ref_txt} | {old_txt} | {got} | {n} | {vs} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": kw, "sweeps": sweeps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
