"""Issue 18's GPU check: predicted against measured allocated (and reserved) peaks of whole-model
plans on the device, and reserved-budget plans run under ``set_per_process_memory_fraction``.

    python benches/gpu_plans.py --out DIR [--model resnet50 --batch 128 --image 224]
    python benches/gpu_plans.py --out DIR --reserved 5519MiB   # one reserved budget, capped

Without ``--reserved``: the unplanned step, then swap-all, recompute-all and PSO at the allocated
budgets that cut ``--fractions`` of the activation peak, each measured from an empty cache (peak
allocated and reserved, median step of ``--repeats``) and checked bitwise against the unplanned
step. With ``--reserved B``: one plan searched with ``budget_kind="reserved"`` at B, run with the
process capped at B (``torch.cuda.set_per_process_memory_fraction``); run it in its own process,
last (an out-of-memory error may change cuDNN's choices for the rest of a process). Each row is
appended to DIR/gpu-plans.jsonl as soon as it is measured. On a CPU (``--device cpu``) the same
rows run without the CUDA counters: a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict

import torch

import tensorplace as tp
from tensorplace import peers
from tensorplace.bench import common


def emit(out: str, row: Dict[str, Any]) -> None:
    row = {"time": time.strftime("%H:%M:%S"), **row}
    print(json.dumps(row), flush=True)
    with open(os.path.join(out, "gpu-plans.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def host_and_step(module: Any, x: Any, loss_fn: Any, dev: Any, repeats: int) -> Dict[str, float]:
    """Median over ``repeats`` steps of the host's time to issue a step (until backward returns)
    and of the whole step (until the device is done): equal where the step is host-bound."""
    host, step = [], []
    for _ in range(repeats):
        for p in module.parameters():
            p.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        loss_fn(module(x)).backward()
        t1 = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        host.append(t1 - t0)
        step.append(t2 - t0)
    for p in module.parameters():
        p.grad = None
    return {"host_issue_time": sorted(host)[len(host) // 2], "synced_step_time": sorted(step)[len(step) // 2]}


def record_trace(module: Any, x: Any, loss_fn: Any, dev: Any, path: str, **info: Any) -> None:
    """One training step of ``module`` from an empty cache, its caching-allocator events written
    to ``path`` as an allocator trace (docs/formats.md)."""
    peers._fresh(dev)
    for p in module.parameters():
        p.grad = None
    torch.cuda.synchronize(dev)
    at_start = {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev)}
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        torch.manual_seed(0)
        loss_fn(module(x)).backward()
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [{"action": e["action"], "addr": e["addr"], "size": e["size"], "stream": e.get("stream", 0)}
              for e in snap["device_traces"][dev.index or 0]]
    for p in module.parameters():
        p.grad = None
    with open(path, "w") as f:
        json.dump({"format": "cuda-caching-allocator-trace", **info, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(dev),
                   "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "at_start": at_start,
                   "max_allocated": torch.cuda.max_memory_allocated(dev),
                   "max_reserved": torch.cuda.max_memory_reserved(dev), "events": events}, f)


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5])
    ap.add_argument("--methods", nargs="+", default=["swap-all", "recompute-all", "pso"])
    ap.add_argument("--reserved", type=common.budget, default=None)
    ap.add_argument("--particles", type=int, default=100)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--trace", action="store_true",
                    help="also record each plan's allocator trace of one step (DIR/alloc-ROW.json) and save the plan")
    return ap


def main() -> int:
    a = arguments().parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if cuda:  # bitwise comparisons need deterministic kernels
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    rm = common.build_model(a.model, a.batch, image=a.image, seq=a.seq, classes=a.classes, device=dev)
    model, (x,), loss_fn = rm.model, rm.inputs, rm.loss_fn
    tag = {"model": a.model, "batch": a.batch, "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if cuda else None, "torch": torch.__version__}
    reference = peers._step(model, x, loss_fn)
    base = peers._measure(model, x, loss_fn, a.repeats)
    emit(a.out, {**tag, "row": "unplanned", **base, **host_and_step(model, x, loss_fn, dev, a.repeats)})
    if a.trace and cuda:
        record_trace(model, x, loss_fn, dev, os.path.join(a.out, "alloc-unplanned.json"), model=a.model,
                     batch=a.batch, scenario="unplanned")
    t0 = time.perf_counter()
    probe = tp.plan(model, x, 2**50, loss_fn=loss_fn, method="retain")
    emit(a.out, {**tag, "row": "profile", "seconds": time.perf_counter() - t0,
                 "predicted_step_time": probe.predicted["step_time"], "predicted_peak_bytes": probe.predicted["peak_bytes"]})
    prof = probe.to_dict()["profile"]
    if a.reserved is None:  # the profile, for planning anywhere later (a plan file carries it)
        probe.save(os.path.join(a.out, f"{a.model}-b{a.batch}.retain.plan.json"))
    search = {"particles": a.particles, "iterations": a.iterations, "seed": 0}
    cases = []
    if a.reserved is not None:
        cases.append(("pso-reserved", a.reserved, "pso", {"budget_kind": "reserved", **search}))
    else:
        peak = int(probe.predicted["peak_bytes"])
        for frac in a.fractions:
            budget = int(peak - frac * (peak - common.fixed_bytes(prof)))
            for m in a.methods:
                fixed = m in ("swap-all", "recompute-all", "retain", "checkpoint-blocks")  # any budget: one plan
                if fixed and frac != a.fractions[0]:
                    continue
                cases.append((m if fixed else f"{m}@{frac}", 2**50 if fixed else budget, m, {} if fixed else search))
    for name, budget, method, kw in cases:
        row: Dict[str, Any] = {**tag, "row": name, "budget_bytes": budget}
        try:
            t0 = time.perf_counter()
            plan = probe.replan(budget, method, **kw)
            row.update(plan_seconds=time.perf_counter() - t0, counts=plan.counts(),
                       predicted_step_time=plan.predicted["step_time"],
                       predicted_peak_bytes=plan.predicted["peak_bytes"],
                       predicted_reserved_bytes=plan.predicted.get("reserved_bytes"),
                       reserved_note=((plan.settings or {}).get("reserved_search") or {}).get("note"))
            if a.reserved is not None and cuda:  # capped from here on: the unplanned steps above were not
                peers._fresh(dev)
                total = torch.cuda.get_device_properties(dev).total_memory
                torch.cuda.set_per_process_memory_fraction(a.reserved / total, dev)
                row["memory_fraction"] = a.reserved / total
            fast = tp.run(model, plan)
            try:
                row.update(peers._measure(fast, x, loss_fn, a.repeats))
                row["bitwise"] = peers._equal(peers._step(fast, x, loss_fn), reference)
                row.update(host_and_step(fast, x, loss_fn, dev, a.repeats))
                stats = getattr(fast, "last_stats", None)
                row["stats"] = {k: v for k, v in vars(stats).items() if isinstance(v, (int, float, bool))} if stats else None
                if a.trace and cuda:
                    safe = name.replace("@", "-")
                    plan.save(os.path.join(a.out, f"plan-{safe}.json"))
                    record_trace(fast, x, loss_fn, dev, os.path.join(a.out, f"alloc-{safe}.json"), model=a.model,
                                 batch=a.batch, scenario=name, plan_counts=plan.counts())
            finally:
                fast.close()
        except Exception as e:  # keep going: the next row may still measure
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        emit(a.out, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
