"""torch.compile'd training steps: unplanned, torch's checkpoint per block, and tensorplace's plans
run by the compiled engine (``tensorplace.compiled``, torch's selective checkpointing).

    python benches/compiled_engine.py --model gpt6 --batch 8 --seq 256 [--repeats 5]
    python benches/compiled_engine.py --model resnet18 --batch 32 --image 128

Per row: the measured peak (torch's allocation records, constant memory included:
``tensorplace.profiler.unplanned_step_stats`` on the compiled module), the median step, the
largest difference of the loss and gradients from the compiled unplanned step, and for
tensorplace's rows the plan's predicted peak (the eager executor's cost model: this engine's
own prediction is not built yet, docs/compiled.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from typing import Any, Dict, List

import torch

import tensorplace as tp
from tensorplace.bench.common import build_model
from tensorplace.peers import block_modules, checkpoint_blocks
from tensorplace.profiler import unplanned_step_stats


def _grads(module: torch.nn.Module, params: torch.nn.Module, x: Any, loss_fn: Any) -> List[torch.Tensor]:
    for p in params.parameters():
        p.grad = None
    torch.manual_seed(0)
    loss = loss_fn(module(x))
    loss.backward()
    out = [loss.detach().clone()] + [p.grad.detach().clone() for p in params.parameters() if p.grad is not None]
    for p in params.parameters():
        p.grad = None
    return out


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt6")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", help="append the rows to this JSON-lines file")
    a = ap.parse_args(argv)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    built = build_model(a.model, a.batch, image=a.image, seq=a.seq, classes=a.classes)
    model, inputs = built.model, built.inputs
    loss_fn = built.loss_fn or (lambda out: out.float().pow(2).mean())
    x = inputs[0]
    for m in model.modules():  # dropout off: the rows' values are comparable across engines
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    plans = {m: tp.plan(copy.deepcopy(model), x, budget=1 << 40, loss_fn=loss_fn, method=m, repeats=1)
             for m in ("checkpoint-blocks", "recompute-all")}
    blocks = block_modules(plans["checkpoint-blocks"])
    rows: List[Dict[str, Any]] = []

    def measure(name: str, make: Any, params: torch.nn.Module, plan: Any = None) -> None:
        torch._dynamo.reset()
        module = make()
        t0 = time.perf_counter()
        grads = _grads(module, params, x, loss_fn)  # compiles
        compile_s = time.perf_counter() - t0
        stats = unplanned_step_stats(module, (x,), loss_fn=loss_fn, repeats=a.repeats)
        row = {"row": name, "peak_bytes": stats["peak_bytes"], "step_time": stats["step_time"], "compile_s": compile_s,
               "grads": grads}
        if plan is not None:
            row["predicted_peak_bytes"] = plan.predicted["peak_bytes"]
        rows.append(row)
        print(f"{name}: peak {tp.format_bytes(row['peak_bytes'])}, step {row['step_time'] * 1e3:.1f} ms "
              f"(compile {compile_s:.0f} s)", file=sys.stderr, flush=True)

    measure("compiled unplanned", lambda: torch.compile(model), model)
    ckpt = checkpoint_blocks(copy.deepcopy(model), blocks)
    measure("compiled torch checkpoint per block", lambda: torch.compile(ckpt), ckpt)
    for m, plan in plans.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            wrapper = tp.compiled(model, plan)
        try:
            measure(f"compiled tensorplace {m}", lambda: torch.compile(wrapper), model, plan)
        finally:
            wrapper.close()
    ref = rows[0]["grads"]
    print(f"\n{a.model} batch {a.batch}: torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| row | peak | step | x ckpt | max diff vs compiled unplanned | predicted peak (eager model) |")
    print("|---|---|---|---|---|---|")
    ck = rows[1]["step_time"]
    for r in rows:
        diff = max(float((g - h).abs().max()) for g, h in zip(ref, r.pop("grads")))
        r["max_diff"] = diff
        pred = tp.format_bytes(r["predicted_peak_bytes"]) if "predicted_peak_bytes" in r else ""
        print(f"| {r['row']} | {tp.format_bytes(r['peak_bytes'])} | {r['step_time'] * 1e3:.1f} ms | "
              f"{r['step_time'] / ck:.2f} | {diff:.1e} | {pred} |")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"model": a.model, "batch": a.batch, **r}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
