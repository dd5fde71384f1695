"""The peers table: tensorplace against the checkpointing recipes and save_on_cpu."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from cuda_exec.cpu_backend import CpuBackend
from tensorplace.models import TinyGPT
from tensorplace.peers import compare_peers


def test_peers_rows_are_measured_and_plans_keep_the_recipes_memory() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, dim=64, heads=4, layers=4, block=64, dropout=0.1)
    x = torch.randint(0, 128, (4, 64))
    y = torch.randint(0, 128, (4, 64))
    backend = CpuBackend(bandwidth_cap=0.15e9)
    try:
        rows = compare_peers(model, x, lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                             backend=backend, repeats=2, search={"particles": 20, "iterations": 10})
    finally:
        backend.close()
    by_name = {r["name"]: r for r in rows}
    assert list(by_name)[0] == "unplanned"
    for name in ("checkpoint per block", "checkpoint sqrt(n)", "save_on_cpu",
                 "tensorplace at checkpoint per block", "tensorplace at checkpoint sqrt(n)"):
        assert name in by_name, (name, list(by_name))
    base = by_name["unplanned"]
    assert base["peak_ratio"] == 1.0 and base["time_ratio"] == 1.0
    # step times from two rounds of one step per row, each row's time the median of its own
    for r in rows:
        if "error" not in r:
            assert len(r["step_times"]) == 2 and r["step_time"] == statistics.median(r["step_times"]), r["name"]
    # the recipes save memory, and they and every plan train exactly as the plain model does
    assert by_name["checkpoint per block"]["peak_bytes"] < base["peak_bytes"]
    assert all(r.get("bitwise", True) for r in rows), [(r["name"], r.get("bitwise")) for r in rows]
    # the per-block recipe as a plan costs what torch's checkpoint costs
    ours = by_name["tensorplace checkpoint-blocks"]
    assert abs(ours["peak_bytes"] - by_name["checkpoint per block"]["peak_bytes"]) <= 0.02 * base["peak_bytes"]
    for recipe in ("checkpoint per block", "checkpoint sqrt(n)"):
        plan_row = by_name[f"tensorplace at {recipe}"]
        assert "error" not in plan_row, plan_row
        assert plan_row["budget"] == by_name[recipe]["peak_bytes"]
        assert plan_row["peak_bytes"] <= plan_row["budget"]
        assert plan_row["predicted_peak_bytes"] <= plan_row["budget"]
        assert plan_row["step_time"] > 0 and plan_row["predicted_step_time"] > 0
