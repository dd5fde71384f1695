"""Parameters and optimizer state kept in the host tier between optimizer steps (TENSILE's
swapping across iterations; docs/cost-model.md, "Optimizer step").

A plan's ``state_swaps`` names the units whose parameters and whose optimizer state leave the
device after the unit's part of the optimizer step and come back before their next use: the
parameters before the unit's next forward, the optimizer state before its next optimizer step.
:class:`StateSwapper` does that for one model and one optimizer, through the executor's backend
(the same copy queue as the activations' swaps):

* **Optimizer step.** ``tp.run(model, plan, optimizer=opt)`` replaces ``opt.step`` (on this
  instance; ``close()`` puts it back) by the planned step: the optimizer's own update, run in
  chunks, one per unit (the last unit first, as the cost model's optimizer stages), then one for
  the parameters of no unit. A chunk waits for its unit's optimizer state if it is on its way
  back, runs the optimizer on the chunk's parameters alone (the others' gradients are set aside
  for the call, so the optimizer skips them: per-parameter optimizers such as SGD, Adam, AdamW,
  RMSprop and Adagrad then compute exactly what one call computes, bit for bit), and queues the
  copies of what the plan keeps on the host. The step returns when those copies have completed
  (the model's end-of-step wait). Step pre- and post-hooks run once per step, as without a plan.
  A closure (LBFGS) is refused.
* **Forward and backward.** At the start of every forward stage the plan's parameter prefetches
  for that stage are issued and the unit's own parameters are waited for and put back into their
  ``nn.Parameter`` objects (``param.data``: the same objects the optimizer and the user hold); at
  the start of the backward stages the plan names, the optimizer state's prefetches are issued.
* **Between steps** a swapped parameter's ``data`` and a swapped state tensor are placeholders of
  the right shape and dtype that hold no memory: one NaN, expanded (an in-place update of one
  fails loudly, a computation with one gives NaN). ``model.state_dict()``, ``opt.state_dict()``
  and their ``load_state_dict``, a forward of the model itself (not through the planned module),
  and one of the planned module in eval mode or without gradients, first bring everything back
  (:meth:`StateSwapper.materialize`); the next training forward sends it back to the host before
  it starts (synchronously), so the plan's memory holds again; so does one after a failed step.
  ``close()`` brings everything back for good.

What moves is whole storages: a storage shared by the parameters of several units, or with
anything outside them, is never moved (the profiler counts only the others in ``param_bytes``).
If a step fails, nothing is lost: every parameter and state tensor is either on the device or in
a host buffer the swapper keeps until it is brought back.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch import nn

from .units import ViewMeta

__all__ = ["StateSwapper", "StateSwapError", "unit_parameters", "exclusive_storages", "state_tensors",
           "optimizer_chunks"]


class StateSwapError(RuntimeError):
    """A plan's swaps across iterations cannot be run as asked (say why and what to do)."""


# ------------------------------------------------------------------------------------------
# Which parameters and state tensors belong to which unit (shared with the profiler)
# ------------------------------------------------------------------------------------------


def unit_parameters(names: Sequence[str], unit_modules: Mapping[nn.Module, str],
                    params: Iterable[nn.Parameter]) -> Tuple[List[List[nn.Parameter]], List[nn.Parameter]]:
    """Per unit (``names`` as a profile and a plan list them: a unit module's qualified name,
    ``name#k`` for its k-th further call), the parameters among ``params`` that it is the first
    unit to use: its module's parameters (recursively, for a coarse unit); a parameter of several
    units belongs to the one with the smallest index. Returns ``(per_unit, rest)``, ``rest`` being
    the parameters of no unit (used in glue code), in ``params`` order."""
    wanted: Dict[int, nn.Parameter] = {}
    for p in params:
        wanted.setdefault(id(p), p)
    by_name = {name: m for m, name in unit_modules.items()}
    claimed: Set[int] = set()
    per_unit: List[List[nn.Parameter]] = []
    for name in names:
        module = by_name.get(name.split("#", 1)[0])
        mine: List[nn.Parameter] = []
        if module is not None:
            for p in module.parameters():
                if id(p) in wanted and id(p) not in claimed:
                    claimed.add(id(p))
                    mine.append(p)
        per_unit.append(mine)
    rest = [p for i, p in wanted.items() if i not in claimed]
    return per_unit, rest


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def exclusive_storages(per_unit: Sequence[Sequence[torch.Tensor]],
                       others: Iterable[torch.Tensor] = ()) -> List[List[Tuple[torch.UntypedStorage, List[torch.Tensor]]]]:
    """Per unit, the storages of its tensors that no other unit's tensor and none of ``others``
    uses, each with the unit's tensors on it: what can move without leaving a copy behind."""
    users: Dict[int, Set[int]] = defaultdict(set)
    for u, ts in enumerate(per_unit):
        for t in ts:
            users[_storage_key(t)].add(u)
    for t in others:
        users[_storage_key(t)].add(-1)
    out: List[List[Tuple[torch.UntypedStorage, List[torch.Tensor]]]] = []
    for u, ts in enumerate(per_unit):
        groups: Dict[int, Tuple[torch.UntypedStorage, List[torch.Tensor]]] = {}
        for t in ts:
            key = _storage_key(t)
            if users[key] == {u}:
                groups.setdefault(key, (t.untyped_storage(), []))[1].append(t)
        out.append(list(groups.values()))
    return out


