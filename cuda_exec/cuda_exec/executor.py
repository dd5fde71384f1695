"""The plan executor: train under a plan of retain / swap / recompute, one action per unit.

``PlannedModule(model, plan, backend=...)`` is an ``nn.Module`` that shares ``model``'s parameters
and runs each training forward under the plan; the user's own loop, loss and optimizer are
unchanged, for any number of steps. In eval mode or with gradients disabled it simply runs the
model.

How a step runs (docs/cost-model.md is the contract):

* The forward runs inside a :class:`~cuda_exec.units.UnitTracker`, which cuts it into units and
  says which unit owns every tensor autograd saves (units.py). The owner's action applies:

  - **retain**: autograd keeps the tensor, as without a plan.
  - **swap**: at pack time the tensor's whole storage is queued for a device-to-host copy through
    the backend (once per storage, however many views or units save it); autograd keeps a small
    handle. The device bytes are freed when the copy has run and the forward no longer uses them.
    At the start of the backward stage the plan's ``prefetch`` names, the copy back is issued;
    the tensor's unpack waits only if that copy is late (or issues it if no stage did). If the
    offload has not even run when the tensor is needed, the still-alive device tensor is used.
  - **recompute**: the tensor is dropped at pack time (autograd keeps a handle). When the backward
    first needs one of the unit's tensors, the unit's segment (its module call plus the glue after
    it) is replayed under ``enable_grad`` with saved-tensor hooks that capture the regenerated
    tensors, like non-reentrant checkpointing: the CPU (and CUDA) RNG state, autocast state and
    grad mode of the original forward are restored, the unit's buffers (BatchNorm running
    statistics) are put back bit for bit afterwards. Its inputs are obtained through their own
    owners' actions (retained, fetched from the host, or replayed first: chained recomputation,
    also through a saved glue value of a unit whose module output is not saved, such as the
    softmax output an attention dropout reads); inputs nobody saves are held from the forward
    (``held_input_bytes``), with a private copy when the unit or later code writes into them in
    place. A replay lets go of every value of the segment right after its last use in the
    segment, keeping only the regenerated saved tensors and the values later replays read (so it
    holds no more than the original forward did). Held inputs and the saved RNG state are
    released after the replay. Zero-length profiler ranges ``tensorplace::R<unit>`` /
    ``tensorplace::r<unit>`` mark every replay (``MARK_PREFIX``) when torch.profiler runs.

* Every moved or dropped tensor is freed, like any saved tensor, after the last backward node
  that reads it has run (its handle dies with the node's saved variables). A dropped tensor that
  the forward's own code still references (a local variable of an enclosing module) stays on the
  device until the forward lets go of it; ``StepStats.dropped_alive`` reports those bytes per
  unit and stage boundary (the profiler turns them into ``lingering_bytes``).
* Verify mode (``verify=True`` or ``TENSORPLACE_VERIFY=1``) checksums every swapped or dropped
  tensor at pack time and checks it at unpack (verify.py).
* An exception (or KeyboardInterrupt) in the forward, or in one of the executor's backward hooks,
  aborts the step: all hooks are gone, every host buffer is released, the next step starts clean.

The lean path (issue 6: the executor was host-bound, ~430-550 us per unit on this CPU)
------------------------------------------------------------------------------------------
The step above (the *full* step) runs the whole ownership analysis: module hooks registered per
step, a TorchFunctionMode on every torch call, storage/version bookkeeping at every pack. For a
plan without recomputed units only the owner's action of each saved tensor matters, and that
is a function of the step's order. So:

* **Learn once.** The executor's first step is a full step that also records a table
  (:class:`_Table`): the sequence of unit-module calls and, per pack of the step in order, the
  action of its owner (retain / swap) and the first pack of the same storage version (a storage
  saved several times, or through views, is copied once).
* **Install once, arm per step.** After that step one forward pre-hook per unit module is
  installed (it holds no reference to the executor; ``close()``, a failed step, or the executor's
  garbage collection remove it). A steady step arms a small frame (:class:`_LeanStep`); outside a
  step the hooks return at once. There is no TorchFunctionMode (no Python per torch op), and
  an all-retain plan installs no saved-tensor hooks at all.
* **Per pack** (swap plans only): a counter, a table lookup, ``return tensor`` if the owner
  retains; for a swap one ``backend.offload`` (one copy and one completion event per storage)
  and a handle; a later pack of the same storage is checked to be that storage version (weak
  storage reference and version counter) and shares the copy.
* **Checks that turn a different order into an error, never into wrong tensors.** Each unit
  start checks the module against the table and the number of packs made so far; the end of the
  forward checks both totals; dedupe is checked by identity. A mismatch raises
  :class:`PlanMismatchError`, aborts the step, removes the hooks; the next step learns again.
  A different batch size is fine (views are rebuilt from each step's own metadata).
* **Stage boundaries** do work only where the plan needs it (a swap-out may have completed, a
  swap deadline, a prefetch stage's gradient hook on the unit's inputs).
* **Swap deadlines** call ``backend.release_offload``: on CUDA the compute stream waits for the
  copy's event (``cudaStreamWaitEvent``) and the source is dropped, the host does not block; the
  CPU backend (no streams) waits on the host, counted in ``StepStats.deadline_wait_s`` /
  ``deadline_waits``. The full step uses the same call.

Plans with recomputed units still run the full step every step: a replay needs the recorded
glue calls and the identity of each input value (retained, swapped or replayed producer), which
the full tracker provides. Scoping the TorchFunctionMode and the value registry to recompute
segments (with the first step's table resolving inputs by order) is the next step; until then
such plans pay the full per-unit overhead on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .units import (
    InputRef,
    PackInfo,
    Segment,
    UnitSpec,
    UnitTracker,
    ValueRec,
    ViewMeta,
    discover_units,
    is_replaying,
    model_input_position,
    replaying,
)
from .verify import check, checksum, verify_from_env

__all__ = [
    "ACTIONS",
    "PlanMismatchError",
    "StepAbortedError",
    "ReplayError",
    "StepStats",
    "read_plan",
    "read_swap_deadlines",
    "Executor",
    "PlannedModule",
    "execute",
    "default_backend",
    "replay_state_bytes",
    "MARK_PREFIX",
]

ACTIONS = ("retain", "swap", "recompute")

PlanLike = Union[Mapping[str, Any], Sequence[str], Any]


#: Prefix of the zero-length profiler ranges the executor drops around every replay,
#: ``tensorplace::R<unit>`` before the segment runs and ``tensorplace::r<unit>`` after it, so that a
#: memory trace (torch.profiler with profile_memory) can be cut at replays. The profiler measures
#: ``replay_transient_bytes`` with them.
MARK_PREFIX = "tensorplace::"
_profiler_enabled = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def _mark(label: str) -> None:
    if _profiler_enabled():
        with torch.profiler.record_function(MARK_PREFIX + label):
            pass


class PlanMismatchError(RuntimeError):
    """The model's unit sequence in this step does not match the plan (data-dependent control
    flow, another model, or other unit choices)."""


class StepAbortedError(RuntimeError):
    """A saved tensor of an aborted step was needed."""


class ReplayError(RuntimeError):
    """A recomputed unit could not be replayed exactly."""


@dataclass
class StepStats:
    """What one planned step did (filled in during forward and backward)."""

    units: int = 0
    swap_storages: int = 0  #: storages offloaded
    swap_bytes: int = 0  #: bytes offloaded
    dropped_tensors: int = 0  #: saved tensors dropped for recomputation
    replays: int = 0  #: unit replays
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
    aborted: bool = False


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
        if int(plan.get("version", 1)) > 1:
            raise ValueError(f"plan version {plan.get('version')} is newer than this executor (1)")
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


def read_swap_deadlines(plan: PlanLike) -> List[Tuple[str, int]]:
    """``[(stage_label, unit)]``: the swap-outs a plan says have completed before each stage."""
    if isinstance(plan, (str, os.PathLike)) and str(plan).endswith(".json"):
        with open(plan) as f:
            plan = json.load(f)
    if hasattr(plan, "to_dict") and not isinstance(plan, Mapping):
        plan = plan.to_dict()
    if not isinstance(plan, Mapping):
        return []
    return [(str(d["before"]), int(d["unit"])) for d in plan.get("swap_deadlines", []) or []]


def replay_state_bytes(device: Any) -> int:
    """Bytes of ``device`` memory a recomputed unit keeps from its forward to its replay besides
    its held inputs: the random-number generator states restored for the replay. They are CPU
    tensors, so this is 0 on a GPU and the CPU generator's state size on the CPU."""
    return torch.get_rng_state().untyped_storage().nbytes() if torch.device(device).type == "cpu" else 0


