"""Parameters and optimizer state kept on the host between optimizer steps (TENSILE), measured.

Profiles a model with its optimizer, then trains it for a few iterations (forward, backward,
``opt.step()``, ``opt.zero_grad()``) three ways: unplanned; under ``tensile`` at the smallest
budget its activation actions alone can meet (no swaps across iterations); and under ``tensile``
at a lower budget that needs parameters and optimizer state on the host. For each: the plan's
predicted peak, the measured peak of every iteration after the first (torch's allocation records
plus what is alive when the iteration starts: ``cuda_exec.memory``), the median iteration time,
and whether losses, gradients, parameters and optimizer state are bitwise those of unplanned
training. Exits 1 if a planned iteration is measured above its prediction or differs.

Run: ``python benches/state_swaps.py [--model gpt|resnet18] [--optimizer adam|sgd] [--steps 4]``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import tensorplace as tp
from cuda_exec.memory import measure_peak, resident_state_bytes
from tensorplace.models import TinyGPT

MiB = 2**20


def model_and_data(name: str) -> Tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    if name == "gpt":
        model: nn.Module = TinyGPT(vocab=512, dim=256, heads=4, layers=4, block=64, dropout=0.1)
        x, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
        return model, x, lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    return model, x, lambda out: F.cross_entropy(out, y)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def train(model: nn.Module, run: nn.Module, opt: Any, x: torch.Tensor, loss_fn: Any, steps: int) -> Dict[str, Any]:
    """``steps`` measured iterations; the record of each (loss, gradients) for the comparison."""
    peaks, losses, grads = [], [], []
    for step in range(steps):
        torch.manual_seed(step)
        seen: Dict[str, Any] = {}

        def iteration() -> None:
            loss = loss_fn(run(x))
            loss.backward()
            seen["loss"] = loss.item()
            seen["grads"] = [p.grad for p in model.parameters()]
            del loss
            opt.step()
            opt.zero_grad()

        start = resident_state_bytes(model, opt, x)
        _, trace = measure_peak(iteration)
        losses.append(seen["loss"])
        grads.append([g.clone() for g in seen.pop("grads")])
        peaks.append(start + trace.peak_bytes)
    return {"peaks": peaks, "losses": losses, "grads": grads}


def timed(run: nn.Module, opt: Any, x: torch.Tensor, loss_fn: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss_fn(run(x)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt", "resnet18"], default="gpt")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    base, x, loss_fn = model_and_data(a.model)
    probe = tp.plan(base, x, budget=2**40, loss_fn=loss_fn, method="retain",
                    optimizer=make_optimizer(a.optimizer, base.parameters()), repeats=3)
    prof = probe.to_dict()["profile"]
    without = tp._core.smallest_known_budget(json.dumps(prof))[0]
    low = tp.lower_bound(prof, state_swaps=True)
    with_swaps = tp._core.smallest_known_budget(json.dumps(prof), state_swaps=True)[0]
    print(f"{a.model} with {a.optimizer}: constant {sum(prof['memory'].values()) / MiB:.2f} MiB "
          f"({json.dumps({k: round(v / MiB, 2) for k, v in prof['memory'].items()})}); smallest budget without swaps "
          f"across iterations {without / MiB:.2f} MiB, with them {with_swaps / MiB:.2f} MiB (lower bound {low / MiB:.2f} MiB)")
    rows = [("unplanned", None), ("tensile", without), ("tensile", (with_swaps + without) // 2), ("tensile", with_swaps)]
    reference = None
    ok = True
    for method, budget in rows:
        model = copy.deepcopy(base)
        opt = make_optimizer(a.optimizer, model.parameters())
        if budget is None:
            plan, run = None, model
        else:
            plan = probe.replan(budget, method=method)
            run = tp.run(model, plan, optimizer=opt)
        rec = train(model, run, opt, x, loss_fn, a.steps)
        step_time = timed(run, opt, x, loss_fn, a.steps)
        if hasattr(run, "executor") and run.executor.swapper is not None:
            run.executor.swapper.materialize()
        state = [p.detach().clone() for p in model.parameters()]
        state += [t.clone() for p in model.parameters() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
        if reference is None:
            reference = (rec, state)
            same = "-"
        else:
            r, s = reference
            same_bits = (rec["losses"] == r["losses"]
                         and all(torch.equal(g, h) for gs, hs in zip(rec["grads"], r["grads"]) for g, h in zip(gs, hs))
                         and all(torch.equal(t, u) for t, u in zip(state, s)))
            same = "yes" if same_bits else "NO"
            ok &= same_bits
        # (not the first iteration: it frees tensors allocated before any measurement, frees torch's
        # profiler does not record)
        measured = max(rec["peaks"][1:])
        if plan is None:
            print(f"  unplanned: predicted peak {tp.unplanned_peak(prof) / MiB:.2f} MiB; measured peak "
                  f"{measured / MiB:.2f} MiB, iteration {step_time * 1e3:.1f} ms")
            continue
        pred = plan.predicted
        ss = plan.state_swaps or {}
        moved = sum(prof["units"][u]["param_bytes"] for u in ss.get("parameters", []))
        moved += sum(prof["units"][u]["optimizer_state_bytes"] for u in ss.get("optimizer_state", []))
        over = measured > pred["peak_bytes"]
        ok &= not over
        print(f"  {method} at {budget / MiB:.2f} MiB: {plan.counts()}, across iterations {len(ss.get('parameters', []))} "
              f"units' parameters and {len(ss.get('optimizer_state', []))} units' state ({moved / MiB:.2f} MiB) on the host; "
              f"predicted peak {pred['peak_bytes'] / MiB:.2f} MiB, step {pred['step_time'] * 1e3:.1f} ms; measured peak "
              f"{measured / MiB:.2f} MiB{' (OVER)' if over else ''}, iteration {step_time * 1e3:.1f} ms; bitwise {same}")
        run.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
