"""Exact planning as a mixed-integer linear program, solved by HiGHS (``highspy``).

AutoTM's formulation (a flow graph per tensor over the stages, write-once host copies, a memory
constraint per stage, asynchronous copies overlapping compute) extended with Checkmate's
recomputation, written as a *linear model of tensorplace's cost model* (docs/cost-model.md).
docs/methods.md says exactly where the model departs from the evaluator; the evaluator scores
the resulting plan like any other.

Methods: ``milp`` (swap and recompute), ``milp-swap`` (AutoTM: swap only) and
``milp-recompute`` (Checkmate: recompute only).

Stages are numbered s = 0 .. 2n-1: forward F0 .. F(n-1) are 0 .. n-1, backward B(i) is 2n-1-i.
For a unit u the model has binaries r_u, w_u, c_u (retain, swap, recompute; one of them is 1;
swap only for a unit with activations and a backward reader), and for a swap:

- z[u, b]: the swap-out has left the device when stage b allocates (b in bu+1 .. bu+1+K, bu the
  last stage the forward may reference u's activations in: its last forward reader, or the
  profile's `forward_held_until`); the copy's work is split over the stages
  before b (continuous, f[u, k] <= d_u * [u still on the device at k]), and at stage b itself it
  is a stall (the evaluator waits for a queued swap-out when a stage does not fit);
- y[u, p]: the prefetch is issued at the start of stage p (within the evaluator's lookahead
  window before u's first backward reader fn); its work g[u, k] runs in stages p .. fn, and work
  at fn itself is a stall;
- write-once: one swap-out and one prefetch per unit, b <= p.

Checkpoint segments: a binary x[s, e, v] per candidate segment (units s..e recomputed as one
segment; with the default starts, the runs between two starts, a neighbour in the same run not
recomputed) and behaviour v: what the segment's replays do depends on a few units outside it
(a later reader recomputed in another segment holds what it reads instead of having it
replayed; an earlier unit recomputed in another segment whose saved value a unit of the segment
reads makes that unit's backward replay it), so each assignment of those that changes the
segment's behaviour is a column, allowed only where the assignment holds. Each column's replay
time, memory per stage (held inputs, held saved values, replayed activations) and transient at
its replays come from simulating the evaluator's rules for that segment (_simulate_segment);
c_u is the sum of the columns covering u.

One copy stream: at every stage, the copy work placed in it is at most the stage's compute time
plus its recomputation plus its stall sigma_s. A swapped input a replay needs is on the device
by then (its copy's remaining work is a stall) or prefetched then (a stall). The objective is
the step time: compute + recomputation + stalls.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .. import _core

MILP_METHODS = ("milp", "milp-swap", "milp-recompute")


class MilpError(_core.PlannerError):
    """The MILP could not be built or solved (bad setting, solver missing)."""


# ------------------------------------------------------------------------------------------------
# Graph indexes (rust_core/src/profile.rs Graph, from _core.profile_graph), with stage numbers
# ------------------------------------------------------------------------------------------------


@dataclass
class _Graph:
    n: int
    constant: int
    d2h: float
    h2d: float
    fwd: List[float]
    bwd: List[float]
    act: List[int]
    out: List[int]
    out_saved: List[bool]
    held: List[int]
    random: List[bool]  # the unit's segment draws random numbers
    rng_state: int  # bytes a segment with a random unit keeps from its start to its replay
    held_from: List[List[Tuple[int, int]]]  # (producer, bytes): unsaved values held for a replay
    saved_from: List[List[Tuple[int, int]]]  # (producer, bytes): saved values of inputs
    block_start: List[bool]  # default checkpoint segment starts
    fwd_tr: List[int]
    bwd_tr: List[int]
    grad: List[int]
    inputs: List[List[int]]
    replay_inputs: List[List[int]]
    replay_extra: List[int]
    linger: List[int]
    linger_until: List[int]  # stage index (inclusive) until which lingering bytes stay
    last_fwd: List[int]
    busy_until: List[int]  # stage index until which the forward may reference its activations
    no_recompute: List[bool]  # the executor cannot replay the unit (profile's recomputable: false)
    first_need: List[Optional[int]]  # stage index of the first backward reader
    last_use: List[Optional[int]]  # stage index of the last backward reader
    needs: List[List[int]]  # per unit i: the units whose activations B(i) reads, largest first
    readers: List[List[int]]  # per unit: the units whose backward reads its activations
    # the executor's host costs (docs/cost-model.md, "Host time"), added to the objective
    swap_host: List[float] = field(default_factory=list)  # per unit, when swapped
    drop_host: List[float] = field(default_factory=list)  # per unit, when recomputed
    tracked_host: List[float] = field(default_factory=list)  # per unit, when its segment is tracked
    glue_scope: List[Optional[Tuple[int, int]]] = field(default_factory=list)
    segment_host: float = 0.0  # per replayed segment
    step_host: float = 0.0  # per step, whatever the plan


def _plan_independent_time(g: _Graph) -> float:
    """Seconds of every plan's step outside the objective: the stages and the executor's own work."""
    return sum(g.fwd) + sum(g.bwd) + g.step_host


def _graph(profile_text: str) -> _Graph:
    d = json.loads(_core.profile_graph(profile_text))
    n = int(d["n"])
    S = 2 * n
    readers: List[List[int]] = [[] for _ in range(n)]
    for i, us in enumerate(d["needs"]):
        for u in us:
            readers[u].append(i)
    linger_until = [t if t < n else S - 1 for t in d["linger_until"]]  # S - 1: never let go in the forward
    return _Graph(
        n=n,
        constant=int(d["constant"]),
        d2h=float(d["d2h"]),
        h2d=float(d["h2d"]),
        fwd=[float(t) for t in d["fwd_time"]],
        bwd=[float(t) for t in d["bwd_time"]],
        act=[int(b) for b in d["act"]],
        out=[int(b) for b in d["out"]],
        out_saved=[bool(v) for v in d["out_saved"]],
        held=[int(b) for b in d["held"]],
        random=[bool(v) for v in d.get("random", [False] * n)],
        no_recompute=[bool(v) for v in d.get("no_recompute", [False] * n)],
        rng_state=int(d.get("rng_state", 0)),
        held_from=[[(int(p), int(b)) for p, b in hf] for hf in d["held_from"]],
        saved_from=[[(int(p), int(b)) for p, b in sf] for sf in d["saved_from"]],
        block_start=[bool(v) for v in d["block_start"]],
        fwd_tr=[int(b) for b in d["fwd_transient"]],
        bwd_tr=[int(b) for b in d["bwd_transient"]],
        grad=[int(b) for b in d["grad"]],
        inputs=[list(map(int, v)) for v in d["inputs"]],
        replay_inputs=[list(map(int, v)) for v in d["replay_inputs"]],
        replay_extra=[int(b) for b in d["replay_extra"]],
        linger=[int(b) for b in d["linger"]],
        linger_until=linger_until,
        last_fwd=[int(v) for v in d["last_fwd"]],
        busy_until=[int(v) for v in d["busy_until"]],
        first_need=[None if r is None else S - 1 - int(r) for r in d["first_need"]],
        last_use=[None if r is None else S - 1 - int(r) for r in d["last_use"]],
        needs=[list(map(int, v)) for v in d["needs"]],
        readers=readers,
        **_host_costs(d, n),
    )


def _host_costs(d: Dict[str, Any], n: int) -> Dict[str, Any]:
    """The executor's host seconds per unit and action (the evaluator's additive rule: a profile
    with host times per stage, a GPU's, is scored by the evaluator, which knows its clock)."""
    c = d.get("costs") or {}
    packs = [float(v) for v in d.get("packs", [0.0] * n)]
    glue = [float(v) for v in d.get("glue_ops", [0.0] * n)]
    swap = [float(v) for v in d["swap_host"]]  # the evaluator's rule (ExecutorCosts::swap_host)
    scope = [None if s is None else (int(s[0]), int(s[1])) for s in d.get("glue_scope", [None] * n)]
    return {"swap_host": swap, "drop_host": [c.get("drop", 0.0) * p for p in packs],
            "tracked_host": [c.get("tracked_op", 0.0) * k for k in glue], "glue_scope": scope,
            "segment_host": float(c.get("segment", 0.0)), "step_host": float(c.get("step", 0.0))}


