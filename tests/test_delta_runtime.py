"""DELTA's runtime policy in the executor (cuda_exec/cuda_exec/delta_policy.py): bitwise-equal
training, the 3/4 threshold, the director's rule, prefetch in backward order, the budget (held or
its excess reported), the live counter, and clean failures."""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
import tensorplace as tp
from cuda_exec.cpu_backend import CpuBackend
from cuda_exec.delta_policy import DeltaBudgetWarning, DeltaModule, DeltaStats
from cuda_exec.live_memory import HeapLiveMemory
from cuda_exec.memory import measure_peak
from side_by_side import assert_trains_alike
from tensorplace.profiler import unplanned_step_stats
from test_executor import MODELS, Boom, FailingCopyBackend, _assert_no_hooks, _assert_released_then_exact, loss_fn, make

torchvision = pytest.importorskip("torchvision")

MiB = 2**20
ALWAYS_OVER = 1 << 62  # a counter that always reads above any budget: every candidate is released


def adam(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=1e-3)


def mlp() -> nn.Sequential:
    """Every unit can be replayed except the in-place ReLU (its input is overwritten)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(inplace=True),
                         nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


class Switch:
    """A counter the test sets: ``value`` bytes in use."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def one_step(fast: nn.Module, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> DeltaStats:
    model.zero_grad(set_to_none=True)
    loss_fn(fast(x), y).backward()
    return fast.last_stats


# ----------------------------------------------------------------------------- bitwise equality


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet18" else n for n in sorted(MODELS)])
@pytest.mark.parametrize("bandwidth", [1.0, 1e18], ids=["recompute", "swap"])
def test_training_bitwise_equal_when_everything_is_released(name: str, bandwidth: float) -> None:
    """A counter always over the budget: every saved tensor leaves the device in the forward
    (recomputed where its unit can be replayed at a low bandwidth, swapped at a high one), and
    training (losses, gradients, parameters, BatchNorm statistics, dropout) is bitwise equal;
    verify mode checks every tensor that comes back."""
    model, x, y = make(name)
    ref = copy.deepcopy(model)
    fast = DeltaModule(model, 1 << 30, memory_counter=lambda: ALWAYS_OVER, bandwidth=(bandwidth, bandwidth),
                       verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaBudgetWarning)
        assert_trains_alike(model, fast, ref, x, lambda out: loss_fn(out, y), adam, 3, name)
    st = fast.last_stats
    actions = {d.action for d in st.decisions}
    assert st.decisions and not st.aborted
    if bandwidth == 1.0:
        assert "recompute" in actions and st.replays > 0
    else:
        assert actions == {"swap"} and st.replays == 0
    fast.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "gpt"])
