"""tensorplace-bench subcommands run end to end on small models and print and write (--json,
--png) what they claim; argument errors say what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch

import tensorplace as tp
from tensorplace import allocator, examples
from tensorplace.bench import main, parser
from tensorplace.bench import common
from tensorplace.bench.maxbatch import extrapolate
from traces import small_trace

SEARCH = ["--iterations", "5", "--particles", "10"]
# TinyGPT 2 x 32 on 16 tokens: a real model small enough for the tests
TINY = ["--model", "tinygpt", "--seq", "16", "--repeats", "1"]


MYMODELS = textwrap.dedent("""
    import torch
    def mlp(batch, classes):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, classes))
        return model, torch.randn(batch, 3, 4, 4)
    def bare():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    def deep(batch, classes):  # activations that matter next to the backward's scratch at batch 256
        layers = [torch.nn.Flatten(), torch.nn.Linear(48, 64)]
        for _ in range(4):
            layers += [torch.nn.ReLU(), torch.nn.Linear(64, 64)]
        return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(64, classes)), torch.randn(batch, 3, 4, 4)
""")
MLP = ["--model", "mymodels:mlp", "--batch", "6", "--classes", "7", "--repeats", "1"]
DEEP = ["--model", "mymodels:deep", "--batch", "256", "--classes", "7", "--repeats", "1"]


@pytest.fixture
def mymodels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's models module on the import path: `--model mymodels:mlp` (MYMODELS above)."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    monkeypatch.syspath_prepend(str(tmp_path))


def deep_profile(batch: int = 256) -> dict:
    """The profile of DEEP's model as the bench makes it (its bytes are those of any profiling run)."""
    return common.profile(common.build_model("mymodels:deep", batch, classes=7), 1)


def run_json(tmp_path: Path, args: list, rc: int = 0) -> dict:
    out = tmp_path / f"{args[0]}.json"
    assert main(args + ["--json", str(out)]) == rc
    data = json.loads(out.read_text())
    assert data["command"] == args[0] and data["exit_code"] == rc and data["versions"]["torch"] == torch.__version__
    return data


def rich_rows(text: str) -> dict:
    """First two cells of each row of the rich tables printed."""
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.count("│") >= 3}


def test_every_subcommand_takes_json():
    sub = next(a for a in parser()._actions if a.dest == "cmd")
    for name in ("demo", "accuracy", "profile", "plan", "maxbatch", "peers", "allocator", "compare", "convergence", "timeline",
                 "models"):
        assert name in sub.choices
    for name, p in sub.choices.items():
        assert any("--json" in act.option_strings for act in p._actions), name


@pytest.mark.slow
def test_compare_prints_every_method(capsys, tmp_path):
    data = run_json(tmp_path, ["compare", "--builtin", "plain20", "--batch", "8", *SEARCH, "--fractions", "0.5",
                               "--methods", "pso", "swap-all", "recompute-all", "no-such-method"])
    out = capsys.readouterr().out
    for word in ("pso", "swap-all", "recompute-all", "plain20"):
        assert word in out
    assert "skipping method 'no-such-method'" in out and data["skipped_methods"] == ["no-such-method"]
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"pso", "swap-all", "recompute-all"}
    assert data["lower_bound_bytes"] <= rows["pso"]["budget_bytes"] <= data["unplanned_peak_bytes"]
    for r in rows.values():
        if r["feasible"]:
            assert r["predicted_peak_bytes"] <= r["budget_bytes"]
            assert f"{r['predicted_step_time'] * 1e3:.2f}" in out


def test_maxbatch_builtin_planning_fits_at_least_the_unplanned_batch(capsys, tmp_path):
    data = run_json(tmp_path, ["maxbatch", "--builtin", "plain20", "--memory", "64MiB", "--iterations", "3",
                               "--particles", "8", "--methods", "unplanned", "pso"])
    rows = {k: v[0] for k, v in rich_rows(capsys.readouterr().out).items()}
    assert int(rows["pso"]) >= int(rows["unplanned"]) > 0
    js = {r["method"]: r for r in data["rows"]}
    assert js["pso"]["max_batch"] == int(rows["pso"]) and js["unplanned"]["max_batch"] == int(rows["unplanned"])
    # the batch found fits and the next one does not
    b = js["unplanned"]["max_batch"]
    assert tp.unplanned_peak(examples.profile("plain20", batch_size=b)) <= 64 * 2**20
    assert tp.unplanned_peak(examples.profile("plain20", batch_size=b + 1)) > 64 * 2**20


def test_convergence_reports_the_trace(capsys, tmp_path):
    png = tmp_path / "c.png"
    data = run_json(tmp_path, ["convergence", "--builtin", "squeezenet", "--batch", "4", "--iterations", "6",
                               "--particles", "12", "--png", str(png)])
    out = capsys.readouterr().out
    assert "within 1% of the final best" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = [b for b in data["convergence"]["best"] if b is not None]
    assert len(data["convergence"]["best"]) == 6 and best == sorted(best, reverse=True)
    assert data["predicted_step_time"] == pytest.approx(best[-1])


def test_timeline_draws_streams_and_memory(capsys, tmp_path):
    png = tmp_path / "t.png"
    data = run_json(tmp_path, ["timeline", "--builtin", "plain20", "--batch", "4", *SEARCH, "--fraction", "0.2",
                               "--png", str(png)])
    out = capsys.readouterr().out
    assert "fwd:0" in out and "bwd:0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prof = examples.profile("plain20", batch_size=4)
    planned, stages = data["planned"], data["stages"]
    assert len(stages) == 2 * len(prof["units"])
    for s, nxt in zip(stages, stages[1:]):
        assert s["start"] <= s["compute_start"] <= s["end"] == nxt["start"]
    assert stages[-1]["end"] == pytest.approx(planned["step_time"])
    assert max(s["peak"] for s in stages) == planned["peak_bytes"] <= data["budget_bytes"]
    # copies: in order on each copy queue, each as long as its bytes over the bandwidth
    copies = planned["copies"]
    assert copies, "a plan at 20% of the way from the lower bound swaps something"
    for q in {c["queue"] for c in copies}:
        on_q = [c for c in copies if c["queue"] == q]
        for c, nxt in zip(on_q, on_q[1:]):
            assert c["end"] <= nxt["start"] + 1e-12
    for c in copies:
        bw = prof["d2h_bandwidth"] if c["direction"] == "d2h" else prof["h2d_bandwidth"]
        assert c["end"] - c["start"] == pytest.approx(c["bytes"] / bw)
    assert sum(c["end"] - c["start"] for c in copies) == pytest.approx(planned["copy_time"])
    assert sum(r["end"] - r["start"] for r in planned["replays"]) == pytest.approx(planned["recompute"])
    check_memory_curve(data, prof)


