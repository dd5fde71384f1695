"""``budgets``: does the budget hold on any model? Plan zoo models at three budgets and measure.

For each model (python/tensorplace/zoo.py, or any ``--model``): profile once, then for budgets
at fractions of the way from the lower bound to the unplanned peak, search a plan and run one
measured training step under it. A row passes when the measured peak is within the budget and
the step is bitwise equal to the plain one, or when the planner refuses the budget and the
smallest budget it names does plan and fit when measured.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import common

FRACTIONS = (0.75, 0.4, 0.1)


def _measured_step(module: Any, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor]) -> Dict[str, Any]:
    from ..profiler import unplanned_step_stats

    return unplanned_step_stats(module, tuple(inputs), loss_fn=loss_fn, repeats=1)


def _grads(module: Any, params: Sequence[torch.nn.Parameter], inputs: Sequence[Any],
           loss_fn: Callable[[Any], torch.Tensor], buffers: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()
           ) -> List[Optional[torch.Tensor]]:
    """The loss, the gradients and the buffers after one step from the buffers' values
    ``buffers`` (the steps measured before it moved them: running statistics, an EMA the forward
    reads)."""
    for p in params:
        p.grad = None
    with torch.no_grad():
        for b, value in buffers:
            b.copy_(value)
    torch.manual_seed(1)
    loss = loss_fn(module(*inputs))
    loss.backward()
    out = [loss.detach()] + [None if p.grad is None else p.grad.clone() for p in params]
    out += [b.detach().clone() for b, _ in buffers]
    for p in params:
        p.grad = None
    return out


def _same(a: List[Optional[torch.Tensor]], b: List[Optional[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and _equal(x, y))
                                    for x, y in zip(a, b))


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.is_sparse or y.is_sparse:  # an Embedding(sparse=True)'s gradient
        return x.is_sparse == y.is_sparse and torch.equal(x.to_dense(), y.to_dense())
    return torch.equal(x, y)


def check_model(model: torch.nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor], *,
                fractions: Sequence[float] = FRACTIONS, backend: Any = None, method: str = "pso",
                search: Optional[Dict[str, Any]] = None, fixed: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """One row per budget: ``budget``, ``fraction``, and either ``predicted_peak_bytes``,
    ``measured_peak_bytes``, ``fits``, ``bitwise``, ``counts``, or ``refused`` (the planner's
    message) with ``smallest`` and the measured row of a plan at that budget (``smallest_fits``).
    Then one measured row per method in `fixed` (plans whatever the budget, such as "swap-all"),
    with its ``method`` and ``fraction`` None, planned without a budget, or at a fraction of the
    way from the lower bound to the unplanned peak written after an ``@`` ("vdnn@0.5")."""
    import tensorplace as tp

    search = dict(search or {})
    inputs = tuple(inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    reference = _grads(model, params, inputs, loss_fn, buffers)
    probe = tp.plan(model, inputs, budget=2**50, loss_fn=loss_fn, method="retain", backend=backend, repeats=1)
    profile = probe.to_dict()["profile"]
    low, high = tp.lower_bound(profile), tp.unplanned_peak(profile)

    def measure(plan: Any) -> Dict[str, Any]:
        fast = tp.run(model, plan, backend=backend)
        try:
            stats = _measured_step(fast, inputs, loss_fn)
            same = _same(_grads(fast, params, inputs, loss_fn, buffers), reference)
        finally:
            fast.close()
        # end_delta_bytes: the step's gradients unless a free went unrecorded (a diagnostic of a row that does not fit)
        return {"measured_peak_bytes": stats["peak_bytes"], "end_delta_bytes": stats["end_delta_bytes"],
                "fits": stats["peak_bytes"] <= plan.budget_bytes,
                "bitwise": same, "predicted_peak_bytes": plan.predicted["peak_bytes"], "counts": plan.counts()}

    rows: List[Dict[str, Any]] = []
    for f in fractions:
        budget = int(low + f * (high - low))
        row: Dict[str, Any] = {"fraction": f, "budget": budget, "lower_bound": low, "unplanned": high}
        try:
            plan = probe.replan(budget, method=method, **search)
        except tp.BudgetError as exc:
            smallest = int(exc.args[1]) if len(exc.args) > 1 else None
            row.update(refused=str(exc).splitlines()[0], smallest=smallest)
            if smallest is not None:
                retry = measure(probe.replan(smallest, method=method, **search))
                row.update(smallest_fits=retry["fits"], smallest_bitwise=retry["bitwise"],
                           smallest_measured_peak_bytes=retry["measured_peak_bytes"])
        else:
            row.update(measure(plan))
        rows.append(row)
    for m in fixed:
        method_name, _, at = m.partition("@")
        plan = probe.replan(int(low + float(at) * (high - low)) if at else 2**62, method=method_name)
        rows.append({"method": m, "fraction": None, "budget": plan.budget_bytes, "lower_bound": low, "unplanned": high,
                     **measure(plan)})
    return rows


def row_ok(row: Dict[str, Any]) -> bool:
    """The promise: fits and trains exactly, or refused with a smallest budget that does."""
    if "refused" in row:
        return bool(row.get("smallest_fits")) and bool(row.get("smallest_bitwise"))
    return bool(row["fits"]) and bool(row["bitwise"])


def cmd_budgets(a: argparse.Namespace) -> int:
    """Plan zoo models (or --model) at three budgets between the lower bound and the unplanned
    peak, run a measured step under each plan, and check the budget holds."""
    from .. import zoo
    from ..budget import format_bytes

    names = a.model or zoo.names()
    backend = None
    link = a.link if a.link is not None or a.device.type != "cpu" else 1.0
    if link is not None:
        if link <= 0:
            raise SystemExit(f"--link must be a positive bandwidth in GB/s, got {link}")
        if a.device.type != "cpu":
            raise SystemExit("--link caps the CPU backend's copies; on a GPU the link is the real one (leave --link out)")
        from cuda_exec.cpu_backend import CpuBackend

        backend = CpuBackend(bandwidth_cap=link * 1e9)
    a.out["link_gbps"] = link
    table: List[List[str]] = []
    results: Dict[str, Any] = {}
    failed = 0
    try:
        for name in names:
            if name not in zoo.MODELS:
                raise SystemExit(f"--model {name!r}: not in the zoo ({', '.join(zoo.names())})")
            with torch.device(a.device):  # the model, its inputs and labels on --device
                model, inputs, loss_fn = zoo.build(name, batch=a.batch)
            model, inputs = common.on_device(model, tuple(inputs), a.device)
            a.out["tensors_on"] = common.placement(model, inputs)
            with common.progress(f"{name}: planning and measuring at three budgets"):
                rows = check_model(model, inputs, loss_fn, backend=backend, method=a.method,
                                   search={"particles": a.particles, "iterations": a.iterations, "seed": a.seed})
            results[name] = rows
            for r in rows:
                ok = row_ok(r)
                failed += not ok
                if "refused" in r:
                    got = (f"refused; smallest {format_bytes(r['smallest'])}" if r.get("smallest") else "refused")
                    meas = format_bytes(r["smallest_measured_peak_bytes"]) if "smallest_measured_peak_bytes" in r else "-"
                    pred = "-"
                else:
                    got, meas, pred = "planned", format_bytes(r["measured_peak_bytes"]), format_bytes(r["predicted_peak_bytes"])
                table.append([name, f"{r['fraction']:.2f}", format_bytes(r["budget"]), got, pred, meas,
                              "yes" if ok else "NO"])
    finally:
        if backend is not None:
            backend.close()
    common.table("budgets on the zoo (measured on this device)",
                 ["model", "fraction", "budget", "plan", "predicted", "measured", "holds"], table)
    a.out["models"] = results
    a.out["failed"] = failed
    return 1 if failed else 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser("budgets", help="plan zoo models at three budgets and check the measured peaks",
                       description=cmd_budgets.__doc__)
    p.add_argument("--model", action="append", default=None, help="a zoo model (repeatable; default: all)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--method", default="pso")
    p.add_argument("--link", type=float, default=None, metavar="GB/s",
                   help="cap the CPU backend's host copies at this bandwidth (default on the CPU: 1 GB/s; "
                        "not on a GPU, whose link is the real one)")
    common.device_arg(p)
    p.add_argument("--particles", type=int, default=20)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_budgets)
