"""``peers``: tensorplace against torch's checkpointing recipes and save_on_cpu, measured
(``tensorplace.peers``; registered here with the bench's model options and --json)."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Tuple

from . import common


def _load(a: argparse.Namespace) -> Tuple[Any, Any, Any]:
    rm = common.model_from_args(a)
    if rm.loss_fn is None:
        from ..profiler import default_loss

        return rm.model, rm.inputs[0] if len(rm.inputs) == 1 else rm.inputs, default_loss
    return rm.model, rm.inputs[0] if len(rm.inputs) == 1 else rm.inputs, rm.loss_fn


def _write(a: argparse.Namespace, data: Dict[str, Any]) -> None:
    # the bench's header has "command" and "device" (the measured device, as in every subcommand);
    # peers' own "device" (the model's torch device) goes in as "torch_device"
    a.out.update(**{("torch_device" if k == "device" else k): v for k, v in data.items() if k != "command"})


def add_cli(sub: Any) -> None:
    from .. import peers

    peers.add_cli(sub, common.model_args, _load, _write)
