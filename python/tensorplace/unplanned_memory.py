"""Memory the plan does not know of, caught at the first planned steps.

A plan counts a fixed amount of memory as on the device for the whole step: its profile's
constant memory (parameters and buffers, optimizer state when ``plan(..., optimizer=opt)`` was
given, the example inputs, kernel workspaces). Anything else on the device when a step starts
raises the step's peak by as much: the state of an optimizer the plan was not told of (Adam's
two moments are twice the parameters; created at its first ``step()``, after the first planned
step), tensors the user keeps (the last step's output, a copy of the weights).

At the start of each of the first planned training steps, ``run()``'s module compares

- what is allocated: on CUDA ``torch.cuda.memory_allocated``; on the CPU, where torch keeps no
  count outside its profiler, the bytes of the model's parameters and buffers, the inputs, and
  the state of the optimizers over the model's parameters (found among the live objects);
- plus the state those optimizers will create at their first ``step()`` and have not yet
  (measured by a step of a throwaway optimizer of the same class and settings on one- and
  two-element tensors: per element and fixed bytes);
- less the gradients already there (the plan counts every gradient; they stay between steps
  under gradient accumulation)

with the plan's constant memory. More than a MiB (or 1% of the budget) over it is reported once,
with the bytes, whether the plan's predicted peak plus them is still within the budget, and the
fix: plan with the optimizer (``tensorplace.plan(model, inputs, budget, optimizer=opt)``), or
leave room for the extra bytes (``plan.replan(budget - extra)``). With ``run(...,
hard_cap=True)`` (a budget that must hold: a shared GPU, a memory fraction) the step raises
``BudgetError`` instead when the budget would not hold.
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._core import BudgetError
from .budget import format_bytes

__all__ = ["UnplannedMemoryWarning", "UnplannedMemoryCheck"]

MiB = 2**20
#: planned steps at whose start the memory is compared
STEPS_CHECKED = 3


class UnplannedMemoryWarning(RuntimeWarning):
    """A planned step started with device memory its plan does not count."""


def _storages_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total


def optimizers_of(model: nn.Module) -> List[Any]:
    """The live ``torch.optim.Optimizer`` objects that update any of ``model``'s parameters."""
    ids = {id(p) for p in model.parameters()}
    found = []
    for obj in gc.get_objects():
        try:  # type(), not isinstance(): no __class__ property of a proxy object runs (and warns)
            if issubclass(type(obj), torch.optim.Optimizer) and any(
                    id(p) in ids for g in obj.param_groups for p in g.get("params", ())):
                found.append(obj)
        except Exception:  # noqa: BLE001 - an object whose isinstance or groups misbehave
            continue
    return found


def _probe(optimizer: Any, group: Dict[str, Any], like: torch.Tensor, n: int) -> Optional[int]:
    """State bytes one step of a throwaway optimizer like ``optimizer`` creates for an ``n``
    element parameter of ``like``'s dtype and device; None if it cannot be run."""
    q = nn.Parameter(torch.zeros(n, dtype=like.dtype, device=like.device))
    q.grad = torch.zeros_like(q)
    options = {k: v for k, v in group.items() if k != "params"}
    try:
        try:
            probe = type(optimizer)([dict(options, params=[q])], **getattr(optimizer, "defaults", {}))
        except TypeError:  # a constructor that does not take its defaults back as keywords
            probe = type(optimizer)([dict(options, params=[q])])
        probe.step()
    except Exception:  # noqa: BLE001 - any failure: we cannot tell
        return None
    return _storages_bytes([v for v in probe.state.get(q, {}).values() if isinstance(v, torch.Tensor)])


