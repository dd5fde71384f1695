"""Tests of the CUDA backend (cuda_exec/cuda_exec/cuda_backend.py) and GPU detection (gpu.py).

Three groups:
- detection, everywhere: without a GPU, cuda_available() is False, cuda_status() names the reason,
  and CudaBackend() refuses with that reason;
- the backend's logic, everywhere: the backend runs against FakeRuntime, an emulation of the
  cuda-python runtime calls it uses, on host memory, whose copy stream only makes progress when
  the test (or a wait / synchronize) lets it. That checks ordering (events, waits), lifetimes
  (sources held until their copy ran), the pinned pool, close(), error names and the absence of
  host synchronisation in the hot path, without a GPU;
- the real thing, only on a GPU (skipped elsewhere with cuda_status() as the reason): bitwise round
  trips, overlap of copies with compute, pool reuse, close() freeing pinned memory, autograd.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import time
import weakref
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from cuda_exec import gpu
from cuda_exec.cuda_backend import (
    CudaBackend,
    CudaError,
    CudaUnavailableError,
    _is_dense,
    size_class,
)
from cuda_exec.gpu import cuda_available, cuda_status, runtime_module

RT = runtime_module()
E = RT.cudaError_t
HAS_GPU = cuda_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason=cuda_status())
SYNC_CALLS = {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"}


# --------------------------------------------------------------------------- detection (no GPU)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_no_gpu_is_reported_not_raised():
    assert cuda_available() is False
    status = cuda_status()
    assert status.startswith("no GPU: ")
    err, _count = RT.cudaGetDeviceCount()
    if err != E.cudaSuccess:  # this machine: error 35, cudaErrorInsufficientDriver
        assert gpu.error_name(RT, err) in status
        assert f"error {int(err)}" in status
    assert cuda_available(refresh=True) is False and cuda_status() == status


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_backend_without_gpu_raises_clearly():
    with pytest.raises(CudaUnavailableError, match="needs a CUDA GPU") as info:
        CudaBackend()
    assert cuda_status() in str(info.value)


def test_detection_failures_become_reasons(monkeypatch):
    class NoDevices:
        cudaError_t = E

        @staticmethod
        def cudaGetDeviceCount():
            return (E.cudaSuccess, 0)

    class Broken:
        cudaError_t = E
        cudaGetErrorName = staticmethod(RT.cudaGetErrorName)
        cudaGetErrorString = staticmethod(RT.cudaGetErrorString)

        @staticmethod
        def cudaGetDeviceCount():
            return (E.cudaErrorNoDevice, None)

    def missing():
        raise ImportError("No module named 'cuda'")

    try:
        monkeypatch.setattr(gpu, "runtime_module", lambda: NoDevices)
        assert gpu.cuda_available(refresh=True) is False
        assert "0 devices" in gpu.cuda_status()
        monkeypatch.setattr(gpu, "runtime_module", lambda: Broken)
        assert gpu.cuda_available(refresh=True) is False
        assert "cudaErrorNoDevice" in gpu.cuda_status()
        monkeypatch.setattr(gpu, "runtime_module", missing)
        assert gpu.cuda_available(refresh=True) is False
        assert "cuda-python is not usable" in gpu.cuda_status()
    finally:
        monkeypatch.undo()
        gpu.cuda_status(refresh=True)


def test_size_classes():
    assert size_class(1) == size_class(4096) == 4096
    for n in [4097, 5000, 65537, 10**6, 3 << 20, (64 << 20) + 1, 10**9 + 7]:
        c = size_class(n)
        assert n <= c < 1.25 * n + 1024, (n, c)
        assert size_class(c) == c
    assert len({size_class(n) for n in range((1 << 20) + 1, (2 << 20) + 1, 997)}) == 4


def test_dense_detection():
    x = torch.empty(4, 6, 8)
    assert _is_dense(x) and _is_dense(x.transpose(0, 2)) and _is_dense(x[1:3])
    assert _is_dense(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert _is_dense(torch.empty(5, 1, 3).as_strided((5, 1, 3), (3, 99, 1)))
    assert not _is_dense(x[:, ::2]) and not _is_dense(x[:, :, :4])
    assert not _is_dense(torch.empty(5, 1).expand(5, 7))


# --------------------------------------------------------------------------- the fake runtime


class _Event:
    _ids = itertools.count(1)

    def __init__(self, flags):
        self.id = next(self._ids)
        self.flags = flags
        self.recorded = 0  # generation of the latest cudaEventRecord
        self.completed = 0  # generation that has completed
        self.time = None
        self.alive = True

    def __int__(self):
        return self.id


def _api(nvals):
    """Record the call; return an injected error (with `nvals` None values) if one is armed."""

    def wrap(fn):
        def call(self, *args):
            self.calls.append(fn.__name__)
            err = self.fail.pop(fn.__name__, None)
            if err is not None:
                return (err,) + (None,) * nvals
            out = fn(self, *args)
            return (E.cudaSuccess,) + ((out,) if nvals else ())

        call.__name__ = fn.__name__
        return call

    return wrap


class FakeRuntime:
    """The cuda-python runtime calls the backend uses, emulated on host memory. Compute streams
    (any stream but the copy stream) are the host: work on them is already done. The copy stream
    is a queue that runs only in run(), cudaStreamSynchronize / cudaEventSynchronize, or when a
    compute stream waits on one of its events."""

    def __init__(self):
        self.calls = []
        self.fail = {}
        self.queue = deque()
        self.copy = None
        self.streams = set()
        self.events = {}
        self.host = {}  # pointer -> ctypes buffer
        self.host_allocs = 0
        self.host_frees = 0
        self.compute_records = []  # streams events were recorded on (other than the copy stream)
        self.waits = []  # (waiting stream, event id)
        self.device_alive = None  # (ptr, n) -> whether a live device tensor owns that memory

    def __getattr__(self, name):  # enums, flags, error names
        return getattr(RT, name)

    def _is_copy(self, stream):
        return int(stream) == self.copy

    def _event(self, ev):
        assert isinstance(ev, _Event) and ev.alive and ev.id in self.events, "dead or foreign event"
        return ev

    def _pinned(self, ptr, n):
        return any(p <= ptr and ptr + n <= p + len(buf) for p, buf in self.host.items())

    @_api(1)
    def cudaStreamCreateWithFlags(self, flags):
        assert flags == RT.cudaStreamNonBlocking
        s = RT.cudaStream_t(0xC0FFEE + len(self.streams))
        self.copy = int(s)
        self.streams.add(int(s))
        return s

    @_api(0)
    def cudaStreamDestroy(self, s):
        assert not self.queue, "stream destroyed with queued work"
        self.streams.remove(int(s))

    @_api(1)
    def cudaEventCreateWithFlags(self, flags):
        ev = _Event(flags)
        self.events[ev.id] = ev
        return ev

    @_api(0)
    def cudaEventDestroy(self, ev):
        self._event(ev).alive = False
        del self.events[ev.id]

    @_api(0)
    def cudaEventRecord(self, ev, stream):
        ev = self._event(ev)
        ev.recorded += 1
        if self._is_copy(stream):
            self.queue.append(("record", ev, ev.recorded))
        else:
            self.compute_records.append(int(stream))
            ev.completed, ev.time = ev.recorded, time.perf_counter()

    @_api(0)
    def cudaStreamWaitEvent(self, stream, ev, flags):
        ev = self._event(ev)
        self.waits.append((int(stream), ev.id))
        if self._is_copy(stream):
            self.queue.append(("wait", ev, ev.recorded))
        else:
            self._run_until(ev, ev.recorded)

    @_api(0)
    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        assert self._is_copy(stream), "copies belong on the copy stream"
        if kind == RT.cudaMemcpyKind.cudaMemcpyDeviceToHost:
            assert self._pinned(dst, n), "D2H target is not a pinned buffer"
        else:
            assert kind == RT.cudaMemcpyKind.cudaMemcpyHostToDevice
            assert self._pinned(src, n), "H2D source is not a pinned buffer"
        self.queue.append(("copy", dst, src, n))

    def cudaEventQuery(self, ev):
        self.calls.append("cudaEventQuery")
        err = self.fail.pop("cudaEventQuery", None)
        if err is not None:
            return (err,)
        ev = self._event(ev)
        return (E.cudaSuccess,) if ev.completed >= ev.recorded else (E.cudaErrorNotReady,)

    @_api(0)
    def cudaEventSynchronize(self, ev):
        ev = self._event(ev)
        self._run_until(ev, ev.recorded)

    @_api(0)
    def cudaStreamSynchronize(self, stream):
        if self._is_copy(stream):
            self.run()

    @_api(0)
    def cudaDeviceSynchronize(self):
        self.run()

    @_api(1)
    def cudaEventElapsedTime(self, a, b):
        assert a.flags == b.flags == RT.cudaEventDefault, "timing needs timing events"
        return (b.time - a.time) * 1e3

    @_api(1)
    def cudaHostAlloc(self, n, flags):
        buf = ctypes.create_string_buffer(n)
        self.host[ctypes.addressof(buf)] = buf
        self.host_allocs += 1
        return ctypes.addressof(buf)

    @_api(0)
    def cudaFreeHost(self, ptr):
        del self.host[ptr]
        self.host_frees += 1

    # the device making progress
    def run(self, n=None):
        while self.queue and (n is None or n > 0):
            op = self.queue.popleft()
            if op[0] == "copy":
                if self.device_alive is not None and not self._pinned(op[1], op[3]):
                    # an H2D copy: its target must still belong to a live tensor, else torch
                    # could already have given the memory to someone else
                    assert self.device_alive(op[1], op[3]), "H2D copy into a freed tensor"
                ctypes.memmove(op[1], op[2], op[3])
            elif op[0] == "wait":
                assert op[1].completed >= op[2], "copy stream waits on an event that never completes"
            else:
                op[1].completed = max(op[1].completed, op[2])
                op[1].time = time.perf_counter()
            n = None if n is None else n - 1

    def _run_until(self, ev, gen):
        while ev.completed < gen:
            assert self.queue, "waiting on an event nothing will complete"
            self.run(1)


class FakeTorch:
    """The backend's torch adapter on CPU tensors, with a current stream the test can switch."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.stream = 7
        self.recorded = []  # (data_ptr, stream) of record_stream calls
        self.allocated = []  # (data_ptr, nbytes, weakref) of every tensor the backend allocated

    def current_stream(self):
        return SimpleNamespace(cuda_stream=self.stream)

    def empty_strided(self, size, stride, dtype):
        t = torch.empty_strided(size, stride, dtype=dtype)
        self.allocated.append((t.data_ptr(), t.untyped_storage().nbytes(), weakref.ref(t)))
        return t

    def alive(self, ptr, n):
        return any(p <= ptr and ptr + n <= p + size and ref() is not None for p, size, ref in self.allocated)

    def record_stream(self, tensor, stream):
        self.recorded.append((tensor.data_ptr(), stream.cuda_stream))

    def device_guard(self):
        return contextlib.nullcontext()


