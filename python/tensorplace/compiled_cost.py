"""The compiled engine's own cost model, and plans made for it (issue 19).

The compiled engine (:mod:`tensorplace.compiled_engine`) runs each *region* (by default every
repeated block) under torch's selective checkpointing; compiled, torch's partitioner decides op by
op what is saved, saves the region boundaries, and inductor fuses and frees buffers as it likes.
Rather than modelling the partitioner and inductor, this cost model **measures** what it needs
where the measurement is cheap, and adds the measurements up along the step:

* **Per region class and assignment** (a *class*: the region's module structure and its inputs'
  shapes, so GPT6's six blocks are one class and ResNet-18's eight BasicBlocks seven; an
  *assignment*: the actions of the region's units): a copy of the region alone is compiled under
  the compiled engine with that assignment and one training step of it is measured with torch's
  allocation records (:func:`cuda_exec.memory.measure_peak`, the instrument of every measurement
  here): ``kept``, what its forward leaves allocated (the values the partitioner saved); whether it
  saved its output and its input; ``F``, its forward's peak; ``B``, the peak of its forward and
  backward (the output's gradient made in the step, as the next region's backward makes it), less
  the output when the region did not save it; ``G``, its parameters' gradients; ``t``, its step time.
* **The whole step** under three plans (three compiles of the model: all retained, all
  recomputed, all retained but the last region), measured as the benches measure
  (:func:`tensorplace.profiler.unplanned_step_stats`, and the forward alone): they calibrate what
  lies outside the regions (embeddings, stem, head, loss) and how the whole graph's schedule
  differs from the regions' own.

For a plan with assignment ``a_r`` for region ``r`` (forward order), region ``r`` keeps
``P[r] = kept[r]`` plus its output if it or region ``r + 1`` saves it (the last region's output is
counted). The predicted peak is the constant memory (parameters, inputs) plus the largest of

* forward of region ``r``: ``K_fw + sum(P[q] for q < r) + F[r]`` (+ its input if not kept);
* end of the forward and the head's backward: ``K_end + sum(P)``;
* backward of region ``r``: ``K_bw[kind(a_r)] + sum(P[q] for q < r) + sum(G[q] for q > r) + B[r]``,
  plus ``hoist * (F[r-1] - E[r-1])`` when regions ``r - 1`` and ``r`` both recompute (the whole
  graph's schedule recomputes region ``r - 1`` while region ``r``'s backward runs);

``kind``: "retain" (all retained), "recompute" (all recomputed), "mixed". ``K_end``: the
all-retain step's measured peak less its ``sum(P)``; ``K_fw``: the larger, over the first two
plans, of the forward's measured peak less its largest forward term; ``K_bw["retain"]``: the
all-retain step's peak less its largest backward term; ``K_bw["recompute"]``: the third plan's
peak less its last region's backward term; ``K_bw["mixed"]`` the larger of the two; ``hoist``:
the smallest share that explains the all-recompute step's peak. The calibration plans are so
predicted at their measured peaks. The predicted step is the all-retain step's plus, per region,
its measured step under its assignment less under all-retain (at least zero).

The model alone (:meth:`CompiledCostModel.predict`) is an estimate (docs/compiled.md has its
measured error). :func:`plan_compiled` searches with it and then **verifies**: it compiles the
chosen plan on the whole model and measures it (one compile; :meth:`CompiledCostModel.verify`),
re-searching with a corrected budget where the measurement disagrees, so that the plan's
predicted peak and step are its compiled step's measured ones. The search: per region class a few
assignments ("retain"; "recompute"; "save-matmuls": the units with a matrix product or a
convolution retained, the rest recomputed), one per region, the smallest predicted step whose
predicted peak fits, of equal steps the one with the fewest recomputed units (exhaustive when
small, else greedy).

Limits: the regions must run one after another (a chain of blocks) and the compiled step must be
one graph (no graph breaks); units outside the regions run as retained (the engine's rule); the
numbers are the device's the model's parameters are on.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from ._core import BudgetError, PlannerError

__all__ = ["CompiledCostModel", "RegionCost", "plan_compiled", "unit_sequence", "plan_dict"]

RETAIN, RECOMPUTE = "retain", "recompute"


# --- plans and units ------------------------------------------------------------------------------


def unit_sequence(model: nn.Module, example_inputs: Sequence[Any], units: Any = None) -> List[str]:
    """The unit names of one forward of ``model`` in call order (one per call of a unit module, as
    the profiler numbers units). Runs one forward in training mode without gradients; the random
    generators and the model's buffers are restored afterwards."""
    from cuda_exec.units import discover_units

    modules = discover_units(model, units)
    names: List[str] = []
    depth = [0]

    def pre(_m: nn.Module, _a: Any, name: str) -> None:
        if depth[0] == 0:
            names.append(name)
        depth[0] += 1

    def post(_m: nn.Module, _a: Any, _o: Any) -> None:
        depth[0] -= 1

    handles = []
    for m, name in modules.items():
        handles.append(m.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name)))
        handles.append(m.register_forward_hook(post))
    with _probe_forward(model, handles), torch.no_grad():
        model(*example_inputs)
    return names


