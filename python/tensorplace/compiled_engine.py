"""The compiled engine: a plan executed by torch's own selective activation checkpointing.

``tensorplace.compiled(model, plan)`` returns a module that trains ``model`` under ``plan`` and
that ``torch.compile`` compiles as usual (it also runs eagerly, to check a plan without
compiling). Each *region* (by default every repeated block of the model: ResNet's BasicBlocks, a
GPT's Blocks; ``regions=[...]`` names others) runs under ``torch.utils.checkpoint(...,
use_reentrant=False, context_fn=...)`` with a selective-checkpointing policy that gives every op
of the region the action of its unit (a unit is one call of a leaf module, as in the eager
executor; an op between modules, "glue", belongs to the unit that ran last, or to the region's
first unit when none has yet):

* retain -> ``CheckpointPolicy.MUST_SAVE``; recompute -> ``CheckpointPolicy.MUST_RECOMPUTE``;
* swap -> ``MUST_CPU_OFFLOAD``, compiled (:func:`compiled_offload_supported`): torch's
  partitioner saves an offload-tagged op like a saved one (every torch up to 2.15), so the wrapper
  installs a joint-graph pass (inductor's ``joint_custom_pre_pass``) that marks those ops
  ``should_offload`` and turns on torch's activation-offloading pass
  (``torch._functorch.config.enable_activation_offloading``), which copies each such saved value
  to the host after its last forward use and back before its first backward use (torch skips
  views, non-contiguous values and the model's outputs: those stay saved on the device). The
  copies run on the compute stream; ``offload_stream=True`` puts them on a stream of their own
  with prefetched reloads (torch's flags for it), which torch 2.11 fails to compile on CUDA
  (``streams.record_stream``: "missing 1 required positional argument: 'to_dealloc'", measured
  on an H200). Eagerly (torch's eager selective checkpointing has no offload) a swap runs as
  retain; where the torch lacks that pass it does so compiled too, with a warning, and
  ``wrapper.swaps_as_retain`` lists those units;
* ops that cannot be recomputed safely are saved whatever their unit's action: random ops
  (dropout: torch's compiled recompute would need a functionalised generator) and collectives.

Units outside every region run as in the unplanned step (torch's partitioner decides what their
compiled code saves); a plan that recomputes such a unit runs it as retained, with a warning
(``wrapper.outside_regions`` lists them).

Compiled (``torch.compile``): the policy tags the traced ops (their ``nn_module_stack`` gives the
unit) and torch's partitioner saves what MUST_SAVE names and recomputes the rest in the backward,
op by op; region boundaries are saved (its ``cleanup_recompute_tags``). In-place ops are
functionalised first, so they follow their unit's action.

Eager (no compile): torch's eager selective checkpointing, which caches the saved ops' outputs and
re-runs the region for the others. Eagerly, an op's cached output must not be changed by a later
in-place op of the region (the recomputed readers would see the changed value), and an op that
writes into memory from outside the region (BatchNorm's running statistics) must not run twice.
So the first call of each region (per input shapes, train/eval modes of its modules and autocast
state) runs as the model's own forward, outside torch's checkpoint (correct for any model: nothing
is re-run), and records the region's ops; later calls use the plan with these corrections: an op
that writes outside the region is saved; an op and the in-place ops that modify its output are one
group, saved if any of them is saved, else recomputed; a saved group's outputs that were read
before their last modification make those readers saved too. Eager runs are bitwise equal to the
unplanned eager step (losses, gradients, BatchNorm statistics).

Not yet: the plan's predicted peak and step are the eager executor's cost model, not this
engine's (torch's partitioner works per op and fuses; docs/compiled.md).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cuda_exec.compile_guard import refuse_compile
from cuda_exec.errors import CompiledPathError

from ._core import PlannerError

__all__ = [
    "CompiledPlan",
    "CompiledPathError",
    "compiled",
    "compiled_offload_supported",
    "find_regions",
    "refuse_compile",
]

RETAIN, SWAP, RECOMPUTE = "retain", "swap", "recompute"


def compiled_offload_supported() -> bool:
    """Whether swaps can be lowered to torch's compiled CPU offload with this torch: it has the
    activation-offloading pass its partitioner runs on values marked ``should_offload``
    (``torch._functorch.config.enable_activation_offloading``, torch 2.11 on) and inductor's
    joint-graph pass hook, through which the wrapper marks the ops its policy tags
    ``MUST_CPU_OFFLOAD``."""
    policy = getattr(torch.utils.checkpoint, "CheckpointPolicy", None)
    if policy is None or not hasattr(policy, "MUST_CPU_OFFLOAD"):
        return False
    try:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        from torch._functorch import partitioners
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError:
        return False
    return (hasattr(functorch_config, "enable_activation_offloading")
            and hasattr(inductor_config, "joint_custom_pre_pass")
            and "enable_activation_offloading" in _source(partitioners))


def _tracing() -> bool:
    """Whether torch is tracing for its compiled path: dynamo (``torch.compiler.is_compiling``), or
    a run on fake tensors or AOTAutograd's tracing, during which torch asks the
    selective-checkpointing policy (torch up to 2.13 leaves ``is_compiling`` False there)."""
    return (torch.compiler.is_compiling() or _proxy_tracing()
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


def _proxy_tracing() -> bool:
    """Whether AOTAutograd is tracing the graph: the policy's answers become the ops' tags."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _source(module: Any) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def _mark_offloads(graph: Any) -> int:
    """The joint-graph pass: every op the policy tagged MUST_CPU_OFFLOAD is saved (torch's
    partitioner would save it anyway) and marked for torch's activation-offloading pass.
    Returns how many ops it marked."""
    P = torch.utils.checkpoint.CheckpointPolicy
    marked = 0
    for node in graph.nodes:
        if node.meta.get("recompute") in (P.MUST_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD):
            node.meta["recompute"] = P.MUST_SAVE
            node.meta["should_offload"] = True
            marked += 1
    return marked


