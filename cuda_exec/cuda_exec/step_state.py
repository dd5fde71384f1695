"""What one planned step owns: swap entries, the handles autograd keeps for moved or dropped
saved tensors, stage boundaries (swap-out queueing, swap deadlines, prefetches) and abort."""

from __future__ import annotations

import sys
import time
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .errors import ReplayError, StepAbortedError, StepStats
from .inline_swap import InlineHandle, copy_back_units, copy_out_saved, release_all
from .state_swap import StateSwapper
from .units import ValueRec, ViewMeta, empty_tensor
from .verify import check, note_out_of_memory

if TYPE_CHECKING:
    from .executor import Executor
    from .recorded_replay import _InputSlot, _UnitRuntime

#: Prefix of the zero-length profiler ranges the executor drops around every replay,
#: ``tensorplace::R<unit>`` before the segment runs and ``tensorplace::r<unit>`` after it, so that a
#: memory trace (torch.profiler with profile_memory) can be cut at replays. The profiler measures
#: ``replay_transient_bytes`` with them.
MARK_PREFIX = "tensorplace::"

#: model -> its live executors: a forward of any of them aborts the interrupted steps of all
#: (a failed step of an earlier ``run()`` on the same model must not keep its tensors alive)
_EXECUTORS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Executor]]" = weakref.WeakKeyDictionary()
_profiler_enabled = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def _mark(label: str) -> None:
    if _profiler_enabled():
        with torch.profiler.record_function(MARK_PREFIX + label):
            pass


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


def _alive(ref: "weakref.ReferenceType[_StepState]") -> "_StepState":
    state = ref()
    if state is None:
        raise StepAbortedError("the step this belongs to is gone")
    return state


#: ``_Entry.host`` before the entry's copy is queued
_QUEUED_LATER: Any = object()