def check_memory_curve(data: dict, prof: Optional[dict] = None) -> None:
    """The timeline's memory curve: after every allocation and free of the plan's allocation
    sequence, when it happens, the evaluator's allocated bytes and the bytes the caching
    allocator reserves for them; reserved covers allocated, and each stage's events stay within
    the stage's peak. With the profile: the sequence simulated by tensorplace.allocator."""
    planned = data["planned"]
    curve = planned["memory_curve"]
    times, allocated = [p["time"] for p in curve], [p["allocated"] for p in curve]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] <= planned["step_time"]
    assert all(p["reserved"] >= p["allocated"] for p in curve)
    assert max(p["reserved"] for p in curve) == data["reserved_peak_bytes"]
    assert max(allocated) == planned["peak_bytes"] and allocated[-1] == planned["end_bytes"]
    for s in data["stages"]:  # an event strictly inside a stage's interval is the stage's
        inside = [p["allocated"] for p in curve if s["start"] < p["time"] < s["end"]]
        assert max(inside, default=0) <= s["peak"], s["stage"]
    if prof is None:
        return
    seq = tp.allocation_sequence(prof, data["actions"], data["budget_bytes"], segment_starts=planned["segment_starts"])
    c = seq["constant_bytes"]
    sim = allocator.simulate(seq["events"], alloc_conf=planned["alloc_conf"], initial=(c, c), timeline=True)
    size, running = {}, [c]
    for e in seq["events"]:
        if e["op"] == "alloc":
            size[e["id"]] = e["size"]
        running.append(running[-1] + (e["size"] if e["op"] == "alloc" else -size.pop(e["id"])))
    assert times == [0.0] + seq["times"] and allocated == running
    assert [p["reserved"] for p in curve] == [c] + [r for _, r in sim["timeline"]]


