"""Why a tiny model's all-retain plan on the H200 was predicted 1.0 MiB below the plain step's
measured peak (run2: GPT6s 69.7 against 70.7 MiB, ResNet-18 at 32 px 154.2 against 155.2 MiB):
the device's allocations between the steps, the profile's constant memory and measured peak, and
unplanned_step_stats, as JSON lines on stdout."""
import collections
import gc
import json
import sys

import torch

import tensorplace as tp
from tensorplace.bench.common import build_model
from tensorplace.peers import _step
from tensorplace.profiler import unplanned_step_stats


def live_blocks():
    sizes = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                sizes[b["size"]] += 1
    return sizes


def say(**kw):
    print(json.dumps(kw), flush=True)


for spec, kw in (("gpt6s", dict(batch=1, seq=64)), ("resnet18", dict(batch=2, image=32, classes=10))):
    rm = build_model(spec, device="cuda", **kw)
    model, x, loss_fn = rm.model, rm.inputs[0], rm.loss_fn
    torch.cuda.synchronize()
    points = {"built": torch.cuda.memory_allocated()}
    blocks = {"built": live_blocks()}
    _step(model, x, loss_fn)
    torch.cuda.synchronize(); gc.collect()
    points["after a step"] = torch.cuda.memory_allocated()
    blocks["after a step"] = live_blocks()
    probe = tp.plan(model, x, budget=2**50, loss_fn=loss_fn, method="retain", repeats=3)
    torch.cuda.synchronize(); gc.collect()
    points["after the profile"] = torch.cuda.memory_allocated()
    blocks["after the profile"] = live_blocks()
    prof = probe.to_dict()["profile"]
    stats = unplanned_step_stats(model, (x,), loss_fn=loss_fn, repeats=1)
    torch.cuda.synchronize(); gc.collect()
    points["after the stats"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(model, x, loss_fn)
    torch.cuda.synchronize()
    keys = list(blocks)
    new = {f"{a} -> {b}": {str(k): v for k, v in (blocks[b] - blocks[a]).items()} for a, b in zip(keys, keys[1:])}
    say(model=spec, allocated=points, new_blocks=new, profile_memory=prof["memory"],
        profile_peak=prof["measured"]["peak_bytes"], predicted_peak=probe.predicted["peak_bytes"],
        stats={k: v for k, v in stats.items() if k != "step_times"},
        max_allocated_plain_step=torch.cuda.max_memory_allocated())
    del model, x, probe, rm
    gc.collect(); torch.cuda.empty_cache()
print("done", file=sys.stderr)
