//! moDNN (Chen et al.) on tensorplace's cost model: sub-batch size selection with gradient
//! accumulation, offload only on allocation failure, prefetch timed by earliest start time
//! (docs/methods.md says how each rule was read).
//!
//! 1. **Sub-batch.** The profile is of the full batch B. For a sub-batch b, [`scale_profile`]
//!    scales activation bytes, transient bytes, input bytes and stage times by b / B (parameters,
//!    gradients, optimizer state and workspace stay). The candidates are the divisors of B that
//!    moDNN's power-of-two regularisation keeps (b <= 64: a power of two; b > 64: a multiple of
//!    64; B itself: no partitioning); the largest b whose every window of 15% of consecutive
//!    tasks fits the budget ([`window_peak`]) is tried first, then smaller ones until the schedule
//!    fits.
//! 2. **Offload on allocation failure.** Start from all-retain; at the first stage that does not
//!    fit, swap one retained tensor that is neither being produced nor read there (moDNN's
//!    "not used immediately"), the one whose swap-out would delay that stage least; keep it if
//!    the excess shrinks; repeat.
//! 3. **EST prefetch.** Each prefetch should start at the latest backward stage from which its
//!    copy (after the prefetches queued before it) still ends by the expected start time of the
//!    stage that needs it ([`est_lookahead`]); the evaluator takes one lookahead for all
//!    prefetches, the largest of these.

use super::capuchin::{alive_at, first_over};
use super::{bwd_stage, movable, stage_starts};
use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{evaluate_segments, EvalOptions, Outcome, Scratch};
use crate::peak::{lower_bound, unplanned_peak};
use crate::plan::{Plan, Predicted};
use crate::profile::{Graph, Profile};
use serde_json::json;

/// moDNN's window: 15% of the tasks (forward and backward stages).
pub const WINDOW_FRACTION: f64 = 0.15;

fn scale_bytes(x: i64, num: u64, den: u64) -> i64 {
    if x <= 0 {
        return x;
    }
    ((x as u128 * num as u128).div_ceil(den as u128)) as i64
}

/// The profile of a sub-batch of `sub` samples out of the profile's `batch` (activation,
/// transient, held, lingering and input bytes scaled by sub / batch, rounded up; times scaled;
/// parameters, gradients, optimizer state and workspace unchanged). With `accumulating`, the
/// step is a later sub-batch of gradient accumulation: every gradient is already on the device
/// (constant memory), and each backward stage's new gradient is a transient added into it.
pub fn scale_profile(p: &Profile, batch: u64, sub: u64, accumulating: bool) -> Profile {
    let mut q = p.clone();
    let f = sub as f64 / batch as f64;
    let s = |x: i64| scale_bytes(x, sub, batch);
    q.batch_size = Some(sub);
    q.measured = Default::default();
    // the optimizer step is not modelled for moDNN's sub-batches (docs/methods.md, "Not done")
    q.optimizer = None;
    q.memory.inputs = s(q.memory.inputs as i64) as u64;
    let mut grads: u64 = 0;
    for u in &mut q.units {
        u.fwd_time *= f;
        u.bwd_time *= f;
        u.act_bytes = s(u.act_bytes);
        u.output_bytes = s(u.output_bytes);
        u.held_input_bytes = s(u.held_input_bytes);
        u.fwd_transient_bytes = s(u.fwd_transient_bytes);
        u.bwd_transient_bytes = s(u.bwd_transient_bytes);
        u.replay_transient_bytes = u.replay_transient_bytes.map(s);
        u.lingering_bytes = u.lingering_bytes.map(s);
        for v in u.held_from.iter_mut().flatten().chain(u.saved_from.iter_mut().flatten()) {
            v[1] = s(v[1]);
        }
        for v in u.held_values.iter_mut().flatten().chain(u.saved_values.iter_mut().flatten()) {
            v[2] = s(v[2]);
        }
        let lingering = u.lingering_bytes.unwrap_or(0);
        for v in u.lingering_values.iter_mut().flatten() {
            v[1] = s(v[1]).min(lingering);
        }
        if accumulating {
            grads += u.grad_bytes.max(0) as u64;
            u.bwd_transient_bytes += u.grad_bytes;
            u.grad_bytes = 0;
        }
    }
    q.memory.workspace += grads;
    q
}

