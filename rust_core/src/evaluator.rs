//! The policy evaluator (HOME Algorithm 2): a deterministic simulation of one training step over
//! a compute stream and one FIFO copy stream (or one per direction when the device has two copy
//! engines). The rules are written down in docs/cost-model.md;
//! this file is their only implementation.

use crate::action::Action;
use crate::alloc_sequence::{MemoryEvents, NoEvents, What};
use crate::profile::Graph;
pub use crate::state_swap::StateSwaps;
use crate::state_swap::StateSchedule;
use std::cmp::Ordering;

/// Settings of the simulation that are not part of the profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalOptions {
    /// A prefetch may be issued up to this many backward stages before the stage that needs it.
    pub prefetch_lookahead: usize,
    /// vDNN's synchronous offload (method `vdnn-sync`): after a forward stage queues swap-outs,
    /// the compute stream waits until the copy stream has finished them (charged as swap stall).
    pub sync_swap_out: bool,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions { prefetch_lookahead: 2, sync_swap_out: false }
    }
}

/// The fitness of a plan: feasible plans beat infeasible ones; among infeasible ones the smaller
/// excess over the budget wins; then the shorter step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    pub feasible: bool,
    pub excess: u64,
    pub time: f64,
}

impl Score {
    pub const WORST: Score = Score { feasible: false, excess: u64::MAX, time: f64::INFINITY };

    pub fn better_than(&self, other: &Score) -> bool {
        self.cmp_key(other) == Ordering::Less
    }

    pub fn cmp_key(&self, other: &Score) -> Ordering {
        match (self.feasible, other.feasible) {
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (true, true) => self.time.total_cmp(&other.time),
            (false, false) => self.excess.cmp(&other.excess).then(self.time.total_cmp(&other.time)),
        }
    }
}

/// Which stage of the step: forward or backward of a unit, the whole optimizer step in one call,
/// or (a plan that swaps parameters or optimizer state across iterations) the optimizer step over
/// a unit's parameters (`Opt(n)`: over the parameters of no unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Start,
    Fwd(usize),
    Bwd(usize),
    OptStep,
    Opt(usize),
}

impl Stage {
    pub fn label(&self) -> String {
        match self {
            Stage::Start => "start".into(),
            Stage::Fwd(i) => format!("fwd:{i}"),
            Stage::Bwd(i) => format!("bwd:{i}"),
            Stage::OptStep => "opt".into(),
            Stage::Opt(i) => format!("opt:{i}"),
        }
    }
}

/// What a copy moves: a unit's activations, or (TENSILE, across iterations) its parameters or
/// their optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Moved {
    Activations,
    Parameters,
    OptimizerState,
}

impl Moved {
    pub fn name(self) -> &'static str {
        match self {
            Moved::Activations => "activations",
            Moved::Parameters => "parameters",
            Moved::OptimizerState => "optimizer_state",
        }
    }

    pub fn from_name(s: &str) -> Option<Moved> {
        match s {
            "activations" => Some(Moved::Activations),
            "parameters" => Some(Moved::Parameters),
            "optimizer_state" => Some(Moved::OptimizerState),
            _ => None,
        }
    }
}

/// One point of the memory curve: the stage, when it starts, memory at its start and its peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurvePoint {
    pub stage: Stage,
    pub start_time: f64,
    pub mem_start: u64,
    pub peak: u64,
}

/// The full result of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub step_time: f64,
    pub compute_time: f64,
    pub swap_stall: f64,
    pub recompute: f64,
    /// Time the compute stream spent on the host's work beyond the stages' own (the executor's
    /// host costs; on a profile with host times, also the waits for a host that issues kernels
    /// slower than the device runs them): `step_time = compute + swap_stall + recompute + host`.
    pub host_time: f64,
    pub copy_time: f64,
    pub overlapped_copy: f64,
    /// Swap-outs still in flight when their unit was needed again (the device copy was used).
    pub cancelled_swaps: usize,
    pub peak_bytes: u64,
    pub peak_stage: Stage,
    /// Memory when the step ends: the constant memory and the gradients (every activation,
    /// held input and host copy has been let go).
    pub end_bytes: u64,
    pub feasible: bool,
    pub excess: u64,
    pub reason: Option<String>,
    pub curve: Vec<CurvePoint>,
    /// (unit, backward stage at whose start its prefetch is issued), in issue order.
    pub prefetch: Vec<(usize, usize)>,
    /// (stage, unit): the swap-out of `unit` has completed and its bytes left the device before
    /// `stage` starts (or before it allocates, when the stage waited for it), in FIFO order.
    pub swap_deadlines: Vec<(Stage, usize)>,
    /// Units whose swap-out is cancelled before its copy starts (its prefetch or first backward
    /// use comes first): the executor never starts it (recorded evaluations only; ascending).
    pub unstarted_swaps: Vec<usize>,
    /// Units whose swap-out is cancelled while its copy runs: the copy runs to its end, and the
    /// backward uses the device bytes in place, never copied back (recorded evaluations only).
    pub in_flight_swaps: Vec<usize>,
    /// Copies on the copy stream, in issue order (recorded evaluations only).
    pub copies: Vec<CopyEvent>,
    /// Replays of recomputed units on the compute stream: (unit, backward stage, start, end),
    /// recorded evaluations only.
    pub replays: Vec<(usize, usize, f64, f64)>,
    /// Prefetches of swapped parameters and optimizer state: (what, unit, the stage at whose
    /// start it is issued), in issue order (recorded evaluations only).
    pub state_prefetch: Vec<(Moved, usize, Stage)>,
    /// (stage, what, unit): the swap-out of a unit's parameters or optimizer state has completed
    /// and its bytes left the device before `stage` starts (or before it allocates, when it
    /// waited for it), or before the step ends (`Stage::Start`: the end-of-step wait).
    pub state_deadlines: Vec<(Stage, Moved, usize)>,
}

/// One copy on the copy stream: a swap-out (`to_host`) or a prefetch of `unit`'s activations
/// (or of its parameters or optimizer state: `what`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyEvent {
    pub unit: usize,
    pub what: Moved,
    pub to_host: bool,
    /// The copy queue: 0, or 1 for prefetches when the profile has two copy engines.
    pub queue: usize,
    pub start: f64,
    pub end: f64,
    pub bytes: u64,
}

impl Outcome {
    pub fn score(&self) -> Score {
        Score { feasible: self.feasible, excess: self.excess, time: self.step_time }
    }
}

/// Reusable buffers so that evaluations in a search do not allocate.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    resident: Vec<bool>,
    host: Vec<bool>,
    ready: Vec<f64>,
    in_queue: Vec<bool>,
    /// A recomputed unit's held inputs are on the device (from its forward to its replay).
    held: Vec<bool>,
    /// Bytes of a dropped or swapped-out unit's activations the forward still references.
    lingering: Vec<u64>,
    /// First unit of the run of consecutive recomputed units that contains the unit (the unit
    /// itself when it is not recomputed).
    run_start: Vec<usize>,
    /// Bytes a recomputed unit holds from its forward to its replay under this plan: its held
    /// inputs less those its run's replay regenerates.
    held_bytes: Vec<u64>,
    /// Bytes of saved values of other segments' recomputed units that a recomputed unit holds
    /// from its forward to its own backward (its replay reuses them as its saved tensors).
    held_saved: Vec<u64>,
    /// Per run (indexed by its first unit): some unit of it draws random numbers (the run keeps
    /// the generators' state for its replay), and some unit of it has activations (it is
    /// replayed when the backward first needs them).
    run_random: Vec<bool>,
    run_replays: Vec<bool>,
    /// Per run: the executor tracks it (some unit's glue lies outside the run's module calls).
    run_tracked: Vec<bool>,
    /// Per unit: the executor's host seconds in its forward stage under this plan.
    fwd_over: Vec<f64>,
    /// Per producer, the run that last charged holding its values (dedupes a run's held inputs).
    charged_run: Vec<usize>,
    /// Per value id (profiles with `held_values` / `saved_values`), the run that last charged it.
    charged_value: Vec<usize>,
    /// Per value id (profiles with `lingering_values`), the first unit whose forward holds it for
    /// a replay under this plan (`usize::MAX`: none).
    first_held: Vec<usize>,
    /// The unit's forward was replayed in this backward (a replay runs once, as in the executor).
    replayed: Vec<bool>,
    /// Per run (indexed by its first unit): the backward replays it (crate::incremental's bound).
    replayed_run: Vec<bool>,
    /// Swap-outs in FIFO order: (completion time, item), item = unit | kind << KIND_SHIFT.
    queue: Vec<(f64, u32)>,
    /// Per unit: its swap-out is queued (after its first forward reader, where the executor
    /// queues it) but a later forward stage still reads its output, so its bytes cannot leave yet.
    fwd_busy: Vec<bool>,
    /// Activations' swap-outs whose copy completed while the forward still read them, in FIFO
    /// order: they leave at the first release point after their last forward reader.
    parked: Vec<u32>,
    /// Every copy of this run in issue order, with where its completion time is kept: a
    /// swap-out cancelled before its copy starts gives its queue time back to the copies queued
    /// after it (`Sim::refund`).
    pending: Vec<PendingCopy>,
    /// Per unit, its activations' swap-out in `pending` (`usize::MAX`: none).
    pending_of: Vec<usize>,
    /// Swapped parameters / optimizer state: on the device (prefetched, or not yet swapped out),
    /// when their prefetch completes, and whether their swap-out is queued.
    param_resident: Vec<bool>,
    param_ready: Vec<f64>,
    param_out: Vec<bool>,
    state_resident: Vec<bool>,
    state_ready: Vec<f64>,
    state_out: Vec<bool>,
    /// Units whose prefetch was issued ahead of its need in this run, in issue order, and when:
    /// (clock, backward stage, replay time so far).
    early: Vec<usize>,
    early_at: Vec<(f64, usize, f64)>,
    /// (unit, stage): prefetches issued ahead of their need that were on the device when backward
    /// `stage`, before their need, did not fit (the first stage that did not fit).
    retract: Vec<(usize, usize)>,
    /// The first overflow blamed a prefetch that the next run issues later: this run's outcome
    /// is not the evaluation's, so the run stops at the end of the stage ([`run_with_events`]).
    retry: bool,
    /// Per unit, the highest backward stage at which its prefetch may be issued ahead of its need
    /// (`usize::MAX`: any). Kept across the runs of one evaluation ([`run_with_events`]).
    issue_from: Vec<usize>,
}