def test_training_bitwise_equal_under_the_live_counter(name: str) -> None:
    """The real counter and a budget that makes the policy release part of the activations."""
    if name == "resnet18":
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        x, y = torch.randn(4, 3, 96, 96), torch.randint(0, 10, (4,))
    else:
        torch.manual_seed(0)
        model = models.TinyGPT(vocab=128, dim=64, heads=4, layers=2, block=32, dropout=0.1)
        x, y = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4 * 32,))
    base = unplanned_step_stats(model, (x,), loss_fn=lambda out: loss_fn(out, y), repeats=1)
    ref = copy.deepcopy(model)
    fast = tp.run(model, tp.delta(int(base["peak_bytes"] * 0.85)), backend=CpuBackend(bandwidth_cap=2e8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaBudgetWarning)
        assert_trains_alike(model, fast, ref, x, lambda out: loss_fn(out, y), adam, 4, name)
    assert fast.last_stats.decisions
    fast.close()


# ----------------------------------------------------------------------------- the policy's rules


def test_nothing_is_released_at_or_below_three_quarters_of_the_budget() -> None:
    model, x, y = make("inception")
    budget = 100 * MiB
    counter = Switch(budget * 3 // 4)  # exactly at the threshold: not above it
    fast = DeltaModule(model, budget, memory_counter=counter, bandwidth=(1e9, 1e9))
    st = one_step(fast, model, x, y)
    assert st.threshold_bytes == budget * 3 // 4
    assert st.decisions == [] and st.swap_storages == 0 and st.replays == 0 and st.dropped_tensors == 0
    counter.value = budget * 3 // 4 + 1  # one byte above: DELTA's loop releases
    st = one_step(fast, model, x, y)
    assert st.decisions and st.swap_storages == len(st.decisions)
    # the live counter, with a budget the step never comes near: nothing moves either
    live = DeltaModule(model, 1 << 40)
    st = one_step(live, model, x, y)
    assert max(st.forward_counter) < st.threshold_bytes
    assert st.decisions == [] and st.swap_storages == 0 and st.replays == 0
    fast.close()
    live.close()


def test_the_filter_releases_the_largest_size_times_staleness_first() -> None:
    model, x, y = make("resnet18")
    fast = DeltaModule(model, 1 << 30, memory_counter=lambda: ALWAYS_OVER, bandwidth=(1e18, 1e18))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaBudgetWarning)
        st = one_step(fast, model, x, y)
    assert len({d.stage for d in st.decisions}) > 5
    assert sum(d.runner_up >= 0 for d in st.decisions) > 10  # choices among several candidates
    for d in st.decisions:
        assert d.unit < d.stage  # only finished segments
        assert d.nbytes * d.staleness >= d.runner_up  # the largest size x staleness then
    # within a stage the releases come in decreasing score (staleness grows alike for all)
    by_stage: Dict[int, List[Any]] = {}
    for d in st.decisions:
        by_stage.setdefault(d.stage, []).append(d)
    big = [ds for ds in by_stage.values() if len(ds) > 2]
    assert big and any(ds[0].nbytes * ds[0].staleness > ds[-1].nbytes * ds[-1].staleness for ds in big)
    fast.close()


@pytest.mark.parametrize("cap", [1e5, 1e15], ids=["low", "high"])
def test_recompute_or_swap_follows_the_director_rule(cap: float) -> None:
    """The CPU backend's bandwidth cap sets the transfer time: very low, every tensor of a unit
    that can be replayed is recomputed (the in-place ReLU's cannot: swapped); very high,
    everything is swapped."""
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 32), torch.randint(0, 8, (8,))
    backend = CpuBackend(bandwidth_cap=cap)
    fast = DeltaModule(model, 1 << 30, backend, memory_counter=lambda: ALWAYS_OVER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaBudgetWarning)
        assert_trains_alike(model, fast, ref, x, lambda out: loss_fn(out, y), adam, 2, "mlp")
    st = fast.last_stats
    assert st.recomputable == [True, True, True, False, True, True, True]
    # every unit whose saved tensors exist at a later unit's start (GELU 5's output is saved by
    # the last unit, after the last release point)
    assert {d.unit for d in st.decisions} == {0, 1, 3, 4}
    for d in st.decisions:
        assert d.transfer_s == pytest.approx(2 * d.nbytes / cap)
        if cap < 1e6 and d.replay_s is not None:
            assert d.replay_s <= d.transfer_s and d.action == "recompute"
        else:
            assert d.action == "swap"
            assert d.replay_s is None or d.replay_s > d.transfer_s
    assert [d.action for d in st.decisions if d.unit == 3] == ["swap"]
    fast.close()
    backend.close()


def test_swapped_tensors_are_prefetched_in_backward_order() -> None:
    model, x, y = make("inception")
    counter = Switch(ALWAYS_OVER)
    fast = DeltaModule(model, 1 << 30, memory_counter=counter, bandwidth=(1e18, 1e18), prefetch_depth=3)

    def low_after_forward(out: torch.Tensor) -> torch.Tensor:
        counter.value = 0  # the backward has room: every swapped tensor can come back ahead of use
        return loss_fn(out, y)

    model.zero_grad(set_to_none=True)
    counter.value = ALWAYS_OVER
    out = fast(x)
    counter.value = 0
    low_after_forward(out).backward()
    st = fast.last_stats
    needs = [need for _unit, need in st.prefetch_order]
    assert len(needs) == st.swap_storages > 10
    assert needs == sorted(needs, reverse=True)  # the order the backward needs them
    assert st.unscheduled_fetches == 0 and st.prefetches == st.swap_storages
    fast.close()


