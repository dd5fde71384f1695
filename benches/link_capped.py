"""Swap-heavy plans on a capped host link: measured peak and step against the plan's prediction.

Issue 18's CPU check of the copy model: the CPU backend's copies capped at ``--link`` GB/s (0.15:
about the H100's copy-to-compute ratio for ResNet-50), the model profiled once through that
backend, then the all-swap plan, vDNN's (swap convolution inputs, else every input) and AutoTM's
swap-only MILP at 40% of the way from the lower bound to the unplanned peak, and PSO plans at
three budgets, each run for ``--repeats`` timed steps. A row
prints the swaps and recomputes, the predicted and measured peak (torch's allocation records)
and the predicted and measured step (median), the measured step over the predicted one, and the
bytes copied back per step: the model's (its host-to-device copies) and the CPU backend's (median
of three more steps; a swap-out the model cancels or uses from the device is not copied back).

The machine's speed moves by 10-20% from minute to minute here, which no profile taken minutes
before can predict, so each planned step is timed right after a plain step of a copy of the model
(interleaved, ``--repeats`` pairs): "speed" is the plain steps' median over the profile's
all-retain prediction, and "at that speed" is the plan's predicted step with its compute,
recompute and host time scaled by it and its swap stall as predicted (``at_speed``); the link's
bandwidth is the cap's, which does not move. The measured step over that prediction is the copy
model's error, apart from the machine's speed.

Run: ``python benches/link_capped.py --model gpt6 --batch 8 --seq 256`` or
``--model resnet18 --batch 32 --image 128``; ``--json F`` writes the rows. Exits 1 if a plan was
measured over its predicted peak.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from typing import Any, Dict, List

import torch

import tensorplace as tp
from cuda_exec.cpu_backend import CpuBackend
from tensorplace.bench.common import build_model
from tensorplace.profiler import unplanned_step_stats


def at_speed(predicted: Dict[str, Any], speed: float) -> float:
    """The step of a plan ``predicted`` as the cost model predicted it, on a machine ``speed``
    times slower: its compute, recompute and host time scaled, its swap stall as predicted (the
    link is the cap's, which does not move; a slower compute hides no less of the copies, so
    this does not under-predict the stall). Not the plan evaluated on a slower profile: that
    would move which swap-outs the model cancels, which the executor takes from the plan."""
    busy = predicted["compute_time"] + predicted["recompute"] + predicted.get("host_time", 0.0)
    return predicted["step_time"] + (speed - 1.0) * busy


def step_seconds(model: torch.nn.Module, inputs: Any, loss_fn: Any) -> float:
    t = time.perf_counter()
    loss_fn(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt6")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--link", type=float, default=0.15, help="host link cap, GB/s")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per plan (median)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.4, 0.75],
                    help="PSO budgets, as fractions from the lower bound to the unplanned peak")
    ap.add_argument("--milp-time", type=float, default=10.0, help="seconds for the swap-only MILP")
    ap.add_argument("--json", default=None, metavar="FILE")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    rm = build_model(a.model, a.batch, image=a.image, seq=a.seq)
    model, inputs, loss_fn = rm.model, tuple(rm.inputs), rm.loss_fn
    backend = CpuBackend(bandwidth_cap=a.link * 1e9)
    rows: List[Dict[str, Any]] = []
    try:
        probe = tp.plan(model, inputs, budget=2**50, loss_fn=loss_fn, method="retain", backend=backend, repeats=3)
        profile = probe.to_dict()["profile"]
        low, high = tp.lower_bound(profile), tp.unplanned_peak(profile)
        mid = int(low + 0.4 * (high - low))
        plans = [("swap-all", lambda: probe.replan(2**50, method="swap-all")),
                 ("vdnn 0.40", lambda: probe.replan(mid, method="vdnn")),
                 ("milp-swap 0.40", lambda: probe.replan(mid, method="milp-swap", time_limit=a.milp_time))]
        for f in a.fractions:
            budget = int(low + f * (high - low))
            plans.append((f"pso {f:.2f}", lambda budget=budget: probe.replan(budget, method="pso", particles=100,
                                                                             iterations=50)))
        plain = unplanned_step_stats(model, inputs, loss_fn=loss_fn, repeats=a.repeats)
        print(f"{a.model} b{a.batch}, link {a.link} GB/s: unplanned measured {plain['step_time'] * 1e3:.1f} ms, "
              f"{plain['peak_bytes'] / 2**20:.1f} MiB; profile's step {probe.predicted['step_time'] * 1e3:.1f} ms",
              flush=True)
        print("| plan | swap / recompute | predicted peak | measured peak | predicted step | measured step | measured / predicted "
              "| speed | predicted at that speed | measured / that | copied back per step, predicted / measured |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        plain_copy = copy.deepcopy(model)
        for label, make in plans:
            try:
                plan = make()
            except tp.BudgetError as exc:
                print(f"| {label} | refused: {str(exc).splitlines()[0]} | | | | | | | | | |", flush=True)
                continue
            fast = tp.run(model, plan, backend=backend)
            t = time.perf_counter()
            try:
                m = unplanned_step_stats(fast, inputs, loss_fn=loss_fn, repeats=1)  # its peak
                plain_steps, steps = [], []
                for _ in range(a.repeats):  # interleaved: a plain step, then a planned one
                    plain_steps.append(step_seconds(plain_copy, inputs, loss_fn))
                    steps.append(step_seconds(fast, inputs, loss_fn))
                back = []
                for _ in range(3):
                    before = backend.stats().prefetch_bytes
                    loss_fn(fast(*inputs)).backward()
                    model.zero_grad(set_to_none=True)
                    back.append(backend.stats().prefetch_bytes - before)
            finally:
                fast.close()
            speed = statistics.median(plain_steps) / probe.predicted["step_time"]
            measured = statistics.median(steps)
            d = plan.to_dict()
            modelled = tp.evaluate(profile, d["actions"], d["budget_bytes"], segment_starts=d["segment_starts"])
            now = at_speed(plan.predicted, speed)
            model_back = sum(c["bytes"] for c in modelled["copies"] if c["direction"] == "h2d")
            c = plan.counts()
            row = {"plan": label, "swap": c["swap"], "recompute": c["recompute"],
                   "predicted_peak_bytes": plan.predicted["peak_bytes"], "measured_peak_bytes": m["peak_bytes"],
                   "predicted_step": plan.predicted["step_time"], "measured_step": measured,
                   "measured_steps": steps, "plain_steps": plain_steps, "speed": speed,
                   "predicted_step_at_speed": now, "wall": time.perf_counter() - t,
                   "predicted_copied_back_bytes": model_back, "measured_copied_back_bytes": sorted(back)[1]}
            rows.append(row)
            print(f"| {label} | {c['swap']} / {c['recompute']} | {row['predicted_peak_bytes'] / 2**20:.1f} MiB | "
                  f"{row['measured_peak_bytes'] / 2**20:.1f} MiB | {row['predicted_step'] * 1e3:.0f} ms | "
                  f"{measured * 1e3:.0f} ms | {measured / row['predicted_step']:.3f} | {speed:.3f} | "
                  f"{now * 1e3:.0f} ms | {measured / now:.3f} | "
                  f"{model_back / 2**20:.1f} / {row['measured_copied_back_bytes'] / 2**20:.1f} MiB |", flush=True)
    finally:
        backend.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "batch": a.batch, "link_gbps": a.link, "unplanned": plain, "rows": rows}, f,
                      indent=1)
    over = [r["plan"] for r in rows if r["measured_peak_bytes"] > r["predicted_peak_bytes"]]
    if over:
        print("measured over the predicted peak:", ", ".join(over))
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
