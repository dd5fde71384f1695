"""``plan``: plan from a saved profile on any machine and save the plan, for
``tensorplace.run(model, "plan.json")`` on the machine that profiled."""

from __future__ import annotations

import argparse
from typing import Any, Dict

from .._core import BudgetError
from ..budget import format_bytes
from ..planning import Plan, lower_bound, plan_profile, unplanned_peak
from . import common


def plan_from_profile(prof: Dict[str, Any], budget: int, method: str, **search: Any) -> Plan:
    """plan_profile(), plus what ``tensorplace.plan()`` writes into a plan (the profile, and the
    model and input fingerprints when the profile was saved by ``tensorplace-bench profile``), so
    that ``run()`` checks the plan against the model as it does for ``plan()``'s plans."""
    data = plan_profile(prof, budget, method, **search).to_dict()
    data["profile"] = prof
    for key in ("model_fingerprint", "input_shapes", "input_specs"):
        if prof.get(key) is not None:
            data[key] = prof[key]
    return Plan(data)


def cmd_plan(a: argparse.Namespace) -> int:
    """Plan from a saved profile and save the plan."""
    prof = common.read_profile(a.profile, "profile", " (write one with `tensorplace-bench profile`)")
    if not common.planner_knows(a.method):
        raise SystemExit(f"--method {a.method!r}: this planner does not know it; use pso, swap-all, recompute-all, "
                         "retain or exhaustive")
    lb, up = lower_bound(prof), unplanned_peak(prof)
    a.out.update(profile=a.profile, model=prof.get("model"), budget_bytes=a.budget, method=a.method,
                      lower_bound_bytes=lb, unplanned_peak_bytes=up)
    try:
        with common.progress(f"searching ({a.particles} particles x {a.iterations} iterations)"):
            p = plan_from_profile(prof, a.budget, a.method, iterations=a.iterations, particles=a.particles,
                                  seed=a.seed, threads=a.threads, budget_kind=a.budget_kind, alloc_conf=a.alloc_conf)
    except BudgetError as e:
        print(f"cannot plan {prof.get('model')} in {format_bytes(a.budget)}: {e.args[0]}")
        a.out["error"] = e.args[0]
        return 1
    print(p.summary())
    print(f"(unplanned peak {format_bytes(up)}, smallest peak any plan could have {format_bytes(lb)})")
    p.save(a.output)
    print(f"plan saved to {a.output}; use it with tensorplace.run(model, {a.output!r})")
    a.out.update(path=a.output, counts=p.counts(), predicted=p.predicted, actions=p.actions)
    return 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser("plan", help="plan from a saved profile and save the plan", description=cmd_plan.__doc__)
    p.add_argument("profile", metavar="PROFILE", help="a profile file (tensorplace-bench profile, or save_profile()), or a plan file that carries its profile (tp.plan)")
    p.add_argument("--budget", type=common.budget, required=True, help="device memory for the whole step, e.g. 6GiB")
    p.add_argument("--method", default="pso", help="pso (default), swap-all, recompute-all, retain, exhaustive")
    p.add_argument("-o", "--output", default="plan.json", metavar="PATH", help="where to write the plan (default plan.json)")
    p.add_argument("--threads", type=int, default=0, help="search threads (default 0: all cores; the plan is the same)")
    p.add_argument("--budget-kind", choices=("allocated", "reserved"), default="allocated",
                   help="what the budget limits: live tensors (default) or the CUDA caching allocator's reserved "
                        "memory, simulated (docs/cost-model.md, Reserved memory)")
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to simulate reserved memory under (default: the profile's)")
    common.search_args(p)
    p.set_defaults(fn=cmd_plan)
