"""Parameters and optimizer state swapped across iterations (TENSILE): the profiler's optimizer
fields, method "tensile" with them, and training under such plans (bitwise equal to training
without, within the predicted peak, nothing lost when something goes wrong)."""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorplace as tp
from cuda_exec.gpu import cuda_available, cuda_status
from cuda_exec.memory import measure_peak, resident_state_bytes
from cuda_exec.state_swap import StateSwapError

OPTIMIZERS: Dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def mlp(seed: int = 0) -> Tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.randn(8, 32)
    y = torch.randint(0, 10, (8,))
    return model, x, lambda out: F.cross_entropy(out, y)


def profile_with(model: nn.Module, x: torch.Tensor, loss_fn: Any, opt: Any) -> tp.Plan:
    """A retain plan of a profile with the optimizer step (the profile rides on the plan)."""
    return tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", optimizer=opt, repeats=1)


def swapping_everything(probe: tp.Plan, actions: Optional[List[str]] = None) -> tp.Plan:
    """``probe``'s model and profile, with every unit's parameters and optimizer state kept on the
    host between steps (the evaluator's schedule)."""
    prof = probe.to_dict()["profile"]
    n = len(prof["units"])
    acts = actions or ["retain"] * n
    units = [u for u in range(n) if prof["units"][u].get("param_bytes")]
    pred = tp.evaluate(prof, acts, 2**40, swap_parameters=units, swap_optimizer_state=units)
    data = dict(probe.to_dict(), version=2, actions=acts, prefetch=pred["prefetch"], swap_deadlines=pred["swap_deadlines"],
                predicted={k: pred[k] for k in probe.predicted if k in pred},
                state_swaps={"parameters": units, "optimizer_state": units, "prefetch": pred["state_prefetch"],
                             "deadlines": pred["state_deadlines"]})
    return tp.Plan(data)


def resident_bytes(model: nn.Module, opt: Any, x: torch.Tensor) -> int:
    return resident_state_bytes(model, opt, x)


def train_alike(model: nn.Module, fast: nn.Module, ref: nn.Module, opt: Any, opt_ref: Any, x: torch.Tensor,
                loss_fn: Any, steps: int, predicted_peak: Optional[int] = None) -> List[int]:
    """``steps`` iterations (forward, backward, step, zero_grad) of the planned model and of the
    reference: losses and gradients bitwise equal at every step, then parameters and optimizer
    state; each planned iteration's measured peak (torch's allocation records plus what was alive
    at its start) within ``predicted_peak``. Returns the measured peaks."""
    peaks = []
    for step in range(steps):
        torch.manual_seed(step)
        loss_ref = loss_fn(ref(x))
        loss_ref.backward()
        grads_ref = [q.grad.clone() for q in ref.parameters()]
        opt_ref.step()
        opt_ref.zero_grad()
        torch.manual_seed(step)
        seen: Dict[str, Any] = {}

        def iteration() -> None:
            loss = loss_fn(fast(x))
            loss.backward()
            seen["loss"] = loss.item()  # (a float32 is exact as a Python float)
            seen["grads"] = [p.grad for p in model.parameters()]  # compared after the measurement
            del loss  # the cost model's optimizer stages count no tensor of the user's
            opt.step()
            opt.zero_grad()

        start = resident_bytes(model, opt, x)
        _, trace = measure_peak(iteration)
        peaks.append(start + trace.peak_bytes)
        assert seen["loss"] == loss_ref.item(), f"step {step}: loss differs"
        assert all(torch.equal(g, r) for g, r in zip(seen["grads"], grads_ref)), f"step {step}: gradients differ"
        # (not the first step: it frees tensors allocated before any measurement, frees torch's
        # profiler does not record, so its running sum overcounts)
        if predicted_peak is not None and step > 0:
            assert peaks[-1] <= predicted_peak, (step, peaks, predicted_peak)
    if hasattr(fast, "executor") and fast.executor.swapper is not None:
        fast.executor.swapper.materialize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, v in opt_ref.state[q].items():
            assert torch.equal(opt.state[p][key], v), f"optimizer state {key} differs"
    return peaks


# ----------------------------------------------------------------------------- the profiler


