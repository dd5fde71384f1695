"""The executor's own host time per action, measured on a device (the cost model's host costs).

A step under a plan costs what the plain step costs plus the executor's work: Python that runs at
every saved tensor it handles, every checkpoint segment it replays, every storage it swaps, every
glue call of a segment it tracks. On a GPU that work is host time the device waits for when
kernels are short; on a CPU it adds to the step. :func:`executor_costs` measures it on the device
where the plan will run, end to end, with the executor itself on small synthetic models whose
kernels take microseconds (so the step is host work), by timing steady steps of plans that
differ in one thing at a time:

* ``step``: the executor's own work per step, under any plan (checking the inputs and which
  parameters require grad, the step's state, the backward's hook): the all-retain plan against the
  plain step. The other figures are each plan's step beyond the all-retain plan's;
* ``segment``: one more replayed checkpoint segment (its frame, the kept arguments, the replay's
  setup): ``B`` one-block segments against one segment of the same ``B`` blocks;
* ``drop``: one more saved tensor dropped and regenerated (its holder, its capture in the replay,
  its unpack; the hook calls of the segment's other saved tensors are spread over them): the one
  segment against the all-retain plan and the forward it replays;
* ``swap``: one more storage swapped (its entry, the copy out and back through the backend, its
  unpack): the all-swap plan against the one swapping the first unit alone; ``swap_async`` the
  same for a storage larger than ``inline_bytes``, which the CPU backend copies on its copy
  thread rather than on the caller's;
* ``stage``: per stage after a plan's first swapped unit, the swap work at its boundary (frees of
  completed copies, deadlines, the prefetch schedule's hooks): the plan swapping the first unit
  alone against the all-retain plan, less that unit's swap;
* ``tracked_op``: one more glue call of a segment the executor tracks because its glue lies
  outside its module calls (the TorchFunctionMode records it in every step, the replay runs the
  recording; the tracker's work per unit is spread over its glue calls).

The costs go into the profile (``executor``, docs/formats.md) and the evaluator adds them to the
stages where the work happens (docs/cost-model.md, "Host time"). Each figure is from the quickest
fifth of interleaved rounds (what else the machine does only slows some steps down), each plan's
steps with the other plans' executors' hooks off the shared model (idle hooks slow a step down).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

__all__ = ["executor_costs", "COST_KEYS"]

#: the host costs a profile's ``executor`` section holds (seconds)
COST_KEYS = ("segment", "drop", "swap", "swap_async", "tracked_op", "stage", "step", "inline_bytes")

_cache: Dict[Tuple[Any, ...], Dict[str, float]] = {}


class _Block(nn.Module):
    def __init__(self, width: int, second: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width) if second else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        # glue between the block's units, inside the block's call: a segment of `a` alone is
        # tracked (its glue lies outside its own module call), a segment of the block is not
        h = torch.tanh(h) * 0.5 + h
        return self.b(h) if self.b is not None else h


def _model(blocks: int, width: int, device: torch.device, second: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(width, second) for _ in range(blocks)]).to(device)


def _swap_backends(dev: torch.device, backend: Any) -> Dict[str, Any]:
    """The backends the swap costs are measured through: the step's (``swap``) and, where it runs
    small copies on the caller's thread (the CPU backend), one that runs every copy on its copy
    thread (``swap_async``: a storage above ``inline_bytes``)."""
    from .executor import default_backend

    be = backend if backend is not None else default_backend(dev)
    out = {"swap": be}
    inline = getattr(be, "inline_bytes", 0)
    if inline:
        from .cpu_backend import CpuBackend

        out = {"swap": CpuBackend(inline_bytes=inline), "swap_async": CpuBackend(inline_bytes=0)}
        if backend is None:
            be.close()
    return out


def _counts(model: nn.Module, x: torch.Tensor) -> Tuple[List[int], List[int]]:
    """Per unit: saved tensors its segment makes, glue calls its segment makes."""
    from .units import UnitTracker

    with UnitTracker(model) as tr:
        model(x).sum()
    packs = [len(seg.packs) for seg in tr.segments]
    glue = [0] * len(tr.segments)
    for _event, unit in tr.glue_events:
        if unit >= 0:
            glue[unit] += 1
    return packs, glue


def _median_steps(modules: Dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float],
                  before: Callable[[str], None] = lambda k: None) -> Dict[str, float]:
    """The quickest fifth of ``rounds`` interleaved steps of each of ``modules``, ``before(k)``
    called untimed before each step of ``k``."""
    times: Dict[str, List[float]] = {k: [] for k in modules}
    for _ in range(3):
        for k, fn in modules.items():
            before(k)
            fn()
    for r in range(rounds):
        items = list(modules.items())
        for k, fn in (items if r % 2 == 0 else reversed(items)):
            before(k)
            t0 = clock()
            fn()
            times[k].append(clock() - t0)
    # the quickest steps: the executor's work is the same in every step, what else the machine
    # does only adds to some (a low quantile is steadier than the median under load)
    return {k: sorted(v)[len(v) // 5] for k, v in times.items()}


def executor_costs(device: Any = "cpu", backend: Any = None, *, blocks: int = 24, width: int = 8, batch: int = 2,
                   rounds: int = 15, cached: bool = True) -> Dict[str, float]:
    """Host seconds of the executor's work per action on ``device`` (module docstring):
    ``COST_KEYS``. ``backend``: the backend the swaps go through (default: the device's). Cached
    per device, torch version, thread count and backend kind."""
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        return _executor_costs(dev, backend, blocks, width, batch, rounds, cached)


def _executor_costs(dev: torch.device, backend: Any, blocks: int, width: int, batch: int, rounds: int,
                    cached: bool) -> Dict[str, float]:
    from .executor import PlannedModule, hooks_of_one

    key = (str(dev), torch.__version__, torch.get_num_threads(), type(backend).__name__,
           getattr(backend, "inline_bytes", None))
    if cached and key in _cache:
        return dict(_cache[key])
    model = _model(blocks, width, dev)
    front = _model(blocks, width, dev, second=False)  # what a replay of `a` and its glue runs
    x = torch.randn(batch, width, device=dev)
    n = 2 * blocks
    packs, glue = _counts(model, x)
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def clock() -> float:
        sync()
        return time.perf_counter()

    def step(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            m(x).sum().backward()
            for p in model.parameters():
                p.grad = None
        return run

    def forward(m: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.enable_grad():
                m(x)
        return run

    block_starts = list(range(0, n, 2))
    plans: Dict[str, Any] = {
        # nothing moved: the executor's work per step
        "retain": {"actions": ["retain"] * n},
        # one checkpoint segment per block (aligned: the block's call holds its glue)
        "blocks": {"actions": ["recompute"] * n, "segment_starts": block_starts},
        # one segment of every block: one replay of the whole model
        "one": {"actions": ["recompute"] * n, "segment_starts": [0]},
        # each block's first unit alone: tracked (its glue lies outside its own module call)
        "tracked": {"actions": ["recompute", "retain"] * blocks, "segment_starts": block_starts},
    }
    # swaps with each unit's copy back issued one stage before it is needed (as a planned step)
    swap_plan = {"actions": ["swap"] * n, "prefetch": [[u, min(u + 2, n - 1)] for u in range(n - 1)]}
    # the first unit swapped alone: every later stage does the swap plan's boundary work
    first_plan = {"actions": ["swap"] + ["retain"] * (n - 1), "prefetch": [[0, min(2, n - 1)]]}
    backends = _swap_backends(dev, backend)
    planned = {k: PlannedModule(model, p, backend=backend) for k, p in plans.items()}
    for k, be in backends.items():
        planned[k] = PlannedModule(model, swap_plan, backend=be)
    planned["swap_first"] = PlannedModule(model, first_plan, backend=backends["swap"])
    try:
        runs: Dict[str, Callable[[], None]] = {"plain": step(model), "forward": forward(model),
                                               "front": forward(front)}
        runs.update({k: step(m) for k, m in planned.items()})
        executors = {k: m.executor for k, m in planned.items()}
        # the executors share the model: the others' module hooks would run idle in k's step
        t = _median_steps(runs, rounds, clock, lambda k: hooks_of_one(executors.values(), executors.get(k)))
        swaps = {k: int(planned[k].last_stats.swap_storages) for k in [*backends, "swap_first"]}
    finally:
        for m in planned.values():
            m.close()
        for k, be in backends.items():
            if be is not backend:
                be.close()
    step_cost = max(0.0, t["retain"] - t["plain"])
    base, fwd, front_fwd = t["plain"] + step_cost, t["forward"], t["front"]  # base: the all-retain plan's step
    segment = max(0.0, (t["blocks"] - t["one"]) / (blocks - 1))
    drop = max(0.0, (t["one"] - base - fwd - segment) / max(sum(packs), 1))
    # all swapped: storages x swap + (n - 1) x stage; the first alone: its storages x swap + (n - 1) x stage
    swap = max(0.0, (t["swap"] - t["swap_first"]) / max(swaps["swap"] - swaps["swap_first"], 1))
    stage = max(0.0, (t["swap_first"] - base - swaps["swap_first"] * swap) / (n - 1))
    swap_async = (max(0.0, (t["swap_async"] - base - (n - 1) * stage) / max(swaps["swap_async"], 1))
                  if "swap_async" in t else swap)
    a_units = range(0, n, 2)
    tracked = (t["tracked"] - base - front_fwd - blocks * segment - drop * sum(packs[u] for u in a_units))
    tracked_op = max(0.0, tracked / max(sum(glue[u] for u in a_units), 1))
    costs = {"segment": segment, "drop": drop, "swap": swap, "swap_async": swap_async, "tracked_op": tracked_op,
             "stage": stage, "step": step_cost, "inline_bytes": float(getattr(backends["swap"], "inline_bytes", 0))}
    if cached:
        _cache[key] = dict(costs)
    return costs
