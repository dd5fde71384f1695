//! Parameters and optimizer state swapped across iterations (TENSILE): which units' a plan keeps
//! in host memory between optimizer steps ([`StateSwaps`]), and when the cost model issues their
//! prefetches ([`StateSchedule`]; docs/cost-model.md, "Optimizer step").
//!
//! A swapped unit's parameters leave the device after its optimizer stage and come back before
//! its next forward; its optimizer state leaves after its optimizer stage and comes back before
//! the next one. Prefetches are issued as late as the step's compute-only timeline allows
//! without the copy being late, with the copies of one kind queued in the order they are needed
//! (FIFO): the last copy ends at its need, each earlier one by the start of the next. A prefetch
//! of parameters is issued at the start of a forward stage (at the latest the unit's own), one of
//! optimizer state at the start of a backward stage or of an earlier optimizer stage.

use crate::profile::Graph;

/// Which units' parameters and optimizer state a plan keeps in host memory between optimizer
/// steps (TENSILE's swapping across iterations; docs/cost-model.md, "Optimizer step"): each
/// leaves the device after its unit's optimizer stage and comes back before its next use, the
/// parameters before the unit's forward, the state before its optimizer stage. Empty vectors:
/// nothing is swapped. Only profiles with an optimizer step can swap them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateSwaps {
    pub params: Vec<bool>,
    pub states: Vec<bool>,
}

impl StateSwaps {
    /// Nothing swapped.
    pub fn none() -> StateSwaps {
        StateSwaps::default()
    }

    /// Every unit's parameters and optimizer state that the profile lists (none without an
    /// optimizer step).
    pub fn all(g: &Graph) -> StateSwaps {
        StateSwaps {
            params: (0..g.n).map(|u| g.param[u] > 0).collect(),
            states: (0..g.n).map(|u| g.opt_state[u] > 0).collect(),
        }
    }

    /// From unit lists (indices must be below `n`).
    pub fn from_units(n: usize, params: &[usize], states: &[usize]) -> StateSwaps {
        let mut s = StateSwaps { params: vec![false; n], states: vec![false; n] };
        for &u in params {
            s.params[u] = true;
        }
        for &u in states {
            s.states[u] = true;
        }
        s
    }

    pub fn param(&self, u: usize) -> bool {
        self.params.get(u).copied().unwrap_or(false)
    }

    pub fn state(&self, u: usize) -> bool {
        self.states.get(u).copied().unwrap_or(false)
    }

    /// The swapped units with bytes to move in `g`: (parameters, optimizer state), ascending.
    pub fn units(&self, g: &Graph) -> (Vec<usize>, Vec<usize>) {
        if !g.has_optimizer {
            return (Vec::new(), Vec::new());
        }
        (
            (0..g.n).filter(|&u| self.param(u) && g.param[u] > 0).collect(),
            (0..g.n).filter(|&u| self.state(u) && g.opt_state[u] > 0).collect(),
        )
    }

    /// Bytes off the device when the step starts (and between steps).
    pub fn host_bytes(&self, g: &Graph) -> u64 {
        let (p, s) = self.units(g);
        p.iter().map(|&u| g.param[u]).sum::<u64>() + s.iter().map(|&u| g.opt_state[u]).sum::<u64>()
    }

    /// Whether anything is swapped in `g`.
    pub fn any(&self, g: &Graph) -> bool {
        let (p, s) = self.units(g);
        !(p.is_empty() && s.is_empty())
    }
}


/// When the evaluator issues the prefetches of a plan's swapped parameters and optimizer state.
#[derive(Debug, Clone, Default)]
pub struct StateSchedule {
    /// Per unit: its parameters / optimizer state are swapped (and have bytes). These vectors
    /// are empty when nothing is swapped: read them through the methods.
    pub params: Vec<bool>,
    pub states: Vec<bool>,
    /// Per forward stage, the units whose parameters are prefetched at its start (ascending).
    pub at_fwd: Vec<Vec<usize>>,
    /// Per backward stage, the units whose optimizer state is prefetched at its start.
    pub at_bwd: Vec<Vec<usize>>,
    /// Per optimizer stage (position in `Graph::opt_order`), the same.
    pub at_opt: Vec<Vec<usize>>,
    /// Bytes on the host when the step starts.
    pub host_bytes: u64,
    /// Something is swapped: the optimizer step runs as one stage per unit.
    pub any: bool,
}