def test_the_profiler_records_the_optimizer_step_per_unit() -> None:
    model, x, loss_fn = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = profile_with(model, x, loss_fn, opt).to_dict()["profile"]
    assert prof["optimizer"]["name"] == "Adam"
    linears = [u for u in prof["units"] if u["kind"] == "linear"]
    relus = [u for u in prof["units"] if u["kind"] == "activation"]
    params = {name: sum(p.numel() * 4 for p in m.parameters()) for name, m in model.named_children()}
    for u in linears:
        assert u["param_bytes"] == params[u["name"]]
        assert u["optimizer_state_bytes"] == 2 * u["param_bytes"]  # exp_avg, exp_avg_sq (the step counter stays)
        assert u["optimizer_time"] > 0 and u["optimizer_transient_bytes"] >= 0
    assert all(u["param_bytes"] == 0 and u["optimizer_time"] == 0 for u in relus)
    assert sum(u["param_bytes"] for u in prof["units"]) <= prof["memory"]["parameters"]
    assert sum(u["optimizer_state_bytes"] for u in prof["units"]) <= prof["memory"]["optimizer_state"]
    assert not opt.state, "the user's optimizer was stepped"
    assert prof["optimizer"]["step_time"] > 0 and prof["optimizer"]["transient_bytes"] >= 0
    # the step now ends with the optimizer step: in one call, or (swapping) one call per unit
    n = len(prof["units"])
    pred = tp.evaluate(prof, ["retain"] * n, 2**40)
    assert pred["curve"][-1]["stage"] == "opt" and len(pred["curve"]) == 2 * n + 1
    pred = tp.evaluate(prof, ["retain"] * n, 2**40, swap_optimizer_state=[4])
    assert [c["stage"] for c in pred["curve"]][-4:] == ["opt:4", "opt:2", "opt:0", "opt:5"]
    # without an optimizer, a profile has none of the fields
    plain = tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", repeats=1).to_dict()["profile"]
    assert "optimizer" not in plain and all("param_bytes" not in u for u in plain["units"])


def test_sgd_state_is_counted_once_it_exists() -> None:
    model, x, loss_fn = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prof = profile_with(model, x, loss_fn, opt).to_dict()["profile"]
    for u in prof["units"]:
        assert u["optimizer_state_bytes"] == u["param_bytes"]  # momentum buffers
    plain = profile_with(model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1)).to_dict()["profile"]
    assert all(u["optimizer_state_bytes"] == 0 for u in plain["units"])


# ----------------------------------------------------------------------------- planning


def test_tensile_keeps_state_on_the_host_when_activations_cannot_meet_the_budget(tmp_path) -> None:
    model, x, loss_fn = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = profile_with(model, x, loss_fn, opt)
    prof = probe.to_dict()["profile"]
    without = tp.lower_bound(prof)
    smallest = tp._core.smallest_known_budget(json.dumps(prof), state_swaps=True)[0]
    assert tp.lower_bound(prof, state_swaps=True) <= smallest < without
    budget = (smallest + without) // 2
    with pytest.raises(tp.BudgetError):
        probe.replan(budget, method="capuchin")  # activation actions alone cannot
    plan = probe.replan(budget, method="tensile")
    swaps = plan.state_swaps
    assert swaps and (swaps["parameters"] or swaps["optimizer_state"])
    assert plan.predicted["feasible"] and plan.predicted["peak_bytes"] <= budget
    assert plan.to_dict()["version"] == 2 and "on the host" in plan.summary()
    # what no plan can move, for plans that swap across iterations
    fixed = plan.fixed_memory
    assert fixed["lower_bound_bytes"] == tp.lower_bound(prof, state_swaps=True) <= plan.predicted["peak_bytes"]
    assert fixed["movable_bytes"] == sum(u["param_bytes"] + u["optimizer_state_bytes"] for u in prof["units"]) > 0
    # the prediction is the evaluator's for those swaps; the file round-trips
    again = tp.evaluate(prof, plan.actions, budget, swap_parameters=swaps["parameters"],
                        swap_optimizer_state=swaps["optimizer_state"])
    assert again["peak_bytes"] == plan.predicted["peak_bytes"] and again["state_prefetch"] == swaps["prefetch"]
    plan.save(tmp_path / "p.json")
    assert tp.Plan.load(tmp_path / "p.json") == plan
    # a budget activations meet: nothing swapped across iterations, a version-1 plan
    easy = probe.replan(tp.unplanned_peak(prof), method="tensile")
    assert easy.state_swaps is None and easy.to_dict()["version"] == 1