# ------------------------------------------------------------------------------------------------
# Checkpoint segments: what one segment does in the evaluator, given which units outside it are
# recomputed (docs/cost-model.md, "Checkpoint segments"; rust_core/src/evaluator.rs)
# ------------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    """Units s..e recomputed as one checkpoint segment, under one assignment of the outside units
    its replays depend on (`cond`: unit -> recomputed)."""

    s: int
    e: int
    cond: Dict[int, bool]
    replay_at: Dict[int, int]  # unit -> stage of its replay (units never replayed are absent)
    time: Dict[int, float]  # stage -> replay time in it
    steady: np.ndarray  # per stage: held bytes, held saved values, replayed activations (the most at any point)
    extra: Dict[int, float]  # stage -> what its replays add on top of `steady` at their peak
    swap_inputs: List[Tuple[int, int, int, bool]]  # (unit, outside input, stage, let go): resident if swapped


def _simulate_segment(g: _Graph, s: int, e: int, rec: Set[int]) -> _Segment:
    """The evaluator's rules for a recomputed run s..e split from its neighbours, where `rec` are
    the units outside it that are recomputed (in other segments)."""
    n, S = g.n, 2 * g.n
    act = g.act
    # Held bytes, once per segment and producer (a producer inside the segment is regenerated).
    held_b: Dict[int, int] = {}
    held_saved: Dict[int, int] = {}
    charged: Set[int] = set()
    if any(g.random[u] for u in range(s, e + 1)):
        held_b[s] = g.rng_state  # the generators' state, kept by the segment's first unit
    for u in range(s, e + 1):
        h = g.held[u]
        for p, b in g.held_from[u]:
            if p >= s:
                h -= b
            elif p in charged:
                h -= b
            else:
                charged.add(p)
        held_b[u] = held_b.get(u, 0) + h
        hs = 0
        for p, b in g.saved_from[u]:
            if p < s and p in rec and p not in charged:
                charged.add(p)
                hs += b
        held_saved[u] = hs
    steady = np.zeros(S)
    # Forward: held from the unit's forward on.
    fwd_held = np.zeros(n)
    for u in range(s, e + 1):
        fwd_held[u] += held_b[u] + held_saved[u]
    steady[:n] = np.cumsum(fwd_held)
    # Backward. A segment none of whose units has activations is never replayed: its held inputs
    # leave when the forward ends.
    replays = any(act[u] > 0 for u in range(s, e + 1))
    held_now = {u: held_b[u] for u in range(s, e + 1) if replays}
    saved_now = dict(held_saved)
    state = float(sum(held_now.values()) + sum(saved_now.values()))
    resident: Set[int] = set()
    replay_at: Dict[int, int] = {}
    time: Dict[int, float] = {}
    peaks: Dict[int, float] = {}
    swap_inputs: List[Tuple[int, int, int, bool]] = []
    k = n
    high = state

    def replay(u: int) -> None:
        nonlocal state, high
        kept = 0
        for p in g.replay_inputs[u]:
            if p >= s:
                if p in replay_at and p not in resident:
                    kept += act[p]
                elif act[p] > 0 and p not in resident:
                    replay(p)
            elif act[p] > 0 and g.last_use[p] is not None:
                # Outside the segment: resident (retained or swapped, until its last reader), held
                # (recomputed), or, once its last reader has run, made resident for this replay
                # only (counted whatever the action: exact unless it is recomputed and not yet
                # replayed, when it is held).
                gone = g.last_use[p] < k
                if gone:
                    kept += act[p]
                swap_inputs.append((u, p, k, gone))
        regen = 0
        for p, b in g.held_from[u]:
            if p >= s:
                if p not in replay_at:
                    replay(p)
                regen += b
        peaks[k] = max(peaks.get(k, 0.0), state + act[u] + g.replay_extra[u] + regen + kept)
        replay_at[u] = k
        time[k] = time.get(k, 0.0) + g.fwd[u]
        state += act[u] - held_now.pop(u, 0)
        resident.add(u)
        if g.last_use[u] is None or g.last_use[u] < k:
            resident.discard(u)
            state -= act[u]
        high = max(high, state)

    def ensure(u: int) -> None:
        # the whole segment, in order, the first time one of its tensors is needed
        if u not in resident and u not in replay_at:
            for v in range(s, e + 1):
                if v not in replay_at:
                    replay(v)

    for k in range(n, S):
        i = S - 1 - k
        high = state
        inside = s <= i <= e
        for u in g.needs[i]:
            if inside:
                if u >= s and u <= e:
                    ensure(u)
                elif u < s and u in rec and i not in replay_at:
                    ensure(i)  # B(i) reads a saved value of another segment's unit: its own replay hands it back
            elif s <= u <= e and (i < s or i not in rec):
                ensure(u)
        steady[k] = high
        for u in [u for u in resident if g.last_use[u] == k]:
            resident.discard(u)
            state -= act[u]
        if inside:
            state -= held_now.pop(i, 0) + saved_now.pop(i, 0)
    extra = {k: p - steady[k] for k, p in peaks.items() if p > steady[k]}
    return _Segment(s, e, {}, replay_at, time, steady, extra, swap_inputs)


def _segment_host(g: _Graph, s: int, e: int) -> float:
    """The executor's host time for the segment s..e (replayed; tracked when a unit's glue lies
    outside it): the evaluator's rule."""
    if not g.drop_host:
        return 0.0
    tracked = any(sc is not None and (sc[0] < s or sc[1] > e or sc[0] < 0) for sc in g.glue_scope[s:e + 1])
    return (g.segment_host + sum(g.drop_host[s:e + 1])
            + (sum(g.tracked_host[s:e + 1]) if tracked else 0.0))


