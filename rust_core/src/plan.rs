//! The Plan: one action per unit, the prefetch schedule, and the evaluator's predictions
//! (docs/formats.md).

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{Moved, Outcome, StateSwaps};
use crate::profile::Profile;
use crate::versioned::read_versioned;
use serde::{Deserialize, Serialize};

pub const PLAN_FORMAT: &str = "tensorplace.plan";
/// The newest plan version this core reads and writes. `budget_kind`, `reserved_budget_bytes`
/// and `predicted.reserved_bytes` / `predicted.alloc_conf` were added to version 1 without a new
/// version: they are optional, and a reader that does not know them executes the plan the same.
/// Version 2 adds `state_swaps` (parameters and optimizer state kept on the host between
/// steps), which a version-1 reader would silently not execute: only plans that swap them are
/// written as version 2 (others stay version 1, readable by older executors, which refuse
/// version 2).
pub const PLAN_VERSION: u32 = 2;
/// The version of a plan without `state_swaps`.
pub const PLAN_VERSION_WITHOUT_STATE_SWAPS: u32 = 1;

/// What a budget limits: the bytes of live tensors (`allocated`, what the cost model counts), or
/// the memory the caching allocator reserves from the device for them (`reserved`, simulated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetKind {
    #[default]
    Allocated,
    Reserved,
}

