//! DELTA (Tang et al.): a runtime policy, not a planner. When the memory in use passes a
//! threshold (3/4 of the budget), it releases tensors, picking the candidate with the largest
//! size x staleness (staleness: the time since the tensor was last used); it evicts
//! (recomputes) a tensor when recomputing it is cheaper than its transfer, and swaps it
//! otherwise; swapped tensors are prefetched in backward order.
//!
//! The policy's decisions depend only on the step's timeline (sizes, stage times, who reads what
//! when), which the profile fixes, so the policy is *simulated* over the cost model's timeline:
//! walk the step; at the first stage whose peak is over the threshold, release the candidate with
//! the largest size x staleness among the tensors resident there; repeat until every stage is
//! under the threshold or no candidate is left. The executor then runs the policy's decisions as
//! a plan, and the evaluator scores them like any other method's (docs/methods.md, "DELTA").

use super::capuchin::alive_at;
use super::{movable, recompute_time, stage_starts};
use crate::action::Action;
use crate::evaluator::{evaluate, EvalOptions, Outcome, Scratch};
use crate::profile::Graph;

/// DELTA starts releasing at this share of the budget.
pub const THRESHOLD: f64 = 0.75;

/// Index of the first stage whose peak is over `limit`, if any.
fn first_over(o: &Outcome, limit: u64) -> Option<usize> {
    o.curve.iter().position(|c| c.peak > limit)
}

pub fn plan(g: &Graph, budget: u64, opts: &EvalOptions) -> Vec<Action> {
    let limit = (budget as f64 * THRESHOLD) as u64;
    let mut actions = vec![Action::Retain; g.n];
    let mut scratch = Scratch::new(g.n);
    for _round in 0..g.n {
        let o = evaluate(g, &actions, budget, opts, &mut scratch, true);
        let Some(s) = first_over(&o, limit) else { break };
        let starts = stage_starts(&o);
        // resident retained tensors at stage s; staleness = time since the end of the last
        // forward stage that read them (their last use before s)
        let pick = (0..g.n)
            .filter(|&u| actions[u] == Action::Retain && movable(g, u) && alive_at(g, u, s))
            .map(|u| {
                let stale = (starts[s] - starts[g.last_fwd[u] + 1]).max(0.0);
                (g.act[u] as f64 * stale, u)
            })
            .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        let Some((_, u)) = pick else { break };
        let transfer = g.act[u] as f64 / g.d2h + g.act[u] as f64 / g.h2d;
        actions[u] = if recompute_time(g, &actions, u) < transfer { Action::Recompute } else { Action::Swap };
    }
    actions
}
