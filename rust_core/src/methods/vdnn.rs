//! vDNN (Rhu et al.): offload the inputs of convolution layers to host memory in forward and
//! prefetch them in backward. Its dynamic policy tries, in order, no offload, offloading the
//! convolution inputs (vDNN_conv) and offloading every layer's input (vDNN_all), and keeps the
//! first that fits. `vdnn-sync` evaluates with synchronous offload: the compute waits after each
//! forward stage for its swap-outs (EvalOptions::sync_swap_out).

use super::{movable, score_of};
use crate::action::Action;
use crate::evaluator::{EvalOptions, Scratch};
use crate::profile::{Graph, Profile};

/// The units whose activations hold a convolution's input: the producers of its inputs (a saved
/// tensor belongs to the unit that produced it), and a convolution without producers itself.
pub fn conv_inputs(profile: &Profile, g: &Graph) -> Vec<usize> {
    let mut v = Vec::new();
    for (i, u) in profile.units.iter().enumerate() {
        if u.kind != "conv" {
            continue;
        }
        if g.inputs[i].is_empty() && movable(g, i) {
            v.push(i);
        }
        for &p in &g.inputs[i] {
            if movable(g, p) {
                v.push(p);
            }
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

pub fn plan(profile: &Profile, g: &Graph, budget: u64, opts: &EvalOptions) -> Vec<Action> {
    let mut scratch = Scratch::new(g.n);
    let retain = vec![Action::Retain; g.n];
    if score_of(g, &retain, budget, opts, &mut scratch).feasible {
        return retain;
    }
    let mut conv = retain.clone();
    for u in conv_inputs(profile, g) {
        conv[u] = Action::Swap;
    }
    if score_of(g, &conv, budget, opts, &mut scratch).feasible {
        return conv;
    }
    // vDNN_all: every layer's input (every unit read by a later unit) is offloaded.
    let mut all = retain;
    for u in 0..g.n {
        if movable(g, u) && (g.last_fwd[u] > u || conv[u] == Action::Swap) {
            all[u] = Action::Swap;
        }
    }
    all
}