class _OffloadSettings:
    """torch's compiled-offload settings while a wrapper with swaps lives: the joint-graph pass
    (chained after one the user had) and the functorch flags; :meth:`restore` puts back what was
    there. Several wrappers share one installation (reference count)."""

    users = 0
    saved: Dict[str, Any] = {}

    @classmethod
    def install(cls, stream: bool) -> None:
        import torch._functorch.config as fc
        import torch._inductor.config as ic
        from torch._inductor.custom_graph_pass import CustomGraphPass

        if cls.users == 0:
            cls.saved = {"joint_custom_pre_pass": ic.joint_custom_pre_pass,
                         **{k: getattr(fc, k) for k in _OFFLOAD_FLAGS if hasattr(fc, k)}}
            previous = ic.joint_custom_pre_pass

            class MarkOffloads(CustomGraphPass):
                def __call__(self, graph: Any) -> None:
                    if previous is not None:
                        previous(graph)
                    _mark_offloads(graph)

                def uuid(self) -> Any:
                    inner = previous.uuid() if previous is not None and hasattr(previous, "uuid") else None
                    return ("tensorplace.compiled_engine.mark_offloads", 1, inner)

            ic.joint_custom_pre_pass = MarkOffloads()
        cls.users += 1
        fc.enable_activation_offloading = True
        if stream:  # a stream of its own and prefetched reloads (CPU tensors: no streams)
            for k in _OFFLOAD_FLAGS[1:]:
                if hasattr(fc, k):
                    setattr(fc, k, True)

    @classmethod
    def restore(cls) -> None:
        import torch._functorch.config as fc
        import torch._inductor.config as ic

        cls.users -= 1
        if cls.users == 0:
            ic.joint_custom_pre_pass = cls.saved.pop("joint_custom_pre_pass")
            for k, v in cls.saved.items():
                setattr(fc, k, v)
            cls.saved = {}