/// A copy on a copy queue, as issued: when it was issued, starts and ends, and which time its
/// end is (a swap-out's entry in `Scratch::queue`, a prefetch's ready time), so that the copies
/// behind a cancelled one can move up.
#[derive(Debug, Clone, Copy)]
struct PendingCopy {
    queue: usize,
    issue: f64,
    start: f64,
    dur: f64,
    end_of: EndOf,
    /// Its index in the recorded copies (`usize::MAX` when not recording).
    record: usize,
    /// Cancelled before it started: it never runs.
    cancelled: bool,
}

#[derive(Debug, Clone, Copy)]
enum EndOf {
    /// `Scratch::queue[i]`
    SwapOut(usize),
    Ready(usize),
    ParamReady(usize),
    StateReady(usize),
}

/// Queue items: the kind of what a swap-out moves, in the item's top bits.
const KIND_SHIFT: u32 = 30;
const KIND_PARAM: u32 = 1;
const KIND_STATE: u32 = 2;

impl Scratch {
    pub fn new(n: usize) -> Scratch {
        let mut s = Scratch::default();
        s.reset(n);
        s
    }

    /// Before the first run of an evaluation: every prefetch may be issued as early as its window
    /// allows ([`run_with_events`]).
    fn issue_any_time(&mut self, n: usize) {
        self.issue_from.clear();
        self.issue_from.resize(n, usize::MAX);
    }

    /// After a run: the prefetches its first overflow blamed are issued no earlier than the stage
    /// after it in the next run; false when none moves (the run is the evaluation's last).
    fn issue_blamed_later(&mut self) -> bool {
        for &(u, stage) in &self.retract {
            self.issue_from[u] = self.issue_from[u].min(stage - 1);
        }
        self.retry
    }

    fn reset(&mut self, n: usize) {
        self.reset_for(n, false, true);
    }

    /// Before a run: the plan's per-unit values, and (unless `restored`: a saved state sets
    /// them, and they have `n` entries) the simulation's state; the swapped parameters' and
    /// optimizer state's only when `state_swaps` (nothing reads them otherwise).
    fn reset_for(&mut self, n: usize, restored: bool, state_swaps: bool) {
        if !(restored && self.resident.len() == n) {
            self.reset_state(n);
        }
        self.run_start.clear();
        self.run_start.resize(n, 0);
        self.held_bytes.clear();
        self.held_bytes.resize(n, 0);
        self.held_saved.clear();
        self.held_saved.resize(n, 0);
        for v in [&mut self.run_random, &mut self.run_replays, &mut self.run_tracked] {
            v.clear();
            v.resize(n, false);
        }
        self.fwd_over.clear();
        self.fwd_over.resize(n, 0.0);
        self.charged_run.clear();
        self.charged_run.resize(n, usize::MAX);
        self.charged_value.clear();
        self.first_held.clear();
        if state_swaps {
            for v in [&mut self.param_resident, &mut self.param_out, &mut self.state_resident, &mut self.state_out] {
                v.clear();
                v.resize(n, false);
            }
            for v in [&mut self.param_ready, &mut self.state_ready] {
                v.clear();
                v.resize(n, 0.0);
            }
        }
        self.early.clear();
        self.early_at.clear();
        self.retract.clear();
        self.retry = false;
    }

    /// What a saved state holds (`SimState`), as at the step's start.
    fn reset_state(&mut self, n: usize) {
        self.resident.clear();
        self.resident.resize(n, false);
        self.host.clear();
        self.host.resize(n, false);
        self.ready.clear();
        self.ready.resize(n, 0.0);
        self.in_queue.clear();
        self.in_queue.resize(n, false);
        self.held.clear();
        self.held.resize(n, false);
        self.lingering.clear();
        self.lingering.resize(n, 0);
        self.replayed.clear();
        self.replayed.resize(n, false);
        self.queue.clear();
        self.fwd_busy.clear();
        self.fwd_busy.resize(n, false);
        self.parked.clear();
        self.pending.clear();
        self.pending_of.clear();
        self.pending_of.resize(n, usize::MAX);
    }
}

/// Why a step does not fit: the first stage that overflowed (its needs and the excess), or the
/// constant memory.
#[derive(Debug, Clone, Copy)]
enum Overflow {
    Constant(u64),
    Stage(Stage, u64, u64),
}

impl Overflow {
    fn reason(self) -> String {
        match self {
            Overflow::Constant(constant) => format!("the constant memory ({constant} bytes) alone exceeds the budget"),
            Overflow::Stage(stage, total, over) => format!(
                "stage {} needs {} bytes with nothing left to swap out, over the budget by {} bytes",
                stage.label(),
                total,
                over
            ),
        }
    }
}

struct Sim<'a, E: MemoryEvents> {
    g: &'a Graph,
    /// Where memory changes are reported (`NoEvents` in the search: nothing).
    ev: &'a mut E,
    actions: &'a [Action],
    budget: u64,
    lookahead: usize,
    record: bool,
    s: &'a mut Scratch,
    head: usize,
    t: f64,
    /// The host's clock (profiles with host times: it issues the stages' kernels, running ahead
    /// of the compute stream `t`), and the time the compute stream waited for it.
    h: f64,
    host: f64,
    /// When each copy queue is free: [device-to-host, host-to-device] (the same queue, index 0,
    /// with one copy engine).
    copy_free: [f64; 2],
    h2d_queue: usize,
    mem: u64,
    peak: u64,
    peak_stage: Stage,
    stall: f64,
    recompute: f64,
    copy_time: f64,
    cancelled: usize,
    excess: u64,
    /// The first overflow (written out in the outcome only).
    reason: Option<Overflow>,
    stage: Stage,
    stage_start_mem: u64,
    stage_peak: u64,
    curve: Vec<CurvePoint>,
    prefetch: Vec<(usize, usize)>,
    deadlines: Vec<(Stage, usize)>,
    copies: Vec<CopyEvent>,
    /// Recorded copies cancelled before they started (left out of the outcome).
    dropped_copies: Vec<usize>,
    /// Units whose swap-out was cancelled before its copy started (recorded evaluations only).
    unstarted: Vec<usize>,
    /// Units whose swap-out was cancelled while its copy ran (recorded evaluations only).
    in_flight: Vec<usize>,
    replays: Vec<(usize, usize, f64, f64)>,
    /// The first of `Scratch::early` whose need has not come yet (`Hooks::cannot_beat`).
    early_head: usize,
    state_prefetch: Vec<(Moved, usize, Stage)>,
    state_deadlines: Vec<(Stage, Moved, usize)>,
}

impl<'a, E: MemoryEvents> Sim<'a, E> {
    /// Release swap-outs whose copy has completed by now (and whose forward readers have run).
    fn release_completed(&mut self) {
        self.release_parked();
        while self.head < self.s.queue.len() {
            let (end, u) = self.s.queue[self.head];
            if end > self.t {
                break;
            }
            self.head += 1;
            if self.park(u) {
                continue;
            }
            self.release(u);
        }
    }

    /// A completed swap-out of activations that a later forward stage still reads is parked: its
    /// bytes stay until the forward is done with them (the executor frees a storage only when
    /// both the copy and the forward have let go of it). True if `item` was parked.
    fn park(&mut self, item: u32) -> bool {
        if item >> KIND_SHIFT == 0 && self.s.fwd_busy[item as usize] {
            self.s.parked.push(item);
            return true;
        }
        false
    }