@pytest.fixture
def fake(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("torch.cuda.synchronize called")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    rt, tt = FakeRuntime(), FakeTorch()
    rt.device_alive = tt.alive
    backend = CudaBackend(_runtime=rt, _torch=tt)
    yield SimpleNamespace(rt=rt, torch=tt, b=backend)
    backend.close()


def _bits(t):
    return t.detach().resolve_conj().resolve_neg().cpu().reshape(-1).contiguous().view(torch.uint8)


def _cases(device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return {
        "f32": r(1000),
        "f16_3d": r(3, 5, 7, dtype=torch.float16),
        "bf16": r(17, 9, dtype=torch.bfloat16),
        "f64_scalar": r((), dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (33, 3), generator=g).to(device),
        "bool": (r(50) > 0),
        "u8": torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8).to(device),
        "c64": torch.randn(6, 4, dtype=torch.complex64, generator=g).to(device),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0, 1e-40], device=device),
        "transposed": r(64, 32).t(),
        "channels_last": r(8, 3, 16, 16).to(memory_format=torch.channels_last),
        "row_slice": r(10, 20)[3:7],
        "step_slice": r(10, 20)[:, ::3],
        "column_slice": r(30, 40)[:, 5:9],
        "expanded": r(5, 1).expand(5, 7),
        "conj": torch.randn(3, 3, dtype=torch.complex64, generator=g).to(device).conj(),
        "empty": r(0, 5),
        "large": r(1 << 20),
    }


