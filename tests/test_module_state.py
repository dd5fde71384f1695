"""Recomputed units whose forward writes into buffers it then reads.

A replay runs a unit's forward again. Where that forward updates a buffer and then uses it (an
EMA in the forward, spectral_norm's power iteration in its forward pre-hook), a replay from the
buffer's updated value regenerates other tensors than the forward saved: the gradients were
silently wrong; so were a buffer read by a unit and updated later in the forward. The executor
now keeps such buffers' values at the unit's first access and replays from them
(units.replay_start_state); BatchNorm's running statistics, written but never read in training,
are only put back. Each case trains three SGD steps under a plan and without one, and
compares losses, gradients, parameters and buffers bitwise, on both replay paths: a tracked
segment (glue between unit modules) and an aligned one (glue inside a block's forward).
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import nn

from cuda_exec.cpu_backend import CpuBackend
from cuda_exec.executor import PlannedModule
from cuda_exec.units import UnitTracker

SN = nn.utils.spectral_norm


class EmaGlue(nn.Module):
    """An EMA of the features, updated in the forward's glue, then subtracted."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("mu", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.training:
            with torch.no_grad():
                self.mu.mul_(0.9).add_(0.1 * h.mean(0))
        return self.c(torch.tanh(self.b(h - self.mu)))


class SpectralNorm(nn.Module):
    """spectral_norm'd layers: power iteration in each module's own forward pre-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = SN(nn.Linear(16, 16)), SN(nn.Linear(16, 16)), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Block(nn.Module):
    """Both inside one block's forward (the steady step replays it from its module call)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = SN(nn.Linear(16, 16)), nn.Linear(16, 16)
        self.register_buffer("mu", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.mu.mul_(0.9).add_(0.1 * h.mean(0))
        return torch.tanh(self.b(h - self.mu)) + x


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class WrittenLater(nn.Module):
    """A buffer read in one unit's glue (by an op that does not save it) and updated in place in a
    later unit's: the first unit's replay must read it as its forward did."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("shift", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) + self.shift
        out = torch.relu(self.b(h))
        with torch.no_grad():
            self.shift.mul_(0.9).add_(0.1 * out.mean(0))
        return self.c(out)


class ShiftedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) + shift


class BlockReadsLater(nn.Module):
    """A block reads its parent's buffer, passed as an argument, which the parent's glue updates
    after the block: the replay reads the old value, and the buffer is the new one again after."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.b, self.c = ShiftedBlock(), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("shift", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.b(self.block(x, self.shift)))
        with torch.no_grad():
            self.shift.mul_(0.9).add_(0.1 * out.mean(0))
        return self.c(out)


class OwnShiftBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.register_buffer("shift", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) + self.shift


class ParentWritesLater(nn.Module):
    """A block reads its own buffer; its parent updates it after the block (the block is
    replayed from its module call: the buffer is put back to the old value for the replay and to
    the new one after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.b, self.c = OwnShiftBlock(), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.b(self.block(x)))
        with torch.no_grad():
            self.block.shift.mul_(0.9).add_(0.1 * out.mean(0))
        return self.c(out)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.n(self.a(x))))


MODELS: Dict[str, Callable[[], nn.Module]] = {"ema_glue": EmaGlue, "spectral_norm": SpectralNorm, "blocks": Blocks,
                                              "written_later": WrittenLater, "block_reads_later": BlockReadsLater,
                                              "parent_writes_later": ParentWritesLater, "batchnorm": WithBatchNorm}


def _units(model: nn.Module, x: torch.Tensor) -> int:
    tracker = UnitTracker(copy.deepcopy(model))
    with tracker:
        tracker.model(x)
    return len(tracker.records)


def _plans(n: int) -> List[List[str]]:
    return [["recompute"] * n] + [["recompute" if i == j else "retain" for i in range(n)] for j in range(n)] + \
        [["recompute" if i % 2 else "swap" for i in range(n)]]


def _train(model: nn.Module, step_model: nn.Module, x: torch.Tensor, steps: int = 3) -> List[Tuple[torch.Tensor, ...]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step_model(x).square().mean()
        loss.backward()
        seen.append((loss.detach().clone(),) + tuple(p.grad.clone() for p in model.parameters()))
        opt.step()
    seen.append(tuple(t.detach().clone() for t in list(model.parameters()) + list(model.buffers())))
    return seen


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recomputing_a_unit_that_reads_the_buffers_it_writes_trains_bitwise(name: str) -> None:
    torch.manual_seed(0)
    base, x = MODELS[name](), torch.randn(8, 16)
    n = _units(base, x)
    ref_model = copy.deepcopy(base)
    reference = _train(ref_model, ref_model, x)
    for plan in _plans(n):
        model = copy.deepcopy(base)
        planned = PlannedModule(model, plan, backend=CpuBackend())
        try:
            got = _train(model, planned, x)
            stats = planned.last_stats
            program = planned.executor._program
        finally:
            planned.close()
        assert stats.replays > 0 or plan != ["recompute"] * n, plan
        if plan == ["recompute"] * n:  # the steady steps replay the model's (or blocks') calls
            assert program.segments and not any(program.tracked)
        if name == "block_reads_later" and plan[:2] == ["recompute", "retain"]:
            # the block's call gets the buffer as an argument, which the forward writes later: the
            # segment is tracked (replayed from the old value), not replayed from its call (which
            # refused to run: "an input was modified in place after the segment read it")
            assert not program.segments and program.tracked[0]
        if name == "parent_writes_later" and plan[:2] == ["recompute", "retain"]:  # the block's call
            assert [type(c.module).__name__ for s in program.segments for c in s.calls] == ["OwnShiftBlock"]
        if name in ("ema_glue", "spectral_norm", "written_later") and plan[:2] == ["recompute", "retain"]:  # tracked
            assert not program.segments and program.tracked[0]
        for a, b in zip(got, reference):
            assert all(torch.equal(s, t) for s, t in zip(a, b)), (name, plan)


@pytest.mark.filterwarnings("ignore:tensorplace DELTA")  # the budget of 1 byte, said every step
@pytest.mark.parametrize("name", ["ema_glue", "spectral_norm", "blocks", "written_later", "parent_writes_later"])
def test_deltas_replays_start_from_the_forwards_buffers_too(name: str) -> None:
    """DELTA's runtime policy, at a budget it cannot meet and with copies too slow to choose,
    recomputes what it releases: its replays start from the same values."""
    import tensorplace as tp

    torch.manual_seed(0)
    base, x = MODELS[name](), torch.randn(64, 16)
    ref_model = copy.deepcopy(base)
    reference = _train(ref_model, ref_model, x)
    model = copy.deepcopy(base)
    fast = tp.run(model, tp.delta(1, bandwidth=(1e4, 1e4)))
    try:
        got = _train(model, fast, x)
        assert fast.last_stats.replays > 0
    finally:
        fast.close()
    for a, b in zip(got, reference):
        assert all(torch.equal(s, t) for s, t in zip(a, b)), name
