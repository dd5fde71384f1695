"""``models``: the model zoo that ``--model`` accepts."""

from __future__ import annotations

import argparse
from typing import Any

from . import common


def cmd_models(a: argparse.Namespace) -> int:
    """List the models --model accepts by name (and how to pass your own)."""
    z = common.zoo()
    common.table("models by name (--model NAME)", ["name", "what"], sorted(z.items()))
    print("your own: --model package.module:factory (see `tensorplace-bench demo --help`)")
    a.out["models"] = z
    return 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser("models", help="list the model zoo", description=cmd_models.__doc__)
    p.set_defaults(fn=cmd_models)
