"""Inputs of other shapes under a plan: no larger in every dimension trains under the plan,
bitwise equal and within its budget; larger is refused; shape buckets get plans of their own."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Tuple

import pytest
import torch
import torch.nn.functional as F

import tensorplace as tp
from tensorplace import _core
from tensorplace.models import TinyGPT
from tensorplace.profiler import unplanned_step_stats
from tensorplace.shapes import compare, input_specs, planned_specs, scaled_profile

VOCAB, TOKENS, BATCH = 128, 64, 4


def gpt3() -> Tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A 3-layer GPT-style model and a batch of 64 tokens (its labels too)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=64, heads=4, layers=3, block=TOKENS, dropout=0.1)
    return model, torch.randint(0, VOCAB, (BATCH, TOKENS)), torch.randint(0, VOCAB, (BATCH, TOKENS))


def loss_of(y: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    return lambda out: F.cross_entropy(out.flatten(0, 1), y[:, :out.shape[1]].flatten())


@pytest.fixture
def link():
    """The CPU backend with its copies capped at 0.15 GB/s (a GPU-like copy/compute ratio), so
    that plans recompute as well as swap."""
    from cuda_exec.cpu_backend import CpuBackend

    backend = CpuBackend(bandwidth_cap=0.15e9)
    yield backend
    backend.close()


def moving_plan(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, backend: Any) -> tp.Plan:
    """A plan made at 64 tokens that swaps and recomputes: every third unit with activations
    swapped, the next recomputed, the rest retained (a search's mix depends on this machine's
    timings), its budget the peak the cost model predicts for it."""
    probe = tp.plan(model, x, budget=2**40, loss_fn=loss_of(y), method="retain", repeats=1, backend=backend)
    prof = probe.profile
    moving = [i for i, u in enumerate(prof["units"]) if u["act_bytes"] > 0]
    acts = ["retain"] * len(prof["units"])
    for k, i in enumerate(moving):
        acts[i] = ("swap", "recompute", "retain")[k % 3]
    budget = tp.evaluate(prof, acts, 2**40)["peak_bytes"]
    # (labelled pso: a plan names one of the planner's methods)
    plan = json.loads(_core.plan_from_actions(tp.planning.profile_json(prof), budget, acts, "pso", "{}", 2, None))
    data = probe.to_dict()
    plan.update({k: data[k] for k in ("model_fingerprint", "profile", "input_shapes", "input_specs", "unit_modules")
                 if k in data})
    return tp.Plan(plan)


def step(module: torch.nn.Module, params: list, x: torch.Tensor, y: torch.Tensor, seed: int) -> list:
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = loss_of(y)(module(x))
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in params]


def test_plan_profile_is_the_profile_it_was_searched_on(tmp_path) -> None:
    model, x, y = gpt3()
    plan = tp.plan(model, x, budget=2**40, loss_fn=loss_of(y), method="retain", repeats=1)
    prof = plan.profile
    assert prof is not None and prof["format"] == "tensorplace.profile" and len(prof["units"]) == len(plan.units)
    plan.check_profile(prof)  # the plan's own
    prof["units"][0]["act_bytes"] += 1  # a copy: the plan keeps its own
    assert plan.profile["units"][0]["act_bytes"] == prof["units"][0]["act_bytes"] - 1
    plan.save(tmp_path / "p.json")
    assert tp.Plan.load(tmp_path / "p.json").profile == plan.profile
    assert plan.replan(2**40, method="swap-all").profile == plan.profile
    assert tp.plan_profile(plan.profile, 2**40, "retain").profile is None  # plan_profile keeps a fingerprint only


def test_a_gpt_planned_at_64_tokens_trains_bitwise_on_64_32_and_48_within_the_budget(link) -> None:
    model, x, y = gpt3()
    plan = moving_plan(model, x, y, link)
    counts = plan.counts()
    assert counts["swap"] > 0 and counts["recompute"] > 0, counts
    ref = copy.deepcopy(model)
    fast = tp.run(model, plan, backend=link)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)
    try:
        for k, tokens in enumerate((64, 32, 48, 64, 32)):
            xs, ys = x[:, :tokens], y[:, :tokens]
            got, want = step(fast, params, xs, ys, k), step(ref, ref_params, xs, ys, k)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), tokens
            opt.step()
            ref_opt.step()
            assert all(torch.equal(p, q) for p, q in zip(params, ref_params)), tokens
            # the step under the plan, measured (torch's allocation records): within the budget
            peak = unplanned_step_stats(fast, (xs,), loss_fn=loss_of(ys), repeats=1)["peak_bytes"]
            assert peak <= plan.budget_bytes, (tokens, peak, plan.budget_bytes)
            if tokens < TOKENS:
                assert fast.last_stats.swap_bytes > 0 and fast.last_stats.replays > 0
    finally:
        fast.close()


def test_larger_inputs_are_refused_with_the_reason() -> None:
    model, x, y = gpt3()
    plan = tp.plan(model, x[:, :32], budget=2**40, loss_fn=loss_of(y), method="retain", repeats=1)
    fast = tp.run(model, plan)
    try:
        with pytest.raises(tp.PlannerError, match=r"dimension 1 of argument 0 is 48, larger than the planned 32"):
            fast(x[:, :48])
        with pytest.raises(tp.PlannerError, match=r"dimension 0 of argument 0 is 5, larger than the planned 4.*re-plan"):
            fast(torch.cat([x[:, :32], x[:1, :32]]))
        with pytest.raises(tp.PlannerError, match="is torch.int32 where the plan has torch.int64"):
            fast(x[:, :32].int())
        loss_of(y[:2])(fast(x[:2, :16])).backward()  # smaller in both dimensions: fine
    finally:
        fast.close()


def test_shapes_compare_dimension_by_dimension() -> None:
    planned = input_specs((torch.zeros(4, 64, dtype=torch.long), 3, torch.zeros(2)))
    assert compare(planned, planned) == ("same", "")
    assert compare(input_specs((torch.zeros(4, 32, dtype=torch.long), 3, torch.zeros(2))), planned)[0] == "smaller"
    assert compare(input_specs((torch.zeros(4, 32, dtype=torch.long), 3)), planned)[0] == "other"
    assert compare(input_specs((torch.zeros(4, 32, 1, dtype=torch.long), 3, torch.zeros(2))), planned)[0] == "other"
    assert compare(input_specs((torch.zeros(4, 32, dtype=torch.long), torch.zeros(1), torch.zeros(2))), planned)[0] == "other"
    # a plan saved before input_specs: the shapes of its input_shapes text, dtypes unchecked
    old = planned_specs({"input_shapes": "(4, 64), int, (2,)"})
    assert old == [((4, 64), ""), None, ((2,), "")]
    assert compare(input_specs((torch.zeros(4, 32), 1, torch.zeros(1))), old)[0] == "smaller"


def test_shape_buckets_get_their_own_plans_from_the_profile(link) -> None:
    model, x, y = gpt3()
    plan = moving_plan(model, x, y, link)
    ref = copy.deepcopy(model)
    with pytest.raises(tp.PlannerError, match="not within the planned inputs"):
        tp.run(model, plan, shapes=[(4, 80)], backend=link)
    fast = tp.run(model, plan, shapes=[(BATCH, 32), (BATCH, 48)], backend=link)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    try:
        for k, tokens in enumerate((32, 48, 64, 20)):
            xs, ys = x[:, :tokens], y[:, :tokens]
            got, want = step(fast, params, xs, ys, k), step(ref, ref_params, xs, ys, k)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), tokens
            # the executors share the model: only the one that ran keeps its hooks on it
            idle = [e for e in (fast._main_executor, *fast._bucket_executors.values()) if e is not fast.executor]
            assert not any(e._hooks for e in idle), tokens
            peak = unplanned_step_stats(fast, (xs,), loss_fn=loss_of(ys), repeats=1)["peak_bytes"]
            assert peak <= plan.budget_bytes, (tokens, peak, plan.budget_bytes)
        # made on demand, once per bucket (20 tokens went to the 32-token bucket); 64 tokens: the plan itself
        assert sorted(fast.bucket_plans) == [0, 1]
        for b in fast.bucket_plans.values():
            prof = b.profile
            assert prof["scaled_from"]["how"].startswith("a trace of the model on the meta device")
            assert b.budget_bytes == plan.budget_bytes and b.predicted["peak_bytes"] <= b.budget_bytes
            # activations are smaller at the bucket's shape: the plan moves fewer of them
            assert tp.unplanned_peak(prof) < tp.unplanned_peak(plan.profile)
            moved = b.counts()["swap"] + b.counts()["recompute"]
            assert moved <= plan.counts()["swap"] + plan.counts()["recompute"]
    finally:
        fast.close()


def test_a_scaled_profile_is_near_the_profile_measured_at_that_shape() -> None:
    """The bucket plans' profiles: scaled from 64 to 32 tokens, the unplanned peak and the lower
    bound are within 15% of those of a profile measured at 32 tokens (the units' transients and
    times follow their activations, an estimate)."""
    model, x, y = gpt3()
    at64 = tp.plan(model, x, budget=2**40, loss_fn=loss_of(y), method="retain", repeats=1).profile
    at32 = tp.plan(model, x[:, :32].contiguous(), budget=2**40, loss_fn=loss_of(y), method="retain", repeats=1).profile
    scaled = scaled_profile(at64, model, input_specs((x,)), input_specs((x[:, :32],)))
    assert scaled["memory"]["inputs"] == at32["memory"]["inputs"] and scaled["batch_size"] == BATCH
    assert [u["act_bytes"] for u in scaled["units"]] != [u["act_bytes"] for u in at64["units"]]
    for f in (tp.unplanned_peak, tp.lower_bound):
        assert abs(f(scaled) - f(at32)) <= 0.15 * f(at32), (f.__name__, f(scaled), f(at32))
