//! Incremental evaluation of the search's moves: the evaluator's own simulation, resumed from a
//! saved state and stopped early by a bound that cannot be wrong.
//!
//! A move of the search (polish, restarts, path relinking) changes a plan from some unit j on.
//! The evaluator's forward stage Fi reads only the actions of units up to i and what follows from
//! them (runs of recomputed units, what a recomputed unit holds), so the simulation's state at
//! the start of Fi is the same for every plan that agrees on the units before i. A [`Base`] is a
//! plan evaluated once with its state saved at the start of every `stride`-th forward stage; a
//! move is evaluated by restoring the latest saved state at or before the first stage it can
//! affect and running the same simulation (crate::evaluator) from there. The first stage a move
//! at unit j can affect is taken conservatively as the start of the run of recomputed units that
//! j would join or split (j itself when unit j - 1 is not recomputed or j starts a segment):
//! what a segment holds and regenerates depends on all of its units, and a rule of the cost model
//! that charged something at a segment's first stage would still be resumed before it.
//!
//! The swarm's sweep changes one dimension of a particle at a time, front to back: there a
//! worker keeps the states of the particle's own plan, saved by its candidates' evaluations up to
//! the stage each can affect (which the plan and the candidate share), and each candidate resumes
//! from the latest one ([`Context::score_changed`]); a kept change forgets the states after the
//! stage it affects ([`Context::changed`]).
//!
//! The bound: a search only needs to know whether a move beats a score (the current plan's, the
//! other candidate's). The step time only grows (stage times, stalls and replays are never
//! negative) and the excess over the budget never shrinks, so after each stage the simulation
//! stops when even the stage times and replays still to run cannot bring the plan under the
//! bound's time, or its excess already rules it out (crate::evaluator's `Hooks`). Which units the
//! backward replays follows from the plan alone, so their forward times are known before it
//! runs. Such a move is strictly worse than the bound, which is all the search uses (crate::memo
//! keeps it as such).
//!
//! A step whose first overflow blames prefetches issued ahead of their need is simulated again
//! with them issued later (crate::evaluator's `run_with_events`; the run that will be retried
//! stops at the end of that stage); the hooked evaluation does the same, each run resumed from
//! the same state (prefetches are issued in the backward only). A run that a retry may follow
//! (a plan with swaps, before a first overflow) is bounded from where a retry would part from
//! it: the first prefetch it issued ahead of its need whose need has not come yet (a retry
//! issues fewer of them, and is this run up to there); a run that is the last (after a first
//! overflow that blamed none, a plan without swaps) from where it is, as is any forward stage,
//! which every run simulates alike.
//!
//! Both only skip work: a resumed simulation is the full one's, bit for bit (tested on random
//! moves over random profiles, rust_core/tests/incremental.rs).

use crate::action::Action;
use crate::evaluator::{score_hooked, EvalOptions, Hooks, Score, Scratch, SimState};
use crate::profile::Graph;

/// Saved states per plan, at most (plus the state at F0): the stride is n / this, at least 1.
pub const SAVED_STATES: usize = 32;

/// What evaluations of one profile under one budget share: the remaining stage times after each
/// stage, and where states are saved.
#[derive(Debug, Clone)]
pub struct Context<'a> {
    pub g: &'a Graph,
    pub budget: u64,
    pub opts: &'a EvalOptions,
    pub starts: &'a [bool],
    stride: usize,
    rest_after_fwd: Vec<f64>,
    rest_after_bwd: Vec<f64>,
    min_time: f64,
}

/// One thread's evaluation buffers and the work it did.
#[derive(Debug, Clone, Default)]
pub struct Worker {
    pub scratch: Scratch,
    /// Forward and backward stages simulated so far (a work count that does not depend on the
    /// machine's load).
    pub stages: u64,
    /// The states of the plan a caller changes one dimension at a time
    /// ([`Context::score_changed`]): `prefix[k]` is its state at the start of forward stage
    /// `k * stride`, for k up to `prefix_valid`.
    prefix: Vec<SimState>,
    prefix_valid: usize,
    /// The last slot the last evaluation saved (None: none).
    saved: Option<usize>,
}

