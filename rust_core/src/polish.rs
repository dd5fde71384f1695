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
//!    second of step time (once the plan fits, the fastest change, at most
//!    [`FITTING_REPAIRS`] times), or at once the
//!    change that makes it beat the plan; each unit changed at most once, at most
//!    [`CHAIN_ROUNDS`] changes. The [`CHAINS_PER_PASS`] most promising first changes (fastest
//!    with unlimited memory) are tried per pass; a chain that ends faster than the plan replaces
//!    it. A chain often needs several repairs (five cheap GELU recomputations to retain one
//!    attention projection of a GPT block), which pair moves cannot find.
//!
//! Then every swap the plan does without at no cost is undone (fewer copies, same score). The
//! starts are polished at once, each on its own; the best polished start is polished once more
//! with pairs at any distance.
//!
//! Every step only replaces the plan with a better one, so the polish never makes PSO's result
//! worse. Scans are evaluated in parallel in fixed batches and the first improvement in scan
//! order is taken, so the result and the evaluation count do not depend on the thread count.
//! A plan evaluated before (by this polish, the swarm before it, or the relinking after it; a
//! restart's polish, by that restart) is answered from what that evaluation found (crate::memo),
//! the same answer.

use crate::action::Action;
use crate::evaluator::{EvalOptions, Score};
use crate::incremental::{Base, Context, Worker};
use crate::memo::{normalized, ScoreMemo};
use crate::profile::Graph;
use crate::space::Space;
use crate::threads::Threads;

/// Most repairs after the first change of an ejection chain.
pub const CHAIN_ROUNDS: usize = 8;

/// Repairs of an ejection chain once it fits (each the fastest single change). The first
/// change's excess is often repaired by swaps that fit but stall; the fastest changes after that
/// turn them back (on inception_v3 at 0.25: two such repairs find a plan 1.9% faster, which one
/// does not reach).
pub const FITTING_REPAIRS: usize = 2;

/// Ejection chains tried per pass (the most promising first changes).
pub const CHAINS_PER_PASS: usize = 24;

/// Pair moves of the descent change units at most this far apart (in unit order), except in the
/// last polish of the best start. Far pairs are mostly a unit retained and another made to free
/// its memory, which the ejection chains find.
pub const PAIR_WINDOW: usize = 8;

/// Candidate moves evaluated together in a scan (fixed, so that the evaluation count does not
/// depend on the thread count).
const BATCH: usize = 64;

/// How many changes a relinking step evaluates before the rest, unbounded, at once: their best
/// bounds the rest. A constant, not the thread count, so that what the search simulates (and
/// learns in its memo) does not depend on the thread count (one change alone left the second
/// thread idle; two are the default threads of a 2-core machine).
const HEAD_CHANGES: usize = 2;

/// A change of one or two dimensions of the space (a unit each in the full space).
#[derive(Debug, Clone, Copy)]
struct Move {
    first: (usize, Action),
    second: Option<(usize, Action)>,
}

impl Move {
    fn apply(&self, space: &Space, plan: &mut [Action]) {
        space.set(plan, self.first.0, self.first.1);
        if let Some((k, a)) = self.second {
            space.set(plan, k, a);
        }
    }

    fn undo(&self, space: &Space, plan: &mut [Action], from: &[Action]) {
        space.reset(plan, self.first.0, from);
        if let Some((k, _)) = self.second {
            space.reset(plan, k, from);
        }
    }

    /// The first unit the move changes.
    fn first_unit(&self, space: &Space) -> usize {
        let f = space.first(self.first.0);
        self.second.map_or(f, |(k, _)| f.min(space.first(k)))
    }
}

/// The scores the polish knows (crate::memo), under the budget and with unlimited memory; passed
/// from one polisher to the next of a search.
#[derive(Debug, Default)]
pub struct Memos {
    pub(crate) budget: ScoreMemo,
    free: ScoreMemo,
}

impl Memos {
    /// For plans of `n` units; a disabled memo knows nothing (every plan is evaluated).
    pub fn new(n: usize, enabled: bool) -> Memos {
        Memos { budget: ScoreMemo::new(n, enabled), free: ScoreMemo::new(n, enabled) }
    }

