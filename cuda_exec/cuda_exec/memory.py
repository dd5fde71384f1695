"""Device memory as torch's own allocator accounts it: the peak of one step.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's
allocators as a kineto ``[memory]`` event with a signed size (``nbytes``). Summing them in time
order gives the bytes allocated since the profiler started; its maximum is the step's peak above
what was allocated before (parameters, inputs, and anything else alive when it started). This sees
allocations inside ops, unlike ``function_events``, which fold them into the op.

On CPU it counts torch's CPU allocator (not numpy or mmap host buffers); on CUDA, the caching
allocator's allocations (``device="cuda"``).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["MemoryTrace", "memory_trace", "measure_peak", "resident_state_bytes"]


@dataclass
class MemoryTrace:
    peak_bytes: int  #: largest running total of allocated bytes since the start (>= 0)
    final_bytes: int  #: allocated minus freed at the end
    allocated_bytes: int  #: sum of all allocations
    events: int  #: number of allocation and free events
    #: (time in ns since the first event, running total) after every event
    timeline: List[Tuple[int, int]] = field(default_factory=list, repr=False)


def _device_matches(event: Any, device: str) -> bool:
    name = str(event.device_type()).lower()  # e.g. "devicetype.cpu"
    return name.endswith("." + device) or name == device


def memory_trace(prof: profile, device: str = "cpu", keep_timeline: bool = False) -> MemoryTrace:
    """The allocation trace of a finished ``torch.profiler.profile(profile_memory=True)``."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None  # type: ignore[union-attr]
    if results is None:
        raise RuntimeError("the profiler has no results (was profile_memory=True and did it stop?)")
    events = [e for e in results.events() if e.name() == "[memory]" and _device_matches(e, device)]
    events.sort(key=lambda e: e.start_ns())  # stable: keeps the record order of equal timestamps
    total = peak = allocated = 0
    timeline: List[Tuple[int, int]] = []
    t0 = events[0].start_ns() if events else 0
    for e in events:
        n = int(e.nbytes())
        total += n
        if n > 0:
            allocated += n
        if total > peak:
            peak = total
        if keep_timeline:
            timeline.append((e.start_ns() - t0, total))
    return MemoryTrace(peak, total, allocated, len(events), timeline)


@contextlib.contextmanager
def memory_profile(activities: List[ProfilerActivity]) -> Iterator[profile]:
    """``torch.profiler.profile(profile_memory=True)``, one cycle, without the warning torch 2.11
    prints the first time a profiler starts ("Profiler clears events at the end of each cycle":
    there is one cycle here)."""
    prof = profile(activities=activities, profile_memory=True, record_shapes=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        prof.__enter__()
    try:
        yield prof
    finally:
        prof.__exit__(*sys.exc_info())


def measure_peak(
    fn: Callable[..., Any], *args: Any, device: str = "cpu", keep_timeline: bool = False, **kwargs: Any
) -> Tuple[Any, MemoryTrace]:
    """Run ``fn(*args, **kwargs)`` under the profiler; return its result and the memory trace.

    Let go of the result before the next measurement if it holds tensors. For CUDA the function
    synchronises the device before the profiler stops."""
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with memory_profile(activities) as prof:
        result = fn(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    return result, memory_trace(prof, device, keep_timeline)


def resident_state_bytes(model: torch.nn.Module, optimizer: Any = None, inputs: Any = ()) -> int:
    """Bytes of the storages (each once) of ``model``'s parameters and buffers, ``optimizer``'s
    state and the ``inputs`` tensors on the device now: what a measured training iteration starts
    with, beside ``measure_peak``'s peak above it. A tensor kept in the host tier between steps
    (cuda_exec.state_swap) is a placeholder (one element, expanded) and is not counted."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if optimizer is not None:
        tensors += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (t.numel() > 1 and all(s == 0 for s in t.stride())):
            continue
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total