def default_backend(device: torch.device) -> Any:
    """The backend for tensors on ``device``: CpuBackend on CPU, CudaBackend on CUDA."""
    if device.type == "cuda":
        from .cuda_backend import CudaBackend  # type: ignore[import-not-found]

        return CudaBackend()
    from .cpu_backend import CpuBackend

    return CpuBackend()


# ------------------------------------------------------------------------------------------
# Step state: swap entries, recompute runtimes, handles
# ------------------------------------------------------------------------------------------


class _Entry:
    """One swapped storage version."""

    __slots__ = ("state", "unit", "nbytes", "device", "host", "fetched", "refs", "prefetched", "value",
                 "ref", "version")

    def __init__(self, state: "_StepState", unit: int, value: Any, t: torch.Tensor) -> None:
        self.state = state
        self.unit = unit
        self.value = value  #: the ValueRec (full path) or the pack index (lean path) it is keyed by
        st = t.untyped_storage()
        self.ref = StorageWeakRef(st)  #: which storage, to check that a later pack is the same one
        self.version = t._version
        self.nbytes = st.nbytes()
        self.device = t.device
        byte_view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        self.host: Any = state.backend.offload(byte_view)
        self.fetched: Optional[torch.Tensor] = None
        self.refs = 0
        self.prefetched = False

    def prefetch(self) -> None:
        if self.host is not None and self.fetched is None and not self.prefetched:
            self.prefetched = True
            self.state.backend.prefetch(self.host)
            self.state.stats.prefetches += 1

    def storage(self) -> torch.UntypedStorage:
        if self.fetched is None:
            if self.host is None:
                raise StepAbortedError("a swapped tensor of an aborted step was needed")
            if not self.prefetched:
                self.state.stats.unscheduled_fetches += 1
            t0 = time.perf_counter()
            self.fetched = self.state.backend.fetch(self.host)
            self.state.stats.fetch_s += time.perf_counter() - t0
        return self.fetched.untyped_storage()

    def incref(self) -> None:
        self.refs += 1

    def decref(self) -> None:
        self.refs -= 1
        if self.refs <= 0:
            self.free()

    def free(self) -> None:
        self.fetched = None
        if self.host is not None:
            host, self.host = self.host, None
            self.state.backend.release(host)
        if self.state.entries.get(self.value) is self:
            del self.state.entries[self.value]


class _InputSlot:
    """How a recomputed unit gets one of its inputs back for its replay."""

    __slots__ = ("kind", "tensor", "entry", "rt", "value", "meta", "device", "version",
                 "requires_grad", "protected", "nbytes", "state")

    def __init__(self, state: "_StepState", ref: InputRef, t: torch.Tensor) -> None:
        self.state = state
        self.kind = "tensor"  # "tensor" (held or retained), "entry" (swapped), "replay" (recomputed)
        self.tensor: Optional[torch.Tensor] = t.detach()
        self.entry: Optional[_Entry] = None
        self.rt: Optional["_UnitRuntime"] = None
        self.value = ref.value
        self.meta = ref.meta
        self.device = t.device
        self.version = t._version
        self.requires_grad = t.requires_grad
        self.protected = False
        self.nbytes = 0

    def protect(self, storage: Optional[torch.UntypedStorage] = None) -> torch.UntypedStorage:
        """Replace the held tensor by the same view of a private copy of its storage (made now,
        or ``storage``, a copy already made for another slot of the same value)."""
        assert self.tensor is not None
        if storage is None:
            storage = self.tensor.untyped_storage().clone()
            self.state.stats.held_bytes += storage.nbytes()
        self.tensor = self.meta.view_of(storage, self.device)
        self.version = self.tensor._version
        self.protected = True
        return storage

    def to_entry(self, entry: _Entry) -> None:
        self.kind, self.entry, self.tensor = "entry", entry, None
        entry.incref()

    def to_replay(self, rt: "_UnitRuntime") -> None:
        self.kind, self.rt, self.tensor = "replay", rt, None
        rt.value_refs[self.value] += 1

    def get(self) -> torch.Tensor:
        if self.kind == "tensor":
            t = self.tensor
            if t is None:
                raise StepAbortedError("an input of a recomputed unit was released")
            if t._version != self.version:
                raise ReplayError(
                    "an input of a recomputed unit was modified in place after the unit read it; "
                    "choose another action for that unit"
                )
            return t
        if self.kind == "entry":
            assert self.entry is not None
            return self.meta.view_of(self.entry.storage(), self.device)
        assert self.rt is not None
        self.rt.ensure_replayed()
        base = self.rt.values.get(self.value)
        if base is None:
            raise ReplayError(f"unit {self.rt.unit}'s replay did not regenerate an input of a later replay")
        return self.meta.view_of(base.untyped_storage(), self.device)

    def release(self) -> None:
        kind, self.kind = self.kind, "released"
        self.tensor = None
        if kind == "entry" and self.entry is not None:
            entry, self.entry = self.entry, None
            entry.decref()
        elif kind == "replay" and self.rt is not None:
            rt, self.rt = self.rt, None
            rt.decref_value(self.value)


