"""Host cost of the executor per moved unit (issue 17), on a stack of tiny kernels.

A 193-unit stack: 64 blocks (``nn.Sequential`` of Linear -> LayerNorm -> GELU), then a Linear;
width 32, batch 8, one thread. Every kernel takes a few microseconds, so a step is host work, as a
step on a fast GPU is. It is profiled once (``tensorplace.plan(..., method="retain")``) and the
planner makes the plans below from that profile (with their prefetch schedules and swap
deadlines); one training step (forward, sum loss, backward, grads set to None) of each is timed,
interleaved in one process, after warm-up steps (the executor's learning step among them); each
timed step follows an untimed step of the same mode, so that its caches are warm as in training
(a step right after another mode's took several percent longer, a cost no training run pays):

* ``unplanned``: the model, which no executor hooks (each plan below trains a copy of its own:
  an executor's module hooks stay on its model between its steps); ``forward``: its forward
  alone (grad on, no backward);
* ``hooks only``: that copy under saved-tensor hooks that return what they get and a no-op
  forward pre-hook on every unit: what an executor built on these hooks pays before it does
  anything (printed per unit, a reference, not a plan);
* ``retain``: the all-retain plan (nothing moves);
* ``swap-all``: every unit swapped to the CPU backend's host tier;
* ``recompute-all``: every unit recomputed, in the profile's default checkpoint segments (one
  per block);
* ``checkpoint-blocks``: the units of every repeated block recomputed, one segment per block.

Per plan it prints the median step, the units the plan moves, and the executor's cost per moved
unit: (median step - unplanned step - recompute) / moved units, where recompute is what the
replays' forwards cost, the forward of the recomputed units (their share of the profile's
forward times, times the measured forward); for all-retain, per unit. ``--json FILE`` writes the
figures. Run: ``nice python benches/executor_overhead.py [--rounds 15]``.

``--device cuda`` runs the stack on the GPU with the CUDA backend (each step ends with a device
synchronize). ``--breakdown`` then times further steps of each plan with timers around the
executor's and the backend's entry points (``BREAKDOWN``; inclusive: a unit's start hook contains
its stage boundary, which contains the backend's offloads) and prints microseconds per moved unit
for each. ``--backend cuda-null`` runs the CUDA backend on the CPU over a runtime whose calls
do nothing but copy the bytes (``NullRuntime``): the backend's own host work, with no GPU, and the
runtime calls it makes per swapped storage (each a driver call on a GPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import ctypes
import gc
import itertools
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any, Dict, List

import torch
from torch import nn

import tensorplace as tp
from cuda_exec.step_state import default_backend
from tensorplace.bench import quiet_torch_logs
from tensorplace.bench.common import HOST_MALLOC_MODES, host_malloc


class NullRuntime:
    """cuda-python's runtime calls the CUDA backend makes, doing nothing but copying bytes between
    host addresses (pinned buffers are ctypes buffers); counts the calls."""

    def __init__(self) -> None:
        from cuda_exec.gpu import runtime_module

        self._rt = runtime_module()
        self._ok = self._rt.cudaError_t.cudaSuccess
        self._ids = itertools.count(1 << 20)
        self._buffers: Dict[int, Any] = {}
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name: str) -> Any:  # enums and flags
        return getattr(self._rt, name)

    def _done(self, name: str, *values: Any) -> Any:
        self.calls[name] += 1
        return (self._ok, *values)

    def cudaStreamCreateWithFlags(self, flags: Any) -> Any:
        return self._done("cudaStreamCreateWithFlags", next(self._ids))

    def cudaEventCreateWithFlags(self, flags: Any) -> Any:
        return self._done("cudaEventCreateWithFlags", next(self._ids))

    def cudaMemcpyAsync(self, dst: int, src: int, n: int, kind: Any, stream: Any) -> Any:
        ctypes.memmove(dst, src, n)
        return self._done("cudaMemcpyAsync")

    def cudaHostAlloc(self, n: int, flags: Any) -> Any:
        buf = ctypes.create_string_buffer(n)
        self._buffers[ctypes.addressof(buf)] = buf
        return self._done("cudaHostAlloc", ctypes.addressof(buf))

    def cudaFreeHost(self, ptr: int) -> Any:
        self._buffers.pop(ptr, None)
        return self._done("cudaFreeHost")

    def cudaEventElapsedTime(self, a: Any, b: Any) -> Any:
        return self._done("cudaEventElapsedTime", 1.0)


def _no_op(name: str) -> Any:
    def call(self: NullRuntime, *args: Any) -> Any:
        return self._done(name)
    call.__name__ = name
    return call


for _name in ("cudaStreamDestroy", "cudaEventDestroy", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery",
              "cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize"):
    setattr(NullRuntime, _name, _no_op(_name))


class NullTorch:
    """The CUDA backend's torch adapter on CPU tensors: one compute stream, torch's default (0)."""

    device = torch.device("cpu")
    _stream = SimpleNamespace(cuda_stream=0)

    def current_stream(self) -> Any:
        return self._stream

    def current_handle(self) -> int:
        return 0

    def empty_strided(self, size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def device_guard(self) -> Any:
        return contextlib.nullcontext()


#: (label, module, class, method) timed by --breakdown: the steady step's hooks, its stage work,
#: the replays, and the backend's calls (any the backend has)
BREAKDOWN = [
    ("unit start hook", "cuda_exec.steady", "_SteadyStep", "call_start"),
    ("unit end hook", "cuda_exec.steady", "_SteadyStep", "call_end"),
    ("pack", "cuda_exec.steady", "_SteadyStep", "pack"),
    ("stage boundary", "cuda_exec.step_state", "_StepState", "stage_boundary"),
    ("prefetch stage", "cuda_exec.step_state", "_StepState", "issue_prefetches"),
    ("swap entry free", "cuda_exec.step_state", "_Entry", "free"),
    # (a backward stage's first lean unpack, which starts the stage; or one not prefetched)
    ("lean swap unpack", "cuda_exec.inline_swap", "InlineHandle", "unpack"),
    ("lean swap free", "cuda_exec.inline_swap", "InlineHandle", "__del__"),
    ("segment replay", "cuda_exec.segment_frame", "SegmentFrame", "replay"),
] + [(f"backend.{name}", None, None, name) for name in
     ("offload", "offload_many", "prefetch", "prefetch_many", "fetch", "release", "poll", "release_offload",
      "copy_out", "copy_back", "give_back")]


def breakdown(backend: Any, run_step: Any, steps: int) -> Dict[str, float]:
    """Seconds spent inside each of BREAKDOWN's functions over ``steps`` calls of ``run_step()``
    (patched only meanwhile; one untimed step first, as the interpreter adapts to the patch)."""
    import importlib

    spent: Dict[str, float] = collections.defaultdict(float)
    patched = []
    for label, module, cls, name in BREAKDOWN:
        owner = getattr(importlib.import_module(module), cls) if module else backend
        fn = getattr(owner, name, None)
        if fn is None:
            continue

        def timed(*args: Any, _fn: Any = fn, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - t0

        patched.append((owner, name, owner.__dict__.get(name) if module else None))
        setattr(owner, name, timed)
    try:
        run_step()
        spent.clear()
        for _ in range(steps):
            run_step()
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)  # the instance attribute over the backend's method
            else:
                setattr(owner, name, original)
    return dict(spent)


class _HooksOnly(nn.Module):
    """A copy of ``model`` with a no-op forward pre-hook on every leaf module, whose forward runs
    under saved-tensor hooks that return what they get: the hooks' own cost (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(model)
        for m in self.model.modules():
            if not list(m.children()):
                m.register_forward_pre_hook(_no_hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            return self.model(x)


def _same(t: Any) -> Any:
    return t


def _no_hook(module: nn.Module, args: Any) -> None:
    return None


def build(blocks: int, width: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                           for _ in range(blocks)], nn.Linear(width, width))


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=41, help="interleaved rounds (one step of every mode each)")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plans", default="retain,swap-all,recompute-all,checkpoint-blocks")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the stack and its executor on the GPU "
                    "(CudaBackend); each step ends with a device synchronize")
    ap.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                    help="then time STEPS more steps of each plan with timers around the executor's parts")
    ap.add_argument("--backend", default="default", choices=["default", "cuda-null"],
                    help="cuda-null: the CUDA backend on a runtime that only copies bytes (CPU)")
    ap.add_argument("--host-malloc", default="keep", choices=HOST_MALLOC_MODES,
                    help="the C heap keeps freed memory (as tensorplace-bench does by default)")
    return ap