    /// Release the parked swap-outs whose last forward reader has run, in FIFO order; true if one
    /// still held device bytes.
    fn release_parked(&mut self) -> bool {
        let mut any = false;
        let mut k = 0;
        while k < self.s.parked.len() {
            let item = self.s.parked[k];
            if self.s.fwd_busy[item as usize] {
                k += 1;
                continue;
            }
            self.s.parked.remove(k);
            if self.queued(item) {
                any = true;
                self.release(item);
            }
        }
        any
    }

    /// A queued swap-out has completed: its bytes leave the device (unless it was cancelled).
    fn release(&mut self, item: u32) {
        let u = (item & ((1 << KIND_SHIFT) - 1)) as usize;
        match item >> KIND_SHIFT {
            KIND_PARAM => self.release_state(Moved::Parameters, u),
            KIND_STATE => self.release_state(Moved::OptimizerState, u),
            _ => self.release_act(u),
        }
    }

    fn release_state(&mut self, what: Moved, u: usize) {
        let (out, resident, bytes, block) = match what {
            Moved::Parameters => (&mut self.s.param_out, &mut self.s.param_resident, self.g.param[u], What::Param(u)),
            _ => (&mut self.s.state_out, &mut self.s.state_resident, self.g.opt_state[u], What::OptState(u)),
        };
        if out[u] {
            out[u] = false;
            resident[u] = false;
            self.mem -= bytes;
            self.ev.free(block, self.t);
            if self.record {
                self.state_deadlines.push((self.stage, what, u));
            }
        }
    }

    fn release_act(&mut self, u: usize) {
        if self.s.in_queue[u] {
            if self.record {
                self.deadlines.push((self.stage, u));
            }
            self.s.in_queue[u] = false;
            self.s.resident[u] = false;
            self.leave(u);
        }
    }

    /// Unit `u`'s activations leave the device (dropped, or swapped out), except the bytes the
    /// forward still references: those leave after forward stage `linger_until[u]`. Lingering
    /// values a checkpoint segment already holds for its replay are not counted twice.
    fn leave(&mut self, u: usize) {
        let g = self.g;
        let s = match self.stage {
            Stage::Start => 0,
            Stage::Fwd(s) => s,
            Stage::Bwd(_) | Stage::OptStep | Stage::Opt(_) => g.n,
        };
        let keep = if g.linger_until[u] >= s { g.linger[u] - self.lingering_held_by(u, s) } else { 0 };
        self.mem -= g.act[u] - keep;
        self.s.lingering[u] += keep;
        if E::ENABLED {
            self.ev.free(What::Act(u), self.t);
            if keep > 0 && keep == g.linger[u] {
                self.ev.rename(What::ActLinger(u), What::Lingering(u));
            } else {
                self.ev.free(What::ActLinger(u), self.t);
                self.ev.alloc(What::Lingering(u), keep, self.t);
            }
        }
    }

    /// Value `v` is held for a replay from the forward of unit `u` on (profiles with
    /// `lingering_values`; the first such unit counts).
    fn note_held(&mut self, v: usize, u: usize) {
        if let Some(first) = self.s.first_held.get_mut(v) {
            *first = (*first).min(u);
        }
    }

    /// Bytes of unit `u`'s lingering values that a segment holds for its replay by forward stage `s`.
    fn lingering_held_by(&self, u: usize, s: usize) -> u64 {
        let held: u64 = self.g.linger_values[u].iter().filter(|&&(v, _)| self.s.first_held[v] <= s).map(|&(_, b)| b).sum();
        held.min(self.g.linger[u])
    }

    /// At the forward of recomputed unit `i`, before it allocates what it holds: lingering values
    /// it is the first to hold stop counting as lingering (the held bytes count them from now on).
    fn hand_lingering_to_held(&mut self, i: usize) {
        let g = self.g;
        for &(p, v, _) in g.held_values[i].iter().chain(&g.saved_values[i]) {
            if self.s.first_held[v] != i || self.s.lingering[p] == 0 {
                continue;
            }
            let Some(&(_, b)) = g.linger_values[p].iter().find(|&&(w, _)| w == v) else { continue };
            let moved = b.min(self.s.lingering[p]);
            self.s.lingering[p] -= moved;
            self.mem -= moved;
            if E::ENABLED {
                self.ev.free(What::Lingering(p), self.t);
                self.ev.alloc(What::Lingering(p), self.s.lingering[p], self.t);
            }
        }
    }

    /// Before something that needs `extra` bytes on top of `mem`: wait for queued swap-outs
    /// (in FIFO order) until it fits; if nothing is left to wait for, record the excess.
    fn make_room(&mut self, extra: u64) {
        while self.mem + extra > self.budget && self.wait_next_swap_out() {}
        let total = self.mem + extra;
        if total > self.budget {
            let over = total - self.budget;
            if self.excess == 0 && self.reason.is_none() {
                self.reason = Some(Overflow::Stage(self.stage, total, over));
                self.blame_early_prefetches();
            }
            self.excess = self.excess.max(over);
        }
        self.touch(total);
    }

    /// At the first stage that does not fit, a backward stage: the prefetches issued ahead of their
    /// need whose bytes are on the device and not needed yet, to be issued later.
    fn blame_early_prefetches(&mut self) {
        if let Stage::Bwd(j) = self.stage {
            for k in 0..self.s.early.len() {
                let u = self.s.early[k];
                if self.s.resident[u] && self.g.first_need[u].map_or(false, |f| f < j) {
                    self.s.retract.push((u, j));
                    self.s.retry |= self.s.issue_from[u] > j - 1;
                }
            }
        }
    }

    /// Wait (swap stall) for the next queued swap-out that still holds device bytes, and release
    /// it; false if none is left.
    fn wait_next_swap_out(&mut self) -> bool {
        // Copies that completed while the forward still read them: no wait if it is done now.
        if self.release_parked() {
            return true;
        }
        while self.head < self.s.queue.len() {
            let (end, item) = self.s.queue[self.head];
            self.head += 1;
            if !self.queued(item) {
                continue;
            }
            if self.park(item) {
                // Waiting for it frees nothing before its last forward reader; later copies end
                // no earlier, so the clock moves when one of them is waited for.
                continue;
            }
            if end > self.t {
                self.stall += end - self.t;
                self.t = end;
            }
            self.release(item);
            return true;
        }
        false
    }

    /// The swap-out `item` still holds device bytes (it was not cancelled or freed).
    fn queued(&self, item: u32) -> bool {
        let u = (item & ((1 << KIND_SHIFT) - 1)) as usize;
        match item >> KIND_SHIFT {
            KIND_PARAM => self.s.param_out[u],
            KIND_STATE => self.s.state_out[u],
            _ => self.s.in_queue[u],
        }
    }

    /// Queue a copy of `bytes` on the queue of its direction; returns (start, end).
    fn copy(&mut self, unit: usize, what: Moved, to_host: bool, bytes: u64, end_of: EndOf) -> (f64, f64) {
        let (bw, q) = if to_host { (self.g.d2h, 0) } else { (self.g.h2d, self.h2d_queue) };
        let dur = bytes as f64 / bw;
        let start = self.t.max(self.copy_free[q]);
        let end = start + dur;
        self.copy_free[q] = end;
        self.copy_time += dur;
        let mut record = usize::MAX;
        if self.record {
            record = self.copies.len();
            self.copies.push(CopyEvent { unit, what, to_host, queue: q, start, end, bytes });
        }
        if let EndOf::SwapOut(_) = end_of {
            if what == Moved::Activations {
                self.s.pending_of[unit] = self.s.pending.len();
            }
        }
        self.s.pending.push(PendingCopy { queue: q, issue: self.t, start, dur, end_of, record, cancelled: false });
        (start, end)
    }

    /// Unit `u`'s swap-out is cancelled (its device copy is used as it is). If its copy has not
    /// started, it never runs, as the executor's backends skip a queued copy that was cancelled:
    /// the copies queued behind it on its queue move up (FIFO, none before its issue).
    fn refund(&mut self, u: usize) {
        let k = self.s.pending_of[u];
        if k == usize::MAX {
            return;
        }
        self.s.pending_of[u] = usize::MAX; // a swap-out is cancelled at most once
        let x = self.s.pending[k];
        if x.start <= self.t {
            if self.record {
                self.in_flight.push(u);
            }
            return;
        }
        self.s.pending[k].cancelled = true;
        if self.record {
            self.unstarted.push(u);
        }
        self.copy_time -= x.dur;
        if let EndOf::SwapOut(i) = x.end_of {
            self.s.queue[i].0 = x.start; // keeps the queue's completion times in order
        }
        if x.record != usize::MAX {
            self.dropped_copies.push(x.record);
        }
        // The copy before it ended at its start (it was queued behind it: it starts after now).
        let mut free = x.start;
        for j in k + 1..self.s.pending.len() {
            let p = self.s.pending[j];
            if p.queue != x.queue || p.cancelled {
                continue;
            }
            let start = p.issue.max(free);
            let end = start + p.dur;
            free = end;
            self.s.pending[j].start = start;
            match p.end_of {
                EndOf::SwapOut(i) => self.s.queue[i].0 = end,
                EndOf::Ready(v) => self.s.ready[v] = end,
                EndOf::ParamReady(v) => self.s.param_ready[v] = end,
                EndOf::StateReady(v) => self.s.state_ready[v] = end,
            }
            if p.record != usize::MAX {
                self.copies[p.record].start = start;
                self.copies[p.record].end = end;
            }
        }
        self.copy_free[x.queue] = free;
    }

