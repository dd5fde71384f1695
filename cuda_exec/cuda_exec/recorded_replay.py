"""Replays of recorded segments: what the executor's learning step (and a steady step's tracked
segments) recorded of a recomputed unit's segment, run again in backward (see executor.py)."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter, defaultdict
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.utils._pytree as pytree

from .errors import ReplayError, StepAbortedError
from .step_state import _Entry, _StepState, _alive, _mark
from .units import InputRef, Segment, ValueRec, ViewMeta, replaying

class _InputSlot:
    """How a recomputed unit gets one of its inputs back for its replay."""

    __slots__ = ("kind", "tensor", "entry", "rt", "value", "meta", "device", "version",
                 "requires_grad", "protected", "nbytes", "_state", "unit")

    def __init__(self, state: "_StepState", ref: InputRef, t: torch.Tensor, ref_unit: int) -> None:
        self._state = weakref.ref(state)
        self.kind = "tensor"  # "tensor" (held or retained), "entry" (swapped), "replay" (recomputed)
        self.unit = ref_unit  # the recomputed unit this slot is an input of
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

    @property
    def state(self) -> "_StepState":
        return _alive(self._state)

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

    def replayed_first(self) -> Optional["_UnitRuntime"]:
        """The recomputed unit whose replay gives this input back (replayed before the unit
        that reads it), if any."""
        return self.rt if self.kind == "replay" else None

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
        self._state = weakref.ref(state)
        self.unit = unit
        self.seg = seg
        self.rng_cpu: Optional[torch.Tensor] = None
        self.rng_cuda: List[Tuple[int, torch.Tensor]] = []
        self.autocast: List[Tuple[str, bool, torch.dtype]] = []
        self.grad_enabled = True
        #: buffers its replay must see as its forward did (written by it, or read by it and
        #: written later in the forward), with those values (put in place for the replay, and the
        #: current ones back after it; units.replay_start_state)
        self.before: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.slot_refs: Set[int] = set()  # pack indices (in this segment) with a live handle
        self.value_refs: Counter = Counter()  # ValueRec -> live handles and chained input slots
        self.slots: Dict[int, torch.Tensor] = {}
        self.values: Dict[ValueRec, torch.Tensor] = {}
        self.replayed = False
        self.inputs_released = False
        self.forward_done = False

    @property
    def state(self) -> "_StepState":
        return _alive(self._state)

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
        """Let go of the held inputs of this unit's checkpoint segment once nobody can need its
        replay any more (the segment is replayed as one, so every unit of it waits for all)."""
        if not self.forward_done or self.replayed or self.slot_refs or self.value_refs:
            return
        members = self.run_members()
        if any((rt.slot_refs or rt.value_refs) and not rt.replayed for rt in members):
            return
        for rt in members:
            rt.release_inputs()

    def run_members(self) -> List["_UnitRuntime"]:
        """The runtimes of this unit's checkpoint segment (its run of consecutive recomputed units),
        in unit order; just this one for a unit the plan does not recompute (DELTA's evictions)."""
        st = self.state
        if st.action(self.unit) != "recompute":
            return [self]
        start = st.run_start[self.unit]
        cached = st.run_members.get(start)
        if cached is not None:
            return cached
        out: List[_UnitRuntime] = []
        u = start
        while u < len(st.run_start) and st.run_start[u] == start and st.action(u) == "recompute":
            rt = st.runtimes.get(u)
            if rt is not None:
                out.append(rt)
            u += 1
        if self.forward_done:
            st.run_members[start] = out  # complete once the forward has run (the state holds it: no cycle)
        return out

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
        """Replay this unit's checkpoint segment, once: every unit of it in order (as
        torch.utils.checkpoint replays its region at the first unpack), after the units of other
        segments they chain through (DELTA's evictions; a planned segment holds what it reads from
        other segments). The random-number generators are set once, to the state each replayed
        run saved at its start (none when its forward drew no random numbers)."""
        if self.replayed:
            return
        state = self.state
        state.check_alive()
        todo: Dict[int, _UnitRuntime] = {}
        stack = list(self.run_members())
        while stack:
            rt = stack.pop()
            if rt.replayed or rt.unit in todo:
                continue
            todo[rt.unit] = rt
            for ref in rt.seg.inputs:
                slot = ref.slot
                if isinstance(slot, _InputSlot):
                    first = slot.replayed_first()
                    if first is not None:
                        stack.append(first)
        ordered = [todo[u] for u in sorted(todo)]
        state.stats.segment_replays += 1
        if not any(rt.rng_cpu is not None or rt.rng_cuda for rt in ordered):
            for rt in ordered:
                rt._replay()
            return
        devices = sorted({d for rt in ordered for d, _ in rt.rng_cuda})
        with torch.random.fork_rng(devices=devices):
            for rt in ordered:
                if rt.rng_cpu is not None:
                    torch.set_rng_state(rt.rng_cpu)
                for d, st in rt.rng_cuda:
                    torch.cuda.set_rng_state(st, d)
                rt._replay()

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
        dummy = state.replay_anchor
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
                _owned, meta = packs[i]
                if i in self.slot_refs:
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
        with torch.no_grad():
            for b, before in self.before:  # the replay starts from the forward's values
                if all(r is not b for r, _ in restore):
                    restore.append((b, b.detach().clone()))
                b.data.copy_(before)
        self.before = []
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
                f"the original forward {len(packs)}. Code the executor's torch function mode does not see "
                "ran after the unit's module and before the next unit (most often a custom "
                "torch.autograd.Function applied outside an nn.Module), so its replay cannot regenerate "
                "what that code saved. Call that code inside an nn.Module (a unit of its own, replayed by "
                "calling it) to recompute it; a profile marks such a unit recomputable: false and its plans "
                "never recompute it (this plan's profile did not)",
                unit=self.unit,
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


