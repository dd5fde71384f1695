"""Live device-memory counters: what a runtime policy reads during a step (delta_policy.py).

A runtime policy such as DELTA decides from the memory in use *now*, so it needs a counter it can
read at any point of the step, cheaply. memory.py measures the step's peak with torch's profiler,
which gives its records only when it stops, so it cannot serve.

* **CUDA**: ``torch.cuda.memory_allocated(device)``, the caching allocator's own count of the
  bytes of live tensors (everything on the device: parameters, gradients, optimizer state,
  activations).
* **CPU**: torch's CPU allocator takes its memory from the C heap (``posix_memalign``) and keeps
  no count it exposes outside the profiler. So the counter reads glibc's ``mallinfo2()`` (bytes in
  use, ``uordblks + hblkhd``, about 10 us a call here), as a difference from the step's start,
  minus what the backend took from the heap for its host tier in the meantime (numpy buffers),
  plus a base the caller gives (the bytes of the step's constant memory: parameters, buffers,
  gradients, inputs). Other heap allocations of the process (Python objects larger than 512 bytes,
  numpy) count too: a few kilobytes a step. tests/test_delta_runtime.py checks the counter against
  the profiler's records at the end of a forward. Not available where the C library is not glibc
  2.33 or later: pass ``memory_counter=`` (a function returning bytes) instead.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

import torch

__all__ = ["LiveMemory", "CudaLiveMemory", "HeapLiveMemory", "FunctionLiveMemory", "live_memory_for"]


class LiveMemory:
    """A counter of the device memory in use, in bytes. ``begin(base)`` at the start of a step
    (``base``: the bytes the counter cannot see on its own, for counters that count differences),
    then ``read()`` any number of times."""

    def begin(self, base: int) -> None:
        pass

    def read(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class CudaLiveMemory(LiveMemory):
    """``torch.cuda.memory_allocated``: absolute, ``base`` is ignored."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_mallinfo2: Any = None


def _heap_reader() -> Callable[[], int]:
    global _mallinfo2
    if _mallinfo2 is None:
        try:
            fn = ctypes.CDLL("libc.so.6").mallinfo2
        except (OSError, AttributeError) as e:
            raise RuntimeError(
                "the CPU live-memory counter reads glibc's mallinfo2(), which this C library does not have "
                "(glibc 2.33 or later is needed); pass memory_counter= (a function returning the device bytes "
                "in use) to the runtime policy instead"
            ) from e
        fn.restype = _MallInfo2
        fn.argtypes = []
        _mallinfo2 = fn

    def read() -> int:
        m = _mallinfo2()
        return int(m.uordblks + m.hblkhd)

    return read


class HeapLiveMemory(LiveMemory):
    """CPU: ``base`` plus the C heap's bytes in use since :meth:`begin`, less the host tier's
    heap bytes allocated since then (``host_bytes()``)."""

    def __init__(self, host_bytes: Optional[Callable[[], int]] = None) -> None:
        self._heap = _heap_reader()
        self._host = host_bytes or (lambda: 0)
        self._base = self._heap0 = self._host0 = 0

    def begin(self, base: int) -> None:
        self._base = int(base)
        self._heap0 = self._heap()
        self._host0 = self._host()

    def read(self) -> int:
        return self._base + (self._heap() - self._heap0) - (self._host() - self._host0)


class FunctionLiveMemory(LiveMemory):
    """A caller's counter: ``fn()`` returns the bytes in use (absolute)."""

    def __init__(self, fn: Callable[[], int]) -> None:
        self._fn = fn

    def read(self) -> int:
        return int(self._fn())


def live_memory_for(device: torch.device, backend: Any = None,
                    memory_counter: Optional[Callable[[], int]] = None) -> LiveMemory:
    """The counter for ``device``: the caller's function if given, CUDA's allocator count on a
    GPU, else the C heap less ``backend``'s host tier (``backend.host_heap_bytes()``)."""
    if memory_counter is not None:
        return FunctionLiveMemory(memory_counter)
    if device.type == "cuda":
        return CudaLiveMemory(device)
    host = getattr(backend, "host_heap_bytes", None)
    return HeapLiveMemory(host)
