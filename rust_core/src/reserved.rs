//! Reserved-memory budgets: plans whose simulated reserved peak (the plan's allocation sequence
//! under PyTorch's CUDA caching allocator with the profile's allocator settings) fits the budget.
//!
//! Searching with the simulator inside every evaluation would multiply the search's cost
//! (docs/benchmarks.md), so the search runs on allocated bytes, and the allocated budget is
//! searched for: the plan searched at the reserved budget itself is simulated; while no plan
//! fits, the allocated budget steps down by the reserved overshoot; once a plan fits (or none is
//! found), bisection between that budget and the smallest above it whose plan is over. The
//! fastest plan that fits is kept (the reserved peak is not monotone in the allocated budget, so
//! every plan found counts). The all-swap and all-recompute plans are the fallback when no
//! searched plan fits.

use crate::action::Action;
use crate::alloc_sequence::reserved_peak;
use crate::allocator::AllocConf;
use crate::error::{CoreError, Result};
use crate::evaluator::EvalOptions;
use crate::peak::{lower_bound, smallest_budget_of, unplanned_peak};
use crate::plan::{BudgetKind, Plan};
use crate::planner::{make_plan, plan_from_actions, PlanSettings};
use crate::profile::{Graph, Profile};
use serde_json::json;

/// Searches (on as many allocated budgets) a reserved budget gets at most, by default.
pub const DEFAULT_ROUNDS: usize = 8;

/// The search stops when the allocated budgets whose plans fit and do not fit are this close,
/// relative to the reserved budget (1/256: 0.4%).
const BRACKET_RESOLUTION: u64 = 256;

/// Methods whose plan does not depend on the budget: one search says all.
const FIXED: [&str; 5] = ["retain", "swap-all", "recompute-all", "checkpoint-blocks", "sqrt"];

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

/// One search of the reserved-budget search: the allocated budget, and the plan's reserved
/// peak and step time (None: no plan at that budget).
#[derive(Debug, Clone)]
struct Round {
    allocated_budget: u64,
    plan: Option<(u64, f64)>,
    method: String,
}

/// Plan `profile` so that the plan's simulated reserved peak is at most `budget` bytes: the
/// fastest plan found in at most `rounds` searches on allocated budgets (module docs), or, when
/// none fits, the faster of the all-swap and all-recompute plans that fits (for the searching
/// methods; the plan says so in `settings.reserved_search`). Fails with
/// [`CoreError::NoReservedPlan`], naming the smallest reserved peak of the plans it found (a
/// reserved budget that works), when none fits. Deterministic for the method's seed.
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
    let g = profile.graph()?;
    let lb = lower_bound(&g).0;
    // A plan that fits has an allocated peak at most the reserved budget, so the search at the
    // reserved budget is the fastest that can; above the unplanned peak every plan retains all.
    let top = budget.min(unplanned_peak(&g)).max(lb);
    let rounds = if FIXED.contains(&method) { 1 } else { rounds };
    let mut tried: Vec<Round> = Vec::new();
    let mut found_plans: Vec<Plan> = Vec::new();
    let mut best: Option<usize> = None; // in found_plans
    // Budgets go up from one whose plan fits or where no plan was found (`low`), and down from
    // one whose plan is over the budget (`over`: the budget and that plan's reserved peak).
    let mut low: Option<u64> = None;
    let mut over: Option<(u64, u64)> = None;
    let mut a = top;
    // Below the lower bound no plan fits: no search, only the fallbacks' peaks to name.
    while budget >= lb && tried.len() < rounds {
        let mut s = settings.clone();
        if let Some(b) = best {
            // The fastest plan that fits so far is feasible at every larger budget: the search
            // starts from it, so it returns nothing slower.
            if !s.pso.seeds.contains(&found_plans[b].actions) {
                s.pso.seeds.push(found_plans[b].actions.clone());
            }
        }
        let found = match make_plan(profile, a, method, &s, |_, _| {}) {
            Ok(p) => Some(p),
            Err(CoreError::BudgetBelowLowerBound { .. }) | Err(CoreError::NoFeasiblePlan { .. }) => None,
            Err(e) => return Err(e),
        };
        let reserved = match &found {
            Some(p) => Some(p.predicted.reserved_bytes.ok_or_else(|| {
                CoreError::InvalidSetting(format!(
                    "method {method:?} makes plans without a reserved-memory prediction; budget_kind \"reserved\" \
                     works with the methods that plan the profile's own step (pso, exhaustive, the recipes and heuristics)"
                ))
            })?),
            None => None,
        };
        tried.push(Round {
            allocated_budget: a,
            plan: found.as_ref().zip(reserved).map(|(p, r)| (r, p.predicted.step_time)),
            method: method.to_string(),
        });
        match (found, reserved) {
            (Some(p), Some(r)) if r > budget => {
                over = Some((a, r));
                found_plans.push(p);
            }
            (Some(p), _) => {
                low = Some(a);
                if best.map_or(true, |b| p.predicted.step_time < found_plans[b].predicted.step_time) {
                    best = Some(found_plans.len());
                }
                found_plans.push(p);
            }
            (None, _) => low = Some(a),
        }
        let next = match (low, over) {
            (_, None) => break, // the plan searched at the top fits, or none was found there
            (None, Some((o, r))) => {
                // Nothing fits yet: step down by the reserved overshoot (the allocator's overhead
                // is about the same at a nearby budget), by at least 1/16 of the way to the lower
                // bound.
                if o <= lb {
                    break;
                }
                let step = (r - budget).max((o - lb) / 16).max(1);
                o.saturating_sub(step).max(lb)
            }
            (Some(l), Some((o, _))) => {
                if o <= l || o - l <= (budget / BRACKET_RESOLUTION).max(1) {
                    break;
                }
                l + (o - l) / 2
            }
        };
        if tried.iter().any(|t| t.allocated_budget == next) {
            break;
        }
        a = next;
    }
    if let Some(b) = best {
        let expandable = expandable_note(&g, &conf, &conf_text, budget, &found_plans[b], &found_plans, &settings)?;
        let plan = found_plans.swap_remove(b);
        let chosen = tried.iter().position(|t| t.allocated_budget == plan.budget_bytes);
        return Ok(mark(plan, budget, &conf_text, &tried, chosen, None, expandable));
    }
    // No searched plan fits: the faster of the all-swap and all-recompute plans, each at the
    // smallest allocated budget it meets, if it fits (the searching methods fall back on it; for
    // the others it only names a reserved budget that works).
    let searches = tried.len();
    let mut smallest = tried.iter().filter_map(|t| t.plan.map(|(r, _)| r)).min();
    let mut fallback: Option<Plan> = None;
    for (name, action) in [("swap-all", Action::Swap), ("recompute-all", Action::Recompute)] {
        if action == Action::Swap && !settings.pso.swaps {
            continue;
        }
        let actions = vec![action; g.n];
        let Some(b) = smallest_budget_of(&g, &actions, &settings.eval) else { continue };
        let mut p = plan_from_actions(profile, b, name, json!({"fallback_for": method}), actions, &g.block_start, &settings.eval)?;
        let r = reserved_bytes(&g, &p.actions, &g.block_start, b, &settings.eval, &conf)?;
        tried.push(Round { allocated_budget: b, plan: Some((r, p.predicted.step_time)), method: name.into() });
        smallest = Some(smallest.map_or(r, |s| s.min(r)));
        if r <= budget && fallback.as_ref().map_or(true, |f| p.predicted.step_time < f.predicted.step_time) {
            p.predicted.reserved_bytes = Some(r);
            p.predicted.alloc_conf = Some(conf_text.clone());
            fallback = Some(p);
        }
    }
    if let Some(plan) = fallback.filter(|_| matches!(method, "pso" | "exhaustive" | "exhaustive-segments")) {
        let chosen = tried.iter().rposition(|t| t.method == plan.method);
        let expandable = expandable_note(&g, &conf, &conf_text, budget, &plan, &found_plans, &settings)?;
        let note = format!(
            "no plan searched at {searches} allocated budgets has a reserved peak within the budget: fell back to {}, \
             whose allocated budget is the smallest it meets",
            plan.method
        );
        return Ok(mark(plan, budget, &conf_text, &tried, chosen, Some(note), expandable));
    }
    Err(CoreError::NoReservedPlan { budget, smallest_known: smallest.unwrap_or(u64::MAX), alloc_conf: conf_text, rounds: searches })
}

