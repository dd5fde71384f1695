"""Profiles of the package's TinyGPT at many depths, saved as the planner benches' test data
(rust_core/tests/data/tinygpt-<units>.json: compact JSON, one per depth).

Each is profiled as issue 21 measured them: TinyGPT at width 16 (4 heads, vocab 50, block 16),
one sequence of 16 tokens, ``tp.plan(model, x, budget, method="retain", repeats=REPEATS)`` on this
CPU, and the plan's profile saved. Layers -> units: 10 per layer plus 5. The issue profiled with
``repeats=1``; the saved profiles use 3 (each unit's time the median of 3 steps): on this shared
2-core CPU one step's stage times had outliers of up to a second from other jobs' load (a 1,005-unit
profile summed to 3.56 s of compute where its median unit took 13 us).

Usage: python benches/tinygpt_profiles.py [--repeats 3] [LAYERS ...]   (default: 6 12 25 50 100 200)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import tensorplace as tp
from tensorplace.models import TinyGPT

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "rust_core", "tests", "data")


def profile(layers: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(dim=16, layers=layers)
    x = torch.randint(0, 50, (1, 16))
    plan = tp.plan(model, x, 2**50, method="retain", repeats=repeats)
    return plan.to_dict()["profile"]


def main() -> None:
    args = sys.argv[1:]
    repeats = 3
    if args[:1] == ["--repeats"]:
        repeats, args = int(args[1]), args[2:]
    depths = [int(a) for a in args] or [6, 12, 25, 50, 100, 200]
    os.makedirs(DATA, exist_ok=True)
    for layers in depths:
        t0 = time.perf_counter()
        prof = profile(layers, repeats)
        n = len(prof["units"])
        path = os.path.join(DATA, f"tinygpt-{n}.json")
        with open(path, "w") as f:
            json.dump(prof, f, separators=(",", ":"))
            f.write("\n")
        print(f"{layers} layers: {n} units, profiled in {time.perf_counter() - t0:.1f} s, {os.path.getsize(path)} bytes -> {path}")


if __name__ == "__main__":
    main()
