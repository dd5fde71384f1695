"""A simulated CUDA device: the CUDA backend, and whole planned training steps, without a GPU.

:class:`SimDevice` answers the cuda-python runtime calls the CUDA backend makes
(cuda_exec/cuda_exec/cuda_backend.py; ``CudaBackend(_runtime=dev, _torch=dev.torch)``) on host
memory, with a clock. Tensors stay CPU tensors; what is simulated is when work runs.

* **Clocks.** The host has a clock, ``now`` (seconds). Every stream has a FIFO of work and the
  device time its last work ends (``tail``). Work starts when it is issued (host time), when the
  work before it on its stream has ended, and when its engine is free: compute kernels
  (:meth:`SimDevice.launch`) on their compute stream; copies on a copy engine, one per direction
  (``copy_engines=2``) or one for both (``1``), taking ``bytes / bandwidth``.
* **Streams.** A stream the runtime created (``cudaStreamCreateWithFlags``) is a copy stream; any
  other handle (torch's stream ids, ``cudaStreamLegacy``) names a compute stream, made on first
  use. ``cudaStreamWaitEvent`` makes a stream's later work start after the event; a wait on an
  event never recorded does nothing (as in CUDA) and is counted (``unrecorded_waits``).
* **Events** complete when the work their stream had when they were recorded has ended;
  ``cudaEventQuery`` says so once the host clock has passed that time.
* **Host.** ``host="ahead"``: a kernel launch costs the host ``launch_s`` and the host runs ahead
  of the device, as on a GPU. ``host="sync"``: the host waits for every kernel it launches (a CPU
  running its kernels itself). ``host="manual"``: only :meth:`advance`, :meth:`run` and blocking
  calls move the host clock (the backend's unit tests step the device by hand). Host-blocking
  calls (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``) move the
  host clock to what they wait for and are counted in ``blocking``; ``cudaHostAlloc`` calls in
  ``pinned_allocs``.
* **Data.** Compute is what torch runs on the host at once. A copy moves its bytes
  (``ctypes.memmove``) when the host first depends on it: a compute stream waits for it, the host
  sees its event complete, or synchronises. Until then its source must not change and its target
  must stay alive. Checked, raising :class:`SimError`: a device-to-host copy's source still holds
  the bytes it held when the copy was issued (it was not freed and reused, nor written); a
  host-to-device copy's target is a live tensor (``device_alive``); on device time, no copy writes
  a pinned buffer while a copy out of it runs, and none reads it before the copy into it ended;
  copies go to and from pinned buffers, on the streams the runtime created.

:class:`ProfileClock` launches a profile's stage times on the simulated compute stream where the
cost model has them (docs/cost-model.md), from hooks on the model's unit modules: ``fwd_time`` at
the end of each unit's forward (and of its replay in the backward), ``bwd_time`` when the next
backward stage starts (and when the backward ends). Profiled with the same bandwidths, the
simulated step then follows the model's timeline.

Used by tests/test_cuda_backend.py (the backend's logic) and tests/test_sim_device.py (whole
planned steps of the zoo's models through the executor).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import weakref
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Counter, Deque, Dict, List, Mapping, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from .gpu import runtime_module
from .units import is_replaying

__all__ = ["BLOCKING_CALLS", "CopyRecord", "ProfileClock", "SimDevice", "SimError", "SimTorch", "sim_backend"]

#: runtime calls that block the host until device work has run
BLOCKING_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


class SimError(AssertionError):
    """The code under test broke a rule of CUDA's programming model (module docstring)."""


class _SimEvent:
    _ids = itertools.count(1)

    __slots__ = ("id", "flags", "gen", "time", "mark", "alive")

    def __init__(self, flags: Any) -> None:
        self.id = next(self._ids)
        self.flags = flags
        self.gen = 0  #: cudaEventRecord calls so far
        self.time = 0.0  #: when the work captured by the latest record ends (device time)
        self.mark: Optional[Tuple["_Stream", int]] = None  #: (stream, its last op then)
        self.alive = True

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<sim event {self.id} gen {self.gen} t={self.time:.6g}>"


