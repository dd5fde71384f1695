"""The MILP plan against the exhaustive optimum on random small profiles (docs/methods.md).

    python benches/milp_vs_exhaustive.py [examples] [max_units]

Profiles come from tests/profiles.py (Hypothesis generator, generation phase only); budgets are
uniform between the lower bound and the unplanned peak.
"""

import collections
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
warnings.filterwarnings("ignore")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tensorplace as tp  # noqa: E402
from profiles import dag_profiles  # noqa: E402

N, MAX_UNITS = int(sys.argv[1]) if len(sys.argv) > 1 else 300, int(sys.argv[2]) if len(sys.argv) > 2 else 7
res = collections.Counter()
ratios = []


@settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), database=None, phases=[Phase.generate])
@given(dag_profiles(max_units=MAX_UNITS), st.floats(0.0, 1.0))
def run(prof, frac):
    lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
    b = max(1, int(lb + frac * (up - lb)))
    try:
        ex = tp.plan_profile(prof, b, "exhaustive")
    except tp.BudgetError:
        ex = None
    try:
        p = tp.plan_profile(prof, b, "milp", time_limit=10)
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
    e, m = ex.predicted["step_time"], p.predicted["step_time"]
    ratios.append(m / e if e > 0 else 1.0)


run()
worse = [r for r in ratios if r > 1 + 1e-9]
print(dict(res))
print(f"above the optimum: {len(worse)} of {len(ratios)}; worst ratio {max(ratios):.4f}")