# --------------------------------------------------------------------------- logic, on the fake


def test_fake_round_trip_bitwise_and_layouts(fake):
    b, rt = fake.b, fake.rt
    for name, x in _cases("cpu").items():
        ref, dense, stride = _bits(x).clone(), _is_dense(x) and not x.is_conj(), x.stride()
        h = b.offload(x)
        assert h.nbytes == x.numel() * x.element_size()
        del x  # the backend keeps the source alive until its copy ran
        gc.collect()
        y = b.fetch(h)  # runs the copies up to this handle's H2D (a compute-stream wait)
        assert torch.equal(_bits(y), ref), name
        if dense:
            assert y.stride() == stride, name
        else:
            assert y.is_contiguous(), name
        assert not y.is_conj()
        b.release(h)
    assert not any(c in SYNC_CALLS for c in rt.calls)
    b.synchronize()
    assert b.pool.bytes_in_use == 0 and b.pending_offloads == 0


def test_fake_source_held_until_copy_completes(fake):
    b, rt = fake.b, fake.rt
    x = torch.arange(1 << 16, dtype=torch.float32)
    ptr = x.data_ptr()
    h = b.offload(x)
    del x
    assert rt.queue, "offload queued the copy and returned"
    for _ in range(3):  # polling never blocks and never drops the source early
        assert b.poll() == 1
        assert any(src.data_ptr() == ptr for _ev, src in b._pending)
    rt.run()
    assert b.poll() == 0 and not b._pending
    assert torch.equal(b.fetch(h), torch.arange(1 << 16, dtype=torch.float32))
    b.release(h)


