"""The executor's errors and what one planned step did (:class:`StepStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["CompiledPathError", "PlanMismatchError", "StepAbortedError", "ReplayError", "StepStats"]


class CompiledPathError(RuntimeError):
    """``torch.compile`` of a module that only runs eagerly (``tensorplace.run``): its
    saved-tensor hooks and per-step Python cannot be traced."""


class PlanMismatchError(RuntimeError):
    """The model's unit sequence in this step does not match the plan (data-dependent control
    flow, another model, or other unit choices)."""


class StepAbortedError(RuntimeError):
    """A saved tensor of an aborted step was needed."""


class ReplayError(RuntimeError):
    """A recomputed unit could not be replayed exactly. ``unit``: the unit whose own segment cannot
    be replayed, whatever the plan (None: not known, or not a property of the unit)."""

    def __init__(self, *args: object, unit: Optional[int] = None) -> None:
        super().__init__(*args)
        self.unit = unit


@dataclass
class StepStats:
    """What one planned step did (filled in during forward and backward)."""

    units: int = 0
    swap_storages: int = 0  #: storages swapped (offloaded, or kept: unstarted_swaps)
    swap_bytes: int = 0  #: bytes offloaded
    #: swapped storages never copied out: their swap-out is cancelled before it starts in the plan
    unstarted_swaps: int = 0
    #: swapped storages copied out but used in place (their swap-out is cancelled while it runs)
    in_flight_swaps: int = 0
    #: swapped storages of a steady step that took the lean path (inline_swap.py)
    lean_swaps: int = 0
    dropped_tensors: int = 0  #: saved tensors dropped for recomputation
    replays: int = 0  #: units replayed
    segment_replays: int = 0  #: replays (a checkpoint segment is replayed as one)
    replay_s: float = 0.0  #: time spent replaying
    fetch_s: float = 0.0  #: time spent in fetches (waiting for late copies included)
    #: host time spent at swap deadlines (the swap-outs the plan says are done before a stage):
    #: the whole wait on CPU, only the calls that queue a device-side wait on CUDA
    deadline_wait_s: float = 0.0
    deadline_waits: int = 0  #: swap-outs waited for at their deadline
    prefetches: int = 0  #: prefetches issued by the schedule
    prefetch_stages: List[int] = field(default_factory=list)  #: backward stages that issued, in order
    unscheduled_fetches: int = 0  #: swapped storages fetched without a scheduled prefetch
    held_bytes: int = 0  #: bytes held for replays (held inputs and protective copies)
    #: recomputed unit -> {forward stage: bytes of the unit's dropped tensors (storages, each once)
    #: that the forward itself still held at the start of that stage} (they leave the device only
    #: when the forward lets go of them); the last entry is the end of the forward
    dropped_alive: Dict[int, Dict[int, int]] = field(default_factory=dict)
    #: recomputed unit -> {value id (as the units' ``held_values``): (bytes, the last forward stage
    #: whose start found it still held)}, for the dropped tensors that some unit reads
    dropped_alive_values: Dict[int, Dict[int, Tuple[int, int]]] = field(default_factory=dict)
    #: recomputed unit -> bytes of its dropped tensors (storages, each once): where they add up to
    #: its activations, ``dropped_alive`` says how long the forward references all of them
    dropped_bytes: Dict[int, int] = field(default_factory=dict)
    aborted: bool = False