# ----------------------------------------------------------------------------- the budget


def gpt_case() -> Tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = models.TinyGPT(vocab=128, dim=128, heads=4, layers=3, block=64, dropout=0.1)
    x = torch.randint(0, 128, (8, 64))
    y = torch.randint(0, 128, (8, 64))
    return model, x, lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())


def test_a_stage_waits_for_swap_outs_when_its_profiled_bytes_would_not_fit() -> None:
    """The counter is read between ops, so the growth it saw in a stage misses the transient
    peak inside the stage's ops (an attention's masked_fill and softmax). With a profile the
    wait before a stage also counts the profile's stage bytes: without them the GPT of the
    budget test below went 154 KB over its budget in about one step in seven, whenever its
    swap-outs were still copying when such a stage began."""
    model = mlp()
    x, y = torch.randn(8, 32), torch.randint(0, 8, (8,))
    prof = tp.plan(model, (x,), budget=2**40, loss_fn=lambda out: loss_fn(out, y), method="retain",
                   repeats=1).to_dict()["profile"]
    budget = 1 << 30
    counter = Switch(budget - 1)  # above the release limit and just within the budget: no growth seen
    backend = CpuBackend(bandwidth_cap=1e5)  # the swap-outs are still copying at the next stages
    waits = {}
    for profiled in (False, True):
        policy = tp.delta(budget, profile=prof if profiled else None, bandwidth=(1e18, 1e18), memory_counter=counter)
        fast = tp.run(model, policy, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeltaBudgetWarning)
            st = one_step(fast, model, x, y)
        assert st.decisions and all(d.action == "swap" for d in st.decisions)
        waits[profiled] = st.deadline_waits
        fast.close()
    backend.close()
    assert waits == {False: 0, True: waits[True]} and waits[True] > 0


@pytest.mark.slow
def test_a_budget_the_policy_can_meet_bounds_the_measured_peak() -> None:
    model, x, lf = gpt_case()
    probe = tp.plan(model, x, budget=2**40, loss_fn=lf, method="retain", repeats=1)
    prof = probe.to_dict()["profile"]
    up, lb = tp.unplanned_peak(prof), tp.lower_bound(prof)
    budget = int(lb + 0.5 * (up - lb))
    fast = tp.run(model, tp.delta(budget, profile=prof))
    measured = unplanned_step_stats(fast, (x,), loss_fn=lf, repeats=1, warmup=3)
    st = fast.last_stats
    print(f"\ngpt: budget {budget / MiB:.1f} MiB, unplanned {up / MiB:.1f} MiB; DELTA runtime measured peak "
          f"{measured['peak_bytes'] / MiB:.1f} MiB, counter peak {st.counter_peak_bytes / MiB:.1f} MiB, "
          f"{len(st.decisions)} releases")
    assert st.decisions and st.over_budget_bytes == 0
    assert measured["peak_bytes"] <= budget
    fast.close()


