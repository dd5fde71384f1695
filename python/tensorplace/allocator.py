"""Allocator simulation: what an allocation sequence costs in *reserved* device memory.

Two models run in the Rust core (rust_core/src/allocator): PyTorch's CUDA caching allocator
(``"caching"``) and moDNN's offset pool (``"offset-pool"``).

- :func:`replay` replays a recorded ``cuda-caching-allocator-trace`` (docs/formats.md) and
  compares the simulated peaks with the recorded ones.
- :func:`simulate` runs a plain sequence of allocations and frees.
- ``tensorplace-bench allocator TRACE...`` prints simulated against recorded peaks
  (:func:`add_cli`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _core

MODELS = ("caching", "offset-pool")

TraceLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]
Event = Union[Tuple[Any, ...], Mapping[str, Any]]


class AllocatorError(ValueError):
    """A trace, event sequence or option the simulator refuses; the message says what to fix."""


def _options(
    model: Optional[str],
    alloc_conf: Optional[str],
    capacity: Optional[int],
    timeline: bool,
    check_merged: bool,
    initial: Optional[Tuple[int, int]] = None,
    trace_layout: Optional[bool] = None,
) -> str:
    if model is not None and model not in MODELS:
        raise AllocatorError(f"unknown allocator model {model!r}; use one of {', '.join(MODELS)}")
    opts: Dict[str, Any] = {"timeline": timeline, "check_merged": check_merged}
    if model is not None:
        opts["model"] = model
    if alloc_conf is not None:
        opts["alloc_conf"] = alloc_conf
    if capacity is not None:
        opts["capacity"] = int(capacity)
    if trace_layout is not None:
        opts["trace_layout"] = trace_layout
    if initial is not None:
        opts["initial"] = {"allocated": int(initial[0]), "reserved": int(initial[1])}
    return json.dumps(opts)


def _trace_text(trace: TraceLike) -> str:
    if isinstance(trace, Mapping):
        return json.dumps(trace)
    if isinstance(trace, str) and trace.lstrip().startswith("{"):
        return trace
    path = os.fspath(trace)
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise AllocatorError(f"cannot read allocator trace {path!r}: {e.strerror}; give a path, a dict or JSON text") from e


def _call(fn: Any, *args: str) -> Dict[str, Any]:
    try:
        return json.loads(fn(*args))
    except _core.PlannerError as e:
        raise AllocatorError(str(e)) from None


def replay(
    trace: TraceLike,
    model: Optional[str] = None,
    *,
    alloc_conf: Optional[str] = None,
    capacity: Optional[int] = None,
    timeline: bool = False,
    check_merged: bool = False,
    trace_layout: bool = True,
) -> Dict[str, Any]:
    """Replay a recorded allocator trace (a path, a dict or JSON text) through a model.

    ``model``: ``"caching"`` (default) or ``"offset-pool"``; the trace's ``alloc_conf`` selects
    the caching allocator's settings unless ``alloc_conf`` overrides it. ``capacity``: device
    bytes the allocator may reserve (cached blocks are released on a miss, and allocations that
    still do not fit are counted in ``ooms``). Returns a dict with ``max_reserved``,
    ``max_allocated``, ``segments`` (held at the end), ``max_segments``, ``device_allocs``
    (cudaMalloc calls or page mappings), ``recorded`` (the trace's own peaks and counts),
    ``reserved_error_pct``, ``allocated_error_pct`` and more (docs/formats.md); with
    ``timeline``, ``timeline`` lists ``(allocated, reserved)`` after every replayed event.
    ``trace_layout=False`` ignores what the recorded addresses say about the memory held at the
    start and about cudaMalloc's address order (docs/formats.md): the replay then uses only
    ``at_start``.
    """
    text = _trace_text(trace)
    opts = _options(model, alloc_conf, capacity, timeline, check_merged, trace_layout=trace_layout)
    return _call(_core.allocator_replay, text, opts)


def _event_json(e: Event, i: int) -> Dict[str, Any]:
    if isinstance(e, Mapping):
        return dict(e)
    if e and e[0] == "alloc" and len(e) in (3, 4):
        return {"op": "alloc", "id": int(e[1]), "size": int(e[2]), "stream": int(e[3]) if len(e) == 4 else 0}
    if e and e[0] in ("free", "free_requested", "free_completed") and len(e) == 2:
        return {"op": e[0], "id": int(e[1])}
    raise AllocatorError(f"event {i} is {e!r}; write ('alloc', id, size[, stream]) or ('free', id)")


def simulate(
    events: Sequence[Event],
    model: str = "caching",
    *,
    alloc_conf: str = "",
    initial: Optional[Tuple[int, int]] = None,
    capacity: Optional[int] = None,
    timeline: bool = False,
    check_merged: bool = False,
) -> Dict[str, Any]:
    """Simulate ``events``: ``("alloc", id, size[, stream])`` and ``("free", id)`` tuples (or
    ``{"op": ..., ...}`` dicts; ``free_requested`` / ``free_completed`` split a free).

    ``alloc_conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` string; ``initial`` = ``(allocated,
    reserved)`` bytes held before the first event. ``check_merged`` counts pairs of adjacent
    free blocks left unmerged after every event (``unmerged_free_pairs``; 0 for a correct
    allocator). Returns the stats dict of :func:`replay` without the recorded fields.
    """
    body = json.dumps([_event_json(e, i) for i, e in enumerate(events)])
    return _call(_core.allocator_simulate, body, _options(model, alloc_conf, capacity, timeline, check_merged, initial))


# ---------------------------------------------------------------- tensorplace-bench allocator


def _gib(b: Optional[int]) -> str:
    return "-" if b is None else f"{b / 2**30:.3f}"


def _pct(p: Optional[float]) -> str:
    return "-" if p is None else f"{p:+.2f}%"


def cmd_allocator(a: argparse.Namespace) -> int:
    """Replay recorded allocator traces; print simulated against recorded peaks."""
    from .bench import common

    a.out.update(traces=a.traces, model=a.model or "caching", alloc_conf=a.alloc_conf, capacity=a.capacity,
                 trace_layout=not a.no_trace_layout)
    rows: List[List[Any]] = []
    with common.progress("replaying", total=len(a.traces)) as bar:
        for path in a.traces:
            bar.describe(f"replaying {os.path.basename(path)}")
            try:
                with open(path) as f:
                    trace = json.load(f)
            except FileNotFoundError:
                raise SystemExit(f"allocator: trace {path!r}: no such file") from None
            except (OSError, ValueError) as e:  # ValueError: not JSON (json.JSONDecodeError), not text
                raise SystemExit(f"allocator: trace {path!r} is not a JSON allocator trace: {e}") from None
            try:
                r = replay(trace, a.model, alloc_conf=a.alloc_conf, capacity=a.capacity,
                           trace_layout=not a.no_trace_layout)
            except AllocatorError as e:
                raise SystemExit(f"allocator: trace {path!r}: {e}") from None
            bar.advance()
            rec = r["recorded"]
            rows.append([
                os.path.basename(path).removesuffix(".json") + (f' ({r["alloc_conf"]})' if r["alloc_conf"] else ""),
                _gib(r["max_reserved"]), _gib(rec["max_reserved"]), _pct(r["reserved_error_pct"]),
                _gib(r["max_allocated"]), _gib(rec["max_allocated"]), _pct(r["allocated_error_pct"]),
                f'{r["device_allocs"]} / {rec["device_allocs"]}',
            ])
            a.out.append("rows", {"trace": path, **{k: v for k, v in r.items() if k != "timeline"}})
    common.table(
        f"allocator replay ({a.model or 'caching'}): simulated vs recorded peaks, GiB",
        ["trace (alloc_conf)", "reserved sim", "rec", "error", "allocated sim", "rec", "error", "segments sim / rec"],
        rows,
    )
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``tensorplace-bench allocator``."""
    p = subparsers.add_parser("allocator", help=cmd_allocator.__doc__, description=cmd_allocator.__doc__)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="cuda-caching-allocator-trace JSON files")
    p.add_argument("--model", choices=MODELS, default=None, help="default: caching, under the trace's alloc_conf")
    p.add_argument("--alloc-conf", default=None, help="replay under this PYTORCH_CUDA_ALLOC_CONF instead of the trace's")
    p.add_argument("--capacity", type=int, default=None, help="device bytes the allocator may reserve")
    p.add_argument("--no-trace-layout", action="store_true",
                   help="use only at_start, not the initial blocks and segment addresses inferred from the trace")
    p.set_defaults(fn=cmd_allocator)
