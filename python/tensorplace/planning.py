"""Planning from a Profile: `plan_profile()` and the `Plan` it returns."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _core
from .budget import Budget, format_bytes, parse_budget

ProfileLike = Union[Dict[str, Any], str, "os.PathLike[str]"]

ACTIONS = ("retain", "swap", "recompute")
BUDGET_KINDS = ("allocated", "reserved")
MILP_METHODS = ("milp", "milp-swap", "milp-recompute")


def profile_json(profile: ProfileLike) -> str:
    """JSON text of a profile given as a dict, JSON text, or a path to a .json file (validated)."""
    if isinstance(profile, dict):
        text = json.dumps(profile)
    elif isinstance(profile, (str, os.PathLike)) and not str(profile).lstrip().startswith("{"):
        with open(profile, "r", encoding="utf-8") as f:
            text = f.read()
    elif isinstance(profile, str):
        text = profile
    else:
        raise TypeError(f"profile must be a dict, JSON text or a path, got {type(profile).__name__}")
    _core.validate_profile(text)
    return text


def load_profile(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Read and validate a profile file."""
    return json.loads(profile_json(path))


def save_profile(profile: Dict[str, Any], path: Union[str, "os.PathLike[str]"]) -> None:
    """Validate and write a profile as JSON."""
    text = profile_json(profile)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


