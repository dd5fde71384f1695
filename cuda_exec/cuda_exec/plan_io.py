"""Reading plans: the Plan format's fields the executor runs (docs/formats.md)."""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["ACTIONS", "PLAN_VERSION", "PlanLike", "read_plan", "read_swap_deadlines", "read_state_swaps",
           "read_unstarted_swaps", "read_in_flight_swaps", "read_segment_starts", "run_starts", "plan_mapping"]

ACTIONS = ("retain", "swap", "recompute")
#: the newest plan version the executor runs (2: parameters and optimizer state swapped across
#: iterations, ``state_swaps``)
PLAN_VERSION = 2

PlanLike = Union[Mapping[str, Any], Sequence[str], Any]


def _action_name(a: Any) -> str:
    if isinstance(a, str):
        name = a
    else:
        name = getattr(a, "value", None) or getattr(a, "name", None) or str(a)
    name = str(name).lower()
    if name not in ACTIONS:
        raise ValueError(f"unknown action {a!r}; expected one of {ACTIONS}")
    return name


def read_plan(plan: PlanLike) -> Tuple[List[str], List[Tuple[int, int]], Optional[List[str]]]:
    """``(actions, prefetch, unit_names)`` from a plan.

    Accepts a Plan-format dict (docs/formats.md), an object with ``actions`` / ``prefetch`` /
    ``units`` attributes (or a ``to_dict()`` method), a path to a plan JSON file, or a plain list
    of actions (no prefetch schedule, no name check)."""
    if isinstance(plan, (str, os.PathLike)) and str(plan).endswith(".json"):
        with open(plan) as f:
            plan = json.load(f)
    if isinstance(plan, Mapping):
        if plan.get("format", "tensorplace.plan") != "tensorplace.plan":
            raise ValueError(f"not a tensorplace plan: format {plan.get('format')!r}")
        if int(plan.get("version", 1)) > PLAN_VERSION:
            raise ValueError(f"plan version {plan.get('version')} is newer than this executor ({PLAN_VERSION})")
        actions, prefetch, names = plan["actions"], plan.get("prefetch", []), plan.get("units")
    elif isinstance(plan, (list, tuple)):
        actions, prefetch, names = plan, [], None
    elif hasattr(plan, "actions"):
        actions, prefetch, names = plan.actions, getattr(plan, "prefetch", []), getattr(plan, "units", None)
    elif hasattr(plan, "to_dict"):
        return read_plan(plan.to_dict())
    else:
        raise TypeError(f"cannot read a plan from {type(plan).__name__}")
    acts = [_action_name(a) for a in actions]
    pf: List[Tuple[int, int]] = []
    for p in prefetch or []:
        if isinstance(p, Mapping):
            pf.append((int(p["unit"]), int(p["issue_at_backward_of"])))
        elif hasattr(p, "unit"):
            pf.append((int(p.unit), int(p.issue_at_backward_of)))
        else:
            u, s = p
            pf.append((int(u), int(s)))
    if names is not None:
        names = [n if isinstance(n, str) else getattr(n, "name", str(n)) for n in names]
        if len(names) != len(acts):
            raise ValueError(f"plan has {len(names)} unit names but {len(acts)} actions")
    return acts, pf, names


def plan_mapping(plan: PlanLike) -> Optional[Mapping[str, Any]]:
    if isinstance(plan, (str, os.PathLike)) and str(plan).endswith(".json"):
        with open(plan) as f:
            plan = json.load(f)
    if hasattr(plan, "to_dict") and not isinstance(plan, Mapping):
        plan = plan.to_dict()
    return plan if isinstance(plan, Mapping) else None


def read_swap_deadlines(plan: PlanLike) -> List[Tuple[str, int]]:
    """``[(stage_label, unit)]``: the swap-outs a plan says have completed before each stage."""
    data = plan_mapping(plan)
    if data is None:
        return []
    return [(str(d["before"]), int(d["unit"])) for d in data.get("swap_deadlines", []) or []]


def _read_units(plan: PlanLike, key: str) -> List[int]:
    data = plan_mapping(plan)
    return [int(u) for u in (data.get(key) or [])] if data is not None else []


def read_unstarted_swaps(plan: PlanLike) -> List[int]:
    """Swapped units whose swap-out the plan's cost model cancels before its copy starts (their
    prefetch or first backward use comes first): the executor never starts that copy."""
    return _read_units(plan, "unstarted_swaps")


def read_in_flight_swaps(plan: PlanLike) -> List[int]:
    """Swapped units whose swap-out the plan's cost model cancels while its copy runs: the
    executor lets the copy run and keeps the device bytes for the backward (no copy back)."""
    return _read_units(plan, "in_flight_swaps")


def read_state_swaps(plan: PlanLike) -> Optional[Mapping[str, Any]]:
    """A plan's ``state_swaps`` (parameters and optimizer state kept on the host between optimizer
    steps, state_swap.py), or None when it swaps none."""
    data = plan_mapping(plan)
    spec = None if data is None else data.get("state_swaps")
    if not spec or not (spec.get("parameters") or spec.get("optimizer_state")):
        return None
    return spec


def read_segment_starts(plan: PlanLike) -> List[int]:
    """The units before which a plan splits runs of recomputed units (its checkpoint segments)."""
    data = plan_mapping(plan)
    if data is None:
        return []
    return [int(u) for u in data.get("segment_starts", []) or []]


def run_starts(actions: Sequence[str], segment_starts: Iterable[int] = ()) -> List[int]:
    """Per unit, the first unit of its checkpoint segment: the run of consecutive recomputed
    units that contains it, split before every unit in ``segment_starts`` (the unit itself when it
    is not recomputed). A segment is replayed as one: a value one of its units produces and a
    later unit of it reads is regenerated, never held; what it reads from other segments'
    recomputed units is held from the forward, as torch.utils.checkpoint holds its inputs."""
    starts = set(segment_starts)
    out: List[int] = []
    for i, a in enumerate(actions):
        joins = i > 0 and i not in starts and a == "recompute" and actions[i - 1] == "recompute"
        out.append(out[i - 1] if joins else i)
    return out