def test_fake_prefetch_before_the_offload_completed_hands_back_the_source(fake):
    """A prefetch issued while the offload's copy has not run: the device bytes are still there,
    so fetch returns them, with no second device allocation and no copy back."""
    b, rt, tt = fake.b, fake.rt, fake.torch
    x = torch.arange(1 << 12, dtype=torch.float32)
    ptr = x.data_ptr()
    h = b.offload(x)
    del x
    b.prefetch(h)
    y = b.fetch(h)
    assert y.data_ptr() == ptr and torch.equal(y, torch.arange(1 << 12, dtype=torch.float32))
    assert not tt.allocated and b.stats["h2d_bytes"] == 0 and b.stats["kept_sources"] == 1
    rt.run()  # the offload's copy still runs (it was queued); then everything is given back
    del y
    b.release(h)
    b.synchronize()
    assert b.pool.bytes_in_use == 0 and b.pending_offloads == 0
    # after a swap deadline let the source go, a prefetch copies back as usual
    z = torch.arange(1 << 12, dtype=torch.float32)
    h = b.offload(z)
    b.release_offload(h)
    del z
    b.prefetch(h)
    assert tt.allocated and b.stats["h2d_bytes"] == 1 << 14
    assert torch.equal(b.fetch(h), torch.arange(1 << 12, dtype=torch.float32))
    b.release(h)


def test_fake_swap_deadline_is_a_stream_wait_and_drops_the_sources(fake):
    b, rt, tt = fake.b, fake.rt, fake.torch
    tt.stream = 7
    xs = [torch.arange(1000, dtype=torch.float32) + i for i in range(3)]
    refs = [StorageWeakRef(x.untyped_storage()) for x in xs]
    hs = [b.offload(x) for x in xs]
    del xs
    gc.collect()
    assert not any(r.expired() for r in refs)  # the copies have not run: the backend holds them
    waits = len(rt.waits)
    b.release_offload(hs[1])
    # the compute stream (7) waits for the second copy's event; the host did not block
    assert rt.waits[waits:] == [(7, hs[1]._slot.offload_event.id)]
    assert not any(c in SYNC_CALLS for c in rt.calls)
    gc.collect()
    # FIFO: the first two sources are dropped, the third is still held for its copy
    assert refs[0].expired() and refs[1].expired() and not refs[2].expired()
    assert b.stats["deadline_releases"] == 1
    for i, h in enumerate(hs):
        assert torch.equal(b.fetch(h), torch.arange(1000, dtype=torch.float32) + i)
        b.release(h)
    b.synchronize()
    assert b.pending_offloads == 0 and b.pool.bytes_in_use == 0


