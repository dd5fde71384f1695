"""DELTA three ways on one model and budget: the evaluator's simulation (delta.rs, the plan's
prediction), that plan run by the executor ("plan mode"), and the runtime policy in the executor
(cuda_exec/cuda_exec/delta_policy.py) with the same profile's unit times and bandwidth.

For each model and budget fraction f (budget = lower bound + f x (unplanned peak - lower bound),
the methods tables' convention) it prints: the simulation's predicted step time and peak and its
actions; plan mode's and the runtime policy's measured step time (median of ``--repeats`` steps,
the unplanned model's, plan mode's and the runtime policy's steps interleaved) and measured peak (torch's profiler, the tests' instrument: constant memory + the step's peak
allocation); the runtime policy's own counter peak and its decisions; and how many units the two
treat differently. Timings are of this machine; run it on an idle one.

The runtime policy runs ``--warmup`` steps first (its forward release limit adapts to what the
backward needed in the steps before, delta_policy.py). Run: ``nice python
benches/delta_runtime.py [--models resnet18 gpt] [--fractions 0.5 0.75] [--repeats 5]
[--warmup 4] [--cap BYTES_PER_S]``
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import tensorplace as tp
from cuda_exec.cpu_backend import CpuBackend
from cuda_exec.delta_policy import DeltaBudgetWarning
from tensorplace.models import TinyGPT
from tensorplace.profiler import unplanned_step_stats

MiB = 2**20


def resnet18() -> Tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(8, 3, 128, 128)
    y = torch.randint(0, 10, (8,))
    return model, x, lambda out: F.cross_entropy(out, y)


def gpt() -> Tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=128, heads=4, layers=3, block=64, dropout=0.1)
    x = torch.randint(0, 128, (8, 64))
    y = torch.randint(0, 128, (8, 64))
    return model, x, lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())


MODELS = {"resnet18": resnet18, "gpt": gpt}


def per_unit(actions: List[str], decisions: List[Any]) -> List[str]:
    """The runtime policy's decisions as one action per unit (a unit with several released
    tensors: recompute if any was recomputed, else swap)."""
    out = ["retain"] * len(actions)
    for d in decisions:
        if out[d.unit] != "recompute":
            out[d.unit] = d.action
    return out


def timed_step(module: nn.Module, model: nn.Module, x: torch.Tensor, loss_fn: Callable[[Any], torch.Tensor]) -> float:
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    loss_fn(module(x)).backward()
    return time.perf_counter() - t0


def interleaved(modes: Dict[str, nn.Module], model: nn.Module, x: torch.Tensor,
                loss_fn: Callable[[Any], torch.Tensor], rounds: int) -> Dict[str, float]:
    """Median step time of each mode, the modes' steps interleaved (a busy machine slows them alike)."""
    times: Dict[str, List[float]] = {k: [] for k in modes}
    for _ in range(rounds):
        for k, m in modes.items():
            times[k].append(timed_step(m, model, x, loss_fn))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.75])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cap", type=float, default=None, help="the CPU backend's bandwidth cap, bytes/s")
    ap.add_argument("--warmup", type=int, default=4,
                    help="steps of the runtime policy before the measured ones (its release limit adapts)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows: List[Dict[str, Any]] = []
    for name in a.models:
        model, x, loss_fn = MODELS[name]()
        backend = CpuBackend(bandwidth_cap=a.cap)
        probe = tp.plan(model, x, budget=2**40, loss_fn=loss_fn, method="retain", backend=backend)
        prof = probe.to_dict()["profile"]
        up, lb = tp.unplanned_peak(prof), tp.lower_bound(prof)
        base = unplanned_step_stats(model, (x,), loss_fn=loss_fn, repeats=a.repeats)
        print(f"\n{name}: {len(prof['units'])} units; unplanned peak predicted {up / MiB:.1f} MiB, measured "
              f"{base['peak_bytes'] / MiB:.1f} MiB, step {base['step_time'] * 1e3:.0f} ms; lower bound {lb / MiB:.1f} MiB; "
              f"copy bandwidth {prof['d2h_bandwidth'] / 1e9:.2f} / {prof['h2d_bandwidth'] / 1e9:.2f} GB/s")
        for f in a.fractions:
            budget = int(lb + f * (up - lb))
            row: Dict[str, Any] = dict(model=name, fraction=f, budget=budget)
            try:
                sim = probe.replan(budget, method="delta")
            except tp.BudgetError as e:
                print(f"  f={f}: the simulation has no plan ({e})")
                sim = None
            modes: Dict[str, nn.Module] = {"unplanned": model}
            if sim is not None:
                pred = sim.predicted
                modes["plan"] = tp.run(model, sim, backend=backend)
                row.update(sim_time=pred["step_time"], sim_peak=pred["peak_bytes"], sim_counts=sim.counts())
            rt = modes["runtime"] = tp.run(model, tp.delta(budget, profile=prof), backend=backend)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeltaBudgetWarning)  # reported below
                for _ in range(a.warmup):
                    timed_step(rt, model, x, loss_fn)
                peaks = {k: unplanned_step_stats(m, (x,), loss_fn=loss_fn, repeats=1)["peak_bytes"]
                         for k, m in modes.items()}
                times = interleaved(modes, model, x, loss_fn, a.repeats)
            st = rt.last_stats
            for k in ("plan", "runtime"):
                if k in modes:
                    modes[k].close()  # type: ignore[operator]
            row.update(base_time=times["unplanned"])
            if sim is not None:
                row.update(plan_time=times["plan"], plan_peak=peaks["plan"])
            row.update(rt_time=times["runtime"], rt_peak=peaks["runtime"], rt_counter=st.counter_peak_bytes,
                       rt_counts=Counter(d.action for d in st.decisions), rt_releases=len(st.decisions),
                       rt_stall=st.stall_s, rt_replays=st.replays, rt_unsched=st.unscheduled_fetches,
                       rt_limit=st.threshold_bytes, rt_over=st.over_budget_bytes)
            if sim is not None:
                mine = per_unit(sim.actions, st.decisions)
                row["differ"] = sum(p != q for p, q in zip(mine, sim.actions))
                row["differences"] = [f"{prof['units'][i]['name']}: {q} (simulation {p})"
                                      for i, (p, q) in enumerate(zip(sim.actions, mine)) if p != q]
            rows.append(row)
            print(f"  f={f} budget {budget / MiB:.1f} MiB (unplanned step {row['base_time'] * 1e3:.0f} ms):")
            if sim is not None:
                print(f"    simulation: step {row['sim_time'] * 1e3:.0f} ms, peak {row['sim_peak'] / MiB:.1f} MiB, "
                      f"{row['sim_counts']}")
                print(f"    plan mode:  step {row['plan_time'] * 1e3:.0f} ms, measured peak {row['plan_peak'] / MiB:.1f} MiB")
            print(f"    runtime:    step {row['rt_time'] * 1e3:.0f} ms, measured peak {row['rt_peak'] / MiB:.1f} MiB, "
                  f"counter peak {row['rt_counter'] / MiB:.1f} MiB (over by {row['rt_over'] / MiB:.1f}), releasing "
                  f"from {row['rt_limit'] / MiB:.1f} MiB; {row['rt_releases']} tensors released "
                  f"{dict(row['rt_counts'])}, {row['rt_replays']} replays, {row['rt_unsched']} fetched at use, "
                  f"stall {row['rt_stall'] * 1e3:.0f} ms"
                  + (f"; units treated differently from the simulation: {row['differ']}" if "differ" in row else ""))
            if row.get("differences"):
                print("      " + "; ".join(row["differences"]))
        backend.close()


if __name__ == "__main__":
    main()