_OFFLOAD_FLAGS = ("enable_activation_offloading", "activation_offload_separate_stream",
                  "activation_offload_sink_wait", "activation_reload_prefetch")


# --- regions and units --------------------------------------------------------------------------


def find_regions(model: nn.Module) -> List[str]:
    """Qualified names of the model's repeated blocks, in registration order: children of the same
    class that appear at least twice in an ``nn.ModuleList`` or ``nn.Sequential``, have parameters
    and submodules (ResNet's BasicBlocks, a GPT's Blocks); the outermost such blocks."""
    found: List[str] = []

    def walk(m: nn.Module, name: str) -> None:
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = list(m.named_children())
            counts: Dict[type, int] = {}
            for _, c in kids:
                counts[type(c)] = counts.get(type(c), 0) + 1
            rep = {n for n, c in kids if counts[type(c)] >= 2 and any(True for _ in c.parameters())
                   and any(True for _ in c.children())}
            if rep:
                for n, c in kids:
                    full = f"{name}.{n}" if name else n
                    if n in rep:
                        found.append(full)
                    else:
                        walk(c, full)
                return
        for n, c in m.named_children():
            walk(c, f"{name}.{n}" if name else n)

    walk(model, "")
    return found


def module_name(unit: str) -> str:
    """The module a unit is a call of: ``layer1.0.relu#1`` (the profiler's name of a module's
    second call in one forward) is a call of ``layer1.0.relu``."""
    return unit.split("#", 1)[0]


def _unit_modules(model: nn.Module, unit_names: Sequence[str]) -> Dict[str, nn.Module]:
    """Unit name -> the module it is a call of."""
    modules = dict(model.named_modules())
    modules.setdefault("(root)", model)
    missing = sorted({n for n in unit_names if module_name(n) not in modules})
    if missing:
        raise PlannerError(
            f"the plan's units {missing[:3]} are not modules of this model: the plan was made for another model "
            "(re-plan this model with tensorplace.plan)"
        )
    return {n: modules[module_name(n)] for n in unit_names}


def _inside(name: str, region: str) -> bool:
    return region == "" or name == region or name.startswith(region + ".")


@dataclass
class Region:
    """One checkpoint region: a module whose calls run under torch's checkpoint."""

    name: str
    module: nn.Module
    #: global unit indices of the region's units, in order
    units: List[int]
    #: (unit module name, occurrence within one call of the region) -> global unit index
    index: Dict[Tuple[str, int], int] = field(default_factory=dict)
    #: the module and its submodules (their train/eval modes select the ops a call runs)
    modules: List[nn.Module] = field(default_factory=list)
    #: every unit retained: run eagerly as the model's own forward (no checkpoint)
    retained: bool = False


_STACK_PART = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]?([^'\"\]]+)['\"]?\]")


def normalize_stack_path(path: str) -> str:
    """A dynamo ``nn_module_stack`` path (``L['self'].model.layer1[0]._modules['conv1']``) as a
    dotted module path relative to the compiled root (``model.layer1.0.conv1``)."""
    path = re.sub(r"^[A-Za-z_]+\[['\"][^'\"]*['\"]\]", "", path)
    path = re.sub(r"\.forward\.__closure__\[\d+\]\.cell_contents\.__self__", "", path)
    path = _STACK_PART.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.lstrip(".")


# --- the eager corrections ----------------------------------------------------------------------


def _sac_ignored() -> Set[Any]:
    ignored = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", None)
    return set(ignored) if ignored is not None else {torch.ops.aten.detach.default}


def _storages(obj: Any) -> List[Any]:
    out = []
    for t in pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor):
            out.append(t.untyped_storage())
    return out


