"""The plan executor: train under a plan of retain / swap / recompute, one action per unit.

``PlannedModule(model, plan, backend=...)`` is an ``nn.Module`` that shares ``model``'s parameters
and runs each training forward under the plan; the user's own loop, loss and optimizer are
unchanged, for any number of steps. In eval mode or with gradients disabled it simply runs the
model. docs/cost-model.md is the contract: the executor does what the cost model charges for.

The files, in the order a step meets them
-----------------------------------------
* ``learn.py``: the **learning step**, the executor's first step (and the first after the
  inputs' shapes change): a full step under the unit tracker (units.py), which cuts the forward
  into units, says which unit owns every tensor autograd saves, records the glue between units
  and every module call, and applies the plan's actions on the way (below). It leaves a table of
  what happened, per saved tensor in order.
* ``program.py``: the table made into what a **steady step** runs: the module calls it hooks and
  what happens at each, and an action per saved tensor.
* ``steady.py``: the steady step. A forward pre-hook on the modules that need one, installed
  once; the saved-tensor hooks on only in the spans that move or drop something; per saved tensor
  a table lookup and the action. No Python per torch op, no per-unit bookkeeping: an all-retain
  plan runs the plain model.
* ``segment_frame.py``: a checkpoint segment's replay from its module calls (below);
  ``recorded_replay.py``: the replay of what the tracker recorded (the learning step; tracked
  segments).
* ``step_state.py``: what one step owns (swap entries, handles, stage boundaries, abort);
  ``cpu_backend.py`` / ``cuda_backend.py``: the host tier and its copies.

The actions
-----------
* **retain**: autograd keeps the tensor, as without a plan.
* **swap**: the tensor's whole storage is copied to the host through the backend (once per
  storage, however many views or units save it), queued at the end of the segment that saved it;
  autograd keeps a small handle. The device bytes are freed when the copy has run and the forward
  no longer uses them. The copy back is issued at the start of the backward stage the plan's
  ``prefetch`` names; the unpack waits only if it is late (or issues it if no stage did). If the
  offload has not run when the tensor is needed, the still-alive device tensor is used.
  ``swap_deadlines`` are kept at stage boundaries (CPU: the host waits; CUDA: the compute stream).
* **recompute**: the tensor is dropped at pack time. Consecutive recomputed units form
  **checkpoint segments** (split before the plan's ``segment_starts``), replayed as
  ``torch.utils.checkpoint`` replays its region: once, as a whole, when the backward first needs
  one of their tensors, under saved-tensor hooks that hand each regenerated tensor to its handle;
  the generators' state (kept at the segment's start, only when its forward drew random numbers),
  autocast state and grad mode of the forward are restored, and the buffers the segment writes
  are put back bit for bit after it; the buffers it writes or reads that the forward writes into
  (an EMA, spectral_norm's vectors: all but normalization layers' running statistics) are kept
  as the segment first saw them and the replay starts from them (units.replay_start_state). A
  unit starts before its module's own forward pre-hooks, which are its work, as in its replay.
  What a segment reads from its own units is regenerated; what it reads from elsewhere is held
  from the forward (a private copy when the forward writes into it later) or brought back from
  the host when its owner swaps it; a tensor it saves of another segment's unit is saved again by
  its own replay from the held input. Each regenerated tensor is freed after its last backward
  reader.

  A steady step replays an **aligned** segment, one whose glue lies in module calls inside it
  (``units.UnitTracker.glue_scopes``), by calling those module calls again (its *top calls*: a
  block, or a chain of leaf modules) on the arguments the forward passed; a segment that is not
  aligned (glue of its units outside its module calls, such as an attention's functional ops when
  only a projection is recomputed) is **tracked**: a TorchFunctionMode records its glue in every
  step, and the replay runs the recording. The cost model charges each (docs/cost-model.md, "Host
  time"). Zero-length profiler ranges ``tensorplace::R<unit>`` / ``tensorplace::r<unit>``
  (``MARK_PREFIX``) mark replays when torch.profiler runs.

Checks and failures
-------------------
* Every hooked module call of a steady step is checked against the learned sequence, and every
  span's number of saved tensors where it ends: a mismatch raises :class:`PlanMismatchError`,
  aborts the step, removes the hooks; the next step learns again. New input shapes relearn (one
  full step, with a warning the first time). An aligned replay runs the module's Python again,
  as torch's checkpoint does, and its saved tensors are matched by order and checked by count.
* A dropped tensor that the forward's own code still references stays on the device until the
  forward lets go of it (``StepStats.dropped_alive`` in the learning step; the profiler makes
  ``lingering_bytes`` of it).
* Verify mode (``verify=True`` or ``TENSORPLACE_VERIFY=1``) checksums every swapped or dropped
  tensor at pack time and checks it at unpack (verify.py).
* An exception (or KeyboardInterrupt) in the forward, or in one of the executor's backward hooks,
  aborts the step: all hooks are gone, every host buffer is released, the next step starts clean.
  A backward that fails elsewhere (PyTorch then keeps the rest of the graph alive) is aborted by
  the next forward of any executor on the same model, or by ``close()``, which also aborts a
  step whose backward never ran (that graph's backward then raises ``StepAbortedError``).
"""


