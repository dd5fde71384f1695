"""DELTA (Tang et al.) as a runtime policy inside the executor: no plan, every decision online.

``DeltaModule(model, budget, backend=...)`` is an ``nn.Module`` that trains ``model`` (same
parameters, the user's own loop) while DELTA manages its saved tensors during each step
(``tensorplace.run(model, tensorplace.delta(budget))`` builds one; docs/methods.md, "DELTA").

How a step runs
---------------
Every step runs the executor's full unit tracker (executor.py: units, ownership of every saved
tensor, each unit's segment recorded so that it can be replayed). Nothing is decided in advance:

* **Saved tensors stay resident at first.** Every saved activation (a tensor some unit owns; not
  parameters, model inputs or glue before the first unit) is kept by a record (:class:`_Saved`,
  one per storage version, shared by all its views and packs) and autograd keeps a small handle.
* **Live counter.** At every unit start of the forward the policy reads the device memory in use
  (live_memory.py: ``torch.cuda.memory_allocated`` on a GPU, the C heap on the CPU).
* **Release above 3/4 of the budget (Algorithm 1).** While the memory in use, less the bytes of
  swap-outs still copying, is above ``threshold x budget``, the *filter* (Algorithm 2) takes the
  resident record of an earlier unit with the largest size x staleness (staleness: seconds since
  the tensor was last saved or read by a unit, measured now) and the *director* (Algorithm 3)
  chooses: **recompute** (evict; its unit's segment is replayed in backward) when the unit can be
  replayed and its replay time is at most the record's transfer time, ``nbytes / d2h + nbytes /
  h2d`` at the backend's bandwidth, else **swap** (one device-to-host copy, queued at once).
  Replay time: the unit's segment time measured in this step's forward (or the profile's
  ``fwd_time``), plus the replays of evicted inputs it needs first; 0 when another record of the
  unit is evicted already (the unit is replayed anyway). Releases happen in the forward only
  (the paper's Assumption 2).
* **Budget.** If the memory in use plus what the coming stage needs is above the budget while
  swap-outs are still copying, the step waits for them (oldest first; on CUDA a device-side
  wait): the copies overlap compute only within the budget. What a stage needs: the most the
  counter rose during it in the previous step, or, where the profile names the unit, the
  profile's bytes for its stage (activations, an unsaved output and the transient peak inside
  its ops, which the counter, read between ops, does not see) if that is more.
* **Prefetch in backward order (Algorithm 4, "and").** At the end of the forward and whenever the
  backward reaches a new unit, swapped records are copied back in the order the backward needs
  them (the last reader first), at most ``prefetch_depth`` ahead of use, while the copy fits under
  the budget; a swapped record needed earlier is fetched at its use.

Which units can be replayed (DELTA's ``evict_pinned``) is decided when a unit's segment ends: its
replay needs its inputs back, so every input must be a saved tensor (a record: resident, swapped
or itself evicted, then replayed first), a model input, or a constant; an input nobody saves (it
would have to be held, memory the policy does not see as releasable) or one written in place
(``ReLU(inplace=True)``) pins the unit to swap. A record is recomputable when its unit is and the
replay regenerates it (it is saved inside the unit's segment, or is a value of the segment).
The replay itself is the executor's (executor.py ``_UnitRuntime``): RNG and autocast states,
BatchNorm buffers restored, held inputs by the same view. Swaps are the executor's ``_Entry``.

What a step did is in ``last_stats`` (:class:`DeltaStats`): every decision, the prefetch order,
and the largest memory the counter saw and by how much it went over the budget. The counter is
read at unit starts and ends, and at every unpack in backward; the peak inside an op (its scratch
memory) is not seen. Going over is not an error: the step completes, ``over_budget_bytes`` says by
how much, and a :class:`DeltaBudgetWarning` is issued once per module.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from .errors import ReplayError, StepAbortedError, StepStats
from .executor import Executor, ExecutorModule
from .learn import _PlanTracker
from .recorded_replay import _InputSlot, _UnitRuntime
from .step_state import _alive, _Entry, _Handle, _new_entry, _StepState
from .live_memory import LiveMemory, live_memory_for
from .units import InputRef, PackInfo, Segment, UnitSpec, ValueRec, ViewMeta, model_input_position
from .verify import check, checksum

__all__ = ["THRESHOLD", "DeltaBudgetWarning", "DeltaDecision", "DeltaStats", "DeltaExecutor", "DeltaModule",
           "transfer_bandwidth"]

#: DELTA starts releasing at this share of the budget
THRESHOLD = 0.75

RESIDENT, SWAPPED, EVICTED = "resident", "swapped", "evicted"

#: steps over the budget that warn nothing while the forward's release limit adapts
LEARNING_STEPS = 2


class DeltaBudgetWarning(RuntimeWarning):
    """A step under the DELTA runtime policy used more memory than its budget."""


@dataclass
class DeltaDecision:
    """One release: at the start of forward stage ``stage``, ``unit``'s tensor of ``nbytes``."""

    stage: int
    unit: int
    action: str  #: "swap" or "recompute"
    nbytes: int
    staleness: float  #: seconds since its last use
    replay_s: Optional[float]  #: the director's replay time (None: the unit cannot be replayed)
    transfer_s: float  #: nbytes / d2h + nbytes / h2d
    used_bytes: int  #: the counter when the record was chosen
    #: the filter's score (nbytes x staleness) of the next best candidate then (-1: none)
    runner_up: float = -1.0


