//! The heuristic planners of the papers HOME compares with, on tensorplace's cost model: each
//! returns one action per unit; `planner::make_plan` evaluates the result and refuses it when it
//! does not fit (docs/methods.md says how each paper's rule was read).
//!
//! - [`capuchin`]: swaps by free time, then recomputation by MSPS, in execution order.
//! - [`superneurons`]: swap convolutions, recompute pool / activation / norm layers.
//! - [`vdnn`]: swap convolution inputs (`vdnn`, and `vdnn-sync` with synchronous offload).
//! - [`tensile`]: peak analysis, greedy swaps of the tensors at the peak, MSPS recomputation.
//! - [`delta`]: DELTA's runtime policy (release above 3/4 of the budget by size x staleness,
//!   recompute when cheaper than the transfer), simulated over the cost model's timeline.
//! - [`modnn`]: sub-batch selection with gradient accumulation, offload on allocation failure,
//!   EST prefetch timing (its own plan per full step: `planner::make_plan` hands it over).

pub mod capuchin;
pub mod delta;
pub mod modnn;
pub mod superneurons;
pub mod tensile;
pub mod vdnn;

use crate::action::Action;
use crate::evaluator::{score, EvalOptions, Outcome, Score, Scratch};

use crate::profile::{Graph, Profile};

/// The heuristic methods, by name.
pub const HEURISTICS: [&str; 6] = ["capuchin", "superneurons", "vdnn", "vdnn-sync", "tensile", "delta"];

/// The plan of heuristic `method` (one of [`HEURISTICS`]), or None for another name.
pub fn heuristic_plan(method: &str, profile: &Profile, g: &Graph, budget: u64, opts: &EvalOptions) -> Option<Vec<Action>> {
    Some(match method {
        "capuchin" => capuchin::plan(g, budget, opts),
        "superneurons" => superneurons::plan(profile, g, budget, opts),
        "vdnn" => vdnn::plan(profile, g, budget, opts),
        "vdnn-sync" => vdnn::plan(profile, g, budget, &EvalOptions { sync_swap_out: true, ..*opts }),
        "tensile" => tensile::plan(g, budget, opts),
        "delta" => delta::plan(g, budget, opts),
        _ => return None,
    })
}

/// Units whose activations an action can move (they own bytes that some backward reads).
pub(crate) fn movable(g: &Graph, u: usize) -> bool {
    g.act[u] > 0 && g.first_need[u].is_some()
}

pub(crate) fn score_of(g: &Graph, actions: &[Action], budget: u64, opts: &EvalOptions, s: &mut Scratch) -> Score {
    score(g, actions, budget, opts, s)
}

/// Stage index of backward stage i (forward stage i is index i; B(n-1) is index n).
pub(crate) fn bwd_stage(g: &Graph, i: usize) -> usize {
    2 * g.n - 1 - i
}

/// Start time of every stage (index as above) and the end of the step.
pub(crate) fn stage_starts(o: &Outcome) -> Vec<f64> {
    let mut v: Vec<f64> = o.curve.iter().map(|c| c.start_time).collect();
    v.push(o.step_time);
    v
}

/// The time a replay of `u` costs under `actions`: its forward, plus the forward of every input
/// it needs that is recomputed too and not resident then (one level, as Capuchin's MSPS counts).
pub(crate) fn recompute_time(g: &Graph, actions: &[Action], u: usize) -> f64 {
    let need = g.first_need[u].unwrap_or(0);
    let mut t = g.fwd_time[u];
    for &p in &g.replay_inputs[u] {
        if g.act[p] == 0 {
            continue;
        }
        let resident = match actions[p] {
            Action::Retain => g.last_use[p].map_or(false, |lu| lu <= need),
            Action::Recompute => g.first_need[p].map_or(false, |f| f >= need) && g.last_use[p].map_or(false, |lu| lu <= need),
            Action::Swap => true,
        };
        if !resident && actions[p] != Action::Swap {
            t += g.fwd_time[p];
        }
    }
    t
}