class _Attach(torch.autograd.Function):
    """Makes a held tensor a non-leaf that requires grad without copying it, so the replay sees
    the same autograd situation as the original forward (in-place ops on it are allowed)."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, holder: List[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return holder[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None]:  # type: ignore[override]
        return None, None


class _UnitRuntime:
    """A recomputed unit in one step: what its replay needs and what it regenerated."""

    def __init__(self, state: "_StepState", unit: int, seg: Segment) -> None:
        self.state = state
        self.unit = unit
        self.seg = seg
        self.rng_cpu: Optional[torch.Tensor] = None
        self.rng_cuda: List[Tuple[int, torch.Tensor]] = []
        self.autocast: List[Tuple[str, bool, torch.dtype]] = []
        self.grad_enabled = True
        self.slot_refs: Set[int] = set()  # pack indices (in this segment) with a live handle
        self.value_refs: Counter = Counter()  # ValueRec -> live handles and chained input slots
        self.slots: Dict[int, torch.Tensor] = {}
        self.values: Dict[ValueRec, torch.Tensor] = {}
        self.replayed = False
        self.inputs_released = False
        self.forward_done = False

    # -------------------------------------------------------------- reference counting

    def decref_slot(self, i: int) -> None:
        self.slot_refs.discard(i)
        self.slots.pop(i, None)
        self._maybe_release()

    def decref_value(self, v: ValueRec) -> None:
        self.value_refs[v] -= 1
        if self.value_refs[v] <= 0:
            del self.value_refs[v]
            self.values.pop(v, None)
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.forward_done and not self.replayed and not self.slot_refs and not self.value_refs:
            self.release_inputs()  # nobody will need the replay any more

    def release_inputs(self) -> None:
        if self.inputs_released:
            return
        self.inputs_released = True
        self.rng_cpu = None
        self.rng_cuda = []
        for ref in self.seg.inputs:
            slot = ref.slot
            ref.slot = None
            if isinstance(slot, _InputSlot):
                slot.release()

    # -------------------------------------------------------------- replay

    def ensure_replayed(self) -> None:
        if self.replayed:
            return
        self.state.check_alive()
        # every recomputed unit this replay needs, replayed producers first (their index is lower)
        todo: Dict[int, _UnitRuntime] = {}
        stack = [self]
        while stack:
            rt = stack.pop()
            if rt.replayed or rt.unit in todo:
                continue
            todo[rt.unit] = rt
            for ref in rt.seg.inputs:
                slot = ref.slot
                if isinstance(slot, _InputSlot) and slot.kind == "replay" and slot.rt is not None:
                    stack.append(slot.rt)
        for unit in sorted(todo):
            todo[unit]._replay()

    def _resolve(self, leaves: List[Tuple[str, Any]], seg_values: Dict[int, torch.Tensor],
                 inputs: Dict[int, torch.Tensor]) -> List[Any]:
        out: List[Any] = []
        for kind, x in leaves:
            if kind == "lit" or kind == "const":
                out.append(x)
            elif kind == "seg":
                out.append(seg_values[x])
            else:  # "in"
                out.append(inputs[x])
        return out

    def _replay(self) -> None:
        state = self.state
        seg = self.seg
        if self.inputs_released:
            raise ReplayError(f"unit {self.unit} ({state.names[self.unit]}) cannot be replayed: its inputs were released")
        t0 = time.perf_counter()
        # inputs, as the original forward saw them (same requires_grad, non-leaf when differentiable)
        dummy = torch.zeros((), requires_grad=True)
        inputs: Dict[int, torch.Tensor] = {}
        for i, ref in enumerate(seg.inputs):
            slot = ref.slot
            if not isinstance(slot, _InputSlot):
                raise ReplayError(f"unit {self.unit}: input {i} has no slot")
            t = slot.get().detach()
            if slot.requires_grad:
                with torch.enable_grad():  # backward runs with grad mode off
                    t = _Attach.apply(dummy, [t])
            inputs[i] = t

        packs = seg.packs
        count = 0
        captured: Dict[int, torch.Tensor] = {}

        def cap_pack(t: torch.Tensor) -> None:
            nonlocal count
            i = count
            count += 1
            if i < len(packs):
                owned, meta = packs[i]
                if owned and i in self.slot_refs:
                    if meta is not None and ViewMeta.of(t) != meta:
                        raise ReplayError(
                            f"unit {self.unit} ({state.names[self.unit]}): replayed saved tensor {i} "
                            f"is {ViewMeta.of(t)}, the original was {meta}"
                        )
                    captured[i] = t.detach()
            return None

        def cap_unpack(_: Any) -> torch.Tensor:
            raise ReplayError("the replay graph is not differentiable")

        restore: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for b in list(seg.module.buffers()) + list(seg.mutated_params):
            restore.append((b, b.detach().clone()))
        cuda_devices = [d for d, _ in self.rng_cuda]
        _mark(f"R{self.unit}")
        seg_values: Dict[int, torch.Tensor] = {}
        # Every segment value is let go right after its last use in the replay (the module call,
        # -1, or glue call c), unless a later replay or a saved-tensor handle needs it (`values`).
        # So the replay holds no more than the original forward, which kept each value at least
        # that long (the profiler measures what it does hold: replay_transient_bytes).
        needed = {j for j, vals in enumerate(seg.value_keys)
                  if any(self.value_refs.get(v, 0) > 0 for v in vals)}
        last_use: Dict[int, int] = {j: -1 for _pos, j in seg.out_values}
        for c, call in enumerate(seg.calls):
            for kind, x in call.leaves:
                if kind == "seg":
                    last_use[x] = c
            for _pos, j in call.out_values + call.mutated:
                last_use[j] = c
        let_go: Dict[int, List[int]] = defaultdict(list)
        for j, c in last_use.items():
            if j not in needed:
                let_go[c].append(j)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(replaying())
                stack.enter_context(torch.random.fork_rng(devices=cuda_devices))
                if self.rng_cpu is not None:
                    torch.set_rng_state(self.rng_cpu)
                for d, st in self.rng_cuda:
                    torch.cuda.set_rng_state(st, d)
                for dev, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(cap_pack, cap_unpack))
                with torch.set_grad_enabled(self.grad_enabled):
                    flat = self._resolve(seg.arg_leaves, seg_values, inputs)
                    args, kwargs = pytree.tree_unflatten(flat, seg.arg_spec)
                    out = seg.module(*args, **kwargs)
                out_leaves, _ = pytree.tree_flatten(out)
                for pos, j in seg.out_values:
                    seg_values[j] = out_leaves[pos]
                del flat, args, kwargs, out, out_leaves
                for j in let_go.get(-1, ()):
                    seg_values.pop(j, None)
                for c, call in enumerate(seg.calls):
                    flat = self._resolve(call.leaves, seg_values, inputs)
                    args, kwargs = pytree.tree_unflatten(flat, call.spec)
                    with torch.set_grad_enabled(call.grad_enabled):
                        res = call.func(*args, **kwargs)
                    res_leaves, _ = pytree.tree_flatten(res)
                    for pos, j in call.out_values:
                        seg_values[j] = res_leaves[pos]
                    for pos, j in call.mutated:
                        seg_values[j] = flat[pos]
                    del flat, args, kwargs, res, res_leaves
                    for j in let_go.get(c, ()):
                        seg_values.pop(j, None)
        finally:
            with torch.no_grad():
                for b, saved in restore:
                    b.data.copy_(saved)
        if count != len(packs):
            raise ReplayError(
                f"unit {self.unit} ({state.names[self.unit]}): the replay saved {count} tensors, "
                f"the original forward {len(packs)}"
            )
        values: Dict[ValueRec, torch.Tensor] = {}
        for j, vals in enumerate(seg.value_keys):
            for v in vals:
                if self.value_refs.get(v, 0) > 0:
                    if j not in seg_values:
                        raise ReplayError(f"unit {self.unit}: the replay did not produce segment value {j}")
                    values[v] = seg_values[j].detach()
        del seg_values, inputs
        self.slots = captured
        self.values = values
        self.replayed = True
        _mark(f"r{self.unit}")
        self.release_inputs()
        state.stats.replays += 1
        state.stats.replay_s += time.perf_counter() - t0


class _Handle:
    """What autograd keeps for a swapped or dropped saved tensor."""

    __slots__ = ("state", "meta", "device", "digest", "what", "__weakref__")

    def __init__(self, state: "_StepState", meta: ViewMeta, device: torch.device, digest: Optional[str], what: str) -> None:
        self.state = state
        self.meta = meta
        self.device = device
        self.digest = digest
        self.what = what

    def unpack(self) -> torch.Tensor:
        raise NotImplementedError


class _SwapHandle(_Handle):
    __slots__ = ("entry",)

    def __init__(self, state: "_StepState", entry: _Entry, meta: ViewMeta, device: torch.device,
                 digest: Optional[str], what: str) -> None:
        super().__init__(state, meta, device, digest, what)
        self.entry = entry
        entry.incref()

    def unpack(self) -> torch.Tensor:
        self.state.check_alive()
        t = self.meta.view_of(self.entry.storage(), self.device)
        check(t, self.digest, self.what)
        return t

    def __del__(self) -> None:
        try:
            if not self.state.dead:
                self.entry.decref()
        except Exception:  # pragma: no cover - never raise from __del__
            pass


class _ReplayHandle(_Handle):
    __slots__ = ("rt", "slot", "value")

    def __init__(self, state: "_StepState", rt: _UnitRuntime, slot: Optional[int], value: Optional[ValueRec],
                 meta: ViewMeta, device: torch.device, digest: Optional[str], what: str) -> None:
        super().__init__(state, meta, device, digest, what)
        self.rt = rt
        self.slot = slot
        self.value = value
        if slot is not None:
            rt.slot_refs.add(slot)
        else:
            rt.value_refs[value] += 1

    def unpack(self) -> torch.Tensor:
        self.state.check_alive()
        self.rt.ensure_replayed()
        if self.slot is not None:
            t = self.rt.slots.get(self.slot)
            if t is None:
                raise ReplayError(f"unit {self.rt.unit}: saved tensor {self.slot} was not regenerated")
        else:
            base = self.rt.values.get(self.value)  # type: ignore[arg-type]
            if base is None:
                raise ReplayError(f"unit {self.rt.unit}: a saved value was not regenerated")
            t = self.meta.view_of(base.untyped_storage(), self.device)
        check(t, self.digest, self.what)
        return t

    def __del__(self) -> None:
        try:
            if not self.state.dead:
                if self.slot is not None:
                    self.rt.decref_slot(self.slot)
                else:
                    self.rt.decref_value(self.value)  # type: ignore[arg-type]
        except Exception:  # pragma: no cover
            pass


class _StepState:
    """Everything one planned forward/backward owns."""

    def __init__(self, ex: "Executor") -> None:
        self.backend = ex.backend
        self.actions = ex.actions
        self.names: List[str] = []
        self.plan_names = ex.names
        self.verify = ex.verify
        self.prefetch_at = ex.prefetch_at
        self.swap_deadlines = ex.swap_deadlines
        self.stats = StepStats()
        self.entries: Dict[ValueRec, _Entry] = {}
        self.by_unit: Dict[int, List[_Entry]] = defaultdict(list)
        self.runtimes: Dict[int, _UnitRuntime] = {}
        self.direct_slots: Dict[ValueRec, List[_InputSlot]] = defaultdict(list)
        #: storage key -> (unit, storage, bytes) of tensors dropped for recomputation that the
        #: forward may still hold
        self.dropped: Dict[int, Tuple[int, StorageWeakRef, int]] = {}
        self.fired: Set[int] = set()
        self.dead = False
        self.backward_running = False
        self._warned = False
        #: a failed step also removes the executor's unit hooks (the next step re-learns)
        self.on_abort = ex._uninstall

    def drop(self, unit: int, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        if ref.cdata not in self.dropped:
            self.dropped[ref.cdata] = (unit, ref, st.nbytes())

    def note_dropped_alive(self, stage: int) -> None:
        """At the start of forward stage ``stage`` (``units`` after the last one): the dropped
        tensors the forward still holds (StepStats.dropped_alive)."""
        alive = self.stats.dropped_alive
        for key, (unit, ref, nbytes) in list(self.dropped.items()):
            if ref.expired():
                del self.dropped[key]
            else:
                per_stage = alive.setdefault(unit, {})
                per_stage[stage] = per_stage.get(stage, 0) + nbytes

    def check_alive(self) -> None:
        if self.dead:
            raise StepAbortedError("this step was aborted; run a new forward")

    def action(self, unit: int) -> str:
        return self.actions[unit] if 0 <= unit < len(self.actions) else "retain"

    def abort(self) -> None:
        """Drop everything: host buffers, fetched and replayed tensors, held inputs."""
        if self.dead:
            return
        self.dead = True
        self.stats.aborted = True
        self.on_abort()
        for e in list(self.entries.values()):
            e.free()
        for lst in self.by_unit.values():
            for e in lst:
                e.free()
        self.entries.clear()
        self.by_unit.clear()
        for rt in self.runtimes.values():
            rt.slots.clear()
            rt.values.clear()
            for ref in rt.seg.inputs:
                slot = ref.slot
                ref.slot = None
                if isinstance(slot, _InputSlot):
                    slot.tensor = None
                    slot.entry = None
                    slot.rt = None
                    slot.kind = "released"
            rt.inputs_released = True
        self.direct_slots.clear()
        self.dropped = {}

    def enter_backward(self) -> None:
        """Called by the executor's hooks in backward: note that a backward of this step runs
        until the engine's end-of-backward callback says it finished (it does not on errors)."""
        if not self.backward_running and torch._C._current_graph_task_id() != -1:
            self.backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.backward_running = False

    def guarded(self, fn: Any) -> Any:
        """Wrap a backward-time callback so any exception aborts the step first."""

        def run(*a: Any) -> Any:
            try:
                return fn(*a)
            except BaseException:
                self.abort()
                raise

        return run

    def stage_boundary(self, label: str) -> None:
        """At the start of a stage: free the device bytes of completed swap-outs, and wait for
        the swap-outs the plan says have left the device before this stage (the cost model's
        swap deadlines), so the executor's memory follows the model's."""
        poll = getattr(self.backend, "poll", None)
        if poll is not None:
            poll()
        units = self.swap_deadlines.get(label)
        if not units:
            return
        # release_offload: the compute stream waits for the copy and the source is dropped (CUDA:
        # a device-side wait, the host does not block; CPU: no streams, the host waits)
        wait = getattr(self.backend, "release_offload", None) or getattr(self.backend, "wait_offload", None)
        if wait is None:
            return
        t0 = time.perf_counter()
        for u in units:
            for e in self.by_unit.get(u, ()):
                if e.host is not None and e.fetched is None and not e.prefetched:
                    wait(e.host)
                    self.stats.deadline_waits += 1
        self.stats.deadline_wait_s += time.perf_counter() - t0

    def issue_prefetches(self, stage: int) -> None:
        self.enter_backward()
        if stage in self.fired or self.dead:
            return
        self.fired.add(stage)
        self.stage_boundary(f"bwd:{stage}")
        self.stats.prefetch_stages.append(stage)
        for u in self.prefetch_at.get(stage, ()):
            for e in self.by_unit.get(u, ()):
                e.prefetch()


