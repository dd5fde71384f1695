//! The local search that polishes PSO's result (`PsoSettings::polish`).
//!
//! The swarm ends near good plans but rarely at a local optimum, and what separates its plans
//! from better ones is often a change of several units at once: retaining a recomputed unit pays
//! only once memory is found for it elsewhere. From each start (the swarm's best, then the next
//! best distinct personal bests, `PsoSettings::polish_starts`) the polish repeats, until neither
//! improves the plan:
//!
//! 1. **Descent**: every other action of every unit, then of every pair of units at most
//!    [`PAIR_WINDOW`] apart (one of them not retained), taking each change that makes the plan
//!    better, until none does.
//! 2. **Ejection chains**: a single change that would make the step faster if memory were
//!    unlimited (a recomputed unit retained; a swapped one whose prefetch stalls retained) but
//!    under the budget stalls or does not fit, then repairs that win the memory back: every swap
//!    that costs nothing, then, one unit at a time, the change that removes the most excess per
//!    second of step time (once the plan fits, the fastest change, at most once), or at once the
//!    change that makes it beat the plan; each unit changed at most once, at most
//!    [`CHAIN_ROUNDS`] changes. The [`CHAINS_PER_PASS`] most promising first changes (fastest
//!    with unlimited memory) are tried per pass; a chain that ends faster than the plan replaces
//!    it. A chain often needs several repairs (five cheap GELU recomputations to retain one
//!    attention projection of a GPT block), which pair moves cannot find.
//!
//! Then every swap the plan does without at no cost is undone (fewer copies, same score). The
//! best polished start is polished once more with pairs at any distance.
//!
//! Every step only replaces the plan with a better one, so the polish never makes PSO's result
//! worse. Scans are evaluated in parallel in fixed batches and the first improvement in scan
//! order is taken, so the result and the evaluation count do not depend on the thread count.

use crate::action::Action;
use crate::evaluator::{score, EvalOptions, Score, Scratch};
use crate::profile::Graph;
use rayon::prelude::*;

/// Most repairs after the first change of an ejection chain.
pub const CHAIN_ROUNDS: usize = 8;

/// Ejection chains tried per pass (the most promising first changes).
pub const CHAINS_PER_PASS: usize = 24;

/// Pair moves of the descent change units at most this far apart (in unit order), except in the
/// last polish of the best start. Far pairs are mostly a unit retained and another made to free
/// its memory, which the ejection chains find.
pub const PAIR_WINDOW: usize = 8;

/// Candidate moves evaluated together in a scan (fixed, so that the evaluation count does not
/// depend on the thread count).
const BATCH: usize = 64;

/// A change of one or two units.
#[derive(Debug, Clone, Copy)]
struct Move {
    first: (usize, Action),
    second: Option<(usize, Action)>,
}

impl Move {
    fn apply(&self, plan: &mut [Action]) {
        plan[self.first.0] = self.first.1;
        if let Some((u, a)) = self.second {
            plan[u] = a;
        }
    }

    fn undo(&self, plan: &mut [Action], from: &[Action]) {
        plan[self.first.0] = from[self.first.0];
        if let Some((u, _)) = self.second {
            plan[u] = from[u];
        }
    }
}

/// The local search's state: the evaluator's inputs and the evaluations made so far.
pub(crate) struct Polisher<'a> {
    g: &'a Graph,
    budget: u64,
    opts: &'a EvalOptions,
    pool: &'a rayon::ThreadPool,
    scratch: Scratch,
    evaluations: u64,
    /// Pairs of the descent at most this far apart.
    window: usize,
}

impl<'a> Polisher<'a> {
    pub(crate) fn new(g: &'a Graph, budget: u64, opts: &'a EvalOptions, pool: &'a rayon::ThreadPool) -> Self {
        Polisher { g, budget, opts, pool, scratch: Scratch::new(g.n), evaluations: 0, window: PAIR_WINDOW }
    }

    pub(crate) fn evaluations(&self) -> u64 {
        self.evaluations
    }

    /// Scores of `plan` with each of `changes` (one unit set to one action) applied alone, in
    /// parallel (in order, whatever the thread count).
    pub(crate) fn scores_of_changes(&mut self, plan: &[Action], changes: &[(usize, Action)]) -> Vec<Score> {
        let moves: Vec<Move> = changes.iter().map(|&first| Move { first, second: None }).collect();
        self.scores(plan, &moves, self.budget)
    }

    fn score(&mut self, plan: &[Action]) -> Score {
        self.evaluations += 1;
        score(self.g, plan, self.budget, self.opts, &mut self.scratch)
    }

    /// Scores of `moves` applied (each alone) to `plan` under `budget`, in parallel.
    fn scores(&mut self, plan: &[Action], moves: &[Move], budget: u64) -> Vec<Score> {
        let (g, opts, n) = (self.g, self.opts, self.g.n);
        self.evaluations += moves.len() as u64;
        self.pool.install(|| {
            moves
                .par_iter()
                .map_init(
                    || (Scratch::new(n), plan.to_vec()),
                    |(scratch, p), m| {
                        m.apply(p);
                        let s = score(g, p, budget, opts, scratch);
                        m.undo(p, plan);
                        s
                    },
                )
                .collect()
        })
    }