def _segment_key(seg: _Segment) -> Any:
    return (tuple(sorted(seg.replay_at.items())), tuple(sorted(seg.time.items())), seg.steady.tobytes(),
            tuple(sorted(seg.extra.items())), tuple(seg.swap_inputs))


def _segment_variants(g: _Graph, s: int, e: int, fixed: Dict[int, bool], can_rec: Sequence[bool],
                      max_vars: int) -> Optional[Tuple[List[_Segment], List[Tuple[int, int, int]]]]:
    """The segment s..e under every assignment of the outside units its replays depend on
    (readers after it that may be recomputed in another segment, which then hold what they read
    instead of having it replayed; units before it whose saved values its units read, whose
    recomputation makes such a unit's backward replay it), as a partition into cubes (conditions
    on some of those units) of identical behaviour. `fixed`: units whose action is known
    (maximality of runs). None if more than `max_vars` units matter.

    Also returns the saved values it holds when a unit before it that matters to nothing else is
    recomputed: (producer, holding unit, bytes), held from that unit's forward to the end of its
    backward (added to the segment's memory by a product of binaries; where the producer's
    unsaved values are held as well the model counts both: the evaluator holds one of them)."""
    dep: Set[int] = set()
    for u in range(s, e + 1):
        dep.update(i for i in g.readers[u] if i > e)
        dep.update(p for p in g.needs[u] if p < s)
    base = {p for p, v in fixed.items() if v}
    free = sorted(p for p in dep if p not in fixed and can_rec[p])
    if len(free) > max_vars:
        return None
    products: List[Tuple[int, int, int]] = []
    seen: Set[int] = set()
    for u in range(s, e + 1):
        for p, _ in g.held_from[u]:
            seen.add(p)
        for p, b in g.saved_from[u]:
            if p < s and p not in seen and p not in dep and p not in fixed and can_rec[p] and b > 0:
                products.append((p, u, b))
            seen.add(p)
    sims: Dict[Tuple[bool, ...], _Segment] = {}
    keys: Dict[Tuple[bool, ...], Any] = {}
    for bits in itertools.product((False, True), repeat=len(free)):
        seg = _simulate_segment(g, s, e, base | {p for p, b in zip(free, bits) if b})
        sims[bits] = seg
        keys[bits] = _segment_key(seg)
    out: List[_Segment] = []

    def split(prefix: Tuple[bool, ...]) -> None:
        j = len(prefix)
        group = [b for b in keys if b[:j] == prefix]
        if all(keys[b] == keys[group[0]] for b in group):
            seg = sims[group[0]]
            seg.cond = {p: v for p, v in zip(free, prefix)}
            out.append(seg)
            return
        split(prefix + (False,))
        split(prefix + (True,))

    split(())
    return out, products


# ------------------------------------------------------------------------------------------------
# Model building
# ------------------------------------------------------------------------------------------------


class _Model:
    """Columns and rows of a MILP, assembled as COO triplets."""

    def __init__(self) -> None:
        self.cost: List[float] = []
        self.lo: List[float] = []
        self.hi: List[float] = []
        self.integer: List[int] = []
        self.rows: List[Tuple[Dict[int, float], float, float]] = []

    def col(self, cost: float = 0.0, lo: float = 0.0, hi: float = 1.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, coefs: Dict[int, float], lo: float, hi: float) -> None:
        self.rows.append(({k: v for k, v in coefs.items() if v != 0.0}, lo, hi))

    @classmethod
    def from_parts(cls, m: "_Model", lo: List[float], hi: List[float]) -> "_Model":
        """`m` with other column bounds (the rows are shared)."""
        out = cls()
        out.cost, out.integer, out.rows = m.cost, m.integer, m.rows
        out.lo, out.hi = lo, hi
        return out


def _add(d: Dict[int, float], col: int, v: float) -> None:
    d[col] = d.get(col, 0.0) + v


@dataclass
class _Unit:
    r: int
    w: Optional[int]
    c: Optional[int]
    z: Dict[int, int] = field(default_factory=dict)  # release boundary b -> column
    y: Dict[int, int] = field(default_factory=dict)  # prefetch issue stage p -> column
    work_in: Dict[int, int] = field(default_factory=dict)  # stage -> prefetch copy work in it


def _swap_resident_terms(g: _Graph, U: Dict[int, _Unit], p: int, k: int) -> Dict[int, float]:
    """Linear expression: swapped unit p's activations are on the device at backward stage k (not
    yet released, prefetched, or after their first need)."""
    e: Dict[int, float] = {}
    v = U[p]
    lu = g.last_use[p]
    fn = g.first_need[p]
    assert lu is not None and fn is not None and v.w is not None
    for b, col in v.z.items():
        if k < b and k > g.busy_until[p]:
            _add(e, col, 1.0)
    if k <= fn:
        for q, col in v.y.items():
            if q <= k:
                _add(e, col, 1.0)
    elif k <= lu:
        _add(e, v.w, 1.0)
    return e


@dataclass
class _Segments:
    """The segment columns of a model: column -> segment, and per unit the columns covering it."""

    cols: Dict[int, _Segment] = field(default_factory=dict)
    covering: Dict[int, List[int]] = field(default_factory=dict)
    skipped: int = 0  # intervals left out (more outside units matter than max_vars)


def _intervals(g: _Graph, choose_starts: bool, max_segment: Optional[int]) -> List[Tuple[int, int]]:
    """Candidate segments [s, e]: with the default starts, the runs between two starts (at most
    `max_segment` units); choosing starts, every interval of at most `max_segment` units."""
    n = g.n
    L = n if max_segment is None else max_segment
    out = []
    for s in range(n):
        for e in range(s, min(n, s + L)):
            if e > s and not choose_starts and g.block_start[e]:
                break
            out.append((s, e))
    return out