@dataclass
class DeltaStats(StepStats):
    """What one step under the DELTA runtime policy did (StepStats plus the policy's own)."""

    budget_bytes: int = 0
    threshold_bytes: int = 0
    decisions: List[DeltaDecision] = field(default_factory=list)
    #: (unit, backward stage that first needs it) of every prefetch, in issue order
    prefetch_order: List[Tuple[int, int]] = field(default_factory=list)
    #: the counter at the start of every forward stage (before any release there)
    forward_counter: List[int] = field(default_factory=list)
    counter_peak_bytes: int = 0  #: the largest value the counter showed in the step
    counter_peak_at: str = ""  #: where ("fwd:i", "fwd-end:i", "bwd:i")
    over_budget_bytes: int = 0  #: counter_peak_bytes - budget_bytes, if positive
    stall_s: float = 0.0  #: time waiting for swap-outs to keep the budget
    policy_s: float = 0.0  #: time spent in the policy's forward decisions
    unit_times: List[float] = field(default_factory=list)  #: segment time of each unit (forward)
    recomputable: List[bool] = field(default_factory=list)  #: per unit, whether it could be replayed

    @property
    def released_swap_bytes(self) -> int:
        return sum(d.nbytes for d in self.decisions if d.action == "swap")

    @property
    def released_recompute_bytes(self) -> int:
        return sum(d.nbytes for d in self.decisions if d.action == "recompute")


def transfer_bandwidth(backend: Any, measure_bytes: int = 16 << 20) -> Tuple[float, float]:
    """(device-to-host, host-to-device) bytes/s the director charges a swap at: the CPU backend's
    ``bandwidth_cap`` when it has one (its copy thread makes a copy take at least nbytes / cap),
    else the backend's measured bandwidth (``backend.bandwidth``)."""
    cap = getattr(backend, "bandwidth_cap", None)
    if cap:
        return float(cap), float(cap)
    with torch.random.fork_rng(devices=[]):  # the measurement fills its buffers with random bytes
        d2h, h2d = backend.bandwidth(measure_bytes)
    return float(d2h), float(h2d)


# ------------------------------------------------------------------------------------------
# Records, handles, input slots
# ------------------------------------------------------------------------------------------


class _Saved:
    """One saved storage version owned by a unit: resident, swapped (an executor ``_Entry``) or
    evicted (regenerated by its unit's replay). Alive while a handle or an input slot needs it."""

    __slots__ = ("_state", "unit", "value", "nbytes", "version", "keep", "mode", "entry", "rt", "refs",
                 "handles", "last_use", "need", "outside", "prefetched", "consumed", "order", "released_at")

    def __init__(self, state: "_DeltaState", unit: int, value: ValueRec, t: torch.Tensor, order: int) -> None:
        self._state = weakref.ref(state)  # the state holds its records: no cycle (see _StepState)
        self.unit = unit
        self.value = value
        self.nbytes = value.nbytes
        self.version = t._version
        #: while resident: holds the storage (shares the version counter of the saved tensor)
        self.keep: Optional[torch.Tensor] = t.detach()
        self.mode = RESIDENT
        self.entry: Optional[_Entry] = None
        self.rt: Optional[_UnitRuntime] = None
        self.refs = 0  #: live handles and bound input slots
        self.handles: List["weakref.ref[_DeltaHandle]"] = []
        self.last_use = time.perf_counter()
        self.need = -1  #: the backward stage that first reads it (its largest reader)
        self.outside = False  #: saved or read outside its unit's segment
        self.prefetched = False
        self.consumed = False
        self.order = order
        self.released_at = -1  #: the forward stage at whose start it was released

    @property
    def state(self) -> "_DeltaState":
        return _alive(self._state)  # type: ignore[return-value]

    def view(self, meta: ViewMeta, device: torch.device) -> torch.Tensor:
        """The tensor ``meta`` describes, over this record's bytes wherever they are now."""
        if self.mode == RESIDENT:
            keep = self.keep
            if keep is None:
                raise StepAbortedError("a saved tensor of an aborted step was needed")
            if keep._version != self.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation (a saved tensor of unit {self.unit} is at version {keep._version}; expected "
                    f"version {self.version})"
                )
            return meta.view_of(keep.untyped_storage(), device)
        if self.mode == SWAPPED:
            assert self.entry is not None
            return meta.view_of(self.entry.storage(), device)
        rt = self.rt
        assert rt is not None
        rt.ensure_replayed()
        base = rt.values.get(self.value)
        if base is None:
            raise ReplayError(f"unit {self.unit}'s replay did not regenerate a tensor the step needs")
        return meta.view_of(base.untyped_storage(), device)

    def acquire(self) -> None:
        self.refs += 1

    def release_ref(self) -> None:
        self.refs -= 1
        if self.refs <= 0:
            self.free()

    def free(self) -> None:
        mode, self.mode = self.mode, "freed"
        self.keep = None
        if mode == SWAPPED and self.entry is not None:
            entry, self.entry = self.entry, None
            entry.decref()
        elif mode == EVICTED and self.rt is not None:
            rt, self.rt = self.rt, None
            rt.decref_value(self.value)
        if self.state.records.get(self.value) is self:
            del self.state.records[self.value]

    def live_handles(self) -> List["_DeltaHandle"]:
        out = []
        for ref in self.handles:
            h = ref()
            if h is not None:
                out.append(h)
        return out