/// moDNN's sub-batch criterion on a (scaled) graph: the largest memory of any window of
/// ceil(15% x 2n) consecutive tasks (F0 .. F(n-1), B(n-1) .. B0): constant memory and every
/// gradient (moDNN keeps weights and their gradients on the device), the data the window's tasks
/// read or write counted once (a unit's activations, or its output when it is not saved), and
/// the largest transient (workspace) of the window.
pub fn window_peak(g: &Graph) -> u64 {
    let tasks = 2 * g.n;
    let w = ((WINDOW_FRACTION * tasks as f64).ceil() as usize).clamp(1, tasks);
    let block = |u: usize| if g.out_saved[u] { g.act[u] } else { g.out[u].max(g.act[u]) };
    // Per task: the units whose data it touches, and its workspace.
    let touched: Vec<(Vec<usize>, u64)> = (0..tasks)
        .map(|t| {
            if t < g.n {
                let mut v = g.inputs[t].clone();
                v.push(t);
                (v, g.fwd_transient[t])
            } else {
                let i = 2 * g.n - 1 - t;
                let mut v = g.needs[i].clone();
                v.push(i);
                (v, g.bwd_transient[i])
            }
        })
        .collect();
    let base = g.constant + g.grad.iter().sum::<u64>();
    let mut best = 0u64;
    let mut seen = vec![usize::MAX; g.n];
    for start in 0..=tasks - w {
        let (mut data, mut ws) = (0u64, 0u64);
        for (units, trans) in touched.iter().skip(start).take(w) {
            for &u in units {
                if seen[u] != start {
                    seen[u] = start;
                    data += block(u);
                }
            }
            ws = ws.max(*trans);
        }
        best = best.max(base + data + ws);
    }
    best
}

/// Sub-batch sizes moDNN considers for a batch of `batch`, largest first: the divisors b of the
/// batch that its power-of-two regularisation keeps (b <= 64: a power of two; b > 64: a multiple
/// of 64), and the batch itself (no partitioning).
pub fn candidates(batch: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (1..=batch)
        .rev()
        .filter(|&b| batch % b == 0)
        .filter(|&b| b == batch || (b <= 64 && b.is_power_of_two()) || (b > 64 && b % 64 == 0))
        .collect();
    v.dedup();
    v
}

/// EST prefetch timing: for every swapped unit in the order the backward needs it, the latest
/// backward stage at whose start its prefetch, queued behind the earlier ones, still completes
/// by the expected start of the stage that needs it (the stage starts of `o`, which carry every
/// delay so far); the earliest backward stage when no stage is late enough. Returns the largest
/// lead in stages (at least 1): the evaluator's `prefetch_lookahead`.
pub fn est_lookahead(g: &Graph, actions: &[Action], o: &Outcome) -> usize {
    let starts = stage_starts(o);
    let mut copy_free = starts[g.n];
    let mut lead = 1usize;
    for &u in &g.need_order {
        if actions[u] != Action::Swap {
            continue;
        }
        let Some(need) = g.first_need[u] else { continue };
        let ns = bwd_stage(g, need);
        let copy = g.act[u] as f64 / g.h2d;
        let k = (g.n..ns)
            .rev()
            .find(|&k| starts[k].max(copy_free) + copy <= starts[ns] + 1e-12)
            .unwrap_or(g.n);
        copy_free = starts[k].max(copy_free) + copy;
        lead = lead.max(ns - k);
    }
    lead
}

