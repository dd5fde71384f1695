"""Memory the plan does not know of (an optimizer it was not given) is reported in the first
planned step, once, with the bytes and the fix; or refused where the budget is a hard cap."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision

import tensorplace as tp
from tensorplace.unplanned_memory import optimizer_state_bytes


def resnet18_b8_64px():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(8, 3, 64, 64)
    y = torch.randint(0, 10, (8,))
    return model, x, lambda out: F.cross_entropy(out, y)


def halfway(model, x, loss_fn, **kw) -> tp.Plan:
    probe = tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", repeats=1, **kw)
    lb, up = tp.lower_bound(probe.profile), tp.unplanned_peak(probe.profile)
    return probe.replan(lb + (up - lb) // 2, particles=20, iterations=10)


def test_adam_the_plan_was_not_told_of_is_reported_in_the_first_planned_step() -> None:
    model, x, loss_fn = resnet18_b8_64px()
    plan = halfway(model, x, loss_fn)  # no optimizer=
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opt = torch.optim.Adam(params, lr=1e-3)  # its state appears at its first step(), after planning
    fast = tp.run(model, plan)
    try:
        with pytest.warns(tp.UnplannedMemoryWarning) as caught:
            loss_fn(fast(x)).backward()  # the first planned step
        assert len(caught) == 1
        found = fast.memory_check.last
        # Adam's two moments per parameter, to be created at its first step (and one step counter each)
        assert found["optimizer_state"] == 0 and 2 * param_bytes <= found["optimizer_state_coming"] <= 2 * param_bytes + 4096
        assert found["extra"] >= 2 * param_bytes
        msg = str(caught[0].message)
        for words in ("optimizer state (Adam)", tp.format_bytes(found["extra"]), "optimizer=opt"):
            assert words in msg, (words, msg)
        over = plan.predicted["peak_bytes"] + found["extra"] > plan.budget_bytes
        assert f"{'over' if over else 'within'} its budget of {tp.format_bytes(plan.budget_bytes)}" in msg
        lb = plan.fixed_memory["lower_bound_bytes"]
        if plan.budget_bytes - found["extra"] >= lb:
            assert f"plan.replan({plan.budget_bytes - found['extra']})" in msg, msg
        else:  # no replan within the budget can make room: the message says what budget would
            assert f"the budget needs at least {tp.format_bytes(lb + found['extra'])}" in msg, msg
        opt.step()
        opt.zero_grad()
        assert optimizer_state_bytes(opt)[0] == found["optimizer_state_coming"]  # the prediction was the state
        with warnings.catch_warnings():  # reported once
            warnings.simplefilter("error", tp.UnplannedMemoryWarning)
            loss_fn(fast(x)).backward()
            opt.step()
    finally:
        fast.close()

    # planned with the optimizer: its state is constant memory the plan counts; nothing to report
    counted = halfway(model, x, loss_fn, optimizer=opt)
    fast = tp.run(model, counted)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tp.UnplannedMemoryWarning)
            for _ in range(2):
                opt.zero_grad()
                loss_fn(fast(x)).backward()
                opt.step()
        assert abs(fast.memory_check.last["extra"]) <= fast.memory_check.tolerance()
    finally:
        fast.close()

    # a budget that is a hard cap: the step is not run when the budget would not hold
    fast = tp.run(model, plan, hard_cap=True)
    try:
        assert plan.predicted["peak_bytes"] + 2 * param_bytes > plan.budget_bytes  # else this shows nothing
        with pytest.raises(tp.BudgetError, match="hard_cap=True") as e:
            fast(x)
        assert e.value.args[1] >= plan.predicted["peak_bytes"] + 2 * param_bytes
    finally:
        fast.close()


def test_gradients_kept_for_accumulation_are_not_reported() -> None:
    model, x, loss_fn = resnet18_b8_64px()
    plan = tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", repeats=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: nothing unplanned
    fast = tp.run(model, plan)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tp.UnplannedMemoryWarning)
            for _ in range(3):  # accumulate: the gradients stay between the steps
                loss_fn(fast(x)).backward()
        opt.step()
        assert fast.memory_check.last["gradients"] > 0
    finally:
        fast.close()
