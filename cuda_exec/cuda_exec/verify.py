"""Verify mode: every saved tensor the executor moves or drops is checksummed when it leaves and
checked when it comes back; a mismatch raises :class:`VerificationError`.

Turn it on with ``PlannedModule(..., verify=True)`` or the environment variable
``TENSORPLACE_VERIFY=1``. It costs a copy and a hash of every moved or dropped tensor.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch

__all__ = ["VerificationError", "checksum", "check", "verify_from_env"]


class VerificationError(RuntimeError):
    """A saved tensor came back different from what was swapped out or dropped."""


def verify_from_env() -> bool:
    """Whether ``TENSORPLACE_VERIFY`` asks for verify mode."""
    return os.environ.get("TENSORPLACE_VERIFY", "").strip().lower() in ("1", "true", "yes", "on")


def checksum(t: torch.Tensor) -> str:
    """A digest of ``t``'s shape, strides, dtype and the bytes of its elements (not its storage)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(t.shape), tuple(t.stride()), str(t.dtype))).encode())
    if t.numel() > 0:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check(t: torch.Tensor, expected: Optional[str], what: str) -> None:
    """Raise :class:`VerificationError` if ``t``'s checksum is not ``expected`` (None: no check)."""
    if expected is None:
        return
    got = checksum(t)
    if got != expected:
        raise VerificationError(
            f"tensorplace verify: {what} came back different "
            f"(shape {tuple(t.shape)}, dtype {t.dtype}; checksum {got} != {expected})"
        )
