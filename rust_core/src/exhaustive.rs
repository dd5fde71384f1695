//! Exhaustive search over every plan: the ground truth for tiny profiles (3^n plans).

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{score, EvalOptions, Score, Scratch};
use crate::profile::Graph;

pub const MAX_UNITS: usize = 14;

/// The best plan by the evaluator's score; ties go to the first plan in enumeration order
/// (unit 0 varies slowest, retain < swap < recompute).
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
    let total = 3usize.pow(g.n as u32);
    for code in 0..total {
        let mut c = code;
        for j in (0..g.n).rev() {
            plan[j] = Action::ALL[c % 3];
            c /= 3;
        }
        let s = score(g, &plan, budget, opts, &mut scratch);
        if s.better_than(&best.1) {
            best = (plan.clone(), s);
        }
    }
    Ok(best)
}
