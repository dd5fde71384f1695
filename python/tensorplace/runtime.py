"""Runtime policies: methods that decide during the step instead of planning before it.

``tensorplace.delta(budget)`` is DELTA's runtime policy (cuda_exec/cuda_exec/delta_policy.py,
docs/methods.md "DELTA"): ``tensorplace.run(model, tensorplace.delta("2GiB"))`` trains ``model``
with the policy releasing saved tensors online. ``tensorplace.run(model, plan, runtime=True)``
runs the policy with a ``method="delta"`` plan's budget and profile (unit times and bandwidth
from the profile) instead of running the plan's simulated decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from ._core import PlannerError
from .budget import Budget, parse_budget
from .planning import check_counts

__all__ = ["DeltaRuntime", "delta", "delta_from_plan"]


@dataclass(frozen=True)
class DeltaRuntime:
    """The settings of DELTA's runtime policy (see :func:`delta`)."""

    budget_bytes: int
    threshold: float = 0.75
    prefetch_depth: int = 2
    prefetch_lookahead: int = 2
    headroom: int = 0
    bandwidth: Optional[Tuple[float, float]] = None
    unit_times: Dict[str, float] = field(default_factory=dict)
    stage_bytes: Dict[str, int] = field(default_factory=dict)
    constant_bytes: int = 0
    memory_counter: Optional[Callable[[], int]] = None
    not_recomputable: Tuple[str, ...] = ()

    def executor_kwargs(self) -> Dict[str, Any]:
        return dict(threshold=self.threshold, prefetch_depth=self.prefetch_depth,
                    prefetch_lookahead=self.prefetch_lookahead, headroom=self.headroom, bandwidth=self.bandwidth,
                    unit_times=dict(self.unit_times), stage_bytes=dict(self.stage_bytes),
                    constant_bytes=self.constant_bytes, memory_counter=self.memory_counter,
                    not_recomputable=self.not_recomputable)


def delta(
    budget: Budget,
    *,
    threshold: float = 0.75,
    prefetch_depth: int = 2,
    prefetch_lookahead: int = 2,
    headroom: int = 0,
    profile: Optional[Dict[str, Any]] = None,
    bandwidth: Optional[Tuple[float, float]] = None,
    constant_bytes: int = 0,
    memory_counter: Optional[Callable[[], int]] = None,
) -> DeltaRuntime:
    """DELTA's runtime policy under ``budget`` (bytes or "2GiB": the whole step's device memory),
    for ``tensorplace.run(model, tensorplace.delta(budget))``. No plan: during every step the
    executor reads the device memory in use and, above ``threshold`` x budget, releases the saved
    tensor with the largest size x staleness, recomputing it when its unit's replay takes no
    longer than its two copies and swapping it otherwise; swapped tensors come back in backward
    order, at most ``prefetch_depth`` of them ahead of use and each at most ``prefetch_lookahead``
    units before the unit that needs it. The forward's release limit adapts over the steps so
    that the backward (where DELTA releases nothing) stays under ``budget - headroom``; the
    counter does not see the scratch memory inside an op, which ``headroom`` can leave room for.

    ``profile``: a Profile (``tensorplace.profiler.profile_model``, or ``plan.profile``) whose
    units' ``fwd_time`` and copy bandwidths the director uses, and whose units' stage bytes
    (activations, unsaved output, transient peak) the wait for swap-outs before a stage uses, and
    whose units marked ``recomputable: false`` the policy never recomputes; without one, unit
    times are measured in each step's forward and the bandwidth once from the backend. ``bandwidth``: (d2h, h2d) bytes/s, overriding both. ``constant_bytes``: on CPU, bytes the budget counts that
    the executor cannot see (optimizer state). ``memory_counter``: a function returning the device
    bytes in use, replacing the built-in counter (cuda_exec/cuda_exec/live_memory.py)."""
    times: Dict[str, float] = {}
    stage: Dict[str, int] = {}
    fixed: Tuple[str, ...] = ()
    bw = bandwidth
    if profile is not None:
        times = {str(u["name"]): float(u["fwd_time"]) for u in profile.get("units", [])}
        from .profiler import fwd_stage_alloc_bytes

        stage = {str(u["name"]): fwd_stage_alloc_bytes(u) + int(u.get("fwd_transient_bytes", 0))
                 for u in profile.get("units", [])}
        fixed = tuple(str(u["name"]) for u in profile.get("units", []) if u.get("recomputable") is False)
        if bw is None and profile.get("d2h_bandwidth") and profile.get("h2d_bandwidth"):
            bw = (float(profile["d2h_bandwidth"]), float(profile["h2d_bandwidth"]))
    if not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"threshold must be in (0, 1] (DELTA's is 0.75), got {threshold!r}")
    total = parse_budget(budget)
    check_counts(prefetch_depth=prefetch_depth, prefetch_lookahead=prefetch_lookahead, headroom=headroom,
                 constant_bytes=constant_bytes)
    if headroom >= total:
        raise ValueError(f"headroom ({headroom} bytes) leaves nothing of the budget ({total} bytes): give headroom "
                         "well below the budget, a few percent of it for the scratch memory inside ops")
    return DeltaRuntime(total, float(threshold), int(prefetch_depth), int(prefetch_lookahead),
                        int(headroom), bw, times, stage, int(constant_bytes), memory_counter, fixed)


def delta_from_plan(plan: Any, **overrides: Any) -> DeltaRuntime:
    """The runtime policy with a ``method="delta"`` plan's budget and profile."""
    data = plan.to_dict()
    if data.get("method") != "delta":
        raise PlannerError(
            f"runtime=True runs DELTA's runtime policy, but this plan was made by method {data.get('method')!r}; "
            "plan with method='delta', or pass tensorplace.delta(budget) to run() instead of a plan"
        )
    return delta(int(data["budget_bytes"]), profile=data.get("profile"), **overrides)