def test_timeline_plays_the_plans_own_segments_and_reserved_peak(tmp_path, capsys):
    """sqrt's checkpoint segments are not the profile's blocks (evaluate's default): the timeline
    plays the plan as planned, within its budget, and gives the simulated reserved peak."""
    prof = examples.profile("plain20", batch_size=8)
    lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
    budget = int(lb + 0.6 * (up - lb))
    p = tp.plan_profile(prof, budget, "sqrt")
    assert p.segment_starts != tp.evaluate(prof, p.actions, budget)["segment_starts"]  # else this test shows nothing
    png = tmp_path / "t.png"
    data = run_json(tmp_path, ["timeline", "--builtin", "plain20", "--batch", "8", "--method", "sqrt",
                               "--fraction", "0.6", "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["budget_bytes"] == budget and data["method"] == "sqrt"
    assert data["planned"]["segment_starts"] == p.segment_starts
    assert data["planned"]["peak_bytes"] == p.predicted["peak_bytes"] <= budget
    assert data["planned"]["step_time"] == pytest.approx(p.predicted["step_time"])
    assert data["reserved_peak_bytes"] == p.predicted["reserved_bytes"] >= data["planned"]["peak_bytes"]
    check_memory_curve(data, prof)
    assert "reserved " in capsys.readouterr().out
    # the same plan saved and drawn with --plan
    p.save(tmp_path / "sqrt.json")
    tp.save_profile(prof, tmp_path / "prof.json")
    drawn = ["timeline", "--plan", str(tmp_path / "sqrt.json"), "--profile", str(tmp_path / "prof.json")]
    saved = run_json(tmp_path, drawn)
    assert saved["planned"]["segment_starts"] == p.segment_starts
    assert saved["planned"]["peak_bytes"] == p.predicted["peak_bytes"]
    # allocator settings the simulation does not model: the timeline without the reserved figure
    capsys.readouterr()
    prof.setdefault("environment", {}).setdefault("variables", {})["PYTORCH_CUDA_ALLOC_CONF"] = "gpu_magic:1"
    tp.save_profile(prof, tmp_path / "prof.json")
    odd = run_json(tmp_path, drawn)
    assert odd["reserved_peak_bytes"] is None and odd["planned"]["peak_bytes"] == p.predicted["peak_bytes"]
    assert "memory_curve" not in odd["planned"]
    assert "no reserved-memory figure" in capsys.readouterr().out


def test_timeline_of_a_saved_plan(tmp_path, capsys):
    prof = examples.profile("plain20", batch_size=4)
    path = tmp_path / "prof.json"
    tp.save_profile(prof, path)
    p = tp.plan_profile(prof, tp.unplanned_peak(prof) * 3 // 4, "swap-all")
    p.save(tmp_path / "plan.json")
    data = run_json(tmp_path, ["timeline", "--plan", str(tmp_path / "plan.json"), "--profile", str(path)])
    assert data["method"] == "swap-all" and data["planned"]["step_time"] == pytest.approx(p.predicted["step_time"])
    other = tp.plan_profile(examples.profile("plain20", batch_size=5), "1GiB", "retain")
    other.save(tmp_path / "other.json")
    with pytest.raises(SystemExit, match="does not belong to this profile"):
        main(["timeline", "--plan", str(tmp_path / "other.json"), "--profile", str(path)])


# --- compare, convergence, timeline and maxbatch on a user's model, profiled on the spot -----------


def test_compare_profiles_a_users_model(tmp_path, mymodels, capsys):
    data = run_json(tmp_path, ["compare", *DEEP, *SEARCH, "--fractions", "0.5", "--methods", "pso", "swap-all"])
    ref = deep_profile()
    lb, up = tp.lower_bound(ref), tp.unplanned_peak(ref)
    assert data["profile"] == "mymodels:deep batch 256" and "mymodels:deep batch 256" in capsys.readouterr().out
    assert (data["lower_bound_bytes"], data["unplanned_peak_bytes"]) == (lb, up) and lb < up
    assert [r["method"] for r in data["rows"]] == ["pso", "swap-all"]
    for r in data["rows"]:
        assert r["budget_bytes"] == int(lb + 0.5 * (up - lb))
        assert not r["feasible"] or r["predicted_peak_bytes"] <= r["budget_bytes"]
    assert data["rows"][0]["feasible"]


def test_convergence_profiles_a_users_model(tmp_path, mymodels):
    data = run_json(tmp_path, ["convergence", *DEEP, "--iterations", "4", "--particles", "6", "--fraction", "0.4"])
    ref = deep_profile()
    lb, up = tp.lower_bound(ref), tp.unplanned_peak(ref)
    assert data["profile"] == "mymodels:deep batch 256" and data["budget_bytes"] == int(lb + 0.4 * (up - lb))
    best = data["convergence"]["best"]
    assert best[-1] == pytest.approx(data["predicted_step_time"])
    # Every iteration, unless a plan as fast as the stage times allow (no stall, no replay)
    # stopped the swarm early.
    assert len(best) == 4 or (len(best) < 4 and data["predicted_step_time"] == pytest.approx(data["compute_time"], rel=1e-12))


def test_timeline_profiles_a_users_model(tmp_path, capsys):
    png = tmp_path / "t.png"
    data = run_json(tmp_path, ["timeline", *TINY, "--batch", "4", *SEARCH, "--fraction", "0.3", "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ref = common.profile(common.build_model("tinygpt", 4, seq=16), 1)
    lb, up = tp.lower_bound(ref), tp.unplanned_peak(ref)
    assert data["profile"] == "tinygpt batch 4" and data["budget_bytes"] == int(lb + 0.3 * (up - lb))
    assert len(data["stages"]) == 2 * len(ref["units"]) == 2 * len(data["actions"])
    assert data["planned"]["peak_bytes"] <= data["budget_bytes"]
    check_memory_curve(data)  # on the profile made there, whose times are its own


def test_maxbatch_predicts_from_two_saved_profiles(tmp_path, mymodels, capsys):
    paths = [str(tmp_path / f"b{b}.json") for b in (256, 128)]
    p256, p128 = deep_profile(256), deep_profile(128)
    tp.save_profile(p256, paths[0])
    tp.save_profile(p128, paths[1])

    def at(b: int) -> dict:
        return extrapolate(p128, 128, p256, 256, b)

    memory = tp.unplanned_peak(at(400))
    data = run_json(tmp_path, ["maxbatch", "--profile", *paths, "--memory", str(memory), *SEARCH,
                               "--methods", "unplanned", "pso", "torch-checkpoint"])
    assert "skipping torch-checkpoint" in capsys.readouterr().out and data["skipped_methods"] == ["torch-checkpoint"]
    assert data["mode"] == "predicted" and "batches 128 and 256" in data["model"]
    rows = {r["method"]: r for r in data["rows"]}
    b = rows["unplanned"]["max_batch"]
    assert b >= 400 and rows["pso"]["max_batch"] > b
    # the batch found fits and the next one does not
    assert tp.unplanned_peak(at(b)) <= memory < tp.unplanned_peak(at(b + 1))


def test_maxbatch_has_no_rate_where_the_probes_extrapolate_a_step_of_zero(tmp_path, mymodels):
    """Under load the larger probe can time faster than the smaller: extrapolated to a large
    batch every stage time is then 0, and the predicted rate is none (it was a division by zero)."""
    paths = [str(tmp_path / f"b{b}.json") for b in (256, 128)]
    p256, p128 = deep_profile(256), deep_profile(128)
    for u in p256["units"]:  # far faster than at 128: extrapolated beyond 256, every time is 0
        u["fwd_time"] = u["bwd_time"] = 0.0
    for p in (p128, p256):  # the executor's host time per unit is not extrapolated: none here
        for u in p["units"]:
            u.pop("fwd_host_time", None)
            u.pop("bwd_host_time", None)
    tp.save_profile(p256, paths[0])
    tp.save_profile(p128, paths[1])
    memory = tp.unplanned_peak(extrapolate(p128, 128, p256, 256, 400))
    data = run_json(tmp_path, ["maxbatch", "--profile", *paths, "--memory", str(memory), *SEARCH,
                               "--methods", "unplanned"])
    row = data["rows"][0]
    assert row["max_batch"] >= 400 and row["predicted_step_time"] == 0.0 and row["predicted_samples_per_s"] is None


def test_models_lists_the_zoo(tmp_path):
    data = run_json(tmp_path, ["models"])
    for name in ("gpt", "tinygpt", "inception", "resnet18", "vit_b_16"):
        assert name in data["models"]
    # tensorplace.zoo's models by their names; where torchvision has the name too, as zoo.NAME
    for name in ("unet", "lstm", "transformer_encoder", "zoo.mobilenet_v2", "zoo.efficientnet_b0"):
        assert "tensorplace.zoo" in data["models"][name], name
    assert data["models"]["mobilenet_v2"].startswith("torchvision.models.mobilenet_v2")


def test_zoo_models_by_name_and_torchvision_keeps_its_names(tmp_path):
    from tensorplace import zoo

    # a bare torchvision name is torchvision's model, sized by --image and --classes ...
    rm = common.build_model("mobilenet_v2", 2, image=48, classes=7)
    assert tuple(rm.inputs[0].shape) == (2, 3, 48, 48) and rm.model.classifier[-1].out_features == 7
    # ... and tensorplace.zoo's model of that name is zoo.NAME: the same weights and inputs as zoo.build
    for spec, name in (("zoo.mobilenet_v2", "mobilenet_v2"), ("unet", "unet"), ("zoo.unet", "unet")):
        rm = common.build_model(spec, 3)
        model, inputs, _ = zoo.build(name, batch=3)
        assert [tuple(t.shape) for t in rm.inputs] == [tuple(t.shape) for t in inputs], spec
        assert all(torch.equal(a, b) for a, b in zip(rm.model.state_dict().values(), model.state_dict().values())), spec
    with pytest.raises(SystemExit, match="unknown model 'zoo.nope'"):
        common.build_model("zoo.nope", 2)
    # end to end: a zoo model profiled by the CLI
    data = run_json(tmp_path, ["profile", "--model", "unet", "--batch", "2", "--repeats", "1",
                               "-o", str(tmp_path / "u.json")])
    assert data["model"] == "unet" and data["inputs"] == "(2, 3, 32, 32)"
    prof = tp.load_profile(tmp_path / "u.json")
    assert data["units"] == len(prof["units"]) > 5 and prof["batch_size"] == 2


@pytest.mark.slow
def test_demo_trains_under_the_plan_within_the_budget(capsys, tmp_path):
    data = run_json(tmp_path, ["demo", *TINY, "--batch", "4", *SEARCH, "--fraction", "0.3"])
    out = capsys.readouterr().out
    assert "measured peak within the budget" in out and "predicted" in out
    assert data["planned"]["peak_bytes"] <= data["budget_bytes"] < data["unplanned"]["peak_bytes"]
    assert data["planned"]["peak_bytes"] <= data["predicted"]["peak_bytes"]
    assert sum(data["counts"].values()) > 0 and data["counts"]["retain"] < sum(data["counts"].values())


@pytest.mark.slow
def test_accuracy_measures_each_plan(capsys, tmp_path):
    data = run_json(tmp_path, ["accuracy", *TINY, "--batch", "4", *SEARCH, "--fractions", "0.3",
                               "--methods", "pso", "swap-all"])
    rows = data["rows"]
    assert [r["method"] for r in rows] == ["pso", "swap-all"]
    for r in rows:
        assert r["feasible"] and r["measured_peak_bytes"] <= r["budget_bytes"]
        assert r["time_error"] == pytest.approx(abs(r["predicted_step_time"] - r["measured_step_time"]) / r["measured_step_time"])
    assert "evaluator accuracy, tinygpt" in capsys.readouterr().out


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorplace.bench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_profile_then_plan_in_other_processes_gives_plan_profiles_plan(tmp_path):
    r = _cli("profile", *TINY, "--batch", "4", "-o", "p.json", "--json", "pj.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    prof = tp.load_profile(tmp_path / "p.json")
    assert prof["measured"]["peak_bytes"] == json.loads((tmp_path / "pj.json").read_text())["measured"]["peak_bytes"]
    budget = (tp.lower_bound(prof) + tp.unplanned_peak(prof)) // 2
    r = _cli("plan", "p.json", "--budget", str(budget), "--seed", "3", *SEARCH, "-o", "plan.json", "--json", "planj.json",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "plan saved to plan.json" in r.stdout
    saved = tp.Plan.load(tmp_path / "plan.json")
    here = tp.plan_profile(prof, budget, seed=3, iterations=5, particles=10)
    assert saved.actions == here.actions and saved.prefetch == here.prefetch and saved.predicted == here.predicted
    assert saved.segment_starts == here.segment_starts and saved.method == here.method == "pso"
    figures = json.loads((tmp_path / "planj.json").read_text())
    assert figures["exit_code"] == 0 and figures["actions"] == here.actions and figures["predicted"] == here.predicted
    assert saved.to_dict()["profile"] == prof and saved.model_fingerprint == prof["model_fingerprint"]
    # ... and run() uses it on the model it was profiled for, and refuses another one
    rm = common.build_model("tinygpt", 4, seq=16)
    fast = tp.run(rm.model, str(tmp_path / "plan.json"))
    rm.loss_fn(fast(*rm.inputs)).backward()
    fast.close()
    assert all(p.grad is not None for p in rm.model.parameters())
    with pytest.raises(tp.PlannerError, match="another model"):
        tp.run(common.build_model("gpt", 4, seq=16).model, str(tmp_path / "plan.json"))


@pytest.mark.slow
def test_peers_measures_the_recipes_and_the_plans(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the row names at 80 columns otherwise
    data = run_json(tmp_path, ["peers", *TINY, "--batch", "4", "--particles", "10", "--iterations", "5"])
    out = capsys.readouterr().out
    assert data["device"] == common.where() and data["torch_device"] == "cpu" and data["link_gbps"] is None
    rows = {r["name"]: r for r in data["rows"]}
    for name in ("unplanned", "checkpoint per block", "checkpoint sqrt(n)", "save_on_cpu",
                 "tensorplace checkpoint-blocks", "tensorplace at checkpoint per block"):
        assert name in rows and name in out, name
    base = rows["unplanned"]
    assert base["peak_ratio"] == base["time_ratio"] == 1.0
    assert f"{base['step_time'] / base['profile_step_time']:.3f}x the profile's plain step" in " ".join(out.split())
    assert rows["checkpoint per block"]["peak_bytes"] < base["peak_bytes"]
    for r in rows.values():
        assert "error" not in r, r
        assert r["bitwise"] is True, r["name"]
        assert r["peak_ratio"] == pytest.approx(r["peak_bytes"] / base["peak_bytes"])
    at = rows["tensorplace at checkpoint per block"]
    assert at["budget"] == rows["checkpoint per block"]["peak_bytes"] and at["peak_bytes"] <= at["budget"]
    assert rich_rows(out)["checkpoint per block"][0] == tp.format_bytes(rows["checkpoint per block"]["peak_bytes"])


def test_plan_refuses_an_impossible_budget(tmp_path, capsys):
    prof = examples.profile("plain20", batch_size=4)
    tp.save_profile(prof, tmp_path / "p.json")
    data = run_json(tmp_path, ["plan", str(tmp_path / "p.json"), "--budget", "1MiB", "-o", str(tmp_path / "x.json")], rc=1)
    assert "cannot plan" in capsys.readouterr().out and data["error"]
    assert not (tmp_path / "x.json").exists()


def test_a_plan_file_gives_its_profile_where_a_profile_is_asked_for(tmp_path):
    prof = examples.profile("plain20", batch_size=4)
    plan = tp.plan_profile(prof, tp.unplanned_peak(prof), method="retain")
    plan.save(tmp_path / "bare.plan.json")  # plan_profile's plans do not carry their profile
    with pytest.raises(SystemExit, match="a plan that does not carry its profile"):
        common.read_profile(str(tmp_path / "bare.plan.json"), "profile")
    data = plan.to_dict()
    data["profile"] = prof  # as tp.plan() saves it
    (tmp_path / "full.plan.json").write_text(json.dumps(data))
    assert common.read_profile(str(tmp_path / "full.plan.json"), "profile") == prof


def test_model_by_import_path(tmp_path, mymodels, capsys):
    data = run_json(tmp_path, ["profile", *MLP, "-o", str(tmp_path / "p.json")])
    assert data["inputs"] == "(6, 3, 4, 4)" and data["units"] == 4
    prof = tp.load_profile(tmp_path / "p.json")
    assert prof["batch_size"] == 6 and prof["units"][-1]["grad_bytes"] == (32 * 7 + 7) * 4
    rm = common.build_model("mymodels:bare", 5, input_shape=(3, 2, 2))
    assert tuple(rm.inputs[0].shape) == (5, 3, 2, 2)


@pytest.mark.parametrize("args, message", [
    (["plan", "p.json", "--budget", "lots"], "cannot read budget 'lots'"),
    (["demo", "--fraction", "1.5"], "strictly between 0 and 1"),
    (["demo", "--batch", "0"], "whole number >= 1"),
    (["maxbatch", "--model", "tinygpt"], "--memory"),
    (["compare", "--builtin", "resnet18"], "'resnet18' is a real model: pass --model resnet18"),
    (["timeline", "--builtin", "no_such_profile"], "'no_such_profile' is not a builtin profile (choose from vgg16"),
    (["convergence", "--model", "tinygpt", "--builtin", "plain20"], "not allowed with argument --model"),
    (["maxbatch", "--profile", "a.json", "--memory", "1GiB"], "--profile: expected 2 arguments"),
    (["peers", "--model", "tinygpt", "--budget", "lots"], "cannot read budget 'lots'"),
    (["peers", "--model", "tinygpt", "--repeats", "-1"], "whole number >= 0"),  # 0: peaks only
    (["profile", "--model", "tinygpt", "--input-shape", "3xa", "-o", "x"], "dimensions like 3x64x64"),
])
def test_argument_errors_say_what_is_wrong(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["profile", "--model", "resnet_eighteen", "-o", "x"], "unknown model 'resnet_eighteen'"),
    (["profile", "--model", "no_such_pkg:f", "-o", "x"], "cannot import 'no_such_pkg'"),
    (["profile", "--model", "tensorplace.models:Nope", "-o", "x"], "has no attribute 'Nope'"),
    (["plan", "missing.json", "--budget", "1GiB"], "no such file"),
    (["maxbatch", *TINY, "--memory", "1GiB", "--probe-batches", "4", "4"], "two different batch sizes"),
    (["allocator", "missing.json"], "trace 'missing.json': no such file"),
    (["allocator", "notes.txt"], "trace 'notes.txt' is not a JSON allocator trace"),
    (["allocator", "profile.json"], "cuda-caching-allocator-trace"),
    (["compare", "--model", "plain20"], "'plain20' is a builtin modelled profile: pass --builtin plain20"),
    (["timeline", "--plan", "plan.json", "--model", "tinygpt"], "not on --model, whose new profile"),
    (["peers", *TINY, "--profile", "profile.json"], "--profile 'profile.json': the profile given is of another model"),
    (["peers", *TINY, "--profile", "missing.json"], "--profile 'missing.json': no such file"),
    (["maxbatch", "--profile", "profile.json", "profile.json", "--memory", "1GiB"],
     "give two profiles of one model at different batch sizes (these have 1 and 1)"),
    (["maxbatch", "--profile", "profile.json", "squeezenet.json", "--memory", "1GiB"], "have different units"),
])
def test_usage_errors_say_how_to_fix(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not json")
    tp.save_profile(examples.profile("plain20", batch_size=1), tmp_path / "profile.json")
    tp.save_profile(examples.profile("squeezenet", batch_size=2), tmp_path / "squeezenet.json")
    tp.plan_profile(examples.profile("plain20", batch_size=1), "1GiB", "retain").save(tmp_path / "plan.json")
    with pytest.raises(SystemExit) as e:
        main(args)
    assert message in str(e.value.code)


def test_plan_names_the_methods_it_knows(tmp_path):
    tp.save_profile(examples.profile("plain20", batch_size=2), tmp_path / "p.json")
    with pytest.raises(SystemExit, match="does not know it; use pso"):
        main(["plan", str(tmp_path / "p.json"), "--budget", "1GiB", "--method", "magic"])


def test_extrapolated_profile_matches_the_profile_at_that_batch():
    p4, p8, p16 = (examples.profile("resnet50", batch_size=b) for b in (4, 8, 16))
    e = extrapolate(p4, 4, p8, 8, 16)
    assert tp.unplanned_peak(e) == tp.unplanned_peak(p16)
    for a, b in zip(e["units"], p16["units"]):
        assert a["act_bytes"] == b["act_bytes"] and a["bwd_transient_bytes"] == b["bwd_transient_bytes"]
    with pytest.raises(ValueError, match="different units"):
        extrapolate(p4, 4, examples.profile("plain20", batch_size=8), 8, 16)


def test_repeated_blocks_and_block_checkpoints():
    import torchvision

    r18 = torchvision.models.resnet18(num_classes=10)
    blocks = common.repeated_blocks(r18)
    assert len(blocks) == 8 and {type(b).__name__ for _, _, b in blocks} == {"BasicBlock"}
    rm = common.build_model("tinygpt", 3, seq=16)
    wrapped, n = common.with_block_checkpoints(rm.model)
    assert n == 2
    for m in (rm.model, wrapped):
        torch.manual_seed(1)
        rm.loss_fn(m(*rm.inputs)).backward()
    for (name, p), q in zip(rm.model.named_parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.slow
def test_maxbatch_on_a_real_model_is_confirmed_by_measured_steps(capsys, tmp_path):
    memory = 2**20
    data = run_json(tmp_path, ["maxbatch", *TINY, "--memory", str(memory), *SEARCH, "--probe-batches", "2", "4",
                               "--methods", "pso", "unplanned", "torch-checkpoint", "checkpoint-blocks-not-yet"])
    out = capsys.readouterr().out
    assert "skipping method 'checkpoint-blocks-not-yet'" in out
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"pso", "unplanned", "torch-checkpoint"}
    for r in rows.values():
        assert r["confirmed_batch"] is not None and 1 <= r["confirmed_batch"] <= r["predicted_batch"]
        assert r["measured_peak_bytes"] <= memory
        assert r["samples_per_s"] == pytest.approx(r["confirmed_batch"] / r["measured_step_time"])
        assert r["attempts"][-1]["fits"] and not any(t["fits"] for t in r["attempts"][:-1])
    assert rows["pso"]["predicted_batch"] >= rows["unplanned"]["confirmed_batch"]
    table = rich_rows(out)
    assert table["pso"][1] == str(rows["pso"]["confirmed_batch"])


def test_progress_bars_nest(monkeypatch, capsys):
    """maxbatch profiles inside its own bar: nested bars share one live display."""
    monkeypatch.setattr(common, "_FORCE_PROGRESS", True)
    with common.progress("outer", total=2) as outer:
        with common.progress("inner") as inner:
            assert inner._p is outer._p is common._ACTIVE and inner._t != outer._t
        outer.advance()
        assert [t.description for t in outer._p.tasks] == ["outer"]
    assert common._ACTIVE is None
    assert "outer" in capsys.readouterr().err


def test_what_is_printed_under_a_progress_bar_stays_on_stdout(monkeypatch, capsys):
    monkeypatch.setattr(common, "_FORCE_PROGRESS", True)
    with common.progress("working"):
        print("a figure")
    out, err = capsys.readouterr()
    assert out == "a figure\n" and "working" in err and "a figure" not in err


@pytest.fixture
def bars(monkeypatch) -> list:
    """Progress bars forced on (as on a terminal); the descriptions of those opened."""
    monkeypatch.setattr(common, "_FORCE_PROGRESS", True)
    opened = []
    real = common.progress

    def recording(description, total=None):
        opened.append(description)
        return real(description, total)

    monkeypatch.setattr(common, "progress", recording)
    return opened


@pytest.mark.parametrize("args", [
    ["compare", *DEEP, *SEARCH, "--fractions", "0.5", "--methods", "pso"],
    ["convergence", "--builtin", "plain20", "--batch", "4", *SEARCH],
    ["timeline", "--builtin", "plain20", "--batch", "4", *SEARCH],
    ["maxbatch", "--builtin", "plain20", "--memory", "16MiB", *SEARCH, "--methods", "pso"],
    ["profile", *MLP, "-o", "p.json"],
    ["plan", "saved.json", "--budget", "1GiB", *SEARCH, "-o", "plan.json"],
    ["allocator", "trace.json"],
    ["peers", *TINY, "--batch", "2"],
    ["methods", "--models", "plain20", "--methods", "pso", "--fractions", "0.5", "--particles", "5", "--iterations", "3"],
    *(pytest.param(args, marks=pytest.mark.slow) for args in (
        ["demo", *TINY, "--batch", "2", *SEARCH],
        ["accuracy", *TINY, "--batch", "2", *SEARCH, "--fractions", "0.5", "--methods", "pso"],
        ["budgets", "--model", "unet", "--batch", "1", "--particles", "3", "--iterations", "2"],
    )),
], ids=lambda args: args[0])
def test_json_on_stdout_stays_valid_under_progress_bars(args, bars, mymodels, tmp_path, monkeypatch, capsys):
    """`--json -`: stdout is the JSON alone; the bars (every subcommand that profiles, searches
    or measures has one) and the tables go to stderr. (`methods` writes JSON lines to a file of
    its own: there, the bar alone.)"""
    monkeypatch.chdir(tmp_path)
    tp.save_profile(examples.profile("plain20", batch_size=2), tmp_path / "saved.json")
    (tmp_path / "trace.json").write_text(json.dumps(small_trace(2**24)))
    if args[0] == "peers":  # its measurements take a minute: here only what the command does with them
        import tensorplace.peers

        def compare_peers(model, x, loss_fn, progress, **kw):
            progress("measuring the peers")
            return [{"name": "unplanned", "peak_bytes": 10, "step_time": 1.0, "peak_ratio": 1.0, "time_ratio": 1.0,
                     "bitwise": True}]

        monkeypatch.setattr(tensorplace.peers, "compare_peers", compare_peers)
    to_stdout = args[0] != "methods"
    assert main(args + ["--json", "-"] * to_stdout) == 0
    out, err = capsys.readouterr()
    assert bars and all(d in err for d in bars), (bars, err[-500:])
    if to_stdout:
        data = json.loads(out)
        assert data["command"] == args[0] and data["exit_code"] == 0
        assert "│" in err or "saved to" in err  # what the command printed


def test_json_is_written_as_figures_arrive(tmp_path):
    """A run that dies later keeps what it measured (the GPU-machine habit)."""
    path = tmp_path / "o.json"
    out = common.Output(str(path), {"command": "x"})
    out.append("rows", {"batch": 3})
    assert json.loads(path.read_text()) == {"command": "x", "rows": [{"batch": 3}]}
    out.update(model="m")
    out.flush(exit_code=0)
    assert json.loads(path.read_text()) == {"command": "x", "exit_code": 0, "rows": [{"batch": 3}], "model": "m"}


@pytest.mark.slow
def test_maxbatch_names_what_batch_one_needs_when_nothing_fits(capsys, tmp_path):
    data = run_json(tmp_path, ["maxbatch", *TINY, "--memory", "64KiB", *SEARCH, "--probe-batches", "2", "4",
                               "--methods", "swap-all", "unplanned"])
    out = capsys.readouterr().out
    for m in ("swap-all", "unplanned"):
        assert f"{m}: no batch fits 64.0 KiB: at batch 1 it needs about" in out
    assert all(r["predicted_batch"] == 0 and r["confirmed_batch"] is None for r in data["rows"])


def test_methods_marks_a_method_that_does_not_apply_and_goes_on(tmp_path):
    """checkpoint-blocks on a profile without repeated blocks (vgg16) is n/a in the table; the
    run goes on to the other methods and profiles."""
    from tensorplace.methods.bench import markdown, run_methods

    out = tmp_path / "m.jsonl"
    recs = run_methods(["vgg16", "plain20"], [], [1.0], ["checkpoint-blocks", "sqrt"], out=str(out))
    by = {(r["profile"], r["method"]): r for r in recs}
    assert len(out.read_text().splitlines()) == 4
    assert by["vgg16", "checkpoint-blocks"]["not_applicable"] and "repeated blocks" in by["vgg16", "checkpoint-blocks"]["error"]
    assert "step_time" in by["vgg16", "sqrt"] and "step_time" in by["plain20", "checkpoint-blocks"]
    vgg_row = next(line for line in markdown(recs).splitlines() if line.startswith("| vgg16"))
    assert "| n/a |" in vgg_row


# --- --device: where the model, inputs and labels live, and where the JSON says they were --------


EXPLICIT = textwrap.dedent("""
    import torch
    def on_the_cpu(batch, classes):  # tensors made on the CPU whatever the default device
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, classes, device="cpu"))
        return model, torch.randn(batch, 3, 2, 2, device="cpu")
""")


def test_build_model_makes_model_inputs_and_labels_on_the_device(tmp_path, monkeypatch):
    """No GPU here: the meta device stands in for one (shapes only)."""
    for spec, kw in (("resnet18", {"image": 32, "classes": 10}), ("tinygpt", {"seq": 8}), ("unet", {})):
        rm = common.build_model(spec, 2, device="meta", **kw)
        assert rm.device == torch.device("meta") and common.placement(rm.model, rm.inputs) == {
            "parameters": ["meta"], "inputs": ["meta"]}, spec
        loss = rm.loss_fn(rm.model(*rm.inputs))  # the labels the loss holds are on the device too
        assert loss.device.type == "meta" and loss.dim() == 0, spec
        assert rm.at_batch(3).inputs[0].device.type == "meta"
    # a factory that puts its tensors on the CPU explicitly: moved to the device
    (tmp_path / "explicit.py").write_text(EXPLICIT)
    monkeypatch.syspath_prepend(str(tmp_path))
    rm = common.build_model("explicit:on_the_cpu", 2, classes=3, device="meta")
    assert common.placement(rm.model, rm.inputs) == {"parameters": ["meta"], "inputs": ["meta"]}
    # and on the CPU, the same numbers as before --device existed (seed 0, made on the CPU)
    torch.manual_seed(0)
    import torchvision

    ref = torchvision.models.resnet18(weights=None, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    rm = common.build_model("resnet18", 2, image=32, classes=10, device="cpu")
    assert torch.equal(rm.inputs[0], x) and all(torch.equal(a, b) for a, b in zip(rm.model.parameters(), ref.parameters()))


def test_device_cpu_is_recorded_with_where_the_tensors_were(tmp_path):
    data = run_json(tmp_path, ["profile", *TINY, "--batch", "2", "--device", "cpu", "-o", str(tmp_path / "p.json")])
    assert data["torch_device"] == "cpu" and data["device"].startswith("CPU (")
    assert data["tensors_on"] == {"parameters": ["cpu"], "inputs": ["cpu"]}
    assert tp.load_profile(tmp_path / "p.json")["device"] == "cpu"
    # every subcommand that builds a model takes --device
    sub = next(a for a in parser()._actions if a.dest == "cmd")
    for name in ("demo", "accuracy", "profile", "maxbatch", "peers", "budgets", "compare", "convergence", "timeline"):
        assert any("--device" in act.option_strings for act in sub.choices[name]._actions), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
@pytest.mark.parametrize("cmd", [["profile", *TINY, "-o", "x.json"], ["peers", *TINY], ["budgets", "--model", "unet"],
                                 ["demo", *TINY]])
def test_device_cuda_without_a_gpu_says_so(cmd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device here" in str(e.value.code) and "--device cpu" in str(e.value.code)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("text, message", [("tpu:0", "not a device"), ("meta", "measures on cpu or cuda")])
def test_device_that_is_not_cpu_or_cuda_is_refused(text, message):
    with pytest.raises(SystemExit) as e:
        main(["profile", *TINY, "-o", "x.json", "--device", text])
    assert message in str(e.value.code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_cuda_puts_everything_on_the_gpu(tmp_path):
    data = run_json(tmp_path, ["profile", *TINY, "--batch", "2", "--device", "cuda", "-o", str(tmp_path / "p.json")])
    assert data["torch_device"].startswith("cuda") and data["device"].startswith("GPU ")
    assert data["tensors_on"]["parameters"] == data["tensors_on"]["inputs"] == [data["torch_device"]]
    assert tp.load_profile(tmp_path / "p.json")["device"] == torch.cuda.get_device_name()


# --- only the bench's own lines -------------------------------------------------------------------

#: glog-style lines of torch's C++ libraries (kineto: "USDT:2026-11-26 10:47:58 10857:10857 File.cpp:39] ...")
FOREIGN = r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\]"


def test_demo_prints_only_its_own_lines(tmp_path):
    """No profiler chatter (kineto's USDT profiler_start/stop at every profiled step) and no
    device-probe error lines (gpuGetDeviceCount failed, on a machine without a driver)."""
    import re

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-m", "tensorplace.bench", "demo", *TINY, "--batch", "2", *SEARCH],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # no terminal: no progress bar either
    foreign = [line for line in r.stdout.splitlines() if re.match(FOREIGN, line) or "Warning" in line]
    assert not foreign, foreign
    assert "measured peak within the budget" in r.stdout
    # the same run without the bench's setting shows what it keeps out (where torch prints any)
    probe = subprocess.run([sys.executable, "-c", "import torch\nwith torch.profiler.profile(profile_memory=True):\n"
                            "    torch.ones(1).sum()"], capture_output=True, text=True, timeout=300, env=env)
    # (torch 2.11 adds its one-cycle profiler warning, which tensorplace's measurements filter)
    one_cycle = ("Profiler clears events at the end of each cycle", "_warn_once(")
    assert all(re.match(FOREIGN, line) or any(w in line for w in one_cycle)
               for line in probe.stderr.splitlines() if line.strip()), probe.stderr


def test_link_capped_bench_measures_swap_heavy_plans_within_their_predicted_peaks(tmp_path: Path) -> None:
    """benches/link_capped.py (issue 18's CPU check), on the tiny GPT: the all-swap plan, vDNN's,
    the swap-only MILP's and a PSO plan each run and are measured within their predicted peak."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(root / "benches" / "link_capped.py"), "--model", "tinygpt", "--batch", "4",
                        "--seq", "32", "--repeats", "1", "--milp-time", "2", "--fractions", "0.4", "--json", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["plan"] for row in rows] == ["swap-all", "vdnn 0.40", "milp-swap 0.40", "pso 0.40"]
    assert rows[0]["swap"] > 0 and rows[0]["recompute"] == 0
    assert all(row["measured_peak_bytes"] <= row["predicted_peak_bytes"] for row in rows), rows
    assert all(row["speed"] > 0 and row["predicted_step_at_speed"] > 0 and len(row["plain_steps"]) == 1
               for row in rows), rows
    assert "| swap-all |" in r.stdout


def test_link_capped_bench_predicts_at_the_measured_speed_by_scaling_compute_not_copies() -> None:
    """benches/link_capped.py's prediction at the machine's speed: the swap-all plan of a builtin
    profile, twice as slow, takes its compute, recompute and host time twice and its swap stall
    once; a plan without copies (all-retain) takes twice its step, as the profile made twice as
    slow predicts."""
    import copy
    import runpy

    import tensorplace as tp
    from tensorplace import examples

    root = Path(__file__).resolve().parents[1]
    at_speed = runpy.run_path(str(root / "benches" / "link_capped.py"), run_name="checked")["at_speed"]
    prof = examples.profile("vgg16", batch_size=8)
    n = len(prof["units"])
    swap = tp.evaluate(prof, ["swap"] * n, 2**50)
    assert swap["swap_stall"] > 0
    busy = swap["compute_time"] + swap["recompute"] + swap.get("host_time", 0.0)
    assert at_speed(swap, 1.0) == swap["step_time"]
    assert at_speed(swap, 2.0) == pytest.approx(swap["step_time"] + busy, rel=1e-12)
    slow = copy.deepcopy(prof)
    for u in slow["units"]:
        u["fwd_time"] *= 2
        u["bwd_time"] *= 2
    retain = tp.evaluate(prof, ["retain"] * n, 2**50)
    assert at_speed(retain, 2.0) == pytest.approx(tp.evaluate(slow, ["retain"] * n, 2**50)["step_time"], rel=1e-12)


def test_executor_overhead_bench_times_the_lean_swap_path_on_the_cpu_backend(tmp_path: Path) -> None:
    """benches/executor_overhead.py on the CPU backend: the all-swap plan's steady steps take the
    lean swap path, and --breakdown times its parts (the backend's copies out and back, inside
    the prefetch stages, which the first lean unpack of a stage starts; the frees of the
    handles), patched back afterwards."""
    import runpy

    from cuda_exec.inline_swap import InlineHandle

    root = Path(__file__).resolve().parents[1]
    main = runpy.run_path(str(root / "benches" / "executor_overhead.py"), run_name="checked")["main"]
    free, unpack = InlineHandle.__del__, InlineHandle.unpack
    threads = torch.get_num_threads()
    out = main(["--blocks", "3", "--rounds", "2", "--plans", "swap-all", "--breakdown", "2", "--threads", "1"])
    # its torch threads were the process's until it returned (every later test ran on one thread)
    assert torch.get_num_threads() == threads
    (row,) = out["rows"]
    spent = row["breakdown_us_per_moved_unit"]
    assert {"backend.copy_out", "backend.copy_back", "lean swap free", "lean swap unpack"} <= set(spent), spent
    assert "backend.offload" not in spent or spent["backend.offload"] < spent["backend.copy_out"], spent
    assert spent["prefetch stage"] >= spent["backend.copy_back"], spent  # (inclusive times)
    assert InlineHandle.__del__ is free and InlineHandle.unpack is unpack


def test_executor_overhead_bench_runs_the_cuda_backend_on_a_null_runtime(tmp_path: Path) -> None:
    """benches/executor_overhead.py --backend cuda-null (issue 17's host work of the CUDA backend,
    without a GPU): the swap plan's steps run through CudaBackend, whose runtime calls per swapped
    storage are counted: one copy each way at most, each copy behind an event."""
    import runpy

    root = Path(__file__).resolve().parents[1]
    main = runpy.run_path(str(root / "benches" / "executor_overhead.py"), run_name="checked")["main"]
    import gc

    callbacks = list(gc.callbacks)
    out = main(["--blocks", "3", "--rounds", "2", "--plans", "swap-all", "--backend", "cuda-null",
                "--breakdown", "2", "--json", str(tmp_path / "o.json")])
    assert out["backend"] == "cuda-null" and json.loads((tmp_path / "o.json").read_text())["rows"]
    assert gc.callbacks == callbacks  # its collector timer is gone
    assert "hooks_only_us_per_unit" in out
    (row,) = out["rows"]
    assert row["gc_s_per_step"] >= 0 and row["mean_step_s"] > 0
    assert row["plan"] == "swap-all" and row["moved_units"] == out["units"] == 10
    calls = row["runtime_calls_per_offload"]
    assert 1.0 <= calls["cudaMemcpyAsync"] <= 2.0, calls
    assert calls["cudaEventRecord"] >= calls["cudaMemcpyAsync"], calls
    assert not any(k.endswith("Synchronize") for k in calls), calls  # the step never blocks the host
    # --breakdown: time inside the executor's parts and the backend's calls, patched back afterwards
    spent = row["breakdown_us_per_moved_unit"]
    assert {"pack", "stage boundary", "backend.offload_many", "backend.prefetch_many", "backend.fetch"} <= set(spent)
    assert all(v > 0 for v in spent.values()), spent
    from cuda_exec import steady
    assert steady._SteadyStep.pack.__name__ == "pack"


def test_torch_threads_are_the_processes_again_after_the_command(capsys) -> None:
    # main() runs in the tests' own process: a command's --torch-threads must not stay behind
    # (benches/executor_overhead.py's did, and every test after it ran on one thread)
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    assert main(["timeline", "--builtin", "plain20", "--torch-threads", str(other)]) == 0
    assert torch.get_num_threads() == threads
