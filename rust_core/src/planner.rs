//! From a profile and a budget to a plan: checks the budget, runs a method, refuses infeasible
//! results with the smallest budget known to work.

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{evaluate_with_swaps, EvalOptions, Scratch, StateSwaps};
use crate::peak::{lower_bound, lower_bound_with_state_swaps, smallest_known_budget, smallest_known_budget_with_swaps, unplanned_peak};
use crate::plan::Plan;
use crate::profile::Profile;
use crate::pso::{self, PsoSettings, Trace};
use crate::recipes;
use crate::exhaustive;
use crate::methods::{heuristic_plan, HEURISTICS};
use serde_json::json;

pub const METHODS: [&str; 15] = [
    "pso",
    "exhaustive",
    "exhaustive-segments",
    "retain",
    "swap-all",
    "recompute-all",
    "checkpoint-blocks",
    "sqrt",
    "capuchin",
    "superneurons",
    "vdnn",
    "vdnn-sync",
    "tensile",
    "delta",
    "modnn",
];

#[derive(Debug, Clone, Default)]
pub struct PlanSettings {
    pub eval: EvalOptions,
    pub pso: PsoSettings,
    /// The `PYTORCH_CUDA_ALLOC_CONF` to simulate the plan's reserved memory under (None: the
    /// profile's recorded one).
    pub alloc_conf: Option<String>,
}

fn trace_json(t: &Trace) -> serde_json::Value {
    json!({"best": t.best, "mean": t.mean, "worst": t.worst, "feasible": t.feasible,
           "elapsed": t.elapsed, "evaluations": t.evaluations,
           "stages": t.stages,
           "phases": t.phases.iter().map(|p| json!({"name": p.name, "seconds": p.seconds, "evaluations": p.evaluations,
                                                   "stages": p.stages, "best": p.best})).collect::<Vec<_>>()})
}

/// Methods that make their plan without a search (so a budget they miss says little of what
/// they need): a refusal of one names the smallest budget it meets, by bisection. (Python's
/// `_core.NON_SEARCHING_METHODS`, which python/tensorplace/jobs.py reads.)
pub const NON_SEARCHING: &[&str] =
    &["capuchin", "superneurons", "vdnn", "vdnn-sync", "tensile", "delta", "checkpoint-blocks", "sqrt", "retain",
      "swap-all", "recompute-all"];

/// Plan `profile` under `budget` bytes with `method`.
pub fn make_plan(
    profile: &Profile,
    budget: u64,
    method: &str,
    settings: &PlanSettings,
    on_iteration: impl FnMut(usize, &crate::evaluator::Score),
) -> Result<Plan> {
    match make_plan_at(profile, budget, method, settings, on_iteration) {
        Err(CoreError::NoFeasiblePlan { budget, smallest_known, .. }) if NON_SEARCHING.contains(&method) => {
            // The least budget this method's plan fits, by bisection up to the unplanned peak
            // (assuming more memory never hurts it; the result is checked).
            let fits = |b: u64| make_plan_at(profile, b, method, settings, |_, _| {}).is_ok();
            let hi = unplanned_peak(&profile.graph()?).max(budget + 1);
            let method_smallest = crate::peak::bisect(budget + 1, hi, fits);
            Err(CoreError::MethodNeedsMore { method: method.to_string(), budget, method_smallest, smallest_known })
        }
        r => r,
    }
}