impl Worker {
    pub fn new(n: usize) -> Worker {
        Worker { scratch: Scratch::new(n), ..Worker::default() }
    }
}

/// A plan, its score, and its simulation's state at the start of forward stages 0, stride,
/// 2 stride, ...
#[derive(Debug, Clone)]
pub struct Base {
    pub plan: Vec<Action>,
    pub score: Score,
    states: Vec<SimState>,
}

impl<'a> Context<'a> {
    /// Evaluations under the graph's default checkpoint segments.
    pub fn new(g: &'a Graph, budget: u64, opts: &'a EvalOptions) -> Self {
        Self::with_starts(g, budget, opts, &g.block_start)
    }

    pub fn with_starts(g: &'a Graph, budget: u64, opts: &'a EvalOptions, starts: &'a [bool]) -> Self {
        let n = g.n;
        // The stage times still to run after each stage (the optimizer step in one call, the
        // only one a search evaluation has, included).
        let opt = if g.has_optimizer { g.opt_step_time } else { 0.0 };
        let mut rest_after_bwd = vec![0.0; n];
        let mut acc = opt;
        for i in 0..n {
            rest_after_bwd[i] = acc;
            acc += g.bwd_time[i];
        }
        let mut rest_after_fwd = vec![0.0; n];
        for i in (0..n).rev() {
            rest_after_fwd[i] = acc;
            acc += g.fwd_time[i];
        }
        // The step time of a plan that never waits and replays nothing, added up in the order the
        // simulation adds the stage times (so that such a plan's step time is this, bit for bit).
        let mut min_time = 0.0;
        for i in 0..n {
            min_time += g.fwd_time[i];
        }
        for i in (0..n).rev() {
            min_time += g.bwd_time[i];
        }
        if g.has_optimizer {
            min_time += g.opt_step_time;
        }
        Context { g, budget, opts, starts, stride: n.div_ceil(SAVED_STATES).max(1), rest_after_fwd, rest_after_bwd, min_time }
    }

    /// No plan is faster than one scoring `s`: it fits and its step is the sum of the stage times
    /// (step time = compute + swap stall + recompute, and neither of the last two is negative).
    pub fn is_optimal(&self, s: &Score) -> bool {
        s.feasible && s.time <= self.min_time
    }

    /// A budget of its own (the polish's unlimited-memory scan), same profile.
    pub fn with_budget(&self, budget: u64) -> Self {
        Context { budget, ..self.clone() }
    }

    fn slots(&self) -> usize {
        self.g.n.div_ceil(self.stride) + 1
    }

    /// The first forward stage a plan that differs from `plan` at unit `j` (and maybe after it,
    /// not before) can simulate differently: the first unit of the run of recomputed units
    /// before j that j could join or split, else j.
    pub fn affected_from(&self, plan: &[Action], j: usize) -> usize {
        let mut k = j;
        while k > 0 && !self.starts[k] && plan[k - 1] == Action::Recompute {
            k -= 1;
        }
        k
    }

    /// Evaluate `plan` in full, saving its states.
    pub fn base(&self, plan: &[Action], w: &mut Worker) -> Base {
        let mut states = vec![SimState::default(); self.slots()];
        let score = self.run(plan, None, 0, &mut states, None, w).expect("no bound");
        Base { plan: plan.to_vec(), score, states }
    }

    /// Make `base` the base of `plan`: resume from the first stage where they can differ and
    /// save the states from there on.
    pub fn rebase(&self, base: &mut Base, plan: &[Action], w: &mut Worker) {
        let Some(j) = (0..plan.len()).find(|&u| plan[u] != base.plan[u]) else { return };
        let slot = self.affected_from(&base.plan, j) / self.stride;
        let (head, tail) = base.states.split_at_mut(slot + 1);
        let resume = if slot == 0 { None } else { Some(&head[slot]) };
        base.score = self.run(plan, resume, slot + 1, tail, None, w).expect("no bound");
        base.plan.copy_from_slice(plan);
    }