def build(
    g: _Graph,
    budget: int,
    allow_swap: bool,
    allow_recompute: bool,
    lookahead: int,
    swap_window: int,
    choose_starts: bool = False,
    max_segment: Optional[int] = 16,
    max_vars: int = 8,
) -> Tuple[_Model, Dict[int, _Unit], _Segments, Dict[str, Any]]:
    """The MILP of `g` under `budget` bytes. Returns the model, the per-unit columns, the segment
    columns and sizes."""
    n, S = g.n, 2 * g.n
    m = _Model()
    dur = np.array(g.fwd + g.bwd[::-1], dtype=float)
    # Scaling for the solver: times in units of the mean stage, memory in units of budget / 1e4
    # (seconds and bytes side by side are 10 orders of magnitude apart).
    copies = [a / min(g.d2h, g.h2d) for a in g.act if a > 0]
    tu = max(float(dur.sum() / S), float(np.mean(copies)) if copies else 0.0)
    tu = tu if tu > 0 else 1.0
    mu = max(float(budget), 1.0) / 1e4
    g = replace(g, fwd=[t / tu for t in g.fwd], bwd=[t / tu for t in g.bwd], d2h=g.d2h * tu, h2d=g.h2d * tu,
                swap_host=[t / tu for t in g.swap_host], drop_host=[t / tu for t in g.drop_host],
                tracked_host=[t / tu for t in g.tracked_host], segment_host=g.segment_host / tu)
    dur = dur / tu
    # Memory that no action changes, per stage (what every plan has on the device then).
    base = np.full(S, float(g.constant))
    for u in range(n):
        # activations until the forward lets go of them (then what each action does with them),
        # an unsaved output until its last forward reader
        base[u : g.busy_until[u] + 1] += g.act[u]
        base[u : g.last_fwd[u] + 1] += 0 if g.out_saved[u] else g.out[u]
        base[u] += g.fwd_tr[u]
    grads = np.cumsum(np.array(g.grad[::-1], dtype=float))  # after B(n-1), B(n-2), ...
    base[n:] += grads + np.array(g.bwd_tr[::-1], dtype=float)
    mem: Dict[int, np.ndarray] = {}

    def memc(col: int) -> np.ndarray:
        if col not in mem:
            mem[col] = np.zeros(S)
        return mem[col]

    sigma = [m.col(cost=1.0, lo=0.0, hi=np.inf) for _ in range(S)]
    cap: List[Dict[int, float]] = [{sigma[s]: -1.0} for s in range(S)]  # work - extra <= dur
    own: List[Dict[int, float]] = [{sigma[s]: -1.0} for s in range(S)]  # own-need work <= sigma
    U: Dict[int, _Unit] = {}
    prefetch_rows: Dict[int, Dict[int, float]] = {}
    counts = {"swap_candidates": 0, "recompute_candidates": 0}
    for u in range(n):
        fn, lu, bu = g.first_need[u], g.last_use[u], g.busy_until[u]
        act = float(g.act[u])
        can_swap = allow_swap and g.act[u] > 0 and fn is not None and bu + 1 <= min(bu + 1 + swap_window, fn)
        can_recompute = allow_recompute and not g.no_recompute[u]
        if not can_swap and not can_recompute:
            # retained: resident after the forward until its last backward reader (as the retain
            # column below)
            base[bu + 1 : (S - 1 if lu is None else lu) + 1] += act
            continue
        r = m.col(integer=True)
        w = m.col(integer=True, cost=g.swap_host[u] if g.swap_host else 0.0) if can_swap else None
        c = m.col(integer=True) if can_recompute else None
        U[u] = _Unit(r=r, w=w, c=c)
        one = {r: 1.0}
        if w is not None:
            one[w] = 1.0
        if c is not None:
            one[c] = 1.0
        m.row(one, 1.0, 1.0)
        lin = lambda s: float(g.linger[u]) if s <= g.linger_until[u] else 0.0  # noqa: E731
        # Retain: resident after the forward until its last backward reader (to the end if none).
        memc(r)[bu + 1 : (S - 1 if lu is None else lu) + 1] += act
        if c is not None:
            # Recompute: dropped when the forward lets go of it (busy_until), but what the forward
            # still references after that; the rest (held inputs, the replay) is the segment's.
            counts["recompute_candidates"] += 1
            cm = memc(c)
            for s in range(bu + 1, S):
                cm[s] += lin(s)
        if w is not None:
            assert fn is not None and lu is not None
            p_lo, p_hi = max(fn - lookahead, n), fn
            b_lo, b_hi = bu + 1, min(bu + 1 + swap_window, fn)
            counts["swap_candidates"] += 1
            d, h = act / g.d2h, act / g.h2d
            U[u].z = {b: m.col(integer=True) for b in range(b_lo, b_hi + 1)}
            U[u].y = {p: m.col(integer=True) for p in range(p_lo, p_hi + 1)}
            m.row({**{col: 1.0 for col in U[u].z.values()}, w: -1.0}, 0.0, 0.0)
            m.row({**{col: 1.0 for col in U[u].y.values()}, w: -1.0}, 0.0, 0.0)
            order: Dict[int, float] = {}
            for b, col in U[u].z.items():
                _add(order, col, float(b))
            for p, col in U[u].y.items():
                _add(order, col, -float(p))
            m.row(order, -np.inf, 0.0)  # released before the prefetch is issued
            wm = memc(w)
            for s in range(bu + 1, S):
                wm[s] += lin(s)
            wm[fn + 1 : lu + 1] += act
            # Swap-out: on the device at stage k while not yet released (b > k); its copy works
            # in the stages before b, and at stage b itself only as a stall (the evaluator waits
            # for a queued swap-out when the stage does not fit).
            work_out: Dict[int, float] = {}
            for k in range(bu + 1, b_hi + 1):
                later = {col: 1.0 for b, col in U[u].z.items() if b > k}
                for col in later:
                    memc(col)[k] += act - lin(k)
                if later:
                    fa = m.col(lo=0.0, hi=d)
                    _add(cap[k], fa, 1.0)
                    m.row({fa: 1.0, **{col: -d for col in later}}, -np.inf, 0.0)
                    work_out[fa] = 1.0
                if k in U[u].z:
                    fs = m.col(lo=0.0, hi=d)
                    _add(cap[k], fs, 1.0)
                    _add(own[k], fs, 1.0)
                    m.row({fs: 1.0, U[u].z[k]: -d}, -np.inf, 0.0)
                    if k in U[u].y:  # a prefetch issued then would cancel the swap-out instead
                        m.row({fs: 1.0, U[u].y[k]: d}, -np.inf, d)
                    work_out[fs] = 1.0
            m.row({**work_out, w: -d}, 0.0, 0.0)
            # Prefetch: allocated from its issue stage on; its copy works from then to fn.
            work_in: Dict[int, float] = {}
            for k in range(p_lo, p_hi + 1):
                for p, col in U[u].y.items():
                    if p <= k:
                        memc(col)[k] += act
                gk = m.col(lo=0.0, hi=h)
                _add(cap[k], gk, 1.0)
                if k == fn:
                    _add(own[k], gk, 1.0)
                row = {gk: 1.0}
                for p, col in U[u].y.items():
                    if p <= k:
                        row[col] = -h
                m.row(row, -np.inf, 0.0)
                work_in[gk] = 1.0
                U[u].work_in[k] = gk
            prefetch_rows[u] = {**work_in, w: -h}  # = 0, or >= 0 when a replay prefetched it before (below)
    # Checkpoint segments: a column per candidate segment and behaviour (_segment_variants), the
    # units' recompute binaries the sum of the columns covering them.
    segs = _Segments()
    R: Dict[int, int] = {}  # stage -> the largest replay transient of a segment in it
    miss: Dict[Tuple[int, int, int, bool], List[int]] = {}
    if allow_recompute:
        can_rec = [u in U and U[u].c is not None for u in range(n)]
        for s, e in _intervals(g, choose_starts, max_segment):
            if not all(can_rec[u] for u in range(s, e + 1)):
                continue  # a unit of it cannot be recomputed (nor a segment containing it)
            fixed: Dict[int, bool] = {}
            if not choose_starts:  # a run is split only at a default start
                if s > 0 and not g.block_start[s]:
                    fixed[s - 1] = False
                if e + 1 < n and not g.block_start[e + 1]:
                    fixed[e + 1] = False
            found = _segment_variants(g, s, e, fixed, can_rec, max_vars)
            if found is None:
                segs.skipped += 1
                continue
            variants, products = found
            for seg in variants:
                x = m.col(integer=True, cost=sum(seg.time.values()) + _segment_host(g, s, e))
                segs.cols[x] = seg
                for u in range(s, e + 1):
                    segs.covering.setdefault(u, []).append(x)
                for p, v in {**fixed, **seg.cond}.items():
                    cp = U[p].c if p in U else None
                    if cp is None:
                        continue
                    m.row({x: 1.0, cp: -1.0} if v else {x: 1.0, cp: 1.0}, -np.inf, 0.0 if v else 1.0)
                memc(x)[:] += seg.steady
                for k, t in seg.time.items():
                    _add(cap[k], x, -t)  # the copy stream runs during the replays too
                for k, b in seg.extra.items():
                    if k not in R:
                        R[k] = m.col(lo=0.0, hi=np.inf)
                    m.row({R[k]: 1.0, x: -b / mu}, 0.0, np.inf)
                for u, p, k, gone in seg.swap_inputs:
                    if p in U and U[p].w is not None:
                        miss.setdefault((u, p, k, gone), []).append(x)
                for p, u, b in products:
                    cp = U[p].c
                    assert cp is not None
                    hp = m.col(lo=0.0, hi=1.0)
                    m.row({hp: 1.0, x: -1.0, cp: -1.0}, -1.0, np.inf)
                    memc(hp)[u : S - u] += b
        for u, v in U.items():
            if v.c is not None:
                m.row({v.c: 1.0, **{x: -1.0 for x in segs.covering.get(u, [])}}, 0.0, 0.0)
    # A swapped input that a replay needs and that is not on the device is prefetched then (a
    # stall; its bytes stay until its last reader, or leave after the replay when that has run).
    # One whose prefetch was issued before has to have arrived: what its copy still has to do
    # from the replay's stage on is a stall there. One prefetched by a replay before its own
    # prefetch stays on the device: that prefetch need not copy.
    synced: Dict[int, List[int]] = {}
    for (u, p, k, gone), xs in miss.items():
        vp = U[p]
        assert vp.w is not None
        fn_p, lu_p = g.first_need[p], g.last_use[p]
        assert fn_p is not None and lu_p is not None
        ms = m.col(cost=g.act[p] / g.h2d, lo=0.0, hi=1.0)
        row = {ms: 1.0, vp.w: -1.0, **{x: -1.0 for x in xs}}
        if not gone:
            for col, val in _swap_resident_terms(g, U, p, k).items():
                _add(row, col, val)
            memc(ms)[k : max(k, fn_p) + 1] += g.act[p]
            if k < min(vp.work_in, default=k):
                synced.setdefault(p, []).append(ms)
            late = {col: -1.0 for j, col in vp.work_in.items() if k <= j}
            if late and k < fn_p:
                h = g.act[p] / g.h2d
                t = m.col(lo=0.0, hi=h)
                m.row({t: 1.0, **late, **{x: -h for x in xs}}, -h, np.inf)
                _add(own[k], t, 1.0)
        m.row(row, -1.0, np.inf)
    for p, row in prefetch_rows.items():
        h = g.act[p] / g.h2d
        if p in synced:
            m.row(row, -np.inf, 0.0)
            m.row({**row, **{ms: h for ms in synced[p]}}, 0.0, np.inf)
        else:
            m.row(row, 0.0, 0.0)
    # Copy stream capacity per stage, and stalls for a prefetch still copying at its need.
    for s in range(S):
        m.row(cap[s], -np.inf, float(dur[s]))
        if len(own[s]) > 1:
            m.row(own[s], -np.inf, 0.0)
    # Memory per stage, written as differences between consecutive stages (sparse):
    # M_s - M_{s-1} - sum_j (a_js - a_j,s-1) x_j = base_s - base_{s-1}, M_s <= budget.
    M = [m.col(lo=-np.inf, hi=float(budget) / mu) for _ in range(S)]
    for k, col in R.items():
        m.row({M[k]: 1.0, col: 1.0}, -np.inf, float(budget) / mu)
    # The evaluator issues a prefetch at the first stage of its window where it fits: a later
    # issue stage p is chosen only if it did not fit at every earlier stage q of the window
    # (memory at q plus its bytes over the budget).
    # FIFO: a prefetch needed sooner that does not fit stops the issuing, so the rule is only
    # imposed at stages where no other swap candidate needed sooner is in its window.
    for u, v in U.items():
        for q in v.y:
            if any(
                o != u and U[o].y and q in U[o].y and (g.first_need[o], -o) < (g.first_need[u], -u)  # type: ignore[operator]
                for o in U
            ):
                continue
            later = {col: -(float(budget) + 1.0) / mu for p, col in v.y.items() if p > q}
            if later:
                m.row({M[q]: 1.0, **later}, -float(g.act[u]) / mu, np.inf)
    cols = np.array(list(mem.keys()), dtype=np.int64)
    A = np.stack([mem[c] for c in cols]) / mu if len(cols) else np.zeros((0, S))
    dA = np.diff(A, axis=1, prepend=0.0)
    dbase = np.diff(base / mu, prepend=0.0)
    for s in range(S):
        row = {M[s]: 1.0}
        if s > 0:
            row[M[s - 1]] = -1.0
        nz = np.nonzero(dA[:, s])[0]
        for j in nz:
            _add(row, int(cols[j]), -float(dA[j, s]))
        m.row(row, float(dbase[s]), float(dbase[s]))
    info = {"columns": len(m.cost), "rows": len(m.rows), "segments": len(segs.cols), "segments_skipped": segs.skipped,
            "time_unit": tu, "memory_unit": mu, "stage_memory": M, "transient": R, **counts}
    return m, U, segs, info