class Plan:
    """A policy table: one action per unit, the prefetch schedule, and the predictions.

    >>> import tensorplace as tp
    >>> p = tp.plan_profile(tp.examples.profile("plain20", batch_size=8), "200MiB", iterations=5, particles=20)
    >>> len(p.actions) == len(p.units) and set(p.actions) <= {"retain", "swap", "recompute"}
    True
    """

    def __init__(self, data: Dict[str, Any]):
        self._data = json.loads(_core.validate_plan(json.dumps(data)))
        # Keep fields the core does not know about (none today) as given.
        for k, v in data.items():
            self._data.setdefault(k, v)

    # --- fields -------------------------------------------------------------------------
    @property
    def actions(self) -> List[str]:
        return list(self._data["actions"])

    @property
    def units(self) -> List[str]:
        return list(self._data["units"])

    @property
    def prefetch(self) -> List[Dict[str, int]]:
        return [dict(p) for p in self._data["prefetch"]]

    @property
    def segment_starts(self) -> List[int]:
        """Units that start a checkpoint segment (docs/cost-model.md)."""
        return list(self._data.get("segment_starts", []))

    @property
    def predicted(self) -> Dict[str, Any]:
        return dict(self._data["predicted"])

    @property
    def state_swaps(self) -> Optional[Dict[str, Any]]:
        """Parameters and optimizer state the plan keeps on the host between optimizer steps
        (``parameters``, ``optimizer_state``: unit indices; ``prefetch``, ``deadlines``: when they
        come back and leave; docs/formats.md), or None. Train such a plan with
        ``tensorplace.run(model, plan, optimizer=opt)``."""
        s = self._data.get("state_swaps")
        return json.loads(json.dumps(s)) if s else None

    @property
    def budget_bytes(self) -> int:
        return int(self._data["budget_bytes"])

    @property
    def budget_kind(self) -> str:
        """What the user's budget limits: "allocated" (live tensors) or "reserved" (what the CUDA
        caching allocator reserves, simulated; docs/cost-model.md "Reserved memory")."""
        return str(self._data.get("budget_kind") or "allocated")

    @property
    def reserved_budget_bytes(self) -> Optional[int]:
        """A reserved plan's budget (its ``budget_bytes`` is the allocated budget it was searched
        under); None for an allocated plan."""
        v = self._data.get("reserved_budget_bytes")
        return None if v is None else int(v)

    @property
    def method(self) -> str:
        return str(self._data["method"])

    @property
    def settings(self) -> Dict[str, Any]:
        return dict(self._data.get("settings") or {})

    @property
    def profile_fingerprint(self) -> str:
        return str(self._data["profile_fingerprint"])

    @property
    def model_fingerprint(self) -> Optional[str]:
        return self._data.get("model_fingerprint")

    @model_fingerprint.setter
    def model_fingerprint(self, value: Optional[str]) -> None:
        self._data["model_fingerprint"] = value

    @property
    def profile(self) -> Optional[Dict[str, Any]]:
        """The profile the plan was searched on (a copy), kept by ``tensorplace.plan()`` and
        ``replan()`` and saved with the plan; None for a plan from ``plan_profile()``, which
        keeps only the profile's fingerprint."""
        p = self._data.get("profile")
        return json.loads(json.dumps(p)) if p is not None else None

    @property
    def convergence(self) -> Optional[Dict[str, Any]]:
        return self._data.get("convergence")

    def counts(self) -> Dict[str, int]:
        """How many units get each action."""
        return {a: self._data["actions"].count(a) for a in ACTIONS}

    # --- files --------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return json.loads(json.dumps(self._data))

    def to_json(self) -> str:
        return json.dumps(self._data, indent=1)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write the plan as versioned JSON."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"]) -> "Plan":
        """Read a plan file; refuses other formats, newer versions and corrupt files."""
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise _core.PlannerError(f"cannot read plan {os.fspath(path)!r}: not JSON ({e}); re-plan and save it again") from None
        if not isinstance(data, dict):
            raise _core.PlannerError(f"cannot read plan {os.fspath(path)!r}: expected a JSON object")
        return cls(data)

    def check_profile(self, profile: ProfileLike) -> None:
        """Raise if this plan was made for another profile."""
        _core.validate_plan(json.dumps(self._data), profile_json(profile))

    def replan(self, budget: Budget, method: str = "pso", budget_kind: Optional[str] = None, **search: Any) -> "Plan":
        """A plan for the same model and inputs under another budget or method, searched on the
        profile this plan carries (plans from ``tensorplace.plan()`` do): no new profiling.
        ``budget_kind``: default, this plan's."""
        data = self.to_dict()
        if "profile" not in data:
            raise _core.PlannerError(
                "this plan carries no profile (it was made by plan_profile); call plan_profile(profile, budget) instead"
            )
        kind = self.budget_kind if budget_kind is None else budget_kind
        new = plan_profile(data["profile"], budget, method, budget_kind=kind, **search).to_dict()
        for key in ("model_fingerprint", "profile", "input_shapes", "input_specs", "unit_modules"):
            if key in data:
                new[key] = data[key]
        return Plan(new)

    @property
    def fixed_memory(self) -> Optional[Dict[str, Any]]:
        """The memory no plan can move, and where it is (:func:`fixed_memory`); None for plans
        saved before it was recorded."""
        return self._data.get("fixed_memory")

    def summary(self) -> str:
        p = self.predicted
        c = self.counts()
        under = format_bytes(self.budget_bytes)
        note = ""
        if self.reserved_budget_bytes is not None:
            under = f"{format_bytes(self.reserved_budget_bytes)} reserved ({under} allocated)"
            search = (self.settings or {}).get("reserved_search") or {}
            note = f"; {search['note']}" if search.get("note") else ""
        reserved = f", reserved {format_bytes(p['reserved_bytes'])}" if p.get("reserved_bytes") is not None else ""
        ss = self.state_swaps
        across = (
            f"; across iterations {len(ss.get('parameters', []))} units' parameters and "
            f"{len(ss.get('optimizer_state', []))} units' optimizer state on the host"
            if ss else ""
        )
        return (
            f"{self.method} plan for {len(self.units)} units under {under}: "
            f"{c['retain']} retain, {c['swap']} swap, {c['recompute']} recompute{across}; predicted step "
            f"{p['step_time'] * 1e3:.1f} ms (compute {p['compute_time'] * 1e3:.1f}, swap stall "
            f"{p['swap_stall'] * 1e3:.1f}, recompute {p['recompute'] * 1e3:.1f}), peak {format_bytes(p['peak_bytes'])}{reserved}"
            + note + _fixed_text(self.fixed_memory)
        )

    def __repr__(self) -> str:
        return f"<tensorplace.Plan {self.summary()}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self._data == other._data


def _fixed_text(fixed: Optional[Dict[str, Any]]) -> str:
    if not fixed:
        return ""
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in fixed["constant"].items() if v)
    where = fixed["lower_bound_stage"] + (f" ({fixed['lower_bound_unit']})" if fixed.get("lower_bound_unit") else "")
    movable = f", of which {format_bytes(fixed['movable_bytes'])} can stay on the host between steps" if fixed.get("movable_bytes") else ""
    return (
        f"; fixed: {format_bytes(fixed['constant_bytes'])} constant ({parts or 'none'}){movable}, gradients "
        f"{format_bytes(fixed['gradient_bytes'])}; no plan peaks below {format_bytes(fixed['lower_bound_bytes'])} (at {where})"
    )


def check_counts(**counts: Optional[int]) -> None:
    """Settings that count something are whole numbers, none negative (None: not set); else
    PlannerError (a ValueError) naming the setting."""
    for name, v in counts.items():
        if v is None:
            continue
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise _core.PlannerError(f"{name} must be a whole number, got {v!r}")
        if v < 0:
            raise _core.PlannerError(f"{name} must be 0 or more, got {v}")


