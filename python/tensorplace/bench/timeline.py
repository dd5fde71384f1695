"""``timeline``: one training step under a plan, as the cost model plays it: the compute stream,
the copy stream and the memory curve against the budget (a table, and a PNG with --png). The
curve is allocated memory and the memory PyTorch's caching allocator reserves for the plan's
allocations (simulated, tensorplace.allocator), after every allocation and free."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Tuple

from .._core import BudgetError, PlannerError
from ..budget import format_bytes
from ..planning import Plan, evaluate, lower_bound, plan_profile, unplanned_peak, without_executor
from . import common


def _source(a: argparse.Namespace) -> Tuple[str, Dict[str, Any], Optional[Plan]]:
    if not a.plan:
        label, prof = common.load_source(a)
        return label, prof, None
    if a.model:
        raise SystemExit("--plan draws the plan on the profile it carries, or on --profile FILE / --builtin NAME; "
                         "not on --model, whose new profile would not be the plan's")
    try:
        plan = Plan.load(a.plan)
    except FileNotFoundError:
        raise SystemExit(f"--plan {a.plan!r}: no such file") from None
    except (PlannerError, ValueError) as e:
        raise SystemExit(f"--plan {a.plan!r} is not a valid plan: {e}") from None
    data = plan.to_dict()
    if a.profile or a.builtin:
        label, prof = common.load_source(a)
    elif "profile" in data:
        prof = data["profile"]
        label = f"{prof.get('model')} batch {prof.get('batch_size')}"
    else:
        raise SystemExit(f"--plan {a.plan!r} carries no profile; pass the profile it was made from with --profile")
    try:
        plan.check_profile(prof)
    except PlannerError as e:
        raise SystemExit(f"--plan {a.plan!r} does not belong to this profile: {e}") from None
    return label, prof, plan


def stage_intervals(prof: Dict[str, Any], ev: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each stage's interval on the compute stream: [start, end), and its own compute at the end
    (waits for copies and replays come first, as in the cost model)."""
    curve = ev["curve"]
    units = prof["units"]
    out = []
    for k, c in enumerate(curve):
        end = curve[k + 1]["start_time"] if k + 1 < len(curve) else ev["step_time"]
        kind, i = c["stage"].split(":")
        own = units[int(i)]["fwd_time" if kind == "fwd" else "bwd_time"]
        out.append({"stage": c["stage"], "start": c["start_time"], "end": end, "compute_start": max(c["start_time"], end - own),
                    "mem_start": c["mem_start"], "peak": c["peak"]})
    return out


def draw(path: str, title: str, prof: Dict[str, Any], ev: Dict[str, Any], base: Dict[str, Any], budget: int) -> None:
    plt = common.pyplot()
    from matplotlib.patches import Patch

    stages = stage_intervals(prof, ev)
    fig, (top, mem) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    colors = {"fwd": "tab:blue", "bwd": "tab:orange", "replay": "tab:red", "d2h": "tab:green", "h2d": "tab:purple"}
    copies = ev.get("copies", [])
    queues = sorted({c.get("queue", 0) for c in copies}) or [0]
    lane = {q: len(queues) - 1 - k for k, q in enumerate(queues)}  # copy queues below compute
    cy = len(queues)
    for s in stages:
        kind = s["stage"].split(":")[0]
        top.broken_barh([(s["compute_start"] * 1e3, (s["end"] - s["compute_start"]) * 1e3)], (cy + 0.1, 0.8),
                        facecolors=colors[kind], edgecolor="none")
    for r in ev.get("replays", []):
        top.broken_barh([(r["start"] * 1e3, (r["end"] - r["start"]) * 1e3)], (cy + 0.1, 0.8), facecolors=colors["replay"],
                        edgecolor="none")
    for c in copies:
        top.broken_barh([(c["start"] * 1e3, (c["end"] - c["start"]) * 1e3)], (lane[c.get("queue", 0)] + 0.1, 0.8),
                        facecolors=colors[c["direction"]], edgecolor="white", linewidth=0.3)
    top.set_yticks([lane[q] + 0.5 for q in queues] + [cy + 0.5])
    top.set_yticklabels([f"copy queue {q}" if len(queues) > 1 else "copy stream" for q in queues] + ["compute"])
    top.set_ylim(0, cy + 1)
    top.legend(handles=[Patch(color=colors[k], label=lbl) for k, lbl in
                        [("fwd", "forward"), ("bwd", "backward"), ("replay", "recompute"), ("d2h", "swap out"),
                         ("h2d", "prefetch")]], ncol=5, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0),
               frameon=False)
    fig.suptitle(title)

    def steps(points: List[Dict[str, Any]], key: str) -> Tuple[List[float], List[float]]:
        xs, ys = [], []
        for s in points:
            xs += [s["start"] * 1e3, s["end"] * 1e3]
            ys += [s[key] / 2**20, s[key] / 2**20]
        return xs, ys

    curve = ev.get("memory_curve")
    if curve:  # after every allocation and free, the last point held to the step's end
        xs = [p["time"] * 1e3 for p in curve] + [ev["step_time"] * 1e3]
        ys, rs = ([p[key] / 2**20 for p in curve + curve[-1:]] for key in ("allocated", "reserved"))
        mem.step(xs, rs, where="post", color="tab:purple", linewidth=1,
                 label=f"reserved, planned (caching allocator, simulated; peak {format_bytes(ev['reserved_bytes'])})")
        mem.step(xs, ys, where="post", color="tab:blue", linewidth=1, label="allocated, planned")
        mem.fill_between(xs, ys, step="post", color="tab:blue", alpha=0.15)
    else:  # no allocator simulation: the stages' peaks
        xs, ys = steps(stages, "peak")
        mem.plot(xs, ys, color="tab:blue", label="allocated, planned (stage peak)")
        mem.fill_between(xs, ys, color="tab:blue", alpha=0.15)
    bxs, bys = steps(stage_intervals(prof, base), "peak")
    mem.plot(bxs, bys, color="grey", linestyle="--", linewidth=1, label="allocated, unplanned (stage peak)")
    mem.axhline(budget / 2**20, color="tab:red", linewidth=1, label=f"budget {format_bytes(budget)}")
    mem.set_xlabel("time in the step (ms, predicted)")
    mem.set_ylabel("device memory (MiB)")
    mem.legend(fontsize=7, loc="upper left")
    common.save_figure(fig, path)


