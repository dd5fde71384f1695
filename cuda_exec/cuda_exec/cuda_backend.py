"""The CUDA host tier: activations swapped to pinned host memory on two copy streams.

Built on cuda-python's runtime bindings (`cuda.bindings.runtime`); torch is used only for what
torch owns: allocating device tensors through its caching allocator, naming the current compute
stream, and `record_stream`.

Streams and ordering
--------------------
- Two copy streams per backend, one per direction (`copy_engines = 2`: a GPU's device-to-host and
  host-to-device copies run at once on separate copy engines, the cost model's two copy queues,
  docs/cost-model.md). Both are created with `cudaStreamCreateWithFlags(cudaStreamNonBlocking)`, so
  they never synchronise implicitly with the legacy default stream.
- The compute stream is looked up live on every call (its raw handle, torch's
  `_cuda_getCurrentRawStream`, without making a `torch.cuda.Stream`): the forward runs on the
  user's stream and autograd runs backward on its own device thread, where the current stream may
  differ. Nothing caches it.
- offload: record an event on the compute stream now (the copy must read the finished
  activation) and put the copy in a **host-side queue**; return at once. Device-to-host copies are
  issued from that queue to the D2H stream with a small window in flight: a copy is issued when no
  D2H copy is in flight, or when at most `d2h_window` copies of at most `d2h_window_bytes` bytes in
  all would wait behind the one running (what is in flight is what `cudaEventQuery` has not seen
  complete). Every call into the backend issues what the window allows. Issuing: the D2H stream
  waits for the offload's compute event (and for the pinned buffer's fence, below),
  `cudaMemcpyAsync` D2H, a completion event on the D2H stream. `offload_many` (the executor's
  storages of one stage) records one compute event for the batch, and the D2H stream waits for it
  once when the batch's copies are issued in a row (the stream is FIFO).
- **Cancelling.** A copy queued on a CUDA stream cannot be taken back; one still in the host queue
  can. A prefetch or fetch of an offload that has not been issued cancels it: its device bytes are
  used as they are (the cost model cancels a swap-out that is still queued when its tensor is
  needed, and so never copies it); a release drops it. So at most the window's copies run that the
  model did not want, never a backlog of them.
- The source tensor is kept alive (a strong reference) until its copy has completed: in the host
  queue, then in a FIFO of issued copies polled with `cudaEventQuery` (never blocking) at every
  call into the backend and in `poll()`. Then the reference is dropped and torch's caching
  allocator gets the memory back. Until that moment the caching allocator cannot hand the block to
  anyone else, so the copy never reads reused memory. (The sources are not marked with
  `record_stream` on the copy stream: torch's allocator would then count the block as freed when
  the tensor dies but reuse it only once the host sees the copy's event complete, at some later
  allocation, so a swap deadline, below, could not make it reusable at once; see
  docs/cost-model.md, "Where the executor differs".)
- prefetch: allocate the device tensor with torch on the current compute stream (so the caching
  allocator associates the block with that stream), make the H2D stream wait for the compute
  stream (the block may have been freed by compute work that is still queued) and for the
  offload's completion event if it has not been seen complete (the two directions run on
  different streams), `cudaMemcpyAsync` H2D, record a ready event. Returns at once. If the offload
  is still queued on the host it is cancelled instead; if it was issued but has not completed, its
  source (still alive) is handed back, no second copy is allocated next to it. `prefetch_many`
  (a stage's prefetches) makes the H2D stream wait for the compute stream once for the batch (it
  queues no compute work between its copies).
- fetch: `cudaStreamWaitEvent(current compute stream, ready event)` - a device-side wait, the host
  never blocks - unless that stream already waited for a ready event recorded later on the H2D
  stream (FIFO: a stage's tensors are often fetched last first); and, when fetch runs on another
  stream than the one the prefetch allocated the tensor on, `tensor.record_stream(current
  stream)`, so the caching allocator will not reuse it early (on its own stream the allocator
  needs no record). Stream handles name the same stream for the process's life (torch's streams
  come from its pools and are never destroyed).
- A swap deadline (`release_offload`) is a device-side wait too: the offload (and every offload
  queued on the host before it) is issued if it was not, the compute stream waits for its
  completion event (and so, the D2H stream being FIFO, for every D2H copy before it) and the
  sources are dropped at once: the caching allocator may reuse their blocks for later compute
  work right away, which the stream wait orders after the copies.
- Nothing in offload / prefetch / fetch / release / poll / release_offload synchronises the device
  or even a stream:
  no `cudaDeviceSynchronize`, no `torch.cuda.synchronize`, no `cudaStreamSynchronize`. Only
  `synchronize()` (waits for the copy streams alone), `wait_offload()`, `bandwidth()` (a
  measurement) and `close()` block the host.
- A prefetched tensor that is released (or whose handle is garbage collected) without being
  fetched: its allocation stream is made to wait for the ready event before the tensor is dropped,
  so the caching allocator cannot reuse the block while the H2D copy is still writing into it.

Pinned host buffers
-------------------
Allocating pinned memory costs milliseconds per call, so buffers come from `PinnedPool`: size
classes (4 KiB minimum; above that, four classes per power of two, so at most 25% waste), one
`cudaHostAlloc(cudaHostAllocPortable)` per buffer, allocated only when no free buffer of the class
(or of a class at most twice as large) is there, and reused across steps; `reserve(sizes)` makes
the buffers for a set of sizes up front (the executor reserves its plan's swap set after its
learning step, so steady steps allocate no pinned memory); `close()` frees them all with
`cudaFreeHost`. A buffer is written only by D2H copies (one stream, FIFO) and read only by H2D
copies of its own handle; a buffer given back after an H2D copy read it keeps that copy's ready
event as a **fence**, and the next D2H copy into it waits for the fence on the D2H stream (no host
wait), so it never overwrites bytes an H2D copy on the other stream is still reading. The wait is
left out where it is already implied: a compute stream waited for the fence (the fetch of its
tensor, or the release of one never fetched) before the compute event the copy waits for was
recorded on that stream (the event completes after the fence then, and the D2H stream waits for
it): in steady steps, every reused buffer.

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

Without a GPU, `cuda_exec.sim_device` runs this backend on a simulated device (host memory, a
clock, streams, events and copy engines): tests/test_cuda_backend.py and tests/test_sim_device.py.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

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
        self._fns: Dict[str, Any] = {}  #: call name -> the runtime's function, looked up once

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
        fn = self._fns.get(call)
        if fn is None:
            fn = self._fns[call] = getattr(self.rt, call)
        result = fn(*args)
        if type(result) is tuple and len(result) == 1 and result[0] == self.success:
            return None  # the calls of the hot path: no values
        return self.check(call, result)


class PinnedPool:
    """Pinned host buffers in size classes, allocated with cudaHostAlloc only when no free buffer
    fits, reused until `free_all()`. A free buffer may carry a fence: the ready event of the last
    H2D copy that read it (module docstring)."""

    def __init__(self, cuda: _Cuda):
        self._cuda = cuda
        self._free: Dict[int, List[int]] = collections.defaultdict(list)  # class -> pointers
        self._owned: Dict[int, int] = {}  # pointer -> class size, every live allocation
        self._fences: Dict[int, Any] = {}  # pointer -> event the next writer must wait for
        #: pointer -> (compute stream, order) where a compute stream waited for its fence
        #: (CudaBackend._fence_implied)
        self._covers: Dict[int, Tuple[int, int]] = {}
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

    def _allocate(self, cls: int) -> int:
        rt = self._cuda.rt
        ptr = int(self._cuda("cudaHostAlloc", cls, rt.cudaHostAllocPortable))
        self._owned[ptr] = cls
        self.allocations += 1
        return ptr

    def acquire(self, nbytes: int) -> Tuple[int, int]:
        """A (pointer, capacity) buffer of at least `nbytes` (take its fence with `take_fence`)."""
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
            ptr = self._allocate(cls)
        self.bytes_in_use += cls
        return ptr, cls

    def take_fence(self, ptr: int) -> Any:
        """The event the next copy into `ptr` must wait for (None: nothing), handed to the caller."""
        return self._fences.pop(ptr, None)

    def take_cover(self, ptr: int) -> Optional[Tuple[int, int]]:
        """Where a compute stream waited for the fence of `ptr` (see `give_back`), handed to the
        caller with the fence."""
        return self._covers.pop(ptr, None)

    def give_back(self, ptr: int, fence: Any = None, cover: Optional[Tuple[int, int]] = None) -> None:
        """Return a buffer; `fence`: the ready event of an H2D copy that may still read it (the
        pool keeps it for the next writer); `cover`: (compute stream, order) where a compute
        stream waited for that event, if one did."""
        cls = self._owned[ptr]
        if fence is not None:
            assert ptr not in self._fences, "a buffer has one reader at most"
            self._fences[ptr] = fence
            if cover is not None:
                self._covers[ptr] = cover
            else:
                self._covers.pop(ptr, None)
        self._free[cls].append(ptr)
        self.bytes_in_use -= cls

    def reserve(self, sizes: List[int]) -> int:
        """Grow the pool so that buffers for all of `sizes` at once exist (e.g. a plan's swap set):
        a class gets as many buffers as `sizes` needs of it, counting those it has (free or in
        use). Returns the number of buffers allocated."""
        need: Dict[int, int] = collections.Counter(size_class(n) for n in sizes if n > 0)
        have: Dict[int, int] = collections.Counter(self._owned.values())
        made = 0
        for cls, count in sorted(need.items()):
            for _ in range(count - have.get(cls, 0)):
                self._free[cls].append(self._allocate(cls))
                made += 1
        return made

    def fences(self) -> List[Any]:
        """The fence events held (for close)."""
        return list(self._fences.values())

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
        self._fences.clear()
        self._covers.clear()
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


#: torch's current raw stream of a device index (what torch's own compiled code asks for)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _TorchCuda:
    """The few things asked of torch: the live current stream, allocation, record_stream."""

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def current_handle(self) -> int:
        """The current stream's raw handle (0: the legacy default stream), without making a
        torch.cuda.Stream (a few microseconds on every call into the backend otherwise)."""
        if _raw_stream is None:
            return int(torch.cuda.current_stream(self.device).cuda_stream)
        return int(_raw_stream(self.device.index))

    def empty_strided(self, size, stride, dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def device_guard(self):
        return torch.cuda.device(self.device)


class _Slot:
    """What a handle owns; kept apart from the handle so that a finalizer can reclaim it."""

    __slots__ = ("ptr", "capacity", "device", "alloc_stream", "ready_event", "ready_order", "covered",
                 "fetched", "offload_event", "queued", "fence", "fence_cover", "error", "__weakref__")

    def __init__(self, ptr: Optional[int], capacity: int):
        self.ptr = ptr
        self.capacity = capacity
        self.device: Optional[torch.Tensor] = None  # prefetched, not yet fetched
        self.alloc_stream: Optional[int] = None  # compute stream the prefetch allocated on
        self.ready_event: Any = None  # recorded on the H2D stream after the last H2D
        self.ready_order = 0  # the record's place among the H2D stream's ready events
        #: (compute stream, order) where a compute stream waited for ready_event since it was
        #: recorded (CudaBackend._fence_implied)
        self.covered: Optional[Tuple[int, int]] = None
        self.fetched: Optional[weakref.ref] = None  # the tensor fetch returned
        self.offload_event: Any = None  # the offload's completion event, until seen complete
        self.queued: Optional["_Queued"] = None  # its offload, while it waits in the host queue
        self.fence: Any = None  # the buffer's fence, until a D2H copy into it waited for it
        self.fence_cover: Optional[Tuple[int, int]] = None  # where a compute stream waited for it
        self.error: Optional[BaseException] = None  # why its offload could not be issued


class _Ready:
    """A compute-stream event the copies of one batch of offloads wait for (recorded once for
    the batch, on `stream` at `order`; back to the event pool when the last of them is issued or
    cancelled)."""

    __slots__ = ("event", "refs", "stream", "order")

    def __init__(self, event: Any, stream: int, order: int):
        self.event = event
        self.refs = 0
        self.stream = stream
        self.order = order


class _Queued:
    """An offload waiting in the host queue: its source (kept alive), the compute-stream event
    the copy must wait for (shared by its batch), and its slot."""

    __slots__ = ("slot", "src", "nbytes", "ready")

    def __init__(self, slot: _Slot, src: torch.Tensor, nbytes: int, ready: _Ready):
        self.slot = slot
        self.src: Optional[torch.Tensor] = src
        self.nbytes = nbytes
        self.ready = ready


class CudaHostHandle:
    """An activation in pinned host memory (or on its way there)."""

    __slots__ = ("nbytes", "shape", "stride", "dtype", "_slot", "_dead", "__weakref__")

    def __init__(self, nbytes, shape, stride, dtype, slot, dead=None):
        self.nbytes = nbytes  # bytes copied each way
        self.shape = shape
        self.stride = stride  # strides the fetched tensor will have
        self.dtype = dtype
        self._slot: Optional[_Slot] = slot
        #: the backend's queue of slots whose handles were dropped unreleased (reclaimed at its
        #: next call); a finalizer per handle cost more than the rest of making one
        self._dead: Optional[Deque[_Slot]] = dead

    def __del__(self) -> None:
        slot = self._slot
        if slot is not None and self._dead is not None:
            self._dead.append(slot)

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
    if t.is_contiguous():
        return True
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


class CudaBackend(Backend):
    """Swaps activations between CUDA device memory and pooled pinned host buffers.

    `device`: a CUDA device (default: torch's current one). `d2h_window`, `d2h_window_bytes`: how
    many device-to-host copies, and how many bytes of them, may be queued on the D2H stream behind
    the one running (one may always be; the rest wait in the host queue, where a fetch can still
    cancel them). The private `_runtime` / `_torch` arguments replace cuda-python's runtime module
    and the torch adapter (`cuda_exec.sim_device` runs the backend on a simulated device with
    them)."""

    name = "cuda"

    #: copies that run at once: one device-to-host and one host-to-device copy, each direction on
    #: its own stream (the cost model's two copy queues)
    copy_engines = 2
    #: default window of the host-side D2H queue (copies, bytes queued behind the running one)
    D2H_WINDOW = 2
    D2H_WINDOW_BYTES = 16 << 20

    def __init__(self, device: Any = None, *, d2h_window: int = D2H_WINDOW, d2h_window_bytes: int = D2H_WINDOW_BYTES,
                 _runtime: Any = None, _torch: Any = None):
        self._closed = True  # until fully constructed
        if d2h_window < 0 or d2h_window_bytes < 0:
            raise ValueError(f"d2h_window ({d2h_window}) and d2h_window_bytes ({d2h_window_bytes}) must be >= 0")
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
        current = getattr(_torch, "current_handle", None)
        #: the current compute stream's raw handle, looked up at every call (an adapter without
        #: ``current_handle`` answers through its stream object)
        self._current_handle = current if current is not None else (lambda: int(_torch.current_stream().cuda_stream))
        self.device: torch.device = _torch.device
        self.d2h_window = int(d2h_window)
        self.d2h_window_bytes = int(d2h_window_bytes)
        self._cuda = _Cuda(runtime_module() if _runtime is None else _runtime)
        self._legacy_stream = int(getattr(self._cuda.rt, "cudaStreamLegacy", 1))
        self._lock = threading.RLock()
        self._dead: Deque[_Slot] = collections.deque()  # slots of handles dropped unreleased
        #: every slot not reclaimed yet (close() disarms them)
        self._slots: Set[_Slot] = set()
        #: offloads not issued yet, in order (the host-side D2H queue)
        self._queue: Deque[_Queued] = collections.deque()
        #: issued offloads in D2H-stream order: (completion event, source kept alive or None once
        #: a swap deadline let it go, bytes, slot), until their completion is seen
        self._pending: Deque[Tuple[Any, Optional[torch.Tensor], int, _Slot]] = collections.deque()
        self._pending_bytes = 0
        #: the batch whose ready event the D2H stream waited for last (FIFO: later copies need no
        #: second wait for it)
        self._d2h_after: Optional[_Ready] = None
        #: a count of the compute-stream events recorded and waits issued, in issue order (the
        #: order a fence's wait and a batch's compute event were issued: _fence_implied)
        self._order = 0
        #: ready events recorded on the H2D stream so far; per compute stream, the latest of them
        #: it waited for (a fetch) and that wait's order: a fetch of an earlier one needs no wait
        self._h2d_records = 0
        self._h2d_waited: Dict[int, Tuple[int, int]] = {}
        self._d2h: Any = None
        self._h2d: Any = None
        with self._torch.device_guard():
            flags = self._cuda.rt.cudaStreamNonBlocking
            self._d2h = self._cuda("cudaStreamCreateWithFlags", flags)
            try:
                self._h2d = self._cuda("cudaStreamCreateWithFlags", flags)
            except BaseException:
                self._cuda.rt.cudaStreamDestroy(self._d2h)
                raise
        self.pool = PinnedPool(self._cuda)
        self._events = _EventPool(self._cuda, self._torch.device_guard)
        self.stats = {"offloads": 0, "prefetches": 0, "fetches": 0, "releases": 0, "d2h_bytes": 0, "h2d_bytes": 0,
                      "d2h_copies": 0, "h2d_copies": 0, "deadline_releases": 0, "kept_sources": 0,
                      "cancelled_offloads": 0, "cancelled_bytes": 0, "reserved_buffers": 0}
        self._closed = False

    # ------------------------------------------------------------------ public API

    @property
    def copy_stream(self) -> int:
        """The D2H copy stream's handle (a cudaStream_t as an int); see `h2d_stream`."""
        return int(self._d2h)

    @property
    def d2h_stream(self) -> int:
        return int(self._d2h)

    @property
    def h2d_stream(self) -> int:
        return int(self._h2d)

    @property
    def pending_offloads(self) -> int:
        """Offloads whose completion has not been seen yet (queued on the host or issued): their
        sources are still held, unless a swap deadline let them go."""
        return len(self._pending) + len(self._queue)

    @property
    def queued_offloads(self) -> int:
        """Offloads waiting in the host queue (not issued to the D2H stream yet)."""
        return len(self._queue)

    def offload(self, tensor: torch.Tensor) -> CudaHostHandle:
        return self.offload_many((tensor,))[0]

    def offload_many(self, tensors: Sequence[torch.Tensor]) -> List[CudaHostHandle]:
        """Offload several tensors finished by the same compute work (a stage's swapped
        storages): one event on the compute stream for all of them, and the D2H stream waits for
        it once when their copies are issued in a row."""
        with self._lock:
            self._service()
            srcs = []
            for tensor in tensors:  # every tensor checked and made dense before the event
                if tensor.layout != torch.strided:
                    raise TypeError(f"CudaBackend.offload supports strided tensors only, got {tensor.layout}")
                if tensor.device != self.device:
                    raise ValueError(f"CudaBackend on {self.device} cannot offload a tensor on {tensor.device}")
                # the executor's sources (a storage's bytes) have no autograd history to cut
                src = tensor.detach() if tensor.requires_grad else tensor
                if src.is_conj():
                    src = src.resolve_conj()
                if src.is_neg():
                    src = src.resolve_neg()
                if not _is_dense(src):
                    src = src.contiguous()  # runs on the compute stream; the copy waits for it below
                srcs.append(src)
            handles: List[CudaHostHandle] = []
            ready: Optional[_Ready] = None
            for src in srcs:
                nbytes = src.numel() * src.element_size()
                if nbytes == 0:
                    handles.append(self._new_handle(0, src, _Slot(None, 0)))
                    continue
                ptr, capacity = self.pool.acquire(nbytes)
                slot = _Slot(ptr, capacity)
                slot.fence = self.pool.take_fence(ptr)
                slot.fence_cover = self.pool.take_cover(ptr)
                if ready is None:
                    try:
                        ev = self._events.acquire()
                        # the activations are finished when the work queued so far on the compute stream is
                        stream = self._compute_stream()
                        self._cuda("cudaEventRecord", ev, stream)
                    except BaseException:
                        self.pool.give_back(ptr, slot.fence, slot.fence_cover)
                        raise
                    self._order += 1
                    ready = _Ready(ev, stream, self._order)
                ready.refs += 1
                handles.append(self._new_handle(nbytes, src, slot))
                slot.queued = _Queued(slot, src, nbytes, ready)
                self._queue.append(slot.queued)
                self.stats["offloads"] += 1
            del srcs
            self._pump()
            return handles

    def prefetch(self, handle: CudaHostHandle) -> None:
        self.prefetch_many((handle,))

    def prefetch_many(self, handles: Sequence[CudaHostHandle]) -> None:
        """Prefetch several handles (a stage's): the H2D stream waits for the compute stream once
        for all of them (no compute work is queued between their copies)."""
        with self._lock:
            self._service()
            ordered = False  # the H2D stream waits for the compute stream's work so far
            for handle in handles:
                slot = self._live(handle)
                if slot.device is not None or (slot.fetched is not None and slot.fetched() is not None):
                    continue  # already on its way, or the fetched tensor is still alive
                ordered = self._prefetch(handle, slot, ordered)

    def fetch(self, handle: CudaHostHandle) -> torch.Tensor:
        with self._lock:
            self._service()
            slot = self._live(handle)
            tensor = slot.fetched() if slot.fetched is not None else None
            if tensor is None:
                if slot.device is None:
                    self._prefetch(handle, slot)
                tensor = slot.device
            stream_handle = self._compute_stream()
            if slot.ready_event is not None:  # device-side wait: the host does not block
                waited = self._h2d_waited.get(stream_handle)
                if waited is not None and slot.ready_order <= waited[0]:
                    # the stream waited for a later H2D already (the H2D stream is FIFO)
                    slot.covered = (stream_handle, waited[1])
                else:
                    self._cuda("cudaStreamWaitEvent", stream_handle, slot.ready_event, 0)
                    self._order += 1
                    slot.covered = (stream_handle, self._order)
                    self._h2d_waited[stream_handle] = (slot.ready_order, self._order)
            if stream_handle != slot.alloc_stream:  # the caching allocator ignores its block's own stream
                self._torch.record_stream(tensor, self._torch.current_stream())
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
            if self._closed:
                return  # close() already freed everything
            self._reclaim(slot)
            self._service()
            self.stats["releases"] += 1

    def offload_in_flight(self, handle: CudaHostHandle) -> bool:
        """Whether ``handle``'s offload has not been seen complete (its source is still held,
        unless a swap deadline let it go)."""
        slot = handle._slot
        return slot is not None and (slot.queued is not None or slot.offload_event is not None)

    def poll(self) -> int:
        """Drop the sources of completed offloads, reclaim dropped handles and issue what the D2H
        window allows, without blocking. Returns the number of offloads still in flight (queued on
        the host or issued)."""
        with self._lock:
            self._service()
            return len(self._pending) + len(self._queue)

    def wait_offload(self, handle: CudaHostHandle) -> None:
        """Block the host until `handle`'s offload (and every copy queued before it) has completed,
        then drop the sources: the cost model's wait for a swap-out before a stage."""
        with self._lock:
            self._service()
            slot = handle._slot
            if slot is not None and slot.queued is not None:
                self._flush(slot.queued)
            ev = slot.offload_event if slot is not None else None
            if ev is not None:
                self._cuda("cudaEventSynchronize", ev)
            self._service()

    def release_offload(self, handle: CudaHostHandle) -> None:
        """The cost model's wait for a swap-out before a stage, without blocking the host: the
        offload is issued if it still waits in the host queue (with every offload queued before
        it), the current compute stream waits (``cudaStreamWaitEvent``) for it, and so, the D2H
        stream being FIFO, for every D2H copy issued before it; then the sources of those copies
        are dropped. The caching allocator may hand their blocks to later work on the compute
        stream at once: that work runs after the copies have read them (TransformerEngine's
        ``release_activation_forward_gpu_memory`` does the same). Their events stay pending until
        they fire (``poll``)."""
        with self._lock:
            self._service()
            slot = handle._slot
            if slot is None:
                return
            if slot.queued is not None:
                self._flush(slot.queued)
            ev = slot.offload_event
            if ev is None:
                return  # completed already (its source is gone), released, or never copied
            self._cuda("cudaStreamWaitEvent", self._compute_stream(), ev, 0)
            for i, (e, _src, n, owner) in enumerate(self._pending):
                self._pending[i] = (e, None, n, owner)
                if e is ev:
                    break
            self.stats["deadline_releases"] += 1

    def synchronize(self) -> None:
        """Issue every queued offload and wait (on the host) for every copy on the copy streams;
        the compute stream and the rest of the device are not waited for."""
        with self._lock:
            self._check_open()
            self._flush(None)
            self._cuda("cudaStreamSynchronize", self._d2h)
            self._cuda("cudaStreamSynchronize", self._h2d)
            self._service()

    def reserve(self, sizes: List[int]) -> int:
        """Pre-allocate pinned buffers for activations of these byte sizes (all live at once),
        counting the buffers the pool has. Returns how many were allocated."""
        with self._lock:
            self._check_open()
            made = self.pool.reserve([n for n in sizes if n > 0])
            self.stats["reserved_buffers"] += made
            return made

    def bandwidth(self, nbytes: int = 64 << 20, repeats: int = 3) -> Tuple[float, float]:
        """(device_to_host, host_to_device) bytes per second: the best of `repeats` timed
        `nbytes` copies between a device tensor and a pooled pinned buffer, each on its copy
        stream, timed with CUDA events. Blocks the host until the copies are done."""
        with self._lock:
            self._service()
            rt = self._cuda.rt
            nbytes = max(int(nbytes), 1)
            dev = self._torch.empty_strided((nbytes,), (1,), torch.uint8)
            ptr, _ = self.pool.acquire(nbytes)
            fence = self.pool.take_fence(ptr)
            self.pool.take_cover(ptr)  # (waited for below in any case)
            timing: List[Any] = []
            try:
                with self._torch.device_guard():
                    for _ in range(2):  # timing events (the pooled ones disable timing)
                        timing.append(self._cuda("cudaEventCreateWithFlags", rt.cudaEventDefault))
                start, end = timing
                compute = self._compute_stream()
                self._copy_waits_for(self._d2h, compute)
                self._copy_waits_for(self._h2d, compute)
                if fence is not None:
                    self._cuda("cudaStreamWaitEvent", self._d2h, fence, 0)
                result = []
                for kind, dst, src, stream in (
                    (rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, ptr, dev.data_ptr(), self._d2h),
                    (rt.cudaMemcpyKind.cudaMemcpyHostToDevice, dev.data_ptr(), ptr, self._h2d),
                ):
                    self._cuda("cudaMemcpyAsync", dst, src, nbytes, kind, stream)  # warm-up
                    best = float("inf")
                    for _ in range(max(1, repeats)):
                        self._cuda("cudaEventRecord", start, stream)
                        self._cuda("cudaMemcpyAsync", dst, src, nbytes, kind, stream)
                        self._cuda("cudaEventRecord", end, stream)
                        self._cuda("cudaEventSynchronize", end)
                        ms = self._cuda("cudaEventElapsedTime", start, end)
                        best = min(best, max(float(ms), 1e-6) / 1e3)
                    result.append(nbytes / best)
                return result[0], result[1]
            finally:
                # normally a no-op (end was synchronised); after an error it keeps `dev` and the
                # buffer alive until no copy can touch them any more
                self._cuda.rt.cudaStreamSynchronize(self._d2h)
                self._cuda.rt.cudaStreamSynchronize(self._h2d)
                self.pool.give_back(ptr)
                if fence is not None:
                    self._events.give_back(fence)
                for ev in timing:
                    self._cuda.rt.cudaEventDestroy(ev)
                del dev

    def close(self) -> None:
        """Wait for the copy streams, drop every held tensor (offloads still queued on the host
        are dropped, not copied), destroy events and streams, and free every pinned buffer.
        Idempotent; handles are dead afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors: List[BaseException] = []
            for stream in (self._d2h, self._h2d):
                try:
                    self._cuda("cudaStreamSynchronize", stream)
                except CudaError as exc:
                    errors.append(exc)
            for item in self._queue:
                item.src = None
                item.slot.queued = None
            self._queue.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self._dead.clear()
            for slot in list(self._slots):
                slot.ptr = None
                slot.device = None
                slot.ready_event = None
                slot.fence = None
            for step in (self._events.destroy_all, self.pool.free_all):
                try:
                    step()
                except CudaError as exc:
                    errors.append(exc)
            for stream in (self._d2h, self._h2d):
                try:
                    self._cuda("cudaStreamDestroy", stream)
                except CudaError as exc:
                    errors.append(exc)
            self._d2h = self._h2d = None
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
        handle = CudaHostHandle(nbytes, tuple(src.shape), tuple(src.stride()), src.dtype, slot, self._dead)
        self._slots.add(slot)
        return handle

    def _live(self, handle: CudaHostHandle) -> _Slot:
        slot = handle._slot
        if slot is None:
            raise RuntimeError(f"{handle!r} was released")
        if slot.error is not None:
            raise RuntimeError(f"the offload of {handle!r} failed ({type(slot.error).__name__}: {slot.error})") \
                from slot.error
        return slot

    def _compute_stream(self) -> int:
        """The current compute stream of our device, looked up now, as a handle. torch names its
        default stream 0, which means the legacy default stream (torch is not built for
        per-thread default streams); it is passed to cuda-python as cudaStreamLegacy so that it
        means the same whatever default-stream mode cuda-python's runtime is in."""
        handle = self._current_handle()
        return handle if handle else self._legacy_stream

    def _fence_implied(self, cover: Optional[Tuple[int, int]], ready: _Ready) -> bool:
        """Whether a D2H copy that waits for ``ready`` (a compute-stream event) is already ordered
        after a buffer's fence: a wait for the fence on the same compute stream came before the
        event was recorded there (``cover``: that stream and the wait's order), so the event
        completes after the fence has."""
        return cover is not None and cover[0] == ready.stream and cover[1] < ready.order

    def _copy_waits_for(self, copy_stream: Any, compute_stream: int) -> None:
        """Order `copy_stream` after everything queued so far on `compute_stream`."""
        ev = self._events.acquire()
        self._cuda("cudaEventRecord", ev, compute_stream)
        self._cuda("cudaStreamWaitEvent", copy_stream, ev, 0)
        self._events.give_back(ev)  # the wait captured the event; it may be re-recorded

    # the host-side D2H queue ---------------------------------------------------------------

    def _window_open(self) -> bool:
        """Whether the next queued offload may be issued now: nothing in flight, or few enough
        copies (and bytes, beyond one copy) waiting behind the one running."""
        n = len(self._pending)
        if n == 0:
            return True
        behind = n - 1
        if behind >= self.d2h_window:
            return False
        return behind == 0 or self._pending_bytes - self._pending[0][2] + self._queue[0].nbytes <= self.d2h_window_bytes

    def _pump(self) -> None:
        while self._queue and self._window_open():
            self._issue(self._queue.popleft())

    def _flush(self, item: Optional[_Queued]) -> None:
        """Issue the queued offloads up to `item` (all of them for None), whatever the window."""
        while self._queue:
            it = self._queue.popleft()
            self._issue(it)
            if it is item:
                return

    def _issue(self, item: _Queued) -> None:
        """Queue `item`'s copy on the D2H stream (it has left the host queue)."""
        slot = item.slot
        slot.queued = None
        src, item.src = item.src, None
        rt = self._cuda.rt
        try:
            ready = item.ready
            if slot.fence is not None and not self._fence_implied(slot.fence_cover, ready):
                self._cuda("cudaStreamWaitEvent", self._d2h, slot.fence, 0)  # an H2D copy may still read the buffer
            if ready is not self._d2h_after:  # the D2H stream is FIFO: one wait per batch in a row
                self._cuda("cudaStreamWaitEvent", self._d2h, ready.event, 0)
                self._d2h_after = ready
            self._cuda("cudaMemcpyAsync", slot.ptr, src.data_ptr(), item.nbytes,
                       rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._d2h)
            done = self._events.acquire()
            self._cuda("cudaEventRecord", done, self._d2h)
        except BaseException as exc:
            # the handle is dead for fetches; the buffer may be the target of a queued copy,
            # which FIFO reuse on the D2H stream keeps safe
            slot.error = exc
            self._ready_done(item.ready)
            if slot.ptr is not None:
                self.pool.give_back(slot.ptr, slot.fence, slot.fence_cover)
                slot.ptr = None
                slot.fence = None
            raise
        if slot.fence is not None:
            self._events.give_back(slot.fence)  # the wait captured it (or was implied)
            slot.fence = None
            slot.fence_cover = None
        self._ready_done(item.ready)
        self._pending.append((done, src, item.nbytes, slot))  # src (a view of the caller's storage) stays alive
        self._pending_bytes += item.nbytes
        slot.offload_event = done
        self.stats["d2h_copies"] += 1
        self.stats["d2h_bytes"] += item.nbytes

    def _cancel(self, slot: _Slot) -> Optional[torch.Tensor]:
        """Take `slot`'s offload out of the host queue (never copied); returns its source."""
        item = slot.queued
        assert item is not None
        self._queue.remove(item)
        slot.queued = None
        self._ready_done(item.ready)  # recorded on the compute stream, nobody waits for it
        src, item.src = item.src, None
        return src

    def _ready_done(self, ready: _Ready) -> None:
        """One offload of ``ready``'s batch was issued or cancelled: the event goes back to the
        pool with the batch's last (a wait captures the event's state at the call)."""
        ready.refs -= 1
        if ready.refs == 0:
            self._events.give_back(ready.event)
            if self._d2h_after is ready:
                self._d2h_after = None  # the pooled event may be recorded again for another batch

    def _pending_source(self, slot: _Slot) -> Optional[torch.Tensor]:
        """The device bytes of `slot`'s offload while its copy has not completed and no swap
        deadline has let them go (else None)."""
        ev = slot.offload_event
        if ev is None:
            return None
        for e, src, _n, _slot in self._pending:
            if e is ev:
                return src
        return None

    def _prefetch(self, handle: CudaHostHandle, slot: _Slot, ordered: bool = False) -> bool:
        """Start bringing ``handle`` back. ``ordered``: the H2D stream already waits for the
        compute stream's work so far (an earlier prefetch of the same batch). Returns whether it
        does now."""
        if slot.queued is not None:
            # never issued: the copy is cancelled and the device bytes used as they are (the
            # cost model cancels a swap-out that is still queued when its tensor is needed)
            slot.device = self._cancel(slot)
            self.stats["cancelled_offloads"] += 1
            self.stats["cancelled_bytes"] += handle.nbytes
            self.stats["prefetches"] += 1
            return ordered
        src = self._pending_source(slot)
        if src is not None:
            # the offload is being copied, so its source is still on the device: hand those
            # bytes back rather than allocate a second copy next to them (the CPU backend does too)
            slot.device = src
            self.stats["kept_sources"] += 1
            self.stats["prefetches"] += 1
            return ordered
        stream = self._compute_stream()
        tensor = self._torch.empty_strided(handle.shape, handle.stride, handle.dtype)
        slot.alloc_stream = stream
        if handle.nbytes:
            # The caching allocator may hand back a block freed by compute work still queued on
            # this stream: the copy must not overwrite it before that work has run.
            if not ordered:
                self._copy_waits_for(self._h2d, stream)
                ordered = True
            if slot.offload_event is not None:
                # a swap deadline dropped the source before the D2H copy was seen complete: the
                # H2D copy (another stream) must not read the buffer before that copy wrote it
                self._cuda("cudaStreamWaitEvent", self._h2d, slot.offload_event, 0)
            rt = self._cuda.rt
            self._cuda("cudaMemcpyAsync", tensor.data_ptr(), slot.ptr, handle.nbytes,
                       rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self._h2d)
            if slot.ready_event is None:
                slot.ready_event = self._events.acquire()
            self._cuda("cudaEventRecord", slot.ready_event, self._h2d)
            self._h2d_records += 1
            slot.ready_order = self._h2d_records
            slot.covered = None
            self.stats["h2d_copies"] += 1
            self.stats["h2d_bytes"] += handle.nbytes
        slot.device = tensor
        self.stats["prefetches"] += 1
        return ordered

    def _reclaim(self, slot: _Slot) -> None:
        """Give back what a released (or dropped) handle owned."""
        if self._closed:
            return
        if slot.queued is not None:
            self._cancel(slot)  # never issued: nothing to copy any more
        if slot.device is not None and slot.ready_event is not None:
            # prefetched, never fetched: the H2D may still be writing into the tensor's block.
            # The block's stream waits for it, so the allocator cannot reuse the block too early.
            self._cuda("cudaStreamWaitEvent", slot.alloc_stream, slot.ready_event, 0)
            self._order += 1
            slot.covered = (slot.alloc_stream, self._order)
        slot.device = None
        slot.fetched = None
        # the buffer's fence: the last H2D copy that read it, else one it carried unused
        fence, slot.ready_event = slot.ready_event, None
        cover, slot.covered = slot.covered, None
        if slot.fence is not None:
            if fence is None:
                fence, cover = slot.fence, slot.fence_cover
            else:
                self._events.give_back(slot.fence)
            slot.fence = None
            slot.fence_cover = None
        if slot.ptr is not None:
            self.pool.give_back(slot.ptr, fence, cover)
            slot.ptr = None
        elif fence is not None:
            self._events.give_back(fence)
        self._slots.discard(slot)

    def _service(self) -> None:
        """Non-blocking housekeeping at every call: reclaim dropped handles, drop the sources of
        offloads whose completion event has fired (cudaEventQuery), issue what the D2H window
        allows."""
        self._check_open()
        if not (self._dead or self._pending or self._queue):
            return
        while self._dead:
            self._reclaim(self._dead.popleft())
        while self._pending:
            ev, _src, n, owner = self._pending[0]
            err = self._cuda.rt.cudaEventQuery(ev)
            err = err[0] if isinstance(err, tuple) else err
            if err == self._cuda.not_ready:
                break  # FIFO: later copies are not done either
            self._cuda.check("cudaEventQuery", (err,))
            self._pending.popleft()
            self._pending_bytes -= n
            if owner.offload_event is ev:
                owner.offload_event = None
            self._events.give_back(ev)
        self._pump()