@contextlib.contextmanager
def _probe_forward(model: nn.Module, handles: List[Any]) -> Iterator[None]:
    """A forward of ``model`` in training mode that leaves no trace: the random generators (CPU
    and the model's CUDA devices), the buffers (BatchNorm's statistics), the mode and the
    gradients are restored, and ``handles`` removed, afterwards."""
    saved = [b.detach().clone() for b in model.buffers()]
    was_training = model.training
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda):
            model.train()
            yield
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved):
                b.copy_(s)
        for p in model.parameters():
            p.grad = None
        model.train(was_training)


def plan_dict(units: Sequence[str], actions: Sequence[str], *, budget: int = 0, method: str = "compiled",
              peak: int = 0, step: float = 0.0, feasible: bool = True, **extra: Any) -> Dict[str, Any]:
    """A plan dict (docs/formats.md) with these units and actions; ``peak``/``step`` its predicted
    peak and step time."""
    data: Dict[str, Any] = {
        "format": "tensorplace.plan", "version": 1, "profile_fingerprint": "compiled", "budget_bytes": int(budget),
        "method": method, "settings": {}, "units": list(units), "actions": list(actions), "prefetch": [],
        "predicted": {"step_time": float(step), "compute_time": float(step), "swap_stall": 0.0, "recompute": 0.0,
                      "host_time": 0.0, "copy_time": 0.0, "overlapped_copy": 0.0, "peak_bytes": int(peak),
                      "peak_stage": "", "feasible": bool(feasible), "reason": None},
    }
    data.update(extra)
    return data


def _is_matmul_unit(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd))


# --- measurements ---------------------------------------------------------------------------------


def _tensor_bytes(obj: Any) -> int:
    seen, total = set(), 0
    for t in pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s._cdata not in seen:
                seen.add(s._cdata)
                total += s.nbytes()
    return total


def _clone_inputs(spec: Any) -> Any:
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        if t.requires_grad:
            c.requires_grad_(True)
        return c

    return pytree.tree_map(one, spec)