def cmd_timeline(a: argparse.Namespace) -> int:
    """One step under a plan as the cost model plays it, against the unplanned step."""
    label, prof, plan = _source(a)
    lb, up = lower_bound(prof), unplanned_peak(prof)
    if plan is not None:
        budget, actions, method, starts = plan.budget_bytes, plan.actions, plan.method, plan.segment_starts
    else:
        budget = a.budget if a.budget else int(lb + a.fraction * (up - lb))
        try:
            with common.progress(f"searching ({a.particles} particles x {a.iterations} iterations)"):
                p = plan_profile(prof, budget, a.method, iterations=a.iterations, particles=a.particles, seed=a.seed)
        except BudgetError as e:
            print(f"cannot plan: {e.args[0]}")
            a.out["error"] = e.args[0]
            return 1
        actions, method, starts = p.actions, p.method, p.segment_starts
    # the plan's own checkpoint segments (sqrt's differ from the profile's blocks, evaluate's default);
    # reserved: the caching allocator's reserved memory of the plan's allocations over the step, simulated
    try:
        planned = evaluate(prof, actions, budget, segment_starts=starts or None, reserved=True, memory_curve=True)
    except PlannerError as e:  # e.g. allocator settings in the profile the simulation does not model
        print(f"no reserved-memory figure: {e}")
        planned = evaluate(prof, actions, budget, segment_starts=starts or None)
    reserved = planned.get("reserved_bytes")
    unplanned = evaluate(without_executor(prof), ["retain"] * len(prof["units"]), max(up, budget))
    stages = stage_intervals(prof, planned)
    step = max(1, len(stages) // 24)
    rows = [
        [s["stage"], common.ms(s["start"]), format_bytes(s["peak"]), format_bytes(u["peak"])]
        for k, (s, u) in enumerate(zip(stages, unplanned["curve"]))
        if k % step == 0 or k == len(stages) - 1
    ]
    copies = planned.get("copies", [])
    d2h = sum(c["end"] - c["start"] for c in copies if c["direction"] == "d2h")
    h2d = sum(c["end"] - c["start"] for c in copies if c["direction"] == "h2d")
    title = f"{label}: {method} plan, budget {format_bytes(budget)}"
    common.table(f"{title}: memory per stage (predicted)", ["stage", "start ms", "planned peak", "unplanned peak"], rows)
    print(f"step {common.ms(planned['step_time'])} ms (unplanned {common.ms(unplanned['step_time'])}); "
          f"copy stream busy {common.ms(d2h)} ms out, {common.ms(h2d)} ms in; stalls {common.ms(planned['swap_stall'])} ms; "
          f"recompute {common.ms(planned['recompute'])} ms; peak {format_bytes(planned['peak_bytes'])} at {planned['peak_stage']}"
          + (f"; reserved {format_bytes(reserved)} (caching allocator, simulated; alloc_conf "
             f"{planned.get('alloc_conf') or 'default'})" if reserved is not None else ""))
    a.out.update(profile=label, method=method, actions=actions, budget_bytes=budget, lower_bound_bytes=lb, unplanned_peak_bytes=up,
                      stages=stages, planned=planned, unplanned=unplanned, copy_seconds={"d2h": d2h, "h2d": h2d},
                      reserved_peak_bytes=reserved)
    if a.png:
        draw(a.png, title, prof, planned, unplanned, budget)
        a.out["png"] = a.png
    return 0


def add_cli(sub: Any) -> None:
    t = sub.add_parser("timeline", help="one step under a plan: streams and memory over time (and a PNG)",
                       description=cmd_timeline.__doc__)
    common.profile_source_args(t, "resnet50")
    t.add_argument("--plan", metavar="FILE", help="draw this saved plan (on its own profile, or --profile / --builtin)")
    t.add_argument("--method", default="pso", help="method to plan with when no --plan is given (default pso)")
    t.add_argument("--fraction", type=common.fraction, default=0.5,
                   help="budget position between the lower bound (0) and the unplanned peak (1); default 0.5")
    t.add_argument("--budget", type=common.budget, help="a budget instead of --fraction, e.g. 2GiB")
    t.add_argument("--png", metavar="PATH", help="draw the step into this PNG")
    common.search_args(t, 100, 100)
    t.set_defaults(fn=cmd_timeline)