def test_a_budget_below_what_swapping_state_reaches_names_one_tensile_meets() -> None:
    model, x, loss_fn = mlp()
    probe = profile_with(model, x, loss_fn, torch.optim.Adam(model.parameters(), lr=1e-3))
    low = tp.lower_bound(probe.to_dict()["profile"], state_swaps=True)
    for budget in (low // 2, low - 1):
        with pytest.raises(tp.BudgetError) as e:
            probe.replan(budget, method="tensile")
        works = e.value.args[1]
        assert works > budget and str(works) in str(e.value)
        plan = probe.replan(works, method="tensile")
        assert plan.predicted["peak_bytes"] <= works


def test_the_evaluator_refuses_swaps_the_profile_cannot_make() -> None:
    model, x, loss_fn = mlp()
    plain = tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", repeats=1).to_dict()["profile"]
    n = len(plain["units"])
    with pytest.raises(tp.PlannerError, match="no optimizer step"):
        tp.evaluate(plain, ["retain"] * n, 2**40, swap_parameters=[0])
    prof = profile_with(model, x, loss_fn, torch.optim.Adam(model.parameters())).to_dict()["profile"]
    with pytest.raises(tp.PlannerError, match="unit 1 has no parameters"):
        tp.evaluate(prof, ["retain"] * n, 2**40, swap_parameters=[1])


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_with_everything_on_the_host_between_steps_is_bitwise_equal(name: str) -> None:
    model, x, loss_fn = mlp()
    ref = copy.deepcopy(model)
    make = OPTIMIZERS[name]
    opt, opt_ref = make(model.parameters()), make(ref.parameters())
    plan = swapping_everything(profile_with(model, x, loss_fn, opt), ["retain", "recompute", "swap", "retain", "retain"])
    fast = tp.run(model, plan, optimizer=opt)
    peaks = train_alike(model, fast, ref, opt, opt_ref, x, loss_fn, 4, plan.predicted["peak_bytes"])
    # between steps only the inputs (and one-element placeholders) stay on the device
    fast.executor.swapper.start_step()
    assert resident_bytes(model, opt, x) < x.untyped_storage().nbytes() + 64
    fast.close()
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())
    assert "step" not in opt.__dict__  # the optimizer's own step is back
    print(f"\n{name}: measured peaks {peaks}, predicted {plan.predicted['peak_bytes']}")


def test_a_tensile_plan_trains_bitwise_within_its_budget() -> None:
    model, x, loss_fn = mlp()
    ref = copy.deepcopy(model)
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    probe = profile_with(model, x, loss_fn, opt)
    prof = probe.to_dict()["profile"]
    smallest = tp._core.smallest_known_budget(json.dumps(prof), state_swaps=True)[0]
    budget = (smallest + tp.lower_bound(prof)) // 2
    plan = probe.replan(budget, method="tensile")
    assert plan.state_swaps
    fast = tp.run(model, plan, optimizer=opt)
    train_alike(model, fast, ref, opt, opt_ref, x, loss_fn, 3, budget)
    fast.close()


def test_torch_accounting_sees_parameters_and_state_leave_and_come_back() -> None:
    model, x, loss_fn = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    plan = swapping_everything(profile_with(model, x, loss_fn, opt))
    fast = tp.run(model, plan, optimizer=opt)
    loss_fn(fast(x)).backward()
    opt.step()  # creates the state, then sends parameters and state to the host
    opt.zero_grad()
    params = sum(p.numel() * 4 for p in model.parameters())

    def forward_backward() -> None:
        loss_fn(fast(x)).backward()

    _, fb = measure_peak(forward_backward)
    assert fb.final_bytes >= 2 * params  # parameters back, and their gradients

    _, st = measure_peak(opt.step)
    # the step let go of every parameter (and the state it fetched); gradients are freed later
    assert st.final_bytes <= -params
    opt.zero_grad()
    fast.close()


