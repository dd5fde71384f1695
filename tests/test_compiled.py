"""The compiled engine (python/tensorplace/compiled_engine.py): a plan run through torch's selective
checkpointing, eagerly (bitwise equal to the unplanned step) and under torch.compile; and
torch.compile of the eager executor refused with an error that names the compiled engine."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import tensorplace as tp
from tensorplace.compiled_engine import compiled_offload_supported, eager_saves, find_regions, _OpRecord
from tensorplace.models import TinyGPT


def _gpt(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, heads=4, layers=3, block=16, dropout=dropout)


def _gpt_input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 64, (2, 16))


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        y += x  # an in-place op on a value the block computed (as torchvision's ResNet blocks)
        return self.relu(y)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*[_Block(8) for _ in range(3)])
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _steps(module: nn.Module, params_of: nn.Module, x: torch.Tensor, steps: int = 2):
    """Losses and gradients of `steps` training steps (SGD between them, so later steps see
    changed weights), and the final parameters and buffers."""
    opt = torch.optim.SGD(params_of.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(module(x))
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in params_of.parameters()]))
        opt.step()
    state = [t.detach().clone() for t in list(params_of.parameters()) + list(params_of.buffers())]
    return out, state


def _assert_bitwise(a, b) -> None:
    (steps_a, state_a), (steps_b, state_b) = a, b
    for (la, ga), (lb, gb) in zip(steps_a, steps_b):
        assert torch.equal(la, lb)
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert all(torch.equal(x, y) for x, y in zip(state_a, state_b))


def _assert_close(a, b) -> None:
    """Compiled steps: losses, gradients and final state equal within float tolerance (fusion may
    reorder arithmetic)."""
    (steps_a, state_a), (steps_b, state_b) = a, b
    for (la, ga), (lb, gb) in zip(steps_a, steps_b):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    for x, y in zip(state_a, state_b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def _plan(model: nn.Module, x: torch.Tensor, method: str) -> tp.Plan:
    return tp.plan(copy.deepcopy(model), x, budget=1 << 40, loss_fn=_loss, method=method, repeats=1)


def _wrap(model: nn.Module, plan) -> "tp.CompiledPlan":
    """tp.compiled(model, plan), its warnings about units outside the regions ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # units outside the blocks run as retained
        return tp.compiled(model, plan)


def test_find_regions_takes_the_repeated_blocks():
    assert find_regions(_gpt()) == ["blocks.0", "blocks.1", "blocks.2"]
    assert find_regions(_Net()) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("method", ["recompute-all", "checkpoint-blocks"])
def test_eager_runs_train_bitwise_equal_to_the_unplanned_step(method):
    """GPT with dropout (random ops saved), and a conv net with BatchNorm (its running statistics
    must be updated once) and an in-place add on a block's own value: three steps each, the later
    ones under the learned corrections."""
    for make, x in ((lambda: _gpt(dropout=0.1), _gpt_input()), (_Net, torch.randn(2, 3, 8, 8))):
        reference = make()
        torch.manual_seed(5)
        want = _steps(reference, reference, x, steps=3)
        model = make()
        plan = _plan(model, x, method)
        assert plan.counts()["recompute"] > 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # units outside the blocks run as retained
            wrapper = tp.compiled(model, plan)
        try:
            torch.manual_seed(5)
            got = _steps(wrapper, model, x, steps=3)
        finally:
            wrapper.close()
        _assert_bitwise(want, got)
        # the regions were checkpointed with a plan: some op of each is recomputed after the first call
        assert wrapper._tables and any(not all(t) for t in wrapper._tables.values())
        # close() gives the model back its own forward
        assert all("forward" not in m.__dict__ for _, m in model.named_modules())


def test_eager_saves_keeps_an_in_place_group_and_outside_writes():
    # op 0 makes storage 10; op 1 modifies it in place; op 2 reads it; op 3 writes storage 99 (from
    # outside the region, e.g. BatchNorm's running mean)
    ops = [_OpRecord(None, [1], [], [10]), _OpRecord(None, [10], [10], [10]), _OpRecord(None, [10], [], [11]),
           _OpRecord(None, [11, 99], [99], [12])]
    # the plan recomputes everything but op 1: op 0 joins op 1's saved group; op 3 writes outside
    assert eager_saves(ops, [False, True, False, False]) == [True, True, False, True]
    # a saved producer whose value a reader reads before the last in-place write: the reader is saved
    ops = [_OpRecord(None, [1], [], [10]), _OpRecord(None, [10], [], [11]), _OpRecord(None, [10], [10], [10])]
    assert eager_saves(ops, [True, False, False]) == [True, True, True]


