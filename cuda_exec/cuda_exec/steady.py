"""The executor's steady steps (every step after its learning step; see executor.py)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import _get_current_function_mode

from .errors import PlanMismatchError
from .inline_swap import swap_saved
from .learn import _act_code, _PlanTracker, _Table
from .program import A_HOLD, A_HOLD_VALUE, A_RETAIN, A_SWAP, A_TRACKED_VALUE, Program
from .segment_frame import Holder, SegmentFrame, unpack
from .step_state import _Entry, _new_entry, _StepState, _SwapHandle
from .units import Segment, ValueRec, ViewMeta, _GlueMode
from .verify import checksum

if TYPE_CHECKING:
    from .executor import Executor

def _steady_entry(st: _StepState, tb: _Table, k: int, t: torch.Tensor, indexed: bool = True) -> _Entry:
    """The swap entry of pack ``k`` of a steady step: new at the first pack of its storage
    version (as in the executor's first step), shared by the later ones (checked). A new entry
    is ``indexed`` by its storage where something may look it up (step_state._Entry)."""
    first = tb.first[k]
    if first == k:
        return _new_entry(st, tb.owner[k], k, t, indexed)
    entry = st.entries.get(first)
    if (entry is None or entry.host is None or entry.ref.expired() or entry.version != t._version
            or entry.ref.cdata != StorageWeakRef(t.untyped_storage()).cdata):
        raise PlanMismatchError(
            f"saved tensor {k} of this forward is not the storage version saved as tensor {first}, "
            "as it was in the executor's first step (data-dependent control flow?)"
        )
    return entry


def _inline_packs(p: Program, st: _StepState) -> List[bool]:
    """Per pack of ``p``: its swap may take the lean path (inline_swap.py): a swap that makes its
    storage's entry, which nothing looks up (no later pack saves the storage version again, no
    segment takes it as an argument, no tracker), of a unit whose swap-out the plan does not
    cancel, with a backend that copies small storages on the host's thread (verify mode: none)."""
    if p.any_tracked or st.verify or st.inline_bytes <= 0 or getattr(st.backend, "copy_out", None) is None:
        return [False] * len(p.acts)
    tb = p.table
    cancelled = st.unstarted | st.in_flight
    return [a == A_SWAP and tb.first[k] == k and k not in p.shared and k not in p.entry_args
            and tb.owner[k] not in cancelled for k, a in enumerate(p.acts)]


def _unpack_starts(p: Program, st: _StepState) -> Tuple[List[int], FrozenSet[int]]:
    """Per pack: the backward stage that the first unpack of its swap starts (-1: none); and
    those stages. Backward stage u starts when unit u's backward first needs one of its swapped
    tensors (the same moment as the gradient of its output, less any of its nodes that needs
    none) where every tensor u's forward saves is either swapped (on the lean path,
    inline_swap.InlineHandle, or the general one, step_state._SwapHandle: both carry the stage)
    or retained as it is (a parameter): a flag per unpack instead of a gradient hook per stage
    (registered in the forward, called through autograd's hook machinery).
    Stages with a swap deadline, and every stage where a state swapper runs, keep their gradient
    hook: their boundary waits or copies at the stage's start; so do units with glue after their
    module call (Program.glue_units): their stage starts with the glue's backward, before the
    unit's own (an unpack start there came later than the cost model's stage, and peaks measured
    up to 19% under their predictions on the zoo's functional_glue). Either trigger starts a stage
    once (``_StepState.fired``), so a stage whose first unpack comes later (autograd runs another
    branch's nodes first) or never (a saved tensor autograd lets go of) is only late: a copy
    back it would have issued is made when needed."""
    n = len(p.acts)
    starts = [-1] * n
    if st.swapper is not None or p.any_tracked:  # (a tracked step's packs may be the tracker's)
        return starts, frozenset()
    bounds = list(p.table.pack_start) + [n]
    acts, glue = p.acts, p.glue_units
    no_hook = set()
    for u in range(len(bounds) - 1):
        lo, hi = bounds[u], bounds[u + 1]
        moved = [acts[k] for k in range(lo, hi) if acts[k] != A_RETAIN]
        if not moved or any(a != A_SWAP for a in moved) or u not in st.prefetch_at or u in st.deadline_stages["bwd"] \
                or u in glue:
            continue
        no_hook.add(u)
        for k in range(lo, hi):
            if acts[k] == A_SWAP:
                starts[k] = u
    return starts, frozenset(no_hook)