    /// Prefetch unit `u`'s swapped parameters or optimizer state (issued at the current stage):
    /// its bytes are allocated now (waiting for swap-outs if they do not fit) and ready when the
    /// copy completes.
    fn prefetch_state(&mut self, what: Moved, u: usize) {
        let (bytes, block) = match what {
            Moved::Parameters => (self.g.param[u], What::Param(u)),
            _ => (self.g.opt_state[u], What::OptState(u)),
        };
        let resident = match what {
            Moved::Parameters => self.s.param_resident[u],
            _ => self.s.state_resident[u],
        };
        if resident {
            return;
        }
        if self.record {
            self.state_prefetch.push((what, u, self.stage));
        }
        self.make_room(bytes);
        let end_of = match what {
            Moved::Parameters => EndOf::ParamReady(u),
            _ => EndOf::StateReady(u),
        };
        let (_, end) = self.copy(u, what, false, bytes, end_of);
        self.mem += bytes;
        self.ev.alloc(block, bytes, self.t);
        self.touch(self.mem);
        match what {
            Moved::Parameters => {
                self.s.param_resident[u] = true;
                self.s.param_ready[u] = end;
            }
            _ => {
                self.s.state_resident[u] = true;
                self.s.state_ready[u] = end;
            }
        }
    }

    /// Before a use of unit `u`'s swapped parameters or state: prefetch now if no stage did, and
    /// wait for the copy (swap stall).
    fn ensure_state(&mut self, what: Moved, u: usize) {
        self.prefetch_state(what, u);
        let ready = match what {
            Moved::Parameters => self.s.param_ready[u],
            _ => self.s.state_ready[u],
        };
        if ready > self.t {
            self.stall += ready - self.t;
            self.t = ready;
        }
    }

    /// After unit `u`'s optimizer stage: queue the swap-out of its parameters or state.
    fn swap_out_state(&mut self, what: Moved, u: usize) {
        let (bytes, kind) = match what {
            Moved::Parameters => (self.g.param[u], KIND_PARAM),
            _ => (self.g.opt_state[u], KIND_STATE),
        };
        let (_, end) = self.copy(u, what, true, bytes, EndOf::SwapOut(self.s.queue.len()));
        self.s.queue.push((end, u as u32 | kind << KIND_SHIFT));
        match what {
            Moved::Parameters => self.s.param_out[u] = true,
            _ => self.s.state_out[u] = true,
        }
    }

    fn touch(&mut self, bytes: u64) {
        if bytes > self.stage_peak {
            self.stage_peak = bytes;
        }
        if bytes > self.peak {
            self.peak = bytes;
            self.peak_stage = self.stage;
        }
    }

    /// The compute stream runs work of `device` seconds that the host issues in `host` seconds
    /// (None: the host runs the kernels itself, a CPU: its work adds to them) plus `over` seconds
    /// of the executor's own work.
    fn run_stage(&mut self, device: f64, host: Option<f64>, over: f64) {
        match host {
            None => {
                self.t += device + over;
                self.host += over;
            }
            Some(issue) => {
                // the host issues in program order and never waits for the device within the step
                self.h += issue + over;
                let end = (self.t + device).max(self.h);
                self.host += end - (self.t + device);
                self.t = end;
            }
        }
    }

    fn begin_stage(&mut self, stage: Stage) {
        self.stage = stage;
        self.release_completed();
        self.stage_start_mem = self.mem;
        self.stage_peak = self.mem;
        self.touch(self.mem);
    }

    fn end_stage(&mut self, start_time: f64) {
        if self.record {
            self.curve.push(CurvePoint {
                stage: self.stage,
                start_time,
                mem_start: self.stage_start_mem,
                peak: self.stage_peak,
            });
        }
    }

    /// Unit `u`'s activations, resident as a whole, are freed.
    fn free_act(&mut self, u: usize) {
        self.ev.free(What::Act(u), self.t);
        self.ev.free(What::ActLinger(u), self.t);
    }

    /// A recomputed unit's held inputs leave after its replay (or when it can no longer be
    /// replayed).
    fn release_held(&mut self, u: usize) {
        if self.s.held[u] {
            self.s.held[u] = false;
            self.mem -= self.s.held_bytes[u];
            self.ev.free(What::Held(u), self.t);
        }
    }

    /// `p` is recomputed in the same run of consecutive recomputed units as `u` (p < u).
    fn in_run_of(&self, p: usize, u: usize) -> bool {
        self.actions[u] == Action::Recompute && self.s.run_start[u] <= p
    }

    /// Queue unit `u`'s swap-out at the end of forward stage `i`, its first forward reader: the
    /// executor queues a saved storage at the end of the stage that saved it, and the reader that
    /// saves a unit's output is usually its first. Until the forward lets go of them (`fwd_busy`:
    /// the profile's `forward_held_until`, else its last forward reader) its bytes stay, whenever
    /// the copy completes.
    fn issue_swap_out(&mut self, u: usize, i: usize) {
        let (_, end) = self.copy(u, Moved::Activations, true, self.g.act[u], EndOf::SwapOut(self.s.queue.len()));
        self.s.queue.push((end, u as u32));
        self.s.in_queue[u] = true;
        self.s.host[u] = true;
        self.s.fwd_busy[u] = self.g.busy_until[u] > i;
    }

    fn issue_prefetch(&mut self, u: usize, at_stage: usize) {
        if self.record {
            self.prefetch.push((u, at_stage));
        }
        if self.s.in_queue[u] {
            // Its swap-out has not completed: the device copy is still alive, keep it.
            self.s.in_queue[u] = false;
            self.cancelled += 1;
            self.refund(u);
            self.s.ready[u] = self.t;
            return;
        }
        // Its bytes are allocated at issue: queued swap-outs leave first if they do not fit (a
        // prefetch the stage needs is issued even when it does not fit; the excess is recorded).
        self.make_room(self.g.act[u]);
        let (_, end) = self.copy(u, Moved::Activations, false, self.g.act[u], EndOf::Ready(u));
        self.mem += self.g.act[u];
        self.ev.alloc(What::Act(u), self.g.act[u], self.t);
        self.touch(self.mem);
        self.s.resident[u] = true;
        self.s.ready[u] = end;
    }

    /// Make unit `u`'s activations resident and ready at the current backward stage `i`.
    fn ensure(&mut self, u: usize, i: usize) {
        if self.s.resident[u] {
            // A swap-out still in flight is cancelled: the device copy is used as it is.
            if self.s.in_queue[u] {
                self.s.in_queue[u] = false;
                self.cancelled += 1;
                self.refund(u);
            }
            let ready = self.s.ready[u];
            if ready > self.t {
                self.stall += ready - self.t;
                self.t = ready;
            }
            return;
        }
        if self.actions[u] == Action::Swap && self.s.host[u] {
            self.issue_prefetch(u, i);
            self.ensure(u, i);
            return;
        }
        if self.actions[u] == Action::Recompute && !self.s.replayed[u] {
            self.replay_run(u, i);
        } else {
            // Replayed with its segment, its activations already let go (nobody read them since):
            // the segment is not replayed twice; the reader's replay counts it as kept.
        }
    }

    /// Replay the checkpoint segment (run of recomputed units) of unit `u` at backward stage
    /// `i`, once: every unit of it not replayed yet, in order, as torch.utils.checkpoint replays
    /// its region when the backward first needs one of its tensors.
    fn replay_run(&mut self, u: usize, i: usize) {
        let start = self.s.run_start[u];
        // the executor's setup of the replay (its frame, the kept arguments; a tracked run's
        // recording), once per segment
        let setup = self.g.costs.segment;
        if setup > 0.0 {
            self.run_stage(0.0, self.g.fwd_host.as_ref().map(|_| 0.0), setup);
        }
        let mut v = start;
        while v < self.g.n && self.actions[v] == Action::Recompute && self.s.run_start[v] == start {
            if !self.s.replayed[v] {
                self.replay(v, i);
            }
            v += 1;
        }
    }

