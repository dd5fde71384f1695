"""The Python planning API over the core: budgets, plans, files and errors."""

from __future__ import annotations

import json

import pytest

import tensorplace as tp


@pytest.fixture(scope="module")
def plain20():
    return tp.examples.profile("plain20", batch_size=16)


@pytest.mark.parametrize(
    "text,expected",
    [("6GiB", 6 * 1024**3), ("512 MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("2048", 2048), (4096, 4096)],
)
def test_budget_strings(text, expected):
    assert tp.parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["six gigs", "-1GiB", "0", "5 parsecs", 0, -5, float("nan")])
def test_bad_budgets_say_how_to_write_one(bad):
    with pytest.raises(ValueError, match="budget"):
        tp.parse_budget(bad)


def test_plan_meets_the_budget_and_beats_the_fixed_plans(plain20):
    lb, up = tp.lower_bound(plain20), tp.unplanned_peak(plain20)
    assert lb < up
    budget = (lb + up) // 2
    plan = tp.plan_profile(plain20, budget, particles=60, iterations=40)
    pred = plan.predicted
    assert pred["feasible"] and pred["peak_bytes"] <= budget
    assert len(plan.actions) == len(plain20["units"]) == len(plan.units)
    assert pred["step_time"] >= pred["compute_time"]
    # No worse than the fixed plans that are feasible at this budget.
    for fixed in ("swap-all", "recompute-all"):
        try:
            other = tp.plan_profile(plain20, budget, method=fixed)
        except tp.BudgetError:
            continue
        assert pred["step_time"] <= other.predicted["step_time"] + 1e-12
    # The prediction is the evaluator's for these actions.
    again = tp.evaluate(plain20, plan.actions, budget)
    assert again["step_time"] == pred["step_time"] and again["peak_bytes"] == pred["peak_bytes"]
    assert [p["unit"] for p in again["prefetch"]] == [p["unit"] for p in plan.prefetch]
    trace = plan.convergence
    assert len(trace["best"]) == 40 and trace["best"][-1] == pytest.approx(pred["step_time"])


def test_plans_round_trip_through_versioned_json(tmp_path, plain20):
    plan = tp.plan_profile(plain20, tp.unplanned_peak(plain20), particles=10, iterations=3)
    path = tmp_path / "p.plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "tensorplace.plan" and data["version"] == 1
    assert tp.Plan.load(path) == plan
    plan.check_profile(plain20)


def test_a_plan_for_another_profile_is_refused(plain20):
    plan = tp.plan_profile(plain20, tp.unplanned_peak(plain20), method="retain")
    other = tp.examples.profile("plain20", batch_size=32)
    with pytest.raises(tp.PlannerError, match="re-plan"):
        plan.check_profile(other)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "not JSON"),
        ('{"format": "something.else", "version": 1}', "tensorplace plan"),
        ('{"format": "tensorplace.plan", "version": 99}', "version 99"),
        ('{"format": "tensorplace.plan", "version": 1, "actions": ["retain"]}', "format version 1"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_corrupt_plan_files_are_refused_with_a_reason(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(tp.PlannerError, match=match):
        tp.Plan.load(path)


def test_a_budget_below_the_lower_bound_names_it(plain20):
    lb = tp.lower_bound(plain20)
    with pytest.raises(tp.BudgetError) as e:
        tp.plan_profile(plain20, lb - 1)
    smallest = e.value.args[1]
    assert str(lb) in str(e.value) and smallest >= lb and str(smallest) in str(e.value)
    # printed as its message alone (not the (message, budget) pair), the budget named
    assert str(e.value) == e.value.args[0] and str(e.value).startswith("budget ")
    assert e.value.smallest_budget == smallest
    assert tp.plan_profile(plain20, smallest, particles=20, iterations=5).predicted["feasible"]


def test_an_unreachable_budget_names_a_budget_that_works(plain20):
    # Between the lower bound and what any plan reaches: all-swap is infeasible here, and the
    # error names a budget at which a known plan is feasible.
    lb = tp.lower_bound(plain20)
    with pytest.raises(tp.BudgetError) as e:
        tp.plan_profile(plain20, lb, method="retain")
    smallest = e.value.args[1]
    assert smallest >= lb
    assert tp.evaluate(plain20, ["swap"] * len(plain20["units"]), smallest)["feasible"] or tp.evaluate(
        plain20, ["recompute"] * len(plain20["units"]), smallest
    )["feasible"]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p: p["units"][0].update(inputs=[len(p["units"]) - 1]) or p["units"][-1].update(inputs=[]), "runs later"),
        (lambda p: p["units"][1].update(inputs=[99]), "unknown unit 99"),
        (lambda p: p["units"][2].update(act_bytes=-1), "negative act_bytes"),
        (lambda p: p["units"][0].update(inputs=[3]) or p["units"][3].update(inputs=[0]), "cycle"),
        (lambda p: p.update(version=7), "version 7"),
        (lambda p: p.update(d2h_bandwidth=0), "d2h_bandwidth"),
    ],
)
def test_bad_profiles_are_refused_with_a_reason(plain20, mutate, match):
    p = json.loads(json.dumps(plain20))
    mutate(p)
    with pytest.raises(tp.PlannerError, match=match):
        tp.plan_profile(p, "1GiB", method="retain")