@dataclass
class CopyRecord:
    """One copy the device ran (or will run)."""

    direction: str  #: "d2h" or "h2d"
    nbytes: int
    stream: int
    issued: float  #: host time of the cudaMemcpyAsync
    start: float  #: device time
    end: float
    src: int
    dst: int
    applied: bool = False  #: its bytes have moved


class _Op:
    __slots__ = ("seq", "wait", "copy", "crc")

    def __init__(self, seq: int, wait: Optional[Tuple["_Stream", int]] = None, copy: Optional[CopyRecord] = None,
                 crc: Optional[int] = None) -> None:
        self.seq = seq
        self.wait = wait
        self.copy = copy
        self.crc = crc


class _Stream:
    __slots__ = ("handle", "created", "tail", "ops", "seq")

    def __init__(self, handle: int, created: bool) -> None:
        self.handle = handle
        self.created = created
        self.tail = 0.0
        self.ops: Deque[_Op] = collections.deque()  # data work not applied yet
        self.seq = 0


def _api(nvals: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A runtime call: logged, failing with an injected error (``fail[name]``, and `nvals` None
    values) if one is armed, else (cudaSuccess, *values)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: "SimDevice", *args: Any) -> Tuple[Any, ...]:
            name = fn.__name__
            self.calls.append(name)
            self.call_counts[name] += 1
            err = self.fail.pop(name, None)
            if err is not None:
                return (err,) + (None,) * nvals
            out = fn(self, *args)
            return (self._rt.cudaError_t.cudaSuccess,) + ((out,) if nvals else ())

        call.__name__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call

    return wrap