def _plan_columns(g: _Graph, U: Dict[int, _Unit], segs: _Segments, actions: Sequence[str], starts: Sequence[bool]) -> Optional[Dict[int, float]]:
    """The values of the action binaries and segment columns for a plan (`starts`: a flag per
    unit), or None if the model cannot express it (an action it does not have, or a segment it
    left out)."""
    n = g.n
    fixed: Dict[int, float] = {}
    for u in range(n):
        v = U.get(u)
        if v is None:
            if actions[u] != "retain":
                return None
            continue
        for col, a in ((v.r, "retain"), (v.w, "swap"), (v.c, "recompute")):
            if col is not None:
                fixed[col] = float(actions[u] == a)
            elif actions[u] == a:
                return None
    rec = {u for u in range(n) if actions[u] == "recompute"}
    runs: List[List[int]] = []
    for u in sorted(rec):
        if runs and runs[-1][1] == u - 1 and not starts[u]:
            runs[-1][1] = u
        else:
            runs.append([u, u])
    by_interval: Dict[Tuple[int, int], List[int]] = {}
    for col, seg in segs.cols.items():
        by_interval.setdefault((seg.s, seg.e), []).append(col)
        fixed[col] = 0.0
    for s, e in runs:
        match = [col for col in by_interval.get((s, e), []) if all((p in rec) == v for p, v in segs.cols[col].cond.items())]
        if len(match) != 1:
            return None
        fixed[match[0]] = 1.0
    return fixed


