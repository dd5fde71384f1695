"""``convergence``: the PSO trace (best, mean and worst predicted step time per iteration)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..budget import format_bytes
from ..planning import lower_bound, plan_profile, unplanned_peak
from . import common


def cmd_convergence(a: argparse.Namespace) -> int:
    """The PSO trace: best, mean and worst predicted step time per iteration."""
    label, prof = common.load_source(a)
    lb, up = lower_bound(prof), unplanned_peak(prof)
    budget = a.budget if a.budget else int(lb + a.fraction * (up - lb))
    t = time.perf_counter()
    with common.progress(f"searching ({a.particles} particles x {a.iterations} iterations)"):
        p = plan_profile(prof, budget, iterations=a.iterations, particles=a.particles, seed=a.seed)
    total = time.perf_counter() - t
    c = p.convergence or {}
    best = c.get("best", [])
    final = best[-1] if best else None
    k = next((i for i, b in enumerate(best) if b is not None and final is not None and b <= final * 1.01), None)
    print(f"{label}, budget {format_bytes(budget)}: search {total:.2f} s on this machine, "
          f"{c.get('evaluations')} evaluations; within 1% of the final best at iteration {k} "
          f"({c['elapsed'][k]:.2f} s)" if k is not None else "no feasible plan")
    if len(best) < a.iterations and p.predicted["step_time"] <= p.predicted["compute_time"]:
        print(f"the swarm stopped after {len(best)} iterations: its plan has no stall and no replay, and none is faster")
    step = max(1, len(best) // 20)
    rows = [[i, common.ms(best[i]), common.ms(c["mean"][i]), common.ms(c["worst"][i]), c["feasible"][i]]
            for i in range(0, len(best), step)]
    common.table("convergence (predicted step ms)", ["iteration", "best", "mean", "worst", "feasible"], rows)
    a.out.update(profile=label, budget_bytes=budget, search_seconds=total, evaluations=c.get("evaluations"),
                      within_1pct_iteration=k, predicted_step_time=p.predicted["step_time"],
                      compute_time=p.predicted["compute_time"], convergence=c)
    if a.png:
        plt = common.pyplot()
        xs = list(range(len(best)))
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in ("best", "mean", "worst"):
            ax.plot(xs, [v * 1e3 if v is not None else float("nan") for v in c[key]], label=key)
        ax.set_xlabel("iteration")
        ax.set_ylabel("predicted step time (ms)")
        fig.suptitle(f"{label}: PSO search, budget {format_bytes(budget)}")
        ax.legend()
        common.save_figure(fig, a.png)
        a.out["png"] = a.png
    return 0


def add_cli(sub: Any) -> None:
    v = sub.add_parser("convergence", help="the PSO trace per iteration (and a PNG)", description=cmd_convergence.__doc__)
    common.profile_source_args(v, "inception_v3")
    v.add_argument("--fraction", type=common.fraction, default=0.5,
                   help="budget position between the lower bound (0) and the unplanned peak (1); default 0.5")
    v.add_argument("--budget", type=common.budget, help="a budget instead of --fraction, e.g. 2GiB")
    v.add_argument("--png", metavar="PATH", help="plot the trace into this PNG")
    common.search_args(v)
    v.set_defaults(fn=cmd_convergence)