    /// Replay unit `u`'s forward, chaining through inputs that are not resident.
    fn replay(&mut self, u: usize, i: usize) {
        let g = self.g;
        let mut kept = 0u64;
        for &p in &g.replay_inputs[u] {
            // A value of a unit recomputed in another run is held since the forward (as
            // torch.utils.checkpoint keeps its inputs). So is one of a retained unit whose
            // activations have already been let go (its readers ran), or of a unit of this run
            // replayed and let go already (its replay kept the value for this one): the replay
            // reads it, counted while it runs. Everything else is made resident.
            let held = self.actions[p] == Action::Recompute && p < self.s.run_start[u];
            let let_go = self.actions[p] == Action::Retain || (self.actions[p] == Action::Recompute && self.s.replayed[p]);
            if let_go && !self.s.resident[p] {
                kept += g.act[p];
            } else if g.act[p] > 0 && !held {
                self.ensure(p, i);
            }
        }
        // Unsaved values of earlier units of the same recompute run: the run's replay regenerates
        // them (their producer replays first) and they live until this replay has run.
        let mut regenerated = 0u64;
        for k in 0..g.held_from[u].len() {
            let (p, b) = g.held_from[u][k];
            if self.in_run_of(p, u) {
                if !self.s.replayed[p] {
                    self.replay(p, i);
                }
                regenerated += b;
            }
        }
        // The replay runs inside stage Bi at an unpack, among what Bi's backward has allocated
        // so far: at most the most it holds at the start of one of its nodes (`bwd_replay`; at
        // most its transient and gradients).
        let base = g.bwd_replay[i];
        // A segment that draws random numbers is replayed between a copy of the generators' state
        // at the replay and the copy it restores: two states beside the held one (transformer_encoder
        // on the simulated GPU measured 2 x rng_state_bytes above a replay charged without them).
        let work = g.replay_extra[u] + if self.s.run_random[self.s.run_start[u]] { 2 * g.rng_state } else { 0 };
        self.make_room(g.act[u] + work + regenerated + kept + base);
        if E::ENABLED {
            // What the stage's backward has allocated, what the replay reads, its output, its
            // scratch; all but the output leave after it.
            let grads = g.grad[i].min(base);
            self.ev.alloc(What::BwdWork(i), base - grads, self.t);
            self.ev.alloc(What::ReplayGrad(i), grads, self.t);
            self.ev.alloc(What::Kept(u), kept, self.t);
            self.ev.alloc(What::Regenerated(u), regenerated, self.t);
            self.ev.alloc(What::Act(u), g.act[u], self.t);
            self.ev.alloc(What::ReplayWork(u), work, self.t);
        }
        let start = self.t;
        self.run_stage(g.fwd_time[u], g.fwd_host.as_ref().map(|h| h[u]), 0.0);
        if self.record {
            self.replays.push((u, i, start, self.t));
        }
        if E::ENABLED {
            // The transients leave when the replay ends (no other event comes between).
            for w in [What::ReplayWork(u), What::Regenerated(u), What::Kept(u), What::ReplayGrad(i), What::BwdWork(i)] {
                self.ev.free(w, self.t);
            }
        }
        self.recompute += g.fwd_time[u];
        self.s.replayed[u] = true;
        self.mem += g.act[u];
        self.s.resident[u] = true;
        self.s.ready[u] = self.t;
        self.release_held(u);
        // A unit replayed only to hand back what it saved of another segment's unit (its own
        // activations' readers have all run, or it has none): its activations go at once.
        if g.last_use[u].map_or(true, |lu| lu > i) {
            self.s.resident[u] = false;
            self.mem -= g.act[u];
            self.free_act(u);
        }
        // Inputs materialised only for this replay whose last reader has already run: free them.
        for &p in &g.replay_inputs[u] {
            if let Some(lu) = g.last_use[p] {
                if lu > i && self.s.resident[p] && !self.s.in_queue[p] {
                    self.s.resident[p] = false;
                    self.mem -= g.act[p];
                    self.free_act(p);
                }
            }
        }
    }
}

/// Evaluate `actions` on the profile graph under `budget` bytes, with the graph's default
/// checkpoint segments (a run of recomputed units is split at the start of every repeated block).
///
/// `record` fills the memory curve and the prefetch schedule (slower; the search passes false).
pub fn evaluate(
    g: &Graph,
    actions: &[Action],
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    record: bool,
) -> Outcome {
    evaluate_segments(g, actions, &g.block_start, budget, opts, scratch, record)
}

/// Evaluate with explicit checkpoint segments: `starts[u]` splits a run of recomputed units
/// before unit `u` (docs/cost-model.md, "Checkpoint segments").
pub fn evaluate_segments(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    record: bool,
) -> Outcome {
    run_with_events(g, actions, starts, &StateSwaps::none(), budget, opts, scratch, record, &mut NoEvents)
}

/// Evaluate with explicit checkpoint segments and parameters / optimizer state swapped across
/// iterations (docs/cost-model.md, "Optimizer step").
#[allow(clippy::too_many_arguments)]
pub fn evaluate_with_swaps(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    swaps: &StateSwaps,
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    record: bool,
) -> Outcome {
    run_with_events(g, actions, starts, swaps, budget, opts, scratch, record, &mut NoEvents)
}

/// [`evaluate_with_swaps`], reporting every change of the memory count to `ev`
/// (crate::alloc_sequence).
///
/// A prefetch issued ahead of its need must not make a stage before its need overflow: when the
/// first stage that does not fit is a backward stage with such prefetches on the device, the step
/// is simulated again with each of them issued no earlier than the stage after it, until the
/// first stage that does not fit has none (each retry moves a prefetch later, so this ends).
/// A plan that fits is simulated once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_with_events<E: MemoryEvents>(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    swaps: &StateSwaps,
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    record: bool,
    ev: &mut E,
) -> Outcome {
    scratch.issue_any_time(g.n);
    loop {
        // The events of a retried run would be reported twice: find the schedule without them.
        // (A run that will be retried stops at the end of its first overflow's stage: None.)
        let out = if E::ENABLED {
            simulate(g, actions, starts, swaps, budget, opts, scratch, false, &mut NoEvents, None)
        } else {
            simulate(g, actions, starts, swaps, budget, opts, scratch, record, ev, None)
        };
        if !scratch.issue_blamed_later() {
            let last = if E::ENABLED { simulate(g, actions, starts, swaps, budget, opts, scratch, record, ev, None) } else { out };
            return last.expect("a run that is not retried runs to the end");
        }
    }
}