def plan_profile(
    profile: ProfileLike,
    budget: Budget,
    method: str = "pso",
    *,
    particles: int = 500,
    iterations: int = 500,
    seed: int = 0,
    threads: int = 0,
    seed_extremes: bool = True,
    mutation: float = 0.0,
    patience: Optional[int] = None,
    prefetch_lookahead: int = 2,
    time_limit: float = 30.0,
    mip_gap: float = 1e-4,
    choose_starts: bool = False,
    seed_heuristics: bool = True,
    seed_plans: Optional[Sequence[Sequence[str]]] = None,
    budget_kind: str = "allocated",
    alloc_conf: Optional[str] = None,
    reserved_rounds: int = 8,
    restarts: int = 3,
    relinks: int = 6,
    block_wise: Optional[bool] = None,
    swaps: bool = True,
) -> Plan:
    """Search a plan for `profile` that fits `budget` (the whole step's device memory).

    Methods: "pso" (HOME; its swarm starts from the heuristics' plans unless
    `seed_heuristics` is False, and from `seed_plans`, lists of actions such as another
    method's ``plan.actions``), "exhaustive" (every plan; up to 14 units), "exhaustive-segments"
    (every plan and every split of its recomputed runs into checkpoint segments, which the plan's
    ``segment_starts`` return; up to 12 units), the fixed plans
    "retain", "swap-all", "recompute-all", the recipes "checkpoint-blocks" and "sqrt", the
    heuristics "capuchin", "superneurons", "vdnn",
    "vdnn-sync" (synchronous offload), "tensile", "delta" (DELTA's runtime policy, simulated
    over the cost model's timeline) and "modnn" (a sub-batch with gradient
    accumulation: ``settings["sub_batch"]``, ``settings["accumulation_steps"]``, predictions
    per full step; train it with ``tensorplace.accumulate``), and the MILPs "milp" (swap and recompute),
    "milp-swap" (AutoTM) and "milp-recompute" (Checkmate), solved by HiGHS under `time_limit`
    seconds to a relative gap of `mip_gap` (docs/methods.md); with `choose_starts` the MILP also
    chooses where its runs of recomputed units are split into checkpoint segments (the plan's
    ``segment_starts``; "exhaustive-segments" does too, every other method keeps the profile's
    default starts). Raises `BudgetError` (the smallest budget known to work in its
    `smallest_budget`, also `args[1]`) when the budget cannot be met.

    PSO (`particles` x `iterations`, `seed`; deterministic for a seed whatever `threads`) polishes
    its best plans by local search, then runs `restarts` more swarms of ``max(particles // 8, 1)``
    particles from random plans and polishes their best, then polishes up to `relinks` plans
    found between polished plans by path relinking; the last two only ever improve the plan and
    about double the default search's time (docs/methods.md, "PSO extensions"; 0 turns each off,
    as quick searches with few particles may want: there the polishes dominate the time).

    `block_wise`: models of repeated blocks (Transformer layers, ResNet stages; found from the unit
    names) are searched block-wise: the swarm and its extensions first plan one set of actions per
    class of equal blocks, then the blocks are untied in halves down to single blocks, polished at
    each level (docs/methods.md, "Block-wise search"). None (the default): block-wise above 400
    units, over every unit below (the search over every unit costs about units^2.5); True or
    False forces it. The swarm stops early, and nothing runs after it, when its best plan fits with
    no stall and no replay (no plan is faster), so ``convergence["best"]`` may be shorter than
    `iterations`; ``convergence["phases"]`` lists each phase's time, evaluations and simulated
    stages.

    `swaps=False` (method "pso"): plans retain and recompute only, for an engine that cannot swap
    (``tensorplace.compiled``, docs/compiled.md): the swarm, its extensions and its seeds never
    swap, and an infeasible budget names the smallest budget known for such plans.

    `budget_kind="reserved"`: the budget limits the memory PyTorch's CUDA caching allocator
    reserves, simulated over the plan's allocation sequence under `alloc_conf` (a
    ``PYTORCH_CUDA_ALLOC_CONF`` string; default, the one recorded in the profile's environment).
    The search runs on allocated bytes, and searches the allocated budget: the plan searched at
    the budget itself, then, while none fits, budgets lower by the reserved overshoot, then
    bisection between the largest allocated budget whose plan fit and the smallest above it whose
    plan did not, up to `reserved_rounds` searches; the fastest plan that fits is returned. When
    no searched plan fits, the faster of the all-swap and all-recompute plans that fits is
    (``settings["reserved_search"]["note"]`` says so); when none fits, `BudgetError` names the
    smallest reserved budget a plan found meets. The plan's ``budget_bytes`` is the allocated
    budget it was searched under, ``reserved_budget_bytes`` the budget given,
    ``predicted["reserved_bytes"]`` its reserved peak; ``settings["reserved_search"]`` lists
    every search (docs/formats.md) and, where expandable segments would let the plan searched at
    the budget itself fit, says so (``expandable_segments``), which ``run()`` repeats on CUDA.
    """
    if budget_kind not in BUDGET_KINDS:
        raise _core.PlannerError(f"budget_kind {budget_kind!r}: use one of {', '.join(BUDGET_KINDS)}")
    check_counts(particles=particles, iterations=iterations, seed=seed, threads=threads, restarts=restarts,
                  relinks=relinks, reserved_rounds=reserved_rounds, prefetch_lookahead=prefetch_lookahead,
                  patience=patience)
    if choose_starts and method not in MILP_METHODS:
        raise _core.PlannerError(
            f"choose_starts applies to the MILP methods ({', '.join(MILP_METHODS)}), not {method!r}; "
            "use method='exhaustive-segments' on tiny profiles"
        )
    if not swaps and method != "pso":
        raise _core.PlannerError(
            f"swaps=False applies to method='pso'; {method!r} chooses its own actions (the methods that never swap: "
            "'recompute-all', 'checkpoint-blocks', 'sqrt', 'milp-recompute')")
    text = profile_json(profile)
    if method in MILP_METHODS:
        if budget_kind != "allocated":
            raise _core.PlannerError(
                f"budget_kind='reserved' is not supported for the MILP method {method!r}; use method='pso' "
                "(or plan the MILP on a smaller allocated budget and check predicted['reserved_bytes'])"
            )
        from .methods.milp import milp_plan

        return _with_fixed_memory(
            json.loads(
                milp_plan(
                    text,
                    parse_budget(budget),
                    method,
                    time_limit=time_limit,
                    mip_gap=mip_gap,
                    choose_starts=choose_starts,
                    threads=threads,
                    prefetch_lookahead=prefetch_lookahead,
                )
            ),
            profile,
        )
    data = _core.make_plan(
        text,
        parse_budget(budget),
        method,
        particles=particles,
        iterations=iterations,
        seed=seed,
        threads=threads,
        seed_extremes=seed_extremes,
        mutation=mutation,
        patience=patience,
        prefetch_lookahead=prefetch_lookahead,
        seed_heuristics=seed_heuristics,
        seed_plans=[list(a) for a in seed_plans] if seed_plans else None,
        budget_kind=budget_kind,
        alloc_conf=alloc_conf,
        reserved_rounds=reserved_rounds,
        restarts=restarts,
        relinks=relinks,
        block_wise=block_wise,
        swaps=swaps,
    )
    return _with_fixed_memory(json.loads(data), profile)


