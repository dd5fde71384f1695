"""The lean swap path of a steady step: a swapped unit's small storages, copied out and back by
the backend on the host's thread, a stage's at once.

The general path (step_state._Entry) makes, per swapped storage, an entry, a backend handle and
a call to the backend at each of its four moves (out, deadline, back, release). Storages of at
most the backend's ``inline_bytes``, whose copies complete inside the call (the CPU backend's
``copy_out``/``copy_back``/``give_back``), need none of that: the :class:`InlineHandle` that
autograd keeps for the saved tensor is the swap itself. It holds the storage until the stage
boundary after its pack copies out every storage saved since the last one in one call
(:func:`copy_out_saved`), then the host buffer until its unit's prefetch stage copies that
stage's storages back in one call and gives their buffers back (:func:`copy_back_units`), then
the saved tensor, which goes when autograd lets go of the handle. Device memory moves as on the
general path: a storage's bytes leave at the stage boundary after it was saved, come back at its
unit's prefetch stage, and each storage's copy is freed when autograd lets go of its saved
tensor. The step reaches its handles through weak references (by unit, and those not copied out
yet), so a handle autograd lets go of early takes its bytes and buffer with it. A handle may also
start a backward stage (``starts``): where every tensor a unit saves is swapped (here or on the
general path, whose handles carry the stage too) or retained as it is, and no glue follows its
module call, its stage starts at the first unpack of its swaps, when its backward first needs
one, instead of from a gradient hook registered in the forward (steady._unpack_starts). The CPU backend keeps
a whole contiguous tensor's host copy in its shape and copies it back with one ``clone()``.

Packs that something else may look up (a storage version saved again later, a checkpoint
segment's argument, a tracked segment's value), units whose swap-out the plan cancels, and
verify mode take the general path (steady.py decides, per pack).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable, List, Optional

import torch

from .units import ViewMeta

if TYPE_CHECKING:
    from .step_state import _StepState


class InlineHandle:
    """What autograd keeps for a saved tensor on the lean path: its storage (the device bytes)
    until the stage boundary copies it out, then its host buffer until its unit's prefetch stage
    copies it back, then the saved tensor."""

    __slots__ = ("state", "unit", "storage", "buf", "t", "meta", "starts", "__weakref__")

    def __init__(self, state: "_StepState", unit: int, storage: torch.UntypedStorage, meta: ViewMeta,
                 starts: int) -> None:
        self.state = state
        self.unit = unit
        self.storage: Optional[torch.UntypedStorage] = storage
        self.buf: Optional[torch.Tensor] = None
        self.t: Optional[torch.Tensor] = None
        self.meta = meta
        self.starts = starts  #: the backward stage its first unpack starts, or -1 (steady._unpack_starts)

    def unpack(self) -> torch.Tensor:
        """The saved tensor (the unpack hook returns ``t`` itself once copied back and its stage
        started)."""
        state = self.state
        if state.dead:
            state.check_alive()
        s = self.starts
        if s >= 0 and s not in state.fired:
            state.issue_prefetches(s)  # the stage starts here: its copies back, this one's among them
        t = self.t
        if t is not None:
            return t
        st = self.storage
        if st is not None:  # not copied out yet
            return self.meta.view_of(st, st.device)
        buf = self.buf
        if buf is None:
            raise RuntimeError(f"a swapped tensor of unit {self.unit} was needed after it was freed")
        # the plan did not prefetch it: copied back now
        state.stats.unscheduled_fetches += 1
        t = self.t = state.backend.copy_back([buf], [self.meta], give_back=True)[0]
        self.buf = None
        return t

    def release(self) -> None:
        """Let go of the device bytes and give the host buffer back (a failed step, a handle
    autograd let go of before its copy back)."""
        self.storage = None
        self.t = None
        buf, self.buf = self.buf, None
        if buf is not None:
            self.state.backend.give_back([buf])

    def __del__(self) -> None:
        if self.buf is not None:  # autograd let go before its copy back: the host buffer goes back
            try:
                self.release()
            except Exception:  # pragma: no cover - never raise from __del__
                pass


def swap_saved(state: "_StepState", owner: int, storage: torch.UntypedStorage, meta: ViewMeta,
               nbytes: int, starts: int = -1) -> InlineHandle:
    """A saved tensor of unit ``owner`` over ``storage`` (``meta``: its view; ``nbytes``: the
    storage's) swapped: copied out at the next stage boundary; what autograd keeps for it
    (``starts``: the backward stage its first unpack starts, or -1)."""
    h = InlineHandle(state, owner, storage, meta, starts)
    ref = weakref.ref(h)
    state.inline_open.append(ref)
    refs = state.inline_units.get(owner)
    if refs is None:
        state.inline_units[owner] = [ref]
    else:
        refs.append(ref)
    stats = state.stats
    stats.swap_storages += 1
    stats.lean_swaps += 1
    stats.swap_bytes += nbytes
    return h


def copy_out_saved(state: "_StepState") -> None:
    """At a stage boundary: copy out every storage saved since the last one (one backend call)."""
    refs, state.inline_open = state.inline_open, []
    handles: List[InlineHandle] = []
    storages: List[torch.UntypedStorage] = []
    metas: List[ViewMeta] = []
    for r in refs:
        h = r()
        if h is not None:  # (else autograd let go of it: its bytes went with it)
            handles.append(h)
            storages.append(h.storage)  # type: ignore[arg-type]
            metas.append(h.meta)
    if not handles:
        return
    bufs = state.backend.copy_out(storages, metas)
    for h, b in zip(handles, bufs):
        h.buf = b
        h.storage = None  # the model lets go of the bytes when it does


def copy_back_units(state: "_StepState", units: Iterable[int]) -> None:
    """At a prefetch stage: copy back the storages of ``units`` still needed and give their host
    buffers back (one backend call); those not copied out yet are still on the device."""
    handles: List[InlineHandle] = []
    bufs: List[torch.Tensor] = []
    metas: List[ViewMeta] = []
    inline_units = state.inline_units
    for u in units:
        refs = inline_units.get(u)
        if refs:
            for r in refs:
                h = r()
                if h is not None:
                    b = h.buf
                    if b is not None:
                        handles.append(h)
                        bufs.append(b)
                        metas.append(h.meta)
    if not handles:
        return
    back = state.backend.copy_back(bufs, metas, give_back=True)
    for h, t in zip(handles, back):
        h.t = t
        h.buf = None
    state.stats.prefetches += len(back)


def release_all(state: "_StepState") -> None:
    """A failed step: every lean swap lets go of its device bytes and host buffer."""
    for refs in state.inline_units.values():
        for r in refs:
            h = r()
            if h is not None:
                h.release()
    state.inline_units.clear()
    state.inline_open = []