/// One simulated step, with the prefetches ahead of their need limited by `scratch.issue_from`.
/// With `hooks` (crate::incremental; search evaluations only) it may start from a saved state,
/// save states at forward stages, and stop early (None) once the plan cannot beat a bound.
#[allow(clippy::too_many_arguments)]
fn simulate<E: MemoryEvents>(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    swaps: &StateSwaps,
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    record: bool,
    ev: &mut E,
    mut hooks: Option<&mut Hooks>,
) -> Option<Outcome> {
    assert_eq!(actions.len(), g.n, "one action per unit");
    assert_eq!(starts.len(), g.n, "one segment flag per unit");
    // A unit the executor cannot replay is retained where the plan says recompute.
    let runnable = g.recomputable_plan(actions);
    let actions: &[Action] = runnable.as_deref().unwrap_or(actions);
    let n = g.n;
    // Swapped parameters and optimizer state are on the host when the step starts; when each
    // prefetch is issued (crate::state_swap).
    let schedule = StateSchedule::new(g, swaps);
    let restored = hooks.as_deref().is_some_and(|h| h.resume.is_some());
    scratch.reset_for(n, restored, schedule.any);
    scratch.charged_value.resize(g.value_ids, usize::MAX);
    if g.any_linger_values {
        scratch.first_held.resize(g.value_ids, usize::MAX);
    }
    let constant = g.constant - schedule.host_bytes;
    let mut sim = Sim {
        g,
        ev,
        actions,
        budget,
        lookahead: opts.prefetch_lookahead,
        record,
        s: scratch,
        head: 0,
        t: 0.0,
        h: 0.0,
        host: 0.0,
        copy_free: [0.0; 2],
        h2d_queue: if g.copy_engines >= 2 { 1 } else { 0 },
        mem: constant,
        peak: constant,
        peak_stage: Stage::Start,
        stall: 0.0,
        recompute: 0.0,
        copy_time: 0.0,
        cancelled: 0,
        excess: 0,
        reason: None,
        stage: Stage::Start,
        stage_start_mem: constant,
        stage_peak: constant,
        curve: Vec::new(),
        prefetch: Vec::new(),
        deadlines: Vec::new(),
        copies: Vec::new(),
        dropped_copies: Vec::new(),
        unstarted: Vec::new(),
        in_flight: Vec::new(),
        replays: Vec::new(),
        early_head: 0,
        state_prefetch: Vec::new(),
        state_deadlines: Vec::new(),
    };
    if constant > budget {
        sim.excess = constant - budget;
        sim.reason = Some(Overflow::Constant(constant));
    }

    // Runs of consecutive recomputed units, and what each recomputed unit holds under this plan.
    run_starts(actions, starts, &mut sim.s.run_start);
    for u in 0..n {
        if actions[u] != Action::Recompute {
            continue;
        }
        let run = sim.s.run_start[u];
        let mut held = g.held[u];
        // Unsaved values: regenerated when produced in the run, else held once per run: each
        // value once where the profile names them, else each producer's once.
        if g.value_ids > 0 {
            for &(p, v, b) in &g.held_values[u] {
                if run <= p || sim.s.charged_value[v] == run {
                    held = held.saturating_sub(b);
                } else {
                    sim.s.charged_value[v] = run;
                    sim.note_held(v, u);
                }
            }
        } else {
            for &(p, b) in &g.held_from[u] {
                if run <= p {
                    held -= b;
                } else if sim.s.charged_run[p] == run {
                    held -= b;
                } else {
                    sim.s.charged_run[p] = run;
                }
            }
        }
        // The generators' state, once per segment whose forward draws random numbers: kept by its
        // first unit from its forward to its replay.
        if g.random[u] && !sim.s.run_random[run] {
            sim.s.run_random[run] = true;
            sim.s.held_bytes[run] += g.rng_state;
        }
        sim.s.held_bytes[u] += held;
        // Saved values of a unit recomputed in another segment: held, once per segment, until the
        // backward of the first unit of the segment that reads them.
        if g.value_ids > 0 {
            for &(p, v, b) in &g.saved_values[u] {
                if p < run && actions[p] == Action::Recompute && sim.s.charged_value[v] != run {
                    sim.s.charged_value[v] = run;
                    sim.s.held_saved[u] += b;
                    sim.note_held(v, u);
                }
            }
        } else {
            for &(p, b) in &g.saved_from[u] {
                if p < run && actions[p] == Action::Recompute && sim.s.charged_run[p] != run {
                    sim.s.charged_run[p] = run;
                    sim.s.held_saved[u] += b;
                }
            }
        }
    }

    // The executor's host work per forward stage under this plan (docs/cost-model.md, "Host
    // time"): per swapped storage, per saved tensor of a recomputed unit's segment, per glue call
    // of a tracked run (one with a unit whose glue lies outside the run's module calls), per stage
    // after the first swapped unit, and once per step.
    let c = g.costs;
    if c != crate::profile::ExecutorCosts::default() {
        for u in 0..n {
            sim.s.fwd_over[u] = match actions[u] {
                Action::Retain => 0.0,
                Action::Swap => c.swap_host(g.act[u] as f64, g.act_storages[u], g.d2h, g.h2d),
                Action::Recompute => c.drop * g.packs[u],
            };
        }
        // Every step does the executor's own work (its inputs, its state), whatever the plan.
        if n > 0 {
            sim.s.fwd_over[0] += c.step;
        }
        // Every stage after the first swapped unit's does swap work at its boundary (frees of
        // completed copies, deadlines, the prefetch schedule's hooks), whatever its own action.
        if c.stage > 0.0 {
            if let Some(first) = actions.iter().position(|&a| a == Action::Swap) {
                for over in &mut sim.s.fwd_over[first + 1..] {
                    *over += c.stage;
                }
            }
        }
        let mut u = 0;
        while u < n {
            if actions[u] != Action::Recompute {
                u += 1;
                continue;
            }
            let run = sim.s.run_start[u];
            let mut end = u;
            while end + 1 < n && actions[end + 1] == Action::Recompute && sim.s.run_start[end + 1] == run {
                end += 1;
            }
            let tracked = (run..=end).any(|v| matches!(g.glue_scope[v], Some((f, l)) if f < run || l > end));
            sim.s.run_tracked[run] = tracked;
            if tracked {
                for v in run..=end {
                    sim.s.fwd_over[v] += c.tracked_op * g.glue_ops[v];
                }
            }
            u = end + 1;
        }
    }

    if let Some(h) = hooks.as_deref_mut() {
        if h.bound.is_some() {
            h.replays = replay_time_of(g, actions, &sim.s.run_start, &mut sim.s.replayed_run);
        }
    }

    // Forward stages (from a saved state's stage when resuming).
    let first = match hooks.as_deref_mut() {
        Some(h) => h.resume(&mut sim),
        None => 0,
    };
    for i in first..n {
        if let Some(h) = hooks.as_deref_mut() {
            h.save(i, &sim);
        }
        let t0 = sim.t;
        sim.begin_stage(Stage::Fwd(i));
        for &u in schedule.at_fwd(i) {
            sim.prefetch_state(Moved::Parameters, u);
        }
        if schedule.param(i) {
            sim.ensure_state(Moved::Parameters, i);
        }
        let mut alloc = g.act[i] + if g.out_saved[i] { 0 } else { g.out[i] };
        if actions[i] == Action::Recompute {
            if g.any_linger_values {
                sim.hand_lingering_to_held(i);
            }
            alloc += sim.s.held_bytes[i] + sim.s.held_saved[i];
            sim.s.held[i] = true;
        }
        sim.make_room(alloc + g.fwd_transient[i]);
        if E::ENABLED {
            if actions[i] == Action::Recompute {
                sim.ev.alloc(What::Held(i), sim.s.held_bytes[i], sim.t);
                sim.ev.alloc(What::HeldSaved(i), sim.s.held_saved[i], sim.t);
            }
            // A unit whose activations leave in the forward: the bytes the forward still
            // references after its last reader are a block of their own.
            let linger = if actions[i] == Action::Retain { 0 } else { g.linger[i] };
            sim.ev.alloc(What::Act(i), g.act[i] - linger, sim.t);
            sim.ev.alloc(What::ActLinger(i), linger, sim.t);
            if !g.out_saved[i] {
                sim.ev.alloc(What::Output(i), g.out[i], sim.t);
            }
            sim.ev.alloc(What::FwdWork(i), g.fwd_transient[i], sim.t);
        }
        sim.run_stage(g.fwd_time[i], g.fwd_host.as_ref().map(|h| h[i]), sim.s.fwd_over[i]);
        // The stage's scratch leaves when its compute ends (no other event comes between).
        sim.ev.free(What::FwdWork(i), sim.t);
        sim.mem += alloc;
        sim.s.resident[i] = true;
        sim.s.ready[i] = sim.t;
        // Swapped units whose first forward reader this is: their copies are queued now, even if
        // a later forward stage reads their output (their bytes stay until it has run).
        for &u in &g.swap_outs_after_fwd[i] {
            if actions[u] == Action::Swap && g.act[u] > 0 {
                sim.issue_swap_out(u, i);
            }
        }
        for &u in &g.releases_after_fwd[i] {
            if !g.out_saved[u] {
                sim.mem -= g.out[u];
                sim.ev.free(What::Output(u), sim.t);
            }
            if actions[u] == Action::Recompute {
                // Nothing of it stays (a unit without activations too): a replay of its run
                // must run it again to regenerate what a later unit of the run reads.
                sim.s.resident[u] = false;
            }
        }
        // Units whose activations the forward has let go of: a recomputed unit's leave (its
        // tensors were dropped at pack time), a swapped unit's may leave from now on.
        for &u in &g.busy_release_after_fwd[i] {
            match actions[u] {
                Action::Recompute if g.act[u] > 0 => sim.leave(u),
                Action::Swap => sim.s.fwd_busy[u] = false,
                _ => {}
            }
        }
        if opts.sync_swap_out && sim.copy_free[0] > sim.t {
            // Synchronous offload: wait for the queued swap-outs; they leave at the next stage.
            sim.stall += sim.copy_free[0] - sim.t;
            sim.t = sim.copy_free[0];
        }
        for &u in &g.linger_release_after_fwd[i] {
            sim.mem -= std::mem::take(&mut sim.s.lingering[u]);
            sim.ev.free(What::Lingering(u), sim.t);
        }
        sim.touch(sim.mem);
        sim.end_stage(t0);
        if hooks.as_deref_mut().is_some_and(|h| h.cannot_beat(&mut sim, Stage::Fwd(i))) {
            return None;
        }
    }
    // A segment none of whose units has activations is never replayed: its held inputs leave
    // when the forward ends.
    for u in 0..n {
        if actions[u] == Action::Recompute && g.act[u] > 0 {
            sim.s.run_replays[sim.s.run_start[u]] = true;
        }
    }
    for u in 0..n {
        if actions[u] == Action::Recompute && !sim.s.run_replays[sim.s.run_start[u]] {
            sim.release_held(u);
        }
    }

    // Backward stages, last unit first. Prefetch candidates in the order the backward needs them.
    let mut next = 0usize;
    for i in (0..n).rev() {
        let t0 = sim.t;
        sim.begin_stage(Stage::Bwd(i));
        for &u in schedule.at_bwd(i) {
            sim.prefetch_state(Moved::OptimizerState, u);
        }
        // The loss's backward runs before the stage's first node, so before the prefetches the
        // executor issues there and before the stage's replays.
        if g.loss_transient[i] > 0 {
            sim.make_room(g.loss_transient[i]);
            if E::ENABLED {
                sim.ev.alloc(What::LossWork(i), g.loss_transient[i], sim.t);
                sim.ev.free(What::LossWork(i), sim.t);
            }
        }
        // Issue prefetches whose need is within the lookahead window, most urgent first, while
        // they fit; the one needed by this very stage is issued regardless (in `ensure`).
        while next < g.need_order.len() {
            let u = g.need_order[next];
            let need = g.first_need[u].unwrap_or(0);
            if need + sim.lookahead < i {
                break;
            }
            if need > i || actions[u] != Action::Swap || !sim.s.host[u] || sim.s.resident[u] && !sim.s.in_queue[u] {
                next += 1;
                continue;
            }
            let fits = sim.mem + g.act[u] + g.bwd_transient[i] + g.grad[i] <= budget;
            if need < i && (!fits || i > sim.s.issue_from[u]) {
                break;
            }
            if need < i {
                sim.s.early.push(u);
                sim.s.early_at.push((sim.t, i, sim.recompute));
            }
            sim.issue_prefetch(u, i);
            next += 1;
        }
        for k in 0..g.needs[i].len() {
            let u = g.needs[i][k];
            // What a recomputed unit saved of another segment's recomputed unit is its held input:
            // its own segment's replay hands it back.
            if actions[i] == Action::Recompute && actions[u] == Action::Recompute && u < sim.s.run_start[i] {
                if !sim.s.replayed[i] {
                    sim.replay_run(i, i);
                }
                continue;
            }
            sim.ensure(u, i);
        }
        sim.make_room(g.bwd_transient[i] + g.grad[i]);
        if E::ENABLED {
            sim.ev.alloc(What::BwdWork(i), g.bwd_transient[i], sim.t);
            sim.ev.alloc(What::Grad(i), g.grad[i], sim.t);
        }
        sim.run_stage(g.bwd_time[i], g.bwd_host.as_ref().map(|h| h[i]), 0.0);
        sim.ev.free(What::BwdWork(i), sim.t);
        sim.mem += g.grad[i];
        for &u in &g.frees_after_bwd[i] {
            if sim.s.resident[u] {
                sim.s.resident[u] = false;
                if sim.s.in_queue[u] {
                    sim.s.in_queue[u] = false;
                }
                sim.mem -= g.act[u];
                sim.free_act(u);
            }
        }
        if actions[i] == Action::Recompute {
            sim.release_held(i);
            sim.mem -= std::mem::take(&mut sim.s.held_saved[i]);
            sim.ev.free(What::HeldSaved(i), sim.t);
        }
        sim.touch(sim.mem);
        sim.end_stage(t0);
        if hooks.as_deref_mut().is_some_and(|h| h.cannot_beat(&mut sim, Stage::Bwd(i))) {
            return None;
        }
        if sim.s.retry {
            return None; // the step is simulated again (run_with_events)
        }
    }

    // The optimizer step: one call when nothing is swapped across iterations; else one stage per
    // unit, each updating the unit's parameters (with its optimizer state, waiting for its
    // prefetch), then queueing the swap-outs of what the plan keeps on the host.
    if g.has_optimizer && !schedule.any {
        let t0 = sim.t;
        sim.begin_stage(Stage::OptStep);
        sim.make_room(g.opt_step_transient);
        sim.ev.alloc(What::OptWork(n), g.opt_step_transient, sim.t);
        sim.t += g.opt_step_time;
        sim.ev.free(What::OptWork(n), sim.t);
        sim.touch(sim.mem);
        sim.end_stage(t0);
    }
    let chunks: &[usize] = if schedule.any { &g.opt_order } else { &[] };
    for (k, &u) in chunks.iter().enumerate() {
        let t0 = sim.t;
        sim.begin_stage(Stage::Opt(u));
        for &v in schedule.at_opt(k) {
            sim.prefetch_state(Moved::OptimizerState, v);
        }
        if schedule.state(u) {
            sim.ensure_state(Moved::OptimizerState, u);
        }
        let (time, transient) = g.opt_stage(u);
        sim.make_room(transient);
        sim.ev.alloc(What::OptWork(u), transient, sim.t);
        sim.t += time;
        sim.ev.free(What::OptWork(u), sim.t);
        if schedule.param(u) {
            sim.swap_out_state(Moved::Parameters, u);
        }
        if schedule.state(u) {
            sim.swap_out_state(Moved::OptimizerState, u);
        }
        sim.touch(sim.mem);
        sim.end_stage(t0);
    }
    if g.has_optimizer {
        // The step ends when the swap-outs of this step have completed (TENSILE: the executor
        // waits for the unfinished swap events of the iteration); the wait is swap stall.
        // (No deadline is recorded: the executor waits for all of them when the step ends.)
        sim.record = false;
        while sim.wait_next_swap_out() {}
    }

    let opt_time: f64 = match (g.has_optimizer, schedule.any) {
        (false, _) => 0.0,
        (true, false) => g.opt_step_time,
        (true, true) => g.opt_time.iter().sum::<f64>() + g.opt_other_time,
    };
    let compute_time: f64 = g.fwd_time.iter().sum::<f64>() + g.bwd_time.iter().sum::<f64>() + opt_time;
    let feasible = sim.excess == 0;
    Some(Outcome {
        step_time: sim.t,
        compute_time,
        swap_stall: sim.stall,
        recompute: sim.recompute,
        host_time: sim.host,
        copy_time: sim.copy_time,
        overlapped_copy: (sim.copy_time - sim.stall).max(0.0),
        cancelled_swaps: sim.cancelled,
        peak_bytes: sim.peak,
        peak_stage: sim.peak_stage,
        end_bytes: sim.mem,
        feasible,
        excess: sim.excess,
        reason: if feasible { None } else { sim.reason.map(Overflow::reason) },
        curve: sim.curve,
        prefetch: sim.prefetch,
        swap_deadlines: sim.deadlines,
        unstarted_swaps: {
            let mut units = sim.unstarted;
            units.sort_unstable();
            units
        },
        in_flight_swaps: {
            let mut units = sim.in_flight;
            units.sort_unstable();
            units
        },
        copies: {
            let mut copies = sim.copies;
            if !sim.dropped_copies.is_empty() {
                let mut keep = vec![true; copies.len()];
                sim.dropped_copies.iter().for_each(|&i| keep[i] = false);
                let mut i = 0;
                copies.retain(|_| {
                    i += 1;
                    keep[i - 1]
                });
            }
            copies
        },
        replays: sim.replays,
        state_prefetch: sim.state_prefetch,
        state_deadlines: sim.state_deadlines,
    })
}

