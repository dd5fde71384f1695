"""Page faults and resident memory of steady training steps on this CPU (issue 6).

A CPU step that grows the C heap pays a minor page fault for every new page; a step that only
reuses memory freed by the previous step pays none. One process builds the model (default: the
6-layer TinyGPT of the peers comparison, batch 8, 256 tokens) and times, in turn, steady steps of
the plain model, of torch's checkpoint around every block, and of tensorplace's per-block plan
(`checkpoint-blocks`). For each it prints the minor faults of every step (getrusage) and the
resident set size after it (/proc/self/statm).

Before the executor's per-step objects stopped forming reference cycles (they waited for a
garbage collection, splitting the heap's free blocks meanwhile), the per-block plan took ~50,000
faults a step and grew ~200 MiB a step on this CPU, with the heap kept (`--host-malloc keep`).

Run: ``python benches/step_faults.py [--steps 8] [--host-malloc keep|default]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

import tensorplace as tp
from tensorplace.bench.common import _OWN, host_malloc
from tensorplace.peers import block_modules, checkpoint_blocks


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt6", choices=["gpt", "gpt6"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--host-malloc", default="keep", choices=["keep", "default"])
    a = ap.parse_args()
    print("host malloc:", host_malloc(a.host_malloc))
    torch.manual_seed(0)
    model, (x,), loss_fn = _OWN[a.model][1](a.batch, 0, a.seq, 0)
    probe = tp.plan(model, x, budget=2**50, loss_fn=loss_fn, method="retain", repeats=1)
    per_block = probe.replan(2**50, method="checkpoint-blocks")
    modes = {
        "plain": model,
        "torch checkpoint per block": checkpoint_blocks(model, block_modules(per_block)),
        "tensorplace checkpoint-blocks": tp.run(model, per_block),
    }

    def step(module: torch.nn.Module) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss_fn(module(x)).backward()
        for p in module.parameters():
            p.grad = None
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    for name, module in modes.items():
        for _ in range(2):  # the executor's first step learns; warm the heap
            step(module)
        faults, rss = [], []
        for _ in range(a.steps):
            faults.append(step(module))
            rss.append(rss_mib())
        print(f"{name:32s} faults/step median {statistics.median(faults):>8.0f} (max {max(faults)}), "
              f"RSS {rss[0]:.0f} -> {rss[-1]:.0f} MiB over {a.steps} steps")


if __name__ == "__main__":
    main()
