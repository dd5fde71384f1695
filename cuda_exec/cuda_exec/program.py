"""What a steady step runs, made from the executor's learning step (see executor.py).

The learning step records every module call of the forward (where it starts and ends among the
glue calls, packs and unit starts; the values of its tensor arguments and outputs) besides the
table of packs (learn._Table). :func:`build_program` turns that into a :class:`Program`:

* **Checkpoint segments replayed from their module calls** (:class:`AlignedSegment`). A segment
  (a run of consecutive recomputed units) is *aligned* when the module calls that lie wholly in
  it (its *top calls*: the outermost calls whose units are all in the segment and that run no
  glue before their first unit) hold everything its replay must regenerate: no glue outside
  them makes a value the replay needs (a tensor saved by a dropped pack, or an argument of a
  later top call), and every tensor their units read from outside comes in through the top
  calls' arguments. Its replay calls those modules again on the arguments the forward passed,
  as ``torch.utils.checkpoint`` calls its function again: no Python per torch op in any step
  after the learning step. Each argument is regenerated (an output of an earlier top call),
  held (by reference, or as a private copy when the forward writes into it later), or brought
  back from the host (the swap of its owner).
* **Other segments are tracked**: a steady step runs the unit tracker over them (a
  TorchFunctionMode on their glue) and replays what it recorded (recorded_replay.py).
* **Events**: the calls of the modules a steady step hooks (unit starts where the saved-tensor
  hooks go on or off, where the plan has stage-boundary work, where tracked segments start and
  end; top calls), in forward order, each with what to do; a steady step checks every hooked
  call against them.
* **Per pack** (in the learning step's numbering): the action of the steady step (``A_*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from .learn import REPLAY_SLOT, REPLAY_VALUE, RETAIN, SWAP, _Table
from .units import UnitTracker, ValueRec, ViewMeta

if TYPE_CHECKING:
    from .recorded_replay import _InputSlot

__all__ = ["A_RETAIN", "A_SWAP", "A_HOLD", "A_HOLD_VALUE", "A_TRACKED", "A_TRACKED_VALUE", "ArgKind",
           "TopCall", "AlignedSegment", "Event", "Program", "build_program"]

#: what a steady step does with a pack (in an armed span)
A_RETAIN, A_SWAP, A_HOLD, A_HOLD_VALUE, A_TRACKED, A_TRACKED_VALUE = range(6)

#: how a top call's tensor argument is obtained for its replay
ARG_HOLD, ARG_COPY, ARG_ENTRY, ARG_REGEN = range(4)


@dataclass
class ArgKind:
    """A tensor argument of a top call: ``ARG_HOLD`` (kept by reference), ``ARG_COPY`` (a private
    copy, the forward writes into it later), ``ARG_ENTRY`` (its owner swaps it: the swap entry of
    pack ``pack``), ``ARG_REGEN`` (output ``pos`` of top call ``call`` of the same segment)."""

    kind: int
    pack: int = -1
    call: int = -1
    pos: int = -1
    #: the call writes into it in place: the replay attaches it to the graph as a non-leaf
    #: (a leaf that requires grad cannot be written in place)
    written: bool = False


@dataclass
class TopCall:
    """One module call an aligned segment's replay makes again."""

    module: nn.Module
    #: per leaf of the call's flattened (args, kwargs): None for a non-tensor leaf (taken from the
    #: step as it is), else how the tensor is obtained for the replay
    args: List[Optional[ArgKind]]
    #: positions of the flattened output the replay keeps after the call (later top calls'
    #: arguments, values handed to packs outside the top calls)
    keep: List[int]
    packs: int  #: packs its forward makes
    #: it was called with positional tensors only (its arguments need no flattening)
    simple: bool = False


@dataclass
class AlignedSegment:
    """A checkpoint segment replayed from its module calls (module docstring)."""

    index: int  #: its position in Program.segments
    first: int  #: its first unit
    last: int  #: its last unit
    calls: List[TopCall]
    random: bool  #: its forward draws random numbers (the replay restores the generators)
    #: buffers (BatchNorm running statistics) and parameters its forward writes into, and those
    #: of ``start_state``: put back after the replay
    restore: List[torch.Tensor]
    holds: int  #: packs of its top calls (the replay's captures)
    #: buffers the replay starts from as the segment's forward saw them (units.replay_start_state:
    #: written by it, or read by it and written later in the forward), kept at its start
    start_state: List[torch.Tensor] = field(default_factory=list)