def _graph_handles(outs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Tensors of no bytes whose autograd graphs hold those of ``outs`` (an empty copy of an empty
    view of each): kept, they keep the graph and what it saved alive without the outputs. Keeping
    ``grad_fn`` itself does not on torch 2.11: the compiled graph's node (CompiledFunctionBackward,
    a custom autograd Function) is held only weakly by its Python object there, so the node and
    its saved values are freed with the output (torch 2.14 holds it)."""
    return [t.as_strided((0,), (1,)).clone() for t in outs]


@dataclass
class RegionCost:
    """One region class under one assignment, measured alone (module docstring)."""

    E: int  #: bytes its forward leaves allocated (saved values and its output)
    F: int  #: its forward's peak
    B: int  #: its step's peak, less its output when nothing saved it
    G: int  #: its parameters' gradients
    t: float  #: its step's shortest time of the timed repeats (seconds)
    out_bytes: int = 0  #: its output
    out_saved: bool = True  #: whether its graph saved its output
    kept: int = 0  #: what its forward leaves allocated without its output (the saved values)
    in_bytes: int = 0  #: its inputs that need gradients
    in_saved: bool = True  #: whether its graph saved its input

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def measure_region(module: nn.Module, rel_units: Sequence[str], actions: Sequence[str], args: Any, kwargs: Any,
                   *, repeats: int = 3) -> RegionCost:
    """Compile a copy of one region ``module`` alone under the compiled engine with ``actions``
    for its units (``rel_units``: their names inside the region) and measure one training step
    (module docstring). ``args``/``kwargs``: example inputs (their ``requires_grad`` as in the
    model's forward)."""
    from cuda_exec.memory import measure_peak

    from .compiled_engine import CompiledPlan

    work = copy.deepcopy(module)
    work.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        wrapper = CompiledPlan(work, plan_dict(rel_units, actions), regions=[""])
    dev = next((p.device for p in work.parameters()), torch.device("cpu"))
    try:
        torch._dynamo.reset()
        step_mod = torch.compile(wrapper)

        def fresh() -> Tuple[Any, Any]:
            return _clone_inputs(args), _clone_inputs(kwargs)

        def outs_of(out: Any) -> List[torch.Tensor]:
            return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]

        def step(a: Any, k: Any) -> None:
            out = step_mod(*a, **k)
            outs = outs_of(out)
            grads = [torch.ones_like(t) for t in outs]
            torch.autograd.backward(outs, grads)

        def forward_keep(a: Any, k: Any) -> Any:
            return step_mod(*a, **k)

        def forward_graph(a: Any, k: Any) -> Any:
            out = step_mod(*a, **k)
            return _graph_handles(outs_of(out))  # the graph (and what it saved) without the output

        def forward_graph_own_input(a: Any, k: Any) -> Any:
            # the inputs made inside the window, not leaves: kept after the call only if the graph saved them
            a2 = [t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in a]
            out = step_mod(*a2, **k)
            del a2
            return _graph_handles(outs_of(out))

        def clear() -> None:
            for p in work.parameters():
                p.grad = None

        a, k = fresh()
        step(a, k)  # compiles
        clear()
        for _ in range(1):  # warm
            a, k = fresh()
            step(a, k)
            clear()
        gc.collect()
        a, k = fresh()
        in_bytes = _tensor_bytes([t for t in a if isinstance(t, torch.Tensor) and t.requires_grad])
        out, tr_f = measure_peak(forward_keep, a, k, device=dev.type)
        out_bytes = _tensor_bytes(outs_of(out))
        del out
        a, k = fresh()
        fns, tr_g = measure_peak(forward_graph, a, k, device=dev.type)
        del fns
        a, k = fresh()
        fns, tr_i = measure_peak(forward_graph_own_input, a, k, device=dev.type)
        del fns
        a, k = fresh()
        _, tr_s = measure_peak(step, a, k, device=dev.type)
        clear()
        unsaved = max(0, int(tr_f.final_bytes) - int(tr_g.final_bytes))
        out_saved = unsaved < out_bytes // 2 if out_bytes else True
        in_saved = (int(tr_i.final_bytes) - int(tr_g.final_bytes)) >= in_bytes // 2 if in_bytes else True
        times = []
        for _ in range(max(1, repeats)):
            a, k = fresh()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(a, k)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            clear()
        G = sum(p.numel() * p.element_size() for p in work.parameters() if p.requires_grad)
        B = int(tr_s.peak_bytes) - (0 if out_saved else out_bytes)
        return RegionCost(E=int(tr_f.final_bytes), F=int(tr_f.peak_bytes), B=max(B, int(tr_f.peak_bytes)), G=int(G),
                          t=min(times), out_bytes=int(out_bytes), out_saved=bool(out_saved), kept=int(tr_g.final_bytes),
                          in_bytes=int(in_bytes), in_saved=bool(in_saved))
    finally:
        wrapper.close()
        torch._dynamo.reset()


def measure_plan(model: nn.Module, example_inputs: Sequence[Any], units: Sequence[str], actions: Sequence[str],
                 loss_fn: Optional[Callable[[Any], torch.Tensor]] = None, *, regions: Optional[Sequence[str]] = None,
                 repeats: int = 3, forward: bool = False) -> Dict[str, Any]:
    """The whole step of ``torch.compile(tensorplace.compiled(model, plan))`` measured as the
    benches measure it (:func:`tensorplace.profiler.unplanned_step_stats`: peak with constant
    memory, median step); with ``forward``, also the forward's own peak above the step's start
    (``forward_peak_delta_bytes``)."""
    from .compiled_engine import CompiledPlan
    from .profiler import unplanned_step_stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        wrapper = CompiledPlan(model, plan_dict(units, actions), regions=regions)
    try:
        torch._dynamo.reset()
        step = torch.compile(wrapper)
        stats = unplanned_step_stats(step, tuple(example_inputs), loss_fn=loss_fn, repeats=repeats)
        if forward:  # the forward alone: its peak above the step's start (the output kept)
            from cuda_exec.memory import measure_peak

            dev = next((p.device for p in model.parameters()), torch.device("cpu"))
            model.train()
            with torch.enable_grad():
                out, trace = measure_peak(lambda: step(*example_inputs), device=dev.type)
            del out
            stats["forward_peak_delta_bytes"] = int(trace.peak_bytes)
    finally:
        wrapper.close()
        torch._dynamo.reset()
    for p in model.parameters():
        p.grad = None
    return stats


