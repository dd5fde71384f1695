"""Host overhead of the executor per unit (issue 6), on a stack of tiny kernels.

A 193-unit stack (64 x Linear -> LayerNorm -> GELU, then a Linear), width 32, batch 8: every
kernel takes a few microseconds, so the step time is mostly host work. One training step (forward,
sum loss, backward, grads set to None) is timed in three modes, interleaved in one process:

* ``unplanned``: the model itself;
* ``retain``: ``PlannedModule`` with the all-retain plan;
* ``swap1``: ``PlannedModule`` with one swapped unit near the end (the last LayerNorm: its mean,
  rstd and output are swapped to the CPU backend's host tier), the rest retained;
* ``recompute1``: the same unit recomputed instead (``--recompute``: its segment is tracked and
  replayed in backward, the rest runs as in ``retain``);
* ``delta``: DELTA's runtime policy (``--delta``, cuda_exec/delta_policy.py) with a budget the
  step never comes near, so nothing moves: what the full unit tracker, the live counter and the
  records of every saved tensor cost in every step.

It prints the median step time of each mode and the overhead per unit over ``unplanned`` in
microseconds. Run: ``nice python benches/executor_overhead.py [--steps 60] [--width 32]
[--recompute] [--delta]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from cuda_exec.cpu_backend import CpuBackend
from cuda_exec.executor import PlannedModule


def build(blocks: int, width: int) -> nn.Sequential:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def step(module: nn.Module, model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    module(x).sum().backward()
    t1 = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--recompute", action="store_true", help="also time the recompute1 mode")
    ap.add_argument("--delta", action="store_true", help="also time DELTA's runtime policy (nothing released)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build(a.blocks, a.width)
    n = len(model)
    x = torch.randn(a.batch, a.width)
    backend = CpuBackend()
    swap1 = ["retain"] * n
    swap1[n - 3] = "swap"  # the last LayerNorm
    modes = {
        "unplanned": model,
        "retain": PlannedModule(model, ["retain"] * n, backend=backend),
        "swap1": PlannedModule(model, swap1, backend=backend),
    }
    if a.recompute:
        rec1 = ["retain"] * n
        rec1[n - 3] = "recompute"
        modes["recompute1"] = PlannedModule(model, rec1, backend=backend)
    if a.delta:
        from cuda_exec.delta_policy import DeltaModule  # here: the bench also runs on older checkouts

        modes["delta"] = DeltaModule(model, 1 << 40, backend=backend, bandwidth=(1e9, 1e9))
    times = {k: [] for k in modes}
    for k, m in modes.items():  # warm-up (and the executor's first step)
        for _ in range(3):
            step(m, model, x)
    for _ in range(a.steps):
        for k, m in modes.items():
            times[k].append(step(m, model, x))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{n} units, width {a.width}, batch {a.batch}, {a.steps} interleaved steps per mode, "
          f"torch threads {a.threads}")
    for k in modes:
        over = (med[k] - med["unplanned"]) / n * 1e6
        print(f"  {k:10s} median step {med[k] * 1e3:8.2f} ms   over unplanned: {over:7.1f} us/unit")
    for m in modes.values():
        if m is not model:
            m.close()
    backend.close()


if __name__ == "__main__":
    main()
