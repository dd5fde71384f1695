"""The user-facing API: ``plan()`` profiles and searches, ``run()`` trains under the plan."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from cuda_exec.compile_guard import refuse_compile
from cuda_exec.delta_policy import DeltaModule
from cuda_exec.executor import PlannedModule
from cuda_exec.units import discover_units

from ._core import PlannerError
from .budget import Budget, format_bytes
from .compiled_engine import refuse_wrapped
from .planning import Plan, evaluate, plan_profile
from .profiler import environment, environment_differences, profile_model
from .runtime import DeltaRuntime, delta_from_plan
from .shapes import Spec, compare, input_specs, planned_specs, scaled_profile, smallest_bucket, specs_json
from .unplanned_memory import UnplannedMemoryCheck


def _inputs_tuple(example_inputs: Any) -> Tuple[Any, ...]:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def parameters_fingerprint(model: nn.Module) -> str:
    """Names, shapes and dtypes of the model's parameters and buffers (not their values)."""
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def inputs_fingerprint(args: Sequence[Any]) -> str:
    """Shapes and dtypes of the tensor inputs of a forward."""
    h = hashlib.sha256()
    for a in args:
        h.update((f"{tuple(a.shape)}:{a.dtype};" if isinstance(a, torch.Tensor) else f"{type(a).__name__};").encode())
    return h.hexdigest()[:16]


def _describe_inputs(args: Sequence[Any]) -> str:
    return ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: Budget,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    method: str = "pso",
    *,
    units: Optional[Iterable[Any]] = None,
    optimizer: Any = None,
    backend: Any = None,
    repeats: int = 3,
    fit_host_costs: Optional[bool] = None,
    **search: Any,
) -> Plan:
    """Profile one training step of ``model`` on ``example_inputs`` and search a plan that fits
    ``budget`` (the whole step's device memory: parameters, gradients, optimizer state,
    activations; bytes or a string like "6GiB").

    ``loss_fn(output)`` gives the scalar the step differentiates (default: cross-entropy for 2-D
    logits, else the sum). ``units``: module classes, instances or names to plan as coarse units
    (default: leaf modules). ``optimizer``: its state is counted as constant memory, and the step
    ends with the optimizer's step (its time and memory per unit are measured on a throwaway copy;
    method ``"tensile"`` may then keep parameters and optimizer state on the host between steps:
    train such a plan with ``run(model, plan, optimizer=opt)``). ``search``: settings of
    ``plan_profile`` (particles, iterations, seed, threads, ...). ``fit_host_costs=False`` keeps
    the executor's calibrated host costs instead of fitting them to this model on a CPU (a faster
    profile; ``profile_model``). The profile is kept on the plan (``plan.profile``) and saved with it.
    """
    refuse_wrapped(model, "tensorplace.plan")
    profile = profile_model(
        model, example_inputs, loss_fn=loss_fn, units=units, repeats=repeats, backend=backend, optimizer=optimizer,
        fit_host_costs=fit_host_costs,
    )
    result = plan_profile(profile, budget, method, **search)
    data = result.to_dict()
    data["model_fingerprint"] = (
        f"params:{parameters_fingerprint(model)};inputs:{inputs_fingerprint(_inputs_tuple(example_inputs))}"
    )
    data["profile"] = profile
    if units is not None:
        data["unit_modules"] = sorted(set(discover_units(model, units).values()))
    data["input_shapes"] = _describe_inputs(_inputs_tuple(example_inputs))
    data["input_specs"] = specs_json(input_specs(_inputs_tuple(example_inputs)))
    return Plan(data)


def _warn_on_environment_change(model: nn.Module, profile: dict) -> None:
    """Warn once when the plan's profile was measured under other kernels or settings: memory
    and times can differ (an oneDNN scratch buffer sized per thread, a cuDNN engine, allocator
    settings), so the plan may not fit its budget."""
    recorded = profile.get("environment")
    if not recorded:
        return
    p = next(model.parameters(), None)
    current = environment(p.device if p is not None else "cpu")
    diff = environment_differences(recorded, current)
    if diff:
        warnings.warn(
            "this plan was profiled under another environment (" + "; ".join(diff) + "): device memory "
            "and times may differ from the plan's predictions; re-plan here with tensorplace.plan() "
            "to be sure the budget holds",
            RuntimeWarning,
            stacklevel=3,
        )


