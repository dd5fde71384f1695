//! TENSILE (Zhang et al.), Algorithms 1-3 on one job: run the memory-peak analysis of the current
//! plan; swap the largest tensor alive at the first stage over the budget whose copies fit in its
//! feasible intervals (the swap-out done before the peak, the swap-in after it and before the
//! first backward reader); keep it if the excess over the budget shrinks. When no swap helps,
//! recompute the tensor at the peak with the largest MSPS (memory saving per second of replay)
//! among those whose replay inputs are retained (TENSILE recomputes only accesses whose inputs
//! are never released). Re-run the peak analysis every round; stop when the plan fits or nothing
//! more helps.

use super::capuchin::{alive_at, first_over};
use super::{bwd_stage, movable, stage_starts};
use crate::action::Action;
use crate::evaluator::{evaluate, EvalOptions, Scratch};
use crate::profile::Graph;

pub fn plan(g: &Graph, budget: u64, opts: &EvalOptions) -> Vec<Action> {
    let mut actions = vec![Action::Retain; g.n];
    let mut scratch = Scratch::new(g.n);
    let mut tried = vec![[false; 3]; g.n];
    let mut o = evaluate(g, &actions, budget, opts, &mut scratch, true);
    for _round in 0..3 * g.n {
        if o.feasible {
            break;
        }
        let s = first_over(g, &o, budget);
        let starts = stage_starts(&o);
        let mut cands: Vec<usize> =
            (0..g.n).filter(|&u| actions[u] == Action::Retain && movable(g, u) && alive_at(g, u, s)).collect();
        cands.sort_by(|&a, &b| g.act[b].cmp(&g.act[a]).then(a.cmp(&b)));
        let mut changed = false;
        // Swap: the largest tensor whose copies fit in its feasible intervals around the peak.
        for &u in &cands {
            if tried[u][1] {
                continue;
            }
            let out_done = starts[g.last_fwd[u] + 1] + g.act[u] as f64 / g.d2h <= starts[s];
            let need = bwd_stage(g, g.first_need[u].unwrap_or(0));
            let in_fits = starts[s + 1] + g.act[u] as f64 / g.h2d <= starts[need];
            if !(out_done && in_fits) {
                continue;
            }
            tried[u][1] = true;
            actions[u] = Action::Swap;
            let o2 = evaluate(g, &actions, budget, opts, &mut scratch, true);
            if o2.score().better_than(&o.score()) {
                o = o2;
                changed = true;
                break;
            }
            actions[u] = Action::Retain;
        }
        if changed {
            continue;
        }
        // Recompute: the largest MSPS among tensors at the peak whose replay inputs are retained.
        let mut by_msps: Vec<usize> = cands
            .iter()
            .copied()
            .filter(|&u| !tried[u][2] && g.replay_inputs[u].iter().all(|&p| actions[p] == Action::Retain))
            .collect();
        by_msps.sort_by(|&a, &b| {
            let ma = g.act[a] as f64 / g.fwd_time[a].max(1e-12);
            let mb = g.act[b] as f64 / g.fwd_time[b].max(1e-12);
            mb.total_cmp(&ma).then(a.cmp(&b))
        });
        for u in by_msps {
            tried[u][2] = true;
            actions[u] = Action::Recompute;
            let o2 = evaluate(g, &actions, budget, opts, &mut scratch, true);
            if o2.score().better_than(&o.score()) {
                o = o2;
                changed = true;
                break;
            }
            actions[u] = Action::Retain;
        }
        if !changed {
            break;
        }
    }
    actions
}
