//! The evaluator's allocation sequence: the device blocks the cost model allocates and frees, in
//! the order it has them happen, as [`AllocEvent`]s for the allocator simulation
//! ([`crate::allocator::simulate`]), and the reserved peak of a plan that follows from them
//! (docs/cost-model.md, "Reserved memory").
//!
//! The evaluator reports every change of its memory count to a [`MemoryEvents`] sink, with the
//! time it happens (seconds from the step's start on the compute stream, as the evaluator plays
//! the step; a transient leaves when the compute or replay that uses it ends). The search
//! passes [`NoEvents`], whose methods are empty and whose `ENABLED` is false, so the hooks compile
//! away; [`Recorder`] turns them into blocks.
//!
//! Convention: the profile's constant memory (parameters, optimizer state, inputs, workspace) is
//! not in the sequence. It is the simulator's initial state, live bytes that fill the memory
//! reserved at the start (nothing cached). So at every event, the constant memory plus the bytes
//! of the live blocks is the evaluator's memory count, and the largest such sum is the
//! evaluator's `peak_bytes`.
//!
//! Blocks larger than the profile's largest unit output are allocated in pieces of that size
//! ([`Recorder`]): the profile gives sums over tensors, not the tensors, and the largest output
//! is the best guess of the largest tensor (docs/cost-model.md, "Reserved memory"). The
//! exceptions are the single requests larger than that which the profile lists for a stage or
//! replay (`fwd_large_allocs`, ...: cuDNN workspaces): its transient block allocates them as
//! they came, each but the last freed before the next.
//!
//! The simulator counts a block's rounded size (512 bytes, and whole
//! 2 MiB segment tails it does not split off), so its allocated peak can be a little higher
//! where sizes are not multiples of 2 MiB.

use crate::action::Action;
use crate::allocator::{simulate, AllocConf, AllocEvent, AllocStats, Initial};
use crate::error::Result;
use crate::evaluator::{run_with_events, EvalOptions, Outcome, Scratch, StateSwaps};
use crate::profile::Graph;
use serde::Serialize;
use std::collections::HashMap;

/// What a device block of the cost model holds. Unit indices name the unit (or, for stage
/// blocks, the stage's unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", content = "unit", rename_all = "snake_case")]
pub enum What {
    /// A unit's activations (its saved tensors), from its forward, prefetch or replay.
    Act(usize),
    /// The part of a dropped or swapped unit's activations that the forward's code still
    /// references after the unit's last forward reader (`lingering_bytes`), while it is still
    /// part of the activations.
    ActLinger(usize),
    /// The same bytes after the rest of the activations left: freed at `lingering_until`.
    Lingering(usize),
    /// An unsaved output, from the unit's forward to its last forward reader.
    Output(usize),
    /// What a recomputed unit holds for its replay (its unsaved inputs), from its forward to the
    /// replay.
    Held(usize),
    /// Saved values of another segment's recomputed units that a recomputed unit holds, from its
    /// forward to its backward.
    HeldSaved(usize),
    /// Parameter gradients of a unit's backward, kept to the end of the step.
    Grad(usize),
    /// Transient: the scratch memory of a forward stage (`fwd_transient_bytes`).
    FwdWork(usize),
    /// Transient: a replay's memory beyond its activations (`replay_transient_bytes`).
    ReplayWork(usize),
    /// Transient: unsaved values of earlier units of the segment a replay regenerates.
    Regenerated(usize),
    /// Transient: activations of retained or replayed inputs already let go that a replay reads.
    Kept(usize),
    /// Transient: a backward stage's memory (`bwd_transient_bytes`): incoming gradient, the
    /// gradients for its inputs, scratch. Also under a replay inside the stage.
    BwdWork(usize),
    /// Transient: the stage's parameter gradients charged under a replay inside the stage.
    ReplayGrad(usize),
    /// Transient: the loss's backward before the stage (`loss_transient_bytes`).
    LossWork(usize),
    /// Swapped parameters of a unit, from their prefetch to their swap-out after the optimizer.
    Param(usize),
    /// Swapped optimizer state of a unit, from its prefetch to its swap-out.
    OptState(usize),
    /// Transient: an optimizer stage's memory (`optimizer_transient_bytes`).
    OptWork(usize),
}

impl What {
    pub fn label(&self) -> String {
        let (k, u) = match *self {
            What::Act(u) => ("act", u),
            What::ActLinger(u) => ("act_linger", u),
            What::Lingering(u) => ("lingering", u),
            What::Output(u) => ("output", u),
            What::Held(u) => ("held", u),
            What::HeldSaved(u) => ("held_saved", u),
            What::Grad(u) => ("grad", u),
            What::FwdWork(u) => ("fwd_work", u),
            What::ReplayWork(u) => ("replay_work", u),
            What::Regenerated(u) => ("regenerated", u),
            What::Kept(u) => ("kept", u),
            What::BwdWork(u) => ("bwd_work", u),
            What::ReplayGrad(u) => ("replay_grad", u),
            What::LossWork(u) => ("loss_work", u),
            What::Param(u) => ("param", u),
            What::OptState(u) => ("opt_state", u),
            What::OptWork(u) => ("opt_work", u),
        };
        format!("{k}:{u}")
    }
}

