//! Reserved-memory budgets: plans whose simulated reserved peak (the plan's allocation sequence
//! under PyTorch's CUDA caching allocator with the profile's allocator settings) fits the budget.
//!
//! Searching with the simulator inside every evaluation would multiply the search's cost
//! (docs/benchmarks.md), so the search runs on allocated bytes: the best plan is simulated, and
//! while its reserved peak is over the budget, the allocated budget is tightened by the
//! overshoot and the search runs again, for a few rounds.

use crate::action::Action;
use crate::alloc_sequence::reserved_peak;
use crate::allocator::AllocConf;
use crate::error::{CoreError, Result};
use crate::evaluator::EvalOptions;
use crate::peak::smallest_known_budget;
use crate::plan::{BudgetKind, Plan};
use crate::planner::{make_plan, plan_from_actions, PlanSettings};
use crate::profile::{Graph, Profile};
use serde_json::json;

/// Searches (rounds of tightening) a reserved budget gets by default.
pub const DEFAULT_ROUNDS: usize = 4;

/// The allocator settings to simulate a profile's plans under: `alloc_conf` when given, else
/// the profile's recorded `PYTORCH_(CUDA_)ALLOC_CONF` ([`Profile::alloc_conf`]).
pub fn alloc_conf_for(profile: &Profile, alloc_conf: Option<&str>) -> Result<(String, AllocConf)> {
    let text = alloc_conf.map(str::to_string).unwrap_or_else(|| profile.alloc_conf());
    let conf = AllocConf::from_alloc_conf(&text).map_err(|e| {
        CoreError::InvalidSetting(format!(
            "{e} (the allocator settings {}; pass alloc_conf to simulate under others)",
            if alloc_conf.is_some() { "given" } else { "recorded in the profile's environment" }
        ))
    })?;
    Ok((text, conf))
}

/// The reserved peak (bytes) of `actions` evaluated under the allocated budget `budget`.
pub fn reserved_bytes(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    budget: u64,
    eval: &EvalOptions,
    conf: &AllocConf,
) -> Result<u64> {
    Ok(reserved_peak(g, actions, starts, budget, eval, conf)?.1.max_reserved)
}

/// [`reserved_bytes`] of a plan that also swaps parameters or optimizer state.
pub fn reserved_bytes_with_swaps(
    g: &Graph,
    actions: &[Action],
    starts: &[bool],
    swaps: &crate::evaluator::StateSwaps,
    budget: u64,
    eval: &EvalOptions,
    conf: &AllocConf,
) -> Result<u64> {
    Ok(crate::alloc_sequence::reserved_peak_with_swaps(g, actions, starts, swaps, budget, eval, conf)?.1.max_reserved)
}

/// Plan `profile` so that the plan's simulated reserved peak is at most `budget` bytes, in at most
/// `rounds` searches on allocated budgets. Fails with [`CoreError::NoReservedPlan`], naming the
/// smallest reserved peak of the plans it found, when none fits.
pub fn make_plan_reserved(
    profile: &Profile,
    budget: u64,
    method: &str,
    settings: &PlanSettings,
    rounds: usize,
) -> Result<Plan> {
    if rounds == 0 {
        return Err(CoreError::InvalidSetting("reserved_rounds must be at least 1".into()));
    }
    let (conf_text, conf) = alloc_conf_for(profile, settings.alloc_conf.as_deref())?;
    let settings = PlanSettings { alloc_conf: Some(conf_text.clone()), ..settings.clone() };
    let mut alloc_budget = budget;
    let mut tried: Vec<(u64, u64)> = Vec::new();
    let mut smallest: Option<u64> = None;
    let mut last_actions: Option<Vec<Action>> = None;
    for _ in 0..rounds {
        let plan = match make_plan(profile, alloc_budget, method, &settings, |_, _| {}) {
            Ok(p) => p,
            Err(CoreError::BudgetBelowLowerBound { .. }) | Err(CoreError::NoFeasiblePlan { .. }) => break,
            Err(e) => return Err(e),
        };
        let Some(r) = plan.predicted.reserved_bytes else {
            return Err(CoreError::InvalidSetting(format!(
                "method {method:?} makes plans without a reserved-memory prediction; budget_kind \"reserved\" \
                 works with the methods that plan the profile's own step (pso, exhaustive, the recipes and heuristics)"
            )));
        };
        tried.push((alloc_budget, r));
        if r <= budget {
            return Ok(mark(plan, budget, &conf_text, &tried, false));
        }
        smallest = Some(smallest.map_or(r, |s: u64| s.min(r)));
        if last_actions.as_deref() == Some(&plan.actions[..]) && tried.len() > 1 {
            break; // the method gives the same plan however tight the budget (a fixed recipe)
        }
        last_actions = Some(plan.actions.clone());
        // Tighten by the overshoot, and by at least one byte.
        let next = alloc_budget.saturating_sub((r - budget).max(1));
        if next == 0 {
            break;
        }
        alloc_budget = next;
    }
    // The searching methods fall back on the plan that needs the least allocated memory
    // (all swap or all recompute), if it fits.
    let g = profile.graph()?;
    let (sb, actions) = smallest_known_budget(&g, &settings.eval);
    let r = reserved_bytes(&g, &actions, &g.block_start, sb, &settings.eval, &conf)?;
    if matches!(method, "pso" | "exhaustive") && r <= budget {
        let name = if actions.iter().all(|&a| a == Action::Swap) { "swap-all" } else { "recompute-all" };
        let plan = plan_from_actions(profile, sb, name, json!({"fallback_for": method}), actions, &g.block_start, &settings.eval)?;
        tried.push((sb, r));
        let mut plan = mark(plan, budget, &conf_text, &tried, true);
        plan.predicted.reserved_bytes = Some(r);
        return Ok(plan);
    }
    let smallest_known = smallest.map_or(r, |s| s.min(r));
    Err(CoreError::NoReservedPlan { budget, smallest_known, alloc_conf: conf_text, rounds: tried.len() })
}

fn mark(mut plan: Plan, budget: u64, conf_text: &str, tried: &[(u64, u64)], fallback: bool) -> Plan {
    plan.budget_kind = BudgetKind::Reserved;
    plan.reserved_budget_bytes = Some(budget);
    if !plan.settings.is_object() {
        plan.settings = json!({});
    }
    plan.settings["reserved_search"] = json!({
        "alloc_conf": conf_text,
        "rounds": tried.iter().map(|&(a, r)| json!({"allocated_budget": a, "reserved_bytes": r})).collect::<Vec<_>>(),
        "fallback": fallback,
    });
    plan
}