    /// Questions answered without an evaluation.
    pub fn hits(&self) -> u64 {
        self.budget.hits + self.free.hits
    }
}

/// Start `memo`'s key at its loaded plan with `m` applied.
fn key_of_move(memo: &mut ScoreMemo, space: &Space, m: &Move) {
    memo.start();
    for (k, a) in std::iter::once(m.first).chain(m.second) {
        for &u in space.group(k) {
            memo.set(u, a);
        }
    }
}

/// The local search's state: the evaluator's inputs, the current plans' saved states
/// (crate::incremental), the scores known (crate::memo) and the evaluations made so far.
pub(crate) struct Polisher<'a> {
    g: &'a Graph,
    space: &'a Space,
    pool: &'a Threads,
    ctx: Context<'a>,
    /// The same profile with unlimited memory (the ejection chains' first changes).
    free_ctx: Context<'a>,
    base: Option<Base>,
    free_base: Option<Base>,
    worker: Worker,
    /// Scores known: a plan evaluated again is answered from here (the same answer).
    pub(crate) memos: Memos,
    evaluations: u64,
    /// Stages simulated by the parallel scans (the worker counts the rest).
    stages: u64,
    /// Per dimension: some unit of it can be swapped (it has activations and a backward reader).
    swappable: Vec<bool>,
    /// Pairs of the descent at most this far apart (in dimensions).
    window: usize,
    /// Ejection chains change only dimensions at most this far from their first change (None:
    /// any).
    pub(crate) chain_window: Option<usize>,
}

impl<'a> Polisher<'a> {
    pub(crate) fn new(g: &'a Graph, budget: u64, opts: &'a EvalOptions, pool: &'a Threads, space: &'a Space) -> Self {
        let ctx = Context::new(g, budget, opts);
        let free_ctx = ctx.with_budget(u64::MAX);
        let swappable = (0..space.dims())
            .map(|k| space.allows(Action::Swap) && space.group(k).iter().any(|&u| g.act[u] > 0 && g.first_need[u].is_some()))
            .collect();
        Polisher {
            g,
            space,
            pool,
            ctx,
            free_ctx,
            base: None,
            free_base: None,
            worker: Worker::new(g.n),
            memos: Memos::default(),
            evaluations: 0,
            stages: 0,
            swappable,
            window: PAIR_WINDOW,
            chain_window: None,
        }
    }

    pub(crate) fn evaluations(&self) -> u64 {
        self.evaluations
    }

    /// Forward and backward stages simulated (incremental evaluations simulate fewer than two
    /// per unit).
    pub(crate) fn stages(&self) -> u64 {
        self.stages + self.worker.stages
    }

    /// Scores of `plan` with each of `changes` (one dimension set to one action) applied alone,
    /// in parallel (in order, whatever the thread count). The first [`HEAD_CHANGES`] changes are
    /// evaluated first (at once) and the best of them bounds the others: a change it beats is
    /// not the best one, and scores None. (Which changes score None, and so the work, does not
    /// depend on the thread count either.)
    pub(crate) fn scores_of_changes(&mut self, plan: &[Action], changes: &[(usize, Action)]) -> Vec<Option<Score>> {
        let moves: Vec<Move> = changes.iter().map(|&first| Move { first, second: None }).collect();
        let head = moves.len().min(HEAD_CHANGES);
        let mut out = self.scores(plan, &moves[..head], false, None);
        let best = out.iter().flatten().copied().reduce(|b, s| if s.better_than(&b) { s } else { b });
        out.extend(self.scores(plan, &moves[head..], false, best));
        out
    }

    /// Make the saved states of `free` (unlimited memory) or the budget's those of `plan`.
    fn ensure_base(&mut self, plan: &[Action], free: bool) {
        let (ctx, slot) = if free { (&self.free_ctx, &mut self.free_base) } else { (&self.ctx, &mut self.base) };
        match slot {
            Some(b) if b.plan == plan => return,
            Some(b) => ctx.rebase(b, plan, &mut self.worker),
            None => *slot = Some(ctx.base(plan, &mut self.worker)),
        }
        let score = slot.as_ref().expect("a base").score;
        let memo = if free { &mut self.memos.free } else { &mut self.memos.budget };
        if memo.enabled() {
            memo.start_at(plan);
            memo.put(None, Some(score));
        }
    }

