"""Exact planning as a mixed-integer linear program, solved by HiGHS (``highspy``).

AutoTM's formulation (a flow graph per tensor over the stages, write-once host copies, a memory
constraint per stage, asynchronous copies overlapping compute) extended with Checkmate's
recomputation, written as a *linear model of tensorplace's cost model* (docs/cost-model.md).
docs/methods.md says exactly where the model departs from the evaluator; the evaluator scores
the resulting plan like any other.

Methods: ``milp`` (swap and recompute), ``milp-swap`` (AutoTM: swap only) and
``milp-recompute`` (Checkmate: recompute only).

Stages are numbered s = 0 .. 2n-1: forward F0 .. F(n-1) are 0 .. n-1, backward B(i) is 2n-1-i.
For a unit u that owns activations the model has binaries r_u, w_u, c_u (retain, swap,
recompute; one of them is 1), and for a swap:

- z[u, b]: the swap-out has left the device when stage b allocates (b in lf+1 .. lf+1+K, the
  copy is queued after u's last forward reader lf); the copy's work is split over the stages
  before b (continuous, f[u, k] <= d_u * [u still on the device at k]), and at stage b itself it
  is a stall (the evaluator waits for a queued swap-out when a stage does not fit);
- y[u, p]: the prefetch is issued at the start of stage p (within the evaluator's lookahead
  window before u's first backward reader fn); its work g[u, k] runs in stages p .. fn, and work
  at fn itself is a stall;
- write-once: one swap-out and one prefetch per unit, b <= p.

One copy stream: at every stage, the copy work placed in it is at most the stage's compute time
plus its recomputation plus its stall sigma_s. Recomputed units are replayed at their first
backward reader; an input a replay needs that is not resident then is replayed (or prefetched
synchronously) in a one-level chain. The objective is the step time: compute + recomputation +
stalls.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core

MILP_METHODS = ("milp", "milp-swap", "milp-recompute")


class MilpError(_core.PlannerError):
    """The MILP could not be built or solved (bad setting, solver missing)."""


# ------------------------------------------------------------------------------------------------
# Graph indexes (the same as rust_core/src/profile.rs Graph, written from docs/formats.md)
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
    fwd_tr: List[int]
    bwd_tr: List[int]
    grad: List[int]
    inputs: List[List[int]]
    replay_inputs: List[List[int]]
    replay_extra: List[int]
    linger: List[int]
    linger_until: List[int]  # stage index (inclusive) until which lingering bytes stay
    last_fwd: List[int]
    first_need: List[Optional[int]]  # stage index of the first backward reader
    last_use: List[Optional[int]]  # stage index of the last backward reader


def _graph(profile: Dict[str, Any]) -> _Graph:
    units = profile["units"]
    n = len(units)
    S = 2 * n
    inputs = [sorted(set(int(p) for p in u.get("inputs", []))) for u in units]
    out_saved = [bool(u.get("output_saved", True)) for u in units]
    replay_inputs = []
    for u, ins in zip(units, inputs):
        if u.get("saved_inputs") is not None:
            replay_inputs.append(sorted(set(int(p) for p in u["saved_inputs"])))
        else:
            replay_inputs.append([p for p in ins if out_saved[p]])
    last_fwd = list(range(n))
    for i, ins in enumerate(inputs):
        for p in ins:
            last_fwd[p] = max(last_fwd[p], i)
    first_need: List[Optional[int]] = []
    last_use: List[Optional[int]] = []
    for u in units:
        rb = sorted(set(int(r) for r in u.get("read_by", [])))
        first_need.append(S - 1 - rb[-1] if rb else None)
        last_use.append(S - 1 - rb[0] if rb else None)
    linger = [0] * n
    linger_until = list(last_fwd)
    for i, u in enumerate(units):
        b = int(u.get("lingering_bytes") or 0)
        t = int(u.get("lingering_until") or 0)
        if b > 0 and t > last_fwd[i]:
            linger[i] = b
            linger_until[i] = t if t < n else S - 1  # the evaluator never lets go of them then
    replay_extra = []
    for u in units:
        if u.get("replay_transient_bytes") is not None:
            replay_extra.append(int(u["replay_transient_bytes"]))
        else:
            replay_extra.append((0 if u.get("output_saved", True) else int(u.get("output_bytes", 0))) + int(u.get("fwd_transient_bytes", 0)))
    g = lambda key: [int(u.get(key, 0)) for u in units]  # noqa: E731
    return _Graph(
        n=n,
        constant=int(sum(profile.get("memory", {}).values())),
        d2h=float(profile["d2h_bandwidth"]),
        h2d=float(profile["h2d_bandwidth"]),
        fwd=[float(u["fwd_time"]) for u in units],
        bwd=[float(u["bwd_time"]) for u in units],
        act=g("act_bytes"),
        out=g("output_bytes"),
        out_saved=out_saved,
        held=g("held_input_bytes"),
        fwd_tr=g("fwd_transient_bytes"),
        bwd_tr=g("bwd_transient_bytes"),
        grad=g("grad_bytes"),
        inputs=inputs,
        replay_inputs=replay_inputs,
        replay_extra=replay_extra,
        linger=linger,
        linger_until=linger_until,
        last_fwd=last_fwd,
        first_need=first_need,
        last_use=last_use,
    )


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


def _add(d: Dict[int, float], col: int, v: float) -> None:
    d[col] = d.get(col, 0.0) + v


@dataclass
class _Unit:
    r: int
    w: Optional[int]
    c: Optional[int]
    z: Dict[int, int] = field(default_factory=dict)  # release boundary b -> column
    y: Dict[int, int] = field(default_factory=dict)  # prefetch issue stage p -> column


def _resident_terms(g: _Graph, U: Dict[int, _Unit], p: int, k: int) -> Dict[int, float]:
    """Linear expression: unit p's activations are resident at backward stage k (before any
    replay chain touches them)."""
    e: Dict[int, float] = {}
    v = U[p]
    lu = g.last_use[p]
    fn = g.first_need[p]
    assert lu is not None and fn is not None
    if k <= lu:
        _add(e, v.r, 1.0)
    if v.c is not None and fn <= k <= lu:
        _add(e, v.c, 1.0)
    if v.w is not None:
        for b, col in v.z.items():
            if k < b and k > g.last_fwd[p]:
                _add(e, col, 1.0)
        if k <= fn:
            for q, col in v.y.items():
                if q <= k:
                    _add(e, col, 1.0)
        elif k <= lu:
            _add(e, v.w, 1.0)
    return e


def build(
    g: _Graph,
    budget: int,
    allow_swap: bool,
    allow_recompute: bool,
    lookahead: int,
    swap_window: int,
) -> Tuple[_Model, Dict[int, _Unit], Dict[str, Any]]:
    """The MILP of `g` under `budget` bytes. Returns the model, the per-unit columns and sizes."""
    n, S = g.n, 2 * g.n
    m = _Model()
    dur = np.array(g.fwd + g.bwd[::-1], dtype=float)
    # Scaling for the solver: times in units of the mean stage, memory in units of budget / 1e4
    # (seconds and bytes side by side are 10 orders of magnitude apart).
    copies = [a / min(g.d2h, g.h2d) for a in g.act if a > 0]
    tu = max(float(dur.sum() / S), float(np.mean(copies)) if copies else 0.0)
    tu = tu if tu > 0 else 1.0
    mu = max(float(budget), 1.0) / 1e4
    g = replace(g, fwd=[t / tu for t in g.fwd], bwd=[t / tu for t in g.bwd], d2h=g.d2h * tu, h2d=g.h2d * tu)
    dur = dur / tu
    # Memory that no action changes, per stage (what every plan has on the device then).
    base = np.full(S, float(g.constant))
    for u in range(n):
        lf = g.last_fwd[u]
        base[u : lf + 1] += g.act[u] + (0 if g.out_saved[u] else g.out[u])
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
    counts = {"swap_candidates": 0, "recompute_candidates": 0}
    for u in range(n):
        if g.act[u] == 0 or g.first_need[u] is None:
            continue
        lf, fn, lu = g.last_fwd[u], g.first_need[u], g.last_use[u]
        assert fn is not None and lu is not None
        act = float(g.act[u])
        r = m.col(integer=True)
        p_lo, p_hi = max(fn - lookahead, n), fn
        b_lo, b_hi = lf + 1, min(lf + 1 + swap_window, fn)
        can_swap = allow_swap and b_lo <= b_hi
        w = m.col(integer=True) if can_swap else None
        c = m.col(integer=True, cost=g.fwd[u]) if allow_recompute else None
        U[u] = _Unit(r=r, w=w, c=c)
        one = {r: 1.0}
        if w is not None:
            one[w] = 1.0
        if c is not None:
            one[c] = 1.0
        m.row(one, 1.0, 1.0)
        lin = lambda s: float(g.linger[u]) if s <= g.linger_until[u] else 0.0  # noqa: E731
        # Retain: resident after the forward until its last backward reader.
        memc(r)[lf + 1 : lu + 1] += act
        if c is not None:
            counts["recompute_candidates"] += 1
            cm = memc(c)
            for s in range(lf + 1, S):
                cm[s] += lin(s)
            cm[fn : lu + 1] += act - np.array([lin(s) for s in range(fn, lu + 1)])
            cm[u : fn + 1] += g.held[u]
            cm[fn] += g.replay_extra[u]
            _add(cap[fn], c, -g.fwd[u])  # the copy stream runs during the replay too
        if w is not None:
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
            for s in range(lf + 1, S):
                wm[s] += lin(s)
            wm[fn + 1 : lu + 1] += act - np.array([lin(s) for s in range(fn + 1, lu + 1)])
            # Swap-out: on the device at stage k while not yet released (b > k); its copy works
            # in the stages before b, and at stage b itself only as a stall (the evaluator waits
            # for a queued swap-out when the stage does not fit).
            work_out: Dict[int, float] = {}
            for k in range(lf + 1, b_hi + 1):
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
                        memc(col)[k] += act - lin(k)
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
            m.row({**work_in, w: -h}, 0.0, 0.0)
    # Replay chains: an input a replay needs that is not resident is replayed (or prefetched)
    # first, one level deep.
    chains = 0
    for u, v in U.items():
        if v.c is None:
            continue
        k = g.first_need[u]
        assert k is not None
        for p in g.replay_inputs[u]:
            if g.act[p] == 0 or p not in U:
                continue
            res = _resident_terms(g, U, p, k)
            vp = U[p]
            lu_p, fn_p = g.last_use[p], g.first_need[p]
            assert lu_p is not None and fn_p is not None
            stays = range(k, max(k, fn_p) + 1) if lu_p >= k else range(k, k + 1)
            # missR >= c_u + (r_p + c_p) - 1 - resident_{retain, recompute}
            missR = m.col(cost=g.fwd[p], lo=0.0, hi=1.0)
            row = {missR: 1.0}
            _add(row, v.c, -1.0)
            _add(row, vp.r, -1.0)
            if vp.c is not None:
                _add(row, vp.c, -1.0)
            for col, val in res.items():
                if col == vp.r or col == vp.c:
                    _add(row, col, val)
            m.row(row, -1.0, np.inf)
            _add(cap[k], missR, -g.fwd[p])
            mm = memc(missR)
            for s in stays:
                mm[s] += g.act[p]
            mm[k] += g.replay_extra[p]
            # one level only: the chained replay's own inputs must be resident
            for q in g.replay_inputs[p]:
                if g.act[q] == 0 or q not in U:
                    continue
                rq = _resident_terms(g, U, q, k)
                m.row({missR: 1.0, **{col: -val for col, val in rq.items()}}, -np.inf, 0.0)
            chains += 1
            if vp.w is not None:
                missS = m.col(cost=g.act[p] / g.h2d, lo=0.0, hi=1.0)
                row = {missS: 1.0}
                _add(row, v.c, -1.0)
                _add(row, vp.w, -1.0)
                for col, val in res.items():
                    if col != vp.r and col != vp.c:
                        _add(row, col, val)
                m.row(row, -1.0, np.inf)
                ms = memc(missS)
                for s in stays:
                    ms[s] += g.act[p]
    # Copy stream capacity per stage, and stalls for a prefetch still copying at its need.
    for s in range(S):
        m.row(cap[s], -np.inf, float(dur[s]))
        if len(own[s]) > 1:
            m.row(own[s], -np.inf, 0.0)
    # Memory per stage, written as differences between consecutive stages (sparse):
    # M_s - M_{s-1} - sum_j (a_js - a_j,s-1) x_j = base_s - base_{s-1}, M_s <= budget.
    M = [m.col(lo=-np.inf, hi=float(budget) / mu) for _ in range(S)]
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
    info = {"columns": len(m.cost), "rows": len(m.rows), "chains": chains, "time_unit": tu, **counts}
    return m, U, info


# ------------------------------------------------------------------------------------------------
# Solving
# ------------------------------------------------------------------------------------------------


def _gap(obj: float, bound: float) -> float:
    """Relative optimality gap |objective - dual bound| / |objective| (0 when they agree)."""
    if not np.isfinite(bound):
        return float("inf")
    diff = abs(obj - bound)
    return 0.0 if diff <= 1e-12 * max(1.0, abs(obj)) else diff / max(abs(obj), 1e-12)


def _solve(m: _Model, time_limit: float, mip_gap: float, threads: int) -> Tuple[Optional[np.ndarray], Dict[str, Any]]:
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
    start = np.searchsorted(c_a, np.arange(ncol + 1)).astype(np.int32)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = r_a
    lp.a_matrix_.value_ = v_a
    lp.a_matrix_.num_col_ = ncol
    lp.a_matrix_.num_row_ = len(m.rows)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in m.integer]
    h.passModel(lp)
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
    retries: int = 3,
    fallback: bool = True,
) -> str:
    """Plan JSON for `profile_text` under `budget` bytes by solving the MILP of `method`.

    The plan is scored by the evaluator. If the evaluator finds it over the budget (the MILP is a
    linear approximation), the MILP is re-solved with its memory limit lowered by the evaluator's
    excess, up to `retries` times; then, with `fallback`, the best of PSO (100 x 100) is returned
    and the settings say so. Raises BudgetError (naming the smallest budget known to work) when no
    plan fits.
    """
    if method not in MILP_METHODS:
        raise MilpError(f"unknown MILP method {method!r}; choose one of {', '.join(MILP_METHODS)}")
    if not time_limit > 0:
        raise MilpError(f"time_limit must be positive seconds, got {time_limit!r}")
    if swap_window < 1:
        raise MilpError(f"swap_window must be at least 1 stage, got {swap_window!r}")
    _core.check_budget(profile_text, budget, prefetch_lookahead)
    profile = json.loads(profile_text)
    g = _graph(profile)
    allow_swap = method in ("milp", "milp-swap")
    allow_recompute = method in ("milp", "milp-recompute")
    attempts: List[Dict[str, Any]] = []
    limit = budget
    build_time = 0.0
    for attempt in range(retries + 1):
        t0 = time.perf_counter()
        m, U, sizes = build(g, limit, allow_swap, allow_recompute, prefetch_lookahead, swap_window)
        build_time += time.perf_counter() - t0
        x, res = _solve(m, time_limit, mip_gap, threads)
        res["model_budget"] = limit
        if res["objective"] is not None:
            res["objective"] *= sizes["time_unit"]
        res["dual_bound"] *= sizes["time_unit"]
        attempts.append(res)
        if x is None:
            break
        actions = []
        for u in range(g.n):
            v = U.get(u)
            if v is None:
                actions.append("retain")
                continue
            vals = {"retain": x[v.r], "swap": x[v.w] if v.w is not None else -1.0, "recompute": x[v.c] if v.c is not None else -1.0}
            actions.append(max(vals, key=lambda a: vals[a]))
        out = json.loads(_core.evaluate(profile_text, actions, budget, prefetch_lookahead))
        res["evaluator_step_time"] = out["step_time"]
        res["evaluator_feasible"] = out["feasible"]
        if out["feasible"]:
            settings = {
                "time_limit": time_limit,
                "mip_gap_target": mip_gap,
                "swap_window": swap_window,
                "solve_time": sum(a["solve_time"] for a in attempts),
                "build_time": build_time,
                "gap": res["gap"],
                "status": res["status"],
                "model_step_time": None if res["objective"] is None else res["objective"] + sum(g.fwd) + sum(g.bwd),
                "dual_bound": res["dual_bound"],
                "attempts": attempts,
                "model": sizes,
                "fallback": None,
                "eval": {"prefetch_lookahead": prefetch_lookahead},
            }
            text = _core.plan_from_actions(profile_text, budget, actions, method, json.dumps(_finite(settings)), prefetch_lookahead)
            if attempt == 0 or not fallback:
                return text
            # A tightened model's plan may be far from the best: compare it with the fallback.
            alt = _fallback(profile_text, budget, prefetch_lookahead)
            if alt is not None and alt["predicted"]["step_time"] < out["step_time"]:
                return _fallback_plan(alt, method, settings, "pso (particles 100, iterations 100): faster than the tightened MILP plan")
            settings["fallback"] = "none: the tightened MILP plan was faster than pso (particles 100, iterations 100)"
            return _core.plan_from_actions(profile_text, budget, actions, method, json.dumps(_finite(settings)), prefetch_lookahead)
        limit = max(0, limit - int(out["excess"]) - max(1, budget // 10000))
    reason = attempts[-1]["status"] if attempts[-1].get("objective") is None else "plan over the budget in the evaluator"
    if not fallback:
        raise _core.BudgetError(
            f"the {method} MILP found no plan the evaluator accepts under {budget} bytes ({reason}); "
            "raise the budget or time_limit, or use method='pso'",
            budget,
        )
    plan = _fallback(profile_text, budget, prefetch_lookahead, raise_error=True)
    assert plan is not None
    settings = {
        "time_limit": time_limit,
        "swap_window": swap_window,
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