def test_swaps_run_as_retained_with_a_warning_where_torch_has_no_compiled_offload(monkeypatch):
    import tensorplace.compiled_engine as ce

    monkeypatch.setattr(ce, "compiled_offload_supported", lambda: False)
    model = _gpt()
    x = _gpt_input()
    plan = _plan(model, x, "swap-all")
    with pytest.warns(RuntimeWarning, match="swapped units run as retained"):
        wrapper = tp.compiled(model, plan)
    try:
        assert wrapper.swaps_as_retain == [u for u, a in zip(plan.units, plan.actions) if a == "swap"]
        assert set(wrapper.actions) == {"retain"} and not wrapper.offloads
    finally:
        wrapper.close()


@pytest.mark.skipif(not compiled_offload_supported(), reason="this torch has no activation-offloading pass")
def test_compiled_swaps_go_to_torchs_activation_offloading(monkeypatch):
    """A swap plan, compiled: the ops of swapped units are offloaded by torch's activation-offloading
    pass (on a CPU the copies are to the same device; the graph is the one CUDA gets), the values
    equal the compiled unplanned step's, and closing the wrapper puts torch's settings back."""
    import torch._functorch.config as fc
    import torch._inductor.config as ic
    from torch._functorch._activation_offloading import activation_offloading as ao

    offloaded = []
    choose = ao.choose_offload_sets

    def recording(fwd_module, *args, **kwargs):
        ok = choose(fwd_module, *args, **kwargs)
        offloaded.extend(n.name for n in fwd_module.graph.nodes if n.meta.get("saved_for_offloading"))
        return ok

    monkeypatch.setattr(ao, "choose_offload_sets", recording)
    model = _gpt()
    x = _gpt_input()
    plan = _plan(model, x, "swap-all")
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    want, want_state = _steps(torch.compile(reference), reference, x, steps=1)
    before = (fc.enable_activation_offloading, ic.joint_custom_pre_pass)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the embeddings and head lie outside the blocks
        wrapper = tp.compiled(model, plan)
    try:
        assert wrapper.offloads and wrapper.swaps_as_retain == []
        assert fc.enable_activation_offloading
        _loss(wrapper(x)).backward()  # an eager step first (a plan checked, then compiled)
        for p in model.parameters():
            p.grad = None
        torch._dynamo.reset()
        got, got_state = _steps(torch.compile(wrapper), model, x, steps=1)
        # torch traced the policy's tags (torch 2.11 asks it outside torch.compiler.is_compiling())
        assert wrapper.traced_policies.get("MUST_CPU_OFFLOAD", 0) > 0, wrapper.traced_policies
    finally:
        wrapper.close()
        torch._dynamo.reset()
    assert (fc.enable_activation_offloading, ic.joint_custom_pre_pass) == before
    assert len(offloaded) >= 3, offloaded  # at least one value of each of the three blocks
    _assert_close((want, want_state), (got, got_state))


def test_a_plan_of_another_model_is_refused():
    plan = _plan(_gpt(), _gpt_input(), "recompute-all")
    with pytest.raises(tp.PlannerError, match="another model"):
        tp.compiled(_Net(), plan)


def test_torch_compile_of_the_eager_executor_names_the_compiled_engine():
    model = _gpt()
    x = _gpt_input()
    plan = _plan(model, x, "recompute-all")
    reference = copy.deepcopy(model)
    run = tp.run(model, plan)
    try:
        with pytest.raises(tp.CompiledPathError, match=r"tensorplace\.compiled\(model, plan\)"):
            _loss(torch.compile(run)(x)).backward()
        torch._dynamo.reset()
        # nothing was lost: the same module trains eagerly, equal to the unplanned step
        _assert_bitwise(_steps(reference, reference, x), _steps(run, model, x))
    finally:
        run.close()


@pytest.mark.slow
def test_torch_compile_of_the_wrapper_trains_as_the_compiled_unplanned_step():
    """Compiled: the plan's recomputations are torch's partitioner's, so values agree with the
    compiled unplanned step within float tolerance (fusion may reorder arithmetic)."""
    model = _gpt()
    x = _gpt_input()
    plan = _plan(model, x, "recompute-all")
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    want, want_state = _steps(torch.compile(reference), reference, x)
    wrapper = _wrap(model, plan)
    try:
        torch._dynamo.reset()
        got, got_state = _steps(torch.compile(wrapper), model, x)
        assert wrapper.traced_policies.get("MUST_RECOMPUTE", 0) > 0, wrapper.traced_policies
    finally:
        wrapper.close()
        torch._dynamo.reset()
    _assert_close((want, want_state), (got, got_state))