@dataclass
class Event:
    """One call of a hooked module in the forward (a steady step's forward pre-hook)."""

    module: nn.Module
    unit: int = -1  #: the unit that starts here, or -1
    pack: int = 0  #: packs of the learning step before this call
    disarm: bool = False  #: the saved-tensor hooks go off here (after checking the pack count)
    arm: bool = False  #: the saved-tensor hooks go on here
    check: bool = False  #: the hooks stay on: check the pack count
    boundary: bool = False  #: forward stage-boundary work of ``unit``
    track_open: bool = False  #: ``unit`` is tracked (its segment recorded for its replay)
    track_close: bool = False  #: a tracked stretch ends here
    top: Optional[Tuple[int, int]] = None  #: (aligned segment, top call) starting here


@dataclass
class Program:
    """What a steady step runs (module docstring)."""

    table: _Table
    events: List[Event]
    #: modules with a forward pre-hook (the modules of ``events``) and with a forward hook (units
    #: of prefetch stages and tracked units)
    pre_modules: List[nn.Module]
    post_modules: List[nn.Module]
    acts: List[int]  #: per pack of the learning step (meaningful in armed spans)
    #: per pack: A_HOLD (segment, capture index) or A_HOLD_VALUE (segment, top call, output position)
    hold: List[Optional[Tuple[int, ...]]]
    segments: List[AlignedSegment]
    tracked: List[bool]  #: per unit: its segment is tracked
    armed: List[bool]  #: per unit: the saved-tensor hooks are on in its segment
    #: per pack: the pending top-call arguments a swap entry made at this pack binds
    entry_args: Dict[int, List[Tuple[int, int, int]]] = field(default_factory=dict)
    #: packs whose storage version a later pack saves again (its swap entry is shared, checked)
    shared: FrozenSet[int] = frozenset()
    #: prefetch-stage units whose outputs a forward hook of their module hooks for the backward;
    #: the others' outputs are the next unit's arguments, which its pre-hook hooks (chained)
    post_units: FrozenSet[int] = frozenset()
    #: per pack: the view of the tensor it swapped in the steady steps so far (made at the first,
    #: checked at every later one), so that a step makes no new ViewMeta for a swapped pack
    metas: List[Optional[ViewMeta]] = field(default_factory=list)
    #: first units of the checkpoint segments whose forward drew random numbers in the learning
    #: step (their replays restore the generators)
    draws: FrozenSet[int] = frozenset()
    #: per pack: its swap takes the lean path (inline_swap.py) when its storage is small enough;
    #: None until a steady step decides it (steady._inline_packs)
    inline: Optional[List[bool]] = None
    #: per pack: the backward stage that the first unpack of its swap starts, or -1; and those
    #: stages, which no gradient hook starts (steady._unpack_starts)
    unpack_starts: List[int] = field(default_factory=list)
    unpack_started: FrozenSet[int] = frozenset()
    #: units after whose module call glue ran (torch calls outside unit modules) before the next
    #: unit's: their backward stage starts with the glue's backward
    glue_units: FrozenSet[int] = frozenset()

    @property
    def swaps(self) -> int:
        return self.acts.count(A_SWAP)

    @property
    def any_tracked(self) -> bool:
        return any(self.tracked)