def test_a_budget_below_what_must_stay_completes_and_reports_the_excess() -> None:
    """Half the parameters' bytes: nothing the policy does can meet it. Every step still trains
    exactly; each says by how much it went over, and the module warns once when the steps after
    the first ones (which adapt the release limit) are still over."""
    model, x, y = make("inception")
    ref = copy.deepcopy(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    fast = DeltaModule(model, params // 2)
    with pytest.warns(DeltaBudgetWarning, match="over its budget"):
        assert_trains_alike(model, fast, ref, x, lambda out: loss_fn(out, y), adam, 4, "inception")
    st = fast.last_stats
    assert st.over_budget_bytes == st.counter_peak_bytes - params // 2 > 0
    assert st.threshold_bytes == 0  # the release limit came down to nothing
    fast.close()


def test_the_release_limit_adapts_to_a_backward_over_the_budget() -> None:
    """DELTA releases in the forward only; a backward over the budget lowers the next step's
    release limit by the excess, and that step's forward releases more."""
    model, x, y = make("resnet18")
    counter = Switch(0)
    budget = 100 * MiB
    fast = DeltaModule(model, budget, memory_counter=counter, bandwidth=(1e18, 1e18))
    model.zero_grad(set_to_none=True)
    counter.value = 60 * MiB  # forward: under 3/4
    out = fast(x)
    counter.value = 120 * MiB  # backward: 20 MiB over
    loss_fn(out, y).backward()
    first = fast.last_stats
    assert first.decisions == [] and first.over_budget_bytes == 20 * MiB
    counter.value = 60 * MiB
    out = fast(x)
    second = fast.last_stats
    assert second.threshold_bytes == 75 * MiB - (20 * MiB + budget // 100)
    assert second.threshold_bytes < 60 * MiB and second.decisions  # released now
    del out
    fast.close()


def test_the_cpu_counter_follows_torchs_own_accounting() -> None:
    """At the end of a forward the counter's growth since the start matches the profiler's record
    of torch's allocations within 1% (plus 256 KiB of other heap traffic)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 96, 96)
    counter = HeapLiveMemory()
    model(x).sum().backward()  # warm up the kernels' caches
    model.zero_grad(set_to_none=True)
    gc.collect()

    def forward() -> Tuple[torch.Tensor, int]:
        counter.begin(0)
        out = model(x)
        return out, counter.read()

    (out, grown), trace = measure_peak(forward)
    assert trace.final_bytes > 10 * MiB
    assert abs(grown - trace.final_bytes) <= 0.01 * trace.final_bytes + 256 * 1024, (grown, trace.final_bytes)
    del out


# ----------------------------------------------------------------------------- failures


def released_then_exact(fast: DeltaModule, backend: CpuBackend, model: nn.Module, ref: nn.Module,
                        x: torch.Tensor, y: torch.Tensor) -> None:
    """test_executor's check after a failed step (nothing left, the next steps exact), with the
    always-over counters' budget warnings silenced; closes ``fast`` and ``backend``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaBudgetWarning)
        _assert_released_then_exact(fast, backend, model, ref, x, y)
    backend.close()


def test_an_exception_mid_forward_leaves_nothing_behind() -> None:
    torch.manual_seed(0)
    body = torchvision.models.resnet18(num_classes=10)
    boom = Boom()
    model = nn.Sequential(body.conv1, body.bn1, body.relu, body.layer1, boom, body.layer2,
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    ref = copy.deepcopy(model)
    backend = CpuBackend()
    fast = DeltaModule(model, 1 << 30, backend, memory_counter=lambda: ALWAYS_OVER, bandwidth=(1.0, 1.0))
    boom.exc = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        fast(x)
    assert fast.last_stats.aborted and fast.last_stats.decisions  # it had released tensors
    boom.exc = None
    released_then_exact(fast, backend, model, ref, x, y)


def test_a_failed_copy_aborts_the_step_and_the_next_ones_are_exact() -> None:
    model, x, y = make("inception")
    ref = copy.deepcopy(model)
    backend = FailingCopyBackend(fail_at=3)
    fast = DeltaModule(model, 1 << 30, backend, memory_counter=lambda: ALWAYS_OVER, bandwidth=(1e18, 1e18))
    with pytest.raises(RuntimeError, match="injected"):
        loss_fn(fast(x), y).backward()
    assert fast.last_stats.aborted
    released_then_exact(fast, backend, model, ref, x, y)


def test_an_interrupted_backward_is_freed_by_the_next_forward() -> None:
    model, x, y = make("resnet18")
    ref = copy.deepcopy(model)
    backend = CpuBackend()
    fast = DeltaModule(model, 1 << 30, backend, memory_counter=lambda: ALWAYS_OVER, bandwidth=(1e18, 1e18))
    out = fast(x)
    h = model.layer2[0].conv1.weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("user hook")))
    with pytest.raises(RuntimeError, match="user hook"):
        loss_fn(out, y).backward()
    h.remove()
    assert backend.stats().buffers_in_use > 0
    del out
    released_then_exact(fast, backend, model, ref, x, y)


# ----------------------------------------------------------------------------- the API


def test_run_takes_the_policy_or_a_delta_plan_with_runtime() -> None:
    model, x, y = make("inception")
    fast = tp.run(model, tp.delta("64MiB", threshold=0.5, prefetch_depth=1))
    assert isinstance(fast, DeltaModule)
    ex = fast.executor
    assert (ex.budget, ex.threshold, ex.prefetch_depth) == (64 * MiB, 0.5, 1)
    model.eval()
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))  # eval mode runs the model itself
    assert fast.last_stats is None
    model.train()
    fast.close()
    lf = lambda out: loss_fn(out, y)  # noqa: E731
    plan = tp.plan(model, x, budget=2**40, loss_fn=lf, method="delta", repeats=1)
    rt = tp.run(model, plan, runtime=True)
    assert isinstance(rt, DeltaModule) and rt.executor.budget == plan.budget_bytes
    names = [u["name"] for u in plan.to_dict()["profile"]["units"]]
    assert set(rt.executor.profile_times) == set(names)
    rt.close()
    with pytest.raises(tp.PlannerError, match="method='delta'"):
        tp.run(model, plan.replan(2**40, method="retain"), runtime=True)
    with pytest.raises(ValueError, match="threshold"):
        tp.delta("1GiB", threshold=1.5)
    # refused when the policy is made, not at the first step (or never: a headroom above the budget)
    for bad, match in ((dict(headroom=-5), "headroom must be 0 or more, got -5"),
                       (dict(headroom=2**30), "headroom .* leaves nothing of the budget"),
                       (dict(prefetch_depth=-1), "prefetch_depth must be"), (dict(prefetch_lookahead=1.5), "prefetch_lookahead")):
        with pytest.raises(ValueError, match=match):
            tp.delta("1GiB", **bad)
    _assert_no_hooks(model)