def test_a_plan_without_swaps_for_the_compiled_engine():
    """plan(..., swaps=False): PSO plans with retain and recompute only, which the compiled engine
    runs as planned inside its regions (no swap-as-retain warning), bitwise equal eagerly."""
    model = _gpt()
    x = _gpt_input()
    retained = _plan(model, x, "retain")
    lb, up = tp.lower_bound(retained.profile), retained.predicted["peak_bytes"]
    plan = tp.plan(copy.deepcopy(model), x, budget=int(lb + 0.6 * (up - lb)), loss_fn=_loss, swaps=False, repeats=1,
                   particles=20, iterations=5)
    assert plan.counts()["swap"] == 0 and plan.counts()["recompute"] > 0
    assert plan.settings["swaps"] is False
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        inside = [u for u, a in zip(plan.units, plan.actions) if a == "recompute" and u.startswith("blocks.")]
        if len(inside) < plan.counts()["recompute"]:
            warnings.simplefilter("ignore", RuntimeWarning)  # recomputed units outside the blocks run retained
        wrapper = tp.compiled(model, plan)
    try:
        assert wrapper.swaps_as_retain == []
        _assert_bitwise(_steps(reference, reference, x), _steps(wrapper, model, x))
    finally:
        wrapper.close()
    with pytest.raises(tp.PlannerError, match="swaps=False applies to method='pso'"):
        tp.plan_profile(plan.profile, plan.budget_bytes, "swap-all", swaps=False)


def test_a_wrapped_model_is_not_profiled_planned_or_wrapped_again():
    """While a wrapper lives, the model's blocks run its policy: tp.plan, tp.run and a second
    tp.compiled of the model (or of a deep copy of it) are refused with the fix; after close()
    they work."""
    model = _gpt()
    x = _gpt_input()
    plan = _plan(model, x, "recompute-all")
    wrapper = _wrap(model, plan)
    try:
        for call in (lambda m: tp.plan(m, x, budget=1 << 40, loss_fn=_loss, method="retain", repeats=1),
                     lambda m: tp.run(m, plan), lambda m: tp.compiled(m, plan)):
            for m in (model, copy.deepcopy(model)):
                with pytest.raises(tp.PlannerError, match=r"wrapped by tensorplace\.compiled.*close\(\)"):
                    call(m)
    finally:
        wrapper.close()
    run = tp.run(model, plan)
    run.close()


