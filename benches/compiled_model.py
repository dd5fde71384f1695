"""The compiled engine's own cost model against measurement: plans searched for the compiled engine
(``tensorplace.compiled_cost.plan_compiled``) at three budgets between its smallest predicted peak
and the compiled all-retain step's peak, each compiled with ``torch.compile`` and measured, beside
the compiled unplanned step and torch's checkpoint per block (compiled).

    python benches/compiled_model.py --model gpt6 --batch 8 --seq 256
    python benches/compiled_model.py --model resnet18 --batch 32 --image 128

Per row: the budget, the cost model's own estimate of the peak, the plan's predicted peak (the
search's measurement of the plan: ``plan_compiled`` verifies), the measured peak of a fresh compile
(torch's allocation records with constant memory: ``tensorplace.profiler.unplanned_step_stats`` on
the compiled module), the ratios, the median and the best step of ``--repeats`` (the best against
the compiled checkpoint per block's best: on a shared CPU the best is the least disturbed), and the
largest difference of the loss and gradients from the compiled unplanned step.
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
from tensorplace.compiled_cost import CompiledCostModel, plan_compiled
from tensorplace.peers import checkpoint_blocks
from tensorplace.profiler import unplanned_step_stats


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap, batch=8, default="gpt6")
    ap.set_defaults(device="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fractions", default="0.25,0.5,0.75",
                    help="budgets as fractions of the way from the smallest predicted peak to the all-retain peak")
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", help="append the rows to this JSON-lines file")
    a = ap.parse_args(argv)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    built = model_from_args(a)
    model, x = built.model, built.inputs[0]
    loss_fn = built.loss_fn or (lambda out: out.float().pow(2).mean())
    for m in model.modules():  # dropout off: the rows' values are comparable across engines
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    t0 = time.perf_counter()
    cm = CompiledCostModel.measure(model, (x,), loss_fn, repeats=a.repeats)
    print(f"cost model measured in {time.perf_counter() - t0:.0f} s ({len(cm.costs)} region measurements, "
          f"{len(cm.regions)} regions)", file=sys.stderr, flush=True)
    rows: List[Dict[str, Any]] = []

    def measure(name: str, make: Any, params: torch.nn.Module, **extra: Any) -> Dict[str, Any]:
        torch._dynamo.reset()
        module = make()
        grads = loss_and_grads(module, params, x, loss_fn)  # compiles
        stats = unplanned_step_stats(module, (x,), loss_fn=loss_fn, repeats=a.repeats)
        row = {"row": name, "peak_bytes": stats["peak_bytes"], "step_time": stats["step_time"],
               "step_best": min(stats["step_times"]), "grads": grads, **extra}
        rows.append(row)
        print(f"{name}: peak {tp.format_bytes(row['peak_bytes'])}, step {row['step_time'] * 1e3:.1f} ms",
              file=sys.stderr, flush=True)
        return row

    measure("compiled unplanned", lambda: torch.compile(model), model)
    ckpt = checkpoint_blocks(copy.deepcopy(model), cm.region_names)
    measure("compiled torch checkpoint per block", lambda: torch.compile(ckpt), ckpt)
    low, high = cm.lower_bound(), cm.calibration["retain"]["peak_bytes"]
    for f in [float(s) for s in a.fractions.split(",")]:
        budget = int(low + f * (high - low))
        plan = plan_compiled(model, x, budget, loss_fn, cost_model=cm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            wrapper = tp.compiled(model, plan)
        acts = plan.actions
        pattern = " ".join("".join("R" if acts[u] == "recompute" else "." for u in i.units) for i in cm.regions)
        try:
            cp = plan.to_dict()["compiled_prediction"]
            measure(f"tensorplace compiled-search {f:g}", lambda: torch.compile(wrapper), model, budget=budget,
                    predicted_peak_bytes=plan.predicted["peak_bytes"], predicted_step=plan.predicted["step_time"],
                    model_peak_bytes=cp["model_peak_bytes"], model_step=cp["model_step_time"], pattern=pattern)
        finally:
            wrapper.close()
    ref = rows[0]["grads"]
    ck = rows[1]["step_best"]
    print(f"\n{a.model} batch {a.batch}: torch {torch.__version__}, {torch.get_num_threads()} threads; cost model: "
          f"lower bound {tp.format_bytes(low)}, all-retain {tp.format_bytes(high)}, measured in {cm.measure_time:.0f} s")
    print("| row | budget | model's peak | predicted peak (verified) | measured peak | measured / predicted | "
          "measured / model | step: median, best | best x ckpt's | max diff vs compiled unplanned |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        diff = max(float((g - h).abs().max()) for g, h in zip(ref, r.pop("grads")))
        r["max_diff"] = diff
        pred = r.get("predicted_peak_bytes")
        if pred:
            print(f"| {r['row']} | {tp.format_bytes(r['budget'])} | {tp.format_bytes(r['model_peak_bytes'])} | "
                  f"{tp.format_bytes(pred)} | {tp.format_bytes(r['peak_bytes'])} | {r['peak_bytes'] / pred:.3f} | "
                  f"{r['peak_bytes'] / r['model_peak_bytes']:.3f} | ", end="")
        else:
            print(f"| {r['row']} | | | | {tp.format_bytes(r['peak_bytes'])} | | | ", end="")
        print(f"{r['step_time'] * 1e3:.0f}, {r['step_best'] * 1e3:.0f} ms | {r['step_best'] / ck:.2f} | {diff:.1e} |")
    for r in rows:
        if "pattern" in r:
            print(f"{r['row']}: per region (R recomputed unit, . retained): {r['pattern']}")
    print(f"\nmodel-only predictions of the whole-step measurements the search made (measured / model): "
          + ", ".join(f"{m['peak_bytes'] / cm.predict(list(k))['peak_bytes']:.3f}" for k, m in cm.verified.items()))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({"model": a.model, "batch": a.batch, "cost_model": cm.to_dict(),
                                "verified": [[list(k), v] for k, v in cm.verified.items()]}, default=str) + "\n")
            for r in rows:
                f.write(json.dumps({"model": a.model, "batch": a.batch, "torch": torch.__version__, **r}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
