"""The CUDA host tier: activations swapped to pinned host memory on a dedicated copy stream.

Built on cuda-python's runtime bindings (`cuda.bindings.runtime`); torch is used only for what
torch owns: allocating device tensors through its caching allocator, naming the current compute
stream, and `record_stream`.

Streams and ordering
--------------------
- One copy stream per backend, created with `cudaStreamCreateWithFlags(cudaStreamNonBlocking)`, so
  it never synchronises implicitly with the legacy default stream. All copies (D2H and H2D) run on
  it in FIFO order: that is the cost model's single copy queue (docs/cost-model.md).
- The compute stream is looked up live on every call (`torch.cuda.current_stream(device)`): the
  forward runs on the user's stream and autograd runs backward on its own device thread, where the
  current stream may differ. Nothing caches it.
- offload: record an event on the compute stream, make the copy stream wait on it (so the copy
  reads the finished activation), `cudaMemcpyAsync` D2H into a pinned buffer, record a completion
  event on the copy stream. Returns at once. The copy is ordered after the work queued so far on
  the current stream: the tensor must have been produced there (or on a stream already ordered
  before it), and must not be modified in place until the copy completed (the executor's rule).
- The source tensor is kept alive (a strong reference in a FIFO of pending copies) until its
  completion event has fired; the FIFO is polled with `cudaEventQuery` (never blocking) at every
  call into the backend and in `poll()`. Then the reference is dropped and torch's caching
  allocator gets the memory back. Until that moment the caching allocator cannot hand the block to
  anyone else, so the copy never reads reused memory.
- prefetch: allocate the device tensor with torch on the current compute stream (so the caching
  allocator associates the block with that stream), make the copy stream wait for the compute
  stream (the block may have been freed by compute work that is still queued), `cudaMemcpyAsync`
  H2D, record a ready event. Returns at once.
- fetch: `cudaStreamWaitEvent(current compute stream, ready event)` - a device-side wait, the host
  never blocks - and `tensor.record_stream(current stream)`, so if fetch runs on another stream
  than the one the tensor was allocated on, the caching allocator will not reuse it early.
- A swap deadline (`release_offload`) is a device-side wait too: the compute stream waits for the
  offload's completion event and the source is dropped at once.
- Nothing in offload / prefetch / fetch / release / poll / release_offload synchronises the device
  or even a stream:
  no `cudaDeviceSynchronize`, no `torch.cuda.synchronize`, no `cudaStreamSynchronize`. Only
  `synchronize()` (waits for the copy stream alone), `bandwidth()` (a measurement) and `close()`
  block the host.
- A prefetched tensor that is released (or whose handle is garbage collected) without being
  fetched: its allocation stream is made to wait for the ready event before the tensor is dropped,
  so the caching allocator cannot reuse the block while the H2D copy is still writing into it.

Pinned host buffers
-------------------
Allocating pinned memory costs milliseconds per call, so buffers come from `PinnedPool`: size
classes (4 KiB minimum; above that, four classes per power of two, so at most 25% waste), one
`cudaHostAlloc(cudaHostAllocPortable)` per buffer, allocated only when no free buffer of the class
(or of a class at most twice as large) is there, and reused across steps; `close()` frees them all
with `cudaFreeHost`. Reusing a buffer needs no host-side wait: every reader and writer of a pinned
buffer is a copy on the one copy stream, whose FIFO order puts a later D2H into the buffer after an
earlier H2D out of it.

Tensor layouts
--------------
- Dense tensors (non-overlapping and dense: contiguous, channels_last, any permutation of the
  dimensions, size-1 dimensions with any stride) are copied byte for byte, exactly their numel *
  itemsize bytes starting at `data_ptr()`, and come back with the same shape, strides and dtype
  (storage offset 0). No extra device memory.
- Anything else (a slice with gaps, a strided step, an expanded tensor with stride 0) is made
  contiguous first with `tensor.contiguous()` on the compute stream; the copy reads that temporary
  (kept alive until the copy completes) and the tensor comes back contiguous, same shape, dtype and
  values. This costs a temporary of numel * itemsize bytes on the device for the duration of the
  copy, never a copy of the whole underlying storage. (The executor moves the base of a view and
  rebuilds the view itself, so the backend mostly sees dense tensors.)
- Lazy conjugate / negative bits are resolved before the copy. Only strided layouts are supported.

Errors from CUDA raise `CudaError` naming the call and the CUDA error (e.g.
`cudaStreamWaitEvent failed: cudaErrorInvalidResourceHandle (...)`). Constructing a `CudaBackend`
without a usable GPU raises `CudaUnavailableError` with the reason from `gpu.cuda_status()`.

Handles must be released (`release`) when the activation is no longer needed; a handle dropped
without release returns its buffer to the pool at the next call into the backend. `close()` (or the
context manager) must be called to free the pinned memory; it is not done in `__del__`.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from .backend import Backend
from .gpu import cuda_available, cuda_status, error_name, error_string, runtime_module

__all__ = [
    "CudaBackend",
    "CudaError",
    "CudaHostHandle",
    "CudaUnavailableError",
    "PinnedPool",
    "size_class",
]

MIN_CLASS = 4096


class CudaError(RuntimeError):
    """A CUDA runtime call failed; `.call`, `.error_name` and `.code` say which and how."""

    def __init__(self, call: str, name: str, code: int, text: str = ""):
        detail = f" ({text})" if text else ""
        super().__init__(f"{call} failed: {name} (error {code}){detail}")
        self.call = call
        self.error_name = name
        self.code = code


class CudaUnavailableError(RuntimeError):
    """Raised when a CudaBackend is constructed where no usable CUDA GPU exists."""


def size_class(nbytes: int) -> int:
    """The pinned buffer size used for `nbytes`: at least 4 KiB, then four classes per octave."""
    if nbytes <= MIN_CLASS:
        return MIN_CLASS
    base = 1 << ((nbytes - 1).bit_length() - 1)  # base < nbytes <= 2 * base
    step = base >> 2
    return base + -(-(nbytes - base) // step) * step


class _Cuda:
    """Error checking around a cuda-python runtime module (`cuda.bindings.runtime`)."""

    def __init__(self, rt: Any):
        self.rt = rt
        self.success = rt.cudaError_t.cudaSuccess
        self.not_ready = rt.cudaError_t.cudaErrorNotReady

    def check(self, call: str, result: Any) -> Any:
        """`result` is what a cuda-python call returns: (err, *values). Returns the values
        (None, one value, or a tuple), raising CudaError when err is not cudaSuccess."""
        if not isinstance(result, tuple):
            result = (result,)
        err = result[0]
        if err != self.success:
            raise CudaError(call, error_name(self.rt, err), int(err), error_string(self.rt, err))
        values = result[1:]
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    def __call__(self, call: str, *args: Any) -> Any:
        return self.check(call, getattr(self.rt, call)(*args))


class PinnedPool:
    """Pinned host buffers in size classes, allocated with cudaHostAlloc only when no free buffer
    fits, reused until `free_all()`."""

    def __init__(self, cuda: _Cuda):
        self._cuda = cuda
        self._free: Dict[int, List[int]] = collections.defaultdict(list)  # class -> pointers
        self._owned: Dict[int, int] = {}  # pointer -> class size, every live allocation
        self.allocations = 0  # cudaHostAlloc calls ever made
        self.frees = 0  # cudaFreeHost calls ever made
        self.bytes_in_use = 0

    @property
    def bytes_reserved(self) -> int:
        return sum(self._owned.values())

    def stats(self) -> Dict[str, int]:
        return {
            "allocations": self.allocations,
            "frees": self.frees,
            "buffers": len(self._owned),
            "bytes_reserved": self.bytes_reserved,
            "bytes_in_use": self.bytes_in_use,
        }

    def acquire(self, nbytes: int) -> Tuple[int, int]:
        """A (pointer, capacity) buffer of at least `nbytes`."""
        cls = size_class(nbytes)
        ptr = None
        if self._free.get(cls):
            ptr = self._free[cls].pop()
        else:  # a free buffer up to twice as large beats a new pinned allocation
            for bigger in sorted(c for c, lst in self._free.items() if lst and cls < c <= 2 * cls):
                cls = bigger
                ptr = self._free[bigger].pop()
                break
        if ptr is None:
            cls = size_class(nbytes)
            rt = self._cuda.rt
            ptr = int(self._cuda("cudaHostAlloc", cls, rt.cudaHostAllocPortable))
            self._owned[ptr] = cls
            self.allocations += 1
        self.bytes_in_use += cls
        return ptr, cls

    def give_back(self, ptr: int) -> None:
        cls = self._owned[ptr]
        self._free[cls].append(ptr)
        self.bytes_in_use -= cls

    def reserve(self, sizes: List[int]) -> None:
        """Grow the pool so that buffers for all of `sizes` at once exist (e.g. from a plan)."""
        taken = [self.acquire(n)[0] for n in sizes]
        for ptr in taken:
            self.give_back(ptr)

    def free_all(self) -> None:
        first_error: Optional[BaseException] = None
        for ptr in list(self._owned):
            try:
                self._cuda("cudaFreeHost", ptr)
                self.frees += 1
            except CudaError as exc:  # keep freeing the others
                first_error = first_error or exc
            del self._owned[ptr]
        self._free.clear()
        self.bytes_in_use = 0
        if first_error is not None:
            raise first_error


class _EventPool:
    """cudaEventDisableTiming events, created once and re-recorded. An event may be given back as
    soon as every cudaStreamWaitEvent on it has been issued (a wait captures the event's state at
    the call) or once cudaEventQuery reported it complete."""

    def __init__(self, cuda: _Cuda, guard):
        self._cuda = cuda
        self._guard = guard
        self._free: List[Any] = []
        self._all: List[Any] = []
        self.created = 0
        self.destroyed = 0

    def acquire(self) -> Any:
        if self._free:
            return self._free.pop()
        with self._guard():
            ev = self._cuda("cudaEventCreateWithFlags", self._cuda.rt.cudaEventDisableTiming)
        self._all.append(ev)
        self.created += 1
        return ev

    def give_back(self, ev: Any) -> None:
        self._free.append(ev)

    def destroy_all(self) -> None:
        first_error: Optional[BaseException] = None
        for ev in self._all:
            try:
                self._cuda("cudaEventDestroy", ev)
                self.destroyed += 1
            except CudaError as exc:
                first_error = first_error or exc
        self._all.clear()
        self._free.clear()
        if first_error is not None:
            raise first_error


class _TorchCuda:
    """The few things asked of torch: the live current stream, allocation, record_stream."""

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def empty_strided(self, size, stride, dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def device_guard(self):
        return torch.cuda.device(self.device)


class _Slot:
    """What a handle owns; kept apart from the handle so that a finalizer can reclaim it."""

    __slots__ = ("ptr", "capacity", "device", "alloc_stream", "ready_event", "fetched", "offload_event",
                 "__weakref__")

    def __init__(self, ptr: Optional[int], capacity: int):
        self.ptr = ptr
        self.capacity = capacity
        self.device: Optional[torch.Tensor] = None  # prefetched, not yet fetched
        self.alloc_stream: Optional[int] = None  # compute stream the prefetch allocated on
        self.ready_event: Any = None  # recorded on the copy stream after the last H2D
        self.fetched: Optional[weakref.ref] = None  # the tensor fetch returned
        self.offload_event: Any = None  # the offload's completion event, until seen complete


class CudaHostHandle:
    """An activation in pinned host memory (or on its way there)."""

    __slots__ = ("nbytes", "shape", "stride", "dtype", "_slot", "_finalizer", "__weakref__")

    def __init__(self, nbytes, shape, stride, dtype, slot):
        self.nbytes = nbytes  # bytes copied each way
        self.shape = shape
        self.stride = stride  # strides the fetched tensor will have
        self.dtype = dtype
        self._slot: Optional[_Slot] = slot
        self._finalizer = None

    @property
    def host_nbytes(self) -> int:
        """Bytes of pinned memory held (the size class)."""
        return self._slot.capacity if self._slot is not None else 0

    @property
    def released(self) -> bool:
        return self._slot is None

    def __repr__(self) -> str:
        state = "released" if self._slot is None else "live"
        return f"CudaHostHandle({tuple(self.shape)}, {self.dtype}, {self.nbytes} B, {state})"


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill exactly numel consecutive slots."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


class CudaBackend(Backend):
    """Swaps activations between CUDA device memory and pooled pinned host buffers.

    `device`: a CUDA device (default: torch's current one). The private `_runtime` / `_torch`
    arguments replace cuda-python's runtime module and the torch adapter (tests drive the
    backend's logic without a GPU with them)."""

    name = "cuda"

    #: copies that run at once: one copy stream today, so one queue in the cost model (the
    #: device's two copy engines would need a stream per direction)
    copy_engines = 1

    def __init__(self, device: Any = None, *, _runtime: Any = None, _torch: Any = None):
        self._closed = True  # until fully constructed
        if _torch is None:
            if not cuda_available():
                raise CudaUnavailableError(
                    f"CudaBackend needs a CUDA GPU and there is none usable here: {cuda_status()}. "
                    "Use the CPU backend (cuda_exec.cpu_backend) on this machine."
                )
            dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"CudaBackend needs a CUDA device, got {dev}")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            _torch = _TorchCuda(dev)
        self._torch = _torch
        self.device: torch.device = _torch.device
        self._cuda = _Cuda(runtime_module() if _runtime is None else _runtime)
        self._legacy_stream = int(getattr(self._cuda.rt, "cudaStreamLegacy", 1))
        self._lock = threading.RLock()
        self._dead: Deque[_Slot] = collections.deque()  # slots of handles dropped unreleased
        self._slots: "weakref.WeakSet[_Slot]" = weakref.WeakSet()
        # FIFO of (completion event, tensor kept alive) in copy-stream order
        self._pending: Deque[Tuple[Any, torch.Tensor]] = collections.deque()
        #: id(slot) -> completion event of its offload, while that offload is pending
        #: id(pending offload's completion event) -> its slot (events are pooled and reused)
        self._event_slot: Dict[int, "weakref.ref[_Slot]"] = {}
        with self._torch.device_guard():
            self._stream = self._cuda("cudaStreamCreateWithFlags", self._cuda.rt.cudaStreamNonBlocking)
        self.pool = PinnedPool(self._cuda)
        self._events = _EventPool(self._cuda, self._torch.device_guard)
        self.stats = {"offloads": 0, "prefetches": 0, "fetches": 0, "releases": 0, "d2h_bytes": 0, "h2d_bytes": 0,
                      "deadline_releases": 0, "kept_sources": 0}
        self._closed = False

    # ------------------------------------------------------------------ public API

    @property
    def copy_stream(self) -> int:
        """The copy stream's handle (a cudaStream_t as an int)."""
        return int(self._stream)

    @property
    def pending_offloads(self) -> int:
        """Offloads whose completion has not been observed yet (their sources are still held)."""
        return len(self._pending)

    def offload(self, tensor: torch.Tensor) -> CudaHostHandle:
        with self._lock:
            self._service()
            if tensor.layout != torch.strided:
                raise TypeError(f"CudaBackend.offload supports strided tensors only, got {tensor.layout}")
            if tensor.device != self.device:
                raise ValueError(f"CudaBackend on {self.device} cannot offload a tensor on {tensor.device}")
            src = tensor.detach()
            if src.is_conj():
                src = src.resolve_conj()
            if src.is_neg():
                src = src.resolve_neg()
            if not _is_dense(src):
                src = src.contiguous()  # runs on the compute stream; the copy waits for it below
            nbytes = src.numel() * src.element_size()
            if nbytes == 0:
                slot = _Slot(None, 0)
                return self._new_handle(0, src, slot)
            ptr, capacity = self.pool.acquire(nbytes)
            slot = _Slot(ptr, capacity)
            try:
                compute = self._compute_stream()[1]
                self._copy_waits_for(compute)
                rt = self._cuda.rt
                self._cuda("cudaMemcpyAsync", ptr, src.data_ptr(), nbytes,
                           rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream)
                done = self._events.acquire()
                self._cuda("cudaEventRecord", done, self._stream)
            except BaseException:
                # the buffer may be the target of a queued copy: FIFO reuse keeps that safe
                self.pool.give_back(ptr)
                raise
            self._pending.append((done, src))  # src (a view of the caller's storage) stays alive
            slot.offload_event = done
            self._event_slot[id(done)] = weakref.ref(slot)
            self.stats["offloads"] += 1
            self.stats["d2h_bytes"] += nbytes
            return self._new_handle(nbytes, src, slot)

    def prefetch(self, handle: CudaHostHandle) -> None:
        with self._lock:
            self._service()
            slot = self._live(handle)
            if slot.device is not None or (slot.fetched is not None and slot.fetched() is not None):
                return  # already on its way, or the fetched tensor is still alive
            self._prefetch(handle, slot)

    def fetch(self, handle: CudaHostHandle) -> torch.Tensor:
        with self._lock:
            self._service()
            slot = self._live(handle)
            tensor = slot.fetched() if slot.fetched is not None else None
            if tensor is None:
                if slot.device is None:
                    self._prefetch(handle, slot)
                tensor = slot.device
            stream, stream_handle = self._compute_stream()
            if slot.ready_event is not None:  # device-side wait: the host does not block
                self._cuda("cudaStreamWaitEvent", stream_handle, slot.ready_event, 0)
            self._torch.record_stream(tensor, stream)
            slot.device = None
            slot.fetched = weakref.ref(tensor)
            self.stats["fetches"] += 1
            return tensor

    def release(self, handle: CudaHostHandle) -> None:
        with self._lock:
            slot = handle._slot
            if slot is None:
                return
            handle._slot = None
            if handle._finalizer is not None:
                handle._finalizer.detach()
            if self._closed:
                return  # close() already freed everything
            self._reclaim(slot)
            self._service()
            self.stats["releases"] += 1

    def offload_in_flight(self, handle: CudaHostHandle) -> bool:
        """Whether ``handle``'s offload has not been seen complete (its source is still held,
        unless a swap deadline let it go)."""
        slot = handle._slot
        return slot is not None and slot.offload_event is not None

    def poll(self) -> int:
        """Drop the sources of completed offloads and reclaim dropped handles, without blocking.
        Returns the number of offloads still in flight."""
        with self._lock:
            self._service()
            return len(self._pending)

    def wait_offload(self, handle: CudaHostHandle) -> None:
        """Block the host until `handle`'s offload (and every copy queued before it) has completed,
        then drop the sources: the cost model's wait for a swap-out before a stage."""
        with self._lock:
            self._check_open()
            ev = handle._slot.offload_event if handle._slot is not None else None
            if ev is not None:
                self._cuda("cudaEventSynchronize", ev)
            self._service()

    def release_offload(self, handle: CudaHostHandle) -> None:
        """The cost model's wait for a swap-out before a stage, without blocking the host: the
        current compute stream waits (``cudaStreamWaitEvent``) for `handle`'s offload, and so, the
        copy stream being FIFO, for every copy queued before it; then the sources of those copies
        are dropped. The caching allocator may hand their blocks to later work on the compute
        stream at once: that work runs after the copies have read them (TransformerEngine's
        ``release_activation_forward_gpu_memory`` does the same). Their events stay pending until
        they fire (``poll``)."""
        with self._lock:
            self._service()
            ev = handle._slot.offload_event if handle._slot is not None else None
            if ev is None:
                return  # completed already (its source is gone), released, or never copied
            self._cuda("cudaStreamWaitEvent", self._compute_stream()[1], ev, 0)
            for i, (e, _src) in enumerate(self._pending):
                self._pending[i] = (e, None)
                if e is ev:
                    break
            self.stats["deadline_releases"] += 1

    def synchronize(self) -> None:
        """Wait (on the host) for every copy queued on the copy stream; the compute stream and
        the rest of the device are not waited for."""
        with self._lock:
            self._check_open()
            self._cuda("cudaStreamSynchronize", self._stream)
            self._service()

    def reserve(self, sizes: List[int]) -> None:
        """Pre-allocate pinned buffers for activations of these byte sizes (all live at once)."""
        with self._lock:
            self._check_open()
            self.pool.reserve([n for n in sizes if n > 0])

    def bandwidth(self, nbytes: int = 64 << 20, repeats: int = 3) -> Tuple[float, float]:
        """(device_to_host, host_to_device) bytes per second: the best of `repeats` timed
        `nbytes` copies between a device tensor and a pooled pinned buffer, on the copy stream,
        timed with CUDA events. Blocks the host until the copies are done."""
        with self._lock:
            self._service()
            rt = self._cuda.rt
            nbytes = max(int(nbytes), 1)
            dev = self._torch.empty_strided((nbytes,), (1,), torch.uint8)
            ptr, _ = self.pool.acquire(nbytes)
            timing: List[Any] = []
            try:
                with self._torch.device_guard():
                    for _ in range(2):  # timing events (the pooled ones disable timing)
                        timing.append(self._cuda("cudaEventCreateWithFlags", rt.cudaEventDefault))
                start, end = timing
                self._copy_waits_for(self._compute_stream()[1])
                result = []
                for kind, dst, src in (
                    (rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, ptr, dev.data_ptr()),
                    (rt.cudaMemcpyKind.cudaMemcpyHostToDevice, dev.data_ptr(), ptr),
                ):
                    self._cuda("cudaMemcpyAsync", dst, src, nbytes, kind, self._stream)  # warm-up
                    best = float("inf")
                    for _ in range(max(1, repeats)):
                        self._cuda("cudaEventRecord", start, self._stream)
                        self._cuda("cudaMemcpyAsync", dst, src, nbytes, kind, self._stream)
                        self._cuda("cudaEventRecord", end, self._stream)
                        self._cuda("cudaEventSynchronize", end)
                        ms = self._cuda("cudaEventElapsedTime", start, end)
                        best = min(best, max(float(ms), 1e-6) / 1e3)
                    result.append(nbytes / best)
                return result[0], result[1]
            finally:
                # normally a no-op (end was synchronised); after an error it keeps `dev` and the
                # buffer alive until no copy can touch them any more
                self._cuda.rt.cudaStreamSynchronize(self._stream)
                self.pool.give_back(ptr)
                for ev in timing:
                    self._cuda.rt.cudaEventDestroy(ev)
                del dev

    def close(self) -> None:
        """Wait for the copy stream, drop every held tensor, destroy events and the stream, and
        free every pinned buffer. Idempotent; handles are dead afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors: List[BaseException] = []
            try:
                self._cuda("cudaStreamSynchronize", self._stream)
            except CudaError as exc:
                errors.append(exc)
            self._pending.clear()
            self._event_slot.clear()
            self._dead.clear()
            for slot in list(self._slots):
                slot.ptr = None
                slot.device = None
                slot.ready_event = None
            for step in (self._events.destroy_all, self.pool.free_all):
                try:
                    step()
                except CudaError as exc:
                    errors.append(exc)
            try:
                self._cuda("cudaStreamDestroy", self._stream)
            except CudaError as exc:
                errors.append(exc)
            self._stream = None
            if errors:
                raise errors[0]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CudaBackend is closed")

    def _new_handle(self, nbytes: int, src: torch.Tensor, slot: _Slot) -> CudaHostHandle:
        handle = CudaHostHandle(nbytes, tuple(src.shape), tuple(src.stride()), src.dtype, slot)
        self._slots.add(slot)
        handle._finalizer = weakref.finalize(handle, self._dead.append, slot)
        return handle

    def _live(self, handle: CudaHostHandle) -> _Slot:
        slot = handle._slot
        if slot is None:
            raise RuntimeError(f"{handle!r} was released")
        return slot

    def _compute_stream(self) -> Tuple[Any, int]:
        """The current compute stream of our device, looked up now: (torch stream, handle).
        torch names its default stream 0, which means the legacy default stream (torch is not
        built for per-thread default streams); it is passed to cuda-python as cudaStreamLegacy so
        that it means the same whatever default-stream mode cuda-python's runtime is in."""
        stream = self._torch.current_stream()
        handle = int(stream.cuda_stream)
        return stream, (handle if handle else self._legacy_stream)

    def _copy_waits_for(self, compute_stream: int) -> None:
        """Order the copy stream after everything queued so far on `compute_stream`."""
        ev = self._events.acquire()
        self._cuda("cudaEventRecord", ev, compute_stream)
        self._cuda("cudaStreamWaitEvent", self._stream, ev, 0)
        self._events.give_back(ev)  # the wait captured the event; it may be re-recorded

    def _pending_source(self, slot: _Slot) -> Optional[torch.Tensor]:
        """The device bytes of `slot`'s offload while its copy has not completed and no swap
        deadline has let them go (else None)."""
        ev = slot.offload_event
        if ev is None:
            return None
        for e, src in self._pending:
            if e is ev:
                return src
        return None

    def _prefetch(self, handle: CudaHostHandle, slot: _Slot) -> None:
        src = self._pending_source(slot)
        if src is not None:
            # the offload has not completed, so its source is still on the device: hand those
            # bytes back rather than allocate a second copy next to them (the CPU backend does too)
            slot.device = src
            self.stats["kept_sources"] += 1
            return
        stream = self._compute_stream()[1]
        tensor = self._torch.empty_strided(handle.shape, handle.stride, handle.dtype)
        slot.alloc_stream = stream
        if handle.nbytes:
            # The caching allocator may hand back a block freed by compute work still queued on
            # this stream: the copy must not overwrite it before that work has run.
            self._copy_waits_for(stream)
            rt = self._cuda.rt
            self._cuda("cudaMemcpyAsync", tensor.data_ptr(), slot.ptr, handle.nbytes,
                       rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream)
            if slot.ready_event is None:
                slot.ready_event = self._events.acquire()
            self._cuda("cudaEventRecord", slot.ready_event, self._stream)
            self.stats["h2d_bytes"] += handle.nbytes
        slot.device = tensor
        self.stats["prefetches"] += 1

    def _reclaim(self, slot: _Slot) -> None:
        """Give back what a released (or dropped) handle owned."""
        if self._closed:
            return
        if slot.device is not None and slot.ready_event is not None:
            # prefetched, never fetched: the H2D may still be writing into the tensor's block.
            # The block's stream waits for it, so the allocator cannot reuse the block too early.
            self._cuda("cudaStreamWaitEvent", slot.alloc_stream, slot.ready_event, 0)
        slot.device = None
        slot.fetched = None
        if slot.ready_event is not None:
            self._events.give_back(slot.ready_event)
            slot.ready_event = None
        if slot.ptr is not None:
            # FIFO on the copy stream: a later D2H into this buffer runs after our H2D out of it
            self.pool.give_back(slot.ptr)
            slot.ptr = None
        self._slots.discard(slot)

    def _service(self) -> None:
        """Non-blocking housekeeping at every call: reclaim dropped handles, and drop the sources
        of offloads whose completion event has fired (cudaEventQuery)."""
        self._check_open()
        while self._dead:
            self._reclaim(self._dead.popleft())
        while self._pending:
            ev, _src = self._pending[0]
            err = self._cuda.rt.cudaEventQuery(ev)
            err = err[0] if isinstance(err, tuple) else err
            if err == self._cuda.not_ready:
                break  # FIFO: later copies are not done either
            self._cuda.check("cudaEventQuery", (err,))
            self._pending.popleft()
            ref = self._event_slot.pop(id(ev), None)
            owner = ref() if ref is not None else None
            if owner is not None and owner.offload_event is ev:
                owner.offload_event = None
            self._events.give_back(ev)