    /// Set dimension `k` of `plan` to `a` and score it (None: strictly worse than `bound`). The
    /// change stays; the caller undoes it.
    fn set_and_score(&mut self, plan: &mut [Action], k: usize, a: Action, bound: Option<Score>) -> Option<Score> {
        self.evaluations += 1;
        if self.memos.budget.enabled() {
            let memo = &mut self.memos.budget;
            memo.start_at(plan);
            for &u in self.space.group(k) {
                memo.set(u, a);
            }
            if let Some(known) = memo.get(bound) {
                self.space.set(plan, k, a);
                return known;
            }
        }
        self.ensure_base(plan, false);
        self.space.set(plan, k, a);
        let base = self.base.as_ref().expect("a base");
        let s = self.ctx.score(base, plan, self.space.first(k), bound, &mut self.worker);
        let memo = &mut self.memos.budget;
        if memo.enabled() {
            memo.start_at(plan);
            memo.put(bound, s);
        }
        normalized(s, bound)
    }

    /// Scores of `moves` applied (each alone) to `plan` (under unlimited memory when `free`), in
    /// parallel; None for a move strictly worse than `bound`.
    fn scores(&mut self, plan: &[Action], moves: &[Move], free: bool, bound: Option<Score>) -> Vec<Option<Score>> {
        if moves.is_empty() {
            return Vec::new();
        }
        self.evaluations += moves.len() as u64;
        let space = self.space;
        // What is known already; the rest is evaluated.
        let mut out = vec![None; moves.len()];
        let mut todo: Vec<usize> = Vec::with_capacity(moves.len());
        let memo = if free { &mut self.memos.free } else { &mut self.memos.budget };
        if memo.enabled() {
            memo.load(plan);
            for (i, m) in moves.iter().enumerate() {
                key_of_move(memo, space, m);
                match memo.get(bound) {
                    Some(known) => out[i] = known,
                    None => todo.push(i),
                }
            }
            if todo.is_empty() {
                return out;
            }
        } else {
            todo.extend(0..moves.len());
        }
        self.ensure_base(plan, free);
        let (ctx, base) = if free { (&self.free_ctx, &self.free_base) } else { (&self.ctx, &self.base) };
        let base = base.as_ref().expect("a base");
        let n = self.g.n;
        let results: Vec<(Option<Score>, u64)> = self.pool.map(
            &todo,
            || (Worker::new(n), plan.to_vec()),
            |(w, p), &i| {
                let m = &moves[i];
                m.apply(space, p);
                let before = w.stages;
                let s = ctx.score(base, p, m.first_unit(space), bound, w);
                m.undo(space, p, plan);
                (s, w.stages - before)
            },
        );
        self.stages += results.iter().map(|r| r.1).sum::<u64>();
        let memo = if free { &mut self.memos.free } else { &mut self.memos.budget };
        if memo.enabled() {
            memo.load(plan);
        }
        for (&i, (s, _)) in todo.iter().zip(results) {
            if memo.enabled() {
                key_of_move(memo, space, &moves[i]);
                memo.put(bound, s);
            }
            out[i] = normalized(s, bound);
        }
        out
    }

    /// The first of `moves` (in order) that makes `plan` better than `current`, evaluated in
    /// batches; with its score.
    fn first_better(&mut self, plan: &[Action], current: &Score, moves: &[Move]) -> Option<(usize, Score)> {
        for (c, chunk) in moves.chunks(BATCH).enumerate() {
            let scores = self.scores(plan, chunk, false, Some(*current));
            if let Some((k, s)) = scores.iter().enumerate().find_map(|(k, s)| s.filter(|s| s.better_than(current)).map(|s| (k, s))) {
                return Some((c * BATCH + k, s));
            }
        }
        None
    }