    /// The score of `plan`, which agrees with `base.plan` on every unit before `changed_from`;
    /// None when it cannot beat `bound` (then it is strictly worse).
    pub fn score(
        &self,
        base: &Base,
        plan: &[Action],
        changed_from: usize,
        bound: Option<Score>,
        w: &mut Worker,
    ) -> Option<Score> {
        let changed_from = changed_from.min(plan.len().saturating_sub(1));
        debug_assert!(plan[..changed_from] == base.plan[..changed_from], "the plan differs before changed_from");
        let slot = self.affected_from(&base.plan, changed_from) / self.stride;
        let resume = if slot == 0 { None } else { Some(&base.states[slot]) };
        self.run(plan, resume, 0, &mut [], bound, w)
    }

    /// The score of `plan` from scratch (None when it cannot beat `bound`).
    pub fn score_full(&self, plan: &[Action], bound: Option<Score>, w: &mut Worker) -> Option<Score> {
        self.run(plan, None, 0, &mut [], bound, w)
    }

    /// Start a plan that the caller changes one dimension at a time and scores with
    /// [`Context::score_changed`] (the swarm's sweep): no state of it is known yet.
    pub fn start_changes(&self, w: &mut Worker) {
        if w.prefix.len() != self.slots() {
            w.prefix = vec![SimState::default(); self.slots()];
        }
        w.prefix_valid = 0;
    }

    /// The plan of [`Context::start_changes`] changes from unit `changed_from` on (units before
    /// it stay): its states from the first stage that can differ are no longer known. `plan` is
    /// the plan before or after the change (the two agree before `changed_from`).
    pub fn changed(&self, plan: &[Action], changed_from: usize, w: &mut Worker) {
        w.prefix_valid = w.prefix_valid.min(self.affected_from(plan, changed_from) / self.stride);
    }

    /// The score of `plan` (None when it cannot beat `bound`), which agrees with the plan of
    /// [`Context::start_changes`] on every unit before `changed_from`: resumed from that plan's
    /// latest known state at or before the first stage the change can affect, and saving the
    /// states up to that stage, which the two plans share. Exact, as [`Context::score`].
    pub fn score_changed(&self, plan: &[Action], changed_from: usize, bound: Option<Score>, w: &mut Worker) -> Option<Score> {
        let last = self.affected_from(plan, changed_from.min(plan.len().saturating_sub(1))) / self.stride;
        let from = w.prefix_valid.min(last);
        let mut prefix = std::mem::take(&mut w.prefix);
        let (head, tail) = prefix.split_at_mut(from + 1);
        let resume = if from == 0 { None } else { Some(&head[from]) };
        let s = self.run(plan, resume, from + 1, &mut tail[..last - from], bound, w);
        w.prefix = prefix;
        if let Some(k) = w.saved {
            w.prefix_valid = w.prefix_valid.max(k);
        }
        s
    }

    fn run(
        &self,
        plan: &[Action],
        resume: Option<&SimState>,
        first_slot: usize,
        save: &mut [SimState],
        bound: Option<Score>,
        w: &mut Worker,
    ) -> Option<Score> {
        let mut hooks = Hooks {
            resume,
            stride: self.stride,
            first_slot,
            save,
            bound,
            rest_after_fwd: &self.rest_after_fwd,
            rest_after_bwd: &self.rest_after_bwd,
            stages: 0,
            swaps: false,
            replays: 0.0,
            saved: None,
        };
        let s = score_hooked(self.g, plan, self.starts, self.budget, self.opts, &mut w.scratch, &mut hooks);
        w.stages += hooks.stages;
        w.saved = hooks.saved;
        s
    }
}
