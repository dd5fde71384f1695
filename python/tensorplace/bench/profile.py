"""``profile``: profile a real model on this device and save the profile (versioned JSON), to plan
on any machine with ``tensorplace-bench plan``."""

from __future__ import annotations

import argparse
from typing import Any

from ..budget import format_bytes
from ..planning import lower_bound, save_profile, unplanned_peak
from . import common


def cmd_profile(a: argparse.Namespace) -> int:
    """Profile one training step of a real model on this device and save the profile."""
    rm = common.model_from_args(a)
    prof = common.profile(rm, a.repeats)
    save_profile(prof, a.output)
    m = prof["measured"]
    lb = lower_bound(prof)
    print(f"{rm.name} {rm.shapes()} on {common.where(rm.device)}: {len(prof['units'])} units, measured peak "
          f"{format_bytes(m['peak_bytes'])}, step {common.ms(m['step_time'])} ms; constant "
          f"{format_bytes(sum(prof['memory'].values()))}; smallest peak any plan could have {format_bytes(lb)}")
    print(f"profile saved to {a.output}; plan it anywhere with: tensorplace-bench plan {a.output} --budget SIZE")
    a.out.update(model=rm.name, inputs=rm.shapes(), path=a.output, units=len(prof["units"]),
                      measured=m, constant_bytes=sum(prof["memory"].values()), lower_bound_bytes=lb,
                      unplanned_peak_bytes=unplanned_peak(prof), d2h_bandwidth=prof["d2h_bandwidth"],
                      h2d_bandwidth=prof["h2d_bandwidth"])
    return 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser("profile", help="profile a real model on this device and save the profile",
                       description=cmd_profile.__doc__)
    common.real_args(p, search=None)
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="where to write the profile (JSON)")
    p.set_defaults(fn=cmd_profile)