def _written_args(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, a in enumerate(schema.arguments):
        alias = a.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        written.append(value)
    return written


@dataclass
class _OpRecord:
    func: Any
    reads: List[int]
    writes: List[int]
    outs: List[int]
    unit: Optional[int] = None


class _Recorder(TorchDispatchMode):
    """Records the ops of one eager region call: what each reads, writes in place and produces
    (storages numbered in order of appearance; the recorder holds them until the call ends, so an
    address is never reused within it)."""

    def __init__(self, current_unit: Callable[[], Optional[int]], buffers: Set[int]) -> None:
        super().__init__()
        self.current_unit = current_unit
        self.buffers = buffers
        self.ops: List[_OpRecord] = []
        self._ids: Dict[int, int] = {}
        self._keep: List[Any] = []
        self._ignored = _sac_ignored()

    def _id(self, storage: Any) -> int:
        key = storage._cdata
        if key not in self._ids:
            self._ids[key] = len(self._ids)
            self._keep.append(storage)
        return self._ids[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._ignored:
            return func(*args, **kwargs)
        reads = [self._id(s) for s in _storages((args, kwargs))]
        writes = [self._id(s) for s in _storages(_written_args(func, args, kwargs))]
        # Some kernels write buffers their schema does not mark (native_batch_norm's running
        # statistics): a buffer the op reads is compared before and after it.
        before = [(t, t.detach().clone()) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.buffers]
        out = func(*args, **kwargs)
        for t, old in before:
            if not _same_bits(t, old):
                writes.append(self._id(t.untyped_storage()))
        outs = [self._id(s) for s in _storages(out)]
        self.ops.append(_OpRecord(func, reads, writes, outs, self.current_unit()))
        return out

    def release(self) -> None:
        self._keep.clear()
        self._ids.clear()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a, b)) and not bool(torch.isnan(a).any())
    return bool(torch.equal(a, b))


