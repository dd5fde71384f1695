//! From a profile and a budget to a plan: checks the budget, runs a method, refuses infeasible
//! results with the smallest budget known to work.

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{evaluate_segments, EvalOptions, Scratch};
use crate::peak::{lower_bound, smallest_known_budget};
use crate::plan::Plan;
use crate::profile::Profile;
use crate::pso::{self, PsoSettings, Trace};
use crate::recipes;
use crate::exhaustive;
use serde_json::json;

pub const METHODS: [&str; 7] =
    ["pso", "exhaustive", "retain", "swap-all", "recompute-all", "checkpoint-blocks", "sqrt"];

#[derive(Debug, Clone, Default)]
pub struct PlanSettings {
    pub eval: EvalOptions,
    pub pso: PsoSettings,
}

fn trace_json(t: &Trace) -> serde_json::Value {
    json!({"best": t.best, "mean": t.mean, "worst": t.worst, "feasible": t.feasible,
           "elapsed": t.elapsed, "evaluations": t.evaluations})
}

/// Plan `profile` under `budget` bytes with `method`.
pub fn make_plan(
    profile: &Profile,
    budget: u64,
    method: &str,
    settings: &PlanSettings,
    on_iteration: impl FnMut(usize, &crate::evaluator::Score),
) -> Result<Plan> {
    let g = profile.graph()?;
    let (lb, _) = lower_bound(&g);
    if budget < lb {
        let (smallest, _) = smallest_known_budget(&g, &settings.eval);
        return Err(CoreError::BudgetBelowLowerBound { budget, lower_bound: lb, smallest_known: smallest.max(lb) });
    }
    let eval_json = json!({"prefetch_lookahead": settings.eval.prefetch_lookahead});
    let mut starts = g.block_start.clone();
    let (actions, method_settings, convergence) = match method {
        "pso" => {
            let mut s = settings.pso.clone();
            if s.seed_extremes {
                // Start from per-block checkpoint too, so the search is never worse than it.
                s.seeds.extend(recipes::checkpoint_blocks(profile));
            }
            let r = pso::search(&g, budget, &settings.eval, &s, on_iteration)?;
            let js = json!({"particles": s.particles, "iterations": s.iterations, "seed": s.seed,
                            "threads": s.threads, "seed_extremes": s.seed_extremes,
                            "mutation": s.mutation, "patience": s.patience, "eval": eval_json});
            (r.actions, js, Some(trace_json(&r.trace)))
        }
        "exhaustive" => {
            let (a, _) = exhaustive::search(&g, budget, &settings.eval)?;
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
    let outcome = evaluate_segments(&g, &actions, &starts, budget, &settings.eval, &mut Scratch::new(g.n), true);
    if !outcome.feasible {
        let (smallest, _) = smallest_known_budget(&g, &settings.eval);
        return Err(CoreError::NoFeasiblePlan { budget, smallest_known: smallest.max(lb), lower_bound: lb });
    }
    let mut plan = Plan::new(profile, budget, method, method_settings, actions, &outcome);
    plan.segment_starts = (0..g.n).filter(|&u| starts[u]).collect();
    plan.convergence = convergence;
    Ok(plan)
}