class _Table:
    """What the executor's first (full) step found, by call and pack order: the lean steps' map.

    ``modules[c]``: the unit module of the c-th unit-module call of the forward (nested calls
    included), ``call_unit[c]``: the unit it starts, or -1 for a call inside another unit.
    ``pack_start[u]``: packs made before unit u started. Per pack k of the step: ``acts[k]``
    (0 retain, 1 swap), ``first[k]`` (the first pack of the same storage version: a swap copies a
    storage once, however many views or units save it) and ``owner[k]``."""

    def __init__(self) -> None:
        self.modules: List[nn.Module] = []
        self.call_unit: List[int] = []
        self.pack_start: List[int] = []
        self.acts: List[int] = []
        self.first: List[int] = []
        self.owner: List[int] = []
        self.names: List[str] = []
        self._entry_first: Dict[int, int] = {}

    def finish(self, names: List[str]) -> "_Table":
        self.names = list(names)
        self._entry_first = {}
        n = len(self.pack_start)
        #: per unit: its segment makes a swapped pack (the pack hooks are on only there)
        self.armed = [False] * n
        u = 0
        for k, a in enumerate(self.acts):
            while u + 1 < n and self.pack_start[u + 1] <= k:
                u += 1
            if a and n:
                self.armed[u] = True
        return self

    def seg_end(self, u: int) -> int:
        """Packs made before the end of unit u's segment."""
        return self.pack_start[u + 1] if u + 1 < len(self.pack_start) else len(self.acts)

    @property
    def swaps(self) -> int:
        return sum(self.acts)