def test_fake_ordering_follows_the_live_compute_stream(fake):
    b, rt, tt = fake.b, fake.rt, fake.torch
    tt.stream = 11  # forward on stream 11
    h = b.offload(torch.ones(1000))
    assert rt.compute_records == [11]
    assert rt.waits[-1][0] == rt.copy  # the copy stream waits for the compute stream
    rt.run()  # the offload completed: a prefetch copies back
    b.prefetch(h)  # allocation on stream 11: the copy waits for it again
    assert rt.compute_records == [11, 11]
    tt.stream = 23  # backward on another thread's stream
    y = b.fetch(h)
    assert rt.waits[-1] == (23, h._slot.ready_event.id)  # stream 23 waits, the host does not
    assert tt.recorded == [(y.data_ptr(), 23)]  # marked as used on stream 23
    h2 = b.offload(torch.zeros(10))
    assert rt.compute_records[-1] == 23  # looked up again, not cached
    assert b.fetch(h) is y  # fetching again returns the live tensor
    tt.stream = 0  # torch's default stream is the legacy default stream
    b.release(b.offload(torch.ones(3)))
    assert rt.compute_records[-1] == int(RT.cudaStreamLegacy)
    assert not any(c in SYNC_CALLS for c in rt.calls)
    for hh in (h, h2):
        b.release(hh)


def test_fake_prefetch_then_release_without_fetch(fake):
    b, rt, tt = fake.b, fake.rt, fake.torch
    h = b.offload(torch.ones(4096))
    rt.run()
    tt.stream = 5
    b.prefetch(h)
    ready = h._slot.ready_event.id
    tt.stream = 9
    b.release(h)  # the tensor's allocation stream (5) must wait for the H2D before it is dropped
    assert (5, ready) in rt.waits
    assert b.pool.bytes_in_use == 0
    with pytest.raises(RuntimeError, match="released"):
        b.fetch(h)
    b.release(h)  # idempotent


def test_fake_dropped_handles_are_reclaimed(fake):
    b = fake.b
    hs = [b.offload(torch.ones(n)) for n in (100, 5000, 70000)]
    assert b.pool.bytes_in_use > 0
    del hs
    gc.collect()
    b.poll()
    assert b.pool.bytes_in_use == 0


def _step(b, sizes, base):
    hs = [b.offload(torch.full((n,), float(base + i))) for i, n in enumerate(sizes)]
    b.synchronize()  # the offloads completed: the prefetches copy back
    for h in hs[::2]:
        b.prefetch(h)
    for i, h in reversed(list(enumerate(hs))):
        y = b.fetch(h)
        assert torch.all(y == float(base + i))
        b.release(h)


def test_fake_pool_reused_across_steps_and_close_frees_everything(fake):
    b, rt = fake.b, fake.rt
    sizes = [1000, 1000, 300000, 7, 65536, 1 << 20, 1000]
    _step(b, sizes, 0)
    allocs, events = rt.host_allocs, b._events.created
    assert allocs == len(sizes) and b.pool.stats()["allocations"] == allocs
    _step(b, sizes, 100)
    _step(b, list(reversed(sizes)), 200)
    assert rt.host_allocs == allocs, "second step allocated pinned memory"
    assert b._events.created == events
    # a slightly smaller step still fits the buffers it has
    _step(b, [n - 3 for n in sizes if n > 10], 300)
    assert rt.host_allocs == allocs
    h = b.offload(torch.ones(123456))  # in flight while closing
    b.close()
    assert not rt.host and rt.host_frees == rt.host_allocs
    assert not rt.events and b._events.destroyed == b._events.created
    assert not rt.streams and not b._pending
    assert b.pool.stats()["bytes_reserved"] == 0
    b.close()  # idempotent
    b.release(h)  # a no-op after close
    with pytest.raises(RuntimeError, match="closed"):
        b.offload(torch.ones(3))