class _ScopedTracker(_PlanTracker):
    """The tracker of a steady step of a plan with recomputed units: on (TorchFunctionMode,
    segment recording, ownership at every pack) only from a recomputed unit's start to the end of
    its segment, so the rest of the step runs as the lean path does. What it cannot see (the
    owners of tensors made outside those segments) comes from the table, by order; what it
    decides at each pack is checked against the table."""

    def __init__(self, ex: "Executor", state: _StepState, table: _Table, draws: FrozenSet[int]) -> None:
        super().__init__(ex, state)
        self.table = table
        self.draws = draws  #: first units of the segments that drew random numbers (Program.draws)
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in ex._params}
        self._k = -1  #: the pack being made
        self._taken: Dict[int, int] = {}  #: recomputed unit -> input decisions taken so far

    # the segments of recomputed units ----------------------------------------------------

    def open(self, u: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Unit ``u`` (recomputed) starts: record its inputs, keep its replay state, and track
        everything up to the end of its segment."""
        self._busy += 1
        try:
            self._open_unit(u, module, args, kwargs)
        finally:
            self._busy -= 1
        if not self._active:
            self._active = True
            self._mode = _GlueMode(self)
            self._mode.__enter__()

    def end_unit(self, module: nn.Module, output: Any) -> None:
        """The forward hook of a recomputed unit's module: its outputs are values of its segment."""
        if self._active and self._current is not None and self.segments[self._current].module is module:
            self._post_hook(module, (), {}, output)

    def close(self, check: bool = True) -> None:
        """The segment of the last recomputed unit ended (another unit starts, or the forward
        ends): stop tracking. ``check``: every input the table names was met."""
        if not self._active:
            return
        self._active = False
        mode, self._mode = self._mode, None
        if mode is not None:
            if _get_current_function_mode() is not mode:
                if not check:
                    return  # failing already: leave the stack to the code that changed it
                raise PlanMismatchError(
                    "a torch function mode (such as `with torch.device(...)`) entered in the glue after a "
                    "recomputed unit is still open when the next unit starts; close it before the next "
                    "unit, or do not recompute that unit"
                )
            mode.__exit__(None, None, None)
        self._frames.clear()
        self._current = None
        self._depth = 0
        if check:
            for u, taken in self._taken.items():
                if taken != len(self.table.inputs.get(u, ())):
                    raise PlanMismatchError(
                        f"unit {u} ({self.table.names[u]}) read {taken} tensors made outside recomputed "
                        f"segments, {len(self.table.inputs.get(u, ()))} in the executor's first step "
                        "(data-dependent control flow?)"
                    )
            self._taken.clear()

    # what the tracker cannot see, from the table ----------------------------------------------

    def _input_value(self, seg: Segment, t: torch.Tensor) -> Optional[ValueRec]:
        val = self.value_of(t)
        if val is not None:
            return val
        u = seg.unit
        i = self._taken.get(u, 0)
        known = self.table.inputs.get(u, ())
        if i >= len(known):
            raise PlanMismatchError(
                f"unit {u} ({self.table.names[u]}) read more tensors made outside recomputed segments "
                "than in the executor's first step (data-dependent control flow?)"
            )
        self._taken[u] = i + 1
        d = known[i]
        if d is None:
            return None  # a constant in the first step too
        owner, saved = d
        val, _new = self._register(t, owner)
        val.saved = saved
        return val

    def _copy_now(self, segment: Segment) -> bool:
        # written in place later in the first step, maybe by code this step does not track
        return len(segment.inputs) - 1 in self.table.protect.get(segment.unit, ())

    def _pack_owner(self, reader: int) -> int:
        return self.table.owner[self._k]

    def _swap_entry(self, val: ValueRec, tensor: torch.Tensor, owner: int) -> _Entry:
        return _steady_entry(self.state, self.table, self._k, tensor)

    def on_unit_start(self, index: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self._keep_replay_state(index)  # the stage boundary and its checks are the lean step's

    def _start_state(self, index: int) -> List[torch.Tensor]:
        return self.table.writes.get(index, [])  # as the learning step found

    def _before_write(self, b: torch.Tensor, value: Optional[torch.Tensor], writer: int) -> None:
        pass  # the learning step found what each unit keeps at its start (_start_state)

    def on_param_read(self, segment: Segment, tensor: torch.Tensor) -> None:
        pass

    def _run_may_draw(self, first: int) -> bool:
        # as the learning step found (aligned segments decide alike: program.AlignedSegment):
        # the generators' state (5 KB on a CPU, device memory there) is kept only where needed
        return first in self.draws

    def on_segment_value(self, segment: Segment, index: int, tensor: torch.Tensor) -> None:
        pass  # prefetch stages are hooked by the lean step

    # packs ---------------------------------------------------------------------------------

    def pack_at(self, k: int, t: torch.Tensor) -> Any:
        """Pack ``k`` of the step, made in a tracked segment."""
        self._k = k
        out = self._pack_hook(t)
        if _act_code(out) != self.table.acts[k]:
            raise PlanMismatchError(
                f"saved tensor {k} of this forward is not handled as in the executor's first step "
                "(data-dependent control flow?)"
            )
        return out

    def drop_at(self, k: int, t: torch.Tensor) -> Any:
        """Pack ``k``, made outside the tracked segments, of a value a recomputed unit's segment
        made: dropped, its owner's replay regenerates it."""
        owner = self.table.owner[k]
        val = self.value_of(t)
        rt = self.state.runtimes.get(owner)
        if val is None or rt is None or val not in rt.seg.owned_values:
            raise PlanMismatchError(
                f"saved tensor {k} of this forward is not a value of unit {owner} "
                f"({self.table.names[owner]}), as it was in the executor's first step (data-dependent control flow?)"
            )
        val.saved = True
        digest = checksum(t) if self.state.verify else None
        what = f"recompute of a saved tensor of unit {owner} ({self.table.names[owner]})" if self.state.verify else ""
        return self._drop_value(rt, val, t, ViewMeta.of(t), digest, what)

    def swapped_outside(self, entry: _Entry, t: torch.Tensor) -> None:
        """A storage swapped outside the tracked segments: recomputed units that hold it as an
        input get it from the host copy instead (and so do those that read it later)."""
        val = self.value_of(t)
        if val is not None:
            val.saved = True
            self._convert_slots(val, entry, None)


#: the key of the executor's hook in a tensor's ``_backward_hooks`` (torch's own hooks use int ids)
_HOOK_KEY = "tensorplace.prefetch"


class _Hooks(dict):
    """A tensor's ``_backward_hooks`` as the executor makes them: a dict that a later
    ``Tensor.register_hook`` can refer to weakly (its ``RemovableHandle``), as to the OrderedDict
    it makes itself, which takes 0.2 us longer to make."""

    __slots__ = ("__weakref__",)


def _on_gradient(a: torch.Tensor, fire: Any) -> None:
    """Call ``fire`` when ``a``'s gradient has arrived (before the node that made ``a`` runs), as
    ``a.register_hook(fire)`` would, without its ``RemovableHandle`` (nobody removes it: the
    hook goes with the step's graph): a third of what ``grad_fn.register_prehook`` costs (1.2 us
    against 0.45, timeit), once per prefetch stage and step."""
    hooks = a._backward_hooks
    if hooks is None:
        hooks = a._backward_hooks = _Hooks()
        hooks[_HOOK_KEY] = fire
        a.grad_fn._register_hook_dict(a)
    else:
        first = hooks.get(_HOOK_KEY)
        if first is None or first.state is not fire.state:  # (a tensor kept from an earlier step)
            hooks[_HOOK_KEY] = fire
        elif first is not fire:  # the same tensor hooked for another stage
            hooks[_HOOK_KEY] = _Both(first, fire)


class _Both:
    """Two gradient hooks of one tensor and step, in order."""

    __slots__ = ("first", "second", "state")

    def __init__(self, first: Any, second: Any) -> None:
        self.first = first
        self.second = second
        self.state = second.state

    def __call__(self, grad: Any) -> None:
        self.first(grad)
        self.second(grad)


def _among(a: Any, xs: List[Any]) -> bool:
    for x in xs:
        if a is x:
            return True
    return False


class _SteadyStep:
    """One steady step: it follows the program's events at the hooked module calls, arms the
    saved-tensor hooks in the spans that need them and applies each pack's action (program.py);
    aligned checkpoint segments keep their top calls' arguments (segment_frame.py), tracked ones
    run the tracker (:class:`_ScopedTracker`)."""

    __slots__ = ("ex", "state", "p", "c", "k", "armed", "hooks", "post", "hooked", "tracker", "scoped", "frames",
                 "acts", "hold", "verify", "metas", "inline", "inline_bytes", "owner", "starts", "unpack_started")

    def __init__(self, ex: "Executor", state: _StepState, program: Program) -> None:
        self.ex = ex
        self.state = state
        self.p = program
        self.c = 0  #: the next event
        self.k = 0  #: the next pack (the learning step's numbering; counted in armed spans)
        self.armed = False  #: the saved-tensor hooks are on
        self.hooks: Any = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)
        self.post: Optional[Tuple[int, nn.Module]] = None  #: a prefetch stage's unit, running
        #: the prefetch stage whose unit's outputs were hooked last, and those outputs (weakly:
        #: the step must not keep a tensor alive longer than the model does)
        self.hooked: Tuple[int, List["weakref.ReferenceType[torch.Tensor]"]] = (-1, [])
        self.tracker = _ScopedTracker(ex, state, program.table, program.draws) if program.any_tracked else None
        self.scoped = False  #: a tracked segment runs (the tracker is on)
        self.frames: List[Optional[SegmentFrame]] = [None] * len(program.segments)
        self.acts = program.acts
        self.hold = program.hold
        self.metas = program.metas
        self.verify = state.verify
        inline = program.inline
        if inline is None:
            inline = program.inline = _inline_packs(program, state)
            program.unpack_starts, program.unpack_started = _unpack_starts(program, state)
        self.inline = inline
        self.inline_bytes: int = state.inline_bytes
        self.owner = program.table.owner
        self.starts = program.unpack_starts
        self.unpack_started = program.unpack_started

    # the forward pre-hook of every hooked module (installed once, see Executor._install)
    def call_start(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        c = self.c
        events = self.p.events
        if c >= len(events) or events[c].module is not module:
            raise self._call_mismatch(c, module)
        self.c = c + 1
        ev = events[c]
        u = ev.unit
        if u >= 0:
            if ev.track_close:
                self.scoped = False
                tracker = self.tracker
                assert tracker is not None
                tracker.close()
                self._untracked(tracker.end_run_before, u)
            if ev.disarm:
                self.disarm(ev.pack)
            elif ev.check and self.k != ev.pack:
                raise self._pack_mismatch(ev.pack)
            if ev.boundary:
                self._untracked(self.boundary, u, module, args, kwargs)
            if ev.arm:
                self.k = ev.pack
                self.hooks.__enter__()
                self.armed = True
        if ev.top is not None:
            self._untracked(self._top_call, ev.top, args, kwargs)
        if ev.track_open:
            self.scoped = True
            self.tracker.open(u, module, args, kwargs)  # type: ignore[union-attr]

    def _top_call(self, top: Tuple[int, int], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        s, i = top
        frame = self.frames[s]
        if i == 0:
            frame = self.frames[s] = SegmentFrame(self.p.segments[s], self.state)
            self.state.frames.append(frame)
            frame.start()
        elif frame is None:
            raise PlanMismatchError(f"a checkpoint segment's module call {i} ran before its first call "
                                    "(data-dependent control flow?)")
        frame.capture(i, args, kwargs, self.state.entries)

    def _untracked(self, fn: Any, *a: Any) -> None:
        """Run the step's own work; while the tracker is on, its torch calls are not glue."""
        if not self.scoped:
            fn(*a)
            return
        tr = self.tracker
        tr._busy += 1  # type: ignore[union-attr]
        try:
            fn(*a)
        finally:
            tr._busy -= 1  # type: ignore[union-attr]

    def disarm(self, expected: Optional[int]) -> None:
        """Pop the saved-tensor hooks at the end of an armed span; check its pack count
        (``expected`` None: no check, the step is failing)."""
        self.armed = False
        self.hooks.__exit__(None, None, None)
        if expected is not None and self.k != expected:
            raise self._pack_mismatch(expected)

    def unwind(self) -> None:
        """The step failed: pop what is pushed, without checks."""
        if self.scoped:
            self.scoped = False
            self.tracker.close(check=False)  # type: ignore[union-attr]
        if self.armed:
            self.disarm(None)

    def boundary(self, u: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        st = self.state
        st.stage_start("fwd", u)
        started = self.unpack_started
        if u in self.p.post_units and u not in started:
            self.post = (u, module)
        s = u - 1
        if s in st.prefetch_at and s not in started:
            # unit s's outputs where they are unit u's arguments as they are (program._chained:
            # unit s's module has no forward hook), else a fallback if unit s's output had no
            # gradient: the gradients of unit u's inputs arrive after stage u's backward (never
            # before stage s starts); an input that is an output of unit s is hooked already
            hs, outs = self.hooked
            self._prefetch_hooks(s, (args, kwargs) if kwargs else args, outs if hs == s else (), keep=False)
        self.hooked = (-1, [])

    def _prefetch_hooks(self, s: int, values: Any, hooked: Any = (),
                        keep: bool = True) -> List["weakref.ReferenceType[torch.Tensor]"]:
        """Issue stage ``s``'s prefetches when the gradient of any tensor of ``values`` arrives
        (except those in ``hooked``, weak references to tensors whose hooks do that already);
        returns weak references to the tensors hooked (``keep``; else none)."""
        # a module's arguments or output: mostly a tensor or a tuple of tensors (pytree for the rest)
        if isinstance(values, torch.Tensor):
            leaves: Any = (values,)
        elif type(values) is tuple:
            leaves = values
            for v in values:
                if not isinstance(v, torch.Tensor):
                    leaves = pytree.tree_leaves(values)
                    break
        else:
            leaves = pytree.tree_leaves(values)
        if hooked:
            done = [h() for h in hooked]
            if len(leaves) == 1 and len(done) == 1:  # a unit's one input, the last unit's one output
                if leaves[0] is done[0]:
                    return []
            else:
                leaves = [a for a in leaves if not _among(a, done)]
        out = []
        fire = None
        for a in leaves:
            if isinstance(a, torch.Tensor) and a.grad_fn is not None:
                if fire is None:
                    fire = self.state.prefetch_hook(s)
                _on_gradient(a, fire)
                if keep:
                    out.append(weakref.ref(a))
        return out

    # the forward hook of the unit modules of prefetch stages and tracked units
    def call_end(self, module: nn.Module, output: Any) -> None:
        if self.scoped:
            self.tracker.end_unit(module, output)  # type: ignore[union-attr]
        post = self.post
        if post is not None and post[1] is module:
            self.post = None
            # backward stage u starts (after the glue after it) when its output's gradient arrives
            self._untracked(self._post_hooks, post[0], output)

    def _post_hooks(self, u: int, output: Any) -> None:
        self.hooked = (u, self._prefetch_hooks(u, output))

    def _call_mismatch(self, c: int, module: nn.Module) -> PlanMismatchError:
        events = self.p.events
        got = self.ex.unit_modules.get(module, type(module).__name__)
        want = (self.ex.unit_modules.get(events[c].module, type(events[c].module).__name__) if c < len(events)
                else "no further hooked call")
        return PlanMismatchError(
            f"hooked module call {c} of this forward is {got!r}; in the executor's first step it was "
            f"{want!r} (data-dependent control flow or a different model)"
        )

    def _pack_mismatch(self, expected: int) -> PlanMismatchError:
        return PlanMismatchError(
            f"a span that ended at saved tensor {expected} in the executor's first step ended at "
            f"saved tensor {self.k} in this forward (data-dependent control flow?)"
        )

    # the saved-tensor pack hook (only in armed spans)
    def pack(self, t: torch.Tensor) -> Any:
        k = self.k
        self.k = k + 1
        if self.scoped:
            return self.tracker.pack_at(k, t)  # type: ignore[union-attr]
        acts = self.acts
        if k >= len(acts):
            raise PlanMismatchError(f"this forward saved more tensors than the executor's first step ({len(acts)}; "
                                    "data-dependent control flow?)")
        a = acts[k]
        if a == A_RETAIN:
            # a leaf (a parameter) as it is, as autograd keeps it; anything else detached: see units._kept
            return t if t.is_leaf else t.detach()
        if a == A_HOLD:
            s, i = self.hold[k]  # type: ignore[misc]
            frame = self.frames[s]
            if frame is None:
                raise self._pack_mismatch(k)
            h = Holder(frame, i)
            frame.holders[i] = weakref.ref(h)
            if self.verify:
                self._verify(h, t, self.p.segments[s].first)
            return h
        if a == A_SWAP:
            if self.inline[k] and t.is_cpu:  # (the general path refuses a tensor of another device)
                storage = t.untyped_storage()
                n = storage.nbytes()
                if n <= self.inline_bytes:
                    meta = self.metas[k]
                    if meta is None or not meta.describes(t):
                        meta = self.metas[k] = ViewMeta.of(t)
                    return swap_saved(self.state, self.owner[k], storage, meta, n, self.starts[k])
            return self._swap(k, t)
        if a == A_HOLD_VALUE:
            s, i, pos = self.hold[k]  # type: ignore[misc]
            frame = self.frames[s]
            if frame is None:
                raise self._pack_mismatch(k)
            h = frame.hold_value(i, pos, t)
            if self.verify:
                self._verify(h, t, self.p.segments[s].first)
            return h
        if a == A_TRACKED_VALUE and self.tracker is not None:
            return self.tracker.drop_at(k, t)
        raise PlanMismatchError(f"saved tensor {k} of this forward was made outside the segment that made it "
                                "in the executor's first step (data-dependent control flow?)")

    def _verify(self, h: Any, t: torch.Tensor, unit: int) -> None:
        h.digest = checksum(t)
        h.what = f"recompute of a saved tensor of the segment starting at unit {unit} ({self.p.table.names[unit]})"

    def _swap(self, k: int, t: torch.Tensor) -> Any:
        st = self.state
        tb = self.p.table
        entry = _steady_entry(st, tb, k, t, self.tracker is not None or k in self.p.shared)
        if self.tracker is not None:
            self.tracker.swapped_outside(entry, t)
        binds = self.p.entry_args.get(k)
        if binds:
            for s, i, leaf in binds:
                frame = self.frames[s]
                if frame is not None:
                    frame.bind_entry(i, leaf, entry)
        meta = self.metas[k]
        if meta is None or not meta.describes(t):
            meta = self.metas[k] = ViewMeta.of(t)
        if st.verify:
            return _SwapHandle(st, entry, meta, entry.device, checksum(t),
                               f"swap of a saved tensor of unit {entry.unit} ({tb.names[entry.unit]})", self.starts[k])
        return _SwapHandle(st, entry, meta, entry.device, None, "", self.starts[k])

    def finish(self, out: Any) -> None:
        p = self.p
        tb = p.table
        n = len(tb.pack_start)
        self.hooked = (-1, [])
        if self.c != len(p.events):
            raise PlanMismatchError(
                f"the model made {self.c} calls of hooked modules, {len(p.events)} in the executor's first step"
            )
        if self.scoped:
            self.scoped = False
            self.tracker.close()  # type: ignore[union-attr]
            self.tracker.end_run_before(n)  # type: ignore[union-attr]
        if self.armed:
            self.disarm(len(tb.acts))
        st = self.state
        st.stats.units = n
        st.stats.dropped_tensors += sum(sum(r is not None for r in f.holders) + len(f.values)
                                        for f in self.frames if f is not None)
        st.forward_done(n)
        st.release_unneeded()
        for frame in self.frames:
            if frame is not None and not frame.live():
                frame.release()  # nobody will need its replay
        last = n - 1
        prefetch_last = (bool(p.swaps) or st.swapper is not None) and last in st.prefetch_at
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