def test_unknown_method_lists_the_methods(plain20):
    with pytest.raises(tp.PlannerError, match="pso"):
        tp.plan_profile(plain20, "1GiB", method="genetic")


@pytest.mark.parametrize("setting,value,match", [
    ("iterations", -1, "iterations must be 0 or more, got -1"),
    ("restarts", 1.5, "restarts must be a whole number, got 1.5"),
    ("seed", "7", "seed must be a whole number"),
])
def test_bad_search_settings_name_the_setting(plain20, setting, value, match):
    # a negative count reached the core as "can't convert negative int to unsigned"
    with pytest.raises(tp.PlannerError, match=match):
        tp.plan_profile(plain20, "1GiB", **{setting: value})


def test_more_search_never_finds_a_worse_plan_for_the_same_seed(plain20):
    budget = (tp.lower_bound(plain20) + tp.unplanned_peak(plain20)) // 2
    short = tp.plan_profile(plain20, budget, particles=30, iterations=5, seed=3)
    long = tp.plan_profile(plain20, budget, particles=30, iterations=30, seed=3)
    assert long.predicted["step_time"] <= short.predicted["step_time"]


def test_restarts_and_relinking_are_settings_that_only_improve_the_plan(plain20):
    lb, up = tp.lower_bound(plain20), tp.unplanned_peak(plain20)
    budget = lb + (up - lb) // 4
    base = tp.plan_profile(plain20, budget, particles=40, iterations=10, restarts=0, relinks=0)
    more = tp.plan_profile(plain20, budget, particles=40, iterations=10, restarts=2, relinks=3)
    assert (base.settings["restarts"], base.settings["relinks"]) == (0, 0)
    assert (more.settings["restarts"], more.settings["relinks"]) == (2, 3)
    assert more.predicted["step_time"] <= base.predicted["step_time"]
    assert more.convergence["evaluations"] > base.convergence["evaluations"]
    assert more.convergence["best"][-1] == pytest.approx(more.predicted["step_time"])


def test_replan_needs_a_profile(plain20):
    plan = tp.plan_profile(plain20, tp.unplanned_peak(plain20), method="retain")
    with pytest.raises(tp.PlannerError, match="carries no profile"):
        plan.replan("1GiB")


def test_a_plan_says_which_memory_no_plan_can_move_and_where() -> None:
    prof = tp.examples.profile("resnet50", batch_size=32)
    budget = (tp.lower_bound(prof) + tp.unplanned_peak(prof)) // 2
    for method in ("capuchin", "pso"):
        plan = tp.plan_profile(prof, budget, method, particles=10, iterations=2) if method == "pso" else tp.plan_profile(prof, budget, method)
        fixed = plan.fixed_memory
        assert fixed["constant_bytes"] == sum(prof["memory"].values()) > 0
        assert fixed["gradient_bytes"] == sum(u["grad_bytes"] for u in prof["units"])
        assert fixed["lower_bound_bytes"] == tp.lower_bound(prof) <= plan.predicted["peak_bytes"]
        assert fixed["lower_bound_unit"] in plan.units
        assert "no plan peaks below" in plan.summary() and fixed["lower_bound_stage"] in plan.summary()
    # it survives saving and loading
    assert tp.Plan(plan.to_dict()).fixed_memory == fixed