def _completion(m: _Model, fixed: Dict[int, float]) -> Tuple[Optional[np.ndarray], Dict[str, Any]]:
    """The best solution of the model with the columns in `fixed` fixed (an LP)."""
    lo, hi = list(m.lo), list(m.hi)
    for col, v in fixed.items():
        lo[col] = hi[col] = v
    return _solve(_Model.from_parts(m, lo, hi), 60.0, 0.0, 1)


# ------------------------------------------------------------------------------------------------
# Solving
# ------------------------------------------------------------------------------------------------


def _gap(obj: float, bound: float) -> float:
    """Relative optimality gap |objective - dual bound| / |objective| (0 when they agree)."""
    if not np.isfinite(bound):
        return float("inf")
    diff = abs(obj - bound)
    return 0.0 if diff <= 1e-12 * max(1.0, abs(obj)) else diff / max(abs(obj), 1e-12)


def _solve(m: _Model, time_limit: float, mip_gap: float, threads: int,
           start: Optional[np.ndarray] = None) -> Tuple[Optional[np.ndarray], Dict[str, Any]]:
    try:
        import highspy
    except ImportError as e:  # pragma: no cover - highspy is a dependency
        raise MilpError("the MILP methods need highspy (pip install highspy)") from e
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads > 0:
        h.setOptionValue("threads", int(threads))
        # HiGHS's thread scheduler is global to the process, made by the first solve with that
        # solve's thread count; a later solve that asks for another count fails (status "Not Set")
        # unless the scheduler is made again.
        reset = getattr(highspy.Highs, "resetGlobalScheduler", None)
        if reset is not None:
            reset(True)
    ncol = len(m.cost)
    lp = highspy.HighsLp()
    lp.num_col_ = ncol
    lp.num_row_ = len(m.rows)
    lp.col_cost_ = np.array(m.cost, dtype=float)
    lp.col_lower_ = np.array(m.lo, dtype=float)
    lp.col_upper_ = np.array(m.hi, dtype=float)
    lp.row_lower_ = np.array([r[1] for r in m.rows], dtype=float)
    lp.row_upper_ = np.array([r[2] for r in m.rows], dtype=float)
    ri: List[int] = []
    ci: List[int] = []
    vv: List[float] = []
    for i, (coefs, _, _) in enumerate(m.rows):
        for c, v in coefs.items():
            ri.append(i)
            ci.append(c)
            vv.append(v)
    r_a, c_a, v_a = np.array(ri, dtype=np.int32), np.array(ci, dtype=np.int32), np.array(vv, dtype=float)
    order = np.lexsort((r_a, c_a))
    r_a, c_a, v_a = r_a[order], c_a[order], v_a[order]
    col_start = np.searchsorted(c_a, np.arange(ncol + 1)).astype(np.int32)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = col_start
    lp.a_matrix_.index_ = r_a
    lp.a_matrix_.value_ = v_a
    lp.a_matrix_.num_col_ = ncol
    lp.a_matrix_.num_row_ = len(m.rows)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in m.integer]
    h.passModel(lp)
    if start is not None:
        h.setSolution(ncol, np.arange(ncol, dtype=np.int32), np.asarray(start, dtype=float))
    t0 = time.perf_counter()
    h.run()
    solve_time = time.perf_counter() - t0
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    sol = h.getSolution()
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.array(sol.col_value) if has else None
    res = {
        "status": status,
        "solve_time": solve_time,
        "objective": float(info.objective_function_value) if has else None,
        "dual_bound": float(info.mip_dual_bound),
        "gap": _gap(float(info.objective_function_value), float(info.mip_dual_bound)) if has else None,
        "nodes": int(info.mip_node_count),
    }
    return x, res


