"""tensorplace against what a user would try first, measured on the current device.

`compare_peers(model, x, loss_fn)` runs one training step of: the plain model; torch's
checkpoint around every repeated block; checkpoint around sqrt(n)-sized groups of blocks;
`torch.autograd.graph.save_on_cpu`; tensorplace's own per-block checkpoint plan; and tensorplace
plans searched at the measured peak of each recipe (and at given budgets). Each row has the peak of allocated memory (torch's own records), the peak
of reserved memory (CUDA), the median step time, the ratios to the plain step, whether the loss
and every gradient are bitwise equal to the plain step's, and, for plans, the prediction.
`tensorplace-bench peers` prints it.

Step times are taken in rounds once every row is set up: each round times one step of every
row, in turn (reversed every other round), and a row's time is its median over the rounds. A
machine whose load changes during the run then slows every row alike instead of the rows
measured at the time.

Repeated blocks are the modules the planner's `checkpoint-blocks` method finds (the unit-name
prefixes of its blocks), so the recipe and the plan checkpoint the same segments.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Checkpointed", "block_modules", "checkpoint_blocks", "checkpoint_sqrt", "compare_peers"]


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _common_prefix(names: Sequence[str]) -> str:
    parts = [n.split("#")[0].split(".") for n in names]
    out: List[str] = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    return ".".join(out)


def block_modules(plan: Any) -> List[str]:
    """Qualified names of the repeated blocks of a `checkpoint-blocks` plan, in forward order."""
    units = plan.units
    return [_common_prefix(units[a:b + 1]) for a, b in plan.settings.get("blocks", [])]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new) if not child.isdigit() else parent.__setitem__(int(child), new)


def checkpoint_blocks(model: nn.Module, blocks: Iterable[str]) -> nn.Module:
    """A copy of ``model`` (sharing nothing) with torch's checkpoint around every named block."""
    out = copy.deepcopy(model)
    for name in blocks:
        _replace(out, name, Checkpointed(out.get_submodule(name)))
    return out


def checkpoint_sqrt(model: nn.Module, blocks: Sequence[str]) -> Optional[nn.Module]:
    """A copy of ``model`` with torch's checkpoint around groups of about sqrt(n) consecutive
    blocks of the same container (an ``nn.Sequential`` or ``nn.ModuleList`` whose blocks run one
    after another), like ``checkpoint_sequential``. None if the blocks are not in such containers."""
    out = copy.deepcopy(model)
    by_parent: Dict[str, List[int]] = {}
    for name in blocks:
        parent, _, idx = name.rpartition(".")
        if not idx.isdigit():
            return None
        by_parent.setdefault(parent, []).append(int(idx))
    size = max(1, round(math.sqrt(len(blocks))))
    parents = list(by_parent)
    for parent, idxs in by_parent.items():
        container = out.get_submodule(parent)
        if not isinstance(container, (nn.Sequential, nn.ModuleList)) or idxs != list(range(len(container))):
            return None
        groups = [nn.Sequential(*[container[i] for i in idxs[k:k + size]]) for k in range(0, len(idxs), size)]
        # as checkpoint_sequential: every group is checkpointed but the very last, which runs plainly
        last = parent == parents[-1]
        wrapped = [Checkpointed(g) for g in (groups[:-1] if last else groups)] + ([groups[-1]] if last else [])
        _replace(out, parent, nn.Sequential(*wrapped) if isinstance(container, nn.Sequential) else nn.ModuleList(wrapped))
    return out


