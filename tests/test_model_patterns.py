"""Patterns of user models outside the zoo (python/tensorplace/zoo.py): each trains under searched
plans at two budgets and under swap-all and recompute-all, bitwise equal to the unplanned step and
within the plan's budget and predicted peak (tensorplace.bench.budgets.check_model)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorplace.bench.budgets import check_model, row_ok

W = 16


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class FunctionInGlue(nn.Module):
    """A custom autograd Function outside any module (its unit is never recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.w, self.out = nn.Linear(W, W), nn.Parameter(torch.randn(W)), nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(_Scale.apply(self.a(x), self.w)))


class _ScaleModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(x, self.w)


class FunctionInModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.f, self.out = nn.Linear(W, W), _ScaleModule(), nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.f(self.a(x))))


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, 4), nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        h = torch.relu(self.a(x))
        return {"y": self.b(h), "z": self.c(h)}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att, self.norm, self.out = nn.MultiheadAttention(W, 2, batch_first=True), nn.LayerNorm(W), nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.att(x, x, x)
        return self.out(self.norm(x + a))


class TokensAndMask(nn.Module):
    """Token ids and a mask; ``sparse``: the embedding's gradient is a sparse tensor."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb, self.a, self.out = nn.Embedding(30, W, sparse=sparse), nn.Linear(W, W), nn.Linear(W, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(self.emb(ids))) * mask.unsqueeze(-1)
        return self.out(h).mean(1)


class EmaInGlue(nn.Module):
    """An EMA of the features updated in the forward and subtracted (tests/test_module_state.py
    has its replays; here the budget and the bitwise step with the buffer compared too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, 4)
        self.register_buffer("mu", torch.zeros(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.mu.mul_(0.9).add_(0.1 * h.mean(0))
        return self.out(torch.tanh(self.b(h - self.mu)))


class NoGradGlue(nn.Module):
    """A gate computed without gradient in the forward (or, ``detach``, a detached branch), then
    a module used three times."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.shared, self.out = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, 4)
        self.detach = detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.b(x))
        if self.detach:
            h = h + torch.relu(self.a(x)).detach()
        else:
            with torch.no_grad():
                gate = torch.sigmoid(self.a(x))
            h = h * gate
        for _ in range(3):
            h = torch.tanh(self.shared(h))
        return self.out(h)


def _sq(o: Any) -> torch.Tensor:
    return o.square().mean()


CASES: Dict[str, Callable[[], Tuple[nn.Module, Tuple[Any, ...], Callable[[Any], torch.Tensor]]]] = {
    "function_in_glue": lambda: (FunctionInGlue(), (torch.randn(8, W),), _sq),
    "function_in_module": lambda: (FunctionInModule(), (torch.randn(8, W),), _sq),
    "dict_output": lambda: (DictOutput(), (torch.randn(8, W),), lambda o: o["y"].sum() + o["z"].square().sum()),
    "attention": lambda: (Attention(), (torch.randn(2, 5, W),), _sq),
    "tokens_and_mask": lambda: (TokensAndMask(), (torch.randint(0, 30, (4, 6)), torch.ones(4, 6)), _sq),
    "sparse_embedding": lambda: (TokensAndMask(sparse=True), (torch.randint(0, 30, (4, 6)), torch.ones(4, 6)), _sq),
    "ema_in_glue": lambda: (EmaInGlue(), (torch.randn(8, W),), _sq),
    "no_grad_glue": lambda: (NoGradGlue(), (torch.randn(8, W),), _sq),
    "detached_branch": lambda: (NoGradGlue(detach=True), (torch.randn(8, W),), _sq),
}

@pytest.mark.parametrize("name", list(CASES))
def test_a_user_model_pattern_trains_bitwise_within_its_budget(name: str) -> None:
    torch.manual_seed(0)
    model, inputs, loss_fn = CASES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # function_in_glue: its unit cannot be recomputed (said once)
        rows = check_model(model, inputs, loss_fn, fractions=(0.3, 0.7), search=dict(particles=30, iterations=10),
                           fixed=("swap-all", "recompute-all"))
    assert len(rows) == 4
    for r in rows:
        assert row_ok(r), (name, r)  # fits and bitwise, or refused with a smallest budget that is
        if "refused" not in r:
            assert r["measured_peak_bytes"] <= r["predicted_peak_bytes"], (name, r)