def _finite(v: Any) -> Any:
    """JSON-safe: non-finite floats (an unbounded dual bound) become None."""
    if isinstance(v, float):
        return v if np.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _decode(x: np.ndarray, g: _Graph, U: Dict[int, _Unit], segs: _Segments) -> Tuple[List[str], List[int]]:
    """The plan of a solution: an action per unit, and the starts of its segments."""
    actions = []
    for u in range(g.n):
        v = U.get(u)
        if v is None:
            actions.append("retain")
            continue
        vals = {"retain": x[v.r], "swap": x[v.w] if v.w is not None else -1.0, "recompute": x[v.c] if v.c is not None else -1.0}
        actions.append(max(vals, key=lambda a: vals[a]))
    starts = sorted({seg.s for col, seg in segs.cols.items() if x[col] > 0.5})
    return actions, starts


def _start(g: _Graph, m: _Model, U: Dict[int, _Unit], segs: _Segments, sizes: Dict[str, Any],
           seed: Optional[Dict[str, Any]]) -> Tuple[Optional[np.ndarray], Optional[float]]:
    """The model's solution for a seed plan (a plan dict, default segment starts), and its model
    step time; (None, None) if the model cannot express it or finds it over its budget."""
    if seed is None:
        return None, None
    fixed = _plan_columns(g, U, segs, seed["actions"], g.block_start)
    if fixed is None:
        return None, None
    x, res = _completion(m, fixed)
    if x is None:
        return None, None
    return x, res["objective"] * sizes["time_unit"] + _plan_independent_time(g)


def _check_settings(method: str, time_limit: float, swap_window: int, max_segment: Optional[int], max_vars: int,
                    mip_start: Optional[str] = None) -> None:
    if method not in MILP_METHODS:
        raise MilpError(f"unknown MILP method {method!r}; choose one of {', '.join(MILP_METHODS)}")
    if not time_limit > 0:
        raise MilpError(f"time_limit must be positive seconds, got {time_limit!r}")
    if swap_window < 1:
        raise MilpError(f"swap_window must be at least 1 stage, got {swap_window!r}")
    if max_segment is not None and max_segment < 1:
        raise MilpError(f"max_segment must be at least 1 unit (or None: no limit), got {max_segment!r}")
    if max_vars < 0:
        raise MilpError(f"max_vars must be at least 0, got {max_vars!r}")
    if mip_start not in (None, "pso"):
        raise MilpError(f"mip_start must be \"pso\" or None, got {mip_start!r}")


def _model_settings(sizes: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in sizes.items() if k not in ("stage_memory", "transient")}


