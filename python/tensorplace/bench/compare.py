"""``compare``: every method on one profile at several budgets (predicted by the cost model)."""

from __future__ import annotations

import argparse
import time
from typing import Any, List

from .._core import BudgetError
from ..budget import format_bytes
from ..planning import lower_bound, plan_profile, unplanned_peak
from . import common


def cmd_compare(a: argparse.Namespace) -> int:
    """Every method on one profile (a real model's, profiled here; a builtin or a saved one) at several
    budgets (predicted by the cost model)."""
    label, prof = common.load_source(a)
    lb, up = lower_bound(prof), unplanned_peak(prof)
    rows = []
    a.methods = common.known_methods(a.methods, a)
    with common.progress("planning", total=len(a.fractions) * len(a.methods)) as bar:
        for frac in a.fractions:
            budget = int(lb + frac * (up - lb))
            row: List[Any] = [f"{frac:.2f}", format_bytes(budget)]
            for method in a.methods:
                bar.advance()
                t = time.perf_counter()
                rec = {"position": frac, "budget_bytes": budget, "method": method}
                try:
                    p = plan_profile(prof, budget, method, iterations=a.iterations, particles=a.particles, seed=a.seed)
                    took = time.perf_counter() - t
                    row.append(f"{common.ms(p.predicted['step_time'])} ({took:.1f}s)")
                    rec.update(feasible=True, predicted_step_time=p.predicted["step_time"],
                               predicted_peak_bytes=p.predicted["peak_bytes"], search_seconds=took)
                except BudgetError:
                    row.append("infeasible")
                    rec.update(feasible=False)
                a.out.append("rows", rec)
            rows.append(row)
    common.table(
        f"{label}: predicted step ms (search time); lower bound {format_bytes(lb)}, unplanned {format_bytes(up)}",
        ["budget pos", "budget"] + list(a.methods),
        rows,
    )
    a.out.update(profile=label, lower_bound_bytes=lb, unplanned_peak_bytes=up)
    return 0


def add_cli(sub: Any) -> None:
    c = sub.add_parser("compare", help="methods side by side on a model's profile (predicted)",
                       description=cmd_compare.__doc__)
    common.profile_source_args(c, "resnet50")
    c.add_argument("--fractions", type=common.fraction, nargs="+", default=[0.25, 0.5, 0.75],
                   help="budget positions between the lower bound (0) and the unplanned peak (1)")
    c.add_argument("--methods", nargs="+", default=["pso", "swap-all", "recompute-all", "retain"])
    common.search_args(c)
    c.set_defaults(fn=cmd_compare)
