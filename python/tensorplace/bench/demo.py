"""``demo``: profile a real model, plan for a budget, train under the plan, measured."""

from __future__ import annotations

import argparse
import time
from typing import Any

from .._core import BudgetError
from ..budget import format_bytes
from . import common


def cmd_demo(a: argparse.Namespace) -> int:
    """Profile, plan for a budget that cuts a share of the activation peak, train under the plan,
    and print measured against unplanned and predicted."""
    from ..api import plan as make_plan
    from ..api import run

    rm = common.model_from_args(a)
    print(f"{rm.name}: inputs {rm.shapes()}, measured on {common.where(rm.device)}")
    with common.progress(f"measuring unplanned steps of {rm.name}"):
        base = common.measure(rm.model, rm.inputs, rm.loss_fn, a.repeats)
    t0 = time.perf_counter()
    with common.progress(f"profiling {rm.name}"):
        probe = make_plan(rm.model, rm.inputs, base["peak_bytes"], loss_fn=rm.loss_fn, method="retain")
    prof = probe.to_dict()["profile"]
    budget = a.budget if a.budget else common.cut_budget(base, prof, a.fraction)
    search = dict(iterations=a.iterations, particles=a.particles, seed=a.seed)
    try:
        with common.progress(f"searching a plan ({a.particles} particles x {a.iterations} iterations)"):
            p = probe.replan(budget, **search)
    except BudgetError as e:
        if a.budget:
            print(f"cannot plan: {e.args[0]}")
            a.out["error"] = e.args[0]
            return 1
        print(f"cutting {a.fraction:.0%} of the activation peak is out of reach for this model ({e.args[0]});"
              f" planning for the smallest budget a known plan meets, {format_bytes(e.args[1])}")
        budget = int(e.args[1])
        p = probe.replan(budget, **search)
    search_s = time.perf_counter() - t0
    print(p.summary())
    fast = run(rm.model, p)
    with common.progress("measuring planned steps"):
        planned = common.measure(fast, rm.inputs, rm.loss_fn, a.repeats)
    fast.close()
    pred = p.predicted
    common.table(
        f"one training step of {rm.name}, budget {format_bytes(budget)} (profile + search {search_s:.1f} s)",
        ["run", "peak", "vs unplanned", "step ms", "vs unplanned"],
        [
            ["unplanned, measured", format_bytes(base["peak_bytes"]), "1.00", common.ms(base["step_time"]), "1.00"],
            [
                "planned, measured",
                format_bytes(planned["peak_bytes"]),
                f"{planned['peak_bytes'] / base['peak_bytes']:.2f}",
                common.ms(planned["step_time"]),
                f"{planned['step_time'] / base['step_time']:.2f}",
            ],
            [
                "planned, predicted",
                format_bytes(pred["peak_bytes"]),
                f"{pred['peak_bytes'] / base['peak_bytes']:.2f}",
                common.ms(pred["step_time"]),
                f"{pred['step_time'] / prof['measured']['step_time']:.2f}",
            ],
        ],
    )
    print(f"(the predicted step against the unplanned step measured when profiling, "
          f"{common.ms(prof['measured']['step_time'])} ms: the model's own baseline)")
    ok = planned["peak_bytes"] <= budget
    print(f"measured peak {'within' if ok else 'OVER'} the budget ({format_bytes(planned['peak_bytes'])} vs {format_bytes(budget)})")
    a.out.update(
        model=rm.name, inputs=rm.shapes(), budget_bytes=budget, search_seconds=search_s,
        unplanned={"peak_bytes": base["peak_bytes"], "step_time": base["step_time"]},
        planned={"peak_bytes": planned["peak_bytes"], "step_time": planned["step_time"]},
        predicted={"peak_bytes": pred["peak_bytes"], "step_time": pred["step_time"]},
        profiled_step_time=prof["measured"]["step_time"], counts=p.counts(), within_budget=ok,
    )
    if a.save:
        p.save(a.save)
        print(f"plan saved to {a.save}")
    return 0 if ok else 2


def add_cli(sub: Any) -> None:
    d = sub.add_parser("demo", help="profile, plan and train a real model under a budget, measured",
                       description=cmd_demo.__doc__)
    common.real_args(d)
    d.add_argument("--budget", type=common.budget, help="bytes or e.g. 200MiB (default: cut --fraction of the activation peak)")
    d.add_argument("--fraction", type=common.fraction, default=0.25,
                   help="share of the unplanned activation peak (peak minus parameters, inputs, optimizer state and gradients) to cut")
    d.add_argument("--save", metavar="PATH", help="write the plan to this file")
    d.set_defaults(fn=cmd_demo)