class _DeltaHandle(_Handle):
    """What autograd keeps for a saved activation under the policy."""

    __slots__ = ("rec", "seg_pack", "reader", "own")

    def __init__(self, state: "_DeltaState", rec: _Saved, seg_pack: int, reader: int, meta: ViewMeta,
                 device: torch.device, digest: Optional[str], what: str) -> None:
        super().__init__(state, meta, device, digest, what)
        self.rec = rec
        self.seg_pack = seg_pack  #: its pack index in its owner's segment, -1 when saved elsewhere
        self.reader = reader  #: the unit whose segment saved it (its backward reads it)
        self.own: Optional[torch.Tensor] = None  #: kept by the handle itself (see _Policy.pack)
        rec.acquire()
        rec.handles.append(weakref.ref(self))

    def unpack(self) -> torch.Tensor:
        st = self.state
        st.check_alive()
        st.policy.on_unpack(self)  # type: ignore[attr-defined]
        rec = self.rec
        replayed = rec.mode == EVICTED
        if self.own is not None:
            t = self.own
        elif replayed and self.seg_pack >= 0:
            rt = rec.rt
            assert rt is not None
            rt.ensure_replayed()
            got = rt.slots.get(self.seg_pack)
            if got is None:
                raise ReplayError(f"unit {rec.unit}: saved tensor {self.seg_pack} was not regenerated")
            t = got
        else:
            t = rec.view(self.meta, self.device)
        check(t, self.digest, self.what, replayed=replayed)
        return t

    def __del__(self) -> None:
        try:
            if not self.state.dead:
                rec = self.rec
                if rec.mode == EVICTED and self.seg_pack >= 0 and rec.rt is not None:
                    rec.rt.decref_slot(self.seg_pack)
                rec.release_ref()
        except Exception:  # pragma: no cover - never raise from __del__
            pass


class _LazySlot(_InputSlot):
    """An input of a unit the policy may recompute, read back through its record at replay time
    (it holds no tensor itself: binding it holds the record, whose bytes are wherever the policy
    put them)."""

    __slots__ = ("rec",)

    def __init__(self, state: "_DeltaState", ref: InputRef, t: torch.Tensor, unit: int) -> None:
        # no tensor reference (_InputSlot.__init__ would hold one)
        self._state = weakref.ref(state)
        self.kind = "lazy"
        self.unit = unit
        self.tensor = None
        self.entry = None
        self.rt = None
        self.value = ref.value
        self.meta = ref.meta
        self.device = t.device
        self.version = t._version
        self.requires_grad = t.requires_grad
        self.protected = False
        self.nbytes = 0
        self.rec: Optional[_Saved] = None

    def bind(self, rec: _Saved) -> None:
        self.rec = rec
        rec.acquire()
        rec.outside = True

    def replayed_first(self) -> Optional[_UnitRuntime]:
        rec = self.rec
        if rec is not None and rec.mode == EVICTED and rec.rt is not None and not rec.rt.replayed:
            return rec.rt
        return None

    def get(self) -> torch.Tensor:
        rec = self.rec
        if rec is None:
            raise StepAbortedError("an input of a recomputed unit was released")
        return rec.view(self.meta, self.device)

    def release(self) -> None:
        self.kind = "released"
        rec, self.rec = self.rec, None
        if rec is not None:
            rec.release_ref()


# ------------------------------------------------------------------------------------------
# The policy (one per step)
# ------------------------------------------------------------------------------------------