impl BudgetKind {
    pub fn from_name(name: &str) -> Result<BudgetKind> {
        match name {
            "allocated" => Ok(BudgetKind::Allocated),
            "reserved" => Ok(BudgetKind::Reserved),
            other => Err(CoreError::InvalidSetting(format!(
                "budget_kind {other:?}: use \"allocated\" (bytes of live tensors, the default) or \"reserved\" \
                 (memory the CUDA caching allocator reserves, simulated)"
            ))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prefetch {
    pub unit: usize,
    pub issue_at_backward_of: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwapDeadline {
    pub unit: usize,
    /// Stage label, "fwd:i" or "bwd:i".
    pub before: String,
}

/// A prefetch of swapped parameters or optimizer state: issued at the start of stage `issue_at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatePrefetch {
    pub unit: usize,
    /// "parameters" or "optimizer_state".
    pub what: String,
    /// Stage label: "fwd:i" (parameters), "bwd:i" or "opt:i" (optimizer state).
    pub issue_at: String,
}

/// A swap-out of parameters or optimizer state that the model lets leave the device before
/// stage `before` ("opt:i"); the executor waits for it there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateDeadline {
    pub unit: usize,
    pub what: String,
    pub before: String,
}

/// Parameters and optimizer state a plan keeps in host memory between optimizer steps
/// (docs/cost-model.md, "Optimizer step"), and the schedule of their copies.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStateSwaps {
    /// Units whose parameters leave after their optimizer stage and come back before their
    /// forward.
    #[serde(default)]
    pub parameters: Vec<usize>,
    /// Units whose optimizer state leaves after their optimizer stage and comes back before the
    /// next one.
    #[serde(default)]
    pub optimizer_state: Vec<usize>,
    #[serde(default)]
    pub prefetch: Vec<StatePrefetch>,
    #[serde(default)]
    pub deadlines: Vec<StateDeadline>,
}

impl PlanStateSwaps {
    pub fn is_empty(&self) -> bool {
        self.parameters.is_empty() && self.optimizer_state.is_empty()
    }

    /// The swaps as the evaluator takes them (refusing units outside the plan).
    pub fn to_swaps(&self, n: usize) -> Result<StateSwaps> {
        for &u in self.parameters.iter().chain(&self.optimizer_state) {
            if u >= n {
                return Err(CoreError::InvalidPlan(format!(
                    "state_swaps names unit {u}; the plan has units 0..{}",
                    n.saturating_sub(1)
                )));
            }
        }
        Ok(StateSwaps::from_units(n, &self.parameters, &self.optimizer_state))
    }

    /// What the evaluation of a plan with `swaps` scheduled.
    pub fn from_outcome(g: &crate::profile::Graph, swaps: &StateSwaps, o: &Outcome) -> PlanStateSwaps {
        let (parameters, optimizer_state) = swaps.units(g);
        PlanStateSwaps {
            parameters,
            optimizer_state,
            prefetch: o
                .state_prefetch
                .iter()
                .map(|&(what, unit, stage)| StatePrefetch { unit, what: what.name().into(), issue_at: stage.label() })
                .collect(),
            deadlines: o
                .state_deadlines
                .iter()
                .map(|&(stage, what, unit)| StateDeadline { unit, what: what.name().into(), before: stage.label() })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    pub step_time: f64,
    pub compute_time: f64,
    pub swap_stall: f64,
    pub recompute: f64,
    /// The executor's host time the step pays (docs/cost-model.md, "Host time"); 0 in plans made
    /// before it was modelled.
    #[serde(default)]
    pub host_time: f64,
    pub copy_time: f64,
    pub overlapped_copy: f64,
    pub peak_bytes: u64,
    pub peak_stage: String,
    pub feasible: bool,
    pub reason: Option<String>,
    /// The largest memory the CUDA caching allocator reserves for the plan's allocation sequence
    /// (simulated under `alloc_conf`, docs/cost-model.md "Reserved memory"). Absent in plans made
    /// before it was added, and where the allocator settings are not modelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    /// The `PYTORCH_CUDA_ALLOC_CONF` the reserved peak was simulated under ("" for the defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alloc_conf: Option<String>,
}

impl Predicted {
    pub fn from_outcome(o: &Outcome) -> Predicted {
        Predicted {
            step_time: o.step_time,
            compute_time: o.compute_time,
            swap_stall: o.swap_stall,
            recompute: o.recompute,
            host_time: o.host_time,
            copy_time: o.copy_time,
            overlapped_copy: o.overlapped_copy,
            peak_bytes: o.peak_bytes,
            peak_stage: o.peak_stage.label(),
            feasible: o.feasible,
            reason: o.reason.clone(),
            reserved_bytes: None,
            alloc_conf: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub format: String,
    pub version: u32,
    pub profile_fingerprint: String,
    /// The allocated-bytes budget the plan was searched and evaluated under (`predicted` holds
    /// under it).
    pub budget_bytes: u64,
    /// What the user's budget limits; with `reserved`, `reserved_budget_bytes` is that budget and
    /// `budget_bytes` the allocated budget the search tightened it to. Absent: allocated.
    #[serde(default)]
    pub budget_kind: BudgetKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_budget_bytes: Option<u64>,
    pub method: String,
    #[serde(default)]
    pub settings: serde_json::Value,
    pub units: Vec<String>,
    pub actions: Vec<Action>,
    #[serde(default)]
    pub prefetch: Vec<Prefetch>,
    #[serde(default)]
    pub swap_deadlines: Vec<SwapDeadline>,
    /// Swapped units whose swap-out the cost model cancels before it starts (their prefetch or
    /// first backward use comes first): the executor keeps them on the device and never starts
    /// the copy. Absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unstarted_swaps: Vec<usize>,
    /// Swapped units whose swap-out the cost model cancels while its copy runs: the executor lets
    /// the copy run and keeps the device bytes for the backward, never copying them back.
    /// Absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_flight_swaps: Vec<usize>,
    /// Units that start a checkpoint segment: a run of recomputed units is split before each
    /// (docs/cost-model.md). Absent in a plan file: none.
    #[serde(default)]
    pub segment_starts: Vec<usize>,
    /// Parameters and optimizer state kept on the host between optimizer steps (version 2).
    /// Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_swaps: Option<PlanStateSwaps>,
    pub predicted: Predicted,
    #[serde(default)]
    pub model_fingerprint: Option<String>,
    #[serde(default)]
    pub convergence: Option<serde_json::Value>,
}

impl Plan {
    pub fn new(
        profile: &Profile,
        budget: u64,
        method: &str,
        settings: serde_json::Value,
        actions: Vec<Action>,
        outcome: &Outcome,
    ) -> Plan {
        Plan {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION_WITHOUT_STATE_SWAPS,
            profile_fingerprint: profile.fingerprint(),
            budget_bytes: budget,
            budget_kind: BudgetKind::Allocated,
            reserved_budget_bytes: None,
            method: method.into(),
            settings,
            units: profile.units.iter().map(|u| u.name.clone()).collect(),
            actions,
            prefetch: outcome
                .prefetch
                .iter()
                .map(|&(unit, at)| Prefetch { unit, issue_at_backward_of: at })
                .collect(),
            swap_deadlines: outcome
                .swap_deadlines
                .iter()
                .map(|&(stage, unit)| SwapDeadline { unit, before: stage.label() })
                .collect(),
            unstarted_swaps: outcome.unstarted_swaps.clone(),
            in_flight_swaps: outcome.in_flight_swaps.clone(),
            segment_starts: Vec::new(),
            state_swaps: None,
            predicted: Predicted::from_outcome(outcome),
            model_fingerprint: None,
            convergence: None,
        }
    }

    /// Record parameters and optimizer state swapped across iterations (nothing if `swaps` moves
    /// nothing in `g`); such a plan is version 2.
    pub fn set_state_swaps(&mut self, g: &crate::profile::Graph, swaps: &StateSwaps, outcome: &Outcome) {
        let s = PlanStateSwaps::from_outcome(g, swaps, outcome);
        if s.is_empty() {
            self.state_swaps = None;
            self.version = PLAN_VERSION_WITHOUT_STATE_SWAPS;
        } else {
            self.state_swaps = Some(s);
            self.version = PLAN_VERSION;
        }
    }

    /// The plan's swaps across iterations as the evaluator takes them (none if absent).
    pub fn swaps(&self) -> Result<StateSwaps> {
        match &self.state_swaps {
            Some(s) => s.to_swaps(self.units.len()),
            None => Ok(StateSwaps::none()),
        }
    }

    pub fn from_json(text: &str) -> Result<Plan> {
        let plan: Plan = read_versioned(text, "plan", PLAN_FORMAT, PLAN_VERSION, "re-plan the model")?;
        if let Some(s) = &plan.state_swaps {
            s.to_swaps(plan.units.len())?;
            for p in &s.prefetch {
                if Moved::from_name(&p.what).is_none() {
                    return Err(CoreError::InvalidPlan(format!(
                        "state_swaps.prefetch has what {:?}; use \"parameters\" or \"optimizer_state\"",
                        p.what
                    )));
                }
            }
            if plan.version < PLAN_VERSION && !s.is_empty() {
                return Err(CoreError::InvalidPlan(format!(
                    "a plan with state_swaps is version {PLAN_VERSION}, this one says version {}; re-plan the model",
                    plan.version
                )));
            }
        }
        if plan.actions.len() != plan.units.len() {
            return Err(CoreError::InvalidPlan(format!(
                "the plan has {} actions for {} units",
                plan.actions.len(),
                plan.units.len()
            )));
        }
        Ok(plan)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plan serialises")
    }

    /// Refuse a plan made for another profile.
    pub fn check_matches(&self, profile: &Profile) -> Result<()> {
        let fp = profile.fingerprint();
        if self.profile_fingerprint != fp {
            return Err(CoreError::InvalidPlan(format!(
                "the plan was made for profile {} but this profile is {}: the model or its input shape changed; re-plan with tensorplace.plan()",
                &self.profile_fingerprint.get(..12).unwrap_or(&self.profile_fingerprint),
                &fp[..12]
            )));
        }
        Ok(())
    }
}