from __future__ import annotations

import operator
import os
import warnings
import weakref
from collections import defaultdict
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from .compile_guard import refuse_compile
from .errors import PlanMismatchError, ReplayError, StepAbortedError, StepStats
from .learn import SWAP, _PlanTracker, _Table
from .plan_io import (ACTIONS, PLAN_VERSION, PlanLike, _action_name, plan_mapping, read_plan, read_segment_starts,
                      read_in_flight_swaps, read_state_swaps, read_swap_deadlines, read_unstarted_swaps,
                      run_starts)
from .recorded_replay import _InputSlot
from .state_swap import StateSwapper
from .program import Program, build_program
from .steady import _SteadyStep, _remove_hooks
from .step_state import _EXECUTORS, MARK_PREFIX, _StepState, default_backend, replay_state_bytes
from .units import UnitSpec, discover_units, is_replaying
from .verify import verify_from_env

__all__ = [
    "ACTIONS",
    "PLAN_VERSION",
    "PlanMismatchError",
    "StepAbortedError",
    "ReplayError",
    "StepStats",
    "read_plan",
    "read_swap_deadlines",
    "read_segment_starts",
    "read_state_swaps",
    "read_unstarted_swaps",
    "read_in_flight_swaps",
    "run_starts",
    "Executor",
    "PlannedModule",
    "ExecutorModule",
    "execute",
    "default_backend",
    "replay_state_bytes",
    "MARK_PREFIX",
]


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
        segment_starts: Iterable[int] = (),
        state_swaps: Optional[Mapping[str, Any]] = None,
        optimizer: Any = None,
        profile_units: Optional[Sequence[Mapping[str, Any]]] = None,
        unstarted_swaps: Iterable[int] = (),
        in_flight_swaps: Iterable[int] = (),
    ) -> None:
        self.model = model
        #: swapped units whose swap-out the cost model cancels before it starts: kept on the device
        self.unstarted_swaps: FrozenSet[int] = frozenset(int(u) for u in unstarted_swaps)
        #: swapped units whose swap-out the cost model cancels while it runs: copied out, and
        #: their device bytes kept for the backward
        self.in_flight_swaps: FrozenSet[int] = frozenset(int(u) for u in in_flight_swaps)
        #: stage label ("fwd:i" / "bwd:i") -> units whose swap-out must be complete before it
        self.swap_deadlines: Dict[str, List[int]] = defaultdict(list)
        for stage_label, unit in swap_deadlines:
            self.swap_deadlines[str(stage_label)].append(int(unit))
        self.swap_deadlines = dict(self.swap_deadlines)
        #: "fwd" / "bwd" -> the stages of that kind with a swap deadline (a steady step's boundary
        #: asks without making the label)
        self.deadline_stages: Dict[str, FrozenSet[int]] = {
            kind: frozenset(int(label[4:]) for label in self.swap_deadlines if label.startswith(kind + ":"))
            for kind in ("fwd", "bwd")}
        self.actions = [_action_name(a) for a in actions]
        #: per unit, the first unit of the run of consecutive recomputed units containing it
        self.run_start = run_starts(self.actions, segment_starts)
        self.names = list(names) if names is not None else None
        #: backward stage -> units whose copy back it issues (the plan's prefetch schedule)
        self.prefetch_at: Dict[int, List[int]] = defaultdict(list)
        for unit, stage in prefetch:
            self.prefetch_at[int(stage)].append(int(unit))
        # a backward stage with a swap deadline runs its boundary even when it prefetches nothing
        # (the boundary is where the deadline is kept; its stage hook is the prefetch hook)
        for label in self.swap_deadlines:
            if label.startswith("bwd:"):
                self.prefetch_at[int(label[4:])]  # noqa: B018 - defaultdict: an empty entry
        self.unit_modules = discover_units(model, units)
        #: parameters and optimizer state kept on the host between optimizer steps (state_swap.py)
        self.swapper: Optional[StateSwapper] = None
        if state_swaps:
            if self.names is None:
                raise PlanMismatchError("a plan with state_swaps must name its units (its \"units\" list)")
            self.swapper = StateSwapper(model, optimizer, state_swaps, self.names, self.unit_modules,
                                        lambda: self.backend, expected=profile_units)
            for stage in self.swapper.backward_stages():
                self.prefetch_at[stage]  # noqa: B018 - a stage hook where the swapper prefetches
        self.prefetch_at = dict(self.prefetch_at)
        self.verify = verify_from_env() if verify is None else bool(verify)
        self._own_backend = backend is None
        self._backend = backend
        self.last_stats: Optional[StepStats] = None
        self._states: "weakref.WeakSet[_StepState]" = weakref.WeakSet()
        _EXECUTORS.setdefault(model, weakref.WeakSet()).add(self)
        #: after its first step, the executor runs the lean path (False: every step is a full step)
        self.lean = True
        self._table: Optional[_Table] = None
        #: what the steady steps run (program.py), and the inputs' shapes it was learned on
        self._program: Optional[Program] = None
        self._signature: Any = None
        #: the programs learned for other input shapes (the most recent MAX_PROGRAMS)
        self._programs: Dict[Any, Program] = {}
        #: replay checkpoint segments from their module calls where they allow it (False: every
        #: recomputed segment is tracked and replays what it recorded)
        self.aligned = os.environ.get("TENSORPLACE_ALIGNED", "1") != "0"
        self.relearned = 0  #: learning steps after the first (the inputs' shapes changed)
        self._shapes_warned = False
        self._model_params = list(model.parameters())  #: whose requires_grad a learned step depends on
        self._cell: List[Optional[_SteadyStep]] = [None]  # the running step, read by the hooks
        self._hooks: List[Any] = []
        self._hooks_finalizer: Optional[weakref.finalize] = None
        #: the hooks were taken off between steps (suspend_hooks); the next step puts them back
        self._suspended = False
        #: the leaf every replay attaches its held inputs to (_Attach), made once
        self._replay_anchor = torch.zeros((), requires_grad=True)

    @property
    def backend(self) -> Any:
        if self._backend is None:
            p = next(self.model.parameters(), None)
            self._backend = default_backend(p.device if p is not None else torch.device("cpu"))
        return self._backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One forward under the plan; the backward of its result follows the plan too."""
        if "swap" in self.actions or self.swapper is not None:
            _ = self.backend
        self.abort_interrupted()
        if self.swapper is None:
            return self._forward(args, kwargs)
        self.swapper.start_step()
        self.swapper.in_planned_forward = True
        try:
            return self._forward(args, kwargs)
        except BaseException:
            self.swapper.unsettle()
            raise
        finally:
            self.swapper.in_planned_forward = False

    def _forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        program = self._program
        if self._suspended:
            self.resume_hooks()
        if program is not None:
            signature = self._step_signature(args, kwargs) if self.lean else None
            if signature == self._signature:
                return self._steady_forward(program, args, kwargs)
            known = self._programs.get(signature)
            self._remove_hooks()
            if known is not None:  # shapes learned before (bucketed lengths): its program again
                self._use(known, signature)
                return self._steady_forward(known, args, kwargs)
            self._note_relearn(signature)
            self._program = self._table = self._signature = None
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
            n = len(tracker.segments)
            if n != len(self.actions):
                raise PlanMismatchError(f"the model ran {n} units but the plan has {len(self.actions)}")
            tracker.end_run_before(n)
            state.forward_done(n)
            state.note_dropped_alive(n)
            state.note_alive_values(tracker.value_ids)
            program = None
            if learn is not None:  # before release_unneeded lets go of the slots
                learn.names = list(state.names)
                # what each recomputed unit keeps at its start for its replay in the steady steps
                learn.writes = {rt.unit: [b for b, _ in rt.before] for rt in state.runtimes.values() if rt.before}
                for rt in state.runtimes.values():
                    learn.protect[rt.unit] = {i for i, ref in enumerate(rt.seg.inputs)
                                              if isinstance(ref.slot, _InputSlot) and ref.slot.protected}
                program = self._build_program(learn, tracker)
                self._reserve_host_buffers(state)
            state.release_unneeded()
        except BaseException:
            state.abort()
            raise
        if program is not None:
            signature = self._step_signature(args, kwargs)
            self._programs[signature] = program
            while len(self._programs) > MAX_PROGRAMS:  # the least recently learned goes
                self._programs.pop(next(iter(self._programs)))
            self._use(program, signature)
        return out

    def _use(self, program: Program, signature: Any) -> None:
        """Run ``program`` from the next step on, for inputs of ``signature``."""
        self._program = program
        self._table = program.table
        self._signature = signature
        self._install(program)

    # ------------------------------------------------------------------ the steady steps

    def _build_program(self, learn: _Table, tracker: _PlanTracker) -> Program:
        """After the learning step: what the steady steps run (program.py)."""
        st_runtimes = tracker.state.runtimes
        slots: Dict[Tuple[int, int], Any] = {}
        for rt in st_runtimes.values():
            run = self.run_start[rt.unit]
            for ref in rt.seg.inputs:
                slots.setdefault((run, id(ref.value)), ref.slot)
        n = len(learn.pack_start)
        fwd_deadline = self.deadline_stages["fwd"]
        first_swap = n
        for k, a in enumerate(learn.acts):
            if a == SWAP:
                first_swap = max(u for u in range(n) if learn.pack_start[u] <= k)
                break
        swapper_stages = self.swapper.forward_stages() if self.swapper is not None else set()
        work = [u in fwd_deadline or u in self.prefetch_at or (u - 1) in self.prefetch_at or u > first_swap
                or u in swapper_stages for u in range(n)]
        post_units = {u for u in range(n) if u in self.prefetch_at}
        #: what the steady steps' tracker counts as parameters (their storages, read per step)
        self._params = [t for t in list(self.model.parameters()) + list(self.model.buffers())
                        if t.layout == torch.strided and t.device.type != "meta"]
        return build_program(learn, tracker, self.actions, self.run_start, slots, work, post_units,
                             aligned=self.aligned)

    def _reserve_host_buffers(self, state: _StepState) -> None:
        """After the learning step: the backend makes the host buffers of the plan's swap set (its
        swapped storages' sizes, all live at once) now, so that steady steps allocate none (pinned
        memory on CUDA: cudaHostAlloc blocks the host for milliseconds)."""
        reserve = getattr(self._backend, "reserve", None)
        sizes = [e.nbytes for entries in state.by_unit.values() for e in entries]
        if reserve is not None and sizes:
            reserve(sizes)

    def _step_signature(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """What a learned step depends on: the inputs (:func:`_signature`) and which parameters
        require grad (a layer frozen or unfrozen mid-training saves other tensors)."""
        return _signature(args, kwargs) + (tuple(map(_REQUIRES_GRAD, self._model_params)),)

    def _note_relearn(self, signature: Any) -> None:
        """The inputs' shapes, or the parameters that require grad, changed to ones not learned
        yet: this step learns them (a full step, slower), once per new signature (the last
        ``MAX_PROGRAMS`` are kept)."""
        self.relearned += 1
        if self._signature is not None and signature[:-1] == self._signature[:-1]:
            warnings.warn(
                "the model's parameters that require grad changed since the executor's learning step "
                "(a layer frozen or unfrozen): the executor learns the new step once (one full, slower step); "
                "the plan's predicted peak is for the parameters its profile trained: plan again if more train now",
                RuntimeWarning, stacklevel=4)
            return
        if not self._shapes_warned:
            self._shapes_warned = True
            warnings.warn(
                "the model's inputs changed shape (or kind) since the executor's learning step: the "
                "executor learns the new step once (one full, slower step per new input shape); "
                "bucket the shapes (e.g. pad to a few lengths) if they change often",
                RuntimeWarning, stacklevel=4)

    def _install(self, program: Program) -> None:
        if self._hooks:
            return
        cell = self._cell

        def pre_hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            step = cell[0]
            if step is not None and not is_replaying():
                step.call_start(module, args, kwargs)

        def post_hook(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            step = cell[0]
            if step is not None and not is_replaying():
                step.call_end(module, output)

        for module in program.pre_modules:  # before the module's own pre-hooks, as the learning step
            self._hooks.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
        for module in program.post_modules:
            self._hooks.append(module.register_forward_hook(post_hook))
        # the hooks hold no reference to the executor; if it is dropped without close(), they go
        self._hooks_finalizer = weakref.finalize(self, _remove_hooks, self._hooks)

    def _uninstall(self) -> None:
        """Forget every learned step and remove the hooks (a failed step, ``close()``)."""
        self._table = None
        self._program = None
        self._signature = None
        self._programs.clear()
        self._remove_hooks()

    def suspend_hooks(self) -> None:
        """Take this executor's module hooks off the model until its next step puts them back, so
        that steps of the same model that are not this executor's (a plain step timed beside it,
        another executor's step) do not call them: every hooked module call costs a Python call
        even when the executor is idle (an idle all-swap executor made the plain step of a
        193-unit tiny-kernel stack 6% slower on a CPU). Call it between steps."""
        if self._hooks:
            self._remove_hooks()
            self._suspended = True

    def resume_hooks(self) -> None:
        """Put back the hooks :meth:`suspend_hooks` took off (the next step does it otherwise)."""
        if self._suspended:
            self._suspended = False
            if self._program is not None:
                self._install(self._program)

    def _remove_hooks(self) -> None:
        self._cell[0] = None
        if self._hooks_finalizer is not None:
            self._hooks_finalizer.detach()
            self._hooks_finalizer = None
        _remove_hooks(self._hooks)

    def _steady_forward(self, program: Program, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        state = _StepState(self)
        state.names = program.table.names
        self.last_stats = state.stats
        step = _SteadyStep(self, state, program)
        self._states.add(state)
        self._cell[0] = step
        try:
            out = self.model(*args, **kwargs)
            self._cell[0] = None
            step.finish(out)
        except BaseException:
            self._cell[0] = None
            step.unwind()
            # a failed step leaves nothing behind; the next one starts with a full step
            state.abort()
            self._uninstall()
            raise
        finally:
            step.hooks = None  # it holds step.pack: a cycle that would outlive the step
        return out

    def abort_interrupted(self) -> int:
        """Abort the steps whose backward started but never finished (an exception or
        KeyboardInterrupt raised in backward outside the executor's own hooks: PyTorch then keeps
        the rest of the graph, and with it the executor's handles, alive), of this executor and
        of every other executor on the same model (an earlier ``run()``). Runs at every forward;
        returns how many steps it aborted."""
        if torch._C._current_graph_task_id() != -1:
            return 0  # called from inside a backward: that backward is running, not interrupted
        n = 0
        for ex in list(_EXECUTORS.get(self.model, ())):
            for st in list(ex._states):
                if st.backward_running and not st.dead:
                    st.abort()
                    n += 1
        return n

    def close(self) -> None:
        """Abort this executor's unfinished steps (a forward whose backward has not run to its
        end: its host buffers and held tensors are released, and a later backward of its graph
        raises :class:`StepAbortedError`), remove the executor's hooks from the model, and close
        the backend if this executor created it."""
        if torch._C._current_graph_task_id() == -1:
            for st in list(self._states):
                if not st.dead and not st.finished:
                    st.abort()
        self._uninstall()
        if self.swapper is not None:
            self.swapper.close()  # everything back on the device, the optimizer's step as it was
        if self._own_backend and self._backend is not None:
            self._backend.close()
            self._backend = None


#: learned steps kept per executor, one per input signature (a few bucketed lengths)
MAX_PROGRAMS = 8
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def hooks_of_one(executors: Iterable[Optional[Executor]], keep: Optional[Executor]) -> None:
    """Between steps of executors that share a model (and plain steps of it, ``keep`` None): only
    ``keep``'s module hooks on the model, the others' off (:meth:`Executor.suspend_hooks`)."""
    for ex in executors:
        if ex is not None and ex is not keep:
            ex.suspend_hooks()
    if keep is not None:
        keep.resume_hooks()


def _signature(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """What a learned step depends on in the inputs: each tensor's shape, dtype, device and
    whether it requires grad, and the other values' types (one pass over the arguments)."""
    return tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else type(x)
                 for x in pytree.tree_leaves((args, kwargs)))