class _TwiceBlock(nn.Module):
    """A block that calls one module twice (as torchvision's BasicBlock calls its relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.b(self.relu(self.a(x)))) + x


class _TwiceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(_TwiceBlock(), _TwiceBlock())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def test_a_module_called_twice_is_two_units_of_the_plan():
    """tp.plan names a module's second call `name#1`; the engine used to refuse such a plan as one
    of another model (every torchvision ResNet's plan)."""
    x = torch.randn(2, 8)
    model, reference = _TwiceNet(), _TwiceNet()
    plan = _plan(model, x, "recompute-all")
    assert "blocks.0.relu#1" in plan.units
    data = plan.to_dict()
    # the first call of each relu recomputed, the second retained: each call gets its own action
    data["actions"] = ["recompute" if not u.endswith("#1") else "retain" for u in plan.units]
    wrapper = _wrap(model, tp.Plan(data))
    try:
        reg = wrapper.regions[0]
        assert reg.index[("blocks.0.relu", 0)] == plan.units.index("blocks.0.relu")
        assert reg.index[("blocks.0.relu", 1)] == plan.units.index("blocks.0.relu#1")
        _assert_bitwise(_steps(reference, reference, x, steps=3), _steps(wrapper, model, x, steps=3))
        assert any(not all(t) for t in wrapper._tables.values())
    finally:
        wrapper.close()


def test_calling_the_model_itself_after_wrapping_applies_the_plan():
    """The regions' forward is replaced on the model, so a user may go on calling the model: each
    call is a new forward (its region calls counted from the start), not a first call every step
    that saves everything and learns another table."""
    model, x = _gpt(), _gpt_input()
    reference = copy.deepcopy(model)
    plan = _plan(model, x, "recompute-all")
    wrapper = _wrap(model, plan)
    try:
        _assert_bitwise(_steps(reference, reference, x, steps=4), _steps(model, model, x, steps=4))
        assert len(wrapper._tables) == len(wrapper.regions) == 3
        assert any(not all(t) for t in wrapper._tables.values())
    finally:
        wrapper.close()


def test_a_region_whose_modules_change_mode_learns_again():
    """BatchNorm frozen (eval) after the first step, as in fine-tuning: the region's ops change,
    which the engine refused ('ran another sequence of ops'); now the modes are part of what a
    learned table is kept for. Bitwise equal to the unplanned model frozen at the same step."""
    x = torch.randn(2, 3, 8, 8)
    model, reference = _Net(), _Net()
    plan = _plan(model, x, "recompute-all")
    wrapper = _wrap(model, plan)
    try:
        got, want = [], []
        for step in range(3):
            if step == 1:
                for m in (model, reference):
                    for bn in m.modules():
                        if isinstance(bn, nn.BatchNorm2d):
                            bn.eval()
            want.append(_steps(reference, reference, x, steps=1))
            got.append(_steps(wrapper, model, x, steps=1))
        for w, g in zip(want, got):
            _assert_bitwise(w, g)
        assert len(wrapper._tables) == 2 * len(wrapper.regions)  # one table per region and mode
    finally:
        wrapper.close()


@pytest.mark.parametrize("bad", [42, None, 3.5])
def test_a_plan_that_is_not_one_is_named(bad):
    with pytest.raises(TypeError, match="plan must be a tensorplace.Plan, its dict or the path of a plan file"):
        tp.compiled(_gpt(), bad)


def test_two_forwards_in_one_autocast_block_train_bitwise_without_its_weight_cache():
    """Autocast's cache of cast weights makes a second forward in one autocast block run fewer ops
    than its region's recompute, which torch's selective checkpointing cannot match (docs/compiled.md);
    with `cache_enabled=False` (on the unplanned model too) such steps train bitwise equal."""
    model, x = _gpt(), _gpt_input()
    reference = copy.deepcopy(model)
    plan = _plan(model, x, "recompute-all")
    wrapper = _wrap(model, plan)

    def steps(module: nn.Module, params_of: nn.Module, second: torch.Tensor):
        out = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = _loss(module(x)) + _loss(module(second))
            loss.backward()
            out.append((loss.detach().clone(), [p.grad.clone() for p in params_of.parameters()]))
            params_of.zero_grad(set_to_none=True)
        return out, []

    try:
        for second in (x.flip(1), x[:1]):  # the same shapes, and another batch
            _assert_bitwise(steps(reference, reference, second), steps(wrapper, model, second))
        assert any(not all(t) for t in wrapper._tables.values())
    finally:
        wrapper.close()


def test_backward_twice_through_retained_regions_and_learning_calls():
    """`loss.backward(retain_graph=True)` then `loss.backward()`: torch's checkpoint keeps saved
    values for one backward only, so a region runs outside it where nothing is recomputed (its
    learning call, and every call of a region whose units are all retained): bitwise equal to the
    unplanned model, gradients summed over the two backwards."""
    x = torch.randn(2, 3, 8, 8)
    for method in ("retain", "recompute-all"):
        model, reference = _Net(), _Net()
        plan = _plan(model, x, method)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            wrapper = tp.compiled(model, plan)
        try:
            steps = 1 if method == "recompute-all" else 3  # a planned call's checkpoint allows one backward
            for module, params_of in ((reference, reference), (wrapper, model)):
                grads = []
                for _ in range(steps):
                    loss = _loss(module(x))
                    loss.backward(retain_graph=True)
                    loss.backward()
                    grads.append([p.grad.clone() for p in params_of.parameters()])
                    params_of.zero_grad(set_to_none=True)
                if module is reference:
                    want = grads
            for a, b in zip(want, grads):
                assert all(torch.equal(p, q) for p, q in zip(a, b))
            assert all(r.retained for r in wrapper.regions) == (method == "retain")
        finally:
            wrapper.close()


class _LstmBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.lstm(x)[0])


@pytest.mark.slow
def test_a_graph_break_inside_a_region_is_reported():
    """Dynamo does not trace an nn.LSTM: the compiled step runs its regions' checkpoint eagerly,
    every op saved, which the engine now says instead of leaving the plan silently unapplied."""
    torch.manual_seed(0)
    model = nn.Sequential(_LstmBlock(), _LstmBlock(), nn.Linear(8, 2))
    x = torch.randn(2, 4, 8)
    plan = _plan(model, x, "recompute-all")
    wrapper = _wrap(model, plan)
    try:
        torch._dynamo.reset()
        with pytest.warns(RuntimeWarning, match="ran eagerly inside a compiled step"):
            _loss(torch.compile(wrapper)(x)).backward()
    finally:
        wrapper.close()
        torch._dynamo.reset()
