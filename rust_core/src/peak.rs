//! Memory-peak analysis: the peak of a plan and where it occurs, the lower bound of any plan
//! (moDNN's per-task bound), and the smallest budget a simple plan is known to meet.

use crate::action::Action;
use crate::evaluator::{evaluate, evaluate_with_swaps, EvalOptions, Outcome, Scratch, Stage, StateSwaps};
use crate::profile::Graph;

/// The peak of `actions` with no budget pressure (nothing waits for memory).
pub fn plan_peak(g: &Graph, actions: &[Action], opts: &EvalOptions) -> Outcome {
    evaluate(g, actions, u64::MAX, opts, &mut Scratch::new(g.n), true)
}

/// The unplanned peak: every unit retained.
pub fn unplanned_peak(g: &Graph) -> u64 {
    plan_peak(g, &vec![Action::Retain; g.n], &EvalOptions::default()).peak_bytes
}

/// A lower bound on the peak of any plan: for every stage, what must be on the device while it
/// runs whatever the actions are; the bound is the largest of these (moDNN, section 5.1.1).
///
/// Forward of unit i: constant memory, i's own new bytes and transient, the outputs of its
/// inputs (as whole activations when saved, since activations move as one), and unsaved outputs
/// of earlier units still waiting for a later reader. Backward of unit i: constant memory, the
/// gradients produced so far, the stage's transient, and the activations the stage reads.
/// The optimizer step (a profile with one): constant memory, every gradient and its transient.
pub fn lower_bound(g: &Graph) -> (u64, Stage) {
    bound(g, false)
}

/// The lower bound of plans that may also keep parameters and optimizer state on the host
/// between steps (crate::state_swap): as [`lower_bound`], less the optimizer state of every unit
/// except the one an optimizer stage updates, and less the parameters of units whose forward
/// has not run yet (in the forward) or whose optimizer stage has run (in the optimizer stages).
/// A plan that swaps nothing runs the optimizer step in one call: the smaller of the two bounds.
pub fn lower_bound_with_state_swaps(g: &Graph) -> (u64, Stage) {
    let (a, b) = (bound(g, true), bound(g, false));
    if a.0 <= b.0 { a } else { b }
}

fn bound(g: &Graph, swapping: bool) -> (u64, Stage) {
    let states: u64 = if swapping { g.opt_state.iter().sum() } else { 0 };
    let params_total: u64 = if swapping { g.param.iter().sum() } else { 0 };
    let mut best = (g.constant - states - params_total, Stage::Start);
    let mut live_unsaved: u64 = 0; // unsaved outputs alive across the stage boundary
    let mut params_in = 0u64; // parameters of units whose forward has run (or runs now)
    for i in 0..g.n {
        params_in += if swapping { g.param[i] } else { 0 };
        let base = g.constant - states - (params_total - params_in);
        let mut need = base + g.act[i] + g.fwd_transient[i];
        if !g.out_saved[i] {
            need += g.out[i];
        }
        let mut inputs_bytes = 0u64;
        for &p in &g.inputs[i] {
            inputs_bytes += if g.out_saved[p] { g.act[p] } else { g.out[p] };
        }
        // Unsaved outputs of inputs are already in `live_unsaved`; do not count them twice.
        let unsaved_inputs: u64 = g.inputs[i].iter().filter(|&&p| !g.out_saved[p]).map(|&p| g.out[p]).sum();
        need += inputs_bytes + live_unsaved - unsaved_inputs;
        if need > best.0 {
            best = (need, Stage::Fwd(i));
        }
        if !g.out_saved[i] && g.last_fwd[i] > i {
            live_unsaved += g.out[i];
        }
        for &u in &g.releases_after_fwd[i] {
            if u != i && !g.out_saved[u] {
                live_unsaved -= g.out[u];
            }
        }
    }
    let mut grads: u64 = 0;
    for i in (0..g.n).rev() {
        grads += g.grad[i];
        let reads: u64 = g.needs[i].iter().map(|&u| g.act[u]).sum();
        // the stage's own transient, or the loss's backward before it (without its gradients)
        let need = g.constant - states + reads + (grads + g.bwd_transient[i]).max(grads - g.grad[i] + g.loss_transient[i]);
        if need > best.0 {
            best = (need, Stage::Bwd(i));
        }
    }
    if g.has_optimizer && !swapping {
        let need = g.constant + grads + g.opt_step_transient;
        if need > best.0 {
            best = (need, Stage::OptStep);
        }
    }
    let mut params_out = 0u64; // parameters of units whose optimizer stage has run
    let chunks: &[usize] = if swapping { &g.opt_order } else { &[] };
    for &u in chunks {
        let (_, transient) = g.opt_stage(u);
        let state = if swapping && u < g.n { g.opt_state[u] } else { 0 };
        let need = g.constant - states + state - params_out + grads + transient;
        if need > best.0 {
            best = (need, Stage::Opt(u));
        }
        if swapping && u < g.n {
            params_out += g.param[u];
        }
    }
    best
}