class _Policy:
    """DELTA's filter, director and prefetcher over one step's records."""

    def __init__(self, ex: "DeltaExecutor", state: "_DeltaState") -> None:
        self.ex = ex
        self._st = weakref.ref(state)  # the state holds its policy: no cycle
        self.counter: LiveMemory = ex.counter
        self.budget = ex.budget
        self.limit = ex.forward_limit()
        self.depth = ex.prefetch_depth
        self.lookahead = ex.prefetch_lookahead
        self.d2h, self.h2d = ex.bandwidth
        self.backend = ex.backend
        self.stats: DeltaStats = state.stats  # type: ignore[assignment]
        self.stats.budget_bytes = self.budget
        self.stats.threshold_bytes = self.limit
        self.resident: List[_Saved] = []  #: candidates, in pack order (pruned lazily)
        self.pending: List[_Saved] = []  #: swapped records whose swap-out may still hold device bytes
        self.swapped: List[_Saved] = []
        self.queue: Deque[_Saved] = deque()  #: the prefetcher's queue, in backward order
        self.inflight = 0  #: prefetched records not yet used
        self.pinned: Set[int] = set()  #: units that cannot be replayed
        self.recomputable: Dict[int, bool] = {}
        self.evicted_units: Set[int] = set()
        self.unit_time: Dict[int, float] = {}
        self.stage = -1  #: the forward stage whose growth the counter's readings record (-1: none)
        self.stage_index = -1  #: the forward stage at whose start the policy runs now, or ran last
        self.bwd_stage: Optional[int] = None
        self.stage_floor = 0  #: the counter at the start of the running forward stage, after releases
        self.growth: List[int] = list(ex.growth)  #: per forward stage, its growth in the previous step
        self.new_growth: Dict[int, int] = {}
        self.order = 0
        self.stage_start = time.perf_counter()

    @property
    def st(self) -> "_DeltaState":
        return _alive(self._st)  # type: ignore[return-value]

    # -------------------------------------------------------------- the counter

    def read(self, where: str) -> int:
        used = self.counter.read()
        if used > self.stats.counter_peak_bytes:
            self.stats.counter_peak_bytes = used
            self.stats.counter_peak_at = where
        if self.stage >= 0 and self.bwd_stage is None:
            g = used - self.stage_floor
            if g > self.new_growth.get(self.stage, 0):
                self.new_growth[self.stage] = g
        return used

    def pending_bytes(self) -> int:
        in_flight = getattr(self.backend, "offload_in_flight", None)
        keep: List[_Saved] = []
        total = 0
        for rec in self.pending:
            e = rec.entry
            host = e.host if e is not None else None
            if host is None or rec.mode != SWAPPED:
                continue
            # a backend that cannot say: a swap-out is taken to be done by the next unit's start
            busy = in_flight(host) if in_flight is not None else rec.released_at == self.stage_index
            if busy:
                keep.append(rec)
                total += rec.nbytes
        self.pending = keep
        return total

    # -------------------------------------------------------------- forward

    def pack(self, tensor: torch.Tensor, info: PackInfo) -> Any:
        st = self.st
        val = info.value
        assert val is not None and info.meta is not None
        rec = st.records.get(val)
        if rec is None or rec.mode == "freed":
            rec = _Saved(st, info.owner, val, tensor, self.order)
            self.order += 1
            st.records[val] = rec
            self.resident.append(rec)
        else:
            rec.last_use = time.perf_counter()
        if not info.in_owner_segment:
            rec.outside = True
        if info.reader > rec.need:
            rec.need = info.reader
        digest = checksum(tensor) if st.verify else None
        what = f"a saved tensor of unit {info.owner} ({st.names[info.owner]})" if st.verify else ""
        h = _DeltaHandle(st, rec, info.seg_pack if info.in_owner_segment else -1, info.reader, info.meta,
                         tensor.device, digest, what)
        if rec.mode == EVICTED and (info.in_owner_segment or rec.rt is None or val not in rec.rt.seg.owned_values):
            h.own = tensor.detach()  # saved again where its unit's replay cannot give it back: kept as is
        return h

    def read_value(self, val: ValueRec) -> None:
        rec = self.st.records.get(val)
        if rec is not None:
            rec.last_use = time.perf_counter()

    def pin(self, unit: int) -> None:
        self.pinned.add(unit)

    def close_segment(self, u: int, seg: Optional[Segment]) -> None:
        """Unit ``u``'s segment ended: bind the inputs its replay would need, or pin it."""
        st = self.st
        rt = st.runtimes.get(u)
        ok = rt is not None and seg is not None and u not in self.pinned and st.names[u] not in self.ex.not_recomputable
        recs: List[Tuple[_LazySlot, _Saved]] = []
        if ok:
            assert seg is not None
            for ref in seg.inputs:
                slot = ref.slot
                if isinstance(slot, _LazySlot):
                    rec = st.records.get(slot.value)
                    if rec is None or rec.mode == "freed" or (
                            rec.mode == EVICTED and (rec.rt is None or slot.value not in rec.rt.seg.owned_values)):
                        ok = False  # nobody saves it (it would have to be held), or no replay gives it back
                        break
                    recs.append((slot, rec))
                elif not isinstance(slot, _InputSlot):
                    ok = False
                    break
        if ok:
            for slot, rec in recs:
                slot.bind(rec)
        else:
            self.pinned.add(u)
            if rt is not None:
                rt.release_inputs()
        self.recomputable[u] = ok

    def forward_boundary(self, s: int) -> None:
        """Forward stage ``s`` starts (every earlier unit's segment has ended): DELTA's loop."""
        t0 = time.perf_counter()
        if self.stage >= 0:
            self.unit_time[self.stage] = t0 - self.stage_start
        used = self.read(f"fwd:{s}")  # the end of the previous stage (its growth)
        self.stage_index = s
        self.stage = -1  # the releases below are no stage's growth
        self.stats.forward_counter.append(used)
        if used - self.pending_bytes() > self.limit:
            used = self._release(s, used)
        used = self._keep_budget(s, used)
        self.stage = s
        self.stage_floor = used
        t1 = time.perf_counter()
        self.stats.policy_s += t1 - t0
        self.stage_start = t1

    def _release(self, s: int, used: int) -> int:
        while used - self.pending_bytes() > self.limit:
            rec, now, runner_up = self._filter(s)
            if rec is None:
                break
            replay = self._replay_time(rec)
            transfer = rec.nbytes / self.d2h + rec.nbytes / self.h2d
            action = "recompute" if replay is not None and replay <= transfer else "swap"
            self.stats.decisions.append(DeltaDecision(s, rec.unit, action, rec.nbytes, now - rec.last_use, replay,
                                                      transfer, used, runner_up))
            if action == "recompute":
                self._evict(rec)
            else:
                self._swap(rec)
            used = self.read(f"fwd:{s}")
        return used

    def _filter(self, s: int) -> Tuple[Optional[_Saved], float, float]:
        """Algorithm 2: the resident record of a finished segment with the largest size x
        staleness; also the time it was taken at and the next best score."""
        now = time.perf_counter()
        best: Optional[_Saved] = None
        best_score = second = -1.0
        keep: List[_Saved] = []
        for rec in self.resident:
            if rec.mode != RESIDENT:
                continue
            keep.append(rec)
            if rec.unit >= s:
                continue
            score = rec.nbytes * (now - rec.last_use)
            if score > best_score:
                best, best_score, second = rec, score, best_score
            elif score > second:
                second = score
        self.resident = keep
        return best, now, second

    def _can_recompute(self, rec: _Saved) -> bool:
        u = rec.unit
        if not self.recomputable.get(u, False):
            return False
        rt = self.st.runtimes.get(u)
        if rt is None or rt.inputs_released:
            return False
        if rec.outside and rec.value not in rt.seg.owned_values:
            return False
        return True

    def _replay_time(self, rec: _Saved) -> Optional[float]:
        """The director's recompute cost (None: the record cannot be recomputed)."""
        if not self._can_recompute(rec):
            return None
        return self._unit_cost(rec.unit, set())

    def _unit_cost(self, u: int, seen: Set[int]) -> float:
        if u in self.evicted_units or u in seen:
            return 0.0  # replayed anyway (or counted already in this chain)
        seen.add(u)
        cost = self.ex.unit_time_of(u, self.st.names, self.unit_time)
        rt = self.st.runtimes.get(u)
        if rt is not None:
            for ref in rt.seg.inputs:
                slot = ref.slot
                if isinstance(slot, _LazySlot) and slot.rec is not None and slot.rec.mode == EVICTED:
                    cost += self._unit_cost(slot.rec.unit, seen)
        return cost

    def _evict(self, rec: _Saved) -> None:
        rt = self.st.runtimes[rec.unit]
        rec.mode = EVICTED
        rec.rt = rt
        rec.keep = None
        rt.value_refs[rec.value] += 1  # the record's own reference (handles saved elsewhere, input slots)
        for h in rec.live_handles():
            if h.seg_pack >= 0 and h.own is None:
                rt.slot_refs.add(h.seg_pack)
            self.stats.dropped_tensors += 1
        self.evicted_units.add(rec.unit)

    def _swap(self, rec: _Saved) -> None:
        st = self.st
        keep = rec.keep
        assert keep is not None
        entry = _new_entry(st, rec.unit, ("delta", rec.order), keep)
        entry.incref()  # the record's reference
        entry.queue_offload()  # its segment has ended: nothing writes into it any more
        rec.mode = SWAPPED
        rec.entry = entry
        rec.keep = None
        rec.released_at = self.stage_index
        self.pending.append(rec)
        self.swapped.append(rec)

    def _keep_budget(self, s: int, used: int) -> int:
        """Wait for swap-outs (oldest first) while the coming stage would not fit otherwise."""
        grow = self.growth[s] if s < len(self.growth) else 0
        names = self.st.names
        if s < len(names):
            grow = max(grow, self.ex.stage_bytes.get(names[s], 0))
        if used + grow <= self.budget or not self.pending_bytes():
            return used
        wait = getattr(self.backend, "release_offload", None) or getattr(self.backend, "wait_offload", None)
        if wait is None:
            return used
        t0 = time.perf_counter()
        for rec in list(self.pending):
            if used + grow <= self.budget:
                break
            if rec.entry is not None and rec.entry.host is not None:
                wait(rec.entry.host)
                self.stats.deadline_waits += 1
            used = self.read(f"fwd:{s}")
        self.pending_bytes()
        self.stats.stall_s += time.perf_counter() - t0
        return used

    def forward_end(self, n: int) -> None:
        t0 = time.perf_counter()
        if self.stage >= 0:
            self.unit_time[self.stage] = t0 - self.stage_start
        self.read(f"fwd-end:{n - 1}")
        self.ex.growth = [self.new_growth.get(i, 0) for i in range(n)]
        self.stats.unit_times = [self.unit_time.get(i, 0.0) for i in range(n)]
        self.stats.recomputable = [self.recomputable.get(i, False) for i in range(n)]
        # the prefetcher's queue: swapped records in the order the backward needs them
        self.queue = deque(sorted(self.swapped, key=lambda r: (-r.need, -r.unit, -r.order)))
        self.bwd_stage = n
        self._prefetch()
        self.stats.policy_s += time.perf_counter() - t0

    # -------------------------------------------------------------- backward

    def on_unpack(self, h: _DeltaHandle) -> None:
        rec = h.rec
        freed_slot = False
        if rec.prefetched and not rec.consumed:
            rec.consumed = True
            self.inflight -= 1
            freed_slot = True
        stage = h.reader
        if self.bwd_stage is None or stage < self.bwd_stage:
            self.bwd_stage = stage
            self._prefetch()
        elif freed_slot:
            self._prefetch()
        else:
            self.read(f"bwd:{stage}")

    def _prefetch(self) -> None:
        """Algorithm 4: copy swapped records back, in backward order, while fewer than
        ``prefetch_depth`` are ahead of use and the copy fits under the budget."""
        where = f"bwd:{self.bwd_stage}"
        used = self.read(where)
        q = self.queue
        stage = self.bwd_stage if self.bwd_stage is not None else 0
        while q and self.inflight < self.depth:
            rec = q[0]
            e = rec.entry
            if rec.mode != SWAPPED or e is None or e.host is None or e.fetched is not None or e.prefetched:
                q.popleft()  # fetched at its use already, or gone
                continue
            if rec.need >= stage:
                q.popleft()  # needed now: it is fetched at its use
                continue
            if stage - rec.need > self.lookahead or used + rec.nbytes > self.budget:
                break
            q.popleft()
            e.prefetch()
            rec.prefetched = True
            self.inflight += 1
            self.stats.prefetch_order.append((rec.unit, rec.need))
            used = self.read(where)

    def finish(self) -> None:
        over = self.stats.counter_peak_bytes - self.budget
        self.stats.over_budget_bytes = max(0, over)
        self.ex.adapt(self.limit, self.stats.counter_peak_bytes)
        self.ex.steps_done += 1
        if over > 0 and (self.ex.steps_done > LEARNING_STEPS or not self.ex.adaptive):
            self.ex.warn_over(self.stats)