/// Where the evaluator reports its memory changes.
pub trait MemoryEvents {
    /// False for the no-op sink: the evaluator skips the work of reporting.
    const ENABLED: bool;
    /// `bytes` are allocated as block `what` at time `at` (nothing for 0 bytes).
    fn alloc(&mut self, what: What, bytes: u64, at: f64);
    /// Block `what` is freed at time `at` (nothing when it is not live).
    fn free(&mut self, what: What, at: f64);
    /// Block `from`, still live, is known as `to` from now on (nothing when it is not live).
    fn rename(&mut self, from: What, to: What);
}

/// The search's sink: reports nothing.
pub struct NoEvents;

impl MemoryEvents for NoEvents {
    const ENABLED: bool = false;
    #[inline(always)]
    fn alloc(&mut self, _: What, _: u64, _: f64) {}
    #[inline(always)]
    fn free(&mut self, _: What, _: f64) {}
    #[inline(always)]
    fn rename(&mut self, _: What, _: What) {}
}

/// Records the blocks as allocator events (all on stream 0, the compute stream: the executor
/// allocates prefetch destinations there too). Ids are never reused.
///
/// A block larger than `max_tensor` is allocated as pieces of `max_tensor` bytes and a rest (and
/// freed together): the cost model's blocks are sums over several tensors, and one block of the
/// sum would never fit into the space several smaller freed tensors leave.
#[derive(Debug, Default, Clone)]
pub struct Recorder {
    pub events: Vec<AllocEvent>,
    /// Per event, the block it allocates or frees.
    pub what: Vec<What>,
    /// Per event, when it happens (seconds from the step's start).
    pub times: Vec<f64>,
    /// The largest allocation (0: no limit), but for `large`.
    pub max_tensor: u64,
    /// Per transient block, the single requests larger than `max_tensor` it makes, in order.
    pub large: HashMap<What, Vec<u64>>,
    /// Per live block: the ids of its pieces still allocated, its bytes.
    live: HashMap<What, (Vec<u64>, u64)>,
    next_id: u64,
    /// A block allocated while a block of the same name was live (a bug of the hooks).
    pub error: Option<String>,
}

impl Recorder {
    /// Bytes of the live blocks.
    pub fn live_bytes(&self) -> u64 {
        self.live.values().map(|(_, b)| b).sum()
    }

    fn push(&mut self, event: AllocEvent, what: What, at: f64) {
        self.events.push(event);
        self.what.push(what);
        self.times.push(at);
    }

    /// Allocate `bytes` as pieces of at most `max_tensor`, their ids added to `ids`.
    fn pieces(&mut self, what: What, mut left: u64, at: f64, ids: &mut Vec<u64>) {
        while left > 0 {
            let size = if self.max_tensor > 0 { left.min(self.max_tensor) } else { left };
            let id = self.next_id;
            self.next_id += 1;
            self.push(AllocEvent::Alloc { id, size, stream: 0 }, what, at);
            ids.push(id);
            left -= size;
        }
    }
}

impl MemoryEvents for Recorder {
    const ENABLED: bool = true;

    fn alloc(&mut self, what: What, bytes: u64, at: f64) {
        if bytes == 0 {
            return;
        }
        if self.live.contains_key(&what) && self.error.is_none() {
            self.error = Some(format!("block {} allocated twice (event {})", what.label(), self.events.len()));
        }
        // The block's large requests that fit in it, as they came: each but the last freed before
        // the next one, the rest of the block in pieces beside them. The block holds `bytes` at
        // its end and never more.
        let large: Vec<u64> =
            self.large.get(&what).map(|l| l.iter().copied().filter(|&w| w <= bytes).collect()).unwrap_or_default();
        let largest = large.iter().copied().max().unwrap_or(0);
        let mut ids = Vec::new();
        self.pieces(what, bytes - largest, at, &mut ids);
        for (k, &w) in large.iter().enumerate() {
            let id = self.next_id;
            self.next_id += 1;
            self.push(AllocEvent::Alloc { id, size: w, stream: 0 }, what, at);
            if k + 1 < large.len() {
                self.push(AllocEvent::Free { id }, what, at);
            } else {
                ids.push(id);
            }
        }
        let last = large.last().copied().unwrap_or(0);
        self.pieces(what, largest - last, at, &mut ids);
        self.live.insert(what, (ids, bytes));
    }

    fn free(&mut self, what: What, at: f64) {
        if let Some((ids, _)) = self.live.remove(&what) {
            for id in ids {
                self.push(AllocEvent::Free { id }, what, at);
            }
        }
    }