/// [`make_plan`] at one budget, without naming what a non-searching method meets.
fn make_plan_at(
    profile: &Profile,
    budget: u64,
    method: &str,
    settings: &PlanSettings,
    on_iteration: impl FnMut(usize, &crate::evaluator::Score),
) -> Result<Plan> {
    if method == "modnn" {
        // moDNN checks its own lower bound (the least over its sub-batches) and evaluates per sub-batch.
        return crate::methods::modnn::make_plan(profile, budget);
    }
    let g = profile.graph()?;
    // TENSILE may also swap parameters and optimizer state across iterations: its bounds are
    // those of plans that can.
    let swapping = method == "tensile" && crate::methods::tensile::swappable(&g);
    let (lb, _) = if swapping { lower_bound_with_state_swaps(&g) } else { lower_bound(&g) };
    if budget < lb {
        let smallest = if method == "pso" && !settings.pso.swaps {
            smallest_budget_without_swaps(profile, &g, &settings.eval)
        } else {
            smallest_budget(&g, &settings.eval, swapping)
        };
        return Err(CoreError::BudgetBelowLowerBound { budget, lower_bound: lb, smallest_known: smallest.max(lb) });
    }
    if method == "tensile" {
        let (a, swaps) = crate::methods::tensile::plan_with_state_swaps(&g, budget, &settings.eval);
        let js = json!({"eval": {"prefetch_lookahead": settings.eval.prefetch_lookahead, "sync_swap_out": false},
                        "state_swaps": swapping});
        let starts = g.block_start.clone();
        return finish(profile, &g, budget, method, js, a, &swaps, &starts, None, &settings.eval, lb, settings.alloc_conf.as_deref());
    }
    let eval_json = json!({"prefetch_lookahead": settings.eval.prefetch_lookahead});
    let mut starts = g.block_start.clone();
    let (actions, method_settings, convergence) = match method {
        "pso" => {
            let mut s = settings.pso.clone();
            let mut seeded: Vec<&str> = Vec::new();
            if s.seed_heuristics {
                for h in HEURISTICS {
                    if let Some(a) = heuristic_plan(h, profile, &g, budget, &settings.eval) {
                        if !s.seeds.contains(&a) && (s.swaps || !a.contains(&Action::Swap)) {
                            s.seeds.push(a);
                            seeded.push(h);
                        }
                    }
                }
            }
            if s.seed_extremes {
                // Start from per-block checkpoint too, so the search is never worse than it.
                s.seeds.extend(recipes::checkpoint_blocks(profile));
            }
            if s.blocks.is_empty() {
                s.blocks = recipes::repeated_block_classes(profile);
            }
            let r = pso::search(&g, budget, &settings.eval, &s, on_iteration)?;
            let js = json!({"particles": s.particles, "iterations": s.iterations, "seed": s.seed,
                            "threads": s.threads, "seed_extremes": s.seed_extremes,
                            "seed_heuristics": seeded, "polish": s.polish,
                            "restarts": s.restarts, "relinks": s.relinks,
                            "block_wise": s.block_wise, "block_wise_searched": crate::blockwise::block_wise(g.n, &s),
                            "swaps": s.swaps,
                            "mutation": s.mutation, "patience": s.patience, "eval": eval_json});
            (r.actions, js, Some(trace_json(&r.trace)))
        }
        h if HEURISTICS.contains(&h) => {
            let eval = if h == "vdnn-sync" { EvalOptions { sync_swap_out: true, ..settings.eval } } else { settings.eval };
            let a = heuristic_plan(h, profile, &g, budget, &settings.eval).expect("a heuristic");
            let js = json!({"eval": {"prefetch_lookahead": eval.prefetch_lookahead, "sync_swap_out": eval.sync_swap_out}});
            return finish(profile, &g, budget, method, js, a, &StateSwaps::none(), &starts, None, &eval, lb, settings.alloc_conf.as_deref());
        }
        "exhaustive" => {
            let (a, _) = exhaustive::search(&g, budget, &settings.eval)?;
            (a, json!({"eval": eval_json}), None)
        }
        "exhaustive-segments" => {
            let (a, s, _) = exhaustive::search_segments(&g, budget, &settings.eval)?;
            starts = s;
            (a, json!({"eval": eval_json}), None)
        }
        "checkpoint-blocks" => {
            let a = recipes::checkpoint_blocks(profile).ok_or_else(|| {
                CoreError::InvalidSetting(
                    "checkpoint-blocks found no repeated blocks in the unit names (modules of the same \
                     structure, such as layer1.0 and layer1.1); use method \"sqrt\" or \"pso\""
                        .into(),
                )
            })?;
            (a, json!({"eval": eval_json, "blocks": recipes::repeated_blocks(profile)}), None)
        }
        "sqrt" => {
            let (a, s) = recipes::sqrt_segments(g.n);
            starts = s;
            (a, json!({"eval": eval_json}), None)
        }
        "retain" | "swap-all" | "recompute-all" => {
            let a = match method {
                "retain" => Action::Retain,
                "swap-all" => Action::Swap,
                _ => Action::Recompute,
            };
            (vec![a; g.n], json!({"eval": eval_json}), None)
        }
        other => {
            return Err(CoreError::InvalidSetting(format!(
                "unknown method {other:?}; choose one of {}",
                METHODS.join(", ")
            )))
        }
    };
    finish(profile, &g, budget, method, method_settings, actions, &StateSwaps::none(), &starts, convergence, &settings.eval, lb, settings.alloc_conf.as_deref())
}

/// The smallest budget a simple plan is known to meet (with parameters and optimizer state
/// swapped across iterations when `swapping`).
fn smallest_budget(g: &crate::profile::Graph, eval: &EvalOptions, swapping: bool) -> u64 {
    if swapping {
        smallest_known_budget_with_swaps(g, eval).0
    } else {
        smallest_known_budget(g, eval).0
    }
}