def _step(module: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor], seed: int = 0,
          context: Any = None) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    if context is None:
        loss = loss_fn(module(x))
        loss.backward()
    else:
        with context():
            loss = loss_fn(module(x))
            loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def _measure(module: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor], repeats: int,
             context: Any = None) -> Dict[str, Any]:
    """Peak allocated (torch's records), peak reserved (CUDA), median step time."""
    from .profiler import unplanned_step_stats

    if context is None:
        stats = unplanned_step_stats(module, (x,), loss_fn=loss_fn, repeats=repeats)
    else:
        class _InContext(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, *a: Any) -> Any:
                return self.inner(*a)

        wrapper = _InContext(module)
        with context():
            stats = unplanned_step_stats(wrapper, (x,), loss_fn=loss_fn, repeats=repeats)
    reserved = None
    dev = next(module.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        _step(module, x, loss_fn, context=context)
        torch.cuda.synchronize(dev)
        reserved = torch.cuda.max_memory_reserved(dev)
    return {"peak_bytes": stats["peak_bytes"], "reserved_bytes": reserved, "step_time": stats["step_time"]}


def _time_in_rounds(timed: Sequence[Tuple[Dict[str, Any], nn.Module, Any]], x: Any,
                    loss_fn: Callable[[Any], torch.Tensor], rounds: int) -> None:
    """Set ``step_time`` (median) and ``step_times`` of every row from ``rounds`` rounds of one
    step of each ``(row, module, context)`` in turn (module docstring)."""
    from .profiler import _Clock, _preserved, _timed_plain_step

    model = timed[0][1]
    dev = next(model.parameters()).device
    clock = _Clock(dev)
    times: List[List[float]] = [[] for _ in timed]
    with _preserved(model, dev):
        for r in range(rounds):
            order = range(len(timed)) if r % 2 == 0 else range(len(timed) - 1, -1, -1)
            for i in order:
                _row, module, context = timed[i]
                module.train()
                with context() if context is not None else contextlib.nullcontext():
                    times[i].append(_timed_plain_step(module, (x,), loss_fn, clock))
    for (row, _module, _context), ts in zip(timed, times):
        row["step_time"] = statistics.median(ts)
        row["step_times"] = ts


def _equal(a: Tuple[torch.Tensor, List[Optional[torch.Tensor]]], b: Tuple[torch.Tensor, List[Optional[torch.Tensor]]]) -> bool:
    if not torch.equal(a[0], b[0]) or len(a[1]) != len(b[1]):
        return False
    return all((g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
               for g, h in zip(a[1], b[1]))


def compare_peers(
    model: nn.Module,
    x: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    budgets: Sequence[int] = (),
    backend: Any = None,
    repeats: int = 3,
    search: Optional[Dict[str, Any]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> List[Dict[str, Any]]:
    """The rows of the peers table (module docstring), the plain step first. ``budgets``: extra
    tensorplace budgets in bytes; ``backend``: the executor's host tier (e.g. a CpuBackend with
    a bandwidth cap); ``search``: settings of the search (particles, iterations, seed)."""
    import tensorplace as tp

    search = dict(search or {})
    note = progress or (lambda _msg: None)
    rows: List[Dict[str, Any]] = []
    note("plain step")
    reference = _step(model, x, loss_fn)
    base = _measure(model, x, loss_fn, 1)
    rows.append({"name": "unplanned", **base, "bitwise": True})
    timed: List[Tuple[Dict[str, Any], nn.Module, Any]] = [(rows[0], model, None)]
    opened: List[Any] = []

    note("profiling")
    probe = tp.plan(model, x, budget=2**50, loss_fn=loss_fn, method="retain", backend=backend, repeats=repeats)
    recipes: List[Tuple[str, Optional[nn.Module], Any]] = []
    try:
        blocks = block_modules(probe.replan(2**50, method="checkpoint-blocks"))
    except tp.PlannerError:
        blocks = []
    if blocks:
        recipes.append(("checkpoint per block", checkpoint_blocks(model, blocks), None))
        recipes.append(("checkpoint sqrt(n)", checkpoint_sqrt(model, blocks), None))
    pin = next(model.parameters()).device.type == "cuda"
    recipes.append(("save_on_cpu", model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)))

    targets: List[Tuple[str, int]] = []
    for name, module, context in recipes:
        if module is None:
            continue
        note(name)
        stats = _measure(module, x, loss_fn, 1, context)
        same = _equal(_step(module, x, loss_fn, context=context), reference)
        rows.append({"name": name, **stats, "bitwise": same})
        timed.append((rows[-1], module, context))
        targets.append((f"tensorplace at {name}", stats["peak_bytes"]))
    targets += [(f"tensorplace at {tp.format_bytes(b)}", int(b)) for b in budgets]
    plans: List[Tuple[str, Optional[int], str]] = [(name, budget, "pso") for name, budget in targets]
    if blocks:  # the per-block recipe as a plan: the executor's segments against torch's checkpoint
        plans.insert(0, ("tensorplace checkpoint-blocks", None, "checkpoint-blocks"))

    try:
        for name, budget, method in plans:
            note(name)
            try:
                plan = probe.replan(2**50 if budget is None else budget, method=method,
                                    **(search if method == "pso" else {}))
            except tp.BudgetError as exc:
                rows.append({"name": name, "budget": budget, "error": str(exc).splitlines()[0]})
                continue
            fast = tp.run(model, plan, backend=backend)
            opened.append(fast)
            stats = _measure(fast, x, loss_fn, 1)
            same = _equal(_step(fast, x, loss_fn), reference)
            rows.append({"name": name, "budget": budget, "method": method, **stats, "bitwise": same,
                         "predicted_peak_bytes": plan.predicted["peak_bytes"],
                         "predicted_step_time": plan.predicted["step_time"], "counts": plan.counts()})
            timed.append((rows[-1], fast, None))
        note(f"step times: {repeats} rounds of {len(timed)} steps")
        _time_in_rounds(timed, x, loss_fn, repeats)
    finally:
        for fast in opened:
            fast.close()
    base = rows[0]  # its step time, too, is from the rounds
    for r in rows:
        if "peak_bytes" in r:
            r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
            r["time_ratio"] = r["step_time"] / base["step_time"]
    return rows


def _print_table(rows: List[Dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from .budget import format_bytes

    t = Table(title="tensorplace against its peers (one training step)")
    for col in ("", "peak", "reserved", "step", "peak / unplanned", "time / unplanned", "bitwise",
                "predicted peak", "predicted step"):
        t.add_column(col, justify="left" if not col else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["name"], "-", "-", "-", "-", "-", "-", r["error"][:60], "")
            continue
        res = r.get("reserved_bytes")
        t.add_row(
            r["name"], format_bytes(r["peak_bytes"]), format_bytes(res) if res is not None else "-",
            f"{r['step_time'] * 1e3:.0f} ms", f"{r['peak_ratio']:.2f}", f"{r['time_ratio']:.2f}",
            "yes" if r["bitwise"] else "NO",
            format_bytes(r["predicted_peak_bytes"]) if "predicted_peak_bytes" in r else "",
            f"{r['predicted_step_time'] * 1e3:.0f} ms" if "predicted_step_time" in r else "",
        )
    Console().print(t)


def add_cli(subparsers: Any, model_args: Callable[[Any], None], load_model: Callable[[Any], Tuple[Any, Any, Any]],
            write_json: Callable[[Any, Any], None]) -> None:
    """Register ``tensorplace-bench peers``: ``model_args(parser)`` adds the model options,
    ``load_model(args)`` returns (model, input, loss_fn), ``write_json(args, data)`` honours ``--json``."""
    from .bench.common import budget as budget_arg, positive_int, progress

    p = subparsers.add_parser("peers", help="measure tensorplace against checkpointing recipes and save_on_cpu")
    model_args(p)
    p.add_argument("--budget", action="append", default=[], type=budget_arg,
                   help="extra tensorplace budget (repeatable), e.g. 200MiB")
    p.add_argument("--link", type=float, default=None, metavar="GB/s",
                   help="cap the CPU backend's host copies at this bandwidth (a GPU-like copy/compute ratio)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds of timed steps, one step of every row per round (median per row)")
    p.add_argument("--particles", type=positive_int, default=100)
    p.add_argument("--iterations", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)

    def run(a: Any) -> int:
        if a.link is not None and a.link <= 0:
            raise SystemExit(f"--link must be a positive bandwidth in GB/s, got {a.link}")
        budgets = list(a.budget)  # bytes (parsed by the argument's type)
        model, x, loss_fn = load_model(a)
        backend = None
        device = next(model.parameters()).device
        if a.link is not None:
            if device.type != "cpu":
                raise SystemExit("--link caps the CPU backend; on a GPU the link is the real one")
            from cuda_exec.cpu_backend import CpuBackend

            backend = CpuBackend(bandwidth_cap=a.link * 1e9)
        try:
            with progress("peers") as bar:  # on stderr
                rows = compare_peers(model, x, loss_fn, budgets=budgets, backend=backend, repeats=a.repeats,
                                     search={"particles": a.particles, "iterations": a.iterations, "seed": a.seed},
                                     progress=bar.describe)
        finally:
            if backend is not None:
                backend.close()
        _print_table(rows)
        write_json(a, {"command": "peers", "device": str(device), "link_gbps": a.link, "rows": rows})
        return 0

    p.set_defaults(func=run)
