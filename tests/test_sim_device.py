"""Whole planned training steps through the CUDA backend on the simulated device
(cuda_exec/cuda_exec/sim_device.py: the cuda-python runtime calls the backend makes, on host
memory, with a clock, streams, events and two copy engines; tensors stay CPU tensors).

What a GPU step would show, checked without one: the planned steps train bitwise equal to the
unplanned ones, the steady steps make no host-blocking runtime call and allocate no pinned memory
(the swap set's buffers are reserved after the learning step), a swap-out cancelled before its copy
was issued never starts one, and the bytes alive in program order (torch's CPU allocator, where the
simulated device's tensors live) stay within the plan's predicted peak.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
from torch import nn

import tensorplace as tp
from cuda_exec.sim_device import ProfileClock, SimDevice, sim_backend
from tensorplace import zoo
from tensorplace.bench.budgets import check_model, row_ok
from tensorplace.profiler import profile_model

WIDTH = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU()) for _ in range(6)],
                         nn.Linear(WIDTH, WIDTH))


def _grads(module: nn.Module, params: List[torch.Tensor], x: torch.Tensor) -> List[torch.Tensor]:
    loss = module(x).sum()
    loss.backward()
    out = [loss.detach()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def _probed() -> Tuple[nn.Module, nn.Module, torch.Tensor, SimDevice, Any, Any]:
    """The stack, a copy of it for reference, an input, a simulated GPU, the CUDA backend on it
    and the stack's all-retain plan (its profile measured there)."""
    model, reference = _model(), _model()
    x = torch.randn(16, WIDTH)
    dev = SimDevice(d2h_bandwidth=25e9, h2d_bandwidth=25e9, copy_engines=2)
    backend = sim_backend(dev)
    try:
        probe = tp.plan(model, x, budget=2**50, loss_fn=lambda out: out.sum(), method="retain", backend=backend,
                        repeats=1)
    except BaseException:
        backend.close()
        raise
    return model, reference, x, dev, backend, probe


@pytest.mark.parametrize("method", ["swap-all", "recompute-all", "pso"])
def test_planned_steps_on_the_simulated_gpu_train_bitwise_without_host_blocking_calls(method: str) -> None:
    model, reference, x, dev, backend, probe = _probed()
    try:
        profile = probe.to_dict()["profile"]
        assert profile["copy_engines"] == 2  # the backend's two copy streams are the model's two queues
        low, high = tp.lower_bound(profile), tp.unplanned_peak(profile)
        budget = 2**50 if method != "pso" else (low + high) // 2
        plan = probe.replan(budget, method=method)
        planned = tp.run(model, plan, backend=backend)
        params = list(model.parameters())
        try:
            with ProfileClock(dev, model, profile) as clock:
                for step in range(3):
                    clock.reset()
                    dev.reset_counters()
                    got = _grads(planned, params, x)
                    want = _grads(reference, list(reference.parameters()), x)
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), (method, step)
                    if step == 0:
                        continue  # the learning step
                    assert not dev.blocking, dict(dev.blocking)
                    assert dev.pinned_allocs == 0
                    stats = planned.last_stats
                    d2h = [c for c in dev.copies if c.direction == "d2h"]
                    h2d = [c for c in dev.copies if c.direction == "h2d"]
                    # every swapped storage is copied out at most once and back at most once;
                    # one whose copy out was cancelled is used in place and copied neither way
                    assert len(d2h) <= stats.swap_storages and len(h2d) <= len(d2h)
                    if method == "swap-all":
                        assert stats.swap_storages > 0 and d2h
                    if plan.counts()["swap"] == 0:
                        assert not dev.copies
        finally:
            planned.close()
    finally:
        backend.close()