class SimDevice:
    """The cuda-python runtime calls the CUDA backend makes, simulated (module docstring).

    ``d2h_bandwidth`` / ``h2d_bandwidth``: bytes per second of the copy engines; ``copy_engines``:
    2 (one per direction) or 1 (shared); ``host``: "ahead", "sync" or "manual"; ``launch_s``: host
    seconds per kernel launch with ``host="ahead"``; ``check_sources``: checksum device-to-host
    sources (module docstring)."""

    def __init__(self, d2h_bandwidth: float = 25e9, h2d_bandwidth: float = 25e9, copy_engines: int = 2, *,
                 host: str = "ahead", launch_s: float = 5e-6, check_sources: bool = True) -> None:
        if host not in ("ahead", "sync", "manual"):
            raise ValueError(f"host must be 'ahead', 'sync' or 'manual', not {host!r}")
        if copy_engines not in (1, 2):
            raise ValueError(f"copy_engines must be 1 or 2, not {copy_engines}")
        if d2h_bandwidth <= 0 or h2d_bandwidth <= 0:
            raise ValueError("bandwidths must be positive (bytes per second)")
        self._rt = runtime_module()
        self.d2h_bandwidth = float(d2h_bandwidth)
        self.h2d_bandwidth = float(h2d_bandwidth)
        self.copy_engines = copy_engines
        self.host_mode = host
        self.launch_s = float(launch_s)
        self.check_sources = check_sources
        self.now = 0.0
        self._engine_free: Dict[str, float] = collections.defaultdict(float)
        self._streams: Dict[int, _Stream] = {}
        self._next_stream = itertools.count(0xC0FFEE)
        self.events: Dict[int, _SimEvent] = {}
        self.host: Dict[int, Any] = {}  #: pinned buffers: pointer -> ctypes buffer
        self._buffer_times: Dict[int, List[float]] = {}  #: pointer -> [last write end, last read end]
        self.torch = SimTorch()
        #: whether a device range still belongs to a live tensor (checked by host-to-device copies)
        self.device_alive: Optional[Callable[[int, int], bool]] = self.torch.alive
        self.fail: Dict[str, Any] = {}  #: call name -> error its next call returns
        self._host_allocs = 0  #: cudaHostAlloc calls ever made
        self.host_frees = 0  #: cudaFreeHost calls ever made
        self.reset_counters()

    # ------------------------------------------------------------------ counters and records

    def reset_counters(self) -> None:
        """Forget the calls, copies and kernels recorded so far (e.g. at the start of a step)."""
        self.calls: List[str] = []
        self.call_counts: Counter[str] = collections.Counter()
        self.blocking: Counter[str] = collections.Counter()  #: host-blocking calls by name
        self.blocked_s = 0.0  #: host time spent in them
        self.pinned_allocs = 0  #: cudaHostAlloc calls
        self.unrecorded_waits = 0  #: cudaStreamWaitEvent on events never recorded
        self.copies: List[CopyRecord] = []
        self.kernels: List[Tuple[int, float, float]] = []  #: (stream, start, end)
        self.compute_records: List[int] = []  #: compute streams events were recorded on
        self.waits: List[Tuple[int, int]] = []  #: (waiting stream, event id)

    @property
    def host_allocs(self) -> int:
        return self._host_allocs

    @property
    def streams(self) -> set:
        """Handles of the streams the runtime created and has not destroyed."""
        return {h for h, s in self._streams.items() if s.created}

    @property
    def queue(self) -> List[CopyRecord]:
        """Copies whose bytes have not moved yet."""
        return [op.copy for s in self._streams.values() for op in s.ops if op.copy is not None]

    def idle_time(self) -> float:
        """When all work issued so far has ended (device time)."""
        return max([self.now] + [s.tail for s in self._streams.values()])

    # ------------------------------------------------------------------ the host

    def advance(self, seconds: float) -> None:
        """The host does `seconds` of other work."""
        self.now += max(0.0, float(seconds))

    def run(self) -> None:
        """Let the device finish everything issued: the host clock moves to when it has ended
        and every copy's bytes move (not a runtime call: not counted as blocking)."""
        self.now = self.idle_time()
        for s in list(self._streams.values()):
            self._force(s, s.seq)

    def launch(self, seconds: float, stream: Optional[int] = None) -> Tuple[float, float]:
        """A compute kernel of `seconds` on `stream` (default: the torch adapter's current stream).
        Returns its (start, end) in device time."""
        handle = self.torch.stream if stream is None else int(stream)
        s = self._stream(handle or int(self._rt.cudaStreamLegacy))
        start = max(self.now, s.tail)
        end = start + max(0.0, float(seconds))
        s.tail = end
        self.kernels.append((s.handle, start, end))
        if self.host_mode == "ahead":
            self.now += self.launch_s
        elif self.host_mode == "sync":
            self.now = max(self.now, end)
        return start, end

    def compute_time(self, stream: Optional[int] = None) -> float:
        """When the work queued so far on a compute stream ends (device time)."""
        handle = self.torch.stream if stream is None else int(stream)
        return self._stream(handle or int(self._rt.cudaStreamLegacy)).tail

    # ------------------------------------------------------------------ internals

    def __getattr__(self, name: str) -> Any:  # enums, flags, error names and strings
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._rt, name)

    def _stream(self, handle: Any) -> _Stream:
        h = int(handle)
        s = self._streams.get(h)
        if s is None:
            s = self._streams[h] = _Stream(h, created=False)
        return s

    def _event(self, ev: Any) -> _SimEvent:
        if not (isinstance(ev, _SimEvent) and ev.alive and self.events.get(ev.id) is ev):
            raise SimError(f"{ev!r} is not a live event of this device (destroyed, or another device's)")
        return ev

    def _buffer(self, ptr: int, n: int) -> Optional[int]:
        """The pinned buffer holding [ptr, ptr + n), or None."""
        for p, buf in self.host.items():
            if p <= ptr and ptr + n <= p + len(buf):
                return p
        return None

    def _force(self, s: _Stream, seq: int) -> None:
        """Move the bytes of `s`'s copies up to op `seq` (and of what they waited for)."""
        while s.ops and s.ops[0].seq <= seq:
            op = s.ops.popleft()
            if op.wait is not None:
                self._force(*op.wait)
            elif op.copy is not None:
                self._apply(op)

    def _apply(self, op: _Op) -> None:
        c = op.copy
        assert c is not None
        if c.direction == "h2d":
            if self.device_alive is not None and not self.device_alive(c.dst, c.nbytes):
                raise SimError(f"a host-to-device copy of {c.nbytes} bytes writes into device memory that no live "
                               "tensor owns any more (freed before the copy ran)")
        elif op.crc is not None and zlib.crc32(ctypes.string_at(c.src, c.nbytes)) != op.crc:
            raise SimError(f"the source of a device-to-host copy of {c.nbytes} bytes changed before the copy ran "
                           "(freed and reused, or written in place, before its copy was ordered before that)")
        ctypes.memmove(c.dst, c.src, c.nbytes)
        c.applied = True

    def _complete(self, ev: _SimEvent) -> None:
        if ev.mark is not None:
            self._force(*ev.mark)

    def _block(self, name: str, until: float) -> None:
        self.blocking[name] += 1
        if until > self.now:
            self.blocked_s += until - self.now
            self.now = until

    # ------------------------------------------------------------------ the runtime API

    @_api(1)
    def cudaStreamCreateWithFlags(self, flags: Any) -> Any:
        if flags != self._rt.cudaStreamNonBlocking:
            raise SimError("copy streams must be non-blocking (cudaStreamNonBlocking): the legacy default stream "
                           "would synchronise with them")
        h = next(self._next_stream)
        self._streams[h] = _Stream(h, created=True)
        return self._rt.cudaStream_t(h)

    @_api(0)
    def cudaStreamDestroy(self, stream: Any) -> None:
        s = self._streams.get(int(stream))
        if s is None or not s.created:
            raise SimError(f"cudaStreamDestroy of a stream the runtime did not create ({int(stream)})")
        if s.ops or s.tail > self.now:
            raise SimError("stream destroyed with work not finished")
        del self._streams[int(stream)]

    @_api(1)
    def cudaEventCreateWithFlags(self, flags: Any) -> _SimEvent:
        ev = _SimEvent(flags)
        self.events[ev.id] = ev
        return ev

    @_api(0)
    def cudaEventDestroy(self, ev: Any) -> None:
        ev = self._event(ev)
        ev.alive = False
        del self.events[ev.id]

    @_api(0)
    def cudaEventRecord(self, ev: Any, stream: Any) -> None:
        ev = self._event(ev)
        s = self._stream(stream)
        ev.gen += 1
        ev.time = max(s.tail, self.now)
        ev.mark = (s, s.seq)
        if not s.created:
            self.compute_records.append(s.handle)

    @_api(0)
    def cudaStreamWaitEvent(self, stream: Any, ev: Any, flags: Any) -> None:
        ev = self._event(ev)
        s = self._stream(stream)
        self.waits.append((s.handle, ev.id))
        if ev.gen == 0:
            self.unrecorded_waits += 1
            return
        s.tail = max(s.tail, ev.time)
        if s.created:
            s.seq += 1
            s.ops.append(_Op(s.seq, wait=ev.mark))
        else:
            self._complete(ev)  # compute runs on the host right after this point

    @_api(0)
    def cudaMemcpyAsync(self, dst: int, src: int, n: int, kind: Any, stream: Any) -> None:
        rt = self._rt
        s = self._stream(stream)
        if not s.created:
            raise SimError("copies belong on the copy streams the runtime created, not on a compute stream")
        if kind == rt.cudaMemcpyKind.cudaMemcpyDeviceToHost:
            direction, bw, buf = "d2h", self.d2h_bandwidth, self._buffer(int(dst), n)
            if buf is None:
                raise SimError("a device-to-host copy's target is not a pinned buffer")
        elif kind == rt.cudaMemcpyKind.cudaMemcpyHostToDevice:
            direction, bw, buf = "h2d", self.h2d_bandwidth, self._buffer(int(src), n)
            if buf is None:
                raise SimError("a host-to-device copy's source is not a pinned buffer")
        else:
            raise SimError(f"unsupported copy kind {kind}")
        engine = direction if self.copy_engines == 2 else "copy"
        start = max(self.now, s.tail, self._engine_free[engine])
        end = start + n / bw
        times = self._buffer_times.setdefault(buf, [0.0, 0.0])
        if direction == "d2h" and start < times[1]:
            raise SimError(f"a device-to-host copy into a pinned buffer starts at {start:.6g} s while a "
                           f"host-to-device copy out of it runs until {times[1]:.6g} s")
        if direction == "h2d" and start < times[0]:
            raise SimError(f"a host-to-device copy out of a pinned buffer starts at {start:.6g} s before the "
                           f"device-to-host copy into it ends at {times[0]:.6g} s")
        times[0 if direction == "d2h" else 1] = end
        s.tail = end
        self._engine_free[engine] = end
        rec = CopyRecord(direction, int(n), s.handle, self.now, start, end, int(src), int(dst))
        self.copies.append(rec)
        crc = zlib.crc32(ctypes.string_at(int(src), n)) if direction == "d2h" and self.check_sources else None
        s.seq += 1
        s.ops.append(_Op(s.seq, copy=rec, crc=crc))

    def cudaEventQuery(self, ev: Any) -> Tuple[Any]:
        self.calls.append("cudaEventQuery")
        self.call_counts["cudaEventQuery"] += 1
        err = self.fail.pop("cudaEventQuery", None)
        if err is not None:
            return (err,)
        ev = self._event(ev)
        if ev.gen and ev.time > self.now:
            return (self._rt.cudaError_t.cudaErrorNotReady,)
        self._complete(ev)  # the host may rely on its work now
        return (self._rt.cudaError_t.cudaSuccess,)

    @_api(0)
    def cudaEventSynchronize(self, ev: Any) -> None:
        ev = self._event(ev)
        self._block("cudaEventSynchronize", ev.time if ev.gen else self.now)
        self._complete(ev)

    @_api(0)
    def cudaStreamSynchronize(self, stream: Any) -> None:
        s = self._stream(stream)
        self._block("cudaStreamSynchronize", s.tail)
        self._force(s, s.seq)

    @_api(0)
    def cudaDeviceSynchronize(self) -> None:
        self._block("cudaDeviceSynchronize", self.idle_time())
        for s in list(self._streams.values()):
            self._force(s, s.seq)

    @_api(1)
    def cudaEventElapsedTime(self, a: Any, b: Any) -> float:
        a, b = self._event(a), self._event(b)
        if a.flags != self._rt.cudaEventDefault or b.flags != self._rt.cudaEventDefault:
            raise SimError("cudaEventElapsedTime needs timing events (cudaEventDefault)")
        return (b.time - a.time) * 1e3

    @_api(1)
    def cudaHostAlloc(self, n: int, flags: Any) -> int:
        buf = ctypes.create_string_buffer(int(n))
        ptr = ctypes.addressof(buf)
        self.host[ptr] = buf
        self._host_allocs += 1
        self.pinned_allocs += 1
        return ptr

    @_api(0)
    def cudaFreeHost(self, ptr: int) -> None:
        if ptr not in self.host:
            raise SimError(f"cudaFreeHost of {ptr:#x}, not a pinned buffer")
        for s in self._streams.values():
            for op in s.ops:
                if op.copy is not None and self._buffer(op.copy.src if op.copy.direction == "h2d" else op.copy.dst,
                                                        op.copy.nbytes) == ptr:
                    raise SimError("cudaFreeHost of a pinned buffer a queued copy still uses")
        del self.host[ptr]
        self._buffer_times.pop(ptr, None)
        self.host_frees += 1