def test_reading_the_model_or_the_optimizer_between_steps_brings_them_back() -> None:
    model, x, loss_fn = mlp()
    ref = copy.deepcopy(model)
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    fast = tp.run(model, swapping_everything(profile_with(model, x, loss_fn, opt)), optimizer=opt)
    for m, o in ((fast, opt), (ref, opt_ref)):
        loss_fn(m(x)).backward()
        o.step()
        o.zero_grad()
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], sd_ref[k]) for k in sd_ref)
    osd, osd_ref = opt.state_dict(), opt_ref.state_dict()
    assert all(torch.equal(osd["state"][i][k], v) for i, s in osd_ref["state"].items() for k, v in s.items())
    # eval mode runs the model on its real parameters
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(fast(x), ref(x))
    model.train()
    ref.train()
    # so does a forward of the model itself, outside the planned module
    fast.executor.swapper.start_step()
    assert torch.equal(model(x), ref(x))
    # loading a checkpoint writes into the real tensors, and training goes on alike
    model.load_state_dict(sd_ref)
    opt.load_state_dict(copy.deepcopy(osd_ref))  # (the optimizer would share the tensors otherwise)
    fast.executor.swapper.start_step()
    train_alike(model, fast, ref, opt, opt_ref, x, loss_fn, 2)
    fast.close()


def test_steps_without_a_forward_between_them_and_schedulers_work() -> None:
    model, x, loss_fn = mlp()
    ref = copy.deepcopy(model)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fast = tp.run(model, swapping_everything(profile_with(model, x, loss_fn, opt)), optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=1, gamma=0.5)
    calls: List[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for m, o, s in ((fast, opt, sched), (ref, opt_ref, sched_ref)):
            loss_fn(m(x)).backward()
            o.step()
            o.step()  # a second step on the same gradients: parameters and state come back first
            o.zero_grad()
            s.step()
    assert calls == [1, 1]  # hooks run once per step, not once per chunk
    train_alike(model, fast, ref, opt, opt_ref, x, loss_fn, 2)
    fast.close()


def test_misuse_is_refused_or_fails_loudly_and_nothing_is_lost() -> None:
    model, x, loss_fn = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    plan = swapping_everything(profile_with(model, x, loss_fn, opt))
    with pytest.raises(StateSwapError, match="optimizer=opt"):
        tp.run(model, plan)
    fast = tp.run(model, plan, optimizer=opt)
    loss_fn(fast(x)).backward()
    with pytest.raises(StateSwapError, match="closure"):
        opt.step(lambda: loss_fn(model(x)))
    opt.step()
    opt.zero_grad()
    # the optimizer's own step, bypassing the plan, cannot silently update placeholders
    with pytest.raises(RuntimeError):
        loss_fn(fast(x)).backward()
        type(opt).step(opt)
    opt.zero_grad()
    fast.executor.swapper.materialize()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    # a forward that fails halfway leaves every tensor on the device or in the host tier
    fast.executor.swapper.start_step()

    def fail(*_: Any) -> None:
        raise RuntimeError("unit 2 failed")

    hook = model[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="unit 2 failed"):
        fast(x)
    hook.remove()
    assert fast.executor.swapper._host, "nothing was on the host when the forward failed"
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())  # (brings them back)
    # the next step starts as the plan says: everything on the host first
    loss_fn(fast(x)).backward()
    opt.step()
    opt.zero_grad()
    assert resident_bytes(model, opt, x) < x.untyped_storage().nbytes() + 64
    fast.close()


@pytest.mark.skipif(not cuda_available(), reason=cuda_status())
def test_on_a_gpu_training_with_state_on_the_host_matches() -> None:
    model, x, loss_fn = mlp()
    model, x = model.cuda(), x.cuda()
    y = torch.randint(0, 10, (8,), device="cuda")
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    ref = copy.deepcopy(model)
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    fast = tp.run(model, swapping_everything(profile_with(model, x, loss_fn, opt)), optimizer=opt)
    for _ in range(3):
        for m, o in ((fast, opt), (ref, opt_ref)):
            loss_fn(m(x)).backward()
            o.step()
            o.zero_grad()
    fast.executor.swapper.materialize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    fast.close()
