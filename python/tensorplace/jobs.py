"""Several jobs against one shared budget (TENSILE's multi-job setting): ``plan_jobs()``.

TENSILE plans the jobs of one device together and counts the global peak as the sum of the
jobs' peaks (conservative: their peaks may not coincide). Here the shared budget is split into
one budget per job, each job is planned by the given method under its share, and the split is
searched: for every job, plans at a grid of budgets from its lower bound to the most it can get
(the shared budget less the other jobs' lower bounds); then the combination of grid points whose
budgets sum to at most the shared budget with the smallest total (or largest) predicted step
time, exactly over the grid (a Pareto frontier over jobs). docs/methods.md has the choices.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _core
from .budget import Budget, format_bytes, parse_budget
from .planning import Plan, ProfileLike, lower_bound, plan_profile, profile_json, unplanned_peak

JobLike = Union[Plan, ProfileLike]


def _job_profile(job: JobLike, index: int) -> Dict[str, Any]:
    if isinstance(job, Plan):
        data = job.to_dict()
        if "profile" not in data:
            raise _core.PlannerError(
                f"job {index}: this plan carries no profile (it was made by plan_profile); pass the profile "
                "itself, or a plan from tensorplace.plan()"
            )
        return data["profile"]
    return json.loads(profile_json(job))


#: methods whose plan is made without a search (the core's, and moDNN): their refusals name the
#: budget they meet
_NON_SEARCHING = (*_core.NON_SEARCHING_METHODS, "modnn")


def _smallest_known(profile: Dict[str, Any], method: str = "pso", **search: Any) -> int:
    """The smallest budget known to work for one job planned with ``method``: a method that does
    not search is asked at the lower bound (its refusal names what it meets); else the smallest
    budget a simple plan meets."""
    if method in _NON_SEARCHING:
        try:
            plan = plan_profile(profile, max(lower_bound(profile, state_swaps=method == "tensile"), 1), method,
                                **search)
            return int(plan.budget_bytes)
        except _core.BudgetError as e:
            return int(e.args[1])
    # TENSILE may keep parameters and optimizer state on the host between steps
    return int(_core.smallest_known_budget(json.dumps(profile), state_swaps=method == "tensile")[0])


class JobPlans:
    """``plan_jobs()``'s result: one Plan per job (``plans``) and the split (``summary``)."""

    def __init__(self, plans: List[Plan], summary: Dict[str, Any]):
        self.plans = plans
        self.summary = summary

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i: int) -> Plan:
        return self.plans[i]

    def __repr__(self) -> str:
        s = self.summary
        shares = ", ".join(format_bytes(b) for b in s["shares"])
        return (
            f"<tensorplace.JobPlans {len(self.plans)} jobs under {format_bytes(s['budget_bytes'])}: shares {shares}; "
            f"sum of peaks {format_bytes(s['sum_peak_bytes'])}, total step {s['total_step_time'] * 1e3:.1f} ms>"
        )