class SimTorch:
    """The CUDA backend's torch adapter (cuda_backend._TorchCuda) on CPU tensors: a current
    stream the caller sets (``stream``; torch's default stream is 0), allocations it remembers
    (``allocated``, and :meth:`alive` for the device's checks), ``record_stream`` calls recorded."""

    def __init__(self, stream: int = 0) -> None:
        self.device = torch.device("cpu")
        self.stream = stream
        self.recorded: List[Tuple[int, int]] = []  #: (data_ptr, stream) of record_stream calls
        #: (data_ptr, nbytes, weakref) of every tensor the backend allocated
        self.allocated: List[Tuple[int, int, "weakref.ReferenceType[torch.Tensor]"]] = []

    def current_stream(self) -> Any:
        return SimpleNamespace(cuda_stream=self.stream)

    def empty_strided(self, size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty_strided(size, stride, dtype=dtype)
        self.allocated.append((t.data_ptr(), t.untyped_storage().nbytes(), weakref.ref(t)))
        return t

    def alive(self, ptr: int, n: int) -> bool:
        return any(p <= ptr and ptr + n <= p + size and ref() is not None for p, size, ref in self.allocated)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.recorded.append((tensor.data_ptr(), stream.cuda_stream))

    def device_guard(self) -> Any:
        return contextlib.nullcontext()


def sim_backend(device: SimDevice, **kwargs: Any) -> Any:
    """A CudaBackend on `device` (keyword arguments go to CudaBackend)."""
    from .cuda_backend import CudaBackend

    return CudaBackend(_runtime=device, _torch=device.torch, **kwargs)


class ProfileClock:
    """Launches `profile`'s stage times on `device`'s compute stream where the cost model has
    them, from hooks on `model`'s unit modules (the profile's unit names): each unit's
    ``fwd_time`` when its module call ends in a training forward (the glue after it runs on the
    host next), or, during a replay (``cuda_exec.is_replaying``), when the replayed call ends; each
    unit's ``bwd_time`` when the next backward stage starts (the gradient of the next unit's
    output arrives) or the backward ends, so that the stage's waits for its swapped tensors come
    before its work, as in the model. Units are numbered in forward call order.

    ``stages``: (label, device time) of every stage end ("fwd:3", "replay:5", "bwd:2") since the
    last :meth:`reset`. The hooks run before any other hook of the module (``prepend``), so a
    stage's time is on the compute stream before the executor's hooks of the same point act.
    """

    def __init__(self, device: SimDevice, model: nn.Module, profile: Mapping[str, Any]) -> None:
        units = list(profile["units"])
        self.device = device
        self.fwd = [float(u["fwd_time"]) for u in units]
        self.bwd = [float(u["bwd_time"]) for u in units]
        modules = dict(model.named_modules())
        self._units: Dict[nn.Module, List[int]] = {}
        for i, u in enumerate(units):
            qual = str(u["name"]).split("#")[0]
            m = model if qual == "(root)" else modules.get(qual)
            if m is None:
                raise ValueError(f"profile unit {u['name']!r} is not a module of the model: profile this model")
            self._units.setdefault(m, []).append(i)
        self._handles: List[Any] = []
        self.reset()

    def reset(self) -> None:
        """A new step starts: units are counted from 0 again."""
        self._next = 0
        self._pending: Optional[int] = None
        self._ending = False
        self.stages: List[Tuple[str, float]] = []

    def attach(self) -> "ProfileClock":
        for m in self._units:
            self._handles.append(m.register_forward_hook(self._post, prepend=True))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "ProfileClock":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _mark(self, label: str) -> None:
        self.stages.append((label, self.device.compute_time()))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        units = self._units[module]
        if is_replaying():
            u = units[0]
            self.device.launch(self.fwd[u])
            self._mark(f"replay:{u}")
            return
        if not (torch.is_grad_enabled() and module.training):
            return  # not a training forward
        u = self._next
        if u not in units:  # a different call order than profiled: charge this module's first unit
            u = units[0]
        self._next += 1
        self.device.launch(self.fwd[u])
        self._mark(f"fwd:{u}")
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, u=u: self._backward_stage(u))
                break

    def _backward_stage(self, u: int) -> None:
        if not self._ending:
            self._ending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        self._finish_backward_stage()
        self._pending = u

    def _finish_backward_stage(self) -> None:
        if self._pending is not None:
            self.device.launch(self.bwd[self._pending])
            self._mark(f"bwd:{self._pending}")
            self._pending = None

    def _backward_end(self) -> None:
        self._finish_backward_stage()
        self._ending = False
        self._next = 0
