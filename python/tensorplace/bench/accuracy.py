"""``accuracy``: predicted against measured step time and peak, several plans of one real model."""

from __future__ import annotations

import argparse
from typing import Any, List

from .._core import BudgetError
from ..budget import format_bytes
from . import common


def cmd_accuracy(a: argparse.Namespace) -> int:
    """Predicted against measured step time and peak for several plans of one real model."""
    from ..api import plan as make_plan
    from ..api import run

    a.methods = common.known_methods(a.methods, a)
    rm = common.model_from_args(a)
    with common.progress(f"measuring unplanned steps of {rm.name}"):
        base = common.measure(rm.model, rm.inputs, rm.loss_fn, a.repeats)
    with common.progress(f"profiling {rm.name}"):
        probe = make_plan(rm.model, rm.inputs, base["peak_bytes"], loss_fn=rm.loss_fn, method="retain")
    prof = probe.to_dict()["profile"]
    rows: List[List[Any]] = []
    with common.progress("planning and measuring", total=len(a.fractions) * len(a.methods)) as bar:
        for frac in a.fractions:
            budget = common.cut_budget(base, prof, frac)
            for method in a.methods:
                bar.advance()
                try:
                    p = probe.replan(budget, method, iterations=a.iterations, particles=a.particles, seed=a.seed)
                except BudgetError:
                    rows.append([f"{frac:.2f}", method, "infeasible", "", "", "", "", ""])
                    a.out.append("rows", {"cut": frac, "method": method, "budget_bytes": budget, "feasible": False})
                    continue
                fast = run(rm.model, p)
                m = common.measure(fast, rm.inputs, rm.loss_fn, a.repeats)
                fast.close()
                pr = p.predicted
                err = abs(pr["step_time"] - m["step_time"]) / m["step_time"]
                rows.append([
                    f"{frac:.2f}", method, format_bytes(budget), format_bytes(pr["peak_bytes"]),
                    format_bytes(m["peak_bytes"]), common.ms(pr["step_time"]), common.ms(m["step_time"]),
                    f"{err * 100:.1f}%",
                ])
                a.out.append("rows", {
                    "cut": frac, "method": method, "budget_bytes": budget, "feasible": True,
                    "predicted_peak_bytes": pr["peak_bytes"], "measured_peak_bytes": m["peak_bytes"],
                    "predicted_step_time": pr["step_time"], "measured_step_time": m["step_time"],
                    "time_error": err,
                })
    common.table(
        f"evaluator accuracy, {rm.name} {rm.shapes()}, measured on {common.where(rm.device)} "
        f"(unplanned {format_bytes(base['peak_bytes'])}, {common.ms(base['step_time'])} ms)",
        ["cut", "method", "budget", "pred peak", "meas peak", "pred ms", "meas ms", "time err"],
        rows,
    )
    a.out.update(model=rm.name, inputs=rm.shapes(),
                      unplanned={"peak_bytes": base["peak_bytes"], "step_time": base["step_time"]})
    return 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser("accuracy", help="predicted vs measured peak and step time for several plans of a real model",
                       description=cmd_accuracy.__doc__)
    common.real_args(p)
    p.add_argument("--fractions", type=common.fraction, nargs="+", default=[0.3, 0.5],
                   help="shares of the activation peak to cut (default 0.3 0.5)")
    p.add_argument("--methods", nargs="+", default=["pso", "swap-all", "recompute-all"])
    p.set_defaults(fn=cmd_accuracy)