def state_tensors(optimizer: Any, params: Iterable[nn.Parameter]) -> List[Tuple[nn.Parameter, str, torch.Tensor]]:
    """The optimizer state of ``params`` that can move: every state tensor with at least one
    dimension (a step counter, a 0-dim tensor, stays), as (parameter, key, tensor)."""
    out = []
    for p in params:
        state = optimizer.state.get(p) if optimizer is not None else None
        for key, v in (state or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.layout == torch.strided:
                out.append((p, key, v))
    return out


def optimizer_chunks(per_unit: Sequence[Sequence[nn.Parameter]], rest: Sequence[nn.Parameter]) -> List[Tuple[int, List[nn.Parameter]]]:
    """The chunks of the planned optimizer step, in the cost model's order: ``(unit, params)`` for
    every unit with parameters, the last unit first, then ``(len(per_unit), rest)``."""
    n = len(per_unit)
    chunks = [(u, list(per_unit[u])) for u in range(n - 1, -1, -1) if per_unit[u]]
    chunks.append((n, list(rest)))
    return chunks


# ------------------------------------------------------------------------------------------
# The swapper
# ------------------------------------------------------------------------------------------


class _Moved:
    """One storage in the host tier: its host handle and the tensors to rebuild on it."""

    __slots__ = ("handle", "device", "views", "prefetched")

    def __init__(self, handle: Any, device: torch.device, views: List[Tuple[Callable[[torch.Tensor], None], ViewMeta]]):
        self.handle = handle
        self.device = device
        self.views = views  #: (install(tensor), its view metadata) per tensor on the storage
        self.prefetched = False


_PARAMS, _STATE = "parameters", "optimizer_state"


class StateSwapper:
    """Moves the parameters and optimizer state a plan names between the device and the host
    tier of ``backend()`` (see the module docstring). ``spec`` is the plan's ``state_swaps``;
    ``names`` the plan's unit names; ``unit_modules`` the executor's unit modules; ``expected``
    (optional) the profile's ``param_bytes`` / ``optimizer_state_bytes`` per unit, checked."""

    def __init__(self, model: nn.Module, optimizer: Any, spec: Mapping[str, Any], names: Sequence[str],
                 unit_modules: Mapping[nn.Module, str], backend: Callable[[], Any],
                 expected: Optional[Sequence[Mapping[str, Any]]] = None) -> None:
        if optimizer is None or not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "state"):
            raise StateSwapError(
                "this plan keeps parameters or optimizer state on the host between optimizer steps "
                "(its state_swaps): pass the optimizer that trains the model, tensorplace.run(model, plan, optimizer=opt)"
            )
        self.model = model
        self.optimizer = optimizer
        self._backend = backend
        self.n = len(names)
        self.params_swapped: List[int] = sorted(int(u) for u in spec.get("parameters", []) or [])
        self.states_swapped: List[int] = sorted(int(u) for u in spec.get("optimizer_state", []) or [])
        for u in self.params_swapped + self.states_swapped:
            if not 0 <= u < self.n:
                raise StateSwapError(f"state_swaps names unit {u}; the plan has units 0..{self.n - 1}")
        #: stage label -> [(what, unit)] prefetches issued at its start; (what, unit) swap-outs that
        #: must have left before it
        self.prefetch_at: Dict[str, List[Tuple[str, int]]] = defaultdict(list)
        for p in spec.get("prefetch", []) or []:
            self.prefetch_at[str(p["issue_at"])].append((str(p["what"]), int(p["unit"])))
        self.deadlines: Dict[str, List[Tuple[str, int]]] = defaultdict(list)
        for d in spec.get("deadlines", []) or []:
            self.deadlines[str(d["before"])].append((str(d["what"]), int(d["unit"])))
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.unit_params, rest = unit_parameters(names, unit_modules, opt_params)
        self.chunks = optimizer_chunks(self.unit_params, rest)
        others = [b for b in model.buffers()] + list(rest)
        #: per unit, the parameters whose storages can move (no other unit's or buffer's share
        #: them), and those storages' bytes; the storages themselves change with every move
        exclusive = exclusive_storages(self.unit_params, others)
        self.swap_params: List[List[nn.Parameter]] = [[p for _, ps in ex for p in ps] for ex in exclusive]  # type: ignore[misc]
        self.param_bytes: List[int] = [sum(st.nbytes() for st, _ in ex) for ex in exclusive]
        del exclusive
        for u in self.params_swapped:
            if not self.swap_params[u]:
                raise StateSwapError(
                    f"the plan swaps the parameters of unit {u} ({names[u]}), which has none the optimizer "
                    "updates alone (none, or all shared with other units): re-plan with this model and optimizer"
                )
        for u in self.states_swapped:
            if not self.unit_params[u]:
                raise StateSwapError(
                    f"the plan swaps the optimizer state of unit {u} ({names[u]}), whose parameters the optimizer "
                    "does not update: re-plan with tensorplace.plan(..., optimizer=opt) for this optimizer"
                )
        if expected is not None:
            for u in self.params_swapped:
                want = int(expected[u].get("param_bytes", 0) or 0)
                have = self.param_bytes[u]
                if want != have:
                    raise StateSwapError(
                        f"unit {u} ({names[u]}) has {have} bytes of parameters to swap here but {want} in the "
                        "plan's profile: the model or the optimizer's parameters differ; re-plan"
                    )
        self._host: Dict[Tuple[str, int], List[_Moved]] = {}
        self._fresh: Dict[Tuple[str, int], List[_Moved]] = {}  #: swap-outs of the running optimizer step
        #: data pointers of swapped parameters brought back (the executor's trackers count them
        #: as parameters, like those resident when a forward starts)
        self.resident_ptrs: Set[int] = set()
        self._placeholders: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._settled = False  #: the plan's between-steps state holds (nothing materialised since)
        self._stepping = False
        #: the executor's forward runs (a forward of the model outside it brings everything back)
        self.in_planned_forward = False
        self._closed = False
        self._hooks: List[Any] = []
        self._previous_step = optimizer.__dict__.get("step")  # an instance attribute (a scheduler's wrapper)
        self._lr_wrapped = hasattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched")
        optimizer.step = types.MethodType(_planned_step(self), optimizer)
        self._install_hooks()

    # -------------------------------------------------------------- the executor's calls

    def forward_stages(self) -> Set[int]:
        """Forward stages at whose start the swapper has work."""
        out = {int(k[4:]) for k in self.prefetch_at if k.startswith("fwd:")}
        return out | set(self.params_swapped)

    def backward_stages(self) -> Set[int]:
        """Backward stages at whose start the swapper issues prefetches."""
        return {int(k[4:]) for k in self.prefetch_at if k.startswith("bwd:")}

    def start_step(self) -> None:
        """A training forward starts: what the plan keeps on the host between steps is sent
        there first (waiting for the copies) unless it already is."""
        self._check_open()
        if self._settled:
            return
        moved = []
        for u in self.params_swapped:
            moved += self._offload(_PARAMS, u)
        for u in self.states_swapped:
            moved += self._offload(_STATE, u)
        self._wait(moved)
        self._settled = True

    def at_stage(self, label: str) -> None:
        """At the start of stage ``label``: issue its prefetches; at a forward stage, put the
        unit's parameters back (waiting for their copy if it is late)."""
        for what, u in self.prefetch_at.get(label, ()):
            self._prefetch(what, u)
        if label.startswith("fwd:"):
            u = int(label[4:])
            if (_PARAMS, u) in self._host:
                self._fetch(_PARAMS, u)

    def unsettle(self) -> None:
        """A step failed: the next training forward sends everything back to the host first."""
        self._settled = False

    def materialize(self) -> None:
        """Bring every parameter and state tensor back to the device (synchronously); the next
        training forward sends them back to the host."""
        if self._stepping:
            return
        keys = list(self._host)
        for key in keys:
            self._prefetch(*key)
        for key in keys:
            self._fetch(*key)
        self._settled = False

    def close(self) -> None:
        """Bring everything back, put ``optimizer.step`` back and remove the hooks."""
        if self._closed:
            return
        self.materialize()
        self._closed = True
        if self._previous_step is not None:
            self.optimizer.step = self._previous_step
        else:
            self.optimizer.__dict__.pop("step", None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -------------------------------------------------------------- the optimizer step

    def step(self, raw: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        self._check_open()
        closure = args[0] if args else kwargs.get("closure")
        if closure is not None:
            raise StateSwapError(
                "a closure (re-evaluating the loss inside step, as LBFGS does) cannot run under a plan that swaps "
                "optimizer state across iterations: the step runs the optimizer unit by unit"
            )
        backend = self._backend()
        opt = self.optimizer
        with_grad = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        out = None
        self._stepping = True
        self._settled = False  # until the step has run to its end
        self._fresh = {}
        try:
            for u, chunk in self.chunks:
                label = f"opt:{u}"
                self._keep_deadlines(label)
                for what, v in self.prefetch_at.get(label, ()):
                    self._prefetch(what, v)
                if u < self.n:
                    if (_PARAMS, u) in self._host:  # stepped twice without a forward
                        self._fetch(_PARAMS, u)
                    if (_STATE, u) in self._host:
                        self._fetch(_STATE, u)
                if not chunk:
                    continue
                ids = {id(p) for p in chunk}
                aside = [(p, p.grad) for p in with_grad if id(p) not in ids]
                for p, _ in aside:
                    p.grad = None
                try:
                    out = raw(opt, *args, **kwargs)
                finally:
                    for p, g in aside:
                        p.grad = g
                if u < self.n:
                    if u in self.params_swapped:
                        self._fresh[(_PARAMS, u)] = self._offload(_PARAMS, u)
                    if u in self.states_swapped:
                        self._fresh[(_STATE, u)] = self._offload(_STATE, u)
            # the step ends when its swap-outs have completed
            self._wait([m for ms in self._fresh.values() for m in ms])
            self._settled = True
        finally:
            self._stepping = False
            self._fresh = {}
            poll = getattr(backend, "poll", None)
            if poll is not None:
                poll()
        return out

    def _keep_deadlines(self, label: str) -> None:
        units = self.deadlines.get(label)
        if not units:
            return
        backend = self._backend()
        wait = getattr(backend, "release_offload", None) or getattr(backend, "wait_offload", None)
        if wait is None:
            return
        for key in units:
            for m in self._fresh.get(key, ()):
                wait(m.handle)

    # -------------------------------------------------------------- moving storages

    def _placeholder(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.device)
        one = self._placeholders.get(key)
        if one is None:
            fill = math.nan if (t.dtype.is_floating_point or t.dtype.is_complex) else 0
            one = None
            if t.device.type == "cpu":
                # in numpy memory: a placeholder takes nothing from torch's allocator (the device
                # tier on a CPU), which the cost model does not count it in
                try:
                    one = torch.from_numpy(np.full((), fill, dtype=torch.empty(0, dtype=t.dtype).numpy().dtype))
                except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16)
                    one = None
            if one is None:
                one = torch.full((), fill, dtype=t.dtype, device=t.device)
            self._placeholders[key] = one
        return one.expand(t.shape)

    def _groups(self, what: str, u: int) -> List[Tuple[torch.UntypedStorage, List[Tuple[Callable[[torch.Tensor], None], torch.Tensor]]]]:
        """The storages of unit ``u``'s parameters or state to move, with an installer per tensor."""
        if what == _PARAMS:
            entries = [(_param_setter(p), p) for p in self.swap_params[u]]
        else:
            entries = [(_state_setter(self.optimizer, p, key), t)
                       for p, key, t in state_tensors(self.optimizer, self.unit_params[u])]
        groups: Dict[int, Tuple[torch.UntypedStorage, List[Tuple[Callable[[torch.Tensor], None], torch.Tensor]]]] = {}
        for install, t in entries:
            groups.setdefault(_storage_key(t), (t.untyped_storage(), []))[1].append((install, t))
        return list(groups.values())

    def _offload(self, what: str, u: int) -> List[_Moved]:
        """Queue the copies of unit ``u``'s parameters or state to the host and put placeholders
        in their place (the device bytes go when the copies have run). Nothing if already there."""
        if (what, u) in self._host:
            return []
        backend = self._backend()
        moved: List[_Moved] = []
        for storage, tensors in self._groups(what, u):
            device = tensors[0][1].device
            views = [(install, ViewMeta.of(t)) for install, t in tensors]
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            self.resident_ptrs.discard(storage.data_ptr())
            for install, t in tensors:
                install(self._placeholder(t))
            moved.append(_Moved(backend.offload(source), device, views))
            del source
        if moved:
            self._host[(what, u)] = moved
        return moved

    def _prefetch(self, what: str, u: int) -> None:
        backend = self._backend()
        for m in self._host.get((what, u), ()):
            if not m.prefetched:
                m.prefetched = True
                backend.prefetch(m.handle)

    def _fetch(self, what: str, u: int) -> None:
        """Put unit ``u``'s parameters or state back (waiting for their copies)."""
        moved = self._host.pop((what, u), None)
        if not moved:
            return
        backend = self._backend()
        for i, m in enumerate(moved):
            try:
                data = backend.fetch(m.handle)
            except BaseException:
                self._host[(what, u)] = moved[i:]  # what is not back yet stays on the host
                raise
            storage = data.untyped_storage()
            for install, meta in m.views:
                install(meta.view_of(storage, m.device))
            if what == _PARAMS:
                self.resident_ptrs.add(storage.data_ptr())
            backend.release(m.handle)
            m.handle = None

    def _wait(self, moved: Sequence[_Moved]) -> None:
        backend = self._backend()
        wait = getattr(backend, "release_offload", None) or getattr(backend, "wait_offload", None)
        if wait is not None:
            for m in moved:
                if m.handle is not None:
                    wait(m.handle)
        poll = getattr(backend, "poll", None)
        if poll is not None:
            poll()

    # -------------------------------------------------------------- safety

    def _check_open(self) -> None:
        if self._closed:
            raise StateSwapError("this planned module was closed; make a new one with tensorplace.run()")

    def _install_hooks(self) -> None:
        def bring_back(*_: Any) -> None:
            self.materialize()

        def forward_outside(*_: Any) -> None:
            if not self.in_planned_forward:
                self.materialize()  # the model called directly: on its real parameters

        self._hooks.append(self.model.register_forward_pre_hook(forward_outside))
        owners = {self.model}
        swapped = {id(p) for u in self.params_swapped for p in self.swap_params[u]}
        for m in self.model.modules():
            if any(id(q) in swapped for q in m.parameters(recurse=False)):
                owners.add(m)
        for m in owners:
            if hasattr(m, "register_state_dict_pre_hook"):
                self._hooks.append(m.register_state_dict_pre_hook(bring_back))
            if hasattr(m, "register_load_state_dict_pre_hook"):
                self._hooks.append(m.register_load_state_dict_pre_hook(bring_back))
        opt = self.optimizer
        for name in ("register_state_dict_pre_hook", "register_load_state_dict_pre_hook"):
            if hasattr(opt, name):
                self._hooks.append(getattr(opt, name)(bring_back))


def _param_setter(p: nn.Parameter) -> Callable[[torch.Tensor], None]:
    def install(t: torch.Tensor) -> None:
        p.data = t

    return install


def _state_setter(optimizer: Any, p: nn.Parameter, key: str) -> Callable[[torch.Tensor], None]:
    def install(t: torch.Tensor) -> None:
        optimizer.state[p][key] = t

    return install


def _raw_step(optimizer: Any) -> Callable[..., Any]:
    """The optimizer's step without torch's hook wrapper (the planned step runs the hooks once)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


def _planned_step(swapper: StateSwapper) -> Callable[..., Any]:
    def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

        for pre in chain(_global_optimizer_pre_hooks.values(), getattr(opt, "_optimizer_step_pre_hooks", {}).values()):
            result = pre(opt, args, kwargs)
            if result is not None:
                args, kwargs = result
        if swapper._lr_wrapped:
            opt._opt_called = True  # what a learning-rate scheduler's wrapper of step records
        out = swapper.step(_raw_step(opt), args, kwargs)
        for post in chain(getattr(opt, "_optimizer_step_post_hooks", {}).values(), _global_optimizer_post_hooks.values()):
            post(opt, args, kwargs)
        return out

    return step