def test_fake_reserve_preallocates(fake):
    b, rt = fake.b, fake.rt
    b.reserve([4 << 20, 4 << 20, 20000])  # bytes
    assert rt.host_allocs == 3
    _step(b, [1 << 20, (1 << 20) - 8, 4999], 0)  # float32 elements
    assert rt.host_allocs == 3


def test_fake_errors_name_the_cuda_error(fake):
    b, rt = fake.b, fake.rt
    rt.fail["cudaHostAlloc"] = E.cudaErrorMemoryAllocation
    with pytest.raises(CudaError, match="cudaHostAlloc failed: cudaErrorMemoryAllocation") as info:
        b.offload(torch.ones(10))
    assert info.value.error_name == "cudaErrorMemoryAllocation" and info.value.code == 2
    h = b.offload(torch.ones(10))
    rt.fail["cudaEventQuery"] = E.cudaErrorLaunchFailure
    with pytest.raises(CudaError, match="cudaEventQuery failed: cudaErrorLaunchFailure"):
        b.poll()
    rt.fail["cudaMemcpyAsync"] = E.cudaErrorInvalidValue
    with pytest.raises(CudaError, match="cudaMemcpyAsync.*cudaErrorInvalidValue"):
        b.offload(torch.ones(10))
    b.release(h)
    b.synchronize()
    assert b.pool.bytes_in_use == 0


def test_fake_bandwidth_uses_timed_events(fake):
    d2h, h2d = fake.b.bandwidth(8 << 20)
    assert d2h > 1e6 and h2d > 1e6
    assert fake.b.pool.bytes_in_use == 0
    assert fake.rt.host_allocs == 1


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )


def _grads(model, x, backend=None):
    model.zero_grad(set_to_none=True)
    if backend is None:
        ctx = contextlib.nullcontext()
    else:

        def unpack(h):
            t = backend.fetch(h)
            backend.release(h)
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(backend.offload, unpack)
    with ctx:
        loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_fake_under_autograd(fake):
    model, x = _mlp(), torch.randn(16, 32)
    ref = _grads(model, x)
    got = _grads(model, x, fake.b)
    assert all(torch.equal(a, c) for a, c in zip(ref, got))
    fake.b.synchronize()
    assert fake.b.pool.bytes_in_use == 0


# --------------------------------------------------------------------------- on a real GPU


@pytest.fixture
def cuda_backend():
    b = CudaBackend()
    yield b
    b.close()


