"""`tensorplace-bench methods`: every planning method on the builtin profiles (and plan or profile
files, such as the H100 profiles) at several budgets: predicted step time, peak, planning time,
PSO's evaluations and the MILP's optimality gap. The tables of docs/methods.md come from it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import examples
from .._core import BudgetError, PlannerError
from ..budget import format_bytes
from ..planning import lower_bound, plan_profile, unplanned_peak

DEFAULT_METHODS = ["pso", "milp"]


def _profiles(models: Sequence[str], files: Sequence[str], batch: int) -> Iterable[Tuple[str, Dict[str, Any]]]:
    for name in models:
        yield name, examples.profile(name, batch_size=batch)
    for path in files:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
        prof = data["profile"] if data.get("format") == "tensorplace.plan" else data
        if not isinstance(prof, dict) or prof.get("format") != "tensorplace.profile":
            raise SystemExit(f"{path}: not a profile, nor a plan that carries its profile")
        yield os.path.basename(path).split(".")[0], prof


def run_methods(
    models: Sequence[str],
    files: Sequence[str],
    fractions: Sequence[float],
    methods: Sequence[str],
    batch: int = 32,
    time_limit: float = 30.0,
    particles: int = 500,
    iterations: int = 500,
    done: Optional[Dict[Tuple[str, float, str], Dict[str, Any]]] = None,
    out: Optional[str] = None,
) -> List[Dict[str, Any]]:
    """One record per (profile, budget fraction, method). Budgets are lower bound +
    fraction x (unplanned peak - lower bound). Records already in `done` are kept, not re-run;
    each new record is appended to `out` (JSON lines) as it is measured."""
    records = []
    for name, prof in _profiles(models, files, batch):
        lb, up = lower_bound(prof), unplanned_peak(prof)
        for frac in fractions:
            budget = int(lb + frac * (up - lb))
            for method in methods:
                key = (name, float(frac), method)
                if done is not None and key in done:
                    records.append(done[key])
                    continue
                rec: Dict[str, Any] = {"profile": name, "units": len(prof["units"]), "fraction": frac, "budget": budget, "method": method}
                t = time.perf_counter()
                try:
                    if method == "pso+milp":  # PSO whose swarm also starts at the MILP's plan
                        m = plan_profile(prof, budget, "milp", time_limit=time_limit)
                        p = plan_profile(prof, budget, "pso", particles=particles, iterations=iterations, seed_plans=[m.actions])
                    else:
                        p = plan_profile(prof, budget, method, particles=particles, iterations=iterations, time_limit=time_limit)
                    rec["planning_time"] = time.perf_counter() - t
                    rec["step_time"] = p.predicted["step_time"]
                    rec["compute_time"] = p.predicted["compute_time"]
                    rec["peak_bytes"] = p.predicted["peak_bytes"]
                    rec["counts"] = p.counts()
                    conv = p.convergence
                    rec["evaluations"] = conv.get("evaluations") if conv else None
                    s = p.settings
                    rec["gap"] = s.get("gap")
                    rec["fallback"] = s.get("fallback")
                    rec["status"] = s.get("status")
                    if "accumulation_steps" in s:  # modnn: the sub-batch, times per full step
                        rec["sub_batch"] = [s["sub_batch"], s["accumulation_steps"]]
                except BudgetError as e:
                    rec["planning_time"] = time.perf_counter() - t
                    rec["error"] = str(e.args[0])
                except PlannerError as e:  # the method does not apply (checkpoint-blocks without repeated blocks)
                    rec["planning_time"] = time.perf_counter() - t
                    rec["error"] = str(e)
                    rec["not_applicable"] = True
                records.append(rec)
                if out:
                    with open(out, "a", encoding="utf-8") as f:
                        f.write(json.dumps(rec) + "\n")
    return records


def markdown(records: Sequence[Dict[str, Any]], baseline: str = "milp") -> str:
    """A table: one row per (profile, budget), one column group per method."""
    methods: List[str] = []
    for r in records:
        if r["method"] not in methods:
            methods.append(r["method"])
    rows: Dict[Tuple[str, float], Dict[str, Dict[str, Any]]] = {}
    for r in records:
        rows.setdefault((r["profile"], r["fraction"]), {})[r["method"]] = r
    head = "| profile (units) | budget | " + " | ".join(methods) + " |"
    lines = [head, "|" + "---|" * (2 + len(methods))]
    for (name, frac), by in rows.items():
        any_r = next(iter(by.values()))
        cells = [f"{name} ({any_r['units']})", f"{format_bytes(any_r['budget'])} ({frac:.2f})"]
        base = by.get(baseline, {}).get("step_time")
        for m in methods:
            r = by.get(m)
            if r is None:
                cells.append("")
            elif r.get("not_applicable"):
                cells.append("n/a")
            elif "error" in r:
                cells.append(f"no plan ({r['planning_time']:.1f} s)")
            else:
                cell = f"{r['step_time'] * 1e3:.2f} ms, {format_bytes(r['peak_bytes'])}, {r['planning_time']:.1f} s"
                if base and m != baseline:
                    cell += f", {100 * (r['step_time'] / base - 1):+.2f}%"
                if r.get("evaluations"):
                    cell += f", {r['evaluations']:,} evals"
                if r.get("gap") is not None and m.startswith("milp"):
                    cell += f", gap {100 * r['gap']:.2f}%"
                if r.get("sub_batch"):
                    cell += f", sub-batch {r['sub_batch'][0]} x {r['sub_batch'][1]}"
                if r.get("fallback"):
                    cell += f", fallback: {r['fallback']}"
                cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_methods(a: argparse.Namespace) -> int:
    """Every method on builtin profiles (and --files) at several budgets, as a markdown table."""
    done: Dict[Tuple[str, float, str], Dict[str, Any]] = {}
    if a.resume and a.json and os.path.exists(a.json):
        with open(a.json, "r", encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                done[(r["profile"], float(r["fraction"]), r["method"])] = r
    from ..bench.common import progress

    runs = (len(a.models) + len(a.files)) * len(a.fractions) * len(a.methods)
    with progress(f"planning: {runs} (profile, budget, method) runs"):
        recs = run_methods(
            a.models, a.files, a.fractions, a.methods, a.batch, a.time_limit, a.particles, a.iterations, done, a.json
        )
    print(markdown(recs, a.baseline))
    return 0


def add_cli(subparsers: Any) -> None:
    """Register the `methods` subcommand on tensorplace-bench's subparsers."""
    p = subparsers.add_parser("methods", help=cmd_methods.__doc__)
    p.add_argument("--models", nargs="*", default=examples.names(), choices=examples.names())
    p.add_argument("--files", nargs="*", default=[], help="profile files, or plan files that carry a profile")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                   help="budgets: lower bound + fraction x (unplanned peak - lower bound)")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help="plan_profile methods (modnn: a sub-batch x accumulation steps), and pso+milp: PSO seeded with the MILP's plan (planning time is both)")
    p.add_argument("--baseline", default="milp", help="the method the others are compared with (%%)")
    p.add_argument("--time-limit", type=float, default=30.0, help="MILP time limit, seconds")
    p.add_argument("--particles", type=int, default=500)
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--json", help="append one JSON line per measurement to this file")
    p.add_argument("--resume", action="store_true", help="reuse the measurements already in --json")
    p.set_defaults(fn=cmd_methods)