/// The smallest budget a plan without swaps is known to meet: the least of the all-retain,
/// all-recompute and per-block checkpoint plans' smallest budgets.
fn smallest_budget_without_swaps(profile: &Profile, g: &crate::profile::Graph, eval: &EvalOptions) -> u64 {
    let mut plans = vec![vec![Action::Recompute; g.n]];
    plans.extend(recipes::checkpoint_blocks(profile));
    plans.iter().filter_map(|p| crate::peak::smallest_budget_of(g, p, eval)).fold(unplanned_peak(g), u64::min)
}

/// The budget check every method starts with: refuse a budget below the lower bound, naming the
/// smallest budget known to work. Returns the lower bound.
pub fn check_budget(profile: &Profile, budget: u64, eval: &EvalOptions) -> Result<u64> {
    let g = profile.graph()?;
    let (lb, _) = lower_bound(&g);
    if budget < lb {
        let (smallest, _) = smallest_known_budget(&g, eval);
        return Err(CoreError::BudgetBelowLowerBound { budget, lower_bound: lb, smallest_known: smallest.max(lb) });
    }
    Ok(lb)
}

/// A plan from actions (and segment starts, one flag per unit) chosen outside the core (the MILP
/// methods in Python): the same budget check, evaluation and refusal of infeasible results as
/// `make_plan`.
pub fn plan_from_actions(
    profile: &Profile,
    budget: u64,
    method: &str,
    method_settings: serde_json::Value,
    actions: Vec<Action>,
    starts: &[bool],
    eval: &EvalOptions,
) -> Result<Plan> {
    plan_from_actions_with_swaps(profile, budget, method, method_settings, actions, starts, &StateSwaps::none(), eval)
}

/// [`plan_from_actions`] with parameters and optimizer state swapped across iterations: the
/// bounds and refusals are then those of plans that can swap them.
#[allow(clippy::too_many_arguments)]
pub fn plan_from_actions_with_swaps(
    profile: &Profile,
    budget: u64,
    method: &str,
    method_settings: serde_json::Value,
    actions: Vec<Action>,
    starts: &[bool],
    swaps: &StateSwaps,
    eval: &EvalOptions,
) -> Result<Plan> {
    let g = profile.graph()?;
    let swapping = swaps.any(&g);
    let (lb, _) = if swapping { lower_bound_with_state_swaps(&g) } else { lower_bound(&g) };
    if budget < lb {
        let smallest = smallest_budget(&g, eval, swapping);
        return Err(CoreError::BudgetBelowLowerBound { budget, lower_bound: lb, smallest_known: smallest.max(lb) });
    }
    if actions.len() != g.n {
        return Err(CoreError::InvalidPlan(format!(
            "{} actions for {} units; give one action per unit",
            actions.len(),
            g.n
        )));
    }
    if starts.len() != g.n {
        return Err(CoreError::InvalidPlan(format!("{} segment flags for {} units; give one per unit", starts.len(), g.n)));
    }
    finish(profile, &g, budget, method, method_settings, actions, swaps, starts, None, eval, lb, None)
}

#[allow(clippy::too_many_arguments)]
fn finish(
    profile: &Profile,
    g: &crate::profile::Graph,
    budget: u64,
    method: &str,
    method_settings: serde_json::Value,
    actions: Vec<Action>,
    swaps: &StateSwaps,
    starts: &[bool],
    convergence: Option<serde_json::Value>,
    eval: &EvalOptions,
    lb: u64,
    alloc_conf: Option<&str>,
) -> Result<Plan> {
    // what the executor runs: a unit it cannot replay retained where the method said recompute
    let actions = g.recomputable_plan(&actions).unwrap_or(actions);
    let outcome = evaluate_with_swaps(g, &actions, starts, swaps, budget, eval, &mut Scratch::new(g.n), true);
    if !outcome.feasible {
        let swapping = swaps.any(g) || (method == "tensile" && crate::methods::tensile::swappable(g));
        let smallest = if method_settings.get("swaps") == Some(&json!(false)) {
            smallest_budget_without_swaps(profile, g, eval)
        } else {
            smallest_budget(g, eval, swapping)
        };
        return Err(CoreError::NoFeasiblePlan { budget, smallest_known: smallest.max(lb), lower_bound: lb });
    }
    let mut plan = Plan::new(profile, budget, method, method_settings, actions, &outcome);
    plan.segment_starts = (0..g.n).filter(|&u| starts[u]).collect();
    plan.set_state_swaps(g, swaps, &outcome);
    plan.convergence = convergence;
    // The reserved peak, where the allocator settings are modelled (a settings error matters only
    // to a reserved budget, which checks them first).
    if let Ok((text, conf)) = crate::reserved::alloc_conf_for(profile, alloc_conf) {
        plan.predicted.reserved_bytes =
            Some(crate::reserved::reserved_bytes_with_swaps(g, &plan.actions, starts, swaps, budget, eval, &conf)?);
        plan.predicted.alloc_conf = Some(text);
    }
    Ok(plan)
}