class ReservedMemoryWarning(RuntimeWarning):
    """``run()`` on CUDA: what the plan is predicted to reserve beyond its allocated bytes."""


_reserved_warned: Set[Tuple[Any, ...]] = set()


def _expandable(alloc_conf: str) -> bool:
    items = dict(i.split(":", 1) for i in alloc_conf.replace(" ", "").split(",") if ":" in i)
    return items.get("expandable_segments", "").lower() in ("true", "1")


def reserved_overhead_message(plan: Dict[str, Any], device_type: str) -> Optional[str]:
    """What ``run()`` says once on CUDA about a plan (a plan dict): its predicted reserved memory
    beyond its allocated peak, and how to turn on expandable segments. None off CUDA.

    The reserved peak is the plan's ``predicted["reserved_bytes"]``; a plan without one (made
    before the field was added) is simulated from the profile it carries, under its recorded
    allocator settings."""
    if device_type != "cuda":
        return None
    predicted = plan.get("predicted") or {}
    allocated = predicted.get("peak_bytes")
    reserved = predicted.get("reserved_bytes")
    alloc_conf = predicted.get("alloc_conf")
    if reserved is None and plan.get("profile") and plan.get("actions"):
        try:
            r = evaluate(plan["profile"], plan["actions"], int(plan["budget_bytes"]),
                         segment_starts=plan.get("segment_starts"), reserved=True)
            reserved, alloc_conf, allocated = r["reserved_bytes"], r["alloc_conf"], r["peak_bytes"]
        except PlannerError:  # allocator settings the simulator does not model
            reserved = None
    turn_on = (
        "to reserve less, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment before CUDA "
        "initialises (before the process's first CUDA call; later it has no effect), then profile and plan under "
        "it; tensorplace.plan(..., budget_kind='reserved') plans against reserved memory"
    )
    if reserved is None or allocated is None:
        return "tensorplace: this plan has no reserved-memory prediction (re-plan to get one); " + turn_on
    overhead = int(reserved) - int(allocated)
    pct = 100.0 * overhead / allocated if allocated else 0.0
    head = (
        f"tensorplace: this plan is predicted to reserve {format_bytes(int(reserved))} in the CUDA caching allocator, "
        f"{format_bytes(overhead)} ({pct:.0f}%) above its allocated peak of {format_bytes(int(allocated))}"
    )
    if plan.get("budget_kind") == "reserved" and plan.get("reserved_budget_bytes") is not None:
        head += f" (reserved budget {format_bytes(int(plan['reserved_budget_bytes']))})"
    else:
        head += f" (its budget, {format_bytes(int(plan['budget_bytes']))}, counts allocated bytes)"
    if alloc_conf is not None and _expandable(alloc_conf):
        return head + "; simulated with expandable segments, as the profile was measured"
    # A reserved-budget plan says what expandable segments would reserve (docs/formats.md).
    expandable = ((plan.get("settings") or {}).get("reserved_search") or {}).get("expandable_segments") or {}
    if expandable.get("reserved_bytes") is None:
        return head + "; " + turn_on
    r = int(expandable["reserved_bytes"])
    helps = r < int(reserved)
    if helps:
        head += (
            f"; with expandable segments it would reserve {format_bytes(r)}, "
            f"{format_bytes(max(r - int(allocated), 0))} above its allocated peak"
        )
    else:
        head += f"; expandable segments would not reserve less for it ({format_bytes(r)})"
    faster = expandable.get("faster")
    if faster and predicted.get("step_time"):
        gain = 100.0 * (1.0 - float(faster["step_time"]) / float(predicted["step_time"]))
        head += (
            f", {'and ' if helps else 'but '}a plan the search found, predicted {gain:.0f}% faster "
            f"({float(faster['step_time']) * 1e3:.1f} ms against {float(predicted['step_time']) * 1e3:.1f} ms), "
            f"would reserve {format_bytes(int(faster['reserved_bytes']))} with them and fit the reserved budget: "
            "re-plan under them"
        )
    elif not helps:
        return head
    return head + "; " + turn_on