def _runs(actions: Sequence[str], run_start: Sequence[int]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for u, a in enumerate(actions):
        if a != "recompute":
            continue
        if out and run_start[u] == out[-1][0] and out[-1][1] == u - 1:
            out[-1] = (out[-1][0], u)
        else:
            out.append((u, u))
    return out


class _Aligner:
    """Decides, for each checkpoint segment, whether its replay can call its modules again."""

    def __init__(self, table: _Table, tracker: UnitTracker) -> None:
        self.t = table
        self.tr = tracker
        self.segs = tracker.segments
        self.n = len(tracker.segments)
        self.random = [bool(r.random) for r in tracker.records]
        self.scopes = tracker.glue_scopes()
        # the unit of each pack
        self.pack_unit: List[int] = []
        u = -1
        for k in range(len(table.acts)):
            while u + 1 < len(table.pack_start) and table.pack_start[u + 1] <= k:
                u += 1
            self.pack_unit.append(u)

    def top_calls(self, first: int, last: int) -> List[int]:
        """The outermost module calls whose units are all in first..last and that run no glue
        before their first unit, in order (indexes into table.calls)."""
        out: List[int] = []
        for c, rec in enumerate(self.t.calls):
            if rec.units_exit <= rec.units_enter or rec.units_enter < first or rec.units_exit - 1 > last:
                continue
            if out and rec.enter < self.t.calls[out[-1]].exit:
                continue  # inside an earlier one
            if not self.tr.replayable_call(c):
                continue  # it runs glue before its first unit: that glue belongs to the unit before
            out.append(c)
        return out

    def align(self, index: int, first: int, last: int,
              slots: Dict[Tuple[int, int], "_InputSlot"]) -> Optional[AlignedSegment]:
        t = self.t
        # every unit's glue lies in a module call whose units are all in the segment (the cost
        # model's rule too: docs/cost-model.md, "Host time")
        for u in range(first, last + 1):
            scope = self.scopes[u]
            if scope is not None and not (first <= scope[0] and scope[1] <= last):
                return None
        tops = self.top_calls(first, last)
        if not tops or sum(t.calls[c].units_exit - t.calls[c].units_enter for c in tops) != last - first + 1:
            return None
        recs = [t.calls[c] for c in tops]
        in_run = range(first, last + 1)
        top_of_unit: Dict[int, int] = {}
        for i, rec in enumerate(recs):
            for u in range(rec.units_enter, rec.units_exit):
                top_of_unit[u] = i
        # where each output value of a top call is: (top call, position)
        out_pos: Dict[ValueRec, Tuple[int, int]] = {}
        for i, rec in enumerate(recs):
            for p, v in enumerate(rec.out_values):
                if v is not None and v.owner in in_run:
                    out_pos.setdefault(v, (i, p))
        keep: List[Set[int]] = [set() for _ in recs]
        # the values its replay hands to packs outside the top calls' own: values of its units
        # dropped by packs anywhere, and packs in its span after its last top call
        for k, a in enumerate(t.acts):
            if a not in (REPLAY_VALUE, REPLAY_SLOT):
                continue
            v = t.values[k]
            u = self.pack_unit[k]
            inside_span = first <= u <= last
            in_top = inside_span and any(r.pack_enter <= k < r.pack_exit for r in recs)
            if in_top:
                continue
            if v is None:
                return None
            if inside_span or (a == REPLAY_VALUE and v.owner in in_run):
                if v not in out_pos:
                    return None  # a value no top call returns: only the glue that made it has it
                i, p = out_pos[v]
                keep[i].add(p)
        # the top calls' arguments
        calls: List[TopCall] = []
        entry_args: List[Tuple[int, int, int]] = []  # (pack, top call, leaf)
        # a value is a storage's version, which several views share (a Permute module's output
        # and its input): an argument comes from the last earlier top call that returned that
        # very view; where none did, glue outside the top calls made it, which a replay does not run
        view_pos: Dict[Tuple[int, ViewMeta], Tuple[int, int]] = {}
        # buffers the replay must see as the forward did (the learning step's table.writes): one
        # passed to a top call as an argument is held by reference, which the forward later
        # writes into; such a segment is tracked (its replay puts the buffer's value back)
        kept = {id(b) for u in in_run for b in t.writes.get(u, ())}
        for i, rec in enumerate(recs):
            args: List[Optional[ArgKind]] = []
            for leaf, v in enumerate(rec.arg_values):
                if v is None:
                    if rec.arg_tensor[leaf] and rec.arg_ids[leaf] in kept:
                        return None
                    args.append(ArgKind(ARG_HOLD) if rec.arg_tensor[leaf] else None)
                    continue
                if v.owner in in_run:
                    pos = view_pos.get((id(v), rec.arg_views[leaf]))
                    if pos is None:
                        return None
                    keep[pos[0]].add(pos[1])
                    args.append(ArgKind(ARG_REGEN, call=pos[0], pos=pos[1]))
                    continue
                slot = slots.get((first, id(v)))
                kind = getattr(slot, "kind", "tensor")
                if kind == "entry" and slot is not None and slot.entry is not None:
                    k = t.entry_first.get(id(slot.entry))
                    if k is None:
                        return None
                    args.append(ArgKind(ARG_ENTRY, pack=k))
                    entry_args.append((k, i, leaf))
                elif kind == "tensor" and slot is not None and slot.protected:
                    args.append(ArgKind(ARG_COPY))
                else:
                    args.append(ArgKind(ARG_HOLD))
            for leaf, kind in enumerate(args):
                if kind is not None:
                    kind.written = rec.arg_written[leaf]
            for p, v in enumerate(rec.out_values):
                if v is not None and v.owner in in_run:
                    view_pos[(id(v), rec.out_views[p])] = (i, p)
            calls.append(TopCall(rec.module, args, [], rec.pack_exit - rec.pack_enter, rec.simple))
        # every tensor its units read from outside their top call comes in as an argument of it
        for u in in_run:
            seg = self.segs[u]
            if seg is None:
                return None
            rec = recs[top_of_unit[u]]
            args_of = {id(v) for v in rec.arg_values if v is not None}
            for ref in seg.inputs:
                v = ref.value
                if v.owner in in_run and top_of_unit.get(v.owner) == top_of_unit[u]:
                    continue  # made inside the same top call
                if id(v) not in args_of:
                    return None
        for i, call in enumerate(calls):
            call.keep = sorted(keep[i])
        restore: List[torch.Tensor] = []
        start_state: List[torch.Tensor] = []
        seen: Set[int] = set()
        for u in in_run:
            for b in t.calls[t.unit_call[u]].mutated_buffers + self.segs[u].mutated_params:
                if id(b) not in seen:
                    seen.add(id(b))
                    restore.append(b)
            start_state += [b for b in t.writes.get(u, []) + self.segs[u].mutated_params
                            if all(b is not x for x in start_state)]
        for b in start_state:  # put back after the replay too (one it only reads included)
            if id(b) not in seen:
                seen.add(id(b))
                restore.append(b)
        seg = AlignedSegment(index, first, last, calls, any(self.random[u] for u in in_run), restore,
                             sum(c.packs for c in calls), start_state)
        self.entry_args = entry_args
        return seg



def build_program(table: _Table, tracker: UnitTracker, actions: Sequence[str], run_start: Sequence[int],
                  slots: Dict[Tuple[int, int], "_InputSlot"], work: Sequence[bool], post_units: Set[int],
                  aligned: bool = True) -> Program:
    """The steady program of a learning step (module docstring). ``slots``: the learning step's
    input slots of recomputed units, by (first unit of their segment, id(value)); ``work``: per unit, forward
    stage-boundary work; ``post_units``: units whose module needs a forward hook (prefetch
    stages); ``aligned``: replay aligned segments from their module calls (False: track every
    recomputed unit, the recorded path)."""
    n = len(table.pack_start)
    runs = _runs(actions[:n], run_start)
    table.calls, table.unit_call = tracker.calls, tracker.unit_call
    aligner = _Aligner(table, tracker)
    seg_list: List[AlignedSegment] = []
    seg_of_unit = [-1] * n
    tracked = [False] * n
    entry_args: Dict[int, List[Tuple[int, int, int]]] = {}
    for first, last in runs:
        seg = aligner.align(len(seg_list), first, last, slots) if aligned else None
        if seg is None:
            for u in range(first, last + 1):
                tracked[u] = True
            continue
        seg_list.append(seg)
        for u in range(first, last + 1):
            seg_of_unit[u] = seg.index
        for k, i, leaf in aligner.entry_args:
            entry_args.setdefault(k, []).append((seg.index, i, leaf))
    table.finish(table.names, tracked)
    # per pack: the steady action
    acts: List[int] = []
    hold: List[Optional[Tuple[int, ...]]] = []
    top_ranges: List[List[Tuple[int, int, int]]] = []  # per aligned segment: (pack_enter, pack_exit, top call)
    for seg in seg_list:
        ranges = []
        tops = aligner.top_calls(seg.first, seg.last)
        for i, c in enumerate(tops):
            rec = table.calls[c]
            ranges.append((rec.pack_enter, rec.pack_exit, i))
        top_ranges.append(ranges)
    out_pos: List[Dict[ValueRec, Tuple[int, int]]] = []
    for seg in seg_list:
        d: Dict[ValueRec, Tuple[int, int]] = {}
        for i, c in enumerate(aligner.top_calls(seg.first, seg.last)):
            for p, v in enumerate(table.calls[c].out_values):
                if v is not None:
                    d.setdefault(v, (i, p))
        out_pos.append(d)
    for k, a in enumerate(table.acts):
        u = aligner.pack_unit[k]
        s = seg_of_unit[u] if u >= 0 else -1
        if u >= 0 and tracked[u]:
            acts.append(A_TRACKED)
            hold.append(None)
            continue
        if a == RETAIN:
            acts.append(A_RETAIN)
            hold.append(None)
        elif a == SWAP:
            acts.append(A_SWAP)
            hold.append(None)
        elif s >= 0:
            captured = 0
            found = None
            for lo, hi, _i in top_ranges[s]:
                if lo <= k < hi:
                    found = captured + (k - lo)
                    break
                captured += hi - lo
            if found is not None:
                acts.append(A_HOLD)
                hold.append((s, found))
            else:
                v = table.values[k]
                i, p = out_pos[s][v]  # present: align() checked it
                acts.append(A_HOLD_VALUE)
                hold.append((s, i, p))
        else:
            owner = table.owner[k]
            so = seg_of_unit[owner] if 0 <= owner < n else -1
            if so >= 0:
                i, p = out_pos[so][table.values[k]]
                acts.append(A_HOLD_VALUE)
                hold.append((so, i, p))
            else:
                acts.append(A_TRACKED_VALUE)
                hold.append(None)
    # armed units: their segment makes a pack that is not retained, or is recomputed
    armed = [tracked[u] or seg_of_unit[u] >= 0 for u in range(n)]
    for k, a in enumerate(acts):
        if a != A_RETAIN:
            armed[aligner.pack_unit[k]] = True
    # events: unit starts where something happens, and top calls
    starts: Dict[int, Event] = {}
    for u in range(n):
        prev_armed = armed[u - 1] if u > 0 else False
        prev_tracked = tracked[u - 1] if u > 0 else False
        ev = Event(table.calls[table.unit_call[u]].module, unit=u, pack=table.pack_start[u])
        ev.disarm = prev_armed and not armed[u]
        ev.arm = armed[u] and not prev_armed
        ev.check = prev_armed and armed[u]
        ev.boundary = bool(work[u])
        ev.track_open = tracked[u]
        ev.track_close = prev_tracked and not tracked[u]
        # (a span's pack count is checked where it ends and at the end of the forward: no hook
        # is added only to check it)
        if ev.disarm or ev.arm or ev.boundary or ev.track_open or ev.track_close:
            starts[table.unit_call[u]] = ev
    tops: Dict[int, Tuple[int, int]] = {}
    for seg in seg_list:
        for i, c in enumerate(aligner.top_calls(seg.first, seg.last)):
            tops[c] = (seg.index, i)
    hooked = {id(table.calls[c].module) for c in list(starts) + list(tops)}
    events: List[Event] = []
    for c, rec in enumerate(table.calls):
        if id(rec.module) not in hooked:
            continue
        ev = starts.get(c) or Event(rec.module, pack=rec.pack_enter)
        ev.top = tops.get(c)
        events.append(ev)
    pre: Dict[int, nn.Module] = {id(e.module): e.module for e in events}
    post: Dict[int, nn.Module] = {}
    hooked_out = frozenset(u for u in post_units if not _chained(table, u, starts))
    for u in range(n):
        if u in hooked_out or tracked[u]:
            m = table.calls[table.unit_call[u]].module
            post[id(m)] = m
    shared = frozenset(f for k, f in enumerate(table.first) if f != k)
    draws = frozenset(first for first, last in runs if any(aligner.random[u] for u in range(first, last + 1)))
    program = Program(table, events, list(pre.values()), list(post.values()), acts, hold, seg_list, tracked, armed,
                      entry_args, shared, hooked_out, [None] * len(acts), draws)
    program.glue_units = frozenset(u for _, u in tracker.glue_events)
    return program


def _chained(table: _Table, u: int, starts: Dict[int, Event]) -> bool:
    """Unit ``u``'s outputs are, as they are (the same tensors), arguments of unit ``u + 1``'s
    call, whose pre-hook does stage work: that hook can hook them for the backward, and ``u``'s
    module needs no forward hook of its own (a Sequential of units: one hook per unit, not two)."""
    if u + 1 >= len(table.unit_call):
        return False
    nxt = table.unit_call[u + 1]
    ev = starts.get(nxt)
    if ev is None or not ev.boundary:
        return False
    out, arg = table.calls[table.unit_call[u]], table.calls[nxt]
    args = {(i, id(v), m) for i, v, m in zip(arg.arg_ids, arg.arg_values, arg.arg_views) if i is not None and v is not None}
    outs = [(i, v, m) for i, v, m in zip(out.out_ids, out.out_values, out.out_views) if i is not None]
    return bool(outs) and all(v is not None and (i, id(v), m) in args for i, v, m in outs)
