"""plan_jobs (TENSILE's several jobs on one device): the split fits the shared budget, is the best
over its grid, refuses with a budget that works, and is single-job planning for one job."""

from __future__ import annotations

import itertools

import pytest

import tensorplace as tp

FAST = dict(particles=6, iterations=2)


def _profiles():
    return [tp.examples.profile("plain20", batch_size=16), tp.examples.profile("squeezenet", batch_size=8)]


@pytest.mark.parametrize("objective", ["sum", "max"])
def test_shares_fit_the_shared_budget_and_are_best_over_the_grid(objective: str) -> None:
    profs = _profiles()
    lbs = [tp.lower_bound(p) for p in profs]
    ups = [tp.unplanned_peak(p) for p in profs]
    budget = sum(lbs) + (sum(ups) - sum(lbs)) // 2
    res = tp.plan_jobs(profs, budget, "tensile", objective=objective, grid=5)
    assert len(res) == 2
    s = res.summary
    assert sum(p.predicted["peak_bytes"] for p in res) <= budget
    assert sum(s["shares"]) <= budget
    for plan, share in zip(res, s["shares"]):
        assert plan.budget_bytes == share and plan.predicted["peak_bytes"] <= share
    # Exact over the grid: no combination of grid points within the budget is better.
    combine = sum if objective == "sum" else max
    best = min(
        combine(t for _, t in combo) for combo in itertools.product(*s["grid"]) if sum(b for b, _ in combo) <= budget
    )
    got = s["total_step_time"] if objective == "sum" else s["max_step_time"]
    assert got == pytest.approx(best)


def test_refuses_below_the_sum_of_lower_bounds_naming_a_budget_that_works() -> None:
    profs = _profiles()
    lbs = [tp.lower_bound(p) for p in profs]
    with pytest.raises(tp.BudgetError, match="lower bounds") as e:
        tp.plan_jobs(profs, sum(lbs) - 1, "pso", **FAST)
    works = e.value.args[1]
    assert works >= sum(lbs)
    res = tp.plan_jobs(profs, works, "pso", grid=3, **FAST)
    assert sum(p.predicted["peak_bytes"] for p in res) <= works


def test_one_job_is_single_job_planning() -> None:
    prof = tp.examples.profile("plain20", batch_size=16)
    budget = (tp.lower_bound(prof) + tp.unplanned_peak(prof)) // 2
    (job,) = tp.plan_jobs([prof], budget, "pso", seed=3, **FAST)
    alone = tp.plan_profile(prof, budget, "pso", seed=3, **FAST)
    assert job.actions == alone.actions and job.prefetch == alone.prefetch
    assert job.budget_bytes == alone.budget_bytes == budget
    assert job.predicted == alone.predicted


def test_one_moDNN_job_below_the_whole_batch_lower_bound_is_single_job_planning() -> None:
    # plan_jobs refused below the whole batch's lower bound before planning one job, where moDNN's
    # sub-batches fit
    prof = tp.examples.profile("plain20", batch_size=16)
    budget = tp.lower_bound(prof) - 1
    alone = tp.plan_profile(prof, budget, "modnn")
    (job,) = tp.plan_jobs([prof], budget, "modnn")
    assert job.actions == alone.actions and job.settings["sub_batch"] == alone.settings["sub_batch"] < 16
    assert job.predicted == alone.predicted


@pytest.mark.parametrize("method", ["sqrt", "superneurons", "delta"])
def test_a_method_that_does_not_search_is_refused_naming_a_shared_budget_it_meets(method: str) -> None:
    # plan_jobs named the sum of simple plans' budgets, which these methods then refused again
    profs = _profiles()
    with pytest.raises(tp.BudgetError, match=f"what method '{method}' needs") as e:
        tp.plan_jobs(profs, sum(tp.lower_bound(p) for p in profs), method)
    works = e.value.args[1]
    res = tp.plan_jobs(profs, works, method, grid=3)
    assert sum(p.predicted["peak_bytes"] for p in res) <= works