def _warn_reserved_overhead(model: nn.Module, plan: Dict[str, Any]) -> None:
    p = next(model.parameters(), None)
    device_type = p.device.type if p is not None else "cpu"
    if device_type != "cuda":
        return
    key = (plan.get("profile_fingerprint"), plan.get("budget_bytes"), plan.get("method"), tuple(plan.get("actions", ())))
    if key in _reserved_warned:
        return
    msg = reserved_overhead_message(plan, device_type)
    if msg:
        _reserved_warned.add(key)
        warnings.warn(msg, ReservedMemoryWarning, stacklevel=4)


class PlannedTraining(PlannedModule):
    """``run()``'s module: the executor, plus the checks that the plan belongs to this model and
    these inputs (shapes.py: inputs no larger than the planned ones train under the plan), the
    plans of shape buckets (``shapes=``), and the check for memory the plan does not know of at
    the first planned steps (unplanned_memory.py)."""

    def __init__(self, model: nn.Module, plan: Plan, *, shapes: Optional[Sequence[Any]] = None,
                 hard_cap: bool = False, **kwargs: Any):
        data = plan.to_dict()
        super().__init__(model, data, **kwargs)
        self._plan = plan
        self._executor_kwargs = {k: v for k, v in kwargs.items() if k in ("units", "verify", "optimizer")}
        self._expected_inputs: Optional[str] = None
        self._planned_shapes = data.get("input_shapes", "?")
        self._planned_specs: Optional[List[Spec]] = planned_specs(data)
        settings = data.get("settings") or {}
        #: a moDNN plan runs its batch as sub-batches of this many samples (tensorplace.accumulate)
        self.sub_batch: Optional[int] = (
            int(settings["sub_batch"]) if int(settings.get("accumulation_steps", 1)) > 1 and "sub_batch" in settings else None
        )
        self._sub_batches = int(settings.get("accumulation_steps", 1))
        #: a moDNN plan's step inputs: the planned specs with its sub-batch in dimension 0
        self._sub_batch_specs: Optional[List[Spec]] = None
        if self.sub_batch is not None and self._planned_specs is not None:
            self._sub_batch_specs = [None if s is None else ((self.sub_batch,) + s[0][1:] if s[0] else s[0], s[1])
                                     for s in self._planned_specs]
        fp = plan.model_fingerprint
        if fp:
            parts = dict(p.split(":", 1) for p in fp.split(";") if ":" in p)
            if "params" in parts and parts["params"] != parameters_fingerprint(model):
                raise PlannerError(
                    "this plan was made for another model (its parameters differ in name, shape or dtype); "
                    "re-plan with tensorplace.plan(model, example_inputs, budget)"
                )
            self._expected_inputs = parts.get("inputs")
        self._main_executor = self.executor
        #: shape buckets (shapes=): their specs, and per bucket its plan and executor once made
        self.buckets: List[List[Spec]] = self._buckets(shapes) if shapes is not None else []
        self.bucket_plans: Dict[int, Plan] = {}
        self._bucket_executors: Dict[int, Any] = {}
        self.memory_check = UnplannedMemoryCheck(model, data, hard_cap=hard_cap)
        _warn_on_environment_change(model, data.get("profile") or {})
        _warn_reserved_overhead(model, data)

    # --- shapes ----------------------------------------------------------------------------

    def _buckets(self, shapes: Sequence[Any]) -> List[List[Spec]]:
        if self._planned_specs is None:
            raise PlannerError("shapes=: this plan does not record its input shapes; re-plan with tensorplace.plan()")
        if self._plan.to_dict().get("state_swaps"):
            raise PlannerError("shapes=: this plan keeps parameters or optimizer state on the host between steps "
                               "(state_swaps), and two plans cannot share that; plan each shape on its own")
        if not self._plan.to_dict().get("profile"):
            raise PlannerError("shapes=: a bucket's plan is searched on the plan's profile, and this plan carries "
                               "none; make it with tensorplace.plan() (or replan())")
        tensors = [s for s in self._planned_specs if s is not None]
        out = []
        for b in shapes:
            shapes_of = [b] if len(tensors) == 1 and all(isinstance(d, int) for d in b) else list(b)
            if len(shapes_of) != len(tensors):
                raise PlannerError(f"shapes=: bucket {b!r} gives {len(shapes_of)} shapes for the plan's "
                                   f"{len(tensors)} tensor inputs; give one shape per tensor input")
            it = iter(shapes_of)
            specs = [None if s is None else (tuple(int(d) for d in next(it)), s[1]) for s in self._planned_specs]
            rel, why = compare(specs, self._planned_specs)
            if rel == "other":
                raise PlannerError(f"shapes=: bucket {b!r} is not within the planned inputs {self._planned_shapes} "
                                   f"({why}); a bucket's plan is made from the profile, which describes inputs no "
                                   "larger than the planned ones")
            out.append(specs)
        return out

    def check_inputs(self, args: Sequence[Any]) -> str:
        """``"same"`` for the planned shapes, ``"smaller"`` for inputs no larger in every dimension
        (they train under the plan: shapes.py says why its memory holds); raise otherwise."""
        if self._expected_inputs is None or inputs_fingerprint(args) == self._expected_inputs:
            return "same"
        why = "the plan records no input shapes to compare with"
        if self._planned_specs is not None:
            # a moDNN plan's steps are of its sub-batch (tensorplace.accumulate)
            planned = self._sub_batch_specs if self._sub_batch_specs is not None else self._planned_specs
            rel, why = compare(input_specs(args), planned)
            if rel != "other":
                return rel
        raise PlannerError(
            f"inputs of shape {_describe_inputs(args)} differ from the planned {self._planned_shapes} ({why}): "
            "activation sizes change with the input shape, so the plan no longer fits; inputs no larger than the "
            "planned ones in every dimension train under the plan, larger ones need a plan of their own: re-plan with "
            "tensorplace.plan(model, inputs_of_the_largest_shape, budget), or keep the batch shape fixed "
            "(drop_last=True in the DataLoader)"
        )

    def bucket_plan(self, k: int) -> Plan:
        """The plan of bucket ``k``, searched on first use on the plan's profile scaled to the
        bucket's shape (shapes.scaled_profile) with the plan's budget, method and search settings."""
        if k not in self.bucket_plans:
            data = self._plan.to_dict()
            prof = scaled_profile(data["profile"], self.model, self._planned_specs or [], self.buckets[k])
            given = data.get("settings") or {}
            settings = {key: v for key, v in given.items() if key in (
                "particles", "iterations", "seed", "restarts", "relinks", "mutation", "patience", "seed_extremes",
                "time_limit", "mip_gap", "swaps")}
            if "prefetch_lookahead" in (given.get("eval") or {}):
                settings["prefetch_lookahead"] = int(given["eval"]["prefetch_lookahead"])
            found = plan_profile(prof, int(data["budget_bytes"]), str(data["method"]),
                                 budget_kind=str(data.get("budget_kind") or "allocated"), **settings).to_dict()
            found["profile"] = prof
            found["input_specs"] = specs_json(self.buckets[k])
            self.bucket_plans[k] = Plan(found)
        return self.bucket_plans[k]

    def _executor_for(self, args: Sequence[Any], relation: str) -> Any:
        if relation == "same" or not self.buckets:
            return self._main_executor
        k = smallest_bucket(input_specs(args), self.buckets)
        if k is None:
            return self._main_executor
        if k not in self._bucket_executors:
            from cuda_exec.executor import PlannedModule as _Planned

            kwargs = dict(self._executor_kwargs)
            self._bucket_executors[k] = _Planned(self.model, self.bucket_plan(k).to_dict(),
                                                 self._main_executor.backend, **kwargs).executor
        return self._bucket_executors[k]

    # --- the step --------------------------------------------------------------------------

    def _check_sub_batch(self, args: Sequence[Any]) -> str:
        """A moDNN plan's step is one sub-batch: inputs of the planned shapes with the sub-batch in
        dimension 0 (or smaller), not the whole batch (its memory is the plan's only split)."""
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if self._sub_batch_specs is None:  # a plan without input specs: the batch dimension only
            rel = "same" if first is not None and first.shape[0] == self.sub_batch else "other"
            why = f"dimension 0 is {None if first is None else first.shape[0]}"
        else:
            rel, why = compare(input_specs(args), self._sub_batch_specs)
        if rel != "other":
            return rel
        raise PlannerError(
            f"inputs of shape {_describe_inputs(args)} are not a sub-batch of this moDNN plan ({why}): it trains "
            f"{self._sub_batches} sub-batches of {self.sub_batch} samples of the planned inputs "
            f"{self._planned_shapes} per step, whose memory is what the plan fits in the budget; give the whole batch "
            "to tensorplace.accumulate(planned, inputs, loss_fn, plan), which splits it"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_compile("tensorplace.run()")
        if self.model.training and torch.is_grad_enabled():
            relation = self._check_sub_batch(args) if self.sub_batch is not None else self.check_inputs(args)
            self.memory_check.at_step_start(args)
            ex = self._executor_for(args, relation)
            if ex is not self.executor:  # a bucket's executor: the last one's hooks would run idle in its steps
                self.executor.suspend_hooks()
                self.executor = ex
        return super().forward(*args, **kwargs)

    def close(self) -> None:
        for ex in self._bucket_executors.values():
            ex.close()
        self._bucket_executors.clear()
        self.executor = self._main_executor
        super().close()


def run(
    model: nn.Module,
    plan: Union[Plan, DeltaRuntime, str, "os.PathLike[str]"],
    *,
    backend: Any = None,
    units: Optional[Iterable[Any]] = None,
    verify: Optional[bool] = None,
    runtime: bool = False,
    optimizer: Any = None,
    shapes: Optional[Sequence[Any]] = None,
    hard_cap: bool = False,
) -> Union[PlannedTraining, DeltaModule]:
    """``model`` as an ``nn.Module`` that trains under ``plan`` (a Plan or a plan file path).

    It shares ``model``'s parameters; use it in your own loop with any optimizer. In eval mode
    or under ``torch.no_grad()`` it simply runs the model. ``backend``: the host tier (default:
    the CPU backend on CPU, the CUDA backend on a GPU). ``verify``: checksum every moved or
    dropped tensor and fail loudly on a mismatch (default: the ``TENSORPLACE_VERIFY`` variable).

    A runtime policy instead of a plan: ``run(model, tensorplace.delta(budget))`` trains under
    DELTA's runtime policy (no planner: decisions during each step; a ``DeltaModule`` whose
    ``last_stats`` lists them). ``runtime=True`` with a ``method="delta"`` plan runs that policy
    with the plan's budget and profile instead of the plan's simulated decisions.

    ``optimizer``: needed by a plan that keeps parameters or optimizer state on the host between
    optimizer steps (``plan.state_swaps``, method ``"tensile"``): its ``step()`` then runs the
    plan's optimizer step (cuda_exec/cuda_exec/state_swap.py); the loop stays
    ``loss.backward(); optimizer.step(); optimizer.zero_grad()``. ``close()`` puts it back.

    Input shapes: inputs no larger than the planned ones in every dimension (a shorter sequence,
    a smaller last batch) train under the plan, whose memory still holds for them
    (tensorplace/shapes.py says why and what is checked); larger ones are refused.
    ``shapes``: shape buckets, e.g. ``[(8, 128), (8, 256)]`` for a model of one (batch, tokens)
    input (one shape per tensor input: ``[((8, 128), (8, 128)), ...]`` for two), each no larger
    than the planned shapes: a batch trains under the plan of the smallest bucket that holds it,
    searched on first use from the plan's profile scaled to that shape (same budget, method and
    search settings) and kept (``module.bucket_plans``); a bucket's plan may retain more, so its
    steps are faster.

    Memory the plan does not know of: at the first planned steps the memory the step starts
    with is compared with the plan's constant memory (tensorplace/unplanned_memory.py); more
    (the state of an optimizer the plan was not given, tensors kept from earlier steps) is
    reported once with ``UnplannedMemoryWarning``, the bytes and the fix. ``hard_cap=True``: a
    budget that must hold; the step raises ``BudgetError`` instead when it would not.
    """
    refuse_wrapped(model, "tensorplace.run")
    if isinstance(plan, DeltaRuntime):
        return DeltaModule(model, plan.budget_bytes, backend, units=units, verify=verify, **plan.executor_kwargs())
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if units is None and plan.to_dict().get("unit_modules"):
        modules = dict(model.named_modules())
        names = plan.to_dict()["unit_modules"]
        missing = [n for n in names if n not in modules]
        if missing:
            raise PlannerError(
                f"the plan's units {missing[:3]} are not modules of this model; re-plan with "
                "tensorplace.plan(model, example_inputs, budget, units=...)"
            )
        units = [modules[n] for n in names]
    if runtime:
        return DeltaModule(model, plan.budget_bytes, backend, units=units, verify=verify,
                           **delta_from_plan(plan).executor_kwargs())
    return PlannedTraining(model, plan, backend=backend, units=units, verify=verify, optimizer=optimizer,
                           shapes=shapes, hard_cap=hard_cap)
