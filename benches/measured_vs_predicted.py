"""Measured against predicted peaks over many searched plans (a fuzz of the executor/model contract).

Profiles a GPT-style model once through a CPU backend with a capped host link, then for each seed
and budget searches a PSO plan, runs one measured training step under it and compares the
measured peak (torch's allocation records) with the plan's prediction. A plan measured above its
prediction is a bug of the executor or of the cost model (docs/cost-model.md says the executor is
never less conservative on memory). Timing matters (copies finish late or early), so run it on a
loaded and on an idle machine.

Run: ``python benches/measured_vs_predicted.py [--seeds 14] [--link 0.15]``; exits 1 if a plan
was measured over its prediction.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.nn.functional as F

import tensorplace as tp
from cuda_exec.cpu_backend import CpuBackend
from tensorplace.models import TinyGPT
from tensorplace.profiler import unplanned_step_stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=14)
    ap.add_argument("--link", type=float, default=0.15, help="host link cap, GB/s")
    ap.add_argument("--budgets", type=int, nargs="+", default=[3_900_000, 4_152_528, 4_600_000, 5_200_000, 5_926_872])
    ap.add_argument("--save-over", default=None, metavar="DIR", help="save the plans measured over their prediction here")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=4, block=64, dropout=0.1)
    x, y = torch.randint(0, 128, (4, 64)), torch.randint(0, 128, (4, 64))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    backend = CpuBackend(bandwidth_cap=a.link * 1e9)
    probe = tp.plan(model, x, budget=2**50, loss_fn=loss_fn, method="retain", backend=backend, repeats=1)
    over = total = 0
    try:
        for seed in range(a.seeds):
            for budget in a.budgets:
                try:
                    plan = probe.replan(budget, method="pso", particles=20, iterations=10, seed=seed)
                except tp.BudgetError:
                    continue
                fast = tp.run(model, plan, backend=backend)
                try:
                    measured = unplanned_step_stats(fast, (x,), loss_fn=loss_fn, repeats=1)["peak_bytes"]
                finally:
                    fast.close()
                predicted = plan.predicted["peak_bytes"]
                total += 1
                over += measured > predicted
                if measured > predicted and a.save_over:
                    os.makedirs(a.save_over, exist_ok=True)
                    plan.save(os.path.join(a.save_over, f"over-{seed}-{budget}.plan.json"))
                print(f"seed {seed:3d} budget {budget:9d} predicted {predicted:9d} measured {measured:9d} "
                      f"{measured - predicted:+8d} {plan.counts()}{'  OVER' if measured > predicted else ''}",
                      flush=True)
    finally:
        backend.close()
    print(f"{over} of {total} plans measured over their predicted peak")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
