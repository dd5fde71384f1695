"""The compiled engine's own cost model (python/tensorplace/compiled_cost.py): a plan searched for
the compiled engine at a budget between its smallest peak and the all-retain step's, compiled
with torch.compile, has a measured peak within its predicted peak (at most the prediction, and the
prediction at most 2% above it), and trains with the unplanned step's values."""

import copy
import warnings

import pytest
import torch

import tensorplace as tp
from cuda_exec.memory import measure_peak
from tensorplace.compiled_cost import CompiledCostModel, _graph_handles, plan_compiled, plan_dict
from tensorplace.models import TinyGPT

_OPTIONS = ("retain", "recompute")


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=64, heads=4, layers=2, block=64, dropout=0.0)
    torch.manual_seed(1)
    x = torch.randint(0, 64, (4, 64))
    # two options per region class (retain, recompute): four compiles in all, a few minutes on 2 cores
    cm = CompiledCostModel.measure(model, (x,), _loss, repeats=1, options=_OPTIONS)
    return model, x, cm


@pytest.mark.slow
def test_the_calibration_plans_are_predicted_at_or_above_their_measured_peaks(gpt):
    _, _, cm = gpt
    n = len(cm.units)
    retain = cm.predict(["retain"] * n)
    recompute = cm.predict(["recompute"] * n)
    # never below the measurement (the constants are calibrated on these plans); the all-recompute
    # plan can be above it. (On torch 2.11 it was 43% above while a region alone was measured holding
    # its output's grad_fn, which there does not keep the compiled graph's saved values: `kept` 0)
    assert retain["peak_bytes"] == cm.calibration["retain"]["peak_bytes"]
    measured = cm.calibration["recompute"]["peak_bytes"]
    assert measured <= recompute["peak_bytes"] <= 1.10 * measured, (measured, recompute)
    low = cm.lower_bound(_OPTIONS)
    assert low <= min(recompute["peak_bytes"], retain["peak_bytes"])
    with pytest.raises(tp.BudgetError):
        cm.search(low - 1, _OPTIONS)
    assert cm.search(low, _OPTIONS)[1]["peak_bytes"] == low


@pytest.mark.slow
def test_a_plan_for_the_compiled_engine_meets_its_predicted_peak_and_trains_as_unplanned(gpt):
    from tensorplace.profiler import unplanned_step_stats

    model, x, cm = gpt
    # the budget: 3% above the estimate of the plan that recomputes the first region and retains the second
    mixed = ["retain"] * len(cm.units)
    for u in cm.regions[0].units:
        mixed[u] = "recompute"
    budget = int(1.03 * cm.predict(mixed)["peak_bytes"])
    plan = plan_compiled(model, x, budget, _loss, cost_model=cm, options=_OPTIONS)
    acts = plan.actions
    if budget < cm.calibration["retain"]["peak_bytes"]:
        assert "recompute" in acts
    predicted = plan.predicted["peak_bytes"]
    info = plan.to_dict()["compiled_prediction"]
    assert predicted <= budget and info["engine"] == "compiled" and info["verified"]
    # the model's own estimate (before the search measured the plan) is within 10% of the measurement
    assert abs(info["model_peak_bytes"] - predicted) <= 0.10 * predicted, (info["model_peak_bytes"], predicted)
    # a fresh compile of the plan: its measured peak within the predicted one (2%), and the unplanned values
    reference = copy.deepcopy(model)
    want_loss = _loss(reference(x))
    want_loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        wrapper = tp.compiled(model, plan)
    try:
        torch._dynamo.reset()
        step = torch.compile(wrapper)
        for p in model.parameters():
            p.grad = None
        loss = _loss(step(x))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        measured = unplanned_step_stats(step, (x,), loss_fn=_loss, repeats=1)["peak_bytes"]
    finally:
        wrapper.close()
        torch._dynamo.reset()
        for p in model.parameters():
            p.grad = None
    assert measured <= predicted <= 1.02 * measured, (measured, predicted)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
    for g, q in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, q.grad, rtol=1e-4, atol=1e-5)


def test_plan_dict_makes_a_valid_plan():
    p = tp.Plan(plan_dict(["a", "b"], ["retain", "recompute"], peak=7, step=0.5))
    assert p.actions == ["retain", "recompute"] and p.predicted["peak_bytes"] == 7


class _Twice(torch.autograd.Function):
    """A custom autograd Function (as the compiled graph's CompiledFunction is) that saves ``2 x``."""

    @staticmethod
    def forward(ctx, x):
        y = x * 2
        ctx.save_for_backward(y)
        return x + 1

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_the_graph_handles_keep_what_a_custom_function_saved_without_its_output():
    # how a region alone is measured: its forward's output let go, its graph kept (on torch 2.11 a
    # kept grad_fn of a custom Function does not keep what it saved)
    x = torch.randn(1000, requires_grad=True)
    handles, trace = measure_peak(lambda: _graph_handles([_Twice.apply(x)]))
    assert [h.numel() for h in handles] == [0]
    assert trace.final_bytes == 1000 * x.element_size()  # the saved 2 x, not the output
    torch.autograd.backward(handles, [torch.zeros(0)])  # the saved values are still there
    torch.testing.assert_close(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("bad", [-5, 0, "lots"])
def test_plan_compiled_refuses_a_budget_that_is_not_one(bad):
    # a negative budget was searched and reported as "no plan ... fits -5 bytes"
    with pytest.raises(ValueError, match="budget"):
        plan_compiled(torch.nn.Linear(2, 2), (torch.randn(1, 2),), bad)
