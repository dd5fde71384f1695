"""``tensorplace-bench``: the numbers behind docs/benchmarks.md, reproducible from a shell.

    tensorplace-bench demo                      # plan() and run() on a real model, measured
    tensorplace-bench compare --model resnet50  # methods side by side on a builtin profile
    tensorplace-bench maxbatch --model vgg16 --memory 8GiB
    tensorplace-bench convergence --model inception_v3 [--png out.png]
    tensorplace-bench accuracy                  # predicted vs measured, several plans, real model
    tensorplace-bench timeline --model resnet50 # the memory curve of a plan

Every measured figure is labelled with the device it was measured on.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import examples
from ._core import BudgetError
from .budget import format_bytes, parse_budget
from .planning import evaluate, lower_bound, plan_profile, unplanned_peak


def _table(title: str, header: Sequence[str], rows: List[Sequence[Any]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for h in header:
            t.add_column(h, justify="right" if h != header[0] else "left")
        for r in rows:
            t.add_row(*[str(c) for c in r])
        Console().print(t)
    except ImportError:  # rich is a dependency, but keep the CLI usable without it
        print(title)
        print("  ".join(f"{h:>14}" for h in header))
        for r in rows:
            print("  ".join(f"{str(c):>14}" for c in r))


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _where() -> str:
    import torch

    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name()}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# --- real models -------------------------------------------------------------------------------


def _real_model(name: str, batch: int, image: int, seq: int) -> Tuple[Any, Any, Callable[[Any], Any]]:
    import torch
    import torchvision

    torch.manual_seed(0)
    if name == "resnet18":
        model = torchvision.models.resnet18(num_classes=100)
        x = torch.randn(batch, 3, image, image)
        y = torch.randint(0, 100, (batch,))
        return model, x, lambda out: torch.nn.functional.cross_entropy(out, y)
    if name == "gpt":
        from .models import TinyGPT

        model = TinyGPT(vocab=512, dim=256, heads=4, layers=4, block=seq, dropout=0.1)
        x = torch.randint(0, 512, (batch, seq))
        y = torch.randint(0, 512, (batch, seq))
        return model, x, lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    raise SystemExit(f"unknown model {name!r}: choose resnet18 or gpt")


def _measure(module: Any, x: Any, loss_fn: Callable[[Any], Any], repeats: int) -> Dict[str, Any]:
    from .profiler import unplanned_step_stats

    return unplanned_step_stats(module, (x,), loss_fn=loss_fn, repeats=repeats)


def _cut_budget(base: Dict[str, Any], prof: Dict[str, Any], fraction: float) -> int:
    """The unplanned peak minus `fraction` of the activation peak (the peak less what no plan
    moves: parameters, inputs, optimizer state and gradients)."""
    fixed = base["constant_bytes"] + sum(u["grad_bytes"] for u in prof["units"])
    return int(base["peak_bytes"] - fraction * (base["peak_bytes"] - fixed))


def cmd_demo(a: argparse.Namespace) -> int:
    """Profile, plan for a budget that halves the activation peak, train under the plan, and
    print measured against unplanned and predicted."""
    from .api import plan as make_plan
    from .api import run

    model, x, loss_fn = _real_model(a.model, a.batch, a.image, a.seq)
    print(f"{a.model}: inputs {tuple(x.shape)}, measured on {_where()}")
    base = _measure(model, x, loss_fn, a.repeats)
    t0 = time.perf_counter()
    probe = make_plan(model, x, base["peak_bytes"], loss_fn=loss_fn, method="retain")
    prof = probe.to_dict()["profile"]
    budget = parse_budget(a.budget) if a.budget else _cut_budget(base, prof, a.fraction)
    try:
        p = probe.replan(budget, iterations=a.iterations, particles=a.particles)
    except BudgetError as e:
        if a.budget:
            print(f"cannot plan: {e.args[0]}")
            return 1
        print(f"cutting {a.fraction:.0%} of the activation peak is out of reach for this model ({e.args[0]});"
              f" planning for the smallest budget a known plan meets, {format_bytes(e.args[1])}")
        budget = int(e.args[1])
        p = probe.replan(budget, iterations=a.iterations, particles=a.particles)
    search_s = time.perf_counter() - t0
    print(p.summary())
    fast = run(model, p)
    planned = _measure(fast, x, loss_fn, a.repeats)
    fast.close()
    pred = p.predicted
    _table(
        f"one training step of {a.model}, budget {format_bytes(budget)} (profile + search {search_s:.1f} s)",
        ["run", "peak", "vs unplanned", "step ms", "vs unplanned"],
        [
            ["unplanned, measured", format_bytes(base["peak_bytes"]), "1.00", _ms(base["step_time"]), "1.00"],
            [
                "planned, measured",
                format_bytes(planned["peak_bytes"]),
                f"{planned['peak_bytes'] / base['peak_bytes']:.2f}",
                _ms(planned["step_time"]),
                f"{planned['step_time'] / base['step_time']:.2f}",
            ],
            [
                "planned, predicted",
                format_bytes(pred["peak_bytes"]),
                f"{pred['peak_bytes'] / base['peak_bytes']:.2f}",
                _ms(pred["step_time"]),
                f"{pred['step_time'] / prof['measured']['step_time']:.2f}",
            ],
        ],
    )
    ok = planned["peak_bytes"] <= budget
    print(f"measured peak {'within' if ok else 'OVER'} the budget ({format_bytes(planned['peak_bytes'])} vs {format_bytes(budget)})")
    if a.save:
        p.save(a.save)
        print(f"plan saved to {a.save}")
    return 0 if ok else 2


def cmd_accuracy(a: argparse.Namespace) -> int:
    """Predicted against measured step time and peak for several plans of one real model."""
    from .api import plan as make_plan
    from .api import run

    model, x, loss_fn = _real_model(a.model, a.batch, a.image, a.seq)
    base = _measure(model, x, loss_fn, a.repeats)
    probe = make_plan(model, x, base["peak_bytes"], loss_fn=loss_fn, method="retain")
    prof = probe.to_dict()["profile"]
    rows = []
    for frac in a.fractions:
        budget = _cut_budget(base, prof, frac)
        for method in a.methods:
            try:
                p = probe.replan(budget, method, iterations=a.iterations, particles=a.particles)
            except BudgetError:
                rows.append([f"{frac:.2f}", method, "infeasible", "", "", "", "", ""])
                continue
            fast = run(model, p)
            m = _measure(fast, x, loss_fn, a.repeats)
            fast.close()
            pr = p.predicted
            rows.append(
                [
                    f"{frac:.2f}",
                    method,
                    format_bytes(budget),
                    format_bytes(pr["peak_bytes"]),
                    format_bytes(m["peak_bytes"]),
                    _ms(pr["step_time"]),
                    _ms(m["step_time"]),
                    f"{abs(pr['step_time'] - m['step_time']) / m['step_time'] * 100:.1f}%",
                ]
            )
    _table(
        f"evaluator accuracy, {a.model} {tuple(x.shape)}, measured on {_where()} (unplanned {format_bytes(base['peak_bytes'])}, {_ms(base['step_time'])} ms)",
        ["cut", "method", "budget", "pred peak", "meas peak", "pred ms", "meas ms", "time err"],
        rows,
    )
    return 0


# --- builtin profiles -------------------------------------------------------------------------


def cmd_compare(a: argparse.Namespace) -> int:
    """Every method on one builtin profile at several budgets (predicted by the cost model)."""
    prof = examples.profile(a.model, batch_size=a.batch)
    lb, up = lower_bound(prof), unplanned_peak(prof)
    rows = []
    for frac in a.fractions:
        budget = int(lb + frac * (up - lb))
        row: List[Any] = [f"{frac:.2f}", format_bytes(budget)]
        for method in a.methods:
            t = time.perf_counter()
            try:
                p = plan_profile(prof, budget, method, iterations=a.iterations, particles=a.particles)
                row.append(f"{_ms(p.predicted['step_time'])} ({time.perf_counter() - t:.1f}s)")
            except BudgetError:
                row.append("infeasible")
        rows.append(row)
    _table(
        f"{a.model} batch {a.batch}: predicted step ms (search time); lower bound {format_bytes(lb)}, unplanned {format_bytes(up)}",
        ["budget pos", "budget"] + list(a.methods),
        rows,
    )
    return 0


def _fits(name: str, batch: int, memory: int, method: str, a: argparse.Namespace) -> Optional[float]:
    prof = examples.profile(name, batch_size=batch)
    if method == "unplanned":
        return evaluate(prof, ["retain"] * len(prof["units"]), memory)["step_time"] if unplanned_peak(prof) <= memory else None
    try:
        return plan_profile(prof, memory, method, iterations=a.iterations, particles=a.particles).predicted["step_time"]
    except BudgetError:
        return None


def cmd_maxbatch(a: argparse.Namespace) -> int:
    """The largest batch each method fits into --memory, by bisection on the batch size."""
    memory = parse_budget(a.memory)
    rows = []
    for method in a.methods:
        lo, hi, t = 0, 1, None  # t: predicted step time at batch lo
        while hi <= 1 << 14 and (th := _fits(a.model, hi, memory, method, a)) is not None:
            lo, hi, t = hi, hi * 2, th
        while hi - lo > 1:
            mid = (lo + hi) // 2
            tm = _fits(a.model, mid, memory, method, a)
            if tm is not None:
                lo, t = mid, tm
            else:
                hi = mid
        rows.append([method, lo, "-" if t is None else f"{lo / t:.0f}"])
    _table(f"{a.model}: largest batch in {format_bytes(memory)} (predicted)", ["method", "max batch", "samples/s"], rows)
    return 0


def cmd_convergence(a: argparse.Namespace) -> int:
    """The PSO trace: best, mean and worst predicted step time per iteration."""
    prof = examples.profile(a.model, batch_size=a.batch)
    lb, up = lower_bound(prof), unplanned_peak(prof)
    budget = int(lb + a.fraction * (up - lb))
    t = time.perf_counter()
    p = plan_profile(prof, budget, iterations=a.iterations, particles=a.particles, seed=a.seed)
    total = time.perf_counter() - t
    c = p.convergence or {}
    best = c.get("best", [])
    final = best[-1] if best else None
    k = next((i for i, b in enumerate(best) if b is not None and final is not None and b <= final * 1.01), None)
    print(f"{a.model} batch {a.batch}, budget {format_bytes(budget)}: search {total:.2f} s on this machine, "
          f"{c.get('evaluations')} evaluations; within 1% of the final best at iteration {k} "
          f"({c['elapsed'][k]:.2f} s)" if k is not None else "no feasible plan")
    step = max(1, len(best) // 20)
    rows = [[i, _ms(best[i]), _ms(c["mean"][i]), _ms(c["worst"][i]), c["feasible"][i]] for i in range(0, len(best), step)]
    _table("convergence (predicted step ms)", ["iteration", "best", "mean", "worst", "feasible"], rows)
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = list(range(len(best)))
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in ("best", "mean", "worst"):
            ax.plot(xs, [v * 1e3 if v is not None else float("nan") for v in c[key]], label=key)
        ax.set_xlabel("iteration")
        ax.set_ylabel("predicted step time (ms)")
        ax.set_title(f"HOME PSO on {a.model}, budget {format_bytes(budget)}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
        print(f"wrote {a.png}")
    return 0


def cmd_timeline(a: argparse.Namespace) -> int:
    """The memory curve of the PSO plan against the unplanned one."""
    prof = examples.profile(a.model, batch_size=a.batch)
    lb, up = lower_bound(prof), unplanned_peak(prof)
    budget = int(lb + a.fraction * (up - lb))
    p = plan_profile(prof, budget, iterations=a.iterations, particles=a.particles)
    planned = evaluate(prof, p.actions, budget)
    unplanned = evaluate(prof, ["retain"] * len(prof["units"]), up)
    step = max(1, len(planned["curve"]) // 24)
    rows = [
        [c["stage"], _ms(c["start_time"]), format_bytes(c["peak"]), format_bytes(u["peak"])]
        for k, (c, u) in enumerate(zip(planned["curve"], unplanned["curve"]))
        if k % step == 0 or k == len(planned["curve"]) - 1
    ]
    _table(f"{a.model}: memory per stage, budget {format_bytes(budget)}", ["stage", "start ms", "planned peak", "unplanned peak"], rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"planned": planned, "unplanned": unplanned}, f)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorplace-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def search_args(p: argparse.ArgumentParser, iterations: int = 500, particles: int = 500) -> None:
        p.add_argument("--iterations", type=int, default=iterations)
        p.add_argument("--particles", type=int, default=particles)

    def real_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="resnet18", choices=["resnet18", "gpt"])
        p.add_argument("--batch", type=int, default=32)
        p.add_argument("--image", type=int, default=128)
        p.add_argument("--seq", type=int, default=256)
        p.add_argument("--repeats", type=int, default=3)
        search_args(p, 200, 200)

    d = sub.add_parser("demo", help=cmd_demo.__doc__)
    real_args(d)
    d.add_argument("--budget", help="bytes or e.g. 200MiB (default: cut --fraction of the activation peak)")
    d.add_argument("--fraction", type=float, default=0.25,
                   help="share of the unplanned activation peak (peak minus parameters, inputs, optimizer state and gradients) to cut")
    d.add_argument("--save", help="write the plan to this file")
    d.set_defaults(fn=cmd_demo)

    acc = sub.add_parser("accuracy", help=cmd_accuracy.__doc__)
    real_args(acc)
    acc.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.5])
    acc.add_argument("--methods", nargs="+", default=["pso", "swap-all", "recompute-all"])
    acc.set_defaults(fn=cmd_accuracy)

    names = examples.names()
    c = sub.add_parser("compare", help=cmd_compare.__doc__)
    c.add_argument("--model", default="resnet50", choices=names)
    c.add_argument("--batch", type=int, default=32)
    c.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    c.add_argument("--methods", nargs="+", default=["pso", "swap-all", "recompute-all", "retain"])
    search_args(c)
    c.set_defaults(fn=cmd_compare)

    m = sub.add_parser("maxbatch", help=cmd_maxbatch.__doc__)
    m.add_argument("--model", default="vgg16", choices=names)
    m.add_argument("--memory", default="11GiB")
    m.add_argument("--methods", nargs="+", default=["unplanned", "pso", "swap-all", "recompute-all"])
    search_args(m, 50, 50)
    m.set_defaults(fn=cmd_maxbatch)

    v = sub.add_parser("convergence", help=cmd_convergence.__doc__)
    v.add_argument("--model", default="inception_v3", choices=names)
    v.add_argument("--batch", type=int, default=32)
    v.add_argument("--fraction", type=float, default=0.5)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--png")
    search_args(v)
    v.set_defaults(fn=cmd_convergence)

    t = sub.add_parser("timeline", help=cmd_timeline.__doc__)
    t.add_argument("--model", default="resnet50", choices=names)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--fraction", type=float, default=0.5)
    t.add_argument("--json")
    search_args(t, 100, 100)
    t.set_defaults(fn=cmd_timeline)

    __import__("tensorplace.methods.bench", fromlist=["add_cli"]).add_cli(sub)  # methods: docs/methods.md
    __import__("tensorplace.allocator", fromlist=["add_cli"]).add_cli(sub)
    a = ap.parse_args(argv)
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
