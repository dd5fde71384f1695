"""The lean swap path of a steady step: a swapped unit's small storages, copied out and back by
the backend on the host's thread, a stage's at once.

The general path (step_state._Entry) makes, per swapped storage, an entry, a backend handle and
a call to the backend at each of its four moves (out, deadline, back, release). Storages of at
most the backend's ``inline_bytes``, whose copies complete inside the call (the CPU backend's
``copy_out``/``copy_back``/``give_back``), need none of that: an :class:`InlineGroup` keeps a
swapped unit's storages by slot; a stage boundary copies out every storage saved since the last
one in one call (:func:`copy_out_saved`), a prefetch stage copies its units' storages back in
one call (:func:`copy_back_units`), which gives their host buffers back (those never copied
back go when the last of the unit's saved tensors is freed). Device memory moves as on the
general path: a storage's bytes leave at the stage boundary after it was saved, come back at
its unit's prefetch stage, and each storage's copy is freed when autograd lets go of its saved
tensor.

Packs that something else may look up (a storage version saved again later, a checkpoint
segment's argument, a tracked segment's value), units whose swap-out the plan cancels, and
verify mode take the general path (steady.py decides, per pack).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, List, Optional

import torch

from .units import ViewMeta

if TYPE_CHECKING:
    from .step_state import _StepState


#: a slot whose saved tensor autograd let go of
FREED: Any = object()


class InlineGroup:
    """A swapped unit's storages of one step, by slot (in pack order)."""

    __slots__ = ("unit", "device", "host", "views", "copied", "live")

    def __init__(self, unit: int) -> None:
        self.unit = unit
        #: per slot, its device bytes: the saved storage until the stage boundary copies it out,
        #: then the saved tensor once copied back (None between; FREED once autograd let go of it)
        self.device: List[Any] = []
        #: per slot, the saved tensor's view of its storage
        self.views: List[ViewMeta] = []
        #: per slot copied out, its host buffer (None: freed before its copy, or given back by
        #: its copy back); the rest are given back with the group's last slot
        self.host: List[Optional[torch.Tensor]] = []
        self.copied = 0  #: slots before this one were handed to a copy out
        self.live = 0  #: slots whose saved tensor autograd still holds

    def fetch(self, slot: int, state: "_StepState") -> torch.Tensor:
        """Slot ``slot``'s saved tensor, copied back now: the plan did not prefetch it."""
        buf = self.host[slot] if self.device[slot] is None else None
        if buf is None:
            state.check_alive()
            raise RuntimeError(f"a swapped tensor of unit {self.unit} was needed after it was freed")
        state.stats.unscheduled_fetches += 1
        t = self.device[slot] = state.backend.copy_back([buf], [self.views[slot]])[0]
        return t

    def free(self, state: "_StepState") -> None:
        self.device = []
        self.views = []
        host, self.host = self.host, []
        bufs = [b for b in host if b is not None]
        if bufs:
            state.backend.give_back(bufs)
        if state.inline_groups.get(self.unit) is self:
            del state.inline_groups[self.unit]


def swap_saved(state: "_StepState", owner: int, storage: torch.UntypedStorage, meta: ViewMeta,
               nbytes: int) -> "InlineHandle":
    """A saved tensor of unit ``owner`` over ``storage`` (``meta``: its view; ``nbytes``: the
    storage's) swapped: a new slot of the unit's group, copied out at the next stage boundary;
    what autograd keeps for it."""
    group = state.inline_groups.get(owner)
    if group is None:
        group = state.inline_groups[owner] = InlineGroup(owner)
    slots = group.device
    if group.copied == len(slots):  # its first storage since the last stage boundary
        state.inline_open.append(group)
    slots.append(storage)
    group.views.append(meta)
    group.live += 1
    stats = state.stats
    stats.swap_storages += 1
    stats.lean_swaps += 1
    stats.swap_bytes += nbytes
    return InlineHandle(state, group, len(slots) - 1)


def copy_out_saved(state: "_StepState") -> None:
    """At a stage boundary: copy out every storage saved since the last one (one backend call)."""
    groups, state.inline_open = state.inline_open, []
    storages: List[Any] = []
    for g in groups:
        c = g.copied
        storages += g.device[c:] if c else g.device
    if FREED in storages:  # (identity first: no storage equals FREED)
        storages = [None if st is FREED else st for st in storages]
    bufs = state.backend.copy_out(storages)
    i = 0
    for g in groups:
        device = g.device
        c, n = g.copied, len(device)
        g.host += bufs[i:i + n - c]
        i += n - c
        g.copied = n
        for s in range(c, n):
            if device[s] is not FREED:
                device[s] = None  # the model lets go of the bytes when it does


def copy_back_units(state: "_StepState", units: Iterable[int]) -> None:
    """At a prefetch stage: copy back the storages of ``units`` still needed (one backend call);
    those not copied out yet are still on the device."""
    todo = []
    bufs: List[torch.Tensor] = []
    views: List[ViewMeta] = []
    groups = state.inline_groups
    for u in units:
        g = groups.get(u)
        if g is None:
            continue
        device, host = g.device, g.host
        for s in range(g.copied):
            if device[s] is None:  # copied out, not freed
                todo.append((device, s, host))
                bufs.append(host[s])  # type: ignore[arg-type]
                views.append(g.views[s])
    if not bufs:
        return
    back = state.backend.copy_back(bufs, views, give_back=True)  # (the device copy is all the step needs)
    for (device, s, host), st in zip(todo, back):
        device[s] = st
        host[s] = None
    state.stats.prefetches += len(back)


class InlineHandle:
    """What autograd keeps for a saved tensor of an :class:`InlineGroup`."""

    __slots__ = ("state", "group", "slot")

    def __init__(self, state: "_StepState", group: InlineGroup, slot: int) -> None:
        self.state = state
        self.group = group
        self.slot = slot

    def unpack(self) -> torch.Tensor:
        state = self.state
        if state.dead:
            state.check_alive()
        g = self.group
        slot = self.slot
        d = g.device[slot]
        if d.__class__ is torch.Tensor:  # copied back
            return d
        if d is None or d is FREED:
            return g.fetch(slot, state)
        return g.views[slot].view_of(d, d.device)  # not copied out yet

    def __del__(self) -> None:
        try:
            state = self.state
            if not state.dead:  # autograd let go: the device bytes go now, the host buffers with the group's last slot
                g = self.group
                g.device[self.slot] = FREED
                g.live -= 1
                if g.live <= 0:
                    g.free(state)
        except Exception:  # pragma: no cover - never raise from __del__
            pass