def _autocast_state() -> Tuple[Any, ...]:
    """Autocast on the CPU and CUDA, and their dtypes."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def _is_random(func: Any) -> bool:
    tags = getattr(func, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _is_collective(func: Any) -> bool:
    ns = getattr(func, "namespace", "")
    return ns in ("_c10d_functional", "c10d", "c10d_functional", "_dtensor")


def eager_saves(ops: Sequence[_OpRecord], wants_save: Sequence[bool]) -> List[bool]:
    """Which ops of an eager region call are saved: ``wants_save`` (the plan's action per op,
    random ops included) corrected so that eager selective checkpointing gives the unplanned
    step's values (module docstring): writes outside the region -> saved; an op and the in-place
    ops that modify its output form a group saved if any member is; a saved group's value read
    before its last modification makes the reader saved (repeated until nothing changes)."""
    n = len(ops)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer: Dict[int, int] = {}
    writers: Dict[int, List[int]] = {}  # storage -> ops that wrote it in place
    forced = [False] * n
    for i, op in enumerate(ops):
        for s in op.writes:
            if s in producer:
                parent[find(i)] = find(producer[s])
                writers.setdefault(s, []).append(i)
            else:
                forced[i] = True  # writes memory from outside the region (a buffer, an input)
        for s in op.outs:
            producer.setdefault(s, i)
    save_group: Dict[int, bool] = {}
    for i in range(n):
        r = find(i)
        save_group[r] = save_group.get(r, False) or forced[i] or wants_save[i]
    saved = [save_group[find(i)] for i in range(n)]
    changed = True
    while changed:
        changed = False
        for s, ws in writers.items():
            p = producer[s]
            if not saved[p]:
                continue
            last = max(ws)
            for k in range(p + 1, last):
                if saved[k] or s not in ops[k].reads:
                    continue
                r = find(k)
                for j in range(n):
                    if find(j) == r and not saved[j]:
                        saved[j] = True
                changed = True
    return saved


# --- the policy -------------------------------------------------------------------------------


class _RegionCall:
    """The policy of one call of one region (torch calls ``context_fn`` once per checkpoint call)."""

    def __init__(self, engine: "CompiledPlan", region: Region) -> None:
        self.engine = engine
        self.region = region
        self.last: Optional[int] = None
        self.occurrence: Dict[str, int] = {}
        self.prev_path: Optional[str] = None
        #: ops the policy was asked about in the forward, and in the backward's recompute (torch
        #: up to 2.13 asks again there and needs the same answer; later versions keep the forward's)
        self.count = [0, 0]
        self.table: Optional[List[bool]] = None
        self.funcs: List[Any] = []
        self.learning = False

    def unit_compiled(self) -> Optional[int]:
        from torch.fx import traceback as fx_traceback

        meta = getattr(fx_traceback, "current_meta", None) or {}
        p = self.engine.stack_unit(meta.get("nn_module_stack"))
        path = p if p is not None and _inside(p, self.region.name) else None
        if path is None:
            self.prev_path = None
            return self.last
        if path != self.prev_path:
            self.occurrence[path] = self.occurrence.get(path, -1) + 1
            self.prev_path = path
        u = self.region.index.get((path, self.occurrence[path]))
        if u is None:
            raise PlannerError(
                f"region {self.region.name!r}: call {self.occurrence[path] + 1} of unit module {path!r} is not among "
                "the plan's units; the plan was made for another forward (re-plan this model)")
        self.last = u
        return u

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        P = torch.utils.checkpoint.CheckpointPolicy
        if _tracing():
            u = self.unit_compiled()
            if u is None:
                u = self.region.units[0]
            policy = self.engine.op_policy(u, func)
            if _proxy_tracing():
                self.engine.traced_policies[policy.name] = self.engine.traced_policies.get(policy.name, 0) + 1
            return policy
        # eager
        phase = 1 if getattr(ctx, "is_recompute", False) else 0
        i = self.count[phase]
        self.count[phase] += 1
        if self.learning or self.table is None:
            return P.MUST_SAVE
        if i >= len(self.table) or self.funcs[i] is not func:
            raise PlannerError(
                f"region {self.region.name!r} ran another sequence of ops than in its first call with these input "
                f"shapes, train/eval modes and autocast state (op {i}: {func}): the eager compiled engine needs the "
                "same ops at every such call (data-dependent control flow in the region, or autocast's weight cache "
                "reused by a second forward in one autocast block: torch.autocast(..., cache_enabled=False)); run "
                "such steps through the eager executor (tensorplace.run) or torch.compile the wrapper")
        return P.MUST_SAVE if self.table[i] else P.MUST_RECOMPUTE


class CompiledPlan(nn.Module):
    """``model`` training under ``plan`` through torch's selective activation checkpointing
    (module docstring); ``torch.compile`` it as any module. It shares ``model``'s parameters;
    its regions' ``forward`` is replaced on the model itself until :meth:`close`.

    ``plan``: a :class:`tensorplace.Plan` (or its dict, or a path), one action per unit (unit
    names as in the plan's ``units``: one entry per call of a unit module, in forward order).
    ``regions``: module names to run under checkpoint (default: the plan's recorded regions,
    else :func:`find_regions`). ``offload_stream``: compiled swaps copy on a CUDA stream of
    their own (torch's experimental flags; default False: on the compute stream)."""

    def __init__(self, model: nn.Module, plan: Any, *, regions: Optional[Sequence[str]] = None,
                 offload_stream: bool = False) -> None:
        super().__init__()
        from .planning import Plan

        refuse_wrapped(model, "tensorplace.compiled")
        if not isinstance(plan, (Plan, dict, str, os.PathLike)):
            raise TypeError(f"plan must be a tensorplace.Plan, its dict or the path of a plan file, not "
                            f"{type(plan).__name__}")
        if not isinstance(plan, Plan):
            plan = Plan(plan) if isinstance(plan, dict) else Plan.load(plan)
        data = plan.to_dict()
        self.model = model
        self.plan = plan
        self.unit_names: List[str] = list(plan.units)
        actions = list(plan.actions)
        modules = _unit_modules(model, self.unit_names)
        #: the unit modules' names (a unit is one call of one: ``name`` or ``name#k``)
        self._unit_paths: Set[str] = {module_name(n) for n in self.unit_names}
        self._unit_of_id: Dict[str, str] = {str(id(m)): module_name(n) for n, m in modules.items()}
        self._path_cache: Dict[str, Optional[str]] = {}
        names = list(regions) if regions is not None else list(data.get("compiled_regions") or find_regions(model))
        all_modules = dict(model.named_modules())
        bad = [r for r in names if r not in all_modules]
        if bad:
            raise PlannerError(f"regions {bad[:3]} are not modules of this model; name modules of "
                               f"model.named_modules() (e.g. {find_regions(model)[:2]})")
        self.regions: List[Region] = []
        for r in names:
            units = [i for i, n in enumerate(self.unit_names) if _inside(module_name(n), r)]
            if not units:
                continue
            reg = Region(r, all_modules[r], units, modules=list(all_modules[r].modules()))
            seen: Dict[str, int] = {}
            for i in units:
                name = module_name(self.unit_names[i])
                k = seen.get(name, 0)
                seen[name] = k + 1
                reg.index[(name, k)] = i
            self.regions.append(reg)
        in_region = {i for reg in self.regions for i in reg.units}
        offload = compiled_offload_supported()
        swapped = [i for i, a in enumerate(actions) if a == SWAP and (i in in_region or not offload)]
        #: units a plan swaps that run as retain (this torch has no compiled CPU offload)
        self.swaps_as_retain: List[str] = [] if offload else [self.unit_names[i] for i in swapped]
        #: units a plan recomputes or swaps outside every region (run as retained)
        self.outside_regions: List[str] = [self.unit_names[i] for i, a in enumerate(actions)
                                           if a != RETAIN and i not in in_region]
        self.actions = [RETAIN if (a == SWAP and not offload) or i not in in_region else a
                        for i, a in enumerate(actions)]
        for reg in self.regions:
            reg.retained = all(self.actions[i] != RECOMPUTE for i in reg.units)
        self._offload = offload
        #: how many traced ops the policy tagged with each CheckpointPolicy (name: count), over
        #: every compilation of this wrapper
        self.traced_policies: Dict[str, int] = {}
        #: whether this wrapper turned on torch's compiled offload (until :meth:`close`)
        self.offloads = bool(offload and swapped)
        if self.offloads:
            on_cuda = any(p.is_cuda for p in model.parameters())
            _OffloadSettings.install(stream=bool(offload_stream) and on_cuda)
        if self.swaps_as_retain:
            warnings.warn(
                f"tensorplace.compiled: this torch ({torch.__version__}) does not lower CPU offload in its compiled "
                f"path, so the plan's {len(self.swaps_as_retain)} swapped units run as retained (more memory than the "
                "plan predicts); for this engine plan with retain and recompute only: tensorplace.plan(..., "
                "swaps=False)",
                RuntimeWarning, stacklevel=2)
        if self.outside_regions:
            warnings.warn(
                f"tensorplace.compiled: {len(self.outside_regions)} recomputed or swapped units are outside the checkpoint "
                f"regions ({', '.join(self.outside_regions[:3])}...) and run as retained (more memory than the plan "
                "predicts); name the regions to checkpoint with regions=[...]", RuntimeWarning, stacklevel=2)
        # eager bookkeeping: the unit running now (forward pre-hooks), the learned corrections
        self._unit_of_module: Dict[int, List[int]] = {}
        for i, n in enumerate(self.unit_names):
            self._unit_of_module.setdefault(id(modules[n]), []).append(i)
        self._calls: Dict[str, int] = {}
        self._invocations = 0
        self._current_unit: Optional[int] = None
        self._in_forward = False
        self._pending_key: Any = None
        self._warned_eager_checkpoint = False
        self._tables: Dict[Tuple[str, int, Any], List[bool]] = {}
        self._funcs: Dict[Tuple[str, int, Any], List[Any]] = {}
        self._handles: List[Any] = []
        self._originals: List[Tuple[nn.Module, Any]] = []
        self._install(modules)

    # --- set-up ------------------------------------------------------------------------------

    def stack_unit(self, stack: Any) -> Optional[str]:
        """The innermost unit module of a dynamo ``nn_module_stack`` (its keys are the modules'
        ids; their paths are a fallback), or None."""
        if not stack:
            return None
        for key, value in reversed(list(stack.items())):
            name = self._unit_of_id.get(str(key))
            if name is None:
                name = self.unit_path(normalize_stack_path(value[0] if isinstance(value, tuple) else str(value)))
            if name is not None:
                return name
        return None

    def unit_path(self, path: str) -> Optional[str]:
        """The unit module name a normalized ``nn_module_stack`` path names (the compiled root may
        be this wrapper, the model, or torch's OptimizedModule around either), or None."""
        if path in self._path_cache:
            return self._path_cache[path]
        parts = path.split(".") if path else []
        found = None
        for k in range(0, min(3, len(parts)) + 1):
            cand = ".".join(parts[k:])
            if cand in self._unit_paths:
                found = cand
                break
        self._path_cache[path] = found
        return found

    def _install(self, modules: Dict[str, nn.Module]) -> None:
        for reg in self.regions:
            original = reg.module.forward
            reg.module.forward = self._region_forward(reg, original)  # type: ignore[method-assign]
            self._originals.append((reg.module, original))
        # the model's own hooks (not this wrapper's forward) start and end a forward: the regions'
        # forward is replaced on the model, which the user may go on calling directly
        self._handles.append(self.model.register_forward_pre_hook(self._forward_starts))
        self._handles.append(self.model.register_forward_hook(self._forward_ends, always_call=True))
        done: Set[int] = set()
        for m in modules.values():
            if id(m) not in done:
                done.add(id(m))
                self._handles.append(m.register_forward_pre_hook(self._pre_hook))

    def _region_forward(self, reg: Region, original: Callable[..., Any]) -> Callable[..., Any]:
        engine = self

        def context_fn() -> Any:
            call = _RegionCall(engine, reg)
            if not _tracing():
                engine._eager_call_begins(reg, call)
            return torch.utils.checkpoint.create_selective_checkpoint_contexts(call, allow_cache_entry_mutation=True)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (reg.module.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            if _tracing():
                return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, context_fn=context_fn,
                                                         **kwargs)
            return engine._eager_region(reg, original, context_fn, args, kwargs)

        forward._tensorplace_region = True  # type: ignore[attr-defined]  # (wrapped_regions)
        return forward

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if _tracing() or not self._in_forward:
            return
        i = self._invocations
        self._invocations += 1
        if i not in self._unit_of_module.get(id(module), ()):
            raise PlannerError(
                f"unit call {i + 1} of this forward is not the plan's {self.unit_names[i] if i < len(self.unit_names) else '(none)'!r}: "
                "the plan was made for another forward of this model (re-plan it)")
        self._current_unit = i

    # --- eager regions -------------------------------------------------------------------------

    def _eager_call_begins(self, reg: Region, call: "_RegionCall") -> None:
        key = self._pending_key
        if key is not None and key in self._tables:
            call.table = self._tables[key]
            call.funcs = self._funcs[key]
            return
        call.learning = True  # everything saved
        if not self._warned_eager_checkpoint:
            # the region's checkpoint ran eagerly, not through _eager_region: torch.compile fell
            # back to eager for it (a graph break inside the region)
            self._warned_eager_checkpoint = True
            warnings.warn(
                f"tensorplace.compiled: region {reg.name!r} ran eagerly inside a compiled step (torch.compile broke "
                "the graph in it, e.g. at an nn.LSTM), so its ops were all saved: the plan does not apply there; "
                "torch._dynamo.explain(wrapper)(*inputs) lists the graph breaks", RuntimeWarning, stacklevel=2)

    def _eager_region(self, reg: Region, original: Callable[..., Any], context_fn: Callable[[], Any],
                      args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if reg.retained:
            return original(*args, **kwargs)  # nothing to recompute: the model's own forward
        k = self._calls.get(reg.name, 0)
        self._calls[reg.name] = k + 1
        shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                       for t in pytree.tree_leaves((args, kwargs)))
        # what else selects the region's ops: its modules' train/eval modes (a BatchNorm frozen
        # for fine-tuning), autocast
        modes = (tuple(m.training for m in reg.modules), _autocast_state())
        key = (reg.name, k, shapes, modes)
        if key in self._tables:
            self._pending_key = key  # for context_fn
            try:
                return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, context_fn=context_fn,
                                                         **kwargs)
            finally:
                self._pending_key = None
        # the first call of this region for these inputs and modes: the model's own forward (all
        # saved, nothing recomputed: outside torch's checkpoint, whose saved values allow one
        # backward only), its ops recorded
        recorder = _Recorder(lambda: self._current_unit, {b.untyped_storage()._cdata for b in self.model.buffers()})
        with recorder:
            out = original(*args, **kwargs)
        P = torch.utils.checkpoint.CheckpointPolicy
        units = [op.unit if op.unit in reg.units else reg.units[0] for op in recorder.ops]
        wants = [self.op_policy(u, op.func) == P.MUST_SAVE for u, op in zip(units, recorder.ops)]
        self._tables[key] = eager_saves(recorder.ops, wants)
        self._funcs[key] = [op.func for op in recorder.ops]
        recorder.release()
        return out

    # --- the plan per op --------------------------------------------------------------------------

    def op_policy(self, unit: int, func: Any) -> Any:
        """The CheckpointPolicy of one op of unit ``unit`` (module docstring)."""
        P = torch.utils.checkpoint.CheckpointPolicy
        if _is_random(func) or _is_collective(func):
            return P.MUST_SAVE
        action = self.actions[unit]
        if action == RECOMPUTE:
            return P.MUST_RECOMPUTE
        if action == SWAP and self._offload and _tracing():
            return P.MUST_CPU_OFFLOAD  # eagerly saved: torch's eager checkpoint has no offload
        return P.MUST_SAVE

    # --- the module ---------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        """The model's forward starts (through this wrapper or called directly): count its unit
        and region calls from the start."""
        if _tracing():
            return
        self._calls = {}
        self._invocations = 0
        self._current_unit = None
        self._in_forward = True

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if not _tracing():
            self._in_forward = False

    def close(self) -> None:
        """Give the model its regions' own ``forward`` back, remove the hooks, and put torch's
        compiled-offload settings back (when this wrapper turned them on)."""
        if self.offloads:
            self.offloads = False
            _OffloadSettings.restore()
        for module, original in self._originals:
            if module.__dict__.get("forward") is not None:
                del module.__dict__["forward"]
        self._originals.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def wrapped_regions(model: nn.Module) -> List[str]:
    """Names of ``model``'s modules whose ``forward`` a live :class:`CompiledPlan` replaced (also
    in a deep copy of such a model): profiling or planning them would measure the wrapper."""
    return [n for n, m in model.named_modules() if getattr(m.__dict__.get("forward"), "_tensorplace_region", False)]


def refuse_wrapped(model: nn.Module, what: str) -> None:
    """Raise PlannerError if ``model`` has regions of a live compiled-engine wrapper."""
    names = wrapped_regions(model)
    if names:
        raise PlannerError(
            f"{what}: the model's modules {names[:3]} are wrapped by tensorplace.compiled (their forward runs under "
            "its checkpoint policy); call close() on that wrapper first (a deep copy of a wrapped model keeps the "
            "wrapping: copy the model before wrapping it)")


def compiled(model: nn.Module, plan: Any, *, regions: Optional[Sequence[str]] = None,
             offload_stream: bool = False) -> CompiledPlan:
    """``model`` training under ``plan`` through torch's selective activation checkpointing: use it
    as the model (``torch.compile(tensorplace.compiled(model, plan))``, or eagerly to check a plan
    without compiling). See :class:`CompiledPlan` and docs/compiled.md."""
    return CompiledPlan(model, plan, regions=regions, offload_stream=offload_stream)