    /// Descent by single and pair moves, first improvement in scan order, until none improves.
    fn descend(&mut self, plan: &mut [Action], current: &mut Score) {
        let (space, window) = (self.space, self.window);
        let n = space.dims();
        let mut moves: Vec<Move> = Vec::new();
        loop {
            let mut improved = false;
            let mut from = 0;
            loop {
                moves.clear();
                for j in from..n {
                    for &a in space.actions() {
                        if a != space.action(plan, j) {
                            moves.push(Move { first: (j, a), second: None });
                        }
                    }
                }
                let Some((k, s)) = self.first_better(plan, current, &moves) else { break };
                moves[k].apply(space, plan);
                *current = s;
                improved = true;
                from = moves[k].first.0 + 1;
                if self.ctx.is_optimal(current) {
                    return;
                }
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
                    let (oi, oj) = (space.action(plan, ri), space.action(plan, rj));
                    if !(oi == Action::Retain && oj == Action::Retain) {
                        for &ai in space.actions() {
                            for &aj in space.actions() {
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
                        moves[k].apply(space, plan);
                        *current = s;
                        improved = true;
                        if self.ctx.is_optimal(current) {
                            return;
                        }
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

    /// Swap every retained dimension (not `locked`) whose swap makes the plan no worse and no
    /// slower, in order, each on top of the earlier ones. Returns whether any changed.
    fn free_swaps(&mut self, plan: &mut [Action], current: &mut Score, locked: &[bool]) -> bool {
        let space = self.space;
        let dims: Vec<usize> =
            (0..space.dims()).filter(|&j| space.action(plan, j) == Action::Retain && !locked[j] && self.swappable[j]).collect();
        self.keep_changes(plan, current, &dims, Action::Swap, |c, s| !c.better_than(s) && s.time <= c.time)
    }

    /// Undo every swap the plan does without at no cost.
    fn tidy(&mut self, plan: &mut [Action], current: &mut Score) {
        let space = self.space;
        let dims: Vec<usize> = (0..space.dims()).filter(|&j| space.action(plan, j) == Action::Swap).collect();
        self.keep_changes(plan, current, &dims, Action::Retain, |c, s| !c.better_than(s));
    }

    /// Set each of `dims` in order to `a` on top of the changes kept before it, keeping the
    /// change when `keep(current, its score)` (a change worse than `current` scores None).
    /// Returns whether any was kept. On more than two threads, one change per thread is scored
    /// at once against the plan as it stands, and the first kept one is kept; the changes after
    /// it are scored again on top of it (the same changes kept and evaluations counted as one
    /// at a time). On two threads one at a time: 64 at once was slower there (plain20 at 0.25,
    /// the search 1.62 s against 1.34).
    fn keep_changes(&mut self, plan: &mut [Action], current: &mut Score, dims: &[usize], a: Action, keep: impl Fn(&Score, &Score) -> bool) -> bool {
        let mut changed = false;
        let threads = self.pool.count();
        if threads <= 2 {
            for &j in dims {
                let old = self.space.action(plan, j);
                match self.set_and_score(plan, j, a, Some(*current)) {
                    Some(s) if keep(current, &s) => {
                        *current = s;
                        changed = true;
                    }
                    _ => self.space.set(plan, j, old),
                }
            }
            return changed;
        }
        let mut at = 0;
        while at < dims.len() {
            let moves: Vec<Move> = dims[at..(at + threads).min(dims.len())].iter().map(|&k| Move { first: (k, a), second: None }).collect();
            let scores = self.scores(plan, &moves, false, Some(*current));
            let kept = scores.iter().position(|s| s.is_some_and(|s| keep(current, &s)));
            let scored = kept.map_or(moves.len(), |i| i + 1);
            self.evaluations -= (moves.len() - scored) as u64;
            if let Some(i) = kept {
                moves[i].apply(self.space, plan);
                *current = scores[i].expect("a kept change is scored");
                changed = true;
            }
            at += scored;
        }
        changed
    }

    /// The repair of an ejection chain from `cur` (score `cs`), among the single changes of
    /// dimensions not `locked`: the one that makes the chain beat `target` (the plan it started
    /// from) by the most; else one that makes `cur` better than `cs`: when `cs` fits, the
    /// fastest; when not, the one that costs the least step time per byte of excess it removes
    /// (the first in order on a tie). (`cs` is not better than `target`, so a change that does
    /// not beat `cs` does neither, and is not evaluated to the end; nor, when `cs` does not fit,
    /// is one that does not lower its excess.)
    fn repair(&mut self, cur: &[Action], cs: &Score, locked: &[bool], target: &Score) -> Option<(Move, Score)> {
        let space = self.space;
        let mut moves = Vec::new();
        for k in 0..space.dims() {
            if !locked[k] {
                for &b in space.actions() {
                    if b != space.action(cur, k) {
                        moves.push(Move { first: (k, b), second: None });
                    }
                }
            }
        }
        // When `cs` does not fit, a change that leaves its excess is worth nothing (it frees no
        // memory, and a change that beats `target` fits): such changes score None.
        let bound = if cs.feasible { *cs } else { Score { feasible: false, excess: cs.excess - 1, time: f64::INFINITY } };
        let scores = self.scores(cur, &moves, false, Some(bound));
        // A change that makes the chain beat the plan it started from ends it: the best such.
        let mut win: Option<(usize, Score)> = None;
        for (k, s) in scores.iter().enumerate() {
            let Some(s) = s else { continue };
            if s.better_than(target) && win.map_or(true, |(_, w)| s.better_than(&w)) {
                win = Some((k, *s));
            }
        }
        if let Some((k, s)) = win {
            return Some((moves[k], s));
        }
        let mut pick: Option<(f64, usize, Score)> = None;
        for (k, s) in scores.iter().enumerate() {
            let Some(s) = s else { continue };
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
            if pick.map_or(true, |(v, _, _)| value < v) {
                pick = Some((value, k, *s));
            }
        }
        pick.map(|(_, k, s)| (moves[k], s))
    }

    /// One pass of ejection chains from `plan` (module documentation). Returns whether the plan
    /// improved.
    fn eject(&mut self, plan: &mut Vec<Action>, current: &mut Score) -> bool {
        if !current.feasible {
            return false;
        }
        let space = self.space;
        let n = space.dims();
        let mut moves = Vec::new();
        for j in 0..n {
            for &a in space.actions() {
                if a != space.action(plan, j) {
                    moves.push(Move { first: (j, a), second: None });
                }
            }
        }
        // The step time of each change with unlimited memory (those not faster than the plan
        // are not evaluated to the end: they are not first changes).
        let bound = Score { feasible: true, excess: 0, time: current.time };
        let free = self.scores(plan, &moves, true, Some(bound));
        let mut firsts: Vec<(f64, Move)> = free
            .iter()
            .zip(&moves)
            .filter_map(|(s, m)| s.filter(|s| s.time < current.time).map(|s| (s.time, *m)))
            .collect();
        firsts.sort_by(|x, y| x.0.total_cmp(&y.0));
        let mut improved = false;
        let mut cur = plan.clone();
        let mut locked = vec![false; n];
        firsts.truncate(CHAINS_PER_PASS);
        for &(free_time, first) in &firsts {
            let (j, a) = first.first;
            if space.action(plan, j) == a || free_time >= current.time {
                continue;
            }
            cur.clone_from(plan);
            match self.chain_window {
                None => locked.iter_mut().for_each(|l| *l = false),
                Some(w) => locked.iter_mut().enumerate().for_each(|(k, l)| *l = k.abs_diff(j) > w),
            }
            locked[j] = true;
            let mut cs = self.set_and_score(&mut cur, j, a, None).expect("no bound");
            self.free_swaps(&mut cur, &mut cs, &locked);
            // Once the chain fits, at most FITTING_REPAIRS more (each the fastest change): a
            // chain that wins does so then, if at all.
            let mut fitting_repairs = 0;
            for _ in 0..CHAIN_ROUNDS {
                if cs.better_than(current) || (cs.feasible && fitting_repairs == FITTING_REPAIRS) {
                    break;
                }
                if cs.feasible {
                    fitting_repairs += 1;
                }
                let Some((m, s)) = self.repair(&cur, &cs, &locked, current) else { break };
                m.apply(space, &mut cur);
                locked[m.first.0] = true;
                cs = s;
            }
            if cs.better_than(current) {
                plan.clone_from(&cur);
                *current = cs;
                improved = true;
                if self.ctx.is_optimal(current) {
                    break;
                }
            }
        }
        improved
    }

    /// Polish one plan (module documentation) with pairs at most [`PAIR_WINDOW`] apart.
    /// (A plan no plan can beat, crate::incremental's `Context::is_optimal`, is only tidied.)
    pub(crate) fn polish(&mut self, mut plan: Vec<Action>, mut current: Score) -> (Vec<Action>, Score) {
        while !self.ctx.is_optimal(&current) {
            self.descend(&mut plan, &mut current);
            if !current.feasible || self.ctx.is_optimal(&current) || !self.eject(&mut plan, &mut current) {
                break;
            }
        }
        self.tidy(&mut plan, &mut current);
        (plan, current)
    }

    /// Undo every swap `plan` does without at no cost (the polish's last step).
    pub(crate) fn tidied(&mut self, mut plan: Vec<Action>, mut current: Score) -> (Vec<Action>, Score) {
        self.tidy(&mut plan, &mut current);
        (plan, current)
    }

    /// No plan beats one scoring `s`.
    pub(crate) fn is_optimal(&self, s: &Score) -> bool {
        self.ctx.is_optimal(s)
    }
}

/// Polished plans: the best, and every distinct feasible plan the polish of a start (or of the
/// best, with pairs at any distance) ended at.
pub struct Polished {
    pub best: (Vec<Action>, Score),
    pub plans: Vec<(Vec<Action>, Score)>,
    pub evaluations: u64,
    /// Forward and backward stages simulated.
    pub stages: u64,
}

/// Polish each start (plans of `space`; at once, each on its own) as the module documentation
/// says, then the best result again with pairs at any distance (None without starts). The
/// scores known are taken from `memos` and handed back with what the polish learnt.
pub fn polish(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    pool: &Threads,
    space: &Space,
    starts: Vec<(Vec<Action>, Score)>,
    memos: &mut Memos,
) -> Option<Polished> {
    if starts.is_empty() {
        return None;
    }
    // The starts are polished at once, each with memos of its own (the first with `memos`);
    // the best is polished again with the memos of its first polish.
    let enabled = memos.budget.enabled();
    let mut runs: Vec<(Vec<Action>, Score, Memos)> = starts
        .into_iter()
        .enumerate()
        .map(|(i, (p, s))| (p, s, if i == 0 { std::mem::take(memos) } else { Memos::new(g.n, enabled) }))
        .collect();
    let done = pool.map_mut(
        &mut runs,
        || (),
        |_, _, (plan, s, memos)| {
            let mut search = Polisher::new(g, budget, opts, pool, space);
            search.memos = std::mem::take(memos);
            let (p, ps) = search.polish(std::mem::take(plan), *s);
            *memos = std::mem::take(&mut search.memos);
            (p, ps, search.evaluations, search.stages())
        },
    );
    let mut search = Polisher::new(g, budget, opts, pool, space);
    let mut best: Option<(Vec<Action>, Score)> = None;
    let mut plans = Vec::new();
    for ((p, ps, evaluations, stages), (_, _, run_memos)) in done.into_iter().zip(runs) {
        search.evaluations += evaluations;
        search.stages += stages;
        if best.as_ref().map_or(true, |(_, bs)| ps.better_than(bs)) {
            best = Some((p.clone(), ps));
            search.memos = run_memos;
        }
        add_distinct(&mut plans, p, ps);
    }
    let (plan, s) = best.expect("at least one start");
    search.window = space.dims();
    let (plan, s) = search.polish(plan, s);
    *memos = std::mem::take(&mut search.memos);
    add_distinct(&mut plans, plan.clone(), s);
    Some(Polished { best: (plan, s), plans, evaluations: search.evaluations, stages: search.stages() })
}

/// Add a feasible plan to `plans` unless it is there already.
pub(crate) fn add_distinct(plans: &mut Vec<(Vec<Action>, Score)>, plan: Vec<Action>, s: Score) {
    if s.feasible && !plans.iter().any(|(p, _)| *p == plan) {
        plans.push((plan, s));
    }
}