def fixed_memory(profile: ProfileLike, state_swaps: bool = False) -> Dict[str, Any]:
    """The memory no plan can move, and where it is: the constant memory by kind (parameters,
    optimizer state, inputs, workspace: on the device for the whole step), the gradients (all
    of them exist by the step's end), and the lower bound of any plan's peak with the stage and
    unit where it is reached (that stage's constant memory, gradients so far, transients and the
    activations it reads).

    `state_swaps`: of plans that may keep parameters and optimizer state on the host between
    optimizer steps; ``movable_bytes`` is then how much of the constant memory they can move."""
    prof = profile if isinstance(profile, dict) else json.loads(profile_json(profile))
    memory = {k: int(v) for k, v in (prof.get("memory") or {}).items()}
    bound, stage = _core.lower_bound(profile_json(prof), state_swaps)
    kind, _, index = str(stage).partition(":")
    units = prof.get("units") or []
    unit = units[int(index)]["name"] if index.isdigit() and int(index) < len(units) else None
    return {
        "constant": memory,
        "constant_bytes": sum(memory.values()),
        "gradient_bytes": sum(int(u.get("grad_bytes", 0)) for u in units),
        "lower_bound_bytes": int(bound),
        "lower_bound_stage": stage,
        "lower_bound_unit": unit,
        **({"movable_bytes": sum(int(u.get("param_bytes", 0)) + int(u.get("optimizer_state_bytes", 0)) for u in units)
            if prof.get("optimizer") else 0} if state_swaps else {}),
    }


