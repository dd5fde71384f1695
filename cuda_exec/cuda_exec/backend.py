"""The host tier an executor swaps activations to: the interface every backend implements.

A backend moves tensors between the device tier (memory torch's allocator counts: GPU memory on
CUDA, torch's CPU allocator on CPU) and the host tier (pinned buffers on CUDA; memory outside
torch's allocator on CPU). Copies are asynchronous and run in FIFO order on one copy queue (the
cost model's copy stream, docs/cost-model.md).

A backend whose small copies complete on the caller's thread (the CPU backend, up to its
``inline_bytes``) may also have ``copy_out(storages) -> buffers``, ``copy_back(buffers, views,
give_back=False) -> tensors`` (each buffer's bytes in a new device storage, as the tensor
``views`` describes: units.ViewMeta; ``give_back``: then the buffers are given back) and
``give_back(buffers)``: a stage's storages copied at once, with no handle per storage (the
executor's lean swap path, inline_swap.py).
"""

from __future__ import annotations

from typing import Protocol, Tuple

import torch


class HostHandle(Protocol):
    """An activation living in (or on its way to) the host tier."""

    nbytes: int


class Backend(Protocol):
    name: str

    def offload(self, tensor: torch.Tensor) -> HostHandle:
        """Queue a device-to-host copy of `tensor` and return at once.

        The backend keeps `tensor` alive until the copy completes and then drops its reference,
        so the device memory is freed as soon as nobody else holds it."""

    def prefetch(self, handle: HostHandle) -> None:
        """Queue the host-to-device copy (allocating the device tensor now); return at once."""

    def fetch(self, handle: HostHandle) -> torch.Tensor:
        """Return the device tensor, waiting for its prefetch (issuing it first if it was not)."""

    def release(self, handle: HostHandle) -> None:
        """Give the host buffer back to the pool (the handle is dead afterwards)."""

    def synchronize(self) -> None:
        """Wait for every queued copy."""

    def bandwidth(self, nbytes: int = 64 << 20) -> Tuple[float, float]:
        """Measure (device_to_host, host_to_device) bytes per second with `nbytes` copies."""

    def close(self) -> None:
        """Stop the copy worker and free every host buffer."""
