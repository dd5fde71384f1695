"""Refuse ``torch.compile`` of the eager executor with an error that names the compiled path.

The executor's steps run Python per saved tensor (saved-tensor hooks, a replay per checkpoint
segment, copies on side streams), which dynamo cannot trace: without this check,
``torch.compile(tensorplace.run(model, plan))`` fails deep inside torch on its first step.
"""

from __future__ import annotations

import torch

from .errors import CompiledPathError

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
except ImportError:  # pragma: no cover - every supported torch has it
    get_eval_frame_callback = None

__all__ = ["compiling", "refuse_compile"]


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller, or running it under its frame callback
    (dynamo runs a frame it gave up tracing eagerly, with the callback still set for the frames
    that frame calls). Called once per training step."""
    if torch.compiler.is_compiling():
        return True
    return get_eval_frame_callback is not None and get_eval_frame_callback() is not None


def refuse_compile(what: str = "tensorplace.run()") -> None:
    """Raise :class:`CompiledPathError` when ``torch.compile`` traces or runs the caller."""
    if compiling():
        raise CompiledPathError(
            f"{what} trains under tensorplace's eager executor (saved-tensor hooks, Python per saved tensor), "
            "which torch.compile cannot trace. Train the module it returns without torch.compile, or, for a "
            "compiled model, run the plan through torch's own selective checkpointing: "
            "torch.compile(tensorplace.compiled(model, plan)) (retain and recompute actions; docs/compiled.md)")