/// Score only (the search's hot path).
pub fn score(g: &Graph, actions: &[Action], budget: u64, opts: &EvalOptions, scratch: &mut Scratch) -> Score {
    evaluate(g, actions, budget, opts, scratch, false).score()
}

// ---- Incremental evaluation (crate::incremental): saved states and a bound -------------------
//
// The search's moves change a plan from some unit on. A forward stage Fi reads the actions (and
// what follows from them: runs, held bytes) of units up to i only, so the state at the start of
// Fi is the same for every plan that agrees on the units before i: a search saves it once for
// its current plan and resumes this same simulation from it. These hooks are the only addition
// to the simulation for that; its rules stay in one place.

/// What the simulation carries from one stage to the next that does not follow from the plan:
/// saved at the start of a forward stage. (Parameters and optimizer state swapped across
/// iterations are not saved: hooked evaluations have none.)
#[derive(Debug, Clone, Default)]
pub struct SimState {
    /// The forward stage at whose start the state was saved.
    pub stage: usize,
    head: usize,
    t: f64,
    h: f64,
    host_time: f64,
    copy_free: [f64; 2],
    mem: u64,
    peak: u64,
    peak_stage: Option<Stage>,
    stall: f64,
    recompute: f64,
    copy_time: f64,
    cancelled: usize,
    excess: u64,
    reason: Option<Overflow>,
    resident: Vec<bool>,
    host: Vec<bool>,
    ready: Vec<f64>,
    in_queue: Vec<bool>,
    held: Vec<bool>,
    lingering: Vec<u64>,
    replayed: Vec<bool>,
    queue: Vec<(f64, u32)>,
    fwd_busy: Vec<bool>,
    parked: Vec<u32>,
    pending: Vec<PendingCopy>,
    pending_of: Vec<usize>,
}

impl SimState {
    fn capture<E: MemoryEvents>(&mut self, stage: usize, sim: &Sim<E>) {
        self.stage = stage;
        self.head = sim.head;
        self.t = sim.t;
        self.h = sim.h;
        self.host_time = sim.host;
        self.copy_free = sim.copy_free;
        self.mem = sim.mem;
        self.peak = sim.peak;
        self.peak_stage = Some(sim.peak_stage);
        self.stall = sim.stall;
        self.recompute = sim.recompute;
        self.copy_time = sim.copy_time;
        self.cancelled = sim.cancelled;
        self.excess = sim.excess;
        self.reason = sim.reason;
        let s = &sim.s;
        self.resident.clone_from(&s.resident);
        self.host.clone_from(&s.host);
        self.ready.clone_from(&s.ready);
        self.in_queue.clone_from(&s.in_queue);
        self.held.clone_from(&s.held);
        self.lingering.clone_from(&s.lingering);
        self.replayed.clone_from(&s.replayed);
        self.queue.clone_from(&s.queue);
        self.fwd_busy.clone_from(&s.fwd_busy);
        self.parked.clone_from(&s.parked);
        self.pending.clone_from(&s.pending);
        self.pending_of.clone_from(&s.pending_of);
    }