impl StateSchedule {
    pub fn new(g: &Graph, swaps: &StateSwaps) -> StateSchedule {
        let n = g.n;
        let (pu, su) = swaps.units(g);
        if pu.is_empty() && su.is_empty() {
            // nothing swapped (every search evaluation): nothing to allocate
            return StateSchedule::default();
        }
        let mut s = StateSchedule {
            params: vec![false; n],
            states: vec![false; n],
            at_fwd: vec![Vec::new(); n],
            at_bwd: vec![Vec::new(); n],
            at_opt: vec![Vec::new(); g.opt_order.len()],
            host_bytes: swaps.host_bytes(g),
            any: !(pu.is_empty() && su.is_empty()),
        };
        if !s.any {
            return s;
        }
        // Compute-only start times: forward stages, then backward stages, then optimizer stages.
        let mut fwd_start = vec![0.0; n];
        let mut t = 0.0;
        for i in 0..n {
            fwd_start[i] = t;
            t += g.fwd_time[i];
        }
        let mut bwd_start = vec![0.0; n];
        for i in (0..n).rev() {
            bwd_start[i] = t;
            t += g.bwd_time[i];
        }
        let mut opt_start = vec![0.0; g.opt_order.len()];
        for (k, &u) in g.opt_order.iter().enumerate() {
            opt_start[k] = t;
            t += g.opt_stage(u).0;
        }
        // A copy late by less than this (rounding) is on time.
        const SLACK: f64 = 1e-9;
        // Parameters: needed at their unit's forward, in ascending order.
        let mut next_start = f64::INFINITY;
        for &u in pu.iter().rev() {
            s.params[u] = true;
            let start = fwd_start[u].min(next_start) - g.param[u] as f64 / g.h2d;
            next_start = start;
            let at = (0..=u).rev().find(|&j| fwd_start[j] <= start + SLACK).unwrap_or(0);
            s.at_fwd[at].push(u);
        }
        for v in s.at_fwd.iter_mut() {
            v.sort_unstable();
        }
        // Optimizer state: needed at its unit's optimizer stage, in the stages' order.
        let mut next_start = f64::INFINITY;
        let mut order: Vec<(usize, usize)> =
            g.opt_order.iter().enumerate().filter(|&(_, &u)| u < n && su.contains(&u)).map(|(k, &u)| (k, u)).collect();
        order.reverse();
        let mut at_bwd: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut at_opt: Vec<Vec<usize>> = vec![Vec::new(); g.opt_order.len()];
        for &(k, u) in &order {
            s.states[u] = true;
            let start = opt_start[k].min(next_start) - g.opt_state[u] as f64 / g.h2d;
            next_start = start;
            if let Some(j) = (0..=k).rev().find(|&j| opt_start[j] <= start + SLACK) {
                at_opt[j].push(u);
            } else {
                // the latest backward stage (B0 is the last) starting by then, else B(n-1)
                let i = (0..n).find(|&i| bwd_start[i] <= start + SLACK).unwrap_or(n - 1);
                at_bwd[i].push(u);
            }
        }
        // issue order within a stage: the order the optimizer stages need them (last unit first)
        for v in at_bwd.iter_mut().chain(at_opt.iter_mut()) {
            v.sort_unstable_by(|a, b| b.cmp(a));
        }
        s.at_bwd = at_bwd;
        s.at_opt = at_opt;
        s
    }

    /// The units whose parameters are prefetched at the start of forward stage `i`.
    pub fn at_fwd(&self, i: usize) -> &[usize] {
        self.at_fwd.get(i).map_or(&[], |v| v)
    }

    /// The units whose optimizer state is prefetched at the start of backward stage `i`.
    pub fn at_bwd(&self, i: usize) -> &[usize] {
        self.at_bwd.get(i).map_or(&[], |v| v)
    }

    /// The same at the start of optimizer stage `k` (position in `Graph::opt_order`).
    pub fn at_opt(&self, k: usize) -> &[usize] {
        self.at_opt.get(k).map_or(&[], |v| v)
    }

    /// Unit `u`'s parameters are swapped.
    pub fn param(&self, u: usize) -> bool {
        self.params.get(u).copied().unwrap_or(false)
    }

    /// Unit `u`'s optimizer state is swapped.
    pub fn state(&self, u: usize) -> bool {
        self.states.get(u).copied().unwrap_or(false)
    }
}
