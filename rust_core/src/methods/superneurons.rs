//! SuperNeurons (Wang et al.), as HOME re-implements it: swap the activations of convolution
//! layers, drop those of pool, activation and normalisation layers (LRN, BatchNorm) and recompute
//! them in backward, retain everything else. The rule applies only when the unplanned step does
//! not fit (otherwise nothing moves).

use super::{movable, score_of};
use crate::action::Action;
use crate::evaluator::{EvalOptions, Scratch};
use crate::profile::{Graph, Profile};

/// SuperNeurons' cheap layers: recomputing them costs little compute.
pub const CHEAP_KINDS: [&str; 4] = ["pool", "activation", "norm", "lrn"];

pub fn plan(profile: &Profile, g: &Graph, budget: u64, opts: &EvalOptions) -> Vec<Action> {
    let retain = vec![Action::Retain; g.n];
    if score_of(g, &retain, budget, opts, &mut Scratch::new(g.n)).feasible {
        return retain;
    }
    profile
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| {
            if !movable(g, i) {
                Action::Retain
            } else if u.kind == "conv" {
                Action::Swap
            } else if CHEAP_KINDS.contains(&u.kind.as_str()) {
                Action::Recompute
            } else {
                Action::Retain
            }
        })
        .collect()
}
