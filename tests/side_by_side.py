"""Training under a plan against training without it, step by step (the first test of any
executor change: docs say bitwise on CPU for deterministic models)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def assert_trains_alike(model: nn.Module, fast: nn.Module, ref: nn.Module, x: Any,
                        loss_fn: Callable[[Any], torch.Tensor],
                        make_opt: Callable[[Any], torch.optim.Optimizer], steps: int, label: str = "") -> None:
    """``steps`` training steps of ``fast`` (``model`` under a plan) and of ``ref`` (a copy of
    ``model`` from before), each seeded alike: the losses, every gradient, then the parameters
    and the buffers (BatchNorm statistics) are bitwise equal. ``make_opt(parameters)``."""
    opt, opt_ref = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(steps):
        torch.manual_seed(step)
        loss_ref = loss_fn(ref(x))
        loss_ref.backward()
        torch.manual_seed(step)
        loss = loss_fn(fast(x))
        loss.backward()
        assert torch.equal(loss, loss_ref), f"{label} step {step}: loss {loss.item()} != {loss_ref.item()}"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"{label} step {step}: gradient of {n} differs"
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{label}: parameter {n} differs"
    for (n, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), f"{label}: buffer {n} (BatchNorm statistics) differs"
