"""The profiler: one training step of a model, cut into units and measured (docs/formats.md).

`profile_model(model, example_inputs)` returns a Profile dict (format "tensorplace.profile",
version 1). `unplanned_step_stats(model, example_inputs)` measures plain training steps (peak
and median time) for predicted-versus-measured comparisons.

What one profile call runs, all on the user's model and inputs, in training mode:

1. `warmup - 1` plain steps, then the **structure step** (the last warm-up step, always run):
   the unit tracker of `cuda_exec.units` watches its forward and finds the units (one per
   leaf-module invocation by default), who owns each tensor that autograd saves (by storage and
   version), who reads whose output, and the held inputs.
2. The **memory step**: torch.profiler with `profile_memory=True` records every allocation and
   free of torch's allocator on the model's device with a timestamp; the profiler's hooks drop a
   marker at every stage boundary (see "Stages" below). Memory is the constant memory plus the
   running sum of the signed allocation sizes. The profiler's own op timings are not used.
3. The **timed steps** (`repeats` of each, interleaved): instrumented steps of the plain model
   (perf_counter, CUDA events on a GPU, at every stage boundary) give per-stage times, and
   uninstrumented steps give the step as a user runs it (`measured.step_time`, a median). The
   instrument's own time (its hooks) is taken out by scaling every stage time by the ratio of the
   two medians (`measured.instrumented_step_time` keeps the instrumented one), so the stage times
   add up to the plain step: the cost model charges compute as it is, not the executor's or the
   profiler's bookkeeping.
4. The **replay step**: one step through the executor with every unit recomputed, under the
   memory recorder. The executor drops a marker before and after every replay
   (`cuda_exec.executor.MARK_PREFIX`), so each replay's peak above the memory at its start is
   measured: `replay_transient_bytes` is that peak minus the unit's `act_bytes` (for the units
   the step replays). And the executor reports which dropped tensors the forward's own code still
   held at each stage boundary (`StepStats.dropped_alive`: a local variable of an enclosing
   module keeps a tensor past its last reader): `lingering_bytes` / `lingering_until`. A unit
   whose own replay fails (code after its module the executor cannot record, such as a custom
   autograd Function applied outside a module) is retained and the step run again; the profile
   marks it `recomputable: false`, and no plan recomputes it. If the step fails otherwise, these
   fields are left out, with a warning.
5. The **steady replay step**: the profile's all-recompute plan (`recompute-all`, the default
   segments) trained through the executor for two steps, the second under the memory recorder.
   That step is what a user's steps are: it replays a segment by calling its modules again,
   and the graph of those calls keeps what autograd saved without the executor's hooks (a
   Python number an op wraps into a tensor, `att * 0.125`) until the call ends, which the first
   step's replays, one unit at a time, let go of earlier. Where the memory while a segment
   replays is above the cost model's prediction of that plan at the backward stage where it
   replays, the excess is that stage's `replay_slack_bytes`, which the model adds under every
   replay of the stage. Skipped, with a warning, if the steps fail.
6. **Host costs fitted to the model** (on a CPU through the CPU backend): the all-retain plan's,
   the all-recompute plan's, the first-unit-swapped plan's and the all-swap plan's steady steps,
   each timed between plain steps, raise the executor's calibrated `step`, `drop`, `stage` and
   `swap`/`swap_async` costs where the cost model predicts the plan shorter than measured, and
   lower `step` and `swap`/`swap_async` where it predicts the all-retain or all-swap plan longer
   (`executor`, docs/formats.md).

Every step checks that the model ran the same sequence of units as the structure step: a model
whose unit sequence changes from step to step (data-dependent control flow, random layer drop)
is refused, naming the first unit that differs.

Stages
------
The timeline of a step is cut into stages, the cost model's F0..F(n-1), B(n-1)..B0:

- F(i) runs from unit i's forward pre-hook to unit i+1's forward pre-hook. Functional code
  between two units (a residual `+=`, a flatten) belongs to the unit before it. F(n-1) also
  holds the loss computation (and F0 whatever the model does before its first unit).
- B(i) is the backward of unit i's segment: the autograd nodes created from unit i's forward
  pre-hook to unit i+1's (autograd sequence numbers in that range), i.e. its module call and the
  glue after it, as cuda_exec.units defines a segment. Just before `loss.backward()` the graph is
  walked from the loss and every such node gets a pre-hook; unit i's window runs from the first
  of its nodes starting to the first node of another unit starting. The loss's backward (from
  the backward call to the first window) is a region of its own, before the first window; its
  peak is that unit's `loss_transient_bytes`. AccumulateGrad nodes (no sequence number) belong
  to the window they run in. The autograd engine runs ready nodes in decreasing sequence number,
  so the windows come in the order B(n-1)..B0. A unit with no backward node (an Identity, a unit on a path without
  gradient) gets an empty window: time 0, transient 0.
  (Module full-backward hooks are not used: they wrap inputs and outputs in a custom Function,
  and `ReLU(inplace=True)` after BatchNorm then fails with "Output 0 of BackwardHookFunction is
  a view and is being modified inplace". Node pre-hooks leave the graph as it is.)

Times and memory use the same windows, so within one step the stage times add up to the step
time and every allocation of the step lies in exactly one stage.

In the timed steps the executor's unit tracker hooks the same unit modules (at every forward).
The profiler's forward pre-hook is registered with `prepend=True`, so its stage mark comes first
and the tracker's work at a unit's start (the executor's stage-boundary work) belongs to the
stage that starts there; the executor's setup before the first unit belongs to F0, its work
after the last unit returns (leaving the tracker, hooking the outputs) to F(n-1). In backward
the executor only adds tensor hooks (on the outputs) and saved-tensor unpack hooks, which run
inside the nodes' windows; the profiler's node pre-hooks leave both alone.

Sizes (per unit; the tracker in cuda_exec/units.py measures the structural ones)
---------------------------------------------------------------------------------
- act_bytes, output_bytes, output_saved, read_by, held_input_bytes, saved_inputs, inputs,
  model_inputs, random: from the unit tracker (saved-tensor ownership by storage and version;
  only saved tensors whose graph is still alive when the forward returns;
  `random`: the generators' state changed across the unit's segment). A checkpoint segment with a
  random unit keeps the generators' state for its replay: `rng_state_bytes` of the profile
  (`cuda_exec.executor.replay_state_bytes`: the CPU generator's state on a CPU, device memory
  there; 0 on a GPU).
- replay_transient_bytes, lingering_bytes, lingering_until, forward_held_until: from the replay step.
- grad_bytes: bytes of the gradients of the unit's own parameters (`recurse=False` for a leaf
  unit, all parameters of a coarser unit; shared parameters counted once). A module invoked more
  than once: the gradient is allocated by the backward that runs first, i.e. by the invocation
  with the largest index (later backwards accumulate into it), so it is charged there and the
  other invocations get 0. The measured stages agree: the accumulation's temporary shows up as
  bwd transient of the earlier invocations. A parameter of no unit module (an `nn.Parameter`
  used in glue) is charged to the backward window in which its gradient is accumulated; one that
  gets no gradient in the step (frozen, or in a module the forward does not call) to none.
- fwd_transient_bytes / bwd_transient_bytes: the measured peak of the stage minus what the cost
  model's all-retain walk (docs/cost-model.md) already counts at that stage, never negative;
  loss_transient_bytes the same for the loss's backward (against the count before the stage's
  gradients), and bwd_replay_bytes for the highest memory at the start of one of the stage's
  backward nodes (each drops a marker N<i> in the memory step), where a replay runs (at most
  bwd_transient_bytes + grad_bytes). So the evaluator's all-retain plan predicts exactly the measured per-stage peaks
  wherever the model counts no more than is really there, and the measured whole-step peak with it
  (`simulate_all_retain` is that walk, in Python, for checks). Known overcount: an in-place
  unit (`ReLU(inplace=True)` after BatchNorm) owns, as activation, the storage its producer
  reports as unsaved output; at the in-place unit's forward stage the model counts that storage
  twice (the producer's output is released only after that stage). This does not move the
  predicted peak of the CNNs tried (their peak is in backward) but is visible per stage.

Constant memory
---------------
- parameters: bytes of the storages of all parameters **and buffers** (BatchNorm statistics),
  shared storages counted once.
- optimizer_state: 0 unless `optimizer=` is given: then the bytes of its state tensors; where a
  parameter has no state yet (lazy optimizers such as Adam create it at the first step), the
  state a step would create is measured on a throwaway optimizer of the same class over clones
  of that parameter (the user's optimizer and parameters are not touched).

Optimizer step (only with `optimizer=`)
---------------------------------------
The profile gets an `optimizer` section and, per unit, the fields of the cost model's optimizer
stages (docs/cost-model.md, "Optimizer step"), over the parameters each unit is the first to use
(`cuda_exec.state_swap.unit_parameters`): `param_bytes` (their storages that no other unit or
buffer shares: what a plan can keep on the host), `optimizer_state_bytes` (their state tensors
with a dimension; a step counter stays), `optimizer_time` and `optimizer_transient_bytes` (one
optimizer step over those parameters alone: the median of `repeats` timed steps, and its peak
of allocations above its start). They are measured on a throwaway optimizer of the same class
and options over clones with zero gradients, one unit at a time (so also when the user's
optimizer has no state yet); `optimizer.other_time` / `other_transient_bytes` are the same for
the parameters of no unit, and `optimizer.step_time` / `transient_bytes` for one whole step over
every parameter (what runs when a plan swaps nothing across iterations).
- inputs: bytes of the storages of the example input tensors.
- workspace: on a GPU, what is allocated when the step starts beyond the above (cuBLAS keeps a
  workspace per handle, allocated before the first step), or after the profile's steps where that
  is more (a library's workspace first needed by a later step: on an H200 a 1 MiB block that came
  with the replay step, by its size cuBLASLt's for the backward's thread); 0 on a CPU.

Environment
-----------
`environment` records what changes the kernels and their memory (torch version, threads, CPU
capability, oneDNN, cuDNN flags, device, allocator variables); `run()` warns when it differs.
`copy_engines`: copies that can run at once in the executor's backend (1 for the CPU backend's
copy thread and the CUDA backend's copy stream).

The model is left as found: gradients, buffers (BatchNorm running statistics), training flags
and torch's RNG states are restored, and every hook is removed, also when a step raises.

Loss
----
`loss_fn(output)` if given (a scalar tensor). Otherwise `default_loss`: a 2-D floating output is
taken as classification logits and the loss is cross-entropy against class 0 for every sample (a
real classification loss, so the backward allocates what a real one does); any other tensor is
summed; a tuple, list or dict of outputs gets the sum of those losses over its floating tensors.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "ProfilerError",
    "profile_model",
    "unplanned_step_stats",
    "default_loss",
    "simulate_all_retain",
    "numpy_copy_bandwidth",
    "copy_bandwidth",
    "environment",
    "environment_differences",
]

PROFILE_FORMAT = "tensorplace.profile"
PROFILE_VERSION = 1


class ProfilerError(ValueError):
    """A model, input or setting the profiler refuses; the message says what and how to fix it."""


# --------------------------------------------------------------------------------------------
# Small helpers: inputs, devices, sizes, loss
# --------------------------------------------------------------------------------------------


def _as_args(example_inputs: Any) -> Tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise ProfilerError(
        f"example_inputs must be a tensor or a tuple/list of positional arguments, not "
        f"{type(example_inputs).__name__}"
    )


def _tensors_in(obj: Any) -> List[torch.Tensor]:
    """Tensors in a (nested) structure of tuples, lists and dicts, in order."""
    out: List[torch.Tensor] = []

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (tuple, list)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)

    walk(obj)
    return out


def _storage_key(t: torch.Tensor) -> Tuple[Any, ...]:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage shared by views counted once)."""
    seen = set()
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if not devices:
        raise ProfilerError(
            "the model has no parameters: tensorplace profiles a training step, which needs "
            "parameters that require grad"
        )
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ProfilerError(
            f"the model's parameters and buffers are on several devices ({names}); tensorplace "
            f"profiles a model on one device: move it with model.to(device)"
        )
    return next(iter(devices))