/// Offload on allocation failure, with EST prefetch timing, on a (sub-batch) graph. Returns the
/// actions and the lookahead they were evaluated with.
pub fn schedule(g: &Graph, budget: u64) -> (Vec<Action>, usize) {
    let mut actions = vec![Action::Retain; g.n];
    let mut scratch = Scratch::new(g.n);
    let starts_b = g.block_start.clone();
    let eval = |a: &[Action], l: usize, s: &mut Scratch| {
        evaluate_segments(g, a, &starts_b, budget, &EvalOptions { prefetch_lookahead: l, sync_swap_out: false }, s, true)
    };
    let mut lookahead = 1usize;
    let mut o = eval(&actions, lookahead, &mut scratch);
    let mut tried = vec![false; g.n];
    for _round in 0..2 * g.n + 2 {
        if o.feasible {
            break;
        }
        let s = first_over(g, &o, budget);
        let starts = stage_starts(&o);
        // Delay of swapping u: how far its swap-out, queued when its last forward reader ends,
        // runs past the start of the failing stage.
        let delay = |u: usize| (starts[g.last_fwd[u] + 1] + g.act[u] as f64 / g.d2h - starts[s]).max(0.0);
        let mut cands: Vec<usize> = (0..g.n)
            .filter(|&u| !tried[u] && actions[u] == Action::Retain && movable(g, u) && alive_at(g, u, s))
            .collect();
        cands.sort_by(|&a, &b| delay(a).total_cmp(&delay(b)).then(g.act[b].cmp(&g.act[a])).then(a.cmp(&b)));
        let mut changed = false;
        for u in cands {
            tried[u] = true;
            actions[u] = Action::Swap;
            let probe = eval(&actions, lookahead, &mut scratch);
            let l2 = est_lookahead(g, &actions, &probe);
            let o2 = if l2 == lookahead { probe } else { eval(&actions, l2, &mut scratch) };
            if o2.score().better_than(&o.score()) {
                o = o2;
                lookahead = l2;
                changed = true;
                break;
            }
            actions[u] = Action::Retain;
        }
        if !changed {
            // A failure moDNN would defragment away: nothing left to offload here.
            break;
        }
    }
    (actions, lookahead)
}

fn sum_predicted(first: &Outcome, later: &Outcome, k: u64) -> Predicted {
    let m = (k - 1) as f64;
    let mut p = Predicted::from_outcome(later);
    p.step_time = first.step_time + m * later.step_time;
    p.compute_time = first.compute_time + m * later.compute_time;
    p.swap_stall = first.swap_stall + m * later.swap_stall;
    p.recompute = first.recompute + m * later.recompute;
    p.copy_time = first.copy_time + m * later.copy_time;
    p.overlapped_copy = first.overlapped_copy + m * later.overlapped_copy;
    if first.peak_bytes > later.peak_bytes {
        p.peak_bytes = first.peak_bytes;
        p.peak_stage = first.peak_stage.label();
    }
    p.feasible = first.feasible && later.feasible;
    p.reason = later.reason.clone().or_else(|| first.reason.clone());
    p
}

fn sub_step_json(o: &Outcome) -> serde_json::Value {
    json!({"step_time": o.step_time, "compute_time": o.compute_time, "swap_stall": o.swap_stall,
           "copy_time": o.copy_time, "peak_bytes": o.peak_bytes, "peak_stage": o.peak_stage.label()})
}

