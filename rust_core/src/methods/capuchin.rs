//! Capuchin (Peng et al.), as HOME describes it: decisions are taken in execution order, each
//! with only the tensors produced so far. Walk the step; at the first stage over the budget, pick
//! among the retained tensors produced up to there and alive at that stage: a swap whose copies
//! hide in its free time (largest free time first); if none can hide, the tensor and action with
//! the best memory saving per second of overhead (MSPS: swap overhead is the part of the copies
//! that does not fit in the free time, recompute overhead the replay, chained one level). Repeat
//! until the step fits.

use super::{bwd_stage, movable, recompute_time, stage_starts};
use crate::action::Action;
use crate::evaluator::{evaluate, EvalOptions, Outcome, Scratch};
use crate::profile::Graph;

/// Stage index of the first stage whose peak is over the budget (the peak stage if none is).
pub(crate) fn first_over(g: &Graph, o: &Outcome, budget: u64) -> usize {
    o.curve.iter().position(|c| c.peak > budget).unwrap_or_else(|| g.stage_index(o.peak_stage))
}

/// Whether unit u's activations (retained) are on the device during stage index s, and could
/// leave then (not being produced or read by that very stage).
pub(crate) fn alive_at(g: &Graph, u: usize, s: usize) -> bool {
    let (Some(need), Some(lu)) = (g.first_need[u], g.last_use[u]) else { return false };
    let (need_s, lu_s) = (bwd_stage(g, need), bwd_stage(g, lu));
    s > g.last_fwd[u] && s < need_s && s <= lu_s
}

/// Free time of a swap of u in a timeline: from the end of its last forward reader to the start
/// of its first backward reader, minus both copies.
pub(crate) fn free_time(g: &Graph, starts: &[f64], u: usize) -> f64 {
    let need = bwd_stage(g, g.first_need[u].unwrap_or(0));
    starts[need] - starts[g.last_fwd[u] + 1] - g.act[u] as f64 / g.d2h - g.act[u] as f64 / g.h2d
}

pub fn plan(g: &Graph, budget: u64, opts: &EvalOptions) -> Vec<Action> {
    let mut actions = vec![Action::Retain; g.n];
    let mut scratch = Scratch::new(g.n);
    for _round in 0..2 * g.n {
        let o = evaluate(g, &actions, budget, opts, &mut scratch, true);
        if o.feasible {
            break;
        }
        let s = first_over(g, &o, budget);
        let starts = stage_starts(&o);
        let upto = s.min(g.n - 1);
        let cands: Vec<usize> = (0..=upto)
            .filter(|&u| actions[u] == Action::Retain && movable(g, u) && alive_at(g, u, s))
            .collect();
        if cands.is_empty() {
            break;
        }
        // Swaps that hide in their free time: the largest free time first (ties: execution order).
        let mut best: Option<(f64, usize)> = None;
        for &u in &cands {
            let f = free_time(g, &starts, u);
            if f >= 0.0 && best.map_or(true, |(bf, _)| f > bf) {
                best = Some((f, u));
            }
        }
        if let Some((_, u)) = best {
            actions[u] = Action::Swap;
            continue;
        }
        // Otherwise the best memory saving per second of overhead, swap or recompute.
        let mut pick: Option<(f64, usize, Action)> = None;
        for &u in &cands {
            let swap_cost = -free_time(g, &starts, u);
            let rec_cost = recompute_time(g, &actions, u);
            for (a, cost) in [(Action::Swap, swap_cost), (Action::Recompute, rec_cost)] {
                let msps = g.act[u] as f64 / cost.max(1e-12);
                if pick.map_or(true, |(m, _, _)| msps > m) {
                    pick = Some((msps, u, a));
                }
            }
        }
        let (_, u, a) = pick.expect("candidates are not empty");
        actions[u] = a;
    }
    actions
}
