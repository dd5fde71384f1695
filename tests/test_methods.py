"""The papers' methods on one cost model (docs/methods.md): heuristics' rules, PSO never worse
than the best heuristic, and exact training under every new method's plan."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import tensorplace as tp
from side_by_side import assert_trains_alike

HEURISTICS = ["capuchin", "superneurons", "vdnn", "vdnn-sync", "tensile", "delta"]
MILPS = ["milp", "milp-swap", "milp-recompute"]
FRACTIONS = [0.25, 0.5, 0.75]


def budget_at(profile: Dict[str, Any], frac: float) -> int:
    lb, up = tp.lower_bound(profile), tp.unplanned_peak(profile)
    return int(lb + frac * (up - lb))


@pytest.mark.parametrize("model", tp.examples.names())
def test_pso_is_never_worse_than_the_best_heuristic(model: str) -> None:
    prof = tp.examples.profile(model, batch_size=32)
    for frac in FRACTIONS:
        budget = budget_at(prof, frac)
        best = None
        for h in HEURISTICS:
            try:
                t = tp.plan_profile(prof, budget, h).predicted["step_time"]
            except tp.BudgetError:
                continue
            best = t if best is None else min(best, t)
        # The guarantee comes from the seeds (restarts and relinking only improve on it; off here,
        # as they would triple this test's time)
        pso = tp.plan_profile(prof, budget, "pso", particles=10, iterations=3, restarts=0, relinks=0)
        assert set(pso.settings["seed_heuristics"]) <= set(HEURISTICS)
        if best is not None:
            assert pso.predicted["step_time"] <= best * (1 + 1e-12), (model, frac)
        # without the seeds, the short search is not guaranteed to be as good
        unseeded = tp.plan_profile(prof, budget, "pso", particles=10, iterations=3, seed_heuristics=False,
                                   restarts=0, relinks=0)
        assert unseeded.settings["seed_heuristics"] == []


@pytest.mark.parametrize("method", HEURISTICS)
def test_heuristic_plans_fit_or_name_a_budget_that_works(method: str) -> None:
    for model in ("resnet50", "inception_v3"):
        prof = tp.examples.profile(model, batch_size=32)
        for frac in FRACTIONS:
            budget = budget_at(prof, frac)
            try:
                p = tp.plan_profile(prof, budget, method)
            except tp.BudgetError as e:
                # the budget a refusal names is one this method meets (it named a simple plan's,
                # which the method then refused again)
                named = e.args[1]
                assert named > budget, e.args
                again = tp.plan_profile(prof, named, method)
                assert again.predicted["feasible"] and again.predicted["peak_bytes"] <= named
                continue
            assert p.method == method
            assert p.predicted["feasible"] and p.predicted["peak_bytes"] <= budget
            assert p.counts()["retain"] < len(p.actions)  # the unplanned step does not fit
        # with room for everything, nothing moves (DELTA releases above 3/4 of any budget)
        p = tp.plan_profile(prof, tp.unplanned_peak(prof), method)
        if method != "delta":
            assert set(p.actions) == {"retain"}


def test_delta_keeps_the_step_under_three_quarters_of_the_budget() -> None:
    """DELTA's policy releases tensors whenever the memory in use passes 3/4 of the budget,
    choosing by size x staleness, recomputing when that is cheaper than the transfer."""
    prof = tp.examples.profile("resnet50", batch_size=32)
    budget = tp.unplanned_peak(prof)
    p = tp.plan_profile(prof, budget, "delta")
    # the unplanned step fits this budget, yet DELTA released: its peak is far below the budget
    # (not always under 3/4 of it: at the backward's peak every resident tensor is in use)
    assert p.predicted["peak_bytes"] < 0.85 * budget
    assert p.counts()["swap"] > 0
    # the slower the host link, the more often recomputing is cheaper than the transfer
    counts = [tp.plan_profile(dict(prof, d2h_bandwidth=prof["d2h_bandwidth"] / f, h2d_bandwidth=prof["h2d_bandwidth"] / f),
                              budget, "delta").counts()["recompute"] for f in (1, 100, 10_000)]
    assert counts == sorted(counts) and counts[-1] > counts[0], counts


def test_superneurons_and_vdnn_follow_their_layer_rules() -> None:
    prof = tp.examples.profile("resnet50", batch_size=32)
    kinds = [u["kind"] for u in prof["units"]]
    budget = budget_at(prof, 0.5)
    sn = tp.plan_profile(prof, budget, "superneurons")
    for k, a in zip(kinds, sn.actions):
        if a == "swap":
            assert k == "conv"
        if a == "recompute":
            assert k in ("pool", "activation", "norm", "lrn")
    assert sn.counts()["swap"] > 0 and sn.counts()["recompute"] > 0
    vd = tp.plan_profile(prof, budget, "vdnn")
    assert vd.counts()["recompute"] == 0 and vd.counts()["swap"] > 0
    conv_inputs = {p for u in prof["units"] if u["kind"] == "conv" for p in u["inputs"]}
    layer_inputs = {p for u in prof["units"] for p in u["inputs"]}  # vDNN_all, when conv is not enough
    swapped = {i for i, a in enumerate(vd.actions) if a == "swap"}
    assert swapped <= conv_inputs or swapped <= layer_inputs | conv_inputs


def test_vdnn_sync_waits_for_every_offload() -> None:
    prof = tp.examples.profile("vgg16", batch_size=32)
    budget = budget_at(prof, 0.5)
    sync = tp.plan_profile(prof, budget, "vdnn-sync")
    assert sync.settings["eval"]["sync_swap_out"] is True
    asynchronous = tp.evaluate(prof, sync.actions, budget)
    assert asynchronous["feasible"]
    # same actions: the synchronous offload only adds stalls
    assert sync.predicted["step_time"] > asynchronous["step_time"]
    assert sync.predicted["swap_stall"] > asynchronous["swap_stall"]


def test_capuchin_and_tensile_move_the_least_they_need() -> None:
    prof = tp.examples.profile("inception_v3", batch_size=32)
    loose, tight = budget_at(prof, 0.75), budget_at(prof, 0.25)
    for m in ("capuchin", "tensile"):
        a = tp.plan_profile(prof, loose, m).counts()
        b = tp.plan_profile(prof, tight, m).counts()
        assert a["retain"] > b["retain"], (m, a, b)


# ------------------------------------------------------------------------------------------------
# Training under each new method's plan is exactly unplanned training (CPU, small ResNet-18).
# ------------------------------------------------------------------------------------------------


def _resnet() -> Tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 64, 64)
    y = torch.randint(0, 10, (4,))
    return model, x, lambda out: F.cross_entropy(out, y)


@pytest.fixture(scope="module")
def probe() -> tp.Plan:
    model, x, loss_fn = _resnet()
    return tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", repeats=1)


def _plan_for(probe: tp.Plan, method: str) -> tp.Plan:
    prof = probe.to_dict()["profile"]
    fixed = sum(prof["memory"].values()) + sum(u["grad_bytes"] for u in prof["units"])
    up = tp.unplanned_peak(prof)
    lb = tp.lower_bound(prof)
    for cut in (0.4, 0.25, 0.1, 0.0):
        budget = max(lb, int(up - cut * (up - fixed)) - 1)  # the last: anything but the unplanned peak
        try:
            return probe.replan(budget, method, time_limit=5)
        except tp.BudgetError:
            continue
    pytest.fail(f"{method}: no plan at any budget tried")


@pytest.mark.parametrize("method", HEURISTICS + MILPS)
def test_training_under_each_method_is_bitwise_equal(probe: tp.Plan, method: str) -> None:
    plan = _plan_for(probe, method)
    assert plan.method == method
    counts = plan.counts()
    assert counts["swap"] + counts["recompute"] > 0, counts
    model, x, loss_fn = _resnet()
    ref = copy.deepcopy(model)
    fast = tp.run(model, plan)
    assert_trains_alike(model, fast, ref, x, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 2, method)
    fast.close()


def test_training_under_a_modnn_plan_matches_full_batch_training_within_tolerance() -> None:
    """moDNN's plan on a real model (a GPT-style model; no BatchNorm or dropout, whose statistics
    and masks are per sub-batch): the executor runs each sub-batch under the plan's actions, and
    the accumulated gradients and the parameters after the optimizer steps match full-batch
    training up to floating-point rounding (docs/methods.md)."""
    from tensorplace.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=3, block=32, dropout=0.0)
    x = torch.randint(0, 50, (16, 32))
    y = torch.randint(0, 50, (16, 32))

    def loss_of(out: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), yb.reshape(-1))

    probe = tp.plan(model, x, "1GiB", loss_fn=lambda out: loss_of(out, y), method="retain", repeats=1)
    prof = probe.to_dict()["profile"]
    lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
    plan = None
    for frac in (0.5, 0.3, 0.2, 0.1, 0.0):
        try:
            cand = probe.replan(int(lb + frac * (up - lb)), method="modnn")
        except tp.BudgetError:
            continue
        if cand.settings["accumulation_steps"] >= 2:
            plan = cand
            break
    assert plan is not None, "a budget near the lower bound should split the batch"
    ref = copy.deepcopy(model)
    planned = tp.run(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        loss = tp.accumulate(planned, x, loss_of, plan, targets=y)
        loss_ref = loss_of(ref(x), y)
        loss_ref.backward()
        assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    assert not planned.last_stats.aborted
    planned.close()