def optimizer_state_bytes(optimizer: Any) -> Tuple[int, int]:
    """(bytes of the state ``optimizer`` holds, bytes it will create at its next ``step()`` for
    the parameters that have none yet)."""
    held: List[torch.Tensor] = []
    coming = 0
    rates: Dict[Tuple[int, Any, Any], Optional[Tuple[int, int]]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state.get(p)
            if state:
                held.extend(v for v in state.values() if isinstance(v, torch.Tensor))
                continue
            key = (gi, p.dtype, p.device)
            if key not in rates:
                one, two = _probe(optimizer, group, p, 1), _probe(optimizer, group, p, 2)
                rates[key] = None if one is None or two is None else (two - one, 2 * one - two)
            rate = rates[key]
            if rate is not None:
                per_element, fixed = rate
                coming += max(0, per_element * p.numel() + fixed)
    return _storages_bytes(held), coming


class UnplannedMemoryCheck:
    """The check of the module docstring, for one ``run()`` module: ``at_step_start(args)`` at
    the start of each planned training step (it does its work at the first ``STEPS_CHECKED``)."""

    def __init__(self, model: nn.Module, plan: Dict[str, Any], hard_cap: bool = False) -> None:
        self.model = model
        self.hard_cap = bool(hard_cap)
        profile = plan.get("profile") or {}
        self.constant = {k: int(v) for k, v in (profile.get("memory") or {}).items()}
        self.budget = int(plan["budget_bytes"])
        self.predicted_peak = int((plan.get("predicted") or {}).get("peak_bytes", 0))
        fixed = plan.get("fixed_memory") or {}
        self.lower_bound: Optional[int] = int(fixed["lower_bound_bytes"]) if "lower_bound_bytes" in fixed else None
        self.left = STEPS_CHECKED if profile.get("memory") is not None else 0
        self.reported = False
        self._optimizers: Optional[List[Any]] = None  # weak references, found once
        #: what the latest check found (bytes), for tests and the curious
        self.last: Dict[str, int] = {}

    def tolerance(self) -> int:
        return max(MiB, self.budget // 100)

    def _optimizer_list(self) -> List[Any]:
        if self._optimizers is None:
            self._optimizers = [weakref.ref(o) for o in optimizers_of(self.model)]
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def measure(self, args: Sequence[Any]) -> Dict[str, int]:
        """What the step starts with, by the module docstring's accounting."""
        params = list(self.model.parameters()) + list(self.model.buffers())
        device = params[0].device if params else torch.device("cpu")
        grads = _storages_bytes([p.grad for p in self.model.parameters() if p.grad is not None])
        held = coming = 0
        names = []
        for opt in self._optimizer_list():
            h, c = optimizer_state_bytes(opt)
            held, coming = held + h, coming + c
            names.append(type(opt).__name__)
        if device.type == "cuda":
            allocated = int(torch.cuda.memory_allocated(device))
        else:
            allocated = _storages_bytes(params + [a for a in args if isinstance(a, torch.Tensor)]) + held + grads
        extra = allocated + coming - grads - sum(self.constant.values())
        self.last = {"allocated": allocated, "optimizer_state": held, "optimizer_state_coming": coming,
                     "gradients": grads, "constant": sum(self.constant.values()), "extra": extra}
        self._names = names
        return self.last

    def at_step_start(self, args: Sequence[Any]) -> None:
        if self.left <= 0 or self.reported:
            return
        self.left -= 1
        m = self.measure(args)
        extra = m["extra"]
        if extra <= self.tolerance():
            return
        self.reported = True
        total = self.predicted_peak + extra
        holds = total <= self.budget
        planned_state = self.constant.get("optimizer_state", 0)
        state = m["optimizer_state"] + m["optimizer_state_coming"]
        opt_extra = max(0, min(extra, state - planned_state))
        other = extra - opt_extra
        parts = []
        if opt_extra:
            parts.append(
                f"optimizer state ({', '.join(sorted(set(self._names)))}): {format_bytes(opt_extra)} more than the plan "
                f"counts ({format_bytes(planned_state)}; {format_bytes(m['optimizer_state'])} held now, "
                f"{format_bytes(m['optimizer_state_coming'])} created at its first step())")
        if other > self.tolerance():
            parts.append(f"other tensors: {format_bytes(other)} (kept from an earlier step, or by your code)")
        fixes = []
        if opt_extra:
            fixes.append("plan with the optimizer, tensorplace.plan(model, inputs, budget, optimizer=opt), so that its "
                         "state is memory the plan counts")
        if other > self.tolerance():
            fixes.append("let go of tensors kept from an earlier step before the next (its output, a loss that holds "
                         "its graph)")
        if self.lower_bound is not None and self.budget - extra < self.lower_bound:
            fixes.append(f"no plan of this profile fits these bytes beside the step in {format_bytes(self.budget)} "
                         f"(none peaks below {format_bytes(self.lower_bound)}): the budget needs at least "
                         f"{format_bytes(self.lower_bound + extra)}")
        else:
            fixes.append(f"leave room for them: plan.replan({self.budget - extra}) (the budget less "
                         f"{format_bytes(extra)})")
        msg = (
            f"tensorplace: this planned step starts with {format_bytes(extra)} of device memory its plan does not "
            f"count (the plan counts {format_bytes(m['constant'])} as constant: "
            + (", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.constant.items() if v) or "none")
            + "): " + "; ".join(parts or [f"{format_bytes(extra)} of tensors"])
            + f". The plan's predicted peak {format_bytes(self.predicted_peak)} plus these bytes is "
            f"{format_bytes(total)}, {'within' if holds else 'over'} its budget of {format_bytes(self.budget)}. "
            "Fix: " + "; or ".join(fixes) + "."
        )
        if self.hard_cap and not holds:
            raise BudgetError(msg + " (hard_cap=True: the step is not run)", int(math.ceil(total)))
        warnings.warn(msg, UnplannedMemoryWarning, stacklevel=5)