@needs_gpu
def test_gpu_round_trip_bitwise(cuda_backend):
    b = cuda_backend
    for name, x in _cases("cuda").items():
        ref, dense, stride = _bits(x).clone(), _is_dense(x) and not x.is_conj(), x.stride()
        h = b.offload(x)
        del x
        # hand freshly freed blocks to someone else: an early release would corrupt the copy
        junk = [torch.full((h.nbytes // 4 + 1,), 7.0, device="cuda") for _ in range(3)]
        y = b.fetch(h)
        assert torch.equal(_bits(y), ref), name
        assert y.stride() == stride if dense else y.is_contiguous(), name
        b.release(h)
        del junk
    b.synchronize()
    assert b.pending_offloads == 0 and b.pool.bytes_in_use == 0


@needs_gpu
def test_gpu_fetch_on_a_side_stream(cuda_backend):
    b = cuda_backend
    x = torch.randn(1 << 20, device="cuda")
    ref = x.clone()
    h = b.offload(x)
    b.prefetch(h)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = b.fetch(h)
        z = y * 2
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(z, ref * 2)
    b.release(h)


@needs_gpu
def test_gpu_copies_overlap_compute(cuda_backend):
    b = cuda_backend
    n = 256 << 20
    x = torch.ones(n // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    b.reserve([n])
    (a @ a).sum().item()  # warm up
    torch.cuda.synchronize()  # test setup, outside the backend

    def copy_alone():
        t0 = time.perf_counter()
        h = b.offload(x)
        issued = time.perf_counter() - t0
        b.synchronize()
        total = time.perf_counter() - t0
        b.release(h)
        return issued, total

    issued, t_copy = min(copy_alone() for _ in range(3))
    t0 = time.perf_counter()
    (a @ a)
    torch.cuda.synchronize()
    one_mm = time.perf_counter() - t0
    k = max(1, round(t_copy / one_mm))

    def mm_alone():
        t0 = time.perf_counter()
        for _ in range(k):
            a @ a
        torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    t_mm = min(mm_alone() for _ in range(3))

    def both():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = b.offload(x)
        for _ in range(k):
            a @ a
        torch.cuda.current_stream().synchronize()
        compute_done = time.perf_counter() - t0
        b.synchronize()
        total = time.perf_counter() - t0
        b.release(h)
        return compute_done, total

    compute_done, t_both = min(both() for _ in range(3))
    assert issued < 0.5 * t_copy, "offload blocked the host"
    assert compute_done < t_mm + 0.5 * t_copy, "compute waited for the copy"
    assert t_both < 0.8 * (t_copy + t_mm), (t_copy, t_mm, t_both)


@needs_gpu
def test_gpu_pool_reused_across_steps(cuda_backend):
    b = cuda_backend
    sizes = [1000, 1000, 300000, 7, 65536, 1 << 20, 1000]

    def step(base):
        hs = [b.offload(torch.full((n,), float(base + i), device="cuda")) for i, n in enumerate(sizes)]
        for h in hs[::2]:
            b.prefetch(h)
        for i, h in reversed(list(enumerate(hs))):
            assert bool(torch.all(b.fetch(h) == float(base + i)))
            b.release(h)

    step(0)
    stats = b.pool.stats()
    events = b._events.created
    step(100)
    assert b.pool.stats()["allocations"] == stats["allocations"] == len(sizes)
    assert b._events.created == events
    b.synchronize()
    assert b.pool.bytes_in_use == 0 and b.pending_offloads == 0


@needs_gpu
def test_gpu_close_frees_everything():
    b = CudaBackend()
    x = torch.randn(1 << 20, device="cuda")
    h = b.offload(x)
    ptr = h._slot.ptr
    attrs = b._cuda("cudaPointerGetAttributes", ptr)
    assert attrs.type == RT.cudaMemoryType.cudaMemoryTypeHost
    src = weakref.ref(b._pending[0][1])
    b.close()
    assert src() is None and b.pending_offloads == 0
    stats = b.pool.stats()
    assert stats["buffers"] == 0 and stats["frees"] == stats["allocations"] == 1
    assert b._events.destroyed == b._events.created
    err, attrs = RT.cudaPointerGetAttributes(ptr)
    assert err != E.cudaSuccess or attrs.type == RT.cudaMemoryType.cudaMemoryTypeUnregistered
    with pytest.raises(RuntimeError, match="closed"):
        b.offload(x)


@needs_gpu
def test_gpu_bandwidth_and_error_names(cuda_backend):
    d2h, h2d = cuda_backend.bandwidth(16 << 20)
    assert 1e8 < d2h < 1e13 and 1e8 < h2d < 1e13
    with pytest.raises(CudaError, match="cudaSetDevice failed: cudaErrorInvalidDevice"):
        cuda_backend._cuda("cudaSetDevice", 1 << 20)


@needs_gpu
def test_gpu_under_autograd(cuda_backend):
    model, x = _mlp().cuda(), torch.randn(16, 32, device="cuda")
    ref = _grads(model, x)
    got = _grads(model, x, cuda_backend)
    assert all(torch.allclose(a, c, rtol=1e-6, atol=1e-7) for a, c in zip(ref, got))
    cuda_backend.synchronize()
    assert cuda_backend.pool.bytes_in_use == 0