/// Where the allocator settings do not have expandable segments (which keep reserved memory
/// close to allocated: docs/cost-model.md): the reserved peak of `plan` under them, and the
/// fastest searched plan faster than it whose reserved peak would fit the budget under them.
fn expandable_note(
    g: &Graph,
    conf: &AllocConf,
    conf_text: &str,
    budget: u64,
    plan: &Plan,
    found: &[Plan],
    settings: &PlanSettings,
) -> Result<Option<serde_json::Value>> {
    if conf.expandable_segments {
        return Ok(None);
    }
    let text = if conf_text.trim().is_empty() {
        "expandable_segments:True".to_string()
    } else {
        format!("{conf_text},expandable_segments:True")
    };
    let conf = AllocConf { expandable_segments: true, ..conf.clone() };
    let under = |p: &Plan| -> Result<u64> {
        let starts: Vec<bool> = (0..g.n).map(|u| p.segment_starts.contains(&u)).collect();
        reserved_bytes(g, &p.actions, &starts, p.budget_bytes, &settings.eval, &conf)
    };
    let mut note = json!({"alloc_conf": text, "reserved_bytes": under(plan)?});
    let mut faster: Vec<&Plan> = found.iter().filter(|p| p.predicted.step_time < plan.predicted.step_time).collect();
    faster.sort_by(|a, b| a.predicted.step_time.total_cmp(&b.predicted.step_time));
    for p in faster {
        let r = under(p)?;
        if r <= budget {
            note["faster"] = json!({"allocated_budget": p.budget_bytes, "reserved_bytes": r, "step_time": p.predicted.step_time});
            break;
        }
    }
    Ok(Some(note))
}

fn mark(
    mut plan: Plan,
    budget: u64,
    conf_text: &str,
    tried: &[Round],
    chosen: Option<usize>,
    note: Option<String>,
    expandable: Option<serde_json::Value>,
) -> Plan {
    plan.budget_kind = BudgetKind::Reserved;
    plan.reserved_budget_bytes = Some(budget);
    if !plan.settings.is_object() {
        plan.settings = json!({});
    }
    let rounds: Vec<_> = tried
        .iter()
        .map(|t| {
            let mut r = json!({"allocated_budget": t.allocated_budget, "method": t.method});
            match t.plan {
                Some((reserved, time)) => {
                    r["reserved_bytes"] = json!(reserved);
                    r["step_time"] = json!(time);
                    r["fits"] = json!(reserved <= budget);
                }
                None => {
                    r["reserved_bytes"] = serde_json::Value::Null;
                    r["fits"] = json!(false);
                }
            }
            r
        })
        .collect();
    let mut search = json!({
        "alloc_conf": conf_text,
        "rounds": rounds,
        "chosen": chosen,
        "fallback": note.is_some(),
    });
    if let Some(n) = note {
        search["note"] = json!(n);
    }
    if let Some(e) = expandable {
        search["expandable_segments"] = e;
    }
    plan.settings["reserved_search"] = search;
    plan
}