# ------------------------------------------------------------------------------------------
# Step state and tracker
# ------------------------------------------------------------------------------------------


class _DeltaState(_StepState):
    def __init__(self, ex: "DeltaExecutor") -> None:
        super().__init__(ex)
        self.stats = DeltaStats()
        self.records: Dict[ValueRec, _Saved] = {}
        self.policy = _Policy(ex, self)

    def abort(self) -> None:
        if self.dead:
            return
        super().abort()
        for rec in list(self.records.values()):
            rec.keep = None
            rec.entry = None
            rec.rt = None
            rec.mode = "freed"
        self.records.clear()
        p = self.policy
        p.resident, p.pending, p.swapped = [], [], []
        p.queue.clear()

    def _backward_done(self) -> None:
        super()._backward_done()
        if not self.dead:
            self.policy.finish()


class _DeltaTracker(_PlanTracker):
    """The executor's full tracker with DELTA's policy at every unit start, input and pack."""

    def __init__(self, ex: "DeltaExecutor", state: _DeltaState) -> None:
        super().__init__(ex, state)
        self.state: _DeltaState = state
        self.policy = state.policy

    def _runtime_for(self, segment: Segment) -> Optional[_UnitRuntime]:
        st = self.state
        rt = st.runtimes.get(segment.unit)
        if rt is None:
            rt = st.runtimes[segment.unit] = _UnitRuntime(st, segment.unit, segment)
        return rt

    def on_unit_start(self, index: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        st = self.state
        st.names.append(self.records[index].name)
        st.stats.units = index + 1
        if index > 0:
            self.policy.close_segment(index - 1, self.segments[index - 1])
        st.stage_boundary(f"fwd:{index}")
        self._save_replay_state(index)
        self.policy.forward_boundary(index)

    def on_unit_end(self, index: int, module: nn.Module, output: Any) -> None:
        self.policy.read(f"fwd:{index}")

    def on_segment_value(self, segment: Segment, index: int, tensor: torch.Tensor) -> None:
        pass

    def on_input(self, segment: Segment, ref: InputRef, tensor: torch.Tensor, will_modify: bool) -> None:
        st = self.state
        val = ref.value
        self.policy.read_value(val)
        u = segment.unit
        if will_modify:
            self.policy.pin(u)
            copy: Optional[torch.UntypedStorage] = None
            for other in st.direct_slots.get(val, []):  # held model inputs of other units
                if other.kind == "tensor" and not other.protected:
                    copy = other.protect(copy)
        self._runtime_for(segment)
        owner = val.owner
        if owner >= 0:
            ref.slot = _LazySlot(st, ref, tensor, u)
        elif model_input_position(owner) is not None or val.saved:
            slot = _InputSlot(st, ref, tensor, u)  # alive anyway: a model input, or saved before any unit
            ref.slot = slot
            st.direct_slots[val].append(slot)
        else:
            self.policy.pin(u)

    def on_input_mutated(self, segment: Segment, ref: InputRef) -> None:
        self.policy.pin(segment.unit)

    def on_pack(self, tensor: torch.Tensor, info: PackInfo) -> Any:
        self._pack_owner_seen = info.owner
        if info.kind != "activation" or info.owner < 0 or info.value is None or info.meta is None:
            return tensor
        return self.policy.pack(tensor, info)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


class DeltaExecutor(Executor):
    """Runs forwards of ``model`` under DELTA's runtime policy (see the module docstring).

    ``budget``: device bytes for the whole step (parameters, gradients, optimizer state,
    activations). ``threshold``: releases start above this share of it. ``prefetch_depth``: the
    prefetcher's limit of copies back ahead of use. ``bandwidth``: (d2h, h2d) bytes/s for the
    director (default: :func:`transfer_bandwidth` of the backend, measured once). ``unit_times``:
    unit name -> forward seconds (a profile's ``fwd_time``; default: measured in each step).
    ``stage_bytes``: unit name -> the most its forward stage allocates above its start (a
    profile's ``act_bytes``, unsaved ``output_bytes`` and ``fwd_transient_bytes``), for the wait
    that keeps a stage within the budget. ``constant_bytes``: on CPU, bytes the counter cannot
    see that the budget counts (optimizer state). ``memory_counter``: a function returning the device bytes in use, instead of
    live_memory.py's counter. ``not_recomputable``: names of units never to recompute (a
    profile's ``recomputable: false``)."""

    def __init__(
        self,
        model: nn.Module,
        budget: int,
        backend: Any = None,
        *,
        threshold: float = THRESHOLD,
        prefetch_depth: int = 2,
        prefetch_lookahead: int = 2,
        bandwidth: Optional[Tuple[float, float]] = None,
        unit_times: Optional[Mapping[str, float]] = None,
        stage_bytes: Optional[Mapping[str, int]] = None,
        constant_bytes: int = 0,
        memory_counter: Optional[Callable[[], int]] = None,
        not_recomputable: Iterable[str] = (),
        adaptive: bool = True,
        headroom: int = 0,
        verify: Optional[bool] = None,
        units: Optional[Iterable[UnitSpec]] = None,
    ) -> None:
        if int(budget) <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        if not 0.0 < float(threshold) <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] (DELTA's is 0.75), got {threshold!r}")
        if int(prefetch_depth) < 0 or int(prefetch_lookahead) < 0:
            raise ValueError(f"prefetch_depth and prefetch_lookahead must be >= 0, got {prefetch_depth!r} and "
                             f"{prefetch_lookahead!r}")
        if bandwidth is not None and (len(bandwidth) != 2 or min(bandwidth) <= 0):
            raise ValueError(f"bandwidth must be (d2h, h2d) bytes per second, both positive, got {bandwidth!r}")
        super().__init__(model, [], (), backend, verify=verify, units=units)
        self.lean = False
        self.budget = int(budget)
        self.threshold = float(threshold)
        self.prefetch_depth = int(prefetch_depth)
        self.prefetch_lookahead = int(prefetch_lookahead)
        self._bandwidth = tuple(float(b) for b in bandwidth) if bandwidth is not None else None
        self.profile_times = dict(unit_times) if unit_times else {}
        self.stage_bytes = {str(k): int(v) for k, v in (stage_bytes or {}).items()}
        self.constant_bytes = int(constant_bytes)
        #: names of units a profile says the executor cannot replay: never recomputed
        self.not_recomputable = frozenset(str(n) for n in not_recomputable)
        self._memory_counter = memory_counter
        self._counter: Optional[LiveMemory] = None
        #: per forward stage, how far the counter rose above the stage's start in the last step
        self.growth: List[int] = []
        self._warned_over = False
        self.steps_done = 0  #: steps whose backward finished
        self.adaptive = bool(adaptive)
        self.headroom = int(headroom)
        self._limit: Optional[int] = None
        self._ceiling: Optional[int] = None  #: the lowest release limit after which a step went over
        self.last_stats: Optional[DeltaStats] = None  # type: ignore[assignment]

    @property
    def bandwidth(self) -> Tuple[float, float]:
        if self._bandwidth is None:
            self._bandwidth = transfer_bandwidth(self.backend)
        return self._bandwidth  # type: ignore[return-value]

    @property
    def counter(self) -> LiveMemory:
        if self._counter is None:
            p = next(self.model.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
            self._counter = live_memory_for(device, self.backend, self._memory_counter)
        return self._counter

    def unit_time_of(self, u: int, names: Sequence[str], measured: Mapping[int, float]) -> float:
        """Unit ``u``'s forward (replay) time for the director: the profile's if it names the unit,
        else its segment time measured in this step's forward."""
        if self.profile_times and u < len(names) and names[u] in self.profile_times:
            return float(self.profile_times[names[u]])
        return measured.get(u, 0.0)

    def forward_limit(self) -> int:
        """Where the forward starts releasing: ``threshold x budget``, lowered after steps whose
        counter went over the budget (see :meth:`adapt`)."""
        top = int(self.threshold * self.budget)
        return top if self._limit is None else min(top, self._limit)

    def adapt(self, limit: int, peak: int) -> None:
        """After a step that released from ``limit`` in the forward and whose counter peaked at
        ``peak``: the next step's limit. The target is ``budget - headroom``, less a margin of 1%
        of the budget; a peak above that lowers the limit by the excess, a peak below it raises
        the limit by half the slack, never above ``threshold x budget`` nor back up to a limit
        after which a step went over (tensors are released whole, so the peak moves in steps
        and would otherwise swing around the target). DELTA releases in the
        forward only; this is how the backward's peak, which the forward cannot see coming, is
        brought under the budget in the following steps."""
        if not self.adaptive:
            return
        margin = self.budget // 100
        err = peak - (self.budget - self.headroom - margin)
        if err > 0:
            self._ceiling = limit if self._ceiling is None else min(self._ceiling, limit)
            nxt = limit - err
        else:
            nxt = limit + (-err) // 2
            if self._ceiling is not None:
                nxt = min(nxt, self._ceiling - margin)  # not back to a limit that went over
        self._limit = max(0, min(int(self.threshold * self.budget), nxt))

    def warn_over(self, stats: DeltaStats) -> None:
        if self._warned_over:
            return
        self._warned_over = True
        warnings.warn(
            f"tensorplace DELTA: a step used {stats.counter_peak_bytes} bytes (at {stats.counter_peak_at}), "
            f"{stats.over_budget_bytes} bytes over its budget of {stats.budget_bytes} (it released from "
            f"{stats.threshold_bytes} bytes in the forward): DELTA releases only in the forward, and what was left on "
            "the device was in use; a larger budget, or a planned method (tensorplace.plan), can meet it. Each "
            "step's excess is in last_stats.over_budget_bytes.",
            DeltaBudgetWarning,
            stacklevel=2,
        )

    def _base_bytes(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
        """Device bytes the step starts with (CPU counter's base): parameters, buffers, their
        gradients, the inputs, and ``constant_bytes``."""
        seen: Set[int] = set()
        total = self.constant_bytes
        tensors: List[torch.Tensor] = []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            tensors.append(t)
            if getattr(t, "grad", None) is not None:
                tensors.append(t.grad)
        tensors += [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        for t in tensors:
            if t.layout != torch.strided or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        return total

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One forward under the policy; its backward follows the policy too."""
        self.abort_interrupted()
        _ = self.bandwidth  # measured once, before the step's counter starts
        counter = self.counter
        state = _DeltaState(self)
        self._states.add(state)
        self.last_stats = state.stats  # type: ignore[assignment]
        tracker = _DeltaTracker(self, state)
        try:
            counter.begin(self._base_bytes(args, kwargs))
            with tracker:
                out = self.model(*args, **kwargs)
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                    leaf.register_hook(state.guarded(lambda grad: state.enter_backward()))
            n = len(tracker.segments)
            if n:
                state.policy.close_segment(n - 1, tracker.segments[n - 1])
            state.forward_done(n)
            state.policy.forward_end(n)
            state.release_unneeded()
        except BaseException:
            state.abort()
            raise
        return out


class DeltaModule(ExecutorModule):
    """``model`` trained under DELTA's runtime policy with device memory ``budget`` (bytes):
    same parameters, same results. In eval mode or with gradients disabled it simply runs the
    model. Keyword arguments: see :class:`DeltaExecutor`."""

    executor: DeltaExecutor

    def __init__(self, model: nn.Module, budget: int, backend: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.executor = DeltaExecutor(model, budget, backend, **kwargs)
