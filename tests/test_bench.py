"""tensorplace-bench subcommands run and print what they claim (small settings)."""

import pytest

from tensorplace.bench import main


def test_compare_prints_every_method(capsys):
    assert main(["compare", "--model", "plain20", "--batch", "8", "--iterations", "5", "--particles", "10",
                 "--fractions", "0.5", "--methods", "pso", "swap-all", "recompute-all"]) == 0
    out = capsys.readouterr().out
    for word in ("pso", "swap-all", "recompute-all", "plain20"):
        assert word in out


def test_maxbatch_planning_fits_at_least_the_unplanned_batch(capsys):
    assert main(["maxbatch", "--builtin", "plain20", "--memory", "64MiB", "--iterations", "3", "--particles", "8",
                 "--methods", "unplanned", "pso"]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in capsys.readouterr().out.splitlines() if line.count("│") >= 3}
    assert int(rows["pso"]) >= int(rows["unplanned"]) > 0


def test_convergence_reports_the_trace(capsys, tmp_path):
    png = tmp_path / "c.png"
    args = ["convergence", "--model", "squeezenet", "--batch", "4", "--iterations", "6", "--particles", "12"]
    try:
        import matplotlib  # noqa: F401

        args += ["--png", str(png)]
    except ImportError:
        png = None
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "within 1% of the final best" in out
    if png is not None:
        assert png.stat().st_size > 0


def test_timeline_prints_stages(capsys):
    assert main(["timeline", "--model", "plain20", "--batch", "4", "--iterations", "3", "--particles", "6"]) == 0
    out = capsys.readouterr().out
    assert "fwd:0" in out and "bwd:0" in out


@pytest.mark.parametrize("model", ["gpt"])
def test_demo_trains_under_the_plan_within_the_budget(capsys, model):
    assert main(["demo", "--model", model, "--batch", "4", "--seq", "64", "--iterations", "10", "--particles", "20",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured peak within the budget" in out and "predicted" in out