def milp_plan(
    profile_text: str,
    budget: int,
    method: str = "milp",
    *,
    time_limit: float = 30.0,
    mip_gap: float = 1e-4,
    threads: int = 0,
    prefetch_lookahead: int = 2,
    swap_window: int = 10,
    choose_starts: bool = False,
    max_segment: Optional[int] = 16,
    max_vars: int = 8,
    mip_start: Optional[str] = "pso",
    retries: int = 3,
    fallback: bool = True,
) -> str:
    """Plan JSON for `profile_text` under `budget` bytes by solving the MILP of `method`.

    Checkpoint segments: with `choose_starts` False (the default), a run of recomputed units is
    split at the profile's default segment starts only, as for every other method; with True, the
    MILP chooses the plan's `segment_starts` too. `max_segment` limits a segment's units (None:
    no limit; with `choose_starts` it should be set: the model has a column per interval).
    `max_vars`: a candidate segment whose behaviour depends on more than this many units outside
    it is left out of the model (docs/methods.md). `mip_start="pso"`: HiGHS starts from PSO's
    plan (100 particles x 100 iterations, the plan the fallback below uses) where the model can
    express it and it fits the model's budget; None: from nothing.

    The plan is scored by the evaluator. If the evaluator finds it over the budget (the MILP is a
    linear approximation), the MILP is re-solved with its memory limit lowered by the evaluator's
    excess, up to `retries` times; then, with `fallback`, the best of PSO (100 x 100) is returned
    and the settings say so. Raises BudgetError (naming the smallest budget known to work) when no
    plan fits.
    """
    _check_settings(method, time_limit, swap_window, max_segment, max_vars, mip_start)
    _core.check_budget(profile_text, budget, prefetch_lookahead)
    g = _graph(profile_text)
    t0 = time.perf_counter()
    seed = _fallback(profile_text, budget, prefetch_lookahead) if mip_start == "pso" else None
    seed_time = time.perf_counter() - t0
    allow_swap = method in ("milp", "milp-swap")
    allow_recompute = method in ("milp", "milp-recompute")
    attempts: List[Dict[str, Any]] = []
    limit = budget
    build_time = 0.0
    common = {"time_limit": time_limit, "swap_window": swap_window, "choose_starts": choose_starts, "max_segment": max_segment,
              "max_vars": max_vars, "mip_start": mip_start, "start_time": seed_time}
    for attempt in range(retries + 1):
        t0 = time.perf_counter()
        m, U, segs, sizes = build(g, limit, allow_swap, allow_recompute, prefetch_lookahead, swap_window, choose_starts,
                                  max_segment, max_vars)
        build_time += time.perf_counter() - t0
        t0 = time.perf_counter()
        start, start_objective = _start(g, m, U, segs, sizes, seed)
        common["start_time"] += time.perf_counter() - t0
        x, res = _solve(m, time_limit, mip_gap, threads, start)
        res["model_budget"] = limit
        res["start_model_step_time"] = start_objective
        if res["objective"] is not None:
            res["objective"] *= sizes["time_unit"]
        res["dual_bound"] *= sizes["time_unit"]
        attempts.append(res)
        if x is None:
            break
        actions, starts = _decode(x, g, U, segs)
        seg_arg = starts if choose_starts else None
        out = json.loads(_core.evaluate(profile_text, actions, budget, prefetch_lookahead, seg_arg))
        res["evaluator_step_time"] = out["step_time"]
        res["evaluator_feasible"] = out["feasible"]
        if out["feasible"]:
            settings = {
                **common,
                "mip_gap_target": mip_gap,
                "solve_time": sum(a["solve_time"] for a in attempts),
                "build_time": build_time,
                "gap": res["gap"],
                "status": res["status"],
                "model_step_time": None if res["objective"] is None else res["objective"] + _plan_independent_time(g),
                "dual_bound": res["dual_bound"],
                "attempts": attempts,
                "model": _model_settings(sizes),
                "fallback": None,
                "eval": {"prefetch_lookahead": prefetch_lookahead},
            }

            def plan_text() -> str:
                return _core.plan_from_actions(profile_text, budget, actions, method, json.dumps(_finite(settings)),
                                               prefetch_lookahead, seg_arg)

            if attempt == 0 or not fallback:
                return plan_text()
            # A tightened model's plan may be far from the best: compare it with the fallback.
            alt = seed if mip_start == "pso" else _fallback(profile_text, budget, prefetch_lookahead)
            if alt is not None and alt["predicted"]["step_time"] < out["step_time"]:
                return _fallback_plan(alt, method, settings, "pso (particles 100, iterations 100): faster than the tightened MILP plan")
            settings["fallback"] = "none: the tightened MILP plan was faster than pso (particles 100, iterations 100)"
            return plan_text()
        limit = max(0, limit - int(out["excess"]) - max(1, budget // 10000))
    reason = attempts[-1]["status"] if attempts[-1].get("objective") is None else "plan over the budget in the evaluator"
    if not fallback:
        raise _core.BudgetError(
            f"the {method} MILP found no plan the evaluator accepts under {budget} bytes ({reason}); "
            "raise the budget or time_limit, or use method='pso'",
            budget,
        )
    plan = seed if seed is not None else _fallback(profile_text, budget, prefetch_lookahead, raise_error=True)
    assert plan is not None
    settings = {
        **common,
        "solve_time": sum(a["solve_time"] for a in attempts),
        "build_time": build_time,
        "gap": None,
        "attempts": attempts,
        "eval": {"prefetch_lookahead": prefetch_lookahead},
    }
    return _fallback_plan(plan, method, settings, f"pso (particles 100, iterations 100): {reason}")


def _fallback(profile_text: str, budget: int, lookahead: int, raise_error: bool = False) -> Optional[Dict[str, Any]]:
    """PSO's plan (100 particles x 100 iterations), or None if it finds none and not raise_error."""
    try:
        return json.loads(_core.make_plan(profile_text, budget, "pso", particles=100, iterations=100, prefetch_lookahead=lookahead))
    except _core.BudgetError:
        if raise_error:
            raise
        return None


def _fallback_plan(plan: Dict[str, Any], method: str, settings: Dict[str, Any], why: str) -> str:
    plan["method"] = method
    plan["settings"] = _finite({**settings, "gap": None, "fallback": why, "pso": plan.get("settings")})
    return json.dumps(plan)


def first_solve(profile_text: str, budget: int, method: str = "milp", *, time_limit: float = 30.0, mip_gap: float = 1e-4,
                threads: int = 0, prefetch_lookahead: int = 2, swap_window: int = 10, choose_starts: bool = False,
                max_segment: Optional[int] = 16, max_vars: int = 8, mip_start: Optional[str] = "pso") -> Dict[str, Any]:
    """The model's size and its first solve, without tightening or fallback (benches/milp_model_size.py)."""
    _check_settings(method, time_limit, swap_window, max_segment, max_vars, mip_start)
    g = _graph(profile_text)
    t0 = time.perf_counter()
    m, U, segs, sizes = build(g, budget, method in ("milp", "milp-swap"), method in ("milp", "milp-recompute"), prefetch_lookahead,
                              swap_window, choose_starts, max_segment, max_vars)
    build_time = time.perf_counter() - t0
    t0 = time.perf_counter()
    seed = _fallback(profile_text, budget, prefetch_lookahead) if mip_start == "pso" else None
    start, start_objective = _start(g, m, U, segs, sizes, seed)
    start_time = time.perf_counter() - t0
    x, res = _solve(m, time_limit, mip_gap, threads, start)
    rec: Dict[str, Any] = {"columns": len(m.cost), "rows": len(m.rows), "nonzeros": sum(len(r[0]) for r in m.rows),
                           "integers": sum(m.integer), "segments": sizes["segments"], "segments_skipped": sizes["segments_skipped"],
                           "build_time": build_time, "start_time": start_time, "start_model_step_time": start_objective,
                           "start_evaluator_step_time": seed["predicted"]["step_time"] if seed else None,
                           **{k: res[k] for k in ("status", "solve_time", "gap")}}
    if x is not None:
        actions, starts = _decode(x, g, U, segs)
        out = json.loads(_core.evaluate(profile_text, actions, budget, prefetch_lookahead, starts if choose_starts else None))
        rec.update(model_step_time=res["objective"] * sizes["time_unit"] + _plan_independent_time(g),
                   evaluator_step_time=out["step_time"], evaluator_feasible=out["feasible"],
                   multi_unit_segments=sum(1 for col, seg in segs.cols.items() if x[col] > 0.5 and seg.e > seg.s))
    return _finite(rec)


def model_of_plan(profile_text: str, actions: Sequence[str], segment_starts: Optional[Sequence[int]] = None, *,
                  prefetch_lookahead: int = 2, swap_window: int = 10, max_vars: int = 8) -> Dict[str, Any]:
    """What the linear model predicts for a plan (tests; docs/methods.md): the model with every
    action binary and segment column fixed to the plan (swap timing left to the solver), under a
    budget that does not bind. Returns `step_time` and `stage_peaks` (bytes per stage, F0 ..
    F(n-1), B(n-1) .. B0). `segment_starts`: None for the profile's defaults."""
    g = _graph(profile_text)
    n = g.n
    starts = g.block_start if segment_starts is None else [u in set(segment_starts) for u in range(n)]
    budget = 4 * (g.constant + sum(g.act) + sum(g.out) + sum(g.held) + sum(g.grad) + max(g.fwd_tr + g.bwd_tr + g.replay_extra + [0])
                  + sum(b for sf in g.saved_from for _, b in sf))
    m, U, segs, sizes = build(g, budget, "swap" in actions, True, prefetch_lookahead, swap_window, segment_starts is not None, None,
                              max_vars)
    fixed = _plan_columns(g, U, segs, actions, starts)
    if fixed is None:
        raise MilpError("the model cannot express this plan (an action a unit cannot take, or a segment left out)")
    x, res = _completion(m, fixed)
    if x is None:
        raise MilpError(f"the model has no solution for this plan ({res['status']})")
    mu = sizes["memory_unit"]
    peaks = [x[col] * mu for col in sizes["stage_memory"]]
    chosen = [seg for col, seg in segs.cols.items() if fixed[col] > 0.5]
    for k in sizes["transient"]:
        peaks[k] += max([seg.extra.get(k, 0.0) for seg in chosen] + [0.0])
    return {"step_time": res["objective"] * sizes["time_unit"] + _plan_independent_time(g), "stage_peaks": peaks}