    fn restore<E: MemoryEvents>(&self, sim: &mut Sim<E>) {
        sim.head = self.head;
        sim.t = self.t;
        sim.h = self.h;
        sim.host = self.host_time;
        sim.copy_free = self.copy_free;
        sim.mem = self.mem;
        sim.peak = self.peak;
        sim.peak_stage = self.peak_stage.expect("a saved state");
        sim.stall = self.stall;
        sim.recompute = self.recompute;
        sim.copy_time = self.copy_time;
        sim.cancelled = self.cancelled;
        sim.excess = self.excess;
        sim.reason = self.reason;
        let s = &mut sim.s;
        s.resident.copy_from_slice(&self.resident);
        s.host.copy_from_slice(&self.host);
        s.ready.copy_from_slice(&self.ready);
        s.in_queue.copy_from_slice(&self.in_queue);
        s.held.copy_from_slice(&self.held);
        s.lingering.copy_from_slice(&self.lingering);
        s.replayed.copy_from_slice(&self.replayed);
        s.queue.clone_from(&self.queue);
        s.fwd_busy.copy_from_slice(&self.fwd_busy);
        s.parked.clone_from(&self.parked);
        s.pending.clone_from(&self.pending);
        s.pending_of.copy_from_slice(&self.pending_of);
    }
}

/// How a search evaluation uses the simulation (crate::incremental).
pub(crate) struct Hooks<'h> {
    /// Start from this state, saved by an evaluation of a plan that agrees with this one on
    /// every unit before its stage (under the same budget, options and segment starts).
    pub resume: Option<&'h SimState>,
    /// Save the state at the start of forward stage `k * stride` into `save[k - first_slot]`
    /// (where that slot exists; 0: save nothing).
    pub stride: usize,
    pub first_slot: usize,
    pub save: &'h mut [SimState],
    /// Stop as soon as the plan cannot beat this score: after stage Fi its step ends no sooner
    /// than now plus `rest_after_fwd[i]` (the stage times still to run) plus `replays`, after
    /// Bi `rest_after_bwd[i]` plus the replays not run yet, and its excess over the budget
    /// never shrinks.
    pub bound: Option<Score>,
    pub rest_after_fwd: &'h [f64],
    pub rest_after_bwd: &'h [f64],
    /// The forward time of the units the backward replays (set by the simulation with a bound:
    /// [`replay_time`]).
    pub replays: f64,
    /// Forward and backward stages simulated (counted at their end).
    pub stages: u64,
    /// The last slot saved (None: none yet).
    pub saved: Option<usize>,
    /// The plan swaps (set by [`score_hooked`]): until a stage first overflows, a later first
    /// overflow may have the step simulated again with prefetches moved ([`run_with_events`]).
    pub swaps: bool,
}

impl Hooks<'_> {
    fn resume<E: MemoryEvents>(&self, sim: &mut Sim<E>) -> usize {
        match self.resume {
            Some(state) => {
                state.restore(sim);
                state.stage
            }
            None => 0,
        }
    }

    fn save<E: MemoryEvents>(&mut self, stage: usize, sim: &Sim<E>) {
        if self.stride > 0 && stage % self.stride == 0 {
            let slot = stage / self.stride;
            if slot >= self.first_slot && slot - self.first_slot < self.save.len() {
                self.save[slot - self.first_slot].capture(stage, sim);
                self.saved = Some(slot);
            }
        }
    }

    /// The plan, simulated up to the end of `stage`, ends strictly worse than the bound. (A
    /// relative margin of 1e-9 covers the rounding of the remaining stage times' sum.)
    fn cannot_beat<E: MemoryEvents>(&mut self, sim: &mut Sim<E>, stage: Stage) -> bool {
        self.stages += 1;
        let Some(b) = self.bound else { return false };
        // Still to run: the stage times, and the replays (each adds at least its unit's forward
        // time to the clock; which units the backward replays follows from the plan alone).
        let (rest, forward) = match stage {
            Stage::Fwd(i) => (self.rest_after_fwd[i] + self.replays, true),
            Stage::Bwd(i) => (self.rest_after_bwd[i] + (self.replays - sim.recompute), false),
            _ => return false,
        };
        // The step is simulated again when its first overflow blamed prefetches that the next
        // run issues later (run_with_events; such a run stops at the end of that stage); before a
        // first overflow, a plan with swaps may still have one. Every run simulates the same
        // forward (prefetches are issued in the backward), and a later run is this one up to the
        // first prefetch ahead of its need that a later overflow can blame (one whose need has
        // not come yet): the clock there and the stage times and replays still to run then bound
        // whichever run is the last. After a first overflow that blamed none, this run is it.
        if sim.s.retry {
            return false;
        }
        let last_run = forward || sim.reason.is_some() || !self.swaps;
        let end = if last_run {
            sim.t + rest
        } else {
            let i = match stage {
                Stage::Bwd(i) => i,
                _ => unreachable!("a forward stage's run is the last"),
            };
            let (early, first_need) = (&sim.s.early, &sim.g.first_need);
            while sim.early_head < early.len() && first_need[early[sim.early_head]].is_none_or(|f| f + 1 >= i) {
                sim.early_head += 1;
            }
            match sim.s.early_at.get(sim.early_head) {
                Some(&(t, k, recompute)) => t + sim.g.bwd_time[k] + self.rest_after_bwd[k] + (self.replays - recompute),
                None => sim.t + rest,
            }
        };
        let slower = end > b.time + b.time.abs() * 1e-9;
        if b.feasible {
            sim.excess > 0 || slower
        } else {
            sim.excess > b.excess || (sim.excess == b.excess && slower)
        }
    }
}

/// Per unit, the first unit of the run of consecutive recomputed units that contains it (itself
/// when it is not recomputed); `starts[u]` splits a run before u.
fn run_starts(actions: &[Action], starts: &[bool], run_start: &mut [usize]) {
    for u in 0..actions.len() {
        let joins = u > 0 && !starts[u] && actions[u] == Action::Recompute && actions[u - 1] == Action::Recompute;
        run_start[u] = if joins { run_start[u - 1] } else { u };
    }
}

/// The forward time of every unit the backward replays under `actions` and segment `starts`:
/// its simulation's recompute time (`Outcome::recompute`), added up in unit order. The search's
/// bound counts it as still to run before the backward (crate::incremental).
pub fn replay_time(g: &Graph, actions: &[Action], starts: &[bool]) -> f64 {
    let mut run_start = vec![0; g.n];
    run_starts(actions, starts, &mut run_start);
    replay_time_of(g, actions, &run_start, &mut Vec::new())
}

/// [`replay_time`] from the plan's runs (`run_start`): a run of recomputed units is replayed,
/// every unit of it once, when the backward first makes one of its units resident, and when a
/// unit of it reads what a recomputed unit of an earlier segment saved (the simulation's
/// backward stages: `ensure`, `replay_run`). Which runs those are follows from the plan alone,
/// not from when anything happens.
fn replay_time_of(g: &Graph, actions: &[Action], run_start: &[usize], replayed_run: &mut Vec<bool>) -> f64 {
    let n = g.n;
    replayed_run.clear();
    replayed_run.resize(n, false);
    for u in 0..n {
        if actions[u] != Action::Recompute {
            continue;
        }
        for &r in &g.readers[u] {
            if actions[r] == Action::Recompute && u < run_start[r] {
                replayed_run[run_start[r]] = true;
            } else {
                replayed_run[run_start[u]] = true;
            }
        }
    }
    let mut time = 0.0;
    for u in 0..n {
        if actions[u] == Action::Recompute && replayed_run[run_start[u]] {
            time += g.fwd_time[u];
        }
    }
    time
}

/// A search evaluation with hooks: the plan's score, or None when it stopped because the plan
/// cannot beat `hooks.bound`. Without swaps across iterations, events or records.
pub(crate) fn score_hooked(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    hooks: &mut Hooks,
) -> Option<Score> {
    // run_with_events' retries, each resumed from the same saved state (prefetches are issued in
    // the backward only, so the forward states do not depend on when)
    hooks.swaps = actions.contains(&Action::Swap);
    scratch.issue_any_time(g.n);
    loop {
        let out = simulate(g, actions, starts, &StateSwaps::none(), budget, opts, scratch, false, &mut NoEvents, Some(&mut *hooks));
        if !scratch.issue_blamed_later() {
            return out.map(|o| o.score());
        }
    }
}