# --- the model --------------------------------------------------------------------------------------


@dataclass
class _RegionInfo:
    name: str
    units: List[int]  #: global unit indices, in order
    rel: List[str]  #: the units' names inside the region
    cls: Tuple[Any, ...]  #: the region class key
    args: Any
    kwargs: Any
    matmul: List[bool]  #: per unit: runs a matrix product or a convolution


def _region_inputs(model: nn.Module, example_inputs: Sequence[Any], regions: Sequence[str]) -> Dict[str, Tuple[Any, Any]]:
    """The inputs of each region's first call (detached copies; ``requires_grad`` as in the forward)."""
    mods = dict(model.named_modules())
    got: Dict[str, Tuple[Any, Any]] = {}
    handles = []
    for r in regions:
        def hook(m: nn.Module, a: Any, kw: Any, r: str = r) -> None:
            if r not in got:
                got[r] = (_clone_inputs(a), _clone_inputs(kw))

        handles.append(mods[r].register_forward_pre_hook(hook, with_kwargs=True))
    with _probe_forward(model, handles), torch.enable_grad():
        model(*example_inputs)
    return got


def _signature(module: nn.Module, args: Any, kwargs: Any) -> Tuple[Any, ...]:
    structure = tuple((n, type(m).__name__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    inputs = tuple((tuple(t.shape), str(t.dtype), t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)
                   for t in pytree.tree_leaves((args, kwargs)))
    return (type(module).__qualname__, structure, params, buffers, inputs)


class CompiledCostModel:
    """The compiled engine's cost model of one model and input (module docstring). Build it with
    :meth:`measure` (compiles the whole step three times and each region class once per assignment)."""

    def __init__(self, model: nn.Module, example_inputs: Sequence[Any], units: List[str], regions: List[_RegionInfo],
                 loss_fn: Optional[Callable[[Any], torch.Tensor]], repeats: int) -> None:
        self.model = model
        self.example_inputs = tuple(example_inputs)
        self.units = units
        self.regions = regions
        self.loss_fn = loss_fn
        self.repeats = repeats
        #: (region class, assignment) -> RegionCost
        self.costs: Dict[Tuple[Any, Tuple[str, ...]], RegionCost] = {}
        #: whole-step measurements: "retain", "recompute" -> unplanned_step_stats of the plan
        self.calibration: Dict[str, Dict[str, Any]] = {}
        #: whole-step measurements of plans (:meth:`verify`): action tuple -> measured figures
        self.verified: Dict[Tuple[str, ...], Dict[str, Any]] = {}
        self.constant_bytes = 0
        self.k_end = 0
        self.k_fw = 0
        #: the share of a recomputing region's forward transient that overlaps the next region's
        #: backward when both recompute (calibrated on the all-recompute step)
        self.hoist = 0.0
        #: the backward terms' constant by the kind of the region's assignment ("retain": all retained,
        #: "recompute": all recomputed, "mixed": the larger of the two)
        self.k_bw: Dict[str, int] = {}
        self.step_retain = 0.0
        self.measure_time = 0.0

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def measure(cls, model: nn.Module, example_inputs: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                *, regions: Optional[Sequence[str]] = None, units: Any = None, repeats: int = 3,
                options: Sequence[str] = ("retain", "recompute", "save-matmuls")) -> "CompiledCostModel":
        """Measure the cost model of ``torch.compile(tensorplace.compiled(model, plan))`` for plans
        of ``model`` on ``example_inputs`` (module docstring). ``options``: the assignments measured
        per region class up front (others are measured when a plan needs them)."""
        from .compiled_engine import find_regions

        t0 = time.perf_counter()
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        names = unit_sequence(model, args, units)
        region_names = list(regions) if regions is not None else find_regions(model)
        inputs = _region_inputs(model, args, region_names)
        mods = dict(model.named_modules())
        infos: List[_RegionInfo] = []
        taken: set = set()
        for r in region_names:
            idx = [i for i, n in enumerate(names) if (n == r or n.startswith(r + ".")) and i not in taken]
            if not idx or r not in inputs:
                continue
            taken.update(idx)
            rel = [names[i][len(r) + 1:] if names[i] != r else "" for i in idx]
            a, kw = inputs[r]
            matmul = [_is_matmul_unit(mods[names[i]]) for i in idx]
            infos.append(_RegionInfo(r, idx, rel, _signature(mods[r], a, kw), a, kw, matmul))
        if not infos:
            raise PlannerError("the compiled cost model found no checkpoint regions with units in this model; name them "
                               "with regions=[...] (module names of model.named_modules())")
        self = cls(model, args, names, infos, loss_fn, repeats)
        self.region_names = [i.name for i in infos]
        for info in infos:
            for opt in options:
                self.cost(info, self.option(info, opt))
        n = len(names)
        in_region = {u for i in infos for u in i.units}
        all_retain = [RETAIN] * n
        all_recompute = [RECOMPUTE if u in in_region else RETAIN for u in range(n)]
        ret = measure_plan(model, args, names, all_retain, loss_fn, regions=self.region_names, repeats=repeats,
                           forward=True)
        rec = measure_plan(model, args, names, all_recompute, loss_fn, regions=self.region_names, repeats=repeats,
                           forward=True)
        self.calibration = {"retain": _brief(ret), "recompute": _brief(rec)}
        self.verified[tuple(all_retain)] = _brief(ret)
        self.verified[tuple(all_recompute)] = _brief(rec)
        self.constant_bytes = int(ret["constant_bytes"])
        self.step_retain = float(ret["step_time"])
        terms_ret = self._terms(self._assignments(all_retain))
        terms_rec = self._terms(self._assignments(all_recompute))
        self.k_end = int(ret["peak_delta_bytes"]) - terms_ret["end"]
        self.k_fw = max(int(ret["forward_peak_delta_bytes"]) - terms_ret["fw"],
                        int(rec["forward_peak_delta_bytes"]) - terms_rec["fw"])
        k_ret = int(ret["peak_delta_bytes"]) - terms_ret["bw"]
        self.k_bw = {RETAIN: k_ret, RECOMPUTE: 0, "mixed": 0}
        R = len(infos)
        if R >= 2:
            # all retained but the last region: that region's backward (its peak) gives K_bw["recompute"]
            last = [RECOMPUTE if u in set(infos[-1].units) else RETAIN for u in range(n)]
            mix = measure_plan(model, args, names, last, loss_fn, regions=self.region_names, repeats=repeats)
            self.calibration["last-recompute"] = _brief(mix)
            self.verified[tuple(last)] = _brief(mix)
            k_rec = int(mix["peak_delta_bytes"]) - self._terms(self._assignments(last), only=R - 1)["bw"]
        else:
            k_rec = int(rec["peak_delta_bytes"]) - terms_rec["bw"]
        self.k_bw = {RETAIN: k_ret, RECOMPUTE: k_rec, "mixed": max(k_ret, k_rec)}
        # the all-recompute step: the smallest share of the overlap that explains its peak
        costs = terms_rec["costs"]
        base = self._terms(self._assignments(all_recompute), per_region=True)["per_region"]
        need = []
        for r in range(1, R):
            over = max(0, costs[r - 1].F - costs[r - 1].E)
            if over > 0:
                need.append((int(rec["peak_delta_bytes"]) - base[r]) / over)
        self.hoist = 0.0
        if R >= 2 and max(base) < int(rec["peak_delta_bytes"]) and need:
            self.hoist = max(0.0, min(need))
        if R < 2:
            self.k_bw[RECOMPUTE] = self.k_bw["mixed"] = int(rec["peak_delta_bytes"]) - terms_rec["bw"]
        self.measure_time = time.perf_counter() - t0
        return self

    # --- assignments -------------------------------------------------------------------------

    @staticmethod
    def option(info: _RegionInfo, name: str) -> Tuple[str, ...]:
        """The assignment an option names for a region: "retain", "recompute", "save-matmuls"."""
        if name == RETAIN:
            return tuple(RETAIN for _ in info.units)
        if name == RECOMPUTE:
            return tuple(RECOMPUTE for _ in info.units)
        if name == "save-matmuls":
            return tuple(RETAIN if mm else RECOMPUTE for mm in info.matmul)
        raise PlannerError(f"unknown region option {name!r} (retain, recompute, save-matmuls)")

    def cost(self, info: _RegionInfo, assignment: Tuple[str, ...]) -> RegionCost:
        """The measured cost of one region under ``assignment`` (measured now if not yet)."""
        key = (info.cls, tuple(assignment))
        if key not in self.costs:
            self.costs[key] = measure_region(dict(self.model.named_modules())[info.name], info.rel, assignment,
                                             info.args, info.kwargs, repeats=self.repeats)
        return self.costs[key]

    def _assignments(self, actions: Sequence[str]) -> List[Tuple[str, ...]]:
        if len(actions) != len(self.units):
            raise PlannerError(f"the plan has {len(actions)} actions; this model has {len(self.units)} units "
                               "(the plan was made for another model or input)")
        # swap runs as retain on this engine (no torch lowers compiled CPU offload)
        return [tuple(RECOMPUTE if actions[u] == RECOMPUTE else RETAIN for u in info.units) for info in self.regions]

    @staticmethod
    def kind(assignment: Sequence[str]) -> str:
        """"retain" (all retained), "recompute" (all recomputed) or "mixed"."""
        kinds = set(assignment)
        return RETAIN if kinds <= {RETAIN} else RECOMPUTE if kinds == {RECOMPUTE} else "mixed"

    def _terms(self, assignments: Sequence[Tuple[str, ...]], only: Optional[int] = None,
               per_region: bool = False) -> Dict[str, Any]:
        """The phase terms of the peak without ``K_end`` (module docstring); the backward terms with
        their constant (none while it is being calibrated)."""
        costs = [self.cost(info, a) for info, a in zip(self.regions, assignments)]
        n = len(costs)
        # what each region's forward leaves allocated in the chain: its saved values, and its output
        # when it saves it or the next region saves its input (the last region's output: kept, the
        # head reads it)
        keeps = [c.out_saved or r == n - 1 or costs[r + 1].in_saved for r, c in enumerate(costs)]
        persist = [c.kept + (c.out_bytes if keeps[r] and not c.out_saved else 0) for r, c in enumerate(costs)]
        g_after = [0] * n
        acc = 0
        for r in range(n - 1, -1, -1):
            g_after[r] = acc
            acc += costs[r].G
        before = 0
        fw = bw = bw_at = 0
        terms: List[int] = []
        for r, c in enumerate(costs):
            own_input = costs[r - 1].out_bytes if r > 0 and not keeps[r - 1] else 0  # the input, alive while it runs
            fw = max(fw, before + own_input + c.F)
            term = before + g_after[r] + c.B + self.k_bw.get(self.kind(assignments[r]), 0)
            if r > 0 and self.kind(assignments[r]) != RETAIN and self.kind(assignments[r - 1]) != RETAIN:
                # two recomputing regions in a row: the whole graph's schedule recomputes the region
                # before while this one's backward runs (a share `hoist` of its forward's transient)
                term += int(self.hoist * max(0, costs[r - 1].F - costs[r - 1].E))
            terms.append(term)
            if (only is None or r == only) and term > bw:
                bw, bw_at = term, r
            before += persist[r]
        return {"fw": fw, "end": before, "bw": bw, "bw_region": bw_at,
                "time": sum(c.t for c in costs), "costs": costs, "per_region": terms}

    # --- predictions -------------------------------------------------------------------------

    def predict(self, plan: Any) -> Dict[str, Any]:
        """This engine's predicted peak (with constant memory) and step time of ``plan`` (a Plan,
        its dict, or a list of actions, one per unit)."""
        actions = _actions_of(plan)
        assignments = self._assignments(actions)
        terms = self._terms(assignments)
        retain = self._terms([tuple(RETAIN for _ in info.units) for info in self.regions])
        phases = {"forward": self.k_fw + terms["fw"], "end of forward": self.k_end + terms["end"],
                  f"backward of {self.regions[terms['bw_region']].name}": terms["bw"]}
        stage = max(phases, key=lambda k: phases[k])
        delta = phases[stage]
        # a region's recomputation adds its measured extra time, never less than none (on a CPU a
        # recomputing region alone can measure as fast as a retaining one)
        extra = sum(max(0.0, c.t - r.t) for c, r in zip(terms["costs"], retain["costs"]))
        return {"peak_bytes": int(self.constant_bytes + delta), "peak_delta_bytes": int(delta), "peak_stage": stage,
                "step_time": float(self.step_retain + extra), "engine": "compiled",
                "recomputed_units": sum(1 for a in actions if a == RECOMPUTE)}

    def lower_bound(self, options: Sequence[str] = ("retain", "recompute", "save-matmuls")) -> int:
        """The smallest predicted peak of this engine's plans made of ``options`` per region (not
        always every region recomputed: two recomputing regions in a row overlap)."""
        per_region = self._choices(options)
        total = 1
        for opts in per_region:
            total *= len(opts)
        if total > 200_000:
            return self.predict([RECOMPUTE] * len(self.units))["peak_bytes"]
        return min(self.predict(self._actions(c))["peak_bytes"] for c in itertools.product(*per_region))

    def _choices(self, options: Sequence[str]) -> List[List[Tuple[str, ...]]]:
        per_region: List[List[Tuple[str, ...]]] = []
        for info in self.regions:
            seen: List[Tuple[str, ...]] = []
            for o in options:
                a = self.option(info, o)
                if a not in seen:
                    seen.append(a)
            per_region.append(seen)
        return per_region

    def _actions(self, choice: Sequence[Tuple[str, ...]]) -> List[str]:
        acts = [RETAIN] * len(self.units)
        for info, a in zip(self.regions, choice):
            for u, x in zip(info.units, a):
                acts[u] = x
        return acts

    def to_dict(self) -> Dict[str, Any]:
        return {
            "units": list(self.units), "regions": [i.name for i in self.regions], "constant_bytes": self.constant_bytes,
            "k_fw": self.k_fw, "k_end": self.k_end, "k_bw": self.k_bw, "hoist": self.hoist, "step_retain": self.step_retain, "calibration": self.calibration,
            "costs": [{"class": str(hash(k[0])), "assignment": list(k[1]), **v.to_dict()} for k, v in self.costs.items()],
            "measure_time": self.measure_time,
        }

    def verify(self, plan: Any) -> Dict[str, Any]:
        """Compile ``plan`` on the whole model and measure it (cached per action list): the
        measured peak (with constant memory), peak above the step's start and median step."""
        actions = tuple(_actions_of(plan))
        if actions not in self.verified:
            stats = measure_plan(self.model, self.example_inputs, self.units, list(actions), self.loss_fn,
                                 regions=[i.name for i in self.regions], repeats=self.repeats)
            self.verified[actions] = _brief(stats)
        return dict(self.verified[actions])

    # --- search ------------------------------------------------------------------------------

    def search(self, budget: int, options: Sequence[str] = ("retain", "recompute", "save-matmuls"),
               exhaustive_limit: int = 200_000) -> Tuple[List[str], Dict[str, Any]]:
        """One option per region: the smallest predicted step whose predicted peak is at most
        ``budget`` (exhaustive over the options when there are at most ``exhaustive_limit``
        combinations, else greedy from all retained). Raises BudgetError when none fits."""
        per_region = self._choices(options)
        actions_of = self._actions
        total = 1
        for opts in per_region:
            total *= len(opts)
        best: Optional[Tuple[float, int, List[Tuple[str, ...]]]] = None
        if total <= exhaustive_limit:
            for choice in itertools.product(*per_region):
                p = self.predict(actions_of(choice))
                if p["peak_bytes"] <= budget:
                    key = (p["step_time"], p["recomputed_units"])  # equal times: the fewer recomputed units
                    if best is None or key < best[:2]:
                        best = (p["step_time"], p["recomputed_units"], list(choice))
        else:
            choice = [opts[0] for opts in per_region]
            while True:
                p = self.predict(actions_of(choice))
                if p["peak_bytes"] <= budget:
                    best = (p["step_time"], p["recomputed_units"], choice)
                    break
                cand = None
                for r, opts in enumerate(per_region):
                    for a in opts:
                        if a == choice[r]:
                            continue
                        trial = list(choice)
                        trial[r] = a
                        q = self.predict(actions_of(trial))
                        gain = p["peak_bytes"] - q["peak_bytes"]
                        if gain <= 0:
                            continue
                        score = gain / max(q["step_time"] - p["step_time"], 1e-9)
                        if cand is None or score > cand[0]:
                            cand = (score, trial)
                if cand is None:
                    break
                choice = cand[1]
        if best is None:
            low = self.lower_bound(options)
            raise BudgetError(
                f"no plan of the compiled engine fits {budget} bytes: its smallest predicted peak is {low} bytes "
                "(every region recomputed); use a larger budget, or the eager executor (tensorplace.plan), which also "
                "swaps")
        acts = actions_of(best[2])
        return acts, self.predict(acts)


def _brief(stats: Dict[str, Any]) -> Dict[str, Any]:
    return {k: stats[k] for k in ("peak_bytes", "peak_delta_bytes", "constant_bytes", "step_time")}


def _actions_of(plan: Any) -> List[str]:
    from .planning import Plan

    if isinstance(plan, Plan):
        return plan.actions
    if isinstance(plan, dict):
        return list(plan["actions"])
    return list(plan)


def plan_compiled(model: nn.Module, example_inputs: Any, budget: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                  *, cost_model: Optional[CompiledCostModel] = None, regions: Optional[Sequence[str]] = None,
                  repeats: int = 3, options: Sequence[str] = ("retain", "recompute", "save-matmuls"),
                  verify: bool = True, tries: int = 3) -> Any:
    """A plan for the compiled engine (``torch.compile(tensorplace.compiled(model, plan))``) at
    ``budget`` (bytes or a string such as "200MiB"; the peak with constant memory, as
    :func:`tensorplace.plan`'s), searched with this engine's own cost model
    (:class:`CompiledCostModel`; pass ``cost_model`` to reuse one: measuring it compiles the model
    three times and each region class once per option).

    ``verify`` (default): the plan the model picks is compiled on the whole model and measured
    (:meth:`CompiledCostModel.verify`, one compile); if its measured peak exceeds the budget the
    search is repeated with the model's budget below that plan's estimate by the excess (``tries``
    plans in all; then the fastest by the estimate of the plans measured so far that fit, the
    calibration plans among them, else BudgetError), and if the model over-predicted, once with the
    model's budget raised by the over-prediction (kept if its measured peak fits). The plan's ``predicted`` peak and step are
    then the measured ones of its compiled step; without ``verify`` they are the model's.
    ``plan.to_dict()["compiled_prediction"]`` has both (``model_peak_bytes``, ``peak_stage``,
    ``verified``)."""
    from .budget import parse_budget
    from .planning import Plan

    b = int(parse_budget(budget))  # refuses a budget that is not a positive number of bytes
    cm = cost_model or CompiledCostModel.measure(model, example_inputs, loss_fn, regions=regions, repeats=repeats,
                                                 options=options)
    actions, pred = cm.search(b, options)
    result = dict(pred, model_peak_bytes=pred["peak_bytes"], model_step_time=pred["step_time"], verified=False)
    if verify:
        m = cm.verify(actions)
        target = b
        left = max(1, int(tries))
        while m["peak_bytes"] > b and left > 1:
            left -= 1
            # below this plan's estimate by its excess: the next search cannot pick it again
            target = min(target, pred["peak_bytes"] - (m["peak_bytes"] - b) - 1)
            try:
                actions, pred = cm.search(target, options)
            except BudgetError:
                break
            m = cm.verify(actions)
        if m["peak_bytes"] > b:
            # the plans measured so far (the calibration plans among them) that fit: the fastest
            # by the estimate, of equal ones the one with the fewest recomputed units
            fits = [list(k) for k, v in cm.verified.items() if v["peak_bytes"] <= b]
            if not fits:
                raise BudgetError(
                    f"the compiled engine's plans the cost model fits in {b} bytes measured above it (last: "
                    f"{m['peak_bytes']} bytes); use a larger budget")
            actions = min(fits, key=lambda a: (cm.predict(a)["step_time"], sum(x == RECOMPUTE for x in a)))
            pred = cm.predict(actions)
            m = cm.verify(actions)
            target = pred["peak_bytes"]
        if pred["peak_bytes"] > m["peak_bytes"]:  # the model over-predicted: one looser try
            try:
                looser, pred2 = cm.search(target + pred["peak_bytes"] - m["peak_bytes"], options)
            except BudgetError:
                looser = actions
            if looser != actions:
                m2 = cm.verify(looser)
                if m2["peak_bytes"] <= b:
                    actions, pred, m = looser, pred2, m2
        result = dict(pred, model_peak_bytes=pred["peak_bytes"], model_step_time=pred["step_time"], verified=True,
                      peak_bytes=m["peak_bytes"], peak_delta_bytes=m["peak_delta_bytes"], step_time=m["step_time"])
    data = plan_dict(cm.units, actions, budget=b, method="compiled-search", peak=result["peak_bytes"],
                     step=result["step_time"], compiled_regions=[i.name for i in cm.regions],
                     compiled_prediction=result)
    return Plan(data)