class _Entry:
    """One swapped storage version: one copy, queued at the end of the segment that saved it."""

    __slots__ = ("_state", "unit", "nbytes", "device", "host", "fetched", "refs", "prefetched", "value",
                 "ref", "version", "source", "kept", "in_place")

    def __init__(self, state: "_StepState", unit: int, value: Any, t: torch.Tensor, indexed: bool = True) -> None:
        self._state = state.ref  # the state holds its entries: no cycle (see _StepState)
        self.unit = unit
        self.value = value  #: the ValueRec (full path) or the pack index (lean path) it is keyed by
        st = t.untyped_storage()
        #: which storage, to check that a later pack is the same one; None: not ``indexed`` (a
        #: steady step that looks up no entry by its storage: nothing else saves this version)
        self.ref: Optional[StorageWeakRef] = StorageWeakRef(st) if indexed else None
        self.version = t._version
        self.nbytes = st.nbytes()
        self.device = device = t.device
        #: the storage as bytes until the copy is queued at the end of the segment that saved it
        #: (``queue_offload``): a kernel may still write other parts of the storage without
        #: bumping its version (a GRU cell's chunked gates), so the copy waits for the segment's end
        self.source: Optional[torch.Tensor] = empty_tensor(torch.uint8, device).set_(st)
        self.host: Any = _QUEUED_LATER
        #: the plan's cost model cancels this unit's swap-out before it starts: never copied, the
        #: device bytes stay until the backward uses them
        self.kept = unit in state.unstarted
        #: the model cancels its swap-out while the copy runs: the copy runs, and the backward
        #: uses these device bytes in place (the entry keeps them; never copied back)
        self.in_place = unit in state.in_flight
        if not self.kept:
            state.unqueued.append(self)
        if indexed:
            state.swapped[(self.ref.cdata, self.version)] = self  # type: ignore[union-attr]
        self.fetched: Optional[torch.Tensor] = None
        self.refs = 0
        self.prefetched = False

    @property
    def state(self) -> "_StepState":
        return _alive(self._state)

    def queue_offload(self) -> None:
        """Queue the device-to-host copy (once)."""
        if self.host is _QUEUED_LATER and self.source is not None and not self.kept:
            self._queue(self.state)

    def _queue(self, state: "_StepState") -> None:
        # the caller checked that the copy is not queued yet
        if state.groups_copies and self.nbytes > state.inline_bytes:  # the unit's storages leave together
            group = state.copy_groups.get(self.unit)
            if group is None:
                group = state.copy_groups[self.unit] = state.backend.new_copy_group()
            self.queued_as(state.backend.offload(self.source, group))
        else:
            self.queued_as(state.backend.offload(self.source))

    def queued_as(self, host: Any) -> None:
        """Its copy is queued as ``host``: the entry lets the device bytes go (unless it uses
        them in place), the backend holds them until the copy has run."""
        self.host = host
        if not self.in_place:
            self.source = None

    def prefetch(self, state: Optional["_StepState"] = None) -> None:
        if state is None:
            state = self.state
        host = self._to_prefetch(state)
        if host is not None:
            state.backend.prefetch(host)

    def _to_prefetch(self, state: "_StepState") -> Any:
        """The host handle to prefetch now (marked prefetched), or None: nothing to copy back."""
        if self.host is _QUEUED_LATER:
            if self.source is None or self.kept:
                return None  # never copied out: nothing to copy back
            self._queue(state)
        if self.in_place:
            return None  # used from the device: nothing to copy back
        if self.host is not None and self.fetched is None and not self.prefetched:
            self.prefetched = True
            state.stats.prefetches += 1
            return self.host
        return None

    def storage(self, state: Optional["_StepState"] = None) -> torch.UntypedStorage:
        if self.fetched is None:
            if self.source is not None and (self.host is _QUEUED_LATER or self.in_place):
                # needed before its copy was queued, or used in place: still here
                return self.source.untyped_storage()
            if self.host is None:
                raise StepAbortedError("a swapped tensor of an aborted step was needed")
            if state is None:
                state = self.state
            if not self.prefetched:
                state.stats.unscheduled_fetches += 1
            t0 = time.perf_counter()
            self.fetched = state.backend.fetch(self.host)
            state.stats.fetch_s += time.perf_counter() - t0
        return self.fetched.untyped_storage()

    def incref(self) -> None:
        self.refs += 1

    def decref(self) -> None:
        self.refs -= 1
        if self.refs <= 0:
            self.free()

    def free(self, state: Optional["_StepState"] = None) -> None:
        self.fetched = None
        self.source = None
        if state is None:
            state = self.state
        if self.host is _QUEUED_LATER:
            self.host = None
        if self.host is not None:
            host, self.host = self.host, None
            state.backend.release(host)
        if state.entries.get(self.value) is self:
            del state.entries[self.value]
        if self.ref is not None:
            key = (self.ref.cdata, self.version)
            if state.swapped.get(key) is self:
                del state.swapped[key]


