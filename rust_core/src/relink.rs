//! Path relinking between polished plans (`PsoSettings::relinks`), PSO's last stage.
//!
//! The polish ends at a local optimum that depends on where it starts, and the better optima
//! differ from the worse by many units at once (checkpoints moved along a chain, several
//! recomputations traded for others elsewhere), which none of the polish's moves makes. A plan
//! on the way from one polished plan to another often beats both, and the polish from it ends
//! at a better optimum than from either (docs/methods.md has the measurements).
//!
//! A walk from plan A to plan B changes the units where they differ to B's actions one at a
//! time, each step the change that leaves the best plan (the first in unit order on a tie); its
//! result is the best feasible plan strictly between A and B. Walks run between the [`POOL`]
//! best polished plans, each ordered pair once, the pairs of best ranks first (rank sum, then
//! the better plan first); a walk's result better than both of its ends is polished, and the
//! polished plan joins the others. At most `polishes` polishes. Every step is evaluated in
//! order, so the result and the evaluation count do not depend on the thread count.

use crate::action::Action;
use crate::evaluator::{EvalOptions, Score};
use crate::polish::{add_distinct, Memos, Polisher};
use crate::profile::Graph;
use crate::space::Space;
use crate::threads::Threads;

/// How many of the best polished plans the walks run between.
pub const POOL: usize = 8;

/// The walk from `from` to `to` (plans of the polisher's space): the best feasible plan
/// strictly between them (None when they differ in fewer than two dimensions or none of those
/// plans is feasible).
fn walk(polisher: &mut Polisher, space: &Space, from: &[Action], to: &[Action]) -> Option<(Vec<Action>, Score)> {
    let mut left: Vec<usize> = (0..space.dims()).filter(|&k| space.action(from, k) != space.action(to, k)).collect();
    let mut cur = from.to_vec();
    let mut best: Option<(Vec<Action>, Score)> = None;
    while left.len() > 1 {
        let changes: Vec<(usize, Action)> = left.iter().map(|&k| (k, space.action(to, k))).collect();
        let scores = polisher.scores_of_changes(&cur, &changes);
        // The best change (the first of equal ones); a change scored None is worse than the
        // first change's score.
        let mut k = 0;
        for (i, s) in scores.iter().enumerate() {
            if let Some(s) = s {
                if s.better_than(&scores[k].expect("the first change is scored")) {
                    k = i;
                }
            }
        }
        let sk = scores[k].expect("the best change is scored");
        space.set(&mut cur, left[k], space.action(to, left[k]));
        left.remove(k);
        if sk.feasible && best.as_ref().map_or(true, |(_, bs)| sk.better_than(bs)) {
            best = Some((cur.clone(), sk));
        }
    }
    best
}

/// The ordered pair of distinct plans (indices into `plans`, sorted best first) not yet walked
/// with the smallest rank sum; of equal sums, the one whose better plan ranks first, walked
/// from the better plan first.
fn next_pair(plans: &[(Vec<Action>, Score)], walked: &[(Vec<Action>, Vec<Action>)]) -> Option<(usize, usize)> {
    let k = plans.len();
    for sum in 1..(2 * k).saturating_sub(2) {
        for i in 0..=sum.min(k - 1) {
            let j = sum - i;
            if j >= k || j <= i {
                continue;
            }
            for (a, b) in [(i, j), (j, i)] {
                if plans[a].0 != plans[b].0 && !walked.iter().any(|(x, y)| *x == plans[a].0 && *y == plans[b].0) {
                    return Some((a, b));
                }
            }
        }
    }
    None
}

/// Relink `plans` (polished, feasible plans of `space`) as the module documentation says;
/// returns the best plan (None without plans), the evaluations made and the stages simulated.
/// The scores known are taken from `memos` and handed back with what relinking learnt.
pub fn relink(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    pool: &Threads,
    space: &Space,
    mut plans: Vec<(Vec<Action>, Score)>,
    polishes: usize,
    memos: &mut Memos,
) -> (Option<(Vec<Action>, Score)>, u64, u64) {
    let mut polisher = Polisher::new(g, budget, opts, pool, space);
    polisher.memos = std::mem::take(memos);
    let mut walked: Vec<(Vec<Action>, Vec<Action>)> = Vec::new();
    let mut polished: Vec<Vec<Action>> = Vec::new();
    while polished.len() < polishes {
        plans.sort_by(|x, y| x.1.cmp_key(&y.1));
        plans.truncate(POOL);
        let Some((a, b)) = next_pair(&plans, &walked) else { break };
        walked.push((plans[a].0.clone(), plans[b].0.clone()));
        let Some((mid, ms)) = walk(&mut polisher, space, &plans[a].0, &plans[b].0) else { continue };
        if !(ms.better_than(&plans[a].1) && ms.better_than(&plans[b].1)) || polished.contains(&mid) {
            continue;
        }
        polished.push(mid.clone());
        let (p, ps) = polisher.polish(mid, ms);
        add_distinct(&mut plans, p, ps);
    }
    plans.sort_by(|x, y| x.1.cmp_key(&y.1));
    *memos = std::mem::take(&mut polisher.memos);
    (plans.into_iter().next(), polisher.evaluations(), polisher.stages())
}
