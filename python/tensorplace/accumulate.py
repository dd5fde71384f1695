"""Training a moDNN plan: one full batch as ``accumulation_steps`` sub-batches, gradients
accumulated (docs/methods.md, "moDNN").

``tensorplace.run(model, plan)`` accepts the plan's sub-batches; :func:`accumulate` checks the
full batch against the plan, splits it and runs each sub-batch under the plan's unit actions::

    plan = tp.plan(model, x, budget, loss_fn=lambda out: F.cross_entropy(out, y), method="modnn")
    planned = tp.run(model, plan)
    loss = tp.accumulate(planned, x, lambda out, yb: F.cross_entropy(out, yb), plan, targets=y)
    opt.step(); opt.zero_grad()

Gradients equal full-batch training up to floating-point rounding (the sum is taken in another
order) for losses that are a mean (or a sum) over samples; BatchNorm statistics (and anything
else computed across the batch) are computed per sub-batch, so they differ.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from ._core import PlannerError
from .planning import Plan


def _split(values: Tuple[Any, ...], batch: int, sub: int, what: str) -> Sequence[Tuple[Any, ...]]:
    for v in values:
        if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != batch):
            shape = tuple(v.shape)
            raise PlannerError(
                f"{what} of shape {shape}: the plan splits a batch of {batch} samples along dimension 0 into "
                f"sub-batches of {sub}; give the full batch the plan was made for, with the samples in dimension 0 "
                "(targets flattened to (batch * length,) too: keep them (batch, length) and flatten in loss_fn)"
            )
    return [
        tuple(v.narrow(0, start, sub) if isinstance(v, torch.Tensor) else v for v in values)
        for start in range(0, batch, sub)
    ]


def accumulate(
    planned: nn.Module,
    inputs: Any,
    loss_fn: Callable[..., torch.Tensor],
    plan: Plan,
    *,
    targets: Any = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """One training step's forward and backward of the full batch ``inputs`` (a tensor or a tuple
    of forward arguments) as ``plan.settings["accumulation_steps"]`` sub-batches under ``plan``;
    the gradients accumulate in the model's ``.grad``. Returns the full batch's loss (detached).

    ``planned``: ``tensorplace.run(model, plan)`` (or a ``cuda_exec`` ``PlannedModule``).
    ``loss_fn(output, *target_chunk)``: the loss of one sub-batch (``targets``, a tensor or a
    tuple, is split like the inputs; without it, ``loss_fn(output)``). ``reduction``: "mean"
    when the loss averages over samples (each sub-batch's loss is divided by the number of
    sub-batches, so the gradients are those of the full batch's mean), "sum" when it sums.
    A plan of another method (no sub-batches) runs the batch as one.
    """
    if reduction not in ("mean", "sum"):
        raise PlannerError(f'reduction {reduction!r}: use "mean" (loss averaged over samples) or "sum"')
    settings = plan.settings
    steps = int(settings.get("accumulation_steps", 1))
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    tgts = () if targets is None else (tuple(targets) if isinstance(targets, (tuple, list)) else (targets,))
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if first is None:
        raise PlannerError("accumulate() needs a tensor input with a batch dimension (dimension 0)")
    batch = int(settings.get("batch_size", first.shape[0]))
    if batch % steps:
        raise PlannerError(f"the plan's batch of {batch} does not split into {steps} equal sub-batches; re-plan")
    sub = batch // steps
    chunks = _split(args, batch, sub, "inputs")
    tchunks = _split(tgts, batch, sub, "targets") if tgts else [()] * len(chunks)

    # run()'s module takes the plan's sub-batches; the full batch is checked against the plan here
    check = getattr(planned, "check_inputs", None)
    if check is not None:
        check(args)
    scale = 1.0 / steps if reduction == "mean" else 1.0
    total: Optional[torch.Tensor] = None
    for chunk, tchunk in zip(chunks, tchunks):
        out = planned(*chunk)
        loss = loss_fn(out, *tchunk) * scale
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total
