"""The MILP plan against the exhaustive optimum on random small profiles (docs/methods.md).

    python benches/milp_vs_exhaustive.py [examples] [max_units] [--choose-starts] [--checkpointable] [--show]

Profiles come from tests/profiles.py (Hypothesis generator, generation phase only); budgets are
uniform between the lower bound and the unplanned peak. With the default segment starts the
reference is `exhaustive`; with --choose-starts the MILP chooses the starts too and the
reference is `exhaustive-segments` (every plan and every split of its recomputed runs).
--checkpointable draws the profiles where multi-unit segments pay off (tests/profiles.py).
--show prints the plans of the profiles where the MILP is above the optimum.
"""

import collections
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
warnings.filterwarnings("ignore")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tensorplace as tp  # noqa: E402
from profiles import dag_profiles, multi_unit_segments  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
CHOOSE = "--choose-starts" in sys.argv
SHOW = "--show" in sys.argv
CHECKPOINTABLE = "--checkpointable" in sys.argv
N, MAX_UNITS = int(args[0]) if args else 300, int(args[1]) if len(args) > 1 else 7
REFERENCE = "exhaustive-segments" if CHOOSE else "exhaustive"
res = collections.Counter()
ratios = []


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), database=None, phases=[Phase.generate])
@given(dag_profiles(max_units=MAX_UNITS, checkpointable=CHECKPOINTABLE), st.floats(0.0, 1.0))
def run(prof, frac):
    lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
    b = max(1, int(lb + frac * (up - lb)))
    try:
        ex = tp.plan_profile(prof, b, REFERENCE)
    except tp.BudgetError:
        ex = None
    try:
        p = tp.plan_profile(prof, b, "milp", time_limit=10, choose_starts=CHOOSE)
    except tp.BudgetError:
        res["both refuse" if ex is None else "milp refuses, exhaustive plans"] += 1
        return
    if ex is None:
        res["milp plans, exhaustive refuses"] += 1
        return
    res["compared"] += 1
    s = p.settings
    res["first solution used"] += s["fallback"] is None and len(s["attempts"]) == 1
    res["tightened"] += len(s["attempts"]) > 1
    res["pso fallback"] += bool(s["fallback"]) and not s["fallback"].startswith("none")
    res["optimum has a multi-unit segment"] += multi_unit_segments(ex.actions, ex.segment_starts) > 0
    res["milp plan has a multi-unit segment"] += multi_unit_segments(p.actions, p.segment_starts) > 0
    res["optimum uses a swap"] += "swap" in ex.actions
    e, m = ex.predicted["step_time"], p.predicted["step_time"]
    ratios.append(m / e if e > 0 else 1.0)
    if SHOW and m > e * (1 + 1e-9):
        print(f"{m / e:.4f} budget {b}\n  optimum {ex.actions} {ex.segment_starts}\n  milp    {p.actions} {p.segment_starts}\n  {json.dumps(prof)}")


run()
worse = [r for r in ratios if r > 1 + 1e-9]
print(dict(res))
print(f"above the optimum: {len(worse)} of {len(ratios)}; worst ratio {max(ratios):.4f}")