def main(argv: List[str] = None) -> Dict[str, Any]:
    a = arguments().parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return measure(a)
    finally:  # called in a process that goes on (the tests): its torch threads as they were
        torch.set_num_threads(threads)


def measure(a: argparse.Namespace) -> Dict[str, Any]:
    quiet_torch_logs()
    malloc = host_malloc(a.host_malloc)
    torch.manual_seed(0)
    device = torch.device(a.device)
    model = build(a.blocks, a.width).to(device)
    plain = copy.deepcopy(model)  # never hooked (module docstring)
    x = torch.randn(a.batch, a.width, device=device)
    loss_fn = lambda out: out.sum()  # noqa: E731
    null_rt = None
    if a.backend == "cuda-null":
        if device.type != "cpu":
            raise SystemExit("--backend cuda-null runs on the CPU (--device cpu)")
        from cuda_exec.cuda_backend import CudaBackend

        null_rt = NullRuntime()
        backend = CudaBackend(_runtime=null_rt, _torch=NullTorch())
    else:
        backend = default_backend(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    probe = tp.plan(model, x, budget=2**50, loss_fn=loss_fn, method="retain", backend=backend, repeats=9)
    units = probe.to_dict()["profile"]["units"]
    n = len(units)
    fwd_share = {}
    modes: Dict[str, Any] = {"unplanned": plain, "hooks only": _HooksOnly(plain)}
    plans: Dict[str, Any] = {}
    for method in a.plans.split(","):
        plan = probe.replan(2**50, method=method)
        plans[method] = plan
        # each plan trains its own copy: the executors' module hooks stay on their model between
        # steps, and one plan's step must not run another's
        modes[method] = tp.run(copy.deepcopy(plain), plan, backend=backend)
        recomputed = [u for u, act in zip(units, plan.actions) if act == "recompute"]
        fwd_share[method] = sum(u["fwd_time"] for u in recomputed) / max(sum(u["fwd_time"] for u in units), 1e-12)

    def step(m: nn.Module) -> float:
        sync()
        t0 = time.perf_counter()
        loss_fn(m(x)).backward()
        sync()
        t1 = time.perf_counter()
        for p in grads[id(m)]:
            p.grad = None
        return t1 - t0

    def forward() -> float:
        sync()
        t0 = time.perf_counter()
        out = plain(x)
        sync()
        t1 = time.perf_counter()
        del out
        return t1 - t0

    #: per mode, the parameters whose gradients a step sets to None after it
    grads = {id(m): list(m.parameters()) for m in modes.values()}
    times: Dict[str, List[float]] = {k: [] for k in modes}
    #: per mode: seconds of CPython's cyclic garbage collector inside its timed steps (the objects
    #: a planned step keeps from its forward to its backward make the collector run, and promote
    #: them: now and then a full collection of every object of the process)
    gc_s: Dict[str, float] = collections.defaultdict(float)
    collecting = [0.0, 0.0]  # (started, seconds so far)

    def on_gc(phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            collecting[1] += time.perf_counter() - collecting[0]
    times["forward"] = []
    #: per plan: runtime calls and offloads over the timed steps (--backend cuda-null)
    calls: Dict[str, collections.Counter] = {k: collections.Counter() for k in modes}
    for _ in range(3):  # warm-up: the executors' learning steps
        for m in modes.values():
            step(m)
    gc.callbacks.append(on_gc)
    try:
        for r in range(a.rounds):
            order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
            for k, m in order:
                step(m)  # untimed: the mode's caches warm (module docstring)
                spent_gc = collecting[1]
                if null_rt is not None:
                    before, offloads = collections.Counter(null_rt.calls), backend.stats["offloads"]
                times[k].append(step(m))
                gc_s[k] += collecting[1] - spent_gc
                if null_rt is not None:
                    calls[k].update(null_rt.calls - before)
                    calls[k]["offloads"] += backend.stats["offloads"] - offloads
            forward()
            times["forward"].append(forward())
    finally:
        gc.callbacks.remove(on_gc)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["unplanned"]
    rows = []
    print(f"{n} units ({a.blocks} blocks of Linear/LayerNorm/GELU + Linear), width {a.width}, batch {a.batch}, "
          f"{a.rounds} interleaved rounds, torch threads {a.threads}, {torch.__version__}, host malloc {malloc}, "
          f"device {device}, backend {backend.name}{' (null runtime)' if null_rt is not None else ''}")
    print(f"  unplanned step {base * 1e3:8.3f} ms, forward alone {med['forward'] * 1e3:8.3f} ms; hooks only "
          f"{(med['hooks only'] - base) / n * 1e6:.1f} us per unit (saved-tensor hooks and a pre-hook per unit that "
          "do nothing)")
    for method, plan in plans.items():
        moved = sum(act != "retain" for act in plan.actions)
        recompute = med["forward"] * fwd_share[method]
        over = med[method] - base - recompute
        per = over / (moved if moved else n)
        row = {"plan": method, "step_s": med[method], "moved_units": moved, "recompute_s": recompute,
               "cost_per_moved_unit_us": per * 1e6, "predicted_step_s": plan.predicted["step_time"],
               "step_times": times[method], "mean_step_s": statistics.fmean(times[method]),
               "gc_s_per_step": gc_s[method] / a.rounds}
        if calls[method]["offloads"]:
            c = calls[method]
            offloads = c.pop("offloads")
            row["runtime_calls_per_offload"] = {k: v / offloads for k, v in sorted(c.items())}
        rows.append(row)
        what = "per moved unit" if moved else "per unit (nothing moved)"
        print(f"  {method:18s} step {med[method] * 1e3:8.3f} ms  moved {moved:3d}  recompute {recompute * 1e3:7.3f} ms"
              f"  executor {per * 1e6:7.1f} us {what}  (predicted step {plan.predicted['step_time'] * 1e3:.3f} ms)")
        print(f"  {'':18s} mean step {row['mean_step_s'] * 1e3:.3f} ms, of which the cyclic garbage collector "
              f"{row['gc_s_per_step'] * 1e3:.3f} ms (unplanned {gc_s['unplanned'] / a.rounds * 1e3:.3f} ms)")
        if "runtime_calls_per_offload" in row:
            per_offload = row["runtime_calls_per_offload"]
            print(f"  {'':18s} runtime calls per swapped storage {sum(per_offload.values()):.1f}: "
                  + ", ".join(f"{k.removeprefix('cuda')} {v:.2f}" for k, v in per_offload.items()))
    if a.breakdown:
        print(f"  where the time goes (--breakdown: {a.breakdown} steps each, inclusive, us per moved unit; "
              "all-retain: per unit):")
        for row in rows:
            m = modes[row["plan"]]
            spent = breakdown(backend, lambda: step(m), a.breakdown)
            per = 1e6 / a.breakdown / (row["moved_units"] or n)  # all-retain: per unit
            row["breakdown_us_per_moved_unit"] = {k: v * per for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
            print(f"  {row['plan']:18s} " + ", ".join(f"{k} {v:.1f}" for k, v in row["breakdown_us_per_moved_unit"].items()))
    for m in modes.values():
        if m is not plain and not isinstance(m, _HooksOnly):
            m.close()
    backend.close()
    out = {"hooks_only_us_per_unit": (med["hooks only"] - base) / n * 1e6, "units": n, "blocks": a.blocks, "width": a.width, "batch": a.batch, "threads": a.threads,
           "rounds": a.rounds, "device": str(device), "backend": a.backend, "torch": torch.__version__, "host_malloc": malloc, "unplanned_step_s": base, "forward_s": med["forward"],
           "unplanned_times": times["unplanned"], "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