def plan_jobs(
    jobs: Sequence[JobLike],
    budget: Budget,
    method: str = "pso",
    *,
    objective: str = "sum",
    grid: int = 6,
    **search: Any,
) -> JobPlans:
    """Plan several jobs that run together on one device under one shared ``budget``.

    ``jobs``: profiles (dicts, JSON text or paths) or Plans that carry their profile (from
    ``tensorplace.plan()``). Each job gets a share of the budget and is planned by ``method``
    (with ``search`` settings, as ``plan_profile``) under its share, so the sum of the jobs'
    predicted peaks fits the shared budget. The split minimises the total (``objective="sum"``)
    or the largest (``"max"``) predicted step time over a grid of ``grid`` budgets per job.
    With one job, its plan is ``plan_profile(job, budget, method, **search)``.

    Raises ``BudgetError`` (``args[1]``: a shared budget that works) when the jobs' lower bounds
    add up to more than the budget, or when no split of the grid fits.
    """
    if objective not in ("sum", "max"):
        raise _core.PlannerError(f'objective {objective!r}: use "sum" (total step time) or "max" (slowest job)')
    if not isinstance(grid, int) or grid < 2:
        raise _core.PlannerError(f"grid {grid!r}: give an integer of at least 2 budgets per job")
    if not jobs:
        raise _core.PlannerError("no jobs: give at least one profile or plan")
    total = parse_budget(budget)
    profiles = [_job_profile(j, i) for i, j in enumerate(jobs)]
    lbs = [lower_bound(p, state_swaps=method == "tensile") for p in profiles]
    if len(profiles) == 1:
        # One job gets the whole budget: plain single-job planning (its refusals are the method's
        # own: moDNN's sub-batches go below the whole batch's lower bound)
        plans = [_carry(jobs[0], plan_profile(profiles[0], total, method, **search))]
        return JobPlans(plans, _summary(total, method, objective, plans, lbs, []))
    # the least share each job can get: its lower bound, or what a method that does not search meets
    floors = [_smallest_known(p, method, **search) for p in profiles] if method in _NON_SEARCHING else list(lbs)

    def known_to_work() -> int:
        """A shared budget known to work: each job under the smallest budget known to work with the
        method (for a searching method, a simple plan's: found only when refusing)."""
        return sum(floors) if method in _NON_SEARCHING else sum(_smallest_known(p, method) for p in profiles)

    if sum(lbs) > total:
        works = known_to_work()
        raise _core.BudgetError(
            f"shared budget {total} bytes ({format_bytes(total)}) is below the sum of the jobs' lower bounds, "
            f"{sum(lbs)} bytes ({format_bytes(sum(lbs))}: {', '.join(format_bytes(b) for b in lbs)}); the "
            f"smallest shared budget known to work is {works} bytes ({format_bytes(works)}), each job under "
            "the smallest budget known to work with this method: give at least that, or fewer jobs",
            works,
        )

    if sum(floors) > total:
        raise _core.BudgetError(
            f"shared budget {total} bytes ({format_bytes(total)}) is below what method {method!r} needs for the jobs, "
            f"{sum(floors)} bytes ({format_bytes(sum(floors))}: {', '.join(format_bytes(b) for b in floors)}): give at "
            "least that, or use method=\"pso\", which searches every plan", sum(floors))

    # Per job: plans at a grid of budgets (its floor .. the most it can get), feasible ones only.
    options: List[List[Tuple[int, float, Plan]]] = []
    for j, p in enumerate(profiles):
        most = total - (sum(floors) - floors[j])
        points = {floors[j] + (most - floors[j]) * g // (grid - 1) for g in range(grid)}
        up = unplanned_peak(p)
        if up < most:
            points.add(up)
        opts: List[Tuple[int, float, Plan]] = []
        for b in sorted(points):
            try:
                plan = plan_profile(p, b, method, **search)
            except _core.BudgetError:
                continue
            opts.append((b, float(plan.predicted["step_time"]), plan))
        if not opts:
            works = known_to_work()
            raise _core.BudgetError(
                f"job {j}: method {method!r} found no plan under any share up to {format_bytes(most)} of the shared "
                f"budget {format_bytes(total)}; a shared budget of {works} bytes ({format_bytes(works)}) is known to "
                "work (each job under the smallest budget known to work with this method): raise the budget or use "
                "method=\"pso\"",
                works,
            )
        options.append(opts)

    # Exact over the grid: a Pareto frontier of (memory used, time) over the jobs so far.
    def combine(a: float, b: float) -> float:
        return a + b if objective == "sum" else max(a, b)

    frontier: List[Tuple[int, float, Tuple[int, ...]]] = [(0, 0.0, ())]
    for opts in options:
        merged = [
            (m + b, combine(t, tb), picks + (k,))
            for (m, t, picks) in frontier
            for k, (b, tb, _) in enumerate(opts)
            if m + b <= total
        ]
        # Keep the non-dominated ones: least memory for each time, scanning by time then more memory.
        merged.sort(key=lambda x: (x[1], -x[0]))
        frontier = []
        for cand in merged:
            if not frontier or cand[0] < frontier[-1][0]:
                frontier.append(cand)
        if not frontier:
            break
    if not frontier:
        works = sum(opts[0][0] for opts in options)
        raise _core.BudgetError(
            f"no split of the shared budget {total} bytes ({format_bytes(total)}) gives every job a plan; "
            f"{works} bytes ({format_bytes(works)}) works (each job at the smallest share where {method!r} "
            "found a plan): raise the budget to at least that",
            works,
        )
    # Best time; among equal times, the split that gives the jobs the most memory.
    best = min(frontier, key=lambda x: (x[1], -x[0]))
    plans = [_carry(jobs[j], options[j][k][2]) for j, k in enumerate(best[2])]
    return JobPlans(plans, _summary(total, method, objective, plans, lbs, [[(b, t) for (b, t, _) in o] for o in options]))


def _carry(job: JobLike, plan: Plan) -> Plan:
    """A job given as a Plan keeps its model fingerprint, profile and units (as Plan.replan)."""
    if not isinstance(job, Plan):
        return plan
    data, new = job.to_dict(), plan.to_dict()
    for key in ("model_fingerprint", "profile", "input_shapes", "unit_modules"):
        if key in data:
            new[key] = data[key]
    return Plan(new)


def _summary(
    total: int, method: str, objective: str, plans: List[Plan], lbs: List[int], grid: List[List[Tuple[int, float]]]
) -> Dict[str, Any]:
    shares = [p.budget_bytes for p in plans]
    peaks = [int(p.predicted["peak_bytes"]) for p in plans]
    return {
        "budget_bytes": total,
        "method": method,
        "objective": objective,
        "shares": shares,
        "peaks": peaks,
        "sum_peak_bytes": sum(peaks),
        "unused_bytes": total - sum(shares),
        "step_times": [float(p.predicted["step_time"]) for p in plans],
        "total_step_time": sum(float(p.predicted["step_time"]) for p in plans),
        "max_step_time": max(float(p.predicted["step_time"]) for p in plans),
        "lower_bounds": lbs,
        "grid": grid,
    }