/// The moDNN plan of `profile` (a full batch) under `budget` bytes: the sub-batch, its unit
/// actions and prefetch schedule, and the prediction per full step (the sum over sub-batches).
pub fn make_plan(profile: &Profile, budget: u64) -> Result<Plan> {
    let batch = profile.batch_size.filter(|&b| b >= 1).ok_or_else(|| {
        CoreError::InvalidSetting(
            "method \"modnn\" needs the profile's batch_size to choose a sub-batch; profile with \
             tensorplace.plan() (it records it) or set \"batch_size\" in the profile"
                .into(),
        )
    })?;
    profile.graph()?;
    let cands = candidates(batch);
    let graph_of = |b: u64, acc: bool| scale_profile(profile, batch, b, acc).graph();
    // The lower bound of any moDNN plan: the least over the sub-batches (a smaller sub-batch has
    // smaller activations but, accumulating, holds the gradients from its start; a small model's
    // whole batch can need less than its smallest sub-batch).
    // Per candidate sub-batch, the graph of its later sub-steps (gradients accumulating where the
    // batch is split) and its lower bound.
    let later: Vec<(Graph, u64)> = cands
        .iter()
        .map(|&b| {
            let g = graph_of(b, batch / b > 1)?;
            let l = lower_bound(&g).0;
            Ok((g, l))
        })
        .collect::<Result<_>>()?;
    let lb = later.iter().map(|&(_, l)| l).min().expect("1 divides every batch");
    // The smallest budget at which moDNN's schedule fits some sub-batch.
    let smallest_known = || -> Result<u64> {
        let mut best = u64::MAX;
        for (&b, (g, l)) in cands.iter().zip(&later) {
            best = best.min(smallest_budget(g, &graph_of(b, false)?, *l));
        }
        Ok(best)
    };
    if budget < lb {
        return Err(CoreError::BudgetBelowLowerBound { budget, lower_bound: lb, smallest_known: smallest_known()? });
    }
    // A window never needs more than the whole step: a sub-batch whose unplanned step fits is
    // taken even where the window sum (every gradient, data counted whole) is above the budget.
    let windows: Vec<(u64, u64)> =
        cands.iter().zip(&later).map(|(&b, (g, _))| (b, window_peak(g).min(unplanned_peak(g)))).collect();
    let first_fit = windows.iter().position(|&(_, w)| w <= budget).unwrap_or(windows.len() - 1);
    let mut tried_sizes = Vec::new();
    // moDNN's order: the largest sub-batch whose window fits, then smaller ones; then, where none
    // of those fits (their windows are estimates), the larger ones, so that a budget named as the
    // smallest known (smallest_known: the least over every sub-batch) is met
    let order = (first_fit..windows.len()).chain((0..first_fit).rev());
    for idx in order {
        let (b, wpeak) = windows[idx];
        let k = batch / b;
        let later_p = scale_profile(profile, batch, b, k > 1);
        let gl = later_p.graph()?;
        let (actions, lookahead) = schedule(&gl, budget);
        let opts = EvalOptions { prefetch_lookahead: lookahead, sync_swap_out: false };
        let later = evaluate_segments(&gl, &actions, &gl.block_start, budget, &opts, &mut Scratch::new(gl.n), true);
        let first = if k > 1 {
            let gf = graph_of(b, false)?;
            evaluate_segments(&gf, &actions, &gf.block_start, budget, &opts, &mut Scratch::new(gf.n), true)
        } else {
            later.clone()
        };
        tried_sizes.push(json!({"sub_batch": b, "window_peak": wpeak, "budget_fits_window": wpeak <= budget, "fits": first.feasible && later.feasible}));
        if !(first.feasible && later.feasible) {
            continue;
        }
        let larger = if idx > 0 { Some(windows[idx - 1]) } else { None };
        let settings = json!({
            "batch_size": batch, "sub_batch": b, "accumulation_steps": k,
            "window_fraction": WINDOW_FRACTION, "window_peak": wpeak, "budget_fits_window": wpeak <= budget,
            "next_larger": larger.map(|(b2, w2)| json!({"sub_batch": b2, "window_peak": w2})),
            "candidates": cands, "tried": tried_sizes,
            "scaling": "activation, transient, held, lingering and input bytes and stage times x sub_batch / batch_size; \
                        parameters, gradients, optimizer state and workspace unchanged",
            "sub_batch_profile_fingerprint": later_p.fingerprint(),
            "sub_steps": {"first": sub_step_json(&first), "later": sub_step_json(&later)},
            "eval": {"prefetch_lookahead": lookahead, "prefetch": "est"},
        });
        let mut plan = Plan::new(profile, budget, "modnn", settings, actions, &later);
        plan.predicted = sum_predicted(&first, &later, k);
        plan.segment_starts = (0..gl.n).filter(|&u| gl.block_start[u]).collect();
        return Ok(plan);
    }
    Err(CoreError::NoFeasiblePlan { budget, smallest_known: smallest_known()?, lower_bound: lb })
}

/// The smallest budget (to 0.001%) at which moDNN's schedule fits one sub-batch size (the graphs
/// of its later and its first sub-steps), by bisection between its lower bound `lb` and its
/// unplanned peak (where all-retain fits).
fn smallest_budget(glater: &Graph, gfirst: &Graph, lb: u64) -> u64 {
    let fits = |b: u64| {
        let (a, l) = schedule(glater, b);
        let opts = EvalOptions { prefetch_lookahead: l, sync_swap_out: false };
        [glater, gfirst]
            .iter()
            .all(|g| evaluate_segments(g, &a, &g.block_start, b, &opts, &mut Scratch::new(g.n), false).feasible)
    };
    let hi = unplanned_peak(glater).max(unplanned_peak(gfirst)).max(lb);
    if fits(lb) {
        return lb;
    }
    crate::peak::bisect(lb, hi, fits).unwrap_or(hi)
}