class _PlanTracker(UnitTracker):
    """The UnitTracker with the plan's policy at every pack. ``learn``: a :class:`_Table` to
    fill with what the step does (for plans the lean path runs)."""

    def __init__(self, ex: "Executor", state: _StepState, learn: Optional[_Table] = None) -> None:
        super().__init__(ex.model, keep_replay_info=True, unit_modules=ex.unit_modules)
        self.state = state
        self.learn = learn

    def _pre_hook(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        learn = self.learn
        if learn is None or not self._active or is_replaying():
            return super()._pre_hook(module, args, kwargs)
        n = len(self.segments)
        super()._pre_hook(module, args, kwargs)
        new = len(self.segments) > n
        learn.modules.append(module)
        learn.call_unit.append(n if new else -1)
        if new:
            learn.pack_start.append(len(learn.acts))

    def _pack_hook(self, t: torch.Tensor) -> Any:
        learn = self.learn
        if learn is None or not self._active or self._busy > 0 or is_replaying():
            return super()._pack_hook(t)
        out = super()._pack_hook(t)
        k = len(learn.acts)
        if isinstance(out, _SwapHandle):
            learn.acts.append(1)
            learn.first.append(learn._entry_first.setdefault(id(out.entry), k))
            learn.owner.append(out.entry.unit)
        else:
            learn.acts.append(0)
            learn.first.append(k)
            learn.owner.append(-1)
        return out

    # units --------------------------------------------------------------------------

    def on_unit_start(self, index: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        st = self.state
        rec = self.records[index]
        st.names.append(rec.name)
        if index >= len(st.actions):
            raise PlanMismatchError(
                f"the model ran more units than the plan has ({len(st.actions)}); unit {index} is {rec.name!r}"
            )
        if st.plan_names is not None and st.plan_names[index] != rec.name:
            raise PlanMismatchError(
                f"unit {index} is {rec.name!r} but the plan says {st.plan_names[index]!r} "
                "(data-dependent control flow or a different model)"
            )
        st.stats.units = index + 1
        st.note_dropped_alive(index)
        st.stage_boundary(f"fwd:{index}")
        if st.action(index) == "recompute":
            rt = self._runtime_for(self.segments[index])
            assert rt is not None
            rt.grad_enabled = torch.is_grad_enabled()
            rt.rng_cpu = torch.get_rng_state()
            devices = sorted({ref.device.index or 0 for ref in self.segments[index].inputs if ref.device.type == "cuda"})
            if devices and torch.cuda.is_available():
                rt.rng_cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices]
            rt.autocast = []
            for dev in ("cpu", "cuda"):
                try:
                    if torch.is_autocast_enabled(dev):
                        rt.autocast.append((dev, True, torch.get_autocast_dtype(dev)))
                except (RuntimeError, TypeError):  # pragma: no cover - device type unsupported
                    pass

    def on_segment_value(self, segment: Segment, index: int, tensor: torch.Tensor) -> None:
        st = self.state
        if segment.unit in st.prefetch_at and tensor.requires_grad and tensor.grad_fn is not None:
            unit = segment.unit
            tensor.register_hook(st.guarded(lambda grad: st.issue_prefetches(unit)))

    # inputs of recomputed units ----------------------------------------------------------

    def _runtime_for(self, segment: Segment) -> Optional[_UnitRuntime]:
        st = self.state
        if st.action(segment.unit) != "recompute":
            return None
        rt = st.runtimes.get(segment.unit)
        if rt is None:
            rt = st.runtimes[segment.unit] = _UnitRuntime(st, segment.unit, segment)
        return rt

    def on_input(self, segment: Segment, ref: InputRef, tensor: torch.Tensor, will_modify: bool) -> None:
        st = self.state
        val = ref.value
        if will_modify:
            # protect the held copies of other recomputed units before this write
            copy: Optional[torch.UntypedStorage] = None
            for other in st.direct_slots.get(val, []):
                if other.kind == "tensor" and not other.protected:
                    copy = other.protect(copy)
        rt = self._runtime_for(segment)
        if rt is None:
            return
        slot = _InputSlot(st, ref, tensor)
        ref.slot = slot
        owner = val.owner
        owner_action = st.action(owner) if owner >= 0 else "retain"
        if will_modify:
            slot.protect()
        elif val.saved and owner_action == "swap" and val in st.entries:
            slot.to_entry(st.entries[val])
        elif val.saved and owner_action == "recompute" and val in self.segments[owner].owned_values:
            owner_rt = self._runtime_for(self.segments[owner])
            assert owner_rt is not None
            slot.to_replay(owner_rt)
        else:
            st.direct_slots[val].append(slot)
            if not val.saved and model_input_position(owner) is None:
                st.stats.held_bytes += val.nbytes

    # packs ----------------------------------------------------------------------------------

    def _convert_slots(self, val: ValueRec, entry: Optional[_Entry], rt: Optional[_UnitRuntime]) -> None:
        slots = self.state.direct_slots.pop(val, None)
        if not slots:
            return
        keep: List[_InputSlot] = []
        for slot in slots:
            if slot.kind != "tensor" or slot.protected:
                keep.append(slot)
            elif entry is not None:
                slot.to_entry(entry)
            elif rt is not None and val in rt.seg.owned_values:
                slot.to_replay(rt)
            else:
                keep.append(slot)
        if keep:
            self.state.direct_slots[val] = keep

    def on_pack(self, tensor: torch.Tensor, info: PackInfo) -> Any:
        st = self.state
        if info.kind != "activation" or info.owner < 0 or info.value is None or info.meta is None:
            return tensor
        owner = info.owner
        act = st.action(owner)
        if act == "retain":
            return tensor
        val = info.value
        digest = checksum(tensor) if st.verify else None
        what = (f"{act} of a saved tensor of unit {owner} ({st.names[owner] if owner < len(st.names) else owner})"
                if st.verify else "")  # the message of a failed check only
        if act == "swap":
            entry = st.entries.get(val)
            if entry is None or entry.host is None:
                entry = _Entry(st, owner, val, tensor)
                st.entries[val] = entry
                st.by_unit[owner].append(entry)
                st.stats.swap_storages += 1
                st.stats.swap_bytes += entry.nbytes
            handle: _Handle = _SwapHandle(st, entry, info.meta, tensor.device, digest, what)
            self._convert_slots(val, entry, None)
            return handle
        rt = self._runtime_for(self.segments[owner])
        assert rt is not None
        if info.in_owner_segment:
            handle = _ReplayHandle(st, rt, info.seg_pack, None, info.meta, tensor.device, digest, what)
        elif val in rt.seg.owned_values:
            handle = _ReplayHandle(st, rt, None, val, info.meta, tensor.device, digest, what)
        else:
            if not st._warned:
                st._warned = True
                warnings.warn(
                    f"unit {owner} ({st.names[owner]}): a saved tensor it owns is not among its outputs "
                    "or glue results, so a replay cannot regenerate it; it is retained",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return tensor
        st.stats.dropped_tensors += 1
        st.drop(owner, tensor)
        self._convert_slots(val, None, rt)
        return handle

    def on_unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Handle):
            try:
                packed.state.enter_backward()
                return packed.unpack()
            except BaseException:
                packed.state.abort()
                raise
        return packed


# ------------------------------------------------------------------------------------------
# The lean path: steady steps of plans without recomputed units
# ------------------------------------------------------------------------------------------


def _unpack_handle(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Handle):
        try:
            packed.state.enter_backward()
            return packed.unpack()
        except BaseException:
            packed.state.abort()
            raise
    return packed


class _LeanStep:
    """One steady step on the lean path: counters, the step's state and the table."""

    __slots__ = ("ex", "state", "t", "calls", "packs", "limit", "armed", "hooks", "work", "post")

    def __init__(self, ex: "Executor", state: _StepState, table: _Table, work: List[bool]) -> None:
        self.ex = ex
        self.state = state
        self.t = table
        self.calls = 0
        self.packs = 0  #: index of the next pack of the step (counted in armed segments)
        self.limit = 0  #: packs made before the end of the armed segment
        self.armed = False  #: the saved-tensor hooks are on (a segment with a swapped pack)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack_handle)
        self.work = work  #: per unit: boundary work to do at its start
        self.post: Optional[Tuple[int, nn.Module]] = None  #: a prefetch stage's unit, running

    # the forward pre-hook of every unit module (installed once, see Executor._install)
    def unit_start(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        c = self.calls
        t = self.t
        if c >= len(t.modules) or t.modules[c] is not module:
            raise self._call_mismatch(c, module)
        self.calls = c + 1
        u = t.call_unit[c]
        if u < 0:
            return
        if self.armed:
            self.disarm(t.pack_start[u])
        if t.armed[u]:
            # the saved-tensor hooks are pushed only for segments that save a swapped tensor:
            # packs elsewhere cost nothing (TE's offload context per layer does the same)
            self.packs = t.pack_start[u]
            self.limit = t.seg_end(u)
            self.hooks.__enter__()
            self.armed = True
        if self.work[u]:
            self.boundary(u, args)

    def disarm(self, expected: Optional[int]) -> None:
        """Pop the saved-tensor hooks at the end of an armed segment; check its pack count
        (``expected`` None: no check, the step is failing)."""
        self.armed = False
        self.hooks.__exit__(None, None, None)
        if expected is not None and self.packs != expected:
            raise PlanMismatchError(
                f"a segment that ended at pack {expected} in the executor's first step ended at "
                f"pack {self.packs} in this forward (data-dependent control flow?)"
            )

    def boundary(self, u: int, args: Tuple[Any, ...]) -> None:
        st = self.state
        if st.by_unit:
            st.stage_boundary(f"fwd:{u}")
        if u in st.prefetch_at:
            self.post = (u, self.t.modules[self.calls - 1])
        s = u - 1
        if s in st.prefetch_at:
            # a fallback if unit s's output had no gradient: the gradients of unit u's inputs
            # arrive after stage u's backward (never before stage s starts)
            self._prefetch_hooks(s, args)

    def _prefetch_hooks(self, s: int, values: Any) -> None:
        st = self.state
        for a in pytree.tree_leaves(values):
            if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is not None:
                a.register_hook(st.guarded(lambda grad, s=s: st.issue_prefetches(s)))

    # the forward hook of the unit modules of prefetch stages
    def unit_end(self, module: nn.Module, output: Any) -> None:
        post = self.post
        if post is not None and post[1] is module:
            self.post = None
            # backward stage u starts (after the glue after it) when its output's gradient arrives
            self._prefetch_hooks(post[0], output)

    def _call_mismatch(self, c: int, module: nn.Module) -> PlanMismatchError:
        t = self.t
        got = self.ex.unit_modules.get(module, type(module).__name__)
        want = self.ex.unit_modules.get(t.modules[c], "?") if c < len(t.modules) else "no further unit"
        return PlanMismatchError(
            f"unit-module call {c} of this forward is {got!r}; in the executor's first step it was "
            f"{want!r} (data-dependent control flow or a different model)"
        )

    # the saved-tensor pack hook (only when the plan swaps something)
    def pack(self, t: torch.Tensor) -> Any:
        k = self.packs
        self.packs = k + 1
        tb = self.t
        if k >= self.limit:
            raise PlanMismatchError(
                f"a segment saved more tensors than in the executor's first step ({self.limit} packs "
                "up to its end; data-dependent control flow?)"
            )
        if tb.acts[k] == 0:
            return t
        return self._swap(k, t)

    def _swap(self, k: int, t: torch.Tensor) -> Any:
        st = self.state
        tb = self.t
        first = tb.first[k]
        owner = tb.owner[k]
        if first == k:
            entry = _Entry(st, owner, k, t)
            st.entries[k] = entry
            st.by_unit[owner].append(entry)
            st.stats.swap_storages += 1
            st.stats.swap_bytes += entry.nbytes
        else:
            entry = st.entries.get(first)  # type: ignore[assignment]
            if (entry is None or entry.host is None or entry.ref.expired() or entry.version != t._version
                    or entry.ref.cdata != StorageWeakRef(t.untyped_storage()).cdata):
                raise PlanMismatchError(
                    f"saved tensor {k} of this forward is not the storage version saved as tensor {first}, "
                    "as it was in the executor's first step (data-dependent control flow?)"
                )
        digest = what = None
        if st.verify:
            digest = checksum(t)
            what = f"swap of a saved tensor of unit {owner} ({tb.names[owner]})"
        return _SwapHandle(st, entry, ViewMeta.of(t), t.device, digest, what or "")

    def finish(self, out: Any) -> None:
        tb = self.t
        if self.calls != len(tb.modules):
            raise PlanMismatchError(
                f"the model ran {self.calls} unit-module calls, {len(tb.modules)} in the executor's first step"
            )
        if self.armed:
            self.disarm(len(tb.acts))
        st = self.state
        st.stats.units = len(tb.pack_start)
        last = len(tb.pack_start) - 1
        prefetch_last = bool(tb.swaps) and last in st.prefetch_at
        # one hook per output and step: the backward of this step starts here
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                if prefetch_last:
                    leaf.register_hook(st.guarded(lambda grad: st.issue_prefetches(last)))
                leaf.register_hook(st.guarded(lambda grad: st.enter_backward()))


def _remove_hooks(handles: List[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


class Executor:
    """Runs forwards of ``model`` under one plan (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        actions: Sequence[str],
        prefetch: Iterable[Tuple[int, int]] = (),
        backend: Any = None,
        *,
        verify: Optional[bool] = None,
        units: Optional[Iterable[UnitSpec]] = None,
        names: Optional[Sequence[str]] = None,
        swap_deadlines: Iterable[Tuple[str, int]] = (),
    ) -> None:
        self.model = model
        #: stage label ("fwd:i" / "bwd:i") -> units whose swap-out must be complete before it
        self.swap_deadlines: Dict[str, List[int]] = defaultdict(list)
        for stage_label, unit in swap_deadlines:
            self.swap_deadlines[str(stage_label)].append(int(unit))
        self.swap_deadlines = dict(self.swap_deadlines)
        self.actions = [_action_name(a) for a in actions]
        self.names = list(names) if names is not None else None
        self.prefetch_at: Dict[int, List[int]] = defaultdict(list)
        for unit, stage in prefetch:
            self.prefetch_at[int(stage)].append(int(unit))
        self.prefetch_at = dict(self.prefetch_at)
        self.unit_modules = discover_units(model, units)
        self.verify = verify_from_env() if verify is None else bool(verify)
        self._own_backend = backend is None
        self._backend = backend
        self.last_stats: Optional[StepStats] = None
        self._states: "weakref.WeakSet[_StepState]" = weakref.WeakSet()
        #: plans without recomputed units run the lean path after the first step
        self.lean = "recompute" not in self.actions
        self._table: Optional[_Table] = None
        self._work: List[bool] = []
        self._cell: List[Optional[_LeanStep]] = [None]  # the armed step, read by the unit hooks
        self._hooks: List[Any] = []
        self._hooks_finalizer: Optional[weakref.finalize] = None

    @property
    def backend(self) -> Any:
        if self._backend is None:
            p = next(self.model.parameters(), None)
            self._backend = default_backend(p.device if p is not None else torch.device("cpu"))
        return self._backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One forward under the plan; the backward of its result follows the plan too."""
        if "swap" in self.actions:
            _ = self.backend
        self.abort_interrupted()
        if self._table is not None:
            return self._lean_forward(args, kwargs)
        state = _StepState(self)
        self._states.add(state)
        self.last_stats = state.stats
        learn = _Table() if self.lean else None
        tracker = _PlanTracker(self, state, learn)
        try:
            with tracker:
                out = self.model(*args, **kwargs)
            # the backward of this step reaches the executor's part of the graph here first
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                    leaf.register_hook(state.guarded(lambda grad: state.enter_backward()))
            if len(tracker.segments) != len(self.actions):
                raise PlanMismatchError(
                    f"the model ran {len(tracker.segments)} units but the plan has {len(self.actions)}"
                )
            state.note_dropped_alive(len(tracker.segments))
            state.dropped = {}
            for rt in state.runtimes.values():
                rt.forward_done = True
            for rt in list(state.runtimes.values()):
                rt._maybe_release()
        except BaseException:
            state.abort()
            raise
        if learn is not None:
            self._arm_lean(learn.finish(state.names))
        return out

    # ------------------------------------------------------------------ the lean path

    def _arm_lean(self, table: _Table) -> None:
        """After a full step of a plan without recomputed units: keep its table, precompute the
        boundary work per unit and install the unit hooks (once; removed by close() or a failed
        step)."""
        n = len(table.pack_start)
        fwd_deadline = {int(label[4:]) for label in self.swap_deadlines if label.startswith("fwd:")}
        first_swap = n
        for k, a in enumerate(table.acts):
            if a:
                first_swap = max(u for u in range(n) if table.pack_start[u] <= k)
                break
        self._work = [u in fwd_deadline or u in self.prefetch_at or (u - 1) in self.prefetch_at or u > first_swap
                      for u in range(n)]
        self._table = table
        self._install()

    def _install(self) -> None:
        if self._hooks:
            return
        cell = self._cell

        def unit_pre_hook(module: nn.Module, args: Tuple[Any, ...]) -> None:
            step = cell[0]
            if step is not None:
                step.unit_start(module, args)

        def unit_post_hook(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            step = cell[0]
            if step is not None:
                step.unit_end(module, output)

        table = self._table
        assert table is not None
        post = {id(table.modules[c]) for c, u in enumerate(table.call_unit) if u in self.prefetch_at}
        for module in self.unit_modules:
            self._hooks.append(module.register_forward_pre_hook(unit_pre_hook))
            if id(module) in post:  # modules of prefetch stages' units
                self._hooks.append(module.register_forward_hook(unit_post_hook))
        # the hooks hold no reference to the executor; if it is dropped without close(), they go
        self._hooks_finalizer = weakref.finalize(self, _remove_hooks, self._hooks)

    def _uninstall(self) -> None:
        self._cell[0] = None
        self._table = None
        if self._hooks_finalizer is not None:
            self._hooks_finalizer.detach()
            self._hooks_finalizer = None
        _remove_hooks(self._hooks)

    def _lean_forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        table = self._table
        assert table is not None
        state = _StepState(self)
        state.names = table.names
        self.last_stats = state.stats
        step = _LeanStep(self, state, table, self._work)
        self._states.add(state)
        self._cell[0] = step
        try:
            out = self.model(*args, **kwargs)
            self._cell[0] = None
            step.finish(out)
        except BaseException:
            self._cell[0] = None
            if step.armed:
                step.disarm(None)
            # a failed step leaves nothing behind; the next one starts with a full step
            state.abort()
            self._uninstall()
            raise
        return out

    def abort_interrupted(self) -> int:
        """Abort the steps whose backward started but never finished (an exception or
        KeyboardInterrupt raised in backward outside the executor's own hooks: PyTorch then keeps
        the rest of the graph, and with it the executor's handles, alive). Runs at every forward;
        returns how many steps it aborted."""
        if torch._C._current_graph_task_id() != -1:
            return 0  # called from inside a backward: that backward is running, not interrupted
        n = 0
        for st in list(self._states):
            if st.backward_running and not st.dead:
                st.abort()
                n += 1
        return n

    def close(self) -> None:
        """Remove the executor's hooks from the model; close the backend if this executor created it."""
        self._uninstall()
        if self._own_backend and self._backend is not None:
            self._backend.close()
            self._backend = None


class PlannedModule(nn.Module):
    """``model`` trained under ``plan``: same parameters, same results, less device memory.

    ``plan``: a Plan-format dict or object, a path to a plan JSON file, or a list of actions (one
    per unit). ``backend``: the host tier (default: CpuBackend on CPU, CudaBackend on CUDA).
    ``units``: the coarse unit choice the plan was made with (see units.discover_units).
    ``verify``: checksum every moved or dropped tensor (default: ``TENSORPLACE_VERIFY``).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PlanLike,
        backend: Any = None,
        *,
        units: Optional[Iterable[UnitSpec]] = None,
        verify: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.model = model
        actions, prefetch, names = read_plan(plan)
        self.executor = Executor(
            model, actions, prefetch, backend, verify=verify, units=units, names=names,
            swap_deadlines=read_swap_deadlines(plan),
        )

    @property
    def backend(self) -> Any:
        return self.executor.backend

    @property
    def last_stats(self) -> Optional[StepStats]:
        """What the latest planned step did (its backward fills in the rest)."""
        return self.executor.last_stats

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.model.training or not torch.is_grad_enabled():
            return self.model(*args, **kwargs)
        return self.executor.forward(*args, **kwargs)

    def abort_interrupted(self) -> int:
        """Free what steps interrupted during their backward still hold (see Executor)."""
        return self.executor.abort_interrupted()

    def close(self) -> None:
        self.executor.close()


def execute(
    model: nn.Module,
    actions: Sequence[str],
    prefetch: Iterable[Tuple[int, int]] = (),
    backend: Any = None,
    *args: Any,
    verify: bool = False,
    units: Optional[Iterable[UnitSpec]] = None,
    **kwargs: Any,
) -> Any:
    """Run one forward of ``model(*args, **kwargs)`` under ``actions`` / ``prefetch``; call
    ``backward`` on (a function of) the result as usual."""
    return Executor(model, actions, prefetch, backend, verify=verify, units=units).forward(*args, **kwargs)