def test_a_swapped_stage_starts_at_its_first_unpack_on_the_cuda_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's swaps take the general path (step_state._SwapHandle), whose handles
    carry their backward stage as the lean path's do (steady._unpack_starts): in a stack of
    units with no glue between them, the all-swap plan's stages start at their first unpack with
    no gradient hook, every prefetch is scheduled (none made at the unpack), the stages run in
    order and the step trains bitwise (the zoo's test below checks peaks on this backend)."""
    import cuda_exec.steady as steady

    model, reference, x, dev, backend, probe = _probed()
    try:
        plan = probe.replan(2**50, method="swap-all")
        planned = tp.run(model, plan, backend=backend)
        params = list(model.parameters())
        try:
            _grads(planned, params, x)  # the learning step
            _grads(planned, params, x)
            program = planned.executor._program
            started = program.unpack_started
            assert not any(program.inline) and len(started) == len(planned.executor.prefetch_at) - 1, started
            hooked: List[int] = []
            on_gradient = steady._on_gradient
            monkeypatch.setattr(steady, "_on_gradient",
                                lambda a, fire: (hooked.append(fire.stage), on_gradient(a, fire)))
            got = _grads(planned, params, x)
            for _ in range(2):
                want = _grads(reference, list(reference.parameters()), x)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            stats = planned.last_stats
            assert not set(hooked) & started, hooked
            # (a swap-out the plan cancels, in flight when its stage comes, is used in place)
            assert stats.unscheduled_fetches == 0 and stats.swap_storages > 0
            assert stats.prefetches == stats.swap_storages - stats.in_flight_swaps - stats.unstarted_swaps
            assert stats.prefetch_stages == sorted(stats.prefetch_stages, reverse=True)
            assert started <= set(stats.prefetch_stages)
        finally:
            planned.close()
    finally:
        backend.close()


FAST = ["mobilenet_v2", "transformer_encoder"]


@pytest.mark.parametrize("name", FAST + [pytest.param(n, marks=pytest.mark.slow) for n in zoo.names() if n not in FAST])
def test_budgets_hold_through_the_cuda_backend_on_the_simulated_gpu(name: str) -> None:
    """As tests/test_zoo.py on the CPU backend, for every zoo model (two in the fast tests): at
    three budgets, the measured peak of a planned step is within the plan's budget and its
    predicted peak, and it trains bitwise; so do the all-swap and all-recompute plans. Here the
    swaps go through the CUDA backend's host-side queue, two copy streams and stream-ordered
    frees."""
    model, inputs, loss_fn = zoo.build(name, batch=4)
    dev = SimDevice(d2h_bandwidth=1e9, h2d_bandwidth=1e9)
    backend = sim_backend(dev)
    # the fast models also run vDNN's plan: some units swapped beside retained ones, whatever the
    # search chooses (it weighs swaps by the host costs measured at profiling)
    fixed = ("swap-all", "recompute-all") + (("vdnn@0.5",) if name in FAST else ())
    try:
        rows: List[Any] = check_model(model, inputs, loss_fn, backend=backend,
                                      search={"particles": 20, "iterations": 10}, fixed=fixed)
    finally:
        backend.close()
    assert [r["fraction"] for r in rows[3:]] == [None] * len(fixed)
    assert all(row_ok(r) for r in rows), "; ".join(str(r) for r in rows if not row_ok(r))  # in full
    measured = [r for r in rows if "refused" not in r]
    assert rows[3]["counts"]["swap"] > 0 and rows[4]["counts"]["recompute"] > 0
    if name in FAST:
        assert 0 < rows[5]["counts"]["swap"] < sum(rows[5]["counts"].values())
    assert all(r["measured_peak_bytes"] <= r["predicted_peak_bytes"] for r in measured), rows
    # issue 18: every plan's predicted peak bounds the bytes alive within 2% (densenet's all-swap
    # plan measured 0.89-0.95 of its prediction while the model kept a swapped unit's bytes until
    # its last forward reader, which the profile's forward_held_until now bounds)
    assert all(r["measured_peak_bytes"] >= 0.98 * r["predicted_peak_bytes"] for r in measured), rows


def test_a_lingering_value_a_segment_holds_is_counted_once() -> None:
    """unet keeps its skip tensors in local variables and joins them by torch.cat: under
    all-recompute, a checkpoint segment holds a value (the concatenation dec1 reads) that the
    forward's own code also still references after its producer's last reader. The profile names
    such values (`lingering_values`) and the model counts the storage once: the all-recompute
    step's measured peak is its predicted peak (it was 2.8% below, counted twice)."""
    model, inputs, loss_fn = zoo.build("unet", batch=4)
    backend = sim_backend(SimDevice(d2h_bandwidth=1e9, h2d_bandwidth=1e9))
    try:
        profile = profile_model(model, inputs, loss_fn, backend=backend)
        units = profile["units"]
        named = {i: u["lingering_values"] for i, u in enumerate(units) if "lingering_values" in u}
        read = {(p, v) for u in units for k in ("held_values", "saved_values") for p, v, _ in u[k]}
        assert named and all((i, v) in read for i, vals in named.items() for v, _ in vals), named
        cat = next(i for i, u in enumerate(units) if u["name"] == "up1")  # the cat is up1's glue
        assert sum(b for _, b in named[cat]) == units[cat]["lingering_bytes"]
        rows = check_model(model, inputs, loss_fn, backend=backend, fractions=(), fixed=("recompute-all",))
    finally:
        backend.close()
    (row,) = rows
    assert row_ok(row), row
    assert row["measured_peak_bytes"] == row["predicted_peak_bytes"], row