def _new_entry(state: "_StepState", owner: int, key: Any, t: torch.Tensor, indexed: bool = True) -> _Entry:
    """A new swap entry of ``owner`` for ``t``'s storage, kept by ``key`` (counted in the stats)."""
    entry = _Entry(state, owner, key, t, indexed)
    state.entries[key] = entry
    state.by_unit[owner].append(entry)
    stats = state.stats
    stats.swap_storages += 1
    stats.swap_bytes += entry.nbytes
    if entry.kept:
        stats.unstarted_swaps += 1
    elif entry.in_place:
        stats.in_flight_swaps += 1
    return entry



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
    __slots__ = ("entry", "starts")

    def __init__(self, state: "_StepState", entry: _Entry, meta: ViewMeta, device: torch.device,
                 digest: Optional[str], what: str, starts: int = -1) -> None:
        # the steady step's hot path: the base class's fields set here, without its call
        self.state = state
        self.meta = meta
        self.device = device
        self.digest = digest
        self.what = what
        self.entry = entry
        self.starts = starts  #: the backward stage its first unpack starts, or -1 (steady._unpack_starts)
        entry.refs += 1

    def unpack(self) -> torch.Tensor:
        state = self.state
        if state.dead:
            state.check_alive()
        s = self.starts
        if s >= 0 and s not in state.fired:
            state.issue_prefetches(s)  # the stage starts here: its prefetches, this one's among them
        entry = self.entry
        storage = entry.storage(state) if entry.fetched is None else None  # fetched now, unless still here
        fetched = entry.fetched
        meta = self.meta
        if fetched is not None and meta.describes(fetched):
            t = fetched  # the backend made it as this view (a third of what view_of takes)
        else:
            t = meta.view_of(storage if fetched is None else fetched.untyped_storage(), self.device)
        if self.digest is not None:
            check(t, self.digest, self.what)
        return t

    def __del__(self) -> None:
        try:
            state = self.state
            if not state.dead:
                entry = self.entry
                entry.refs -= 1
                if entry.refs <= 0:
                    entry.free(state)
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
        check(t, self.digest, self.what, replayed=True)
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
    """Everything one planned forward/backward owns. Its entries, input slots and unit runtimes
    refer back to it weakly (the graph's handles hold it), so a step is freed by reference
    counting when its graph goes: no cycle keeps its objects to a later garbage collection.
    A class with slots: a steady step reads its fields at every stage and swapped tensor."""

    __slots__ = ("_offload_many", "_poll", "_prefetch_many", "_wait_offload", "_warned", "actions",
                 "alive_storages", "backend", "backward_running", "by_unit", "copy_groups", "dead",
                 "deadline_stages", "direct_slots", "dropped", "entries", "finished", "fired",
                 "frames", "groups_copies", "in_flight", "inline_bytes", "inline_open",
                 "inline_units", "kept", "names", "on_abort", "plan_names", "prefetch_at", "ref",
                 "replay_anchor", "run_members", "run_start", "runtimes", "stats", "swap_deadlines",
                 "swapped", "swapper", "unqueued", "unstarted", "verify", "__weakref__")

    def __init__(self, ex: "Executor") -> None:
        #: the weak reference its entries keep to it (one for all)
        self.ref = weakref.ref(self)
        self.backend = ex.backend
        self.actions = ex.actions
        self.names: List[str] = []
        self.plan_names = ex.names
        self.verify = ex.verify
        self.prefetch_at = ex.prefetch_at
        self.swap_deadlines = ex.swap_deadlines
        self.deadline_stages = ex.deadline_stages
        self.run_start = ex.run_start
        self.stats = StepStats()
        #: swap entries by ValueRec (full steps) or by their first pack (steady steps)
        self.entries: Dict[Any, _Entry] = {}
        #: swap entries by (storage, version), whichever step made them
        self.swapped: Dict[Tuple[int, int], _Entry] = {}
        self.by_unit: Dict[int, List[_Entry]] = defaultdict(list)
        self.runtimes: Dict[int, "_UnitRuntime"] = {}
        #: the frames of the aligned checkpoint segments of a steady step (segment_frame.py)
        self.frames: List[Any] = []
        #: checkpoint segment (its first unit) -> its units' runtimes, in order, once the forward ended
        self.run_members: Dict[int, List["_UnitRuntime"]] = {}
        self.direct_slots: Dict[ValueRec, List["_InputSlot"]] = defaultdict(list)
        #: storage key -> (unit, storage, bytes, tracker storage id) of tensors dropped for
        #: recomputation that the forward may still hold
        self.dropped: Dict[int, Tuple[int, StorageWeakRef, int, int]] = {}
        #: unit -> {tracker storage id: (bytes, last forward stage the forward still held it)}
        self.alive_storages: Dict[int, Dict[int, Tuple[int, int]]] = {}
        #: swapped unit -> the backend's group of its storages' copies (backends that group them)
        self.copy_groups: Dict[int, Any] = {}
        self.groups_copies: bool = getattr(self.backend, "groups_copies", False)
        #: copies up to this size complete inside the backend's offload(): no group to wait for
        self.inline_bytes: int = getattr(self.backend, "inline_bytes", 0)
        #: swapped units whose swap-out the plan never starts (its cost model cancels it first)
        self.unstarted: FrozenSet[int] = getattr(ex, "unstarted_swaps", frozenset())
        #: swapped units whose swap-out the plan lets run but uses in place (cancelled in flight)
        self.in_flight: FrozenSet[int] = getattr(ex, "in_flight_swaps", frozenset())
        self._poll = getattr(self.backend, "poll", None)
        # release_offload: the compute stream waits for the copy and the source is dropped (CUDA:
        # a device-side wait, the host does not block; CPU: no streams, the host waits)
        self._wait_offload = (getattr(self.backend, "release_offload", None)
                              or getattr(self.backend, "wait_offload", None))
        #: backends that take a stage's copies at once (CudaBackend: one event for the batch)
        self._offload_many = None if self.groups_copies else getattr(self.backend, "offload_many", None)
        self._prefetch_many = getattr(self.backend, "prefetch_many", None)
        self.fired: Set[int] = set()
        self.dead = False
        self.backward_running = False
        self._warned = False
        self.kept: Set[str] = set()  #: stage labels whose swap deadlines were kept
        self.unqueued: List["_Entry"] = []  #: swapped storages whose copy waits for a stage boundary
        #: steady steps' lean swaps (inline_swap.py), weakly: per unit its handles, and the
        #: handles whose copy out waits for the next stage boundary
        self.inline_units: Dict[int, List["weakref.ReferenceType[InlineHandle]"]] = {}
        self.inline_open: List["weakref.ReferenceType[InlineHandle]"] = []
        self.finished = False  #: a backward of this step ran to its end
        #: a failed step also removes the executor's unit hooks (the next step re-learns)
        self.on_abort = ex._uninstall
        self.replay_anchor = ex._replay_anchor
        #: parameters and optimizer state swapped across iterations (None: the plan swaps none)
        self.swapper: Optional[StateSwapper] = ex.swapper

    def drop(self, unit: int, t: torch.Tensor, sid: int = -1) -> None:
        """Unit ``unit``'s saved tensor ``t`` (its tracker's storage id ``sid``) leaves the step's
        hold; the learning step notes whether the forward still holds it (note_dropped_alive)."""
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        if ref.cdata not in self.dropped:
            self.dropped[ref.cdata] = (unit, ref, st.nbytes(), sid)
            dropped = self.stats.dropped_bytes
            dropped[unit] = dropped.get(unit, 0) + st.nbytes()

    def note_dropped_alive(self, stage: int) -> None:
        """At the start of forward stage ``stage`` (``units`` after the last one): the dropped
        tensors the forward still holds (StepStats.dropped_alive, and per storage
        ``alive_storages``: unit -> {storage id: (bytes, last stage alive)})."""
        alive = self.stats.dropped_alive
        for key, (unit, ref, nbytes, sid) in list(self.dropped.items()):
            if ref.expired():
                del self.dropped[key]
            else:
                per_stage = alive.setdefault(unit, {})
                per_stage[stage] = per_stage.get(stage, 0) + nbytes
                if sid >= 0:
                    self.alive_storages.setdefault(unit, {})[sid] = (nbytes, stage)

    def note_alive_values(self, value_ids: Dict[int, int]) -> None:
        """After the forward: ``alive_storages`` by the tracker's value ids
        (StepStats.dropped_alive_values; storages no unit reads have no id and are left out)."""
        self.stats.dropped_alive_values = {
            unit: {value_ids[sid]: seen for sid, seen in per.items() if sid in value_ids}
            for unit, per in self.alive_storages.items()
        }

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
        if isinstance(sys.exc_info()[1], torch.OutOfMemoryError):
            note_out_of_memory()  # verify mode then names the likely cause of a replay that differs
        self.on_abort()
        for frame in self.frames:
            frame.abort()
        self.frames = []
        for e in list(self.entries.values()):
            e.free()
        for lst in self.by_unit.values():
            for e in lst:
                e.free()
        self.entries.clear()
        self.swapped.clear()
        self.by_unit.clear()
        release_all(self)
        from .recorded_replay import _InputSlot

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
        self.finished = True

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
        if self.unqueued:
            entries, self.unqueued = self.unqueued, []
            many = self._offload_many
            if many is None or len(entries) == 1:
                for e in entries:
                    if e.host is _QUEUED_LATER and e.source is not None:
                        e._queue(self)
            else:  # the stage's copies at once
                todo = [e for e in entries if e.host is _QUEUED_LATER and e.source is not None]
                for e, host in zip(todo, many([e.source for e in todo])):
                    e.queued_as(host)
        self._copies_done()
        if self.by_unit and label in self.swap_deadlines:  # (the lean path's copies need no waits)
            self._keep_deadlines(label)
        if self.swapper is not None:
            # after the deadlines: the model lets swap-outs leave before a prefetch allocates
            self.swapper.at_stage(label)

    def stage_start(self, kind: str, index: int) -> None:
        """The boundary before stage ``kind:index`` of a steady step. Its label is made, and
        :meth:`stage_boundary` run, only where a copy waits to be queued, a general-path swap may
        have a deadline at the stage or a state swapper runs (the lean path's copies complete in
        their call: no deadline waits for them); elsewhere a boundary copies the lean swaps out
        and polls the general path's copies (none: only lean swaps so far), nothing else."""
        if self.swapper is not None or self.unqueued or (self.by_unit and index in self.deadline_stages[kind]):
            self.stage_boundary(f"{kind}:{index}")
        else:
            self._copies_done()

    def _copies_done(self) -> None:
        """A boundary's copies: the lean swaps saved since the last one copied out (they complete
        here: no deadline waits for them), and the device bytes of completed swap-outs freed."""
        if self.inline_open:
            copy_out_saved(self)
        poll = self._poll
        if poll is not None and (self.by_unit or self.swapper is not None):  # copies that may be in flight
            poll()

    def _keep_deadlines(self, label: str) -> None:
        units = self.swap_deadlines.get(label)
        if not units or label in self.kept:
            return
        self.kept.add(label)
        wait = self._wait_offload
        if wait is None:
            return
        t0 = time.perf_counter()
        for u in units:
            for e in self.by_unit.get(u, ()):
                if e.host is not None and e.host is not _QUEUED_LATER and e.fetched is None and not e.prefetched:
                    wait(e.host)
                    self.stats.deadline_waits += 1
        self.stats.deadline_wait_s += time.perf_counter() - t0

    def forward_done(self, units: int) -> None:
        """At the end of the forward: keep the swap deadlines of the first backward stage now.
        The cost model's first backward stage includes the loss and its backward, which run
        before any hook of the executor's part of the graph."""
        if units:
            self.stage_boundary(f"bwd:{units - 1}")

    def release_unneeded(self) -> None:
        """At the end of the forward: stop watching dropped tensors, and let go of the held
        inputs of recomputed units whose replay nobody will need."""
        self.dropped = {}
        for rt in self.runtimes.values():
            rt.forward_done = True
        for rt in list(self.runtimes.values()):
            rt._maybe_release()

    def prefetch_hook(self, stage: int) -> "_StageHook":
        """A gradient hook that issues stage ``stage``'s prefetches (aborting the step if that fails)."""
        return _StageHook(self, stage)

    def issue_prefetches(self, stage: int) -> None:
        if not self.backward_running:
            self.enter_backward()
        if stage in self.fired or self.dead:
            return
        self.fired.add(stage)
        self.stage_start("bwd", stage)
        units = self.prefetch_at.get(stage, ())
        if units:
            self.stats.prefetch_stages.append(stage)
            if self.inline_units:
                copy_back_units(self, units)
            by_unit = self.by_unit
            if not by_unit:  # every swap took the lean path
                return
            many = self._prefetch_many
            if many is None:
                for u in units:
                    for e in by_unit.get(u, ()):
                        e.prefetch(self)
                return
            hosts = []  # the stage's copies back at once
            for u in units:
                for e in by_unit.get(u, ()):
                    host = e._to_prefetch(self)
                    if host is not None:
                        hosts.append(host)
            if hosts:
                many(hosts)


class _StageHook:
    """The hook that starts backward stage ``stage`` (its prefetches), aborting the step if that
    fails: one object per hooked stage and step (what ``guarded`` makes of a lambda is five)."""

    __slots__ = ("state", "stage")

    def __init__(self, state: _StepState, stage: int) -> None:
        self.state = state
        self.stage = stage

    def __call__(self, grad: Any) -> None:
        try:
            self.state.issue_prefetches(self.stage)
        except BaseException:
            self.state.abort()
            raise


def _unpack_handle(packed: Any) -> torch.Tensor:
    """Autograd needs a saved tensor back (full tracker and lean path alike): a handle's tensor,
    aborting the step if getting it fails."""
    if isinstance(packed, torch.Tensor):
        return packed
    state = packed.state
    try:
        if not state.backward_running:
            state.enter_backward()
        return packed.unpack()
    except BaseException:
        state.abort()
        raise

