"""torch.compile'd training steps: unplanned, torch's checkpoint per block, and tensorplace's plans
run by the compiled engine (``tensorplace.compiled``, torch's selective checkpointing).

    python benches/compiled_engine.py --model gpt6 --batch 8 --seq 256 [--repeats 5]
    python benches/compiled_engine.py --model resnet18 --batch 32 --image 128
    python benches/compiled_engine.py --model gpt6 --device cuda --methods --at-checkpoint

Rows: compiled unplanned, compiled torch checkpoint per block, tensorplace's ``--methods`` plans
(default checkpoint-blocks, recompute-all), PSO plans at ``--fractions`` of the way from the
lower bound to the unplanned peak (retain and recompute only; ``--swap-fractions``: with swaps), and with ``--at-checkpoint`` PSO
plans whose budget is the compiled checkpoint's measured peak: one without swaps, and where the
installed torch can lower swaps to its compiled offload (``compiled_offload_supported``) and the
device is CUDA, one with swaps.

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
from tensorplace.bench.common import loss_and_grads, model_args, model_from_args
from tensorplace.compiled_engine import compiled_offload_supported
from tensorplace.peers import block_modules, checkpoint_blocks
from tensorplace.profiler import unplanned_step_stats


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap, batch=8, default="gpt6")
    ap.set_defaults(device="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--methods", nargs="*", default=["checkpoint-blocks", "recompute-all"])
    ap.add_argument("--fractions", type=float, nargs="*", default=[])
    ap.add_argument("--swap-fractions", type=float, nargs="*", default=[],
                    help="PSO plans with swaps (offloaded where compiled_offload_supported) at these fractions")
    ap.add_argument("--at-checkpoint", action="store_true")
    ap.add_argument("--offload-stream", type=int, choices=[0, 1], default=0,
                    help="compiled offload on a CUDA stream of its own (default 0: the compute stream)")
    ap.add_argument("--particles", type=int, default=100)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--json", help="append the rows to this JSON-lines file")
    a = ap.parse_args(argv)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    built = model_from_args(a)
    model, inputs = built.model, built.inputs
    loss_fn = built.loss_fn or (lambda out: out.float().pow(2).mean())
    x = inputs[0]
    for m in model.modules():  # dropout off: the rows' values are comparable across engines
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    retained = tp.plan(copy.deepcopy(model), x, budget=1 << 40, loss_fn=loss_fn, method="retain", repeats=1)
    profile = retained.profile
    lb, up = tp.lower_bound(profile), retained.predicted["peak_bytes"]
    search = dict(particles=a.particles, iterations=a.iterations)
    plans = {m: tp.plan_profile(profile, 1 << 40, m) for m in a.methods}
    for f in a.fractions:
        plans[f"pso {f:g} (no swaps)"] = tp.plan_profile(profile, int(lb + f * (up - lb)), "pso", swaps=False, **search)
    for f in a.swap_fractions:
        plans[f"pso {f:g} (swaps)"] = tp.plan_profile(profile, int(lb + f * (up - lb)), "pso", **search)
    blocks = block_modules(tp.plan_profile(profile, 1 << 40, "checkpoint-blocks"))
    rows: List[Dict[str, Any]] = []

    def measure(name: str, make: Any, params: torch.nn.Module, plan: Any = None) -> Dict[str, Any]:
        torch._dynamo.reset()
        module = make()
        t0 = time.perf_counter()
        grads = loss_and_grads(module, params, x, loss_fn)  # compiles
        compile_s = time.perf_counter() - t0
        stats = unplanned_step_stats(module, (x,), loss_fn=loss_fn, repeats=a.repeats)
        row = {"row": name, "peak_bytes": stats["peak_bytes"], "step_time": stats["step_time"], "compile_s": compile_s,
               "grads": grads}
        if plan is not None:
            row["predicted_peak_bytes"] = plan.predicted["peak_bytes"]
            row["counts"] = plan.counts()
        rows.append(row)
        row["max_diff"] = max(float((g - h).abs().max()) for g, h in zip(rows[0]["grads"], grads))
        if a.json:  # each row as soon as it is measured
            with open(a.json, "a") as f:
                f.write(json.dumps({"model": a.model, "batch": a.batch, "device": a.device,
                                    **{k: v for k, v in row.items() if k != "grads"}}) + "\n")
        print(f"{name}: peak {tp.format_bytes(row['peak_bytes'])}, step {row['step_time'] * 1e3:.1f} ms "
              f"(compile {compile_s:.0f} s)", file=sys.stderr, flush=True)
        return row

    def measure_plan(name: str, plan: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            wrapper = tp.compiled(model, plan, offload_stream=bool(a.offload_stream))
        try:
            measure(f"compiled tensorplace {name}", lambda: torch.compile(wrapper), model, plan)
        finally:
            wrapper.close()

    measure("compiled unplanned", lambda: torch.compile(model), model)
    ckpt = checkpoint_blocks(copy.deepcopy(model), blocks)
    ck_row = measure("compiled torch checkpoint per block", lambda: torch.compile(ckpt), ckpt)
    for m, plan in plans.items():
        measure_plan(m, plan)
    if a.at_checkpoint:
        budget = int(ck_row["peak_bytes"])  # below what the eager model can plan for: its smallest budget
        try:
            tp.plan_profile(profile, budget, "pso", swaps=False, particles=10, iterations=2)
        except tp.BudgetError as e:
            budget = max(budget, int(e.args[1]) if len(e.args) > 1 else tp.lower_bound(profile))
            print(f"the checkpoint's peak is below the smallest budget of a plan without swaps; planned at "
                  f"{tp.format_bytes(budget)}", file=sys.stderr)
        measure_plan("pso at checkpoint's peak (no swaps)",
                     tp.plan_profile(profile, budget, "pso", swaps=False, **search))
        if compiled_offload_supported() and torch.device(a.device).type == "cuda":
            measure_plan("pso at checkpoint's peak (swaps offloaded)", tp.plan_profile(profile, budget, "pso", **search))
    print(f"\n{a.model} batch {a.batch} on {a.device}: torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| row | peak | step | x ckpt | max diff vs compiled unplanned | predicted peak (eager model) |")
    print("|---|---|---|---|---|---|")
    ck = rows[1]["step_time"]
    for r in rows:
        pred = tp.format_bytes(r["predicted_peak_bytes"]) if "predicted_peak_bytes" in r else ""
        print(f"| {r['row']} | {tp.format_bytes(r['peak_bytes'])} | {r['step_time'] * 1e3:.1f} ms | "
              f"{r['step_time'] / ck:.2f} | {r['max_diff']:.1e} | {pred} |")


if __name__ == "__main__":
    main(sys.argv[1:])