    /// The first of `moves` (in order) that makes `plan` better than `current`, evaluated in
    /// batches; with its score.
    fn first_better(&mut self, plan: &[Action], current: &Score, moves: &[Move]) -> Option<(usize, Score)> {
        for (c, chunk) in moves.chunks(BATCH).enumerate() {
            let scores = self.scores(plan, chunk, self.budget);
            if let Some(k) = scores.iter().position(|s| s.better_than(current)) {
                return Some((c * BATCH + k, scores[k]));
            }
        }
        None
    }

    /// Descent by single and pair moves, first improvement in scan order, until none improves.
    fn descend(&mut self, plan: &mut [Action], current: &mut Score) {
        let (n, window) = (self.g.n, self.window);
        let mut moves: Vec<Move> = Vec::new();
        loop {
            let mut improved = false;
            let mut from = 0;
            loop {
                moves.clear();
                for j in from..n {
                    for a in Action::ALL {
                        if a != plan[j] {
                            moves.push(Move { first: (j, a), second: None });
                        }
                    }
                }
                let Some((k, s)) = self.first_better(plan, current, &moves) else { break };
                moves[k].apply(plan);
                *current = s;
                improved = true;
                from = moves[k].first.0 + 1;
            }
            if improved {
                continue;
            }
            // Pairs (one of the two not retained: two retained units changing is two single
            // changes), scanned row by row; after an improvement the scan goes on after it.
            let (mut i, mut from) = (0, 1);
            while i < n {
                moves.clear();
                let (mut ri, mut rj) = (i, from);
                while moves.len() < BATCH && ri < n {
                    if rj >= n || rj > ri + window {
                        ri += 1;
                        rj = ri + 1;
                        continue;
                    }
                    let (oi, oj) = (plan[ri], plan[rj]);
                    if !(oi == Action::Retain && oj == Action::Retain) {
                        for ai in Action::ALL {
                            for aj in Action::ALL {
                                if ai != oi && aj != oj {
                                    moves.push(Move { first: (ri, ai), second: Some((rj, aj)) });
                                }
                            }
                        }
                    }
                    rj += 1;
                }
                match self.first_better(plan, current, &moves) {
                    Some((k, s)) => {
                        moves[k].apply(plan);
                        *current = s;
                        improved = true;
                        let (pi, (pj, _)) = (moves[k].first.0, moves[k].second.expect("a pair"));
                        (i, from) = (pi, pj + 1);
                    }
                    None => (i, from) = (ri, rj),
                }
            }
            if !improved {
                break;
            }
        }
    }

    /// Swap every retained unit (not `locked`) whose swap makes the plan no worse and no slower,
    /// in unit order, each on top of the earlier ones. Returns whether any unit changed.
    fn free_swaps(&mut self, plan: &mut [Action], current: &mut Score, locked: &[bool]) -> bool {
        let g = self.g;
        let mut changed = false;
        for j in 0..g.n {
            if plan[j] != Action::Retain || locked[j] || g.act[j] == 0 || g.first_need[j].is_none() {
                continue;
            }
            plan[j] = Action::Swap;
            let s = self.score(plan);
            if !current.better_than(&s) && s.time <= current.time {
                *current = s;
                changed = true;
            } else {
                plan[j] = Action::Retain;
            }
        }
        changed
    }

    /// Undo every swap the plan does without at no cost.
    fn tidy(&mut self, plan: &mut [Action], current: &mut Score) {
        for j in 0..self.g.n {
            if plan[j] != Action::Swap {
                continue;
            }
            plan[j] = Action::Retain;
            let s = self.score(plan);
            if !current.better_than(&s) {
                *current = s;
            } else {
                plan[j] = Action::Swap;
            }
        }
    }

    /// The repair of an ejection chain from `cur` (score `cs`), among the single changes of
    /// units not `locked`: the one that makes the chain beat `target` (the plan it started from)
    /// by the most; else one that makes `cur` better than `cs`: when `cs` fits, the fastest; when
    /// not, the one that costs the least step time per byte of excess it removes (the first in
    /// unit order on a tie).
    fn repair(&mut self, cur: &[Action], cs: &Score, locked: &[bool], target: &Score) -> Option<(Move, Score)> {
        let mut moves = Vec::new();
        for k in 0..self.g.n {
            if !locked[k] {
                for b in Action::ALL {
                    if b != cur[k] {
                        moves.push(Move { first: (k, b), second: None });
                    }
                }
            }
        }
        let scores = self.scores(cur, &moves, self.budget);
        // A change that makes the chain beat the plan it started from ends it: the best such.
        let mut win: Option<usize> = None;
        for (k, s) in scores.iter().enumerate() {
            if s.better_than(target) && win.map_or(true, |w| s.better_than(&scores[w])) {
                win = Some(k);
            }
        }
        if let Some(k) = win {
            return Some((moves[k], scores[k]));
        }
        let mut pick: Option<(f64, usize)> = None;
        for (k, s) in scores.iter().enumerate() {
            if !s.better_than(cs) {
                continue;
            }
            let value = if cs.feasible {
                s.time
            } else {
                let freed = if s.feasible { cs.excess } else { cs.excess - s.excess };
                if freed == 0 {
                    continue;
                }
                (s.time - cs.time) / freed as f64
            };
            if pick.map_or(true, |(v, _)| value < v) {
                pick = Some((value, k));
            }
        }
        pick.map(|(_, k)| (moves[k], scores[k]))
    }