class ExecutorModule(nn.Module):
    """An ``nn.Module`` that runs ``model``'s training forwards through ``self.executor`` (set
    by the subclass) and runs the model itself in eval mode or with gradients disabled."""

    model: nn.Module
    executor: Executor

    @property
    def backend(self) -> Any:
        return self.executor.backend

    @property
    def last_stats(self) -> Optional[StepStats]:
        """What the latest step did (its backward fills in the rest)."""
        return self.executor.last_stats

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_compile(f"{type(self).__name__} (tensorplace.run())")
        if not self.model.training or not torch.is_grad_enabled():
            if self.executor.swapper is not None:
                self.executor.swapper.materialize()  # parameters kept on the host come back first
            return self.model(*args, **kwargs)
        return self.executor.forward(*args, **kwargs)

    def abort_interrupted(self) -> int:
        """Free what steps interrupted during their backward still hold (see Executor)."""
        return self.executor.abort_interrupted()

    def close(self) -> None:
        self.executor.close()


class PlannedModule(ExecutorModule):
    """``model`` trained under ``plan``: same parameters, same results, less device memory.

    ``plan``: a Plan-format dict or object, a path to a plan JSON file, or a list of actions (one
    per unit). ``backend``: the host tier (default: CpuBackend on CPU, CudaBackend on CUDA).
    ``units``: the coarse unit choice the plan was made with (see units.discover_units).
    ``verify``: checksum every moved or dropped tensor (default: ``TENSORPLACE_VERIFY``).

    After the first training step one forward pre-hook stays on every unit module (a no-op
    outside this module's steps; a forward hook too on the units of prefetch stages and
    recomputed units); :meth:`close` removes them, and so does a failed step or dropping this
    module.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PlanLike,
        backend: Any = None,
        *,
        units: Optional[Iterable[UnitSpec]] = None,
        verify: Optional[bool] = None,
        optimizer: Any = None,
    ) -> None:
        super().__init__()
        self.model = model
        actions, prefetch, names = read_plan(plan)
        data = plan_mapping(plan)
        profile_units = (data.get("profile") or {}).get("units") if data is not None else None
        self.executor = Executor(
            model, actions, prefetch, backend, verify=verify, units=units, names=names,
            swap_deadlines=read_swap_deadlines(plan), segment_starts=read_segment_starts(plan),
            state_swaps=read_state_swaps(plan), optimizer=optimizer, profile_units=profile_units,
            unstarted_swaps=read_unstarted_swaps(plan), in_flight_swaps=read_in_flight_swaps(plan),
        )


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