    fn rename(&mut self, from: What, to: What) {
        if let Some(block) = self.live.remove(&from) {
            self.live.insert(to, block);
        }
    }
}

/// A plan's allocation sequence, with the evaluation it comes from.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub outcome: Outcome,
    /// The profile's constant memory less what the plan keeps on the host between steps: the
    /// simulator's initial live bytes.
    pub constant: u64,
    pub events: Vec<AllocEvent>,
    pub what: Vec<What>,
    /// Per event, when it happens (seconds from the step's start, non-decreasing).
    pub times: Vec<f64>,
}

impl Sequence {
    /// The simulator's initial state under this module's convention.
    pub fn initial(&self) -> Initial {
        Initial { allocated: self.constant, reserved: self.constant, free_blocks: Vec::new() }
    }

    /// After every event, the constant memory plus the live blocks' bytes (requested, not
    /// rounded): the evaluator's memory count.
    pub fn requested(&self) -> Vec<u64> {
        let mut size: HashMap<u64, u64> = HashMap::new();
        let mut cur = self.constant;
        self.events
            .iter()
            .map(|e| {
                match *e {
                    AllocEvent::Alloc { id, size: b, .. } => {
                        size.insert(id, b);
                        cur += b;
                    }
                    AllocEvent::Free { id } | AllocEvent::FreeRequested { id } => cur -= size.remove(&id).unwrap_or(0),
                    AllocEvent::FreeCompleted { .. } => {}
                }
                cur
            })
            .collect()
    }

    /// The largest of [`Sequence::requested`] and the constant memory: the evaluator's
    /// `peak_bytes`.
    pub fn requested_peak(&self) -> u64 {
        self.requested().into_iter().fold(self.constant, u64::max)
    }

    /// The sequence simulated under `conf`, whose initial state is replaced by the constant
    /// memory (the module's convention).
    pub fn simulate(&self, conf: &AllocConf) -> Result<AllocStats> {
        simulate(&self.events, &AllocConf { initial: self.initial(), segment_addresses: Vec::new(), ..conf.clone() })
    }
}

/// Evaluate `actions` (as [`crate::evaluator::evaluate_segments`]) and record its allocation
/// sequence. Errors only on an inconsistency of the evaluator's hooks.
pub fn allocation_sequence(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    budget: u64,
    opts: &EvalOptions,
) -> Result<Sequence> {
    allocation_sequence_with_swaps(g, actions, starts, &StateSwaps::none(), budget, opts)
}

/// [`allocation_sequence`] of a plan that also keeps parameters or optimizer state on the host
/// between steps: their prefetches and swap-outs are blocks too, and the simulation starts
/// without them.
pub fn allocation_sequence_with_swaps(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    swaps: &StateSwaps,
    budget: u64,
    opts: &EvalOptions,
) -> Result<Sequence> {
    let max_tensor = g.out.iter().copied().max().unwrap_or(0);
    let mut large = HashMap::new();
    for u in 0..g.n {
        for (what, l) in [(What::FwdWork(u), &g.fwd_large[u]), (What::BwdWork(u), &g.bwd_large[u]), (What::ReplayWork(u), &g.replay_large[u])] {
            let l: Vec<u64> = l.iter().copied().filter(|&w| w > max_tensor).collect();
            if !l.is_empty() {
                large.insert(what, l);
            }
        }
    }
    let mut rec = Recorder { max_tensor, large, ..Recorder::default() };
    let outcome = run_with_events(g, actions, starts, swaps, budget, opts, &mut Scratch::new(g.n), true, &mut rec);
    if let Some(e) = rec.error {
        return Err(crate::error::CoreError::InvalidPlan(format!("allocation sequence: {e}")));
    }
    let constant = g.constant - swaps.host_bytes(g);
    Ok(Sequence { outcome, constant, events: rec.events, what: rec.what, times: rec.times })
}

/// The reserved memory of a plan: its allocation sequence simulated under `conf` (the initial
/// state of `conf` is replaced by the constant memory, see the module's convention).
pub fn reserved_peak(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    budget: u64,
    opts: &EvalOptions,
    conf: &AllocConf,
) -> Result<(Sequence, AllocStats)> {
    reserved_peak_with_swaps(g, actions, starts, &StateSwaps::none(), budget, opts, conf)
}

/// [`reserved_peak`] with parameters or optimizer state swapped across iterations.
pub fn reserved_peak_with_swaps(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    swaps: &StateSwaps,
    budget: u64,
    opts: &EvalOptions,
    conf: &AllocConf,
) -> Result<(Sequence, AllocStats)> {
    let seq = allocation_sequence_with_swaps(g, actions, starts, swaps, budget, opts)?;
    let stats = seq.simulate(conf)?;
    Ok((seq, stats))
}