    /// One pass of ejection chains from `plan` (module documentation). Returns whether the plan
    /// improved.
    fn eject(&mut self, plan: &mut Vec<Action>, current: &mut Score) -> bool {
        if !current.feasible {
            return false;
        }
        let n = self.g.n;
        let mut moves = Vec::new();
        for j in 0..n {
            for a in Action::ALL {
                if a != plan[j] {
                    moves.push(Move { first: (j, a), second: None });
                }
            }
        }
        // The step time of each change with unlimited memory.
        let free = self.scores(plan, &moves, u64::MAX);
        let mut firsts: Vec<(f64, Move)> =
            free.iter().zip(&moves).filter(|(s, _)| s.time < current.time).map(|(s, m)| (s.time, *m)).collect();
        firsts.sort_by(|x, y| x.0.total_cmp(&y.0));
        let mut improved = false;
        let mut cur = plan.clone();
        let mut locked = vec![false; n];
        firsts.truncate(CHAINS_PER_PASS);
        for &(free_time, first) in &firsts {
            let (j, a) = first.first;
            if plan[j] == a || free_time >= current.time {
                continue;
            }
            cur.clone_from(plan);
            locked.iter_mut().for_each(|l| *l = false);
            cur[j] = a;
            locked[j] = true;
            let mut cs = self.score(&cur);
            self.free_swaps(&mut cur, &mut cs, &locked);
            // Once the chain fits, one more repair (the fastest change): a chain that wins
            // does so then, if at all.
            let mut fitting_repairs = 0;
            for _ in 0..CHAIN_ROUNDS {
                if cs.better_than(current) || (cs.feasible && fitting_repairs == 1) {
                    break;
                }
                if cs.feasible {
                    fitting_repairs += 1;
                }
                let Some((m, s)) = self.repair(&cur, &cs, &locked, current) else { break };
                m.apply(&mut cur);
                locked[m.first.0] = true;
                cs = s;
            }
            if cs.better_than(current) {
                plan.clone_from(&cur);
                *current = cs;
                improved = true;
            }
        }
        improved
    }

    /// Polish one plan (module documentation) with pairs at most [`PAIR_WINDOW`] apart.
    pub(crate) fn polish(&mut self, mut plan: Vec<Action>, mut current: Score) -> (Vec<Action>, Score) {
        loop {
            self.descend(&mut plan, &mut current);
            if !current.feasible || !self.eject(&mut plan, &mut current) {
                break;
            }
        }
        self.tidy(&mut plan, &mut current);
        (plan, current)
    }
}

/// Polished plans: the best, and every distinct feasible plan the polish of a start (or of the
/// best, with pairs at any distance) ended at.
pub struct Polished {
    pub best: (Vec<Action>, Score),
    pub plans: Vec<(Vec<Action>, Score)>,
    pub evaluations: u64,
}

/// Polish each start in turn (module documentation), then the best result again with pairs at
/// any distance (None without starts).
pub fn polish(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    pool: &rayon::ThreadPool,
    starts: Vec<(Vec<Action>, Score)>,
) -> Option<Polished> {
    let mut search = Polisher::new(g, budget, opts, pool);
    let mut best: Option<(Vec<Action>, Score)> = None;
    let mut plans = Vec::new();
    for (plan, s) in starts {
        let (p, ps) = search.polish(plan, s);
        if best.as_ref().map_or(true, |(_, bs)| ps.better_than(bs)) {
            best = Some((p.clone(), ps));
        }
        add_distinct(&mut plans, p, ps);
    }
    let (plan, s) = best?;
    search.window = g.n;
    let (plan, s) = search.polish(plan, s);
    add_distinct(&mut plans, plan.clone(), s);
    Some(Polished { best: (plan, s), plans, evaluations: search.evaluations })
}

/// Add a feasible plan to `plans` unless it is there already.
pub(crate) fn add_distinct(plans: &mut Vec<(Vec<Action>, Score)>, plan: Vec<Action>, s: Score) {
    if s.feasible && !plans.iter().any(|(p, _)| *p == plan) {
        plans.push((plan, s));
    }
}