/// The smallest budget that one of the simple plans (all swap, all recompute) meets, found by
/// bisection on the budget, with that plan. Always feasible at the unplanned peak.
pub fn smallest_known_budget(g: &Graph, opts: &EvalOptions) -> (u64, Vec<Action>) {
    let (lb, _) = lower_bound(g);
    let hi0 = unplanned_peak(g);
    let mut scratch = Scratch::new(g.n);
    let mut best = (hi0, vec![Action::Retain; g.n]);
    for a in [Action::Swap, Action::Recompute] {
        let plan = vec![a; g.n];
        if let Some(b) = bisect(lb, best.0, |b| evaluate(g, &plan, b, opts, &mut scratch, false).feasible) {
            if b < best.0 {
                best = (b, plan);
            }
        }
    }
    best
}

/// The smallest budget (to 0.001%) between the lower bound and the unplanned peak at which
/// `actions` is feasible, or None.
pub fn smallest_budget_of(g: &Graph, actions: &[Action], opts: &EvalOptions) -> Option<u64> {
    let mut s = Scratch::new(g.n);
    bisect(lower_bound(g).0, unplanned_peak(g), |b| evaluate(g, actions, b, opts, &mut s, false).feasible)
}

/// The smallest budget in [lo, hi] at which `feasible` holds, by bisection to 0.001% (None if it
/// does not hold at `hi`; more memory is assumed never to hurt).
pub fn bisect(lo: u64, hi: u64, mut feasible: impl FnMut(u64) -> bool) -> Option<u64> {
    if !feasible(hi) {
        return None;
    }
    let (mut lo, mut hi) = (lo.saturating_sub(1), hi);
    while hi - lo > 1.max(hi / 100_000) {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

/// [`smallest_known_budget`] for plans that may also keep parameters and optimizer state on the
/// host between steps: the simple plans with nothing or everything swapped across iterations.
pub fn smallest_known_budget_with_swaps(g: &Graph, opts: &EvalOptions) -> (u64, Vec<Action>, StateSwaps) {
    let (lb, _) = lower_bound_with_state_swaps(g);
    let (hi0, plan0) = smallest_known_budget(g, opts);
    let mut best = (hi0, plan0, StateSwaps::none());
    let all = StateSwaps::all(g);
    if !all.any(g) {
        return best;
    }
    let mut scratch = Scratch::new(g.n);
    for a in [Action::Retain, Action::Swap, Action::Recompute] {
        let plan = vec![a; g.n];
        let feasible =
            |b: u64| evaluate_with_swaps(g, &plan, &g.block_start, &all, b, opts, &mut scratch, false).feasible;
        if let Some(b) = bisect(lb, best.0, feasible) {
            if b < best.0 {
                best = (b, plan, all.clone());
            }
        }
    }
    best
}
