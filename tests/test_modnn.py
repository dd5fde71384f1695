"""moDNN (docs/methods.md): the sub-batch rule, predictions per full step, refusals, and
training a sub-batch plan with gradient accumulation."""

from __future__ import annotations

import copy
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorplace as tp


def _fractions_of_peak(profile: Dict[str, Any]) -> list:
    up = tp.unplanned_peak(profile)
    return [int(up * f) for f in (0.1, 0.2, 0.4, 0.7, 1.0)]


@pytest.mark.parametrize("model", ["plain20", "resnet50", "mobilenet_v2"])
def test_modnn_takes_the_largest_sub_batch_whose_windows_fit(model: str) -> None:
    prof = tp.examples.profile(model, batch_size=32)
    seen = set()
    for budget in _fractions_of_peak(prof):
        try:
            plan = tp.plan_profile(prof, budget, "modnn")
        except tp.BudgetError as e:
            assert e.args[1] > budget
            continue
        s = plan.settings
        b, k = s["sub_batch"], s["accumulation_steps"]
        seen.add(b)
        assert b * k == 32 and b in s["candidates"]
        assert plan.predicted["feasible"] and plan.predicted["peak_bytes"] <= budget
        assert plan.counts()["recompute"] == 0
        # The rule: the chosen sub-batch's windows fit (unless none did), the next larger's do not.
        assert s["budget_fits_window"] or b == min(s["candidates"]) or not s["tried"][0]["fits"]
        if s["next_larger"] is not None:
            assert s["next_larger"]["window_peak"] > budget
        # Per full step: the first sub-batch plus the later ones.
        sub = s["sub_steps"]
        assert plan.predicted["step_time"] == pytest.approx(sub["first"]["step_time"] + (k - 1) * sub["later"]["step_time"])
        assert plan.predicted["peak_bytes"] == max(sub["first"]["peak_bytes"], sub["later"]["peak_bytes"])
    assert len(seen) >= 2, f"{model}: the budgets should lead to different sub-batches, got {seen}"


def test_modnn_refuses_below_its_lower_bound_and_meets_the_budget_it_names() -> None:
    prof = tp.examples.profile("plain20", batch_size=32)
    with pytest.raises(tp.BudgetError) as e:
        tp.plan_profile(prof, 1000, "modnn")
    named = e.value.args[1]
    assert named > 1000 and "lower bound" in str(e.value)
    plan = tp.plan_profile(prof, named, "modnn")
    assert plan.predicted["peak_bytes"] <= named


def test_a_small_model_whose_whole_batch_needs_least_is_planned_at_its_unplanned_peak() -> None:
    """Where the gradients dominate, the smallest sub-batch (holding them from its start) needs
    more than the whole batch: moDNN took that sub-batch's bound as its own and refused budgets
    up to 20% above the unplanned peak, naming one it then planned without a split."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    prof = tp.plan(model, x, "1GiB", loss_fn=lambda out: F.cross_entropy(out, y), method="retain", repeats=1).profile
    up = tp.unplanned_peak(prof)
    plan = tp.plan_profile(prof, up, "modnn")
    assert plan.predicted["peak_bytes"] <= up
    with pytest.raises(tp.BudgetError) as e:
        tp.plan_profile(prof, tp.lower_bound(prof) // 2, "modnn")
    named = e.value.args[1]
    assert named <= up
    assert tp.plan_profile(prof, named, "modnn").predicted["peak_bytes"] <= named


def test_modnn_needs_a_batch_size() -> None:
    prof = tp.examples.profile("plain20", batch_size=32)
    prof["batch_size"] = None
    with pytest.raises(tp.PlannerError, match="batch_size"):
        tp.plan_profile(prof, tp.unplanned_peak(prof), "modnn")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.head = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))))


def test_gradient_accumulation_matches_full_batch_training() -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))
    probe = tp.plan(model, x, "1GiB", loss_fn=lambda out: F.cross_entropy(out, y), method="retain", repeats=1)
    prof = probe.to_dict()["profile"]
    up = tp.unplanned_peak(prof)
    plan = None
    for frac in (0.9, 0.8, 0.7, 0.6, 0.5):
        try:
            cand = probe.replan(int(up * frac), method="modnn")
        except tp.BudgetError:
            break
        if cand.settings["accumulation_steps"] >= 2:
            plan = cand
            break
    assert plan is not None, "some budget below the unplanned peak should split the batch"
    k = plan.settings["accumulation_steps"]

    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()

    planned = tp.run(model, plan)
    loss = tp.accumulate(planned, x, lambda out, yb: F.cross_entropy(out, yb), plan, targets=y)
    assert loss.item() == pytest.approx(F.cross_entropy(ref(x), y).item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{name} with {k} sub-batches")

    with pytest.raises(tp.PlannerError, match="full batch"):
        tp.accumulate(planned, x[:8], lambda out, yb: F.cross_entropy(out, yb), plan, targets=y[:8])
    # run()'s module takes the plan's sub-batches directly, and nothing larger in any dimension:
    # not the whole batch (it trained as one step, over the budget), nor a sub-batch of wider rows
    sub = plan.settings["sub_batch"]
    planned(x[:sub]).sum().backward()
    for bad in (x, x[: sub + 1], torch.randn(sub, 64)):
        with pytest.raises(tp.PlannerError, match="not a sub-batch of this moDNN plan.*tensorplace.accumulate"):
            planned(bad)
    planned.close()
