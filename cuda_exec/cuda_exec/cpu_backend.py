"""The CPU backend: the host tier is memory outside torch's allocator.

On CPU the device tier is torch's CPU allocator (what ``torch.profiler`` counts) and the host tier
is numpy memory (or file-backed ``np.memmap`` buffers), which torch does not count, so swapping an
activation really lowers the measured device memory. Copies run on one background thread in FIFO
order (the cost model's copy stream). An optional ``bandwidth_cap`` (bytes/s) makes the copy
thread sleep so that a copy of N bytes takes at least N / cap seconds, to emulate a PCIe link.

Host buffers come from a pool keyed by size (or shape) and are reused across steps; :meth:`CpuBackend.close`
frees them all. Device tensors handed to :meth:`offload` must be contiguous 1-D ``uint8`` CPU
tensors (the executor passes whole storages as bytes).
"""

from __future__ import annotations

import ctypes
import queue
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .units import ViewMeta

__all__ = ["CpuBackend", "CpuHostHandle", "CopyGroup", "BackendStats"]

_CPU = torch.device("cpu")
_BYTES = torch.uint8


def _key_bytes(key: Any) -> int:
    """Bytes of a host buffer pooled under ``key``: its size, or a shape's ``(dtype, size)``."""
    if isinstance(key, int):
        return key
    dtype, size = key
    n = dtype.itemsize
    for d in size:
        n *= d
    return n


class CpuHostHandle:
    """An activation's bytes in the CPU host tier (or on their way there)."""

    __slots__ = (
        "nbytes", "buf", "source", "device_tensor", "offload_done", "prefetch_done",
        "prefetch_issued", "cancelled", "released", "pending", "error", "keep_source", "copy_idle", "group",
        "__weakref__",
    )

    def __init__(self, nbytes: int, buf: torch.Tensor, source: Optional[torch.Tensor], threaded: bool = True) -> None:
        self.nbytes = nbytes
        #: the host bytes: a uint8 tensor over numpy (or mmap) memory, which torch's allocator
        #: does not count (made once per pooled buffer, so that a copy is one ``copy_``)
        self.buf: Optional[torch.Tensor] = buf
        #: the device bytes, kept alive until the offload copy has run (or was cancelled)
        self.source: Optional[torch.Tensor] = source
        self.device_tensor: Optional[torch.Tensor] = None
        # a handle whose copies run on the caller's thread (small, uncapped) never waits: it
        # shares the event that is always set instead of making three of its own
        self.offload_done = threading.Event() if threaded else _ALWAYS
        self.prefetch_done = threading.Event() if threaded else _ALWAYS
        self.prefetch_issued = False
        self.cancelled = False  #: offload not needed any more (the device bytes were used as they are)
        self.released = False
        self.pending = 0  #: queued copies not yet finished
        self.error: Optional[BaseException] = None  #: why a copy of this handle failed
        #: prefetched before its offload completed: the device bytes stay for fetch
        self.keep_source = False
        #: clear while the copy thread holds a reference to this handle's device bytes
        self.copy_idle = threading.Event() if threaded else _ALWAYS
        if threaded:
            self.copy_idle.set()
        #: the copies whose device bytes leave together (:class:`CopyGroup`), or None
        self.group: Optional[CopyGroup] = None


class CopyGroup:
    """Offloads whose device bytes leave together, when the last of them has been copied: the
    storages of one swapped unit, whose copy the cost model has as one (a fetch while part of it
    is still being copied uses every storage's device bytes, as the model does, instead of
    copying back the part already out)."""

    __slots__ = ("pending", "done")

    def __init__(self) -> None:
        self.pending = 0  #: offloads of the group queued and not yet seen done by poll()
        self.done: List[CpuHostHandle] = []  #: those seen done, their device bytes kept


#: the event of handles whose copies run on the caller's thread: always set, never cleared
_ALWAYS = threading.Event()
_ALWAYS.set()

#: copies of at most this many bytes run on the caller's thread when there is no bandwidth cap:
#: handing them to the copy thread costs more host time than the copy itself (a thread switch and
#: the copy thread's Python under the GIL), and a copy that completes at once is what the cost
#: model's copy stream does with it
INLINE_BYTES = 64 << 10


