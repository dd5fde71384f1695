//! Exhaustive search over every plan: the ground truth for tiny profiles (3^n plans), with the
//! profile's default checkpoint segments or over every split of the plan's runs of recomputed
//! units into segments as well.

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{evaluate_segments, score, EvalOptions, Score, Scratch};
use crate::profile::Graph;

pub const MAX_UNITS: usize = 14;
/// Units [`search_segments`] takes: it evaluates up to (2 + sqrt 2)^n plans (28 million at 14).
pub const MAX_UNITS_SEGMENTS: usize = 12;

/// The plan of index `code` in enumeration order (unit 0 varies slowest, retain < swap <
/// recompute).
fn decode(code: usize, plan: &mut [Action]) {
    let mut c = code;
    for j in (0..plan.len()).rev() {
        plan[j] = Action::ALL[c % 3];
        c /= 3;
    }
}

/// The best plan by the evaluator's score, under the profile's default segment starts; ties go to
/// the first plan in enumeration order.
pub fn search(g: &Graph, budget: u64, opts: &EvalOptions) -> Result<(Vec<Action>, Score)> {
    if g.n > MAX_UNITS {
        return Err(CoreError::InvalidSetting(format!(
            "exhaustive search enumerates 3^n plans and takes at most {MAX_UNITS} units; this profile has {}: use method=\"pso\"",
            g.n
        )));
    }
    let mut scratch = Scratch::new(g.n);
    let mut plan = vec![Action::Retain; g.n];
    let mut best = (plan.clone(), Score::WORST);
    for code in 0..3usize.pow(g.n as u32) {
        decode(code, &mut plan);
        let s = score(g, &plan, budget, opts, &mut scratch);
        if s.better_than(&best.1) {
            best = (plan.clone(), s);
        }
    }
    Ok(best)
}

/// The best plan and segment starts by the evaluator's score: every plan, and for each every
/// split of its runs of consecutive recomputed units into segments (a start matters only between
/// two recomputed units, so those are the only starts tried and returned). Ties go to the first
/// plan in enumeration order, then to the fewest splits (splits as a binary number, lowest unit
/// least significant). Returns the actions, the starts (one flag per unit) and the score.
pub fn search_segments(g: &Graph, budget: u64, opts: &EvalOptions) -> Result<(Vec<Action>, Vec<bool>, Score)> {
    if g.n > MAX_UNITS_SEGMENTS {
        return Err(CoreError::InvalidSetting(format!(
            "exhaustive search over plans and segment starts takes at most {MAX_UNITS_SEGMENTS} units; this profile has {}: \
             use method=\"exhaustive\" (default starts) or \"pso\"",
            g.n
        )));
    }
    let mut scratch = Scratch::new(g.n);
    let mut plan = vec![Action::Retain; g.n];
    let mut starts = vec![false; g.n];
    let mut best = (plan.clone(), starts.clone(), Score::WORST);
    let mut joins: Vec<usize> = Vec::with_capacity(g.n);
    for code in 0..3usize.pow(g.n as u32) {
        decode(code, &mut plan);
        joins.clear();
        joins.extend((1..g.n).filter(|&u| plan[u] == Action::Recompute && plan[u - 1] == Action::Recompute));
        for mask in 0..1usize << joins.len() {
            starts.iter_mut().for_each(|s| *s = false);
            for (b, &u) in joins.iter().enumerate() {
                starts[u] = mask >> b & 1 == 1;
            }
            let s = evaluate_segments(g, &plan, &starts, budget, opts, &mut scratch, false).score();
            if s.better_than(&best.2) {
                best = (plan.clone(), starts.clone(), s);
            }
        }
    }
    Ok(best)
}