def test_the_policys_calls_into_the_cuda_backend_on_its_emulated_runtime() -> None:
    """The CUDA backend on test_cuda_backend's FakeRuntime (host memory; its copy stream runs
    only when waited on): every tensor swapped, the budget's wait for swap-outs a stream wait
    (no host synchronisation), prefetches in backward order, training bitwise equal, and nothing
    left in the pinned pool."""
    fakes = pytest.importorskip("test_cuda_backend")  # cuda-python's runtime bindings
    from cuda_exec.cuda_backend import CudaBackend

    rt, tt = fakes.FakeRuntime(), fakes.FakeTorch()
    rt.device_alive = tt.alive
    backend = CudaBackend(_runtime=rt, _torch=tt)
    model, x, y = make("inception")
    ref = copy.deepcopy(model)
    counter = Switch(0)
    fast = DeltaModule(model, 1 << 30, backend, memory_counter=counter, bandwidth=(1e18, 1e18))

    class Over(nn.Module):  # the forward over the budget: every tensor leaves, the budget waits
        def forward(self, out: torch.Tensor) -> torch.Tensor:
            counter.value = 0  # the backward has room: prefetches are issued
            return out

    for step in range(2):
        torch.manual_seed(step)
        ref.zero_grad(set_to_none=True)
        loss_fn(ref(x), y).backward()
        torch.manual_seed(step)
        model.zero_grad(set_to_none=True)
        counter.value = ALWAYS_OVER
        out = Over()(fast(x))
        loss_fn(out, y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    st = fast.last_stats
    assert st.swap_storages == len(st.decisions) > 10 and st.deadline_waits > 0
    needs = [need for _unit, need in st.prefetch_order]
    assert needs and needs == sorted(needs, reverse=True)
    assert not any(c in fakes.SYNC_CALLS for c in rt.calls)
    fast.close()
    backend.synchronize()
    assert backend.pool.bytes_in_use == 0
    backend.close()
