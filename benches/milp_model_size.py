"""Size and first solve of the MILP on the builtin profiles and plan/profile files (docs/methods.md).

    python benches/milp_model_size.py [--files F ...] [--models M ...] [--time-limit 30]
        [--fractions 0.25 0.5 0.75] [--method milp] [--json out.jsonl] [-- milp_plan options]

One line per (profile, budget fraction): the model's columns, rows, nonzeros and binaries, the
build and solve time of the first solve (no tightening, no fallback), its status and gap, and
the evaluator's step time and feasibility of its plan. Budgets as `tensorplace-bench methods`.
"""

import argparse
import json
import os
import sys
import time

import tensorplace as tp
from tensorplace.methods import milp
from tensorplace.methods.bench import _profiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=tp.examples.names())
    ap.add_argument("--files", nargs="*", default=[])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--method", default="milp")
    ap.add_argument("--choose-starts", action="store_true", help="let the MILP choose segment starts")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = open(a.json, "a", encoding="utf-8") if a.json else None
    for name, prof in _profiles(a.models, a.files, 32):
        text = tp.planning.profile_json(prof)
        lb, up = tp.lower_bound(prof), tp.unplanned_peak(prof)
        for frac in a.fractions:
            budget = int(lb + frac * (up - lb))
            kw = {"choose_starts": True} if a.choose_starts else {}
            t0 = time.perf_counter()
            rec = milp.first_solve(text, budget, a.method, time_limit=a.time_limit, **kw)
            rec.update(profile=name, units=len(prof["units"]), fraction=frac, budget=budget,
                       wall=time.perf_counter() - t0)
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()


if __name__ == "__main__":
    sys.exit(main())