def _check_inputs_device(args: Sequence[Any], device: torch.device) -> None:
    for i, a in enumerate(args):
        for t in _tensors_in(a):
            if t.device != device:
                raise ProfilerError(
                    f"example input {i} is on {t.device} but the model's parameters are on "
                    f"{device}; move the inputs with x.to({str(device)!r}) (or the model with "
                    f"model.to({str(t.device)!r})) so that both are on one device"
                )


def default_loss(output: Any) -> torch.Tensor:
    """The loss used when none is given (see the module docstring)."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 2 and output.is_floating_point() and output.shape[1] > 0:
            labels = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
            return nn.functional.cross_entropy(output, labels)
        return output.sum()
    parts = [default_loss(t) for t in _tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise ProfilerError(
            f"the model's output ({type(output).__name__}) holds no floating tensor that requires "
            f"grad; pass loss_fn=... that turns the output into a scalar loss"
        )
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _loss_of(output: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> torch.Tensor:
    loss = loss_fn(output) if loss_fn is not None else default_loss(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ProfilerError(f"loss_fn must return a scalar tensor, it returned {got}")
    if not loss.requires_grad:
        raise ProfilerError(
            "the loss does not require grad: no parameter of the model contributes to it "
            "(is the model's forward run under torch.no_grad, or are all parameters frozen?)"
        )
    return loss


# --------------------------------------------------------------------------------------------
# Copy bandwidth
# --------------------------------------------------------------------------------------------


def numpy_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> Tuple[float, float]:
    """(device_to_host, host_to_device) bytes per second on a CPU without a backend: the median
    of `repeats` copies of `nbytes` between a torch tensor (torch's allocator: the device tier)
    and a numpy buffer (memory outside it: the host tier), after one untimed copy each way.
    A stand-in used only when no cuda_exec backend can be asked."""
    nbytes = max(int(nbytes), 1)
    dev = torch.empty(nbytes, dtype=torch.uint8)
    dev.fill_(1)
    host = np.empty(nbytes, dtype=np.uint8)
    dev_np = dev.numpy()
    result = []
    for direction in ("d2h", "h2d"):
        times = []
        for k in range(max(1, repeats) + 1):
            t0 = time.perf_counter()
            if direction == "d2h":
                np.copyto(host, dev_np)
            else:
                dev.copy_(torch.from_numpy(host))
            dt = time.perf_counter() - t0
            if k:
                times.append(max(dt, 1e-9))
        result.append(nbytes / statistics.median(times))
    return result[0], result[1]


def _cuda_exec_module(name: str):
    """Import cuda_exec.<name>, also from this checkout's cuda_exec/ folder; None if absent."""
    try:
        return importlib.import_module(f"cuda_exec.{name}")
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    candidate = os.path.normpath(os.path.join(here, "..", "..", "cuda_exec"))
    if os.path.isdir(os.path.join(candidate, "cuda_exec")) and candidate not in sys.path:
        sys.path.append(candidate)
        try:
            return importlib.import_module(f"cuda_exec.{name}")
        except ImportError:
            return None
    return None


def copy_bandwidth(device: torch.device, backend: Any = None, nbytes: int = 64 << 20) -> Tuple[float, float]:
    """(d2h, h2d) bytes per second measured with `backend.bandwidth(nbytes)` if a backend is
    given; otherwise with the default backend of cuda_exec for the device (closed afterwards);
    otherwise, on a CPU, with `numpy_copy_bandwidth`."""
    if backend is not None:
        d2h, h2d = backend.bandwidth(nbytes)
        return float(d2h), float(h2d)
    made = _default_backend(device)
    if made is not None:
        try:
            d2h, h2d = made.bandwidth(nbytes)
            return float(d2h), float(h2d)
        finally:
            close = getattr(made, "close", None)
            if close is not None:
                close()
    if device.type == "cpu":
        return numpy_copy_bandwidth(nbytes)
    raise ProfilerError(
        f"cannot measure copy bandwidth on {device}: cuda_exec's backend for it is not available; "
        f"pass backend=... (an object with .bandwidth(nbytes) -> (d2h, h2d))"
    )


def _default_backend(device: torch.device) -> Any:
    if device.type == "cpu":
        mod = _cuda_exec_module("cpu_backend")
        cls = getattr(mod, "CpuBackend", None) if mod is not None else None
        return cls() if cls is not None else None
    if device.type == "cuda":
        mod = _cuda_exec_module("cuda_backend")
        cls = getattr(mod, "CudaBackend", None) if mod is not None else None
        return cls(device) if cls is not None else None
    return None


# --------------------------------------------------------------------------------------------
# The cost model's all-retain walk (docs/cost-model.md), for transients and checks
# --------------------------------------------------------------------------------------------


def _last_fwd_readers(units: Sequence[Dict[str, Any]]) -> List[int]:
    last = list(range(len(units)))
    for i, u in enumerate(units):
        for p in u.get("inputs", []):
            last[p] = max(last[p], i)
    return last


def fwd_stage_alloc_bytes(unit: Dict[str, Any]) -> int:
    """What forward stage Fi allocates for unit ``unit`` (docs/cost-model.md): its activations,
    plus its output when the output is not saved."""
    return int(unit["act_bytes"]) + (0 if unit.get("output_saved", True) else int(unit.get("output_bytes", 0)))


def _counted_all_retain(units: Sequence[Dict[str, Any]], constant: int) -> Tuple[List[int], List[int]]:
    """What the evaluator's all-retain walk counts at each stage before transients:
    (fwd[i], bwd[i]) = memory at the stage's start plus what the stage allocates."""
    n = len(units)
    last_fwd = _last_fwd_readers(units)
    releases: List[List[int]] = [[] for _ in range(n)]
    for u in range(n):
        releases[last_fwd[u]].append(u)
    frees: List[List[int]] = [[] for _ in range(n)]
    for u, unit in enumerate(units):
        readers = unit.get("read_by", [])
        if readers:
            frees[min(readers)].append(u)
    mem = constant
    fwd = [0] * n
    for i, u in enumerate(units):
        alloc = fwd_stage_alloc_bytes(u)
        fwd[i] = mem + alloc
        mem += alloc
        for r in releases[i]:
            if not units[r].get("output_saved", True):
                mem -= units[r].get("output_bytes", 0)
    bwd = [0] * n
    for i in range(n - 1, -1, -1):
        bwd[i] = mem + units[i].get("grad_bytes", 0)
        mem = bwd[i]
        for r in frees[i]:
            mem -= units[r]["act_bytes"]
    return fwd, bwd


def simulate_all_retain(profile: Dict[str, Any]) -> Dict[str, Any]:
    """The evaluator's all-retain memory walk over a Profile dict, in Python.

    Returns {"peak_bytes", "peak_stage" ("start", "fwd:i" or "bwd:i"), "fwd": [stage peaks],
    "bwd": [stage peaks]}: a stage's peak is the memory at its start plus what it allocates plus
    its transient, as docs/cost-model.md defines them. For the all-retain plan this is what
    `tensorplace._core.unplanned_peak` computes; the profiler derives the transients from it."""
    units = profile["units"]
    constant = sum(int(v) for v in profile["memory"].values())
    fwd, bwd = _counted_all_retain(units, constant)
    fwd_peaks = [c + u.get("fwd_transient_bytes", 0) for c, u in zip(fwd, units)]
    bwd_peaks = [max(c + u.get("bwd_transient_bytes", 0), c - u.get("grad_bytes", 0) + u.get("loss_transient_bytes", 0))
                 for c, u in zip(bwd, units)]
    peak, stage = constant, "start"
    for i, v in enumerate(fwd_peaks):
        if v > peak:
            peak, stage = v, f"fwd:{i}"
    for i in range(len(units) - 1, -1, -1):
        if bwd_peaks[i] > peak:
            peak, stage = bwd_peaks[i], f"bwd:{i}"
    return {"peak_bytes": peak, "peak_stage": stage, "fwd": fwd_peaks, "bwd": bwd_peaks}


# --------------------------------------------------------------------------------------------
# Memory: torch's own allocation records, cut into stages
# --------------------------------------------------------------------------------------------


def _profiler_activities(device: torch.device) -> List[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


@contextlib.contextmanager
def _memory_recording(device: torch.device):
    """torch.profiler recording allocations; yields a list filled, on exit, with the events
    (ns, delta_bytes or None, marker label or None) on `device`, in time order."""
    events: List[Tuple[int, Optional[int], Optional[str]]] = []
    memory = _cuda_exec_module("memory")
    recording = (memory.memory_profile(_profiler_activities(device)) if memory is not None
                 else torch.profiler.profile(activities=_profiler_activities(device), profile_memory=True))
    with recording as prof:
        yield events
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    want = torch.device(device).type
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            dev_type = str(e.device_type()).split(".")[-1].lower()
            if dev_type != want:
                continue
            if want == "cuda" and device.index is not None and e.device_index() not in (-1, device.index):
                continue
            events.append((e.start_ns(), int(e.nbytes()), None))
        elif name.startswith(_MARK):
            events.append((e.start_ns(), None, name[len(_MARK):]))
    # memory before markers at equal timestamps: a marker's range is empty
    events.sort(key=lambda ev: (ev[0], ev[1] is None))


def _stage_peaks(events: Sequence[Tuple[int, Optional[int], Optional[str]]],
                 allocs: Optional[Dict[Tuple[str, int], List[int]]] = None) -> Tuple[Dict[Tuple[str, int], int], int]:
    """Peak of the running allocation sum (relative to the step's start) per stage, and over the
    whole step. Stage keys: ("fwd", i) and ("bwd", i), and ("loss", i) for the region between the
    backward call and the first backward window, unit i's (the loss's backward). ``allocs``, if
    given, is filled with each stage's allocation sizes in order (the loss region's are left
    out)."""
    level = 0
    overall = 0
    peaks: Dict[Tuple[str, int], int] = {}
    stage: Optional[Tuple[str, int]] = None
    pending: Optional[int] = None  # peak of the loss-backward region, not yet given to a unit
    started = False
    for _, delta, label in events:
        if label is not None:
            if label == "step":
                started = True
                stage = ("fwd", 0)
            elif label == "end":
                break
            elif label == "backward":
                stage = None
                pending = level
            elif label[0] == "F":
                stage = ("fwd", int(label[1:]))
            elif label[0] == "B":
                stage = ("bwd", int(label[1:]))
                if pending is not None:
                    peaks[("loss", stage[1])] = pending
                    pending = None
            elif label[0] == "N":
                # a backward node of the unit starts: the highest level at one is ("node", i)
                key = ("node", int(label[1:]))
                peaks[key] = max(peaks.get(key, level), level)
                continue
            else:
                continue
            if stage is not None:
                peaks[stage] = max(peaks.get(stage, level), level)
            continue
        if not started:
            continue
        level += delta
        overall = max(overall, level)
        if stage is not None:
            if level > peaks[stage]:
                peaks[stage] = level
            if allocs is not None and delta > 0:
                allocs.setdefault(stage, []).append(delta)
        elif pending is not None:
            pending = max(pending, level)
    return peaks, overall


# --------------------------------------------------------------------------------------------
# Model state: leave the model as found
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _preserved(model: nn.Module, device: torch.device):
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, mode in modes:
            m.training = mode
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def _optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer's state tensors; a parameter without state yet is charged what
    one step of a throwaway optimizer of the same class creates for a clone of it."""
    if optimizer is None:
        return 0
    tensors: List[torch.Tensor] = []
    estimated = 0
    cache: Dict[Tuple[Any, ...], int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state.get(p)
            if state:
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
                continue
            key = (gi, tuple(p.shape), p.dtype, p.device)
            if key not in cache:
                cache[key] = _probe_state_bytes(optimizer, group, p)
            estimated += cache[key]
    return _storage_bytes(tensors) + estimated


def _throwaway_optimizer(optimizer: Any, groups: Sequence[Tuple[Dict[str, Any], List[nn.Parameter]]]) -> Any:
    """An optimizer of ``optimizer``'s class over ``groups`` (options, parameters)."""
    spec = [dict(options, params=ps) for options, ps in groups]
    try:
        return type(optimizer)(spec, **getattr(optimizer, "defaults", {}))
    except TypeError:  # a constructor that does not take its defaults back as keywords
        return type(optimizer)(spec)


def _optimizer_step_profile(optimizer: Any, names: Sequence[str], unit_map: Dict[nn.Module, str], model: nn.Module,
                            device: torch.device, repeats: int) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """The optimizer step per unit (docs/cost-model.md, "Optimizer step"): per unit, the bytes of
    the parameters it brings in first (storages no other unit or buffer shares), of their
    optimizer state that can move (tensors with a dimension), and the time and transient memory
    of the optimizer step over its parameters alone (cuda_exec.state_swap's chunks), measured on
    a throwaway optimizer of the same class over clones; plus the same for the parameters of no
    unit. The user's optimizer and parameters are not touched."""
    state_swap = _cuda_exec_module("state_swap")
    if state_swap is None:
        raise ProfilerError("cuda_exec.state_swap is not importable: install cuda_exec or put its folder on PYTHONPATH")
    groups_of: Dict[int, int] = {}
    opt_params: List[nn.Parameter] = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.requires_grad and id(p) not in groups_of:
                groups_of[id(p)] = gi
                opt_params.append(p)
    per_unit, rest = state_swap.unit_parameters(names, unit_map, opt_params)
    exclusive = state_swap.exclusive_storages(per_unit, list(model.buffers()) + rest)
    clock = _Clock(device)
    chunks = state_swap.optimizer_chunks(per_unit, rest)
    costs: Dict[int, Tuple[float, int]] = {}
    state_bytes: Dict[int, int] = {}
    for k, (u, params) in enumerate(chunks):
        if not params:
            continue
        time_k, transient_k, probe, clones = _optimizer_part(optimizer, params, groups_of, clock, device, repeats)
        costs[k] = (time_k, transient_k)
        if u < len(per_unit):
            # the real state where the optimizer has one, else what the copy's step created
            total = 0
            for p, q in zip(params, clones):
                real = state_swap.state_tensors(optimizer, [p])
                ts = real if real else state_swap.state_tensors(probe, [q])
                total += _storage_bytes(t for _, _, t in ts)
            state_bytes[u] = total
        del probe, clones
    whole = _optimizer_part(optimizer, opt_params, groups_of, clock, device, repeats)[:2]
    units: List[Dict[str, Any]] = [
        {"param_bytes": sum(st.nbytes() for st, _ in exclusive[u]), "optimizer_state_bytes": 0,
         "optimizer_time": 0.0, "optimizer_transient_bytes": 0}
        for u in range(len(per_unit))
    ]
    other = {"name": type(optimizer).__name__, "other_time": 0.0, "other_transient_bytes": 0,
             "step_time": whole[0], "transient_bytes": whole[1]}
    for k, (u, _) in enumerate(chunks):
        if k not in costs:
            continue
        time_k, transient_k = costs[k]
        if u < len(per_unit):
            units[u].update(optimizer_state_bytes=state_bytes.get(u, 0), optimizer_time=time_k,
                            optimizer_transient_bytes=transient_k)
        else:
            other.update(other_time=time_k, other_transient_bytes=transient_k)
    return units, other


def _optimizer_part(optimizer: Any, params: Sequence[nn.Parameter], groups_of: Dict[int, int], clock: "_Clock",
                    device: torch.device, repeats: int) -> Tuple[float, int, Any, List[nn.Parameter]]:
    """One optimizer step over ``params`` alone, on a throwaway optimizer of ``optimizer``'s class
    and group options over clones with zero gradients (after a first step that creates the
    state): (median seconds of ``repeats`` steps, peak allocations of one step above its start,
    the throwaway optimizer, the clones)."""
    clones = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = torch.zeros_like(p)
        clones.append(q)
    by_group: Dict[int, List[nn.Parameter]] = {}
    for p, q in zip(params, clones):
        by_group.setdefault(groups_of[id(p)], []).append(q)
    options = [({k: v for k, v in optimizer.param_groups[gi].items() if k != "params"}, qs)
               for gi, qs in sorted(by_group.items())]
    try:
        probe = _throwaway_optimizer(optimizer, options)
        probe.step()  # creates the state (lazy optimizers)
        times = []
        for _ in range(max(1, int(repeats))):
            clock.sync()
            t0 = clock.now()
            probe.step()
            t1 = clock.now()
            clock.sync()
            times.append(clock.seconds(t0, t1))
        gc.collect()
        with _memory_recording(device) as events:
            with torch.profiler.record_function(_MARK + "R0"):
                pass
            probe.step()
            clock.sync()
            with torch.profiler.record_function(_MARK + "r0"):
                pass
    except Exception as exc:  # noqa: BLE001 - any failure means we cannot measure
        raise ProfilerError(
            f"cannot measure the optimizer step of {type(optimizer).__name__} on a copy of its parameters "
            f"({type(exc).__name__}: {exc}); leave optimizer= out to profile without the optimizer step"
        ) from exc
    return statistics.median(times), int(_replay_windows(events).get(0, 0)), probe, clones


def _probe_state_bytes(optimizer: Any, group: Dict[str, Any], p: torch.Tensor) -> int:
    q = nn.Parameter(torch.zeros_like(p))
    q.grad = torch.zeros_like(p)
    options = {k: v for k, v in group.items() if k != "params"}
    try:
        try:
            probe = type(optimizer)([dict(options, params=[q])], **getattr(optimizer, "defaults", {}))
        except TypeError:  # a constructor that does not take its defaults back as keywords
            probe = type(optimizer)([dict(options, params=[q])])
        probe.step()
    except Exception as exc:  # noqa: BLE001 - any failure means we cannot estimate
        raise ProfilerError(
            f"cannot tell the optimizer state of {type(optimizer).__name__} before its first step "
            f"({type(exc).__name__}: {exc}); run one optimizer step before profiling, or leave "
            f"optimizer= out"
        ) from exc
    return _storage_bytes(v for v in probe.state.get(q, {}).values() if isinstance(v, torch.Tensor))


# --------------------------------------------------------------------------------------------
# Units (cuda_exec.units) and the instruments of one step
# --------------------------------------------------------------------------------------------


def _units_module():
    mod = _cuda_exec_module("units")
    if mod is None:
        raise ProfilerError(
            "cuda_exec.units is not importable: install cuda_exec (pip install -e cuda_exec) or put "
            "the checkout's cuda_exec/ folder on PYTHONPATH"
        )
    return mod


def _unit_specs(model: nn.Module, units: Any) -> Optional[List[Any]]:
    """`units` as cuda_exec.units.discover_units takes them (module classes and instances):
    qualified module names (strings) are looked up in the model."""
    specs = None
    if units is not None:
        specs = []
        for u in units:
            if isinstance(u, str):
                try:
                    specs.append(model.get_submodule(u))
                except AttributeError as exc:
                    raise ProfilerError(f"units names {u!r}, which is not a submodule of the model") from exc
            elif isinstance(u, (type, nn.Module)):
                specs.append(u)
            else:
                raise ProfilerError(
                    f"units must hold module classes, module instances or qualified names, not "
                    f"{type(u).__name__}"
                )
    return specs


def _discover(model: nn.Module, specs: Optional[List[Any]]) -> Dict[nn.Module, str]:
    """Unit modules: cuda_exec.units.discover_units over `_unit_specs`."""
    found = _units_module().discover_units(model, specs)
    if not found:
        raise ProfilerError("no module of the model was chosen as a unit")
    return found


_seq_nr = torch._C._autograd._get_sequence_nr


class _Clock:
    """Timestamps at stage boundaries: perf_counter on a CPU; CUDA events on a GPU (read after
    the step's synchronize)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev, time.perf_counter()
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            return a[0].elapsed_time(b[0]) / 1e3
        return b - a

    def host_seconds(self, a: Any, b: Any) -> float:
        """The host's time between two marks (on a GPU the host runs ahead of the device)."""
        if self.cuda:
            return b[1] - a[1]
        return b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


_MARK = "tensorplace::"


class _Instruments:
    """Light hooks for one step: forward pre/post hooks on the unit modules (same unit rules as
    cuda_exec.units: a unit module called inside another unit is part of the outer one; the k-th
    call of a module is named `name#k`), and, just before the backward, pre-hooks on the autograd
    nodes created in each unit's segment (sequence numbers from the unit's start to the next
    unit's start) plus post-accumulate-grad hooks on parameters of no unit module.

    At every stage boundary it reads the clock and, with `markers`, drops a zero-length profiler
    range (tensorplace::F<i>, ::B<i>, ::step, ::backward, ::end) whose timestamp cuts the memory
    records. `remove()` takes every hook away and is always called (in a finally)."""

    def __init__(self, unit_map: Dict[nn.Module, str], kind_of: Callable[[nn.Module], str], clock: _Clock,
                 markers: bool, watch_params: Sequence[nn.Parameter] = ()):
        self.unit_map = unit_map
        self.kind_of = kind_of
        self.clock = clock
        self.markers = markers
        self.watch_params = list(watch_params)
        self.handles: List[Any] = []
        self.sequence: List[Tuple[str, str]] = []
        self.fwd_start: List[Any] = []
        self.seq_start: List[int] = []
        self.seq_end = 0
        self.bwd_windows: List[Tuple[int, Any]] = []  # (unit, clock) where each window starts
        self.grad_window: Dict[int, int] = {}  # id(param) -> unit whose window accumulated it
        self.step_begin: Any = None
        self.fwd_end: Any = None  #: before the instrument's own walk of the graph (before_backward)
        self.bwd_begin: Any = None
        self.bwd_end: Any = None
        self._depth = 0
        self._calls: Dict[nn.Module, int] = {}
        self._bwd_current: Optional[int] = None
        self.in_backward: List[str] = []  #: unit modules the model itself ran during the backward

    # -- hooks ---------------------------------------------------------------------------------

    def install(self) -> None:
        # prepend: the stage mark comes before any other pre-hook of the unit module (the
        # executor's unit tracker registers its own at every forward), so the executor's work at
        # a unit's start is charged to the stage it starts, where the executor does it
        for module in self.unit_map:
            self.handles.append(module.register_forward_pre_hook(self._pre, prepend=True))
            self.handles.append(module.register_forward_hook(self._post))

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()
        self._depth = 0

    def mark(self, label: str) -> Any:
        if self.markers:
            with torch.profiler.record_function(_MARK + label):
                pass
        return self.clock.now()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if _units_module().is_replaying():  # the executor replays a unit: not a forward stage
            return
        if torch._C._current_graph_task_id() != -1:
            # the autograd engine runs this module: the model recomputes it itself
            # (torch.utils.checkpoint); _check_no_backward_calls says so
            self.in_backward.append(self.unit_map[module])
            return
        self._depth += 1
        if self._depth > 1:
            return
        call = self._calls.get(module, 0)
        self._calls[module] = call + 1
        name = self.unit_map[module] if call == 0 else f"{self.unit_map[module]}#{call}"
        idx = len(self.sequence)
        self.sequence.append((name, self.kind_of(module)))
        self.fwd_start.append(self.mark(f"F{idx}"))
        self.seq_start.append(_seq_nr())

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if _units_module().is_replaying() or torch._C._current_graph_task_id() != -1:
            return
        self._depth = max(0, self._depth - 1)

    def forward_done(self) -> None:
        self.seq_end = _seq_nr()

    def before_backward(self, loss: torch.Tensor) -> None:
        """Hook the autograd nodes of every unit's segment, and the watched parameters. The
        walk is the instrument's own work, in no stage: the last forward window ends before it,
        the first backward window starts after it (on a 193-unit stack of tiny kernels it took
        about a fifth of the step, all of it charged to the last unit's forward before)."""
        self.fwd_end = self.clock.now()
        starts = self.seq_start
        n = len(starts)
        # watched parameters are hooked at their AccumulateGrad nodes, which go with the step's
        # graph: a parameter's own post-accumulate hook leaves a hook behind in C++ after its
        # removal (an empty dict it calls into at every later accumulation: 2% of a tiny-stack
        # step of the user's model, for the rest of its training)
        watch = {id(p) for p in self.watch_params}
        if n or watch:
            lo, hi = (starts[0], self.seq_end) if n else (0, 0)
            stack = [loss.grad_fn]
            seen = set()
            while stack:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                if watch:
                    p = getattr(node, "variable", None)  # an AccumulateGrad node's parameter
                    if p is not None and id(p) in watch:
                        self.handles.append(node.register_prehook(self._accumulating(p)))
                        continue
                s = node._sequence_nr()
                if lo <= s < hi:
                    unit = _bisect_right(starts, s) - 1
                    self.handles.append(node.register_prehook(self._node_pre(unit)))
                for nxt, _ in node.next_functions:
                    stack.append(nxt)
        self.bwd_begin = self.mark("backward")

    def _node_pre(self, unit: int):
        def hook(grad_outputs):
            if self._bwd_current != unit:
                self._bwd_current = unit
                self.bwd_windows.append((unit, self.mark(f"B{unit}")))
            if self.markers:
                # every node start: where a replay can run (the executor replays at an unpack,
                # which comes at a node's start), so the memory there bounds a replay's base
                with torch.profiler.record_function(_MARK + f"N{unit}"):
                    pass
            return None

        return hook

    def _accumulating(self, p: torch.Tensor):
        def hook(grad_outputs):
            if id(p) not in self.grad_window:
                self.grad_window[id(p)] = self._bwd_current if self._bwd_current is not None else -1
            return None

        return hook

    # -- results -------------------------------------------------------------------------------

    def host_stage_times(self) -> Tuple[List[float], List[float]]:
        """(fwd[i], bwd[i]) host seconds of the same windows (GPU: the time to issue them)."""
        fwd, bwd, _ = self.stage_times(self.clock.host_seconds)
        return fwd, bwd

    def stage_times(self, sec: Optional[Callable[[Any, Any], float]] = None) -> Tuple[List[float], List[float], float]:
        """(fwd[i], bwd[i], step) seconds; the windows of the module docstring."""
        n = len(self.sequence)
        sec = sec or self.clock.seconds
        fwd_end = self.fwd_end if self.fwd_end is not None else self.bwd_begin
        fwd = [0.0] * n
        for i in range(n):
            start = self.step_begin if i == 0 else self.fwd_start[i]
            end = self.fwd_start[i + 1] if i + 1 < n else fwd_end
            fwd[i] = max(0.0, sec(start, end))
        bwd = [0.0] * n
        for k, (unit, t) in enumerate(self.bwd_windows):
            start = self.bwd_begin if k == 0 else t
            end = self.bwd_windows[k + 1][1] if k + 1 < len(self.bwd_windows) else self.bwd_end
            bwd[unit] += max(0.0, sec(start, end))
        walk = max(0.0, sec(fwd_end, self.bwd_begin))  # the instrument's own (before_backward)
        return fwd, bwd, max(0.0, sec(self.step_begin, self.bwd_end) - walk)


def _bisect_right(a: Sequence[int], x: int) -> int:
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _marker_order(ev: Tuple[int, Optional[int], Optional[str]]) -> Tuple[int, int]:
    """Sort key of a recording's events: by time; at one timestamp an R marker before the
    allocations, an r marker after them."""
    label = ev[2]
    return (ev[0], 1 if label is None else (0 if label.startswith("R") else 2))


def _windows(events: Sequence[Tuple[int, Optional[int], Optional[str]]],
             allocs: Optional[Dict[int, List[int]]] = None) -> Iterator[Tuple[int, int, int]]:
    """Each window between the executor's R<unit> and r<unit> markers of a recording, as (unit,
    running allocation sum at R<unit>, its highest value up to r<unit>), sums above the
    recording's start (a marker at the same timestamp as an allocation: R before it, r after
    it). ``allocs``, if given, is filled with each window's allocation sizes in order."""
    level = 0
    open_unit: Optional[int] = None
    start = peak = 0
    for _, delta, label in sorted(events, key=_marker_order):
        if label is None:
            level += delta or 0
            peak = max(peak, level)
            if allocs is not None and open_unit is not None and (delta or 0) > 0:
                allocs.setdefault(open_unit, []).append(delta)
        elif label[:1] == "R" and label[1:].isdigit():
            open_unit, start, peak = int(label[1:]), level, level
        elif label[:1] == "r" and label[1:].isdigit() and open_unit == int(label[1:]):
            yield open_unit, start, peak
            open_unit = None


def _replay_windows(events: Sequence[Tuple[int, Optional[int], Optional[str]]],
                    allocs: Optional[Dict[int, List[int]]] = None) -> Dict[int, int]:
    """Per replayed unit, the peak of the running allocation sum between the executor's
    R<unit> and r<unit> markers above its value at R<unit> (:func:`_windows`)."""
    out: Dict[int, int] = {}
    for unit, start, peak in _windows(events, allocs):
        out[unit] = max(out.get(unit, 0), peak - start)
    return out


def _lingering_values(unit: int, alive: Dict[int, Tuple[int, int]], last_fwd: int,
                      units: List[Dict[str, Any]]) -> List[List[int]]:
    """`lingering_values` of ``unit``: its dropped values the replay step found the forward
    still holding after its last forward reader (``alive``: value id -> (bytes, last stage)),
    each only where a unit reads that value of ``unit`` with those bytes (``held_values`` /
    ``saved_values``: the ids of the profile and of the replay step's executor agree)."""
    read = {(v, b) for u in units for key in ("held_values", "saved_values") for p, v, b in u[key] if p == unit}
    return sorted([v, b] for v, (b, stage) in alive.items() if stage > last_fwd and (v, b) in read)


def _replay_step(executor_mod: Any, model: nn.Module, args: Tuple[Any, ...], loss_fn: Any, n: int,
                 backend: Any, specs: Any, dev: torch.device,
                 allocs: Optional[Dict[int, List[int]]] = None, names: Sequence[str] = ()
                 ) -> Tuple[Dict[int, int], Dict[int, Dict[int, int]], Dict[int, Dict[int, Tuple[int, int]]],
                            Optional[Dict[int, int]], List[int]]:
    """The replay step (module docstring): ({unit: peak of its replay above its start},
    StepStats.dropped_alive, StepStats.dropped_alive_values, StepStats.dropped_bytes, the units
    the executor cannot replay), or ({}, {}, {}, None, those units) with a warning if the step
    fails. A unit whose own replay fails (ReplayError.unit) cannot be recomputed in any plan: it
    is retained and the step run again (at most ``_UNREPLAYABLE_TRIES`` such units).
    ``allocs``: filled with each replay's allocation sizes."""
    unreplayable: List[int] = []
    while True:
        actions = ["retain" if u in unreplayable else "recompute" for u in range(n)]
        planned = executor_mod.PlannedModule(model, actions, backend=backend, units=specs)
        try:
            _clear_grads(model)
            gc.collect()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the executor's own warnings about this plan
                with _memory_recording(dev) as events:
                    _run_step(planned, args, loss_fn)
            stats = planned.last_stats
            if stats is None:
                return _replay_windows(events, allocs), {}, {}, None, unreplayable
            return (_replay_windows(events, allocs), dict(stats.dropped_alive), dict(stats.dropped_alive_values),
                    dict(stats.dropped_bytes), unreplayable)
        except Exception as exc:  # noqa: BLE001 - the measurement is optional; say why it is missing
            unit = getattr(exc, "unit", None)
            if (isinstance(unit, int) and 0 <= unit < n and unit not in unreplayable
                    and len(unreplayable) < _UNREPLAYABLE_TRIES):
                unreplayable.append(unit)
                name = names[unit] if unit < len(names) else str(unit)
                warnings.warn(
                    f"unit {unit} ({name}) cannot be recomputed: the profile says so (recomputable: false) "
                    f"and its plans retain or swap it (the replay step: {exc})",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            warnings.warn(
                f"the replay step (every unit recomputed) failed ({type(exc).__name__}: {exc}); the "
                "profile has no replay_transient_bytes and lingering_bytes, and the cost model falls "
                "back to the forward transients for replays",
                RuntimeWarning,
                stacklevel=3,
            )
            return {}, {}, {}, None, unreplayable
        finally:
            planned.close()
            _clear_grads(model)


#: units the replay step sets aside as not recomputable, at most (then it gives up)
_UNREPLAYABLE_TRIES = 8


def _executor_costs(dev: torch.device, backend: Any) -> Optional[Dict[str, float]]:
    """The executor's host costs on ``dev`` (cuda_exec/calibrate.py), or None (with a warning)
    where they cannot be measured."""
    calibrate = _cuda_exec_module("calibrate")
    if calibrate is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {k: float(v) for k, v in calibrate.executor_costs(dev, backend).items()}
    except Exception as exc:  # noqa: BLE001 - the measurement is optional; say why it is missing
        warnings.warn(f"the executor's host costs could not be measured ({type(exc).__name__}: {exc}); the "
                      "profile has no executor section and plans are predicted without them",
                      RuntimeWarning, stacklevel=3)
        return None


def _clear_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _run_step(model: nn.Module, args: Tuple[Any, ...], loss_fn: Any, inst: Optional[_Instruments] = None,
              tracker: Any = None, on_loss: Optional[Callable[[], None]] = None, clear: bool = True) -> None:
    """One training step (forward, loss, backward; no optimizer step), gradients set to None
    first (``clear``; a timed step's caller does it before its clock starts). `model` is the
    user's model or a cuda_exec PlannedModule around it. `inst` instruments it (installed and
    always removed here); `tracker` (a cuda_exec.units.UnitTracker) watches the model's forward;
    `on_loss` is called once the loss is computed."""
    if clear:
        _clear_grads(model)
    if inst is not None:
        inst.install()
    try:
        with torch.enable_grad():
            if inst is not None:
                inst.step_begin = inst.mark("step")
            if tracker is not None:
                with tracker:
                    output = model(*args)
            else:
                output = model(*args)
            if inst is not None:
                inst.forward_done()
            loss = _loss_of(output, loss_fn)
            if on_loss is not None:
                on_loss()
            if inst is not None:
                inst.before_backward(loss)
            loss.backward()
            if inst is not None:
                inst.bwd_end = inst.mark("end")
                inst.clock.sync()
            del output, loss
    finally:
        if inst is not None:
            inst.remove()


# --------------------------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------------------------


def _check_no_backward_calls(names: Sequence[str]) -> None:
    if names:
        shown = ", ".join(repr(x) for x in list(dict.fromkeys(names))[:4])
        raise ProfilerError(
            f"the model ran unit modules during its backward pass ({shown}{', ...' if len(set(names)) > 4 else ''}): "
            "it recomputes them itself (torch.utils.checkpoint in its forward, or a backward hook "
            "that calls modules). tensorplace plans recomputation (and swaps) per unit itself and "
            "needs each unit to run once, in the forward: remove the model's own checkpointing and "
            "plan with a budget instead (the plan recomputes what needs recomputing)"
        )


def _check_sequence(units_mod: Any, expected: Sequence[Tuple[str, str]], actual: Sequence[Tuple[str, str]],
                    what: str) -> None:
    diff = units_mod.sequence_mismatch(expected, actual)
    if diff is not None:
        raise ProfilerError(
            f"the model ran a different sequence of units in {what} than in the warm-up step "
            f"({diff}): data-dependent control flow (or randomness in which modules run) makes "
            f"the unit graph change between steps, and a plan needs one fixed graph; make the "
            f"forward take the same path for these inputs, or make the varying part one coarse "
            f"unit (units=[...])"
        )


def _prepare(model: Any, example_inputs: Any, device: Any) -> Tuple[Tuple[Any, ...], torch.device]:
    if not isinstance(model, nn.Module):
        raise ProfilerError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    args = _as_args(example_inputs)
    if not any(p.requires_grad for p in model.parameters()):
        raise ProfilerError(
            "the model has no trainable parameters (none requires grad): tensorplace plans the "
            "memory of a training step; unfreeze some parameters (p.requires_grad_(True))"
        )
    dev = _model_device(model)
    if device is not None:
        want = torch.device(device)
        if want.type != dev.type or (want.index is not None and dev.index is not None and want.index != dev.index):
            raise ProfilerError(
                f"device={str(want)!r} was asked for but the model's parameters are on {dev}; move "
                f"the model with model.to({str(want)!r}) or leave device= out"
            )
    _check_inputs_device(args, dev)
    return args, dev


def _constant_memory(model: nn.Module, args: Sequence[Any], optimizer: Any,
                     at_start: Optional[int] = None) -> Dict[str, int]:
    """Constant memory (module docstring). `at_start`: bytes allocated on the device when the
    step starts (CUDA); what the parameters, optimizer state and inputs do not explain there
    (kernel library workspaces, such as cuBLAS's per-handle workspace) is `workspace`."""
    own = list(model.parameters()) + list(model.buffers())
    own_keys = {_storage_key(t) for t in own}
    inputs = [t for t in _tensors_in(list(args)) if _storage_key(t) not in own_keys]
    out = {
        "parameters": _storage_bytes(own),
        "optimizer_state": _optimizer_state_bytes(optimizer),
        "inputs": _storage_bytes(inputs),
        "workspace": 0,
    }
    if at_start is not None:
        out["workspace"] = max(0, int(at_start) - sum(out.values()))
    return out


def _timed_plain_step(model: nn.Module, args: Tuple[Any, ...], loss_fn: Any, clock: "_Clock") -> float:
    """Seconds of one uninstrumented training step (gradients cleared first)."""
    return _timed_plain_parts(model, args, loss_fn, clock)[1]


def _timed_plain_parts(model: nn.Module, args: Tuple[Any, ...], loss_fn: Any, clock: "_Clock",
                       forward: bool = False) -> Tuple[Optional[float], float]:
    """Seconds of one uninstrumented training step (gradients cleared first): (its forward and
    loss, with ``forward``, else None; the whole step)."""
    # before the clock starts: a walk of every module (0.2 ms of a 3.7 ms step of the 193-unit
    # tiny stack), where a training loop's zero_grad() goes through a list
    _clear_grads(model)
    clock.sync()
    marks: List[Any] = []
    t0 = clock.now()
    _run_step(model, args, loss_fn, on_loss=(lambda: marks.append(clock.now())) if forward else None, clear=False)
    t1 = clock.now()
    clock.sync()
    return (clock.seconds(t0, marks[0]) if marks else None), clock.seconds(t0, t1)


def _copy_engines(device: torch.device) -> int:
    """Copies that can run at once in the default backend: 1 (the CPU backend's copy thread, and
    the CUDA backend's single copy stream)."""
    mod = _cuda_exec_module("cuda_backend" if device.type == "cuda" else "cpu_backend")
    cls = getattr(mod, "CudaBackend" if device.type == "cuda" else "CpuBackend", None) if mod is not None else None
    return int(getattr(cls, "copy_engines", 1))


#: Environment variables that change kernels or the device memory a step takes.
_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS",
             "MKL_NUM_THREADS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def environment(device: Any = "cpu") -> Dict[str, Any]:
    """What changes the kernels a step runs and the memory they take: library versions, threads,
    CPU capability, oneDNN and cuDNN flags, the device, allocator settings. Recorded in every
    profile; `tensorplace.run()` warns when a plan runs under another one."""
    dev = torch.device(device)
    env: Dict[str, Any] = {
        "torch": torch.__version__,
        "device": _device_name(dev),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
    }
    if dev.type == "cuda":
        env.update({
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "cudnn_enabled": bool(torch.backends.cudnn.enabled),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        })
    env["variables"] = {k: os.environ[k] for k in _ENV_VARS if k in os.environ}
    return env


def environment_differences(recorded: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """`key: recorded -> current` for every environment setting that differs."""
    out = []
    for key in sorted(set(recorded) | set(current)):
        if key == "torch" and str(recorded.get(key, "")).split("+")[0] == str(current.get(key, "")).split("+")[0]:
            continue
        if recorded.get(key) != current.get(key):
            out.append(f"{key}: {recorded.get(key)!r} -> {current.get(key)!r}")
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _grad_bytes(records: Sequence[Any], unit_map: Dict[nn.Module, str], model: nn.Module,
                grad_window: Dict[int, int]) -> List[int]:
    """Per unit, bytes of the parameter gradients its backward allocates (module docstring).

    `grad_window`: id(parameter) -> the backward window in which its gradient was accumulated,
    for the parameters that got one in the memory step (the others are charged nowhere)."""
    n = len(records)
    grads = [0] * n
    modules = {name: m for m, name in unit_map.items()}
    last_call: Dict[str, int] = {}
    for r in records:
        last_call[r.module_name] = r.index  # records are in order: the last one wins
    charged = set()
    for name in sorted(last_call, key=lambda k: -last_call[k]):
        for p in modules[name].parameters():
            if id(p) in grad_window and id(p) not in charged:
                charged.add(id(p))
                grads[last_call[name]] += p.numel() * p.element_size()
    for p in model.parameters():  # parameters of no unit module that ran: used in glue
        if id(p) in grad_window and id(p) not in charged:
            charged.add(id(p))
            unit = grad_window[id(p)]
            grads[unit if 0 <= unit < n else n - 1] += p.numel() * p.element_size()
    return grads


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    units: Optional[Iterable[Any]] = None,
    warmup: int = 1,
    repeats: int = 3,
    backend: Any = None,
    device: Any = None,
    *,
    optimizer: Any = None,
    name: Optional[str] = None,
    fit_host_costs: Optional[bool] = None,
) -> Dict[str, Any]:
    """Profile one training step of `model` on `example_inputs`; returns a Profile dict
    (docs/formats.md, version 1). See the module docstring for what is measured and how.

    - example_inputs: a tensor, or a tuple/list of positional arguments of `model`.
    - loss_fn(output) -> scalar tensor; default `default_loss`.
    - units: None (leaf modules) or module classes / instances / qualified names to use as
      coarser units (cuda_exec.units.discover_units).
    - warmup: steps before the measured ones (at least one is run: the structure step).
    - repeats: timed steps; times are their medians.
    - backend: an object with `.bandwidth(nbytes) -> (d2h, h2d)` (a cuda_exec backend); default:
      cuda_exec's backend for the device, else a numpy copy measurement on a CPU.
    - device: the device the caller expects the model on (checked, never moved to).
    - optimizer: counted as constant memory (its state) when given; never stepped.
    - name: the profile's "model" field (default: the model's class name, lower case).
    - fit_host_costs: fit the executor's host costs to this model by timing a few planned steps
      (on a CPU through the CPU backend, the default there; it about doubles the profile's time).
      False: keep the calibrated costs; True where it cannot be done raises ProfilerError.

    Raises ProfilerError for inputs on another device than the parameters, a model without
    trainable parameters, or a unit sequence that changes between steps."""
    args, dev = _prepare(model, example_inputs, device)
    fit = _fits_host_costs(dev, backend)
    if fit_host_costs and not fit:
        raise ProfilerError(
            "fit_host_costs=True: the executor's host costs are fitted on a CPU through the CPU backend "
            f"only (this profile: device {dev}, backend {type(backend).__name__}); leave it unset")
    if fit_host_costs is False:
        fit = False
    if int(repeats) < 1:
        raise ProfilerError(f"repeats must be at least 1, got {repeats}")
    if int(warmup) < 0:
        raise ProfilerError(f"warmup must be >= 0, got {warmup}")
    units_mod = _units_module()
    specs = _unit_specs(model, units)
    unit_map = _discover(model, specs)
    executor_mod = _cuda_exec_module("executor")
    if executor_mod is None:
        raise ProfilerError(
            "cuda_exec.executor is not importable: install cuda_exec (pip install -e cuda_exec) or "
            "put the checkout's cuda_exec/ folder on PYTHONPATH"
        )
    clock = _Clock(dev)
    with _preserved(model, dev):
        model.train()
        for _ in range(int(warmup) - 1):
            _run_step(model, args, loss_fn)
        # The structure step (the last warm-up step): units, ownership, edges.
        tracker = units_mod.UnitTracker(model, unit_modules=unit_map, track_random=True, record_calls=True,
                                         watch_packs=True)
        _run_step(model, args, loss_fn, tracker=tracker)
        records = list(tracker.records)
        scopes = tracker.glue_scopes()
        glue_ops = [0] * len(records)
        for _event, unit in tracker.glue_events:
            if 0 <= unit < len(records):
                glue_ops[unit] += 1
        del tracker  # it holds the step's values
        expected = [(r.name, r.kind) for r in records]
        n = len(records)
        if n == 0:
            raise ProfilerError("the model's forward called none of its unit modules")
        kind_of = units_mod.unit_kind
        trainable = [p for p in model.parameters() if p.requires_grad]
        # The memory step.
        _clear_grads(model)
        gc.collect()
        at_start = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        inst = _Instruments(unit_map, kind_of, clock, markers=True, watch_params=trainable)
        with _memory_recording(dev) as events:
            _run_step(model, args, loss_fn, inst=inst)
        _check_no_backward_calls(inst.in_backward)
        _check_sequence(units_mod, expected, inst.sequence, "the memory step")
        stage_allocs: Dict[Tuple[str, int], List[int]] = {}
        peaks, overall = _stage_peaks(events, stage_allocs)
        grad_window = dict(inst.grad_window)
        # The timed steps: the plain model, instrumented steps (stage times) interleaved with
        # uninstrumented ones (the step as a user runs it); the instrument's own time is taken out
        # by scaling the stage times to the uninstrumented step (module docstring).
        fwd_runs: List[List[float]] = []
        bwd_runs: List[List[float]] = []
        host_fwd_runs: List[List[float]] = []  # on a GPU: the host's time to issue each stage
        host_bwd_runs: List[List[float]] = []
        step_runs: List[float] = []
        plain_runs: List[float] = []
        plain_fwd_runs: List[Any] = []  # their forwards and losses
        for k in range(int(repeats)):
            inst = _Instruments(unit_map, kind_of, clock, markers=False)
            _run_step(model, args, loss_fn, inst=inst)
            _check_sequence(units_mod, expected, inst.sequence, f"timed step {k + 1}")
            fwd, bwd, step = inst.stage_times()
            fwd_runs.append(fwd)
            bwd_runs.append(bwd)
            if clock.cuda:
                hf, hb = inst.host_stage_times()
                host_fwd_runs.append(hf)
                host_bwd_runs.append(hb)
            step_runs.append(step)
            # after an untimed plain step: the instrumented step's own work leaves the caches as
            # no training step finds them (a plain step right after it took longer)
            _run_step(model, args, loss_fn)
            plain_fwd, plain = _timed_plain_parts(model, args, loss_fn, clock, forward=True)
            plain_runs.append(plain)
            plain_fwd_runs.append(plain_fwd)
        # The replay step.
        replay_allocs: Dict[int, List[int]] = {}
        replays, alive, alive_values, dropped, unreplayable = _replay_step(
            executor_mod, model, args, loss_fn, n, backend, specs, dev, replay_allocs, [r.name for r in records])
        _clear_grads(model)
        if at_start is not None:
            # what kernel libraries allocate once and keep, first needed after the memory step, is
            # there when every later step starts (on an H200 a 1 MiB block came with the replay
            # step: by its size cuBLASLt's workspace of the backward's thread)
            gc.collect()
            at_start = max(at_start, torch.cuda.memory_allocated(dev))
        constant = _constant_memory(model, args, optimizer, at_start=at_start)
        # The optimizer step, per unit (on copies).
        opt_units, opt_other = (
            _optimizer_step_profile(optimizer, [r.name for r in records], unit_map, model, dev, repeats)
            if optimizer is not None else (None, None)
        )
    d2h, h2d = copy_bandwidth(dev, backend)
    replay_state = executor_mod.replay_state_bytes(dev)
    host_fwd = host_fwd_runs or None
    host_bwd = host_bwd_runs or None
    costs = _executor_costs(dev, backend)

    grads = _grad_bytes(records, unit_map, model, grad_window)
    plain_step = statistics.median(plain_runs)
    instrumented_step = statistics.median(step_runs)
    # scaled to the plain step (also upwards: both are medians of noisy timings); forward and
    # backward windows each to the plain step's part, as the instrument's hooks cost more per
    # second of a forward than of a backward (on a stack of tiny kernels the instrumented
    # windows put 40% more of the step in the forward than the plain step has there)
    # Each unit's window is its median over the runs, so the scales divide by the sums of those
    # medians (not the median of the runs' sums: with noise that only slows steps down, a sum of
    # medians comes out 2-3% below it, and every plan was predicted that much short)
    scale = plain_step / instrumented_step if instrumented_step > 0 else 1.0
    fwd_med = [statistics.median(run[i] for run in fwd_runs) for i in range(len(records))]
    bwd_med = [statistics.median(run[i] for run in bwd_runs) for i in range(len(records))]
    inst_fwd, inst_bwd = sum(fwd_med), sum(bwd_med)
    fwd_scale = bwd_scale = plain_step / (inst_fwd + inst_bwd) if inst_fwd + inst_bwd > 0 else scale
    plain_fwd = statistics.median(plain_fwd_runs)
    if 0 < plain_fwd < plain_step and inst_fwd > 0 and inst_bwd > 0:
        fwd_scale, bwd_scale = plain_fwd / inst_fwd, (plain_step - plain_fwd) / inst_bwd
    out_units: List[Dict[str, Any]] = []
    for i, r in enumerate(records):
        out_units.append({
            "name": r.name,
            "kind": r.kind,
            "inputs": list(r.inputs),
            "model_inputs": list(r.model_inputs),
            "fwd_time": fwd_scale * fwd_med[i],
            "bwd_time": bwd_scale * bwd_med[i],
            "act_bytes": int(r.act_bytes),
            "output_bytes": int(r.output_bytes),
            "output_saved": bool(r.output_saved),
            "read_by": list(r.read_by),
            "held_input_bytes": int(r.held_input_bytes),
            "random": bool(r.random),
            "packs": int(r.packs),
            "act_storages": int(r.act_storages),
            "glue_ops": int(glue_ops[i]),
            "held_from": [[int(p), int(b)] for p, b in r.held_from],
            "saved_from": [[int(p), int(b)] for p, b in r.saved_from],
            "held_values": [[int(p), int(v), int(b)] for p, v, b in r.held_values],
            "saved_values": [[int(p), int(v), int(b)] for p, v, b in r.saved_values],
            "saved_inputs": list(r.saved_inputs),
            "fwd_transient_bytes": 0,
            "bwd_transient_bytes": 0,
            "grad_bytes": int(grads[i]),
        })
        if scopes[i] is not None:
            out_units[-1]["glue_scope"] = [int(scopes[i][0]), int(scopes[i][1])]
        if i in unreplayable:
            out_units[-1]["recomputable"] = False
        if host_fwd is not None:
            out_units[-1]["fwd_host_time"] = scale * statistics.median(run[i] for run in host_fwd)
            out_units[-1]["bwd_host_time"] = scale * statistics.median(run[i] for run in host_bwd)
        if opt_units is not None:
            out_units[-1].update(opt_units[i])
    last_fwd = _last_fwd_readers(out_units)
    # Single requests larger than any unit output (cuDNN workspaces): the allocation sequence
    # gives them blocks of their own (docs/cost-model.md, "Reserved memory"); at most 8 a stage.
    largest = max((u["output_bytes"] for u in out_units), default=0)
    for i, u in enumerate(out_units):
        for key, sizes in (("fwd_large_allocs", stage_allocs.get(("fwd", i))),
                           ("bwd_large_allocs", stage_allocs.get(("bwd", i))),
                           ("replay_large_allocs", replay_allocs.get(i))):
            big = [int(b) for b in sizes or () if b > largest]
            if big:
                u[key] = big[-8:]
    for i, u in enumerate(out_units):
        if i in replays:
            u["replay_transient_bytes"] = max(0, replays[i] - u["act_bytes"])
        # dropped bytes the forward still holds after the unit's last forward reader
        late = {s: b for s, b in alive.get(i, {}).items() if s > last_fwd[i]}
        if late:
            u["lingering_bytes"] = min(u["act_bytes"], max(late.values()))
            u["lingering_until"] = max(late)
            values = _lingering_values(i, alive_values.get(i, {}), last_fwd[i], out_units)
            if values:
                u["lingering_values"] = values
        # until when the forward references the unit's activations, where every byte of them was
        # dropped (so tracked) and that comes before its last forward reader (a swapped unit's
        # bytes need not stay until that reader): the last stage whose start found some of them
        # still held, and no earlier than the last unit that saves them (a value is dropped only
        # when its saver packs it; until then the forward has it)
        if dropped is not None and 0 < u["act_bytes"] <= dropped.get(i, 0):
            held = max(max(alive.get(i, {}), default=i), max(u["read_by"], default=i))
            if held < last_fwd[i]:
                u["forward_held_until"] = held
    const_total = sum(constant.values())
    fwd_c, bwd_c = _counted_all_retain(out_units, const_total)
    for i, u in enumerate(out_units):
        f = peaks.get(("fwd", i))
        b = peaks.get(("bwd", i))
        if f is not None:
            u["fwd_transient_bytes"] = max(0, const_total + f - fwd_c[i])
        if b is not None:
            u["bwd_transient_bytes"] = max(0, const_total + b - bwd_c[i])
        lp = peaks.get(("loss", i))
        if lp is not None:  # before the stage's own gradients: bwd_c[i] less them
            u["loss_transient_bytes"] = max(0, const_total + lp - (bwd_c[i] - u["grad_bytes"]))
        npk = peaks.get(("node", i))
        if npk is not None and b is not None:  # the same base; never above the stage's peak
            u["bwd_replay_bytes"] = min(max(0, const_total + npk - (bwd_c[i] - u["grad_bytes"])),
                                        u["bwd_transient_bytes"] + u["grad_bytes"])
    first = next((t for t in _tensors_in(list(args)) if t.dim() > 0), None)
    profile = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": name if name is not None else type(model).__name__.lower(),
        "device": _device_name(dev),
        "batch_size": int(first.shape[0]) if first is not None else None,
        "memory": constant,
        "d2h_bandwidth": d2h,
        "h2d_bandwidth": h2d,
        "measured": {
            "peak_bytes": const_total + overall,
            "step_time": plain_step,
            "instrumented_step_time": instrumented_step,
        },
        "copy_engines": int(getattr(backend, "copy_engines", 1)) if backend is not None else _copy_engines(dev),
        "rng_state_bytes": replay_state,
        **({"executor": costs} if costs is not None else {}),
        "environment": environment(dev),
        **({"optimizer": opt_other} if opt_other is not None else {}),
        "units": out_units,
    }
    with _preserved(model, dev):
        _add_replay_slack(profile, model, args, loss_fn, backend, dev, const_total, specs, repeats, fit)
        if fit:
            _fit_swap_cost(profile, model, args, loss_fn, backend, dev, specs, repeats)
    return profile


def _replay_window_levels(events: Sequence[Tuple[int, Optional[int], Optional[str]]]) -> Dict[int, int]:
    """Per R<unit>..r<unit> window of a recording, the highest running allocation sum in it
    (above the recording's start; :func:`_windows`)."""
    out: Dict[int, int] = {}
    for unit, _start, peak in _windows(events):
        out[unit] = max(out.get(unit, peak), peak)
    return out


def _fits_host_costs(dev: torch.device, backend: Any) -> bool:
    """Whether the profile fits the executor's host costs to the model (:func:`_fit_cost`): on a
    CPU through the CPU backend, where the host runs the kernels and a plan's step beyond its
    prediction is host work. Not on a GPU (a step may wait on the device, and the host's work
    overlaps it) nor on the simulated one (its copies' simulated durations are in the steps)."""
    if dev.type != "cpu":
        return False
    if backend is None:
        return True
    mod = _cuda_exec_module("cpu_backend")
    cls = getattr(mod, "CpuBackend", None) if mod is not None else None
    return cls is not None and isinstance(backend, cls)


def _add_replay_slack(profile: Dict[str, Any], model: nn.Module, args: Tuple[Any, ...], loss_fn: Any, backend: Any,
                      dev: torch.device, const_total: int, units_spec: Any, repeats: int = 3,
                      fit: bool = True) -> None:
    """``replay_slack_bytes`` (module docstring, the steady replay step): the all-recompute plan of
    ``profile`` trained for two steps through the executor, the second (a steady step, whose
    replays call a segment's modules again) recorded; where it held more while it replayed a
    segment than the cost model's prediction of that plan at the backward stage where the segment
    replays, the excess goes on that stage's unit. Then, with ``fit`` (:func:`_fits_host_costs`),
    ``repeats`` (at least 3) more steps of the all-retain plan and of this one, interleaved with
    plain steps, fit the executor's ``step`` and ``drop`` costs to this model (:func:`_fit_cost`).
    Skipped, with a warning, if the steps fail."""
    from .api import run
    from .planning import evaluate, plan_profile

    units = profile["units"]
    clock = _Clock(dev)
    plain_s: List[float] = []
    retain_s: List[float] = []
    planned_s: List[float] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the executor's own warnings about this plan
            plan = plan_profile(profile, 2**62, "recompute-all")
            fast = run(model, plan, backend=backend, units=units_spec)
            kept = run(model, plan_profile(profile, 2**62, "retain"), backend=backend, units=units_spec) if fit else None
            try:
                _run_step(fast, args, loss_fn)  # the executor's first step
                _clear_grads(model)
                gc.collect()
                with _memory_recording(dev) as events:
                    _run_step(fast, args, loss_fn)
                if kept is not None:
                    _run_step(kept, args, loss_fn)
                    times = _interleaved_steps(model, {"retain": kept, "plan": fast}, args, loss_fn, clock, repeats)
                    plain_s, retain_s, planned_s = times["plain"], times["retain"], times["plan"]
            finally:
                fast.close()
                if kept is not None:
                    kept.close()
                _clear_grads(model)
    except Exception as exc:  # noqa: BLE001 - the measurement is optional; say why it is missing
        warnings.warn(f"the steady replay step failed ({type(exc).__name__}: {exc}); the profile has no "
                      "replay_slack_bytes", RuntimeWarning, stacklevel=3)
        return
    predicted = evaluate(profile, plan.actions, 2**62, segment_starts=plan.to_dict().get("segment_starts"))
    stage_peak = {int(c["stage"][4:]): int(c["peak"]) for c in predicted["curve"] if c["stage"].startswith("bwd:")}
    stage_of = {int(r["unit"]): int(r["at_backward_of"]) for r in predicted["replays"]}
    for first, level in _replay_window_levels(events).items():
        s = stage_of.get(first)
        if s is None or s not in stage_peak:
            continue
        excess = const_total + level - stage_peak[s]
        if excess > units[s].get("replay_slack_bytes", 0):
            units[s]["replay_slack_bytes"] = int(excess)
    # the executor's own work per step first: every plan's prediction has it
    _fit_cost(profile, ["retain"] * len(units), None, plain_s, retain_s, ("step",), lower=True)
    _fit_cost(profile, plan.actions, plan.to_dict().get("segment_starts"), plain_s, planned_s, ("drop",))


def _interleaved_steps(model: nn.Module, planned: Dict[str, nn.Module], args: Tuple[Any, ...], loss_fn: Any,
                       clock: "_Clock", repeats: int) -> Dict[str, List[float]]:
    """Seconds of ``max(3, repeats)`` rounds of steps, each a plain step of ``model`` ("plain")
    then one of each planned module: interleaved, as the machine's speed moves. Each timed step
    follows an untimed one of the same module, as in training: a plain step right after an
    all-swap step (whose copies went through the caches) took longer than plain steps do. The
    planned modules' executors share ``model``: the others' module hooks are taken off before a
    module's steps (an idle all-swap executor's hooks made the plain steps 6% slower on a
    tiny-kernel stack, and the fit then put the swap costs too low)."""
    from cuda_exec.executor import hooks_of_one

    times: Dict[str, List[float]] = {"plain": [], **{k: [] for k in planned}}
    executors = {k: getattr(m, "executor", None) for k, m in planned.items()}
    for _ in range(max(3, int(repeats))):
        for k, m in (("plain", model), *planned.items()):
            hooks_of_one(executors.values(), executors.get(k))
            _timed_plain_step(m, args, loss_fn, clock)
            times[k].append(_timed_plain_step(m, args, loss_fn, clock))
    return times


def _fit_cost(profile: Dict[str, Any], actions: Sequence[str], starts: Optional[Sequence[int]],
              plain_s: Sequence[float], planned_s: Sequence[float], keys: Sequence[str], lower: bool = False) -> None:
    """The executor's host costs ``keys`` (``step``; ``drop``; ``stage``; ``swap`` and ``swap_async``) fitted
    to this model: the calibration (cuda_exec/calibrate.py) times them on small synthetic blocks, and a
    model whose saved tensors cost more to drop, capture and unpack, or to swap (views of
    attention heads, say), or whose replays take longer than its profiled forwards, is predicted
    short. The plan's measured step (the quickest of ``planned_s`` over the quickest of the plain
    steps timed between them, times the profile's plain step: a busy machine only ever slows a
    step down) is the target, unless the model's prediction is already within the timings' noise
    (the plain steps' median above their quickest, relative): a small difference on a long step,
    such as one swapped unit's, cannot be told from a machine that slowed down. Where the model predicts
    the plan shorter, the costs are raised by one factor until it does not, and the calibrated
    figures are kept as ``<key>_calibrated``. Where it predicts the plan longer they are lowered
    (down to an eighth) only with ``lower``: the swap costs (the executor's work per swapped unit
    is charged per storage, and the synthetic blocks swap fewer storages per unit than most
    models, so their figure over-predicts a model's all-swap step) and ``step`` (the executor checks
    every parameter per step, and the synthetic blocks may have more than the model); ``drop``
    and ``stage`` are never lowered."""
    from .planning import evaluate

    costs = profile.get("executor")
    if not costs or not plain_s or not planned_s or min(plain_s) <= 0:
        return
    plain = float(profile["measured"]["step_time"])
    ratio = min(planned_s) / min(plain_s)
    noise = statistics.median(plain_s) / min(plain_s) - 1.0
    target = plain * ratio
    # a cost calibrated at 0 (the synthetic model showed none) is raised from 1 us
    base = {k: max(float(costs.get(k) or 0.0), 1e-6) for k in keys if k in costs}
    if not base:
        return

    def predicted(f: float) -> float:
        trial = dict(profile, executor=dict(costs, **{k: v * f for k, v in base.items()}))
        return float(evaluate(trial, list(actions), 2**62, segment_starts=starts)["step_time"])

    now = predicted(1.0)
    if now == target or (now > target and not lower) or abs(now - target) <= noise * target:
        return
    if now < target:  # raised until the model predicts the measured step
        lo, hi = 1.0, 2.0
        while predicted(hi) < target:
            if hi >= 1024:  # not the executor's work
                return
            hi *= 2
    else:  # lowered, to an eighth at most
        lo, hi = 1.0 / 8, 1.0
    if predicted(lo) >= target:
        hi = lo
    else:
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) < target else (lo, mid)
    for k, v in base.items():
        costs[f"{k}_calibrated"] = float(costs.get(k) or 0.0)
        costs[k] = v * hi


def _fit_swap_cost(profile: Dict[str, Any], model: nn.Module, args: Tuple[Any, ...], loss_fn: Any, backend: Any,
                   dev: torch.device, units_spec: Any, repeats: int) -> None:
    """The swap costs fitted to this model (:func:`_fit_cost`): ``stage`` from the plan that
    swaps the first unit with activations alone (every later stage does the swap plan's boundary
    work), then ``swap`` and ``swap_async`` from the all-swap plan; each plan's steps timed after
    its learning step, interleaved with plain steps. Skipped, with a warning, if the steps fail."""
    from . import _core
    from .api import run
    from .planning import Plan, plan_profile, profile_json

    if not profile.get("executor"):
        return
    units = profile["units"]
    first = next((i for i, u in enumerate(units) if u["act_bytes"] > 0), None)
    if first is None:
        return
    clock = _Clock(dev)
    alone = ["retain"] * len(units)
    alone[first] = "swap"
    fast: Dict[str, Any] = {}
    try:
        plans = {"first": Plan(json.loads(_core.plan_from_actions(profile_json(profile), 2**62, alone, "swap-first"))),
                 "all": plan_profile(profile, 2**62, "swap-all")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                for k, p in plans.items():
                    fast[k] = run(model, p, backend=backend, units=units_spec)
                for m in fast.values():
                    _run_step(m, args, loss_fn)  # the executor's first step
                times = _interleaved_steps(model, fast, args, loss_fn, clock, repeats)
            finally:
                for m in fast.values():
                    m.close()
                _clear_grads(model)
    except Exception as exc:  # noqa: BLE001 - the measurement is optional; say why it is missing
        warnings.warn(f"the swap plans' steps failed ({type(exc).__name__}: {exc}); the profile keeps the calibrated "
                      "swap costs", RuntimeWarning, stacklevel=3)
        return
    for k, keys in (("first", ("stage",)), ("all", ("swap", "swap_async"))):
        _fit_cost(profile, plans[k].actions, None, times["plain"], times[k], keys, lower=k == "all")


def unplanned_step_stats(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    repeats: int = 3,
    *,
    warmup: int = 1,
    optimizer: Any = None,
) -> Dict[str, Any]:
    """Plain training steps (forward, loss, backward, gradients set to None before each), as a
    user runs them without a plan: `warmup` untimed steps, one step under torch.profiler for the
    peak (`cuda_exec.memory.measure_peak`, the executor's own instrument), `repeats` timed steps
    without any instrument.

    Returns {"peak_bytes": constant memory (on a GPU with the kernel libraries' workspaces, as
    allocated when the step starts) + the step's peak of torch's allocations (the same accounting
    as a Profile's measured.peak_bytes), "peak_delta_bytes": the peak above the
    memory at the step's start, "end_delta_bytes": what the step left allocated (its gradients,
    when every free was recorded), "constant_bytes", "step_time": median seconds, "step_times"}.
    The model is left as found."""
    args, dev = _prepare(model, example_inputs, None)
    if int(repeats) < 1:
        raise ProfilerError(f"repeats must be at least 1, got {repeats}")
    memory_mod = _cuda_exec_module("memory")
    if memory_mod is None:
        raise ProfilerError("cuda_exec.memory is not importable: install cuda_exec or put its folder on PYTHONPATH")
    clock = _Clock(dev)
    with _preserved(model, dev):
        model.train()
        for _ in range(max(0, int(warmup))):
            _run_step(model, args, loss_fn)
        _clear_grads(model)
        gc.collect()
        clock.sync()
        # as the profile's memory step: what the warm-up left allocated beyond parameters, state
        # and inputs (cuBLAS's workspace per handle) is the step's too
        at_start = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        # the executor's instrument (cuda_exec.memory), so that planned and unplanned steps are
        # measured the same way
        _, trace = memory_mod.measure_peak(_run_step, model, args, loss_fn, device=dev.type)
        delta = int(trace.peak_bytes)
        times = [_timed_plain_step(model, args, loss_fn, clock) for _ in range(int(repeats))]
        _clear_grads(model)
        constant = sum(_constant_memory(model, args, optimizer, at_start=at_start).values())
    return {
        "peak_bytes": constant + delta,
        "peak_delta_bytes": delta,
        "end_delta_bytes": int(trace.final_bytes),
        "constant_bytes": constant,
        "step_time": statistics.median(times),
        "step_times": times,
    }
