//! TENSILE (Zhang et al.), Algorithms 1-3 on one job: run the memory-peak analysis of the current
//! plan; swap the largest tensor alive at the first stage over the budget whose copies fit in its
//! feasible intervals (the swap-out done before the peak, the swap-in after it and before the
//! first backward reader); keep it if the excess over the budget shrinks. When no swap helps,
//! recompute the tensor at the peak with the largest MSPS (memory saving per second of replay)
//! among those whose replay inputs are retained (TENSILE recomputes only accesses whose inputs
//! are never released). Re-run the peak analysis every round; stop when the plan fits or nothing
//! more helps.
//!
//! With a profile that has an optimizer step, the tensors at the peak also include parameters
//! and optimizer state (TENSILE's swapping across iterations, crate::state_swap): a unit's
//! optimizer state is a candidate at every stage but its own optimizer stage, its parameters at
//! the forward stages before its own and the optimizer stages after its own; their swap-in must
//! fit before the use on the step's timeline (TENSILE allows no passive swap-in). If the greedy
//! ends over the budget, the fastest of the simple plans (retain, swap or recompute everything,
//! with nothing or everything swapped across iterations) that fits is returned, so a budget the
//! refusal names works with this method (docs/methods.md).

use super::capuchin::{alive_at, first_over};
use super::{bwd_stage, movable, stage_starts};
use crate::action::Action;
use crate::evaluator::{evaluate_with_swaps, EvalOptions, Moved, Outcome, Scratch, Stage, StateSwaps};
use crate::profile::Graph;

/// TENSILE on activations only (the plan PSO is seeded with).
pub fn plan(g: &Graph, budget: u64, opts: &EvalOptions) -> Vec<Action> {
    greedy(g, budget, opts, false).0
}

/// TENSILE with parameters and optimizer state swapped across iterations where the profile has
/// an optimizer step (otherwise as [`plan`]).
pub fn plan_with_state_swaps(g: &Graph, budget: u64, opts: &EvalOptions) -> (Vec<Action>, StateSwaps) {
    greedy(g, budget, opts, swappable(g))
}

/// Whether the profile has parameters or optimizer state a plan can swap across iterations.
pub fn swappable(g: &Graph) -> bool {
    StateSwaps::all(g).any(g)
}

fn greedy(g: &Graph, budget: u64, opts: &EvalOptions, swapping: bool) -> (Vec<Action>, StateSwaps) {
    let mut actions = vec![Action::Retain; g.n];
    let mut swaps = if swapping {
        StateSwaps { params: vec![false; g.n], states: vec![false; g.n] }
    } else {
        StateSwaps::none()
    };
    let mut scratch = Scratch::new(g.n);
    let mut tried = vec![[false; 3]; g.n];
    let mut tried_state = vec![[false; 2]; g.n];
    let eval = |a: &[Action], sw: &StateSwaps, s: &mut Scratch| -> Outcome {
        evaluate_with_swaps(g, a, &g.block_start, sw, budget, opts, s, true)
    };
    let mut o = eval(&actions, &swaps, &mut scratch);
    for _round in 0..3 * g.n + if swapping { 2 * g.n } else { 0 } {
        if o.feasible {
            break;
        }
        let s = first_over(g, &o, budget);
        let starts = stage_starts(&o);
        let acts: Vec<usize> =
            (0..g.n).filter(|&u| actions[u] == Action::Retain && movable(g, u) && alive_at(g, u, s)).collect();
        // Candidates, largest first: (bytes, what, unit).
        let mut cands: Vec<(u64, Moved, usize)> = acts.iter().map(|&u| (g.act[u], Moved::Activations, u)).collect();
        if swapping {
            // the stage over the budget, and when the optimizer step starts (2n)
            let stage = o.curve.get(s).map(|c| c.stage).unwrap_or(Stage::Start);
            let pos = |u: usize| g.opt_order.iter().position(|&v| v == u);
            let opt_start = starts[(2 * g.n).min(starts.len() - 1)];
            for u in 0..g.n {
                if g.opt_state[u] > 0 && !swaps.state(u) && !tried_state[u][1] {
                    // (the whole step in one call: a state swap splits it, so it may help there)
                    if stage != Stage::Opt(u) && g.opt_state[u] as f64 / g.h2d <= opt_start {
                        cands.push((g.opt_state[u], Moved::OptimizerState, u));
                    }
                }
                if g.param[u] > 0 && !swaps.param(u) && !tried_state[u][0] {
                    let after_update = match stage {
                        Stage::Opt(v) => pos(v) > pos(u),
                        _ => false,
                    };
                    if (s < u || after_update) && g.param[u] as f64 / g.h2d <= starts[u] {
                        cands.push((g.param[u], Moved::Parameters, u));
                    }
                }
            }
        }
        cands.sort_by(|a, b| b.0.cmp(&a.0).then((a.1 as u8).cmp(&(b.1 as u8))).then(a.2.cmp(&b.2)));
        let mut changed = false;
        // Swap: the largest tensor whose copies fit in its feasible intervals around the peak.
        for &(_, what, u) in &cands {
            match what {
                Moved::Activations => {
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
                }
                Moved::Parameters => {
                    tried_state[u][0] = true;
                    swaps.params[u] = true;
                }
                Moved::OptimizerState => {
                    tried_state[u][1] = true;
                    swaps.states[u] = true;
                }
            }
            let o2 = eval(&actions, &swaps, &mut scratch);
            if o2.score().better_than(&o.score()) {
                o = o2;
                changed = true;
                break;
            }
            match what {
                Moved::Activations => actions[u] = Action::Retain,
                Moved::Parameters => swaps.params[u] = false,
                Moved::OptimizerState => swaps.states[u] = false,
            }
        }
        if changed {
            continue;
        }
        // Recompute: the largest MSPS among tensors at the peak whose replay inputs are retained.
        let mut by_msps: Vec<usize> = acts
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
            let o2 = eval(&actions, &swaps, &mut scratch);
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
    if swapping && !o.feasible {
        // The fastest simple plan that fits, if any (see the module docs).
        let all = StateSwaps::all(g);
        for a in [Action::Retain, Action::Swap, Action::Recompute] {
            for sw in [StateSwaps::none(), all.clone()] {
                let plan = vec![a; g.n];
                let o2 = eval(&plan, &sw, &mut scratch);
                if o2.score().better_than(&o.score()) {
                    o = o2;
                    actions = plan;
                    swaps = sw;
                }
            }
        }
    }
    (actions, swaps)
}