def _with_fixed_memory(data: Dict[str, Any], profile: ProfileLike) -> "Plan":
    data["fixed_memory"] = fixed_memory(profile, state_swaps=bool(data.get("state_swaps")))
    return Plan(data)


def evaluate(
    profile: ProfileLike,
    actions: Sequence[str],
    budget: Budget,
    prefetch_lookahead: int = 2,
    segment_starts: Optional[Sequence[int]] = None,
    *,
    reserved: bool = False,
    alloc_conf: Optional[str] = None,
    memory_curve: bool = False,
    swap_parameters: Optional[Sequence[int]] = None,
    swap_optimizer_state: Optional[Sequence[int]] = None,
) -> Dict[str, Any]:
    """The cost model's prediction for `actions` (docs/cost-model.md), with the memory curve.

    `swap_parameters`, `swap_optimizer_state`: units whose parameters / optimizer state the plan
    keeps on the host between optimizer steps (a profile with an optimizer step;
    docs/cost-model.md, "Optimizer step"); the result lists their copies (``copies`` with
    ``what``), ``state_prefetch`` and ``state_deadlines``.
    `segment_starts`: units before which a run of recomputed units is split into checkpoint
    segments (default: the starts of the profile's repeated blocks; the result says which).
    `reserved`: also simulate the plan's allocation sequence under PyTorch's CUDA caching
    allocator, with `alloc_conf` (default: the profile's recorded ``PYTORCH_CUDA_ALLOC_CONF``):
    adds ``reserved_bytes``, ``alloc_conf`` and the simulation's stats (``allocator``).
    `memory_curve` (with `reserved`): adds ``memory_curve``, after every allocation event its
    ``time`` (seconds from the step's start), ``allocated`` and ``reserved`` bytes."""
    starts = None if segment_starts is None else [int(u) for u in segment_starts]
    return json.loads(
        _core.evaluate(
            profile_json(profile), list(actions), parse_budget(budget), prefetch_lookahead, starts, reserved, alloc_conf,
            memory_curve, _units(swap_parameters), _units(swap_optimizer_state),
        )
    )


def _units(units: Optional[Sequence[int]]) -> Optional[List[int]]:
    return None if units is None else [int(u) for u in units]


def allocation_sequence(
    profile: ProfileLike,
    actions: Sequence[str],
    budget: Budget,
    prefetch_lookahead: int = 2,
    segment_starts: Optional[Sequence[int]] = None,
    swap_parameters: Optional[Sequence[int]] = None,
    swap_optimizer_state: Optional[Sequence[int]] = None,
) -> Dict[str, Any]:
    """The device allocations and frees the cost model has `actions` make, in order
    (docs/cost-model.md, "Reserved memory"): ``events`` as :func:`tensorplace.allocator.simulate`
    reads them, ``what`` (per event, the block: ``"act:3"``, ``"bwd_work:5"``, ...), ``times``
    (per event, seconds from the step's start), ``constant_bytes`` (the constant memory, not in the events: simulate with ``initial=(c, c)``),
    and the evaluation's ``peak_bytes`` and ``end_bytes``."""
    starts = None if segment_starts is None else [int(u) for u in segment_starts]
    return json.loads(
        _core.allocation_sequence(profile_json(profile), list(actions), parse_budget(budget), prefetch_lookahead, starts,
                                  _units(swap_parameters), _units(swap_optimizer_state))
    )


def lower_bound(profile: ProfileLike, state_swaps: bool = False) -> int:
    """The smallest peak any plan could have (bytes); with `state_swaps`, any plan that may also
    keep parameters and optimizer state on the host between optimizer steps (method "tensile" on
    a profile with an optimizer step)."""
    return _core.lower_bound(profile_json(profile), state_swaps)[0]


def unplanned_peak(profile: ProfileLike) -> int:
    """The predicted peak when every unit is retained (bytes)."""
    return _core.unplanned_peak(profile_json(profile))


def without_executor(profile: ProfileLike) -> Dict[str, Any]:
    """The profile as the model trained without tensorplace runs: no executor host costs (every
    plan's step pays the executor's work, all-retain too; the plain model's step does not), so
    its all-retain evaluation is the unplanned step.

    >>> import tensorplace as tp
    >>> p = dict(tp.examples.profile("plain20", batch_size=8), executor={"step": 1e-3})
    >>> retain = ["retain"] * len(p["units"])
    >>> planned, plain = tp.evaluate(p, retain, 2**40), tp.evaluate(without_executor(p), retain, 2**40)
    >>> round(planned["step_time"] - plain["step_time"], 9)
    0.001
    """
    d = json.loads(profile_json(profile))
    d.pop("executor", None)
    return d
