"""The executor's steady steps (every step after its learning step; see executor.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import _get_current_function_mode

from .errors import PlanMismatchError
from .learn import REPLAY_VALUE, RETAIN, SWAP, _act_code, _PlanTracker, _Table
from .step_state import _Entry, _new_entry, _StepState, _SwapHandle, _unpack_handle
from .units import Segment, ValueRec, ViewMeta, _GlueMode
from .verify import checksum

if TYPE_CHECKING:
    from .executor import Executor

def _steady_entry(st: _StepState, tb: _Table, k: int, t: torch.Tensor) -> _Entry:
    """The swap entry of pack ``k`` of a steady step: new at the first pack of its storage
    version (as in the executor's first step), shared by the later ones (checked)."""
    first = tb.first[k]
    if first == k:
        return _new_entry(st, tb.owner[k], k, t)
    entry = st.entries.get(first)
    if (entry is None or entry.host is None or entry.ref.expired() or entry.version != t._version
            or entry.ref.cdata != StorageWeakRef(t.untyped_storage()).cdata):
        raise PlanMismatchError(
            f"saved tensor {k} of this forward is not the storage version saved as tensor {first}, "
            "as it was in the executor's first step (data-dependent control flow?)"
        )
    return entry


class _ScopedTracker(_PlanTracker):
    """The tracker of a steady step of a plan with recomputed units: on (TorchFunctionMode,
    segment recording, ownership at every pack) only from a recomputed unit's start to the end of
    its segment, so the rest of the step runs as the lean path does. What it cannot see (the
    owners of tensors made outside those segments) comes from the table, by order; what it
    decides at each pack is checked against the table."""

    def __init__(self, ex: "Executor", state: _StepState, table: _Table) -> None:
        super().__init__(ex, state)
        self.table = table
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


class _LeanStep:
    """One steady step: counters, the step's state and the table (and, for a plan with
    recomputed units, the tracker of their segments)."""

    __slots__ = ("ex", "state", "t", "calls", "packs", "limit", "armed", "hooks", "work", "post", "tracker",
                 "scoped")

    def __init__(self, ex: "Executor", state: _StepState, table: _Table, work: List[bool]) -> None:
        self.ex = ex
        self.state = state
        self.t = table
        self.calls = 0
        self.packs = 0  #: index of the next pack of the step (counted in armed segments)
        self.limit = 0  #: packs made before the end of the armed segment
        self.armed = False  #: the saved-tensor hooks are on (a segment with a swapped pack)
        self.hooks: Any = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack_handle)
        self.work = work  #: per unit: boundary work to do at its start
        self.post: Optional[Tuple[int, nn.Module]] = None  #: a prefetch stage's unit, running
        self.tracker = _ScopedTracker(ex, state, table) if any(table.recompute) else None
        self.scoped = False  #: a recomputed unit's segment runs (the tracker is on)

    # the forward pre-hook of every unit module (installed once, see Executor._install)
    def unit_start(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        c = self.calls
        t = self.t
        if c >= len(t.modules) or t.modules[c] is not module:
            raise self._call_mismatch(c, module)
        self.calls = c + 1
        u = t.call_unit[c]
        if u < 0:
            return
        if self.scoped and not t.recompute[u]:
            self.scoped = False
            self.tracker.close()  # type: ignore[union-attr]
        if self.armed:
            self.disarm(t.pack_start[u])
        self._untracked(self._start, u, module, args, kwargs)

    def _untracked(self, fn: Any, *a: Any) -> None:
        """Run the step's own work; while the tracker is on (recomputed units in a row), its
        torch calls are not glue."""
        if not self.scoped:
            fn(*a)
            return
        tr = self.tracker
        tr._busy += 1  # type: ignore[union-attr]
        try:
            fn(*a)
        finally:
            tr._busy -= 1  # type: ignore[union-attr]

    def _start(self, u: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        t = self.t
        if t.armed[u]:
            # the saved-tensor hooks are pushed only for segments that save a swapped or dropped
            # tensor, or are tracked: packs elsewhere cost nothing (TE's offload context per layer
            # does the same)
            self.packs = t.pack_start[u]
            self.limit = t.seg_end(u)
            self.hooks.__enter__()
            self.armed = True
        if self.work[u]:
            self.boundary(u, args)
        if t.recompute[u]:
            self.scoped = True
            self.tracker.open(u, module, args, kwargs)  # type: ignore[union-attr]

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

    def unwind(self) -> None:
        """The step failed: pop what is pushed, without checks."""
        if self.scoped:
            self.scoped = False
            self.tracker.close(check=False)  # type: ignore[union-attr]
        if self.armed:
            self.disarm(None)

    def boundary(self, u: int, args: Tuple[Any, ...]) -> None:
        st = self.state
        if st.by_unit or st.swapper is not None:
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

    # the forward hook of the unit modules of prefetch stages and recomputed units
    def unit_end(self, module: nn.Module, output: Any) -> None:
        if self.scoped:
            self.tracker.end_unit(module, output)  # type: ignore[union-attr]
        self._untracked(self._end, module, output)

    def _end(self, module: nn.Module, output: Any) -> None:
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

    # the saved-tensor pack hook (only in armed segments)
    def pack(self, t: torch.Tensor) -> Any:
        k = self.packs
        self.packs = k + 1
        tb = self.t
        if k >= self.limit:
            raise PlanMismatchError(
                f"a segment saved more tensors than in the executor's first step ({self.limit} packs "
                "up to its end; data-dependent control flow?)"
            )
        if self.scoped:
            return self.tracker.pack_at(k, t)  # type: ignore[union-attr]
        a = tb.acts[k]
        if a == RETAIN:
            return t
        if a == SWAP:
            return self._swap(k, t)
        if a == REPLAY_VALUE and self.tracker is not None:
            return self.tracker.drop_at(k, t)
        raise PlanMismatchError(f"saved tensor {k} of this forward was made outside the segment that made it "
                                "in the executor's first step (data-dependent control flow?)")

    def _swap(self, k: int, t: torch.Tensor) -> Any:
        st = self.state
        tb = self.t
        entry = _steady_entry(st, tb, k, t)
        if self.tracker is not None:
            self.tracker.swapped_outside(entry, t)
        digest = what = None
        if st.verify:
            digest = checksum(t)
            what = f"swap of a saved tensor of unit {entry.unit} ({tb.names[entry.unit]})"
        return _SwapHandle(st, entry, ViewMeta.of(t), t.device, digest, what or "")

    def finish(self, out: Any) -> None:
        tb = self.t
        if self.calls != len(tb.modules):
            raise PlanMismatchError(
                f"the model ran {self.calls} unit-module calls, {len(tb.modules)} in the executor's first step"
            )
        if self.scoped:
            self.scoped = False
            self.tracker.close()  # type: ignore[union-attr]
        if self.armed:
            self.disarm(len(tb.acts))
        st = self.state
        st.stats.units = len(tb.pack_start)
        st.forward_done(len(tb.pack_start))
        st.release_unneeded()
        last = len(tb.pack_start) - 1
        prefetch_last = (bool(tb.swaps) or st.swapper is not None) and last in st.prefetch_at
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