@dataclass
class BackendStats:
    buffers_in_use: int
    bytes_in_use: int
    buffers_pooled: int
    bytes_pooled: int
    offloads: int
    prefetches: int
    offload_bytes: int
    prefetch_bytes: int
    cancelled_offloads: int
    fetch_wait_s: float  #: time fetch() waited for copies (swap stall)


class CpuBackend:
    """Host tier in numpy (``host="numpy"``) or file-backed mmap (``host="mmap"``) memory."""

    name = "cpu"
    #: copies that run at once (one copy thread): the cost model's single copy queue
    copy_engines = 1

    def __init__(
        self,
        bandwidth_cap: Optional[float] = None,
        *,
        host: str = "numpy",
        mmap_dir: Optional[str] = None,
        inline_bytes: int = INLINE_BYTES,
    ) -> None:
        if host not in ("numpy", "mmap"):
            raise ValueError(f"host must be 'numpy' or 'mmap', not {host!r}")
        if bandwidth_cap is not None and bandwidth_cap <= 0:
            raise ValueError("bandwidth_cap must be positive (bytes per second)")
        self.bandwidth_cap = bandwidth_cap
        #: copies up to this size run on the caller's thread (none with a bandwidth cap)
        self.inline_bytes = 0 if bandwidth_cap else int(inline_bytes)
        self.host = host
        self.mmap_dir = mmap_dir
        self._lock = threading.Lock()
        #: free host buffers by size (bytes), or by shape (``(dtype, size)``: copy_out's shaped ones)
        self._pool: Dict[Any, List[torch.Tensor]] = defaultdict(list)
        self._live: Dict[int, CpuHostHandle] = {}
        self._queue: "queue.Queue[Optional[Tuple[str, CpuHostHandle]]]" = queue.Queue()
        self._closed = False
        self._error: Optional[BaseException] = None
        self._counters = dict(offloads=0, prefetches=0, offload_bytes=0, prefetch_bytes=0, cancelled=0)
        self._fetch_wait = 0.0
        #: bytes of host buffers allocated from the C heap (numpy host tier), pooled or in use:
        #: a live counter of device memory that reads the C heap subtracts them (live_memory.py)
        self._heap_bytes = 0
        #: offloads whose copy has run; their sources are dropped by poll() on the caller's thread,
        #: so that the device bytes are freed where torch's profiler sees it, at a stage boundary
        self._done: List[CpuHostHandle] = []
        #: host buffers handed out by copy_out and not given back: [count, bytes]
        self._inline_in_use = [0, 0]
        self._thread = threading.Thread(target=self._worker, name="tensorplace-copy", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ host buffers

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        # torch.from_numpy: the tensor keeps the numpy memory alive, torch's allocator never sees it
        if self.host == "numpy":
            buf = np.empty(nbytes, dtype=np.uint8)
            with self._lock:
                self._heap_bytes += nbytes
            return torch.from_numpy(buf)
        f = tempfile.TemporaryFile(dir=self.mmap_dir)
        try:
            f.truncate(nbytes)
            return torch.from_numpy(np.memmap(f, dtype=np.uint8, mode="r+", shape=(nbytes,)))
        finally:
            f.close()  # the mapping keeps the (already unlinked) file alive

    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._pool.get(nbytes)
            if free:
                return free.pop()
        return self._new_buffer(nbytes)

    def _give_back(self, h: CpuHostHandle) -> None:
        # called with self._lock held
        if h.buf is not None:
            if not self._closed:
                self._pool[h.nbytes].append(h.buf)
            elif self.host == "numpy":
                self._heap_bytes -= h.nbytes
            h.buf = None
        self._live.pop(id(h), None)

    # ------------------------------------------------------------------ the Backend interface

    #: offload() takes a CopyGroup (the executor groups a swapped unit's storages)
    groups_copies = True

    def new_copy_group(self) -> CopyGroup:
        return CopyGroup()

    def offload(self, tensor: torch.Tensor, group: Optional[CopyGroup] = None) -> CpuHostHandle:
        """Queue a copy of ``tensor`` (1-D contiguous uint8 on CPU) to a host buffer. With a
        ``group``, its device bytes are let go (poll) only once every offload of the group queued
        so far has been copied."""
        if self._error is not None or self._closed:
            self._check()
        if self._done:
            self.poll()
        if not tensor.is_cpu or tensor.dtype is not torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("CpuBackend.offload expects a contiguous 1-D uint8 CPU tensor")
        n = tensor.numel()
        if n <= self.inline_bytes:
            with self._lock:
                free = self._pool.get(n)
                buf = free.pop() if free else None
            h = CpuHostHandle(n, buf if buf is not None else self._new_buffer(n), None, threaded=False)
            h.buf.copy_(tensor)  # the copy completes here: the caller's bytes are free to go
            with self._lock:
                self._live[id(h)] = h
            # the caller's thread alone counts offloads and prefetches (the copy thread counts
            # cancellations, under the lock)
            c = self._counters
            c["offloads"] += 1
            c["offload_bytes"] += n
            return h
        h = CpuHostHandle(n, self._take_buffer(n), tensor)
        if group is not None:
            h.group = group
            group.pending += 1
        with self._lock:
            h.pending += 1
            self._live[id(h)] = h
        c = self._counters
        c["offloads"] += 1
        c["offload_bytes"] += n
        self._queue.put(("d2h", h))
        return h

    # ------------------------------------------------------------------ copies on the caller's thread, a unit at once

    def copy_out(self, storages: List[Optional[torch.UntypedStorage]],
                 views: Optional[List[ViewMeta]] = None) -> List[Optional[torch.Tensor]]:
        """Copy each of ``storages`` (CPU storages of at most ``inline_bytes``; None: skipped) to a
        host buffer now, on the caller's thread, and return the buffers in order: one call for the
        small storages a steady step saved in a stage (inline_swap.py), with no handle per
        storage. Their device bytes are free to go on return; :meth:`give_back` the buffers.
        Both tiers are CPU memory: a copy is a ``memmove`` (0.3 us for a small storage, where a
        torch copy of the storage takes 1.2). ``views``: the view of each storage that will be
        copied back; where a view is the whole storage as a contiguous tensor
        (``ViewMeta.shape_key``), its buffer is a tensor of that shape, which :meth:`copy_back`
        copies back with one ``clone()`` (0.9 us, where a new tensor and a ``memmove`` take 1.2);
        else a buffer of bytes."""
        if self._error is not None or self._closed:
            self._check()
        out: List[Optional[torch.Tensor]] = []
        nbytes = copied = 0
        pool = self._pool
        move = ctypes.memmove
        for i, st in enumerate(storages):
            if st is None:  # freed before its copy: nothing to keep
                out.append(None)
                continue
            n = st.nbytes()
            key: Any = n
            if views is not None:
                v = views[i]
                shape = v.shape_key()
                if shape is not None and v.dense_bytes() == n:
                    key = shape
            try:  # list.pop is atomic: the copy thread only appends (its give-backs), under the lock
                buf = pool[key].pop()
            except IndexError:
                buf = self._new_buffer(n)
                if key is not n:
                    buf = buf.view(key[0]).view(key[1])
            move(buf.data_ptr(), st.data_ptr(), n)
            out.append(buf)
            nbytes += n
            copied += 1
        c = self._counters
        c["offloads"] += copied
        c["offload_bytes"] += nbytes
        with self._lock:  # give_back may run where autograd frees the handles
            self._inline_in_use[0] += copied
            self._inline_in_use[1] += nbytes
        return out

    def copy_back(self, buffers: List[torch.Tensor], views: List[ViewMeta], give_back: bool = False) -> List[torch.Tensor]:
        """Copy host buffers of :meth:`copy_out` back now, into new device storages (torch's
        allocator counts them from here), each as a tensor with the view of ``views`` over it;
        ``give_back``: then the buffers go back to the pool (as :meth:`give_back`, in this call)."""
        if self._error is not None or self._closed:
            self._check()
        out: List[torch.Tensor] = []
        nbytes = 0
        move = ctypes.memmove
        for b, v in zip(buffers, views):
            if b.dtype is not _BYTES:  # shaped as the view (copy_out)
                t = b.clone()
                out.append(t)
                nbytes += v.dense_bytes()
                continue
            n = b.numel()
            if v.offset == 0 and v.dense_bytes() == n:
                t = torch.empty_strided(v.size, v.stride, dtype=v.dtype)
                move(t.data_ptr(), b.data_ptr(), n)
            else:
                st = torch.UntypedStorage(n)
                move(st.data_ptr(), b.data_ptr(), n)
                t = v.view_of(st, _CPU)
            out.append(t)
            nbytes += n
        c = self._counters
        c["prefetches"] += len(out)
        c["prefetch_bytes"] += nbytes
        if give_back:  # once every copy is made (a failed one leaves every buffer with its caller)
            pool = self._pool
            for b, v in zip(buffers, views):  # (list.append is atomic: copy_out pops without the lock too)
                pool[b.numel() if b.dtype is _BYTES else v.shape_key()].append(b)
            with self._lock:
                self._inline_in_use[0] -= len(out)
                self._inline_in_use[1] -= nbytes
        return out

    def give_back(self, buffers: List[torch.Tensor]) -> None:
        """The host buffers of :meth:`copy_out` go back to the pool."""
        with self._lock:
            self._inline_in_use[0] -= len(buffers)
            nbytes = 0
            closed = self._closed  # close() let go of every buffer
            pool = self._pool
            for b in buffers:
                if b.dtype is _BYTES:
                    n = key = b.numel()
                else:
                    n, key = b.untyped_storage().nbytes(), (b.dtype, tuple(b.shape))
                if not closed:
                    pool[key].append(b)
                nbytes += n
            self._inline_in_use[1] -= nbytes

    def offload_in_flight(self, handle: CpuHostHandle) -> bool:
        """Whether ``handle``'s device bytes are still held for its offload (its copy has not run,
        or :meth:`poll` has not yet dropped them)."""
        return handle.source is not None and not handle.keep_source

    def host_heap_bytes(self) -> int:
        """Bytes of host buffers this backend took from the C heap (pooled or in use; 0 for the
        mmap host tier, which is not heap memory)."""
        return self._heap_bytes

    def poll(self) -> int:
        """Free the device bytes of every offload whose copy has completed (never blocks); call it
        at stage boundaries. Returns how many were freed. Raises (once) if a copy failed."""
        if self._error is not None:
            self._check()
        if not self._done:
            return 0
        with self._lock:
            done, self._done = self._done, []
        freed = 0
        for h in done:
            g = h.group
            if g is None:
                freed += self._drop_source(h)
                continue
            g.pending -= 1
            g.done.append(h)
            if g.pending == 0:
                for m in g.done:
                    freed += self._drop_source(m)
                g.done.clear()
        return freed

    @staticmethod
    def _drop_source(h: CpuHostHandle) -> int:
        if h.keep_source or h.source is None:
            return 0
        h.source = None
        return 1

    def wait_offload(self, handle: CpuHostHandle) -> None:
        """Block until `handle`'s offload has completed (and those queued before it), then free
        their device bytes."""
        h = handle
        if h.source is not None and not h.cancelled:
            t0 = time.perf_counter()
            while not h.offload_done.wait(0.1):
                self._check()
            self._fetch_wait += time.perf_counter() - t0
        self.poll()
        if h.offload_done.is_set():  # the model's deadline: these bytes leave now, group or not
            self._drop_source(h)

    def release_offload(self, handle: CpuHostHandle) -> None:
        """The cost model's wait for a swap-out before a stage. The CPU has no streams to make
        wait, so the host blocks (``wait_offload``); the executor counts that wait
        (``StepStats.deadline_wait_s``)."""
        if handle.source is None and not self._done and self._error is None:  # copied already: nothing to wait for
            return
        self.wait_offload(handle)

    def prefetch(self, handle: CpuHostHandle) -> None:
        """Allocate the device bytes now (torch's allocator counts them) and queue the copy back."""
        if self._error is not None or self._closed:
            self._check()
        if self._done:
            self.poll()
        h = handle
        if h.released:
            raise RuntimeError("prefetch of a released host handle")
        if h.prefetch_issued:
            return
        h.prefetch_issued = True
        if h.source is not None:
            # the offload has not completed: keep the device bytes (fetch hands them back) rather
            # than allocate a second copy next to them; one that has not started never runs (the
            # cost model cancels a swap-out still queued when its prefetch comes, as the CUDA
            # backend does: its copy time goes to the copies queued behind it)
            with self._lock:
                if h.copy_idle.is_set() and not h.offload_done.is_set():
                    h.cancelled = True
                h.keep_source = True
            return
        h.device_tensor = torch.empty(h.nbytes, dtype=torch.uint8)
        c = self._counters
        c["prefetches"] += 1
        c["prefetch_bytes"] += h.nbytes
        if h.offload_done is _ALWAYS:  # a handle whose copies run here
            h.device_tensor.copy_(h.buf)
            return
        with self._lock:
            h.pending += 1
        self._queue.put(("h2d", h))

    def fetch(self, handle: CpuHostHandle) -> torch.Tensor:
        """The device bytes: the still-alive source if its offload has not finished (the offload is
        then cancelled if it has not started), else the prefetched copy, waiting for it if late."""
        if self._error is not None or self._closed:
            self._check()
        h = handle
        if h.released:
            raise RuntimeError("fetch of a released host handle")
        if h.offload_done is _ALWAYS:  # copies run here: nothing to wait for
            if h.device_tensor is None:
                self.prefetch(h)
            out = h.device_tensor
            h.device_tensor = None
            if out is None:
                raise RuntimeError("the copy back of this tensor was already fetched: fetch at most once")
            return out
        while True:
            with self._lock:  # against the copy thread, which reads and lets go under it
                src = h.source
                if src is None or h.copy_idle.is_set():
                    if src is not None:
                        # the offload is cancelled if it has not run: from here the caller's
                        # tensor alone keeps the device bytes, so they go when the caller lets go
                        # of them, not when the copy thread reaches the offload
                        h.cancelled = True
                        h.source = None
                        h.device_tensor = None
                    break
            t0 = time.perf_counter()
            self._wait_copy_idle(h)  # the offload is copying these bytes: let it finish with them
            self._fetch_wait += time.perf_counter() - t0
        if src is not None:
            return src
        if h.cancelled:
            raise RuntimeError("the offload was cancelled (its device bytes were used): fetch at most once")
        if not h.prefetch_issued:
            self.prefetch(h)
        if not h.prefetch_done.is_set():
            t0 = time.perf_counter()
            while not h.prefetch_done.wait(0.1):
                self._check()
            self._fetch_wait += time.perf_counter() - t0
        if h.error is not None:
            if self._error is h.error:
                self._error = None  # surfaced here
            raise RuntimeError(f"the copy back of this tensor failed ({type(h.error).__name__}: {h.error})") from h.error
        self._check()
        out = h.device_tensor
        if out is None:  # pragma: no cover - defensive
            raise RuntimeError("host handle has no device copy")
        h.device_tensor = None
        return out

    def release(self, handle: CpuHostHandle) -> None:
        """Return the host buffer to the pool (after any copy still queued for it)."""
        h = handle
        if h.copy_idle is _ALWAYS:  # copies run on the caller's thread: none is running
            with self._lock:
                if not h.released:
                    h.released = True
                    h.cancelled = True
                    h.device_tensor = None
                    self._give_back(h)
            return
        while True:
            self._wait_copy_idle(h)
            with self._lock:
                if not h.copy_idle.is_set():
                    continue  # a copy started meanwhile
                if h.released:
                    return
                h.released = True
                h.cancelled = True
                h.source = None  # a queued offload is skipped (a running one was waited for)
                h.device_tensor = None
                if h.pending == 0:
                    self._give_back(h)
            return

    def synchronize(self) -> None:
        """Wait for every queued copy."""
        self._queue.join()
        self._check()

    def bandwidth(self, nbytes: int = 64 << 20, chunk: int = 4 << 20, rounds: int = 3) -> Tuple[float, float]:
        """Measured (device-to-host, host-to-device) bytes/s through the copy thread (cap included):
        `nbytes` moved as `chunk`-sized tensors (activation-sized, so the allocator reuses memory
        as it does in training instead of faulting in fresh pages), best of `rounds` after a
        warm-up round."""
        chunk = max(1, min(chunk, nbytes))
        srcs = [torch.empty(chunk, dtype=torch.uint8).random_(0, 255) for _ in range(max(1, nbytes // chunk))]
        total = chunk * len(srcs)
        self.synchronize()
        results = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            hs = [self.offload(s) for s in srcs]
            for h in hs:
                h.offload_done.wait()
            t1 = time.perf_counter()
            for h in hs:
                self.prefetch(h)
            for h in hs:
                self.fetch(h)
            t2 = time.perf_counter()
            for h in hs:
                self.release(h)
            results.append((total / max(t1 - t0, 1e-9), total / max(t2 - t1, 1e-9)))
        return max(r[0] for r in results[1:]), max(r[1] for r in results[1:])

    def close(self) -> None:
        """Stop the copy thread and free every host buffer (pooled and live)."""
        if self._closed:
            return
        self._queue.put(None)
        self._thread.join()
        with self._lock:
            self._closed = True
            self._pool.clear()
            self._heap_bytes = 0
            for h in list(self._live.values()):
                h.buf = None
                h.source = None
                h.device_tensor = None
            self._live.clear()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> BackendStats:
        with self._lock:
            live = [h for h in self._live.values() if h.buf is not None]
            pooled = [(_key_bytes(n), len(v)) for n, v in self._pool.items()]
            c = dict(self._counters)
        return BackendStats(
            buffers_in_use=len(live) + self._inline_in_use[0],
            bytes_in_use=sum(h.nbytes for h in live) + self._inline_in_use[1],
            buffers_pooled=sum(k for _, k in pooled),
            bytes_pooled=sum(n * k for n, k in pooled),
            offloads=c["offloads"],
            prefetches=c["prefetches"],
            offload_bytes=c["offload_bytes"],
            prefetch_bytes=c["prefetch_bytes"],
            cancelled_offloads=c["cancelled"],
            fetch_wait_s=self._fetch_wait,
        )

    def live_handles(self) -> List[CpuHostHandle]:
        """Handles whose host buffer is in use (for tests and debugging)."""
        with self._lock:
            return [h for h in self._live.values() if h.buf is not None]

    # ------------------------------------------------------------------ the copy thread

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("CpuBackend is closed")
        if self._error is not None:
            # raised once (the step that sees it aborts); the handle whose copy failed keeps its
            # error, so its bytes are never handed out
            err, self._error = self._error, None
            raise RuntimeError(f"the copy thread failed ({type(err).__name__}: {err})") from err

    def _throttle(self, nbytes: int, started: float) -> None:
        if self.bandwidth_cap:
            left = nbytes / self.bandwidth_cap - (time.perf_counter() - started)
            if left > 0:
                time.sleep(left)

    def _wait_copy_idle(self, h: CpuHostHandle) -> None:
        """Wait while the copy thread holds a reference to ``h``'s device bytes (a copy of them is
        running), so that the caller's reference is the last one once the caller has them: their
        free then happens on the caller's thread when its last reader lets go, where torch's
        profiler records it and the cost model has it (a fetch that cancelled a running offload
        otherwise left the copy thread with the last reference: a zoo row measured 65,536 bytes
        held to the end of its step)."""
        while not h.copy_idle.wait(0.1):
            self._check()

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            op, h = item
            dt = src = None
            try:
                if op == "d2h":
                    with self._lock:  # one read: fetch() and release() may drop it meanwhile
                        src = h.source
                        if src is not None:
                            h.copy_idle.clear()
                    if not h.cancelled and h.buf is not None and src is not None:
                        t0 = time.perf_counter()
                        np.copyto(h.buf.numpy(), src.numpy())  # numpy's copy: one thread, GIL released
                        src = None  # never the last reference: fetch() and release() wait for this
                        h.copy_idle.set()
                        self._throttle(h.nbytes, t0)
                    elif h.cancelled:
                        with self._lock:
                            self._counters["cancelled"] += 1
                    with self._lock:
                        self._done.append(h)
                    h.offload_done.set()
                else:  # h2d
                    with self._lock:
                        dt = h.device_tensor
                        if dt is not None:
                            h.copy_idle.clear()
                    if not h.released and not h.cancelled and h.buf is not None and dt is not None:
                        t0 = time.perf_counter()
                        np.copyto(dt.numpy(), h.buf.numpy())
                        self._throttle(h.nbytes, t0)
                    dt = None  # before fetch() can hand the tensor out and its reader drop it
                    h.copy_idle.set()
                    h.prefetch_done.set()
            except BaseException as e:  # surfaced by _check() and by this handle's fetch
                h.error = e
                self._error = e
                h.offload_done.set()
                h.prefetch_done.set()
            finally:
                src = dt = None
                h.copy_idle.set()
                with self._lock:
                    h.pending -= 1
                    if h.released and h.pending == 0:
                        self._give_back(h)
                # drop this thread's references before blocking on the queue again
                item = h = dt = src = None  # type: ignore[assignment]
                self._queue.task_done()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
