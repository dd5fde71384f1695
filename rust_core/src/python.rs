//! The thin PyO3 layer: JSON text in, JSON text or plain values out. Long searches release the GIL.

use crate::action::Action;
use crate::allocator as alloc;
use crate::error::CoreError;
use crate::evaluator::{evaluate_with_swaps, EvalOptions, Outcome, Scratch, StateSwaps};
use crate::peak;
use crate::plan::{BudgetKind, Plan};
use crate::planner::{check_budget as run_check_budget, make_plan as run_make_plan, plan_from_actions_with_swaps as run_plan_from_actions, PlanSettings};
use crate::profile::{Graph, Profile};
use crate::pso::PsoSettings;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::json;

create_exception!(_core, PlannerError, PyValueError, "A profile, plan or setting the planner refuses.");
create_exception!(_core, BudgetError, PlannerError, "The budget cannot be met; args[1] is the smallest budget (bytes) known to work.");

fn to_py(e: CoreError) -> PyErr {
    match e {
        CoreError::BudgetBelowLowerBound { smallest_known, .. } => BudgetError::new_err((e.to_string(), smallest_known)),
        CoreError::NoFeasiblePlan { smallest_known, .. } => BudgetError::new_err((e.to_string(), smallest_known)),
        CoreError::NoReservedPlan { smallest_known, .. } => BudgetError::new_err((e.to_string(), smallest_known)),
        // the budget this method meets, where known (what a caller retrying the same method needs)
        CoreError::MethodNeedsMore { method_smallest, smallest_known, .. } => {
            BudgetError::new_err((e.to_string(), method_smallest.unwrap_or(smallest_known)))
        }
        other => PlannerError::new_err(other.to_string()),
    }
}

fn parse_profile(text: &str) -> PyResult<Profile> {
    Profile::from_json(text).map_err(to_py)
}

fn parse_actions(actions: Vec<String>, n: usize) -> PyResult<Vec<Action>> {
    if actions.len() != n {
        return Err(PlannerError::new_err(format!(
            "the plan has {} actions but the profile has {n} units; give one action per unit",
            actions.len()
        )));
    }
    actions
        .iter()
        .enumerate()
        .map(|(i, a)| {
            Action::from_name(a).ok_or_else(|| {
                PlannerError::new_err(format!("action {i} is {a:?}; use \"retain\", \"swap\" or \"recompute\""))
            })
        })
        .collect()
}

fn outcome_json(o: &Outcome) -> serde_json::Value {
    let curve: Vec<serde_json::Value> = o
        .curve
        .iter()
        .map(|c| json!({"stage": c.stage.label(), "start_time": c.start_time, "mem_start": c.mem_start, "peak": c.peak}))
        .collect();
    let prefetch: Vec<serde_json::Value> =
        o.prefetch.iter().map(|&(u, s)| json!({"unit": u, "issue_at_backward_of": s})).collect();
    let deadlines: Vec<serde_json::Value> =
        o.swap_deadlines.iter().map(|&(s, u)| json!({"unit": u, "before": s.label()})).collect();
    let copies: Vec<serde_json::Value> = o
        .copies
        .iter()
        .map(|c| {
            json!({"unit": c.unit, "what": c.what.name(), "direction": if c.to_host { "d2h" } else { "h2d" },
                   "queue": c.queue, "start": c.start, "end": c.end, "bytes": c.bytes})
        })
        .collect();
    let state_prefetch: Vec<serde_json::Value> = o
        .state_prefetch
        .iter()
        .map(|&(w, u, s)| json!({"unit": u, "what": w.name(), "issue_at": s.label()}))
        .collect();
    let state_deadlines: Vec<serde_json::Value> = o
        .state_deadlines
        .iter()
        .map(|&(s, w, u)| json!({"unit": u, "what": w.name(), "before": s.label()}))
        .collect();
    let replays: Vec<serde_json::Value> = o
        .replays
        .iter()
        .map(|&(u, i, s, e)| json!({"unit": u, "at_backward_of": i, "start": s, "end": e}))
        .collect();
    json!({
        "step_time": o.step_time, "compute_time": o.compute_time, "swap_stall": o.swap_stall,
        "recompute": o.recompute, "host_time": o.host_time, "copy_time": o.copy_time, "overlapped_copy": o.overlapped_copy,
        "cancelled_swaps": o.cancelled_swaps, "unstarted_swaps": o.unstarted_swaps,
        "in_flight_swaps": o.in_flight_swaps,
        "peak_bytes": o.peak_bytes, "peak_stage": o.peak_stage.label(), "end_bytes": o.end_bytes,
        "feasible": o.feasible,
        "excess": o.excess, "reason": o.reason, "curve": curve, "prefetch": prefetch,
        "swap_deadlines": deadlines, "copies": copies, "replays": replays,
        "state_prefetch": state_prefetch, "state_deadlines": state_deadlines,
    })
}

/// The indexes the evaluator walks (profile::Graph), as JSON text, for models of the evaluator
/// written outside the core (the MILP): unit indexes as in the profile; `first_need` and
/// `last_use` are the units whose backward first and last reads a unit's activations (null when
/// none); `needs[i]` the units whose activations unit i's backward reads, largest first;
/// `held_from` and `saved_from` as (producer, bytes) pairs, derived when the profile has none;
/// `block_start` the default segment starts; `linger_until` >= n: never let go in the forward.
/// `bwd_transient` includes the loss's backward where that needs more (`loss_transient` less the
/// stage's gradients): a model that charges the stage's transient once bounds both.
#[pyfunction]
fn profile_graph(profile_json: &str) -> PyResult<String> {
    let g = parse_profile(profile_json)?.graph().map_err(to_py)?;
    let mut graph = json!({
        "n": g.n, "constant": g.constant, "d2h": g.d2h, "h2d": g.h2d, "copy_engines": g.copy_engines,
        "fwd_time": g.fwd_time, "bwd_time": g.bwd_time, "act": g.act, "out": g.out, "out_saved": g.out_saved,
        "held": g.held, "random": g.random, "rng_state": g.rng_state, "held_from": g.held_from, "saved_from": g.saved_from, "block_start": g.block_start,
        "fwd_transient": g.fwd_transient,
        "bwd_transient": (0..g.n).map(|i| g.bwd_transient[i].max(g.loss_transient[i].saturating_sub(g.grad[i]))).collect::<Vec<_>>(),
        "grad": g.grad,
        "inputs": g.inputs, "replay_inputs": g.replay_inputs, "replay_extra": g.replay_extra,
        "linger": g.linger, "linger_until": g.linger_until, "last_fwd": g.last_fwd, "busy_until": g.busy_until,
        "first_need": g.first_need, "last_use": g.last_use, "needs": g.needs,
        "packs": g.packs, "act_storages": g.act_storages, "glue_ops": g.glue_ops,
        "swap_host": (0..g.n).map(|u| g.costs.swap_host(g.act[u] as f64, g.act_storages[u], g.d2h, g.h2d)).collect::<Vec<_>>(),
        "glue_scope": g.glue_scope.iter().map(|s| s.map(|(f, l)| if f == usize::MAX { (-1i64, -1i64) } else { (f as i64, l as i64) })).collect::<Vec<_>>(),
    });
    // (keys of their own: more in the literal exceed the json! macro's recursion limit)
    graph["costs"] = json!({"segment": g.costs.segment, "drop": g.costs.drop, "swap": g.costs.swap,
                            "swap_async": g.costs.swap_async.unwrap_or(g.costs.swap), "inline_bytes": g.costs.inline_bytes,
                            "tracked_op": g.costs.tracked_op, "stage": g.costs.stage, "step": g.costs.step});
    graph["no_recompute"] = json!(g.no_recompute);
    Ok(graph.to_string())
}

/// Validate a profile; raises PlannerError with what is wrong.
#[pyfunction]
fn validate_profile(profile_json: &str) -> PyResult<()> {
    parse_profile(profile_json).map(|_| ())
}

/// SHA-256 of the profile's structure.
#[pyfunction]
fn profile_fingerprint(profile_json: &str) -> PyResult<String> {
    Ok(parse_profile(profile_json)?.fingerprint())
}

/// The profile, its graph, one action per unit, the segment flags and the swaps across
/// iterations of an evaluation call.
fn parse_plan_inputs(
    profile_json: &str,
    actions: Vec<String>,
    segment_starts: Option<Vec<usize>>,
    swap_parameters: Option<Vec<usize>>,
    swap_optimizer_state: Option<Vec<usize>>,
) -> PyResult<(Profile, Graph, Vec<Action>, Vec<bool>, StateSwaps)> {
    let p = parse_profile(profile_json)?;
    let g = p.graph().map_err(to_py)?;
    let a = parse_actions(actions, g.n)?;
    let starts = parse_starts(&g, segment_starts)?;
    let swaps = parse_swaps(&g, swap_parameters, swap_optimizer_state)?;
    Ok((p, g, a, starts, swaps))
}

/// Units whose parameters / optimizer state are kept on the host between steps: refused where
/// the profile has no optimizer step, or the unit has no such bytes.
fn parse_swaps(g: &Graph, params: Option<Vec<usize>>, states: Option<Vec<usize>>) -> PyResult<StateSwaps> {
    let (params, states) = (params.unwrap_or_default(), states.unwrap_or_default());
    if params.is_empty() && states.is_empty() {
        return Ok(StateSwaps::none());
    }
    if !g.has_optimizer {
        return Err(PlannerError::new_err(
            "this profile has no optimizer step, so no parameters or optimizer state can be swapped across \
             iterations; profile with optimizer= (tensorplace.plan(..., optimizer=opt))",
        ));
    }
    for (what, list, bytes) in [("parameters", &params, &g.param), ("optimizer state", &states, &g.opt_state)] {
        for &u in list {
            if u >= g.n || bytes[u] == 0 {
                return Err(PlannerError::new_err(format!(
                    "unit {u} has no {what} to swap; the units with some are {:?}",
                    (0..g.n).filter(|&v| bytes[v] > 0).collect::<Vec<_>>()
                )));
            }
        }
    }
    Ok(StateSwaps::from_units(g.n, &params, &states))
}

fn parse_starts(g: &Graph, segment_starts: Option<Vec<usize>>) -> PyResult<Vec<bool>> {
    match segment_starts {
        None => Ok(g.block_start.clone()),
        Some(list) => {
            let mut starts = vec![false; g.n];
            for u in list {
                if u >= g.n {
                    return Err(PlannerError::new_err(format!(
                        "segment start {u} is not a unit; the profile has units 0..{}",
                        g.n - 1
                    )));
                }
                starts[u] = true;
            }
            Ok(starts)
        }
    }
}

/// Evaluate a plan: returns the outcome as JSON text. With `reserved`, also the plan's reserved
/// peak (`reserved_bytes`) and the allocator simulation (`allocator`) under `alloc_conf` (None:
/// the profile's recorded settings); with `memory_curve` too, `memory_curve`: time, allocated
/// and reserved bytes after every allocation event (crate::memory_curve).
#[pyfunction]
#[pyo3(signature = (profile_json, actions, budget, prefetch_lookahead=2, segment_starts=None, reserved=false, alloc_conf=None,
                    memory_curve=false, swap_parameters=None, swap_optimizer_state=None))]
#[allow(clippy::too_many_arguments)]
fn evaluate(
    py: Python<'_>,
    profile_json: &str,
    actions: Vec<String>,
    budget: u64,
    prefetch_lookahead: usize,
    segment_starts: Option<Vec<usize>>,
    reserved: bool,
    alloc_conf: Option<String>,
    memory_curve: bool,
    swap_parameters: Option<Vec<usize>>,
    swap_optimizer_state: Option<Vec<usize>>,
) -> PyResult<String> {
    if memory_curve && !reserved {
        return Err(to_py(CoreError::InvalidSetting(
            "memory_curve needs reserved=True (the curve is the allocator simulation's)".into(),
        )));
    }
    let (p, g, a, starts, swaps) = parse_plan_inputs(profile_json, actions, segment_starts, swap_parameters, swap_optimizer_state)?;
    let eval = EvalOptions { prefetch_lookahead, ..Default::default() };
    let mut js = if reserved {
        let (text, conf) = crate::reserved::alloc_conf_for(&p, alloc_conf.as_deref()).map_err(to_py)?;
        let (seq, (stats, curve)) = py
            .allow_threads(|| -> crate::error::Result<_> {
                let seq = crate::alloc_sequence::allocation_sequence_with_swaps(&g, &a, &starts, &swaps, budget, &eval)?;
                // the per-event timeline is recorded only for the curve
                let simulated = if memory_curve {
                    crate::memory_curve::memory_curve(&seq, &conf)?
                } else {
                    (seq.simulate(&conf)?, Vec::new())
                };
                Ok((seq, simulated))
            })
            .map_err(to_py)?;
        let mut js = outcome_json(&seq.outcome);
        js["reserved_bytes"] = json!(stats.max_reserved);
        js["alloc_conf"] = json!(text);
        js["allocator"] = serde_json::to_value(&stats).expect("stats serialise");
        if memory_curve {
            js["memory_curve"] = json!(curve);
        }
        js
    } else {
        outcome_json(&evaluate_with_swaps(&g, &a, &starts, &swaps, budget, &eval, &mut Scratch::new(g.n), true))
    };
    js["segment_starts"] = json!((0..g.n).filter(|&u| starts[u]).collect::<Vec<_>>());
    let (sp, ss) = swaps.units(&g);
    js["swap_parameters"] = json!(sp);
    js["swap_optimizer_state"] = json!(ss);
    Ok(js.to_string())
}

/// The allocation sequence of a plan (docs/cost-model.md, "Reserved memory"): JSON text with
/// `constant_bytes` (the simulator's initial live bytes), `events` (allocator events as
/// `allocator_simulate` reads them), `what` (per event, the block: "act:3", "bwd_work:5", ...),
/// `times` (per event, seconds from the step's start) and the evaluation's `peak_bytes`.
#[pyfunction]
#[pyo3(signature = (profile_json, actions, budget, prefetch_lookahead=2, segment_starts=None, swap_parameters=None,
                    swap_optimizer_state=None))]
fn allocation_sequence(
    profile_json: &str,
    actions: Vec<String>,
    budget: u64,
    prefetch_lookahead: usize,
    segment_starts: Option<Vec<usize>>,
    swap_parameters: Option<Vec<usize>>,
    swap_optimizer_state: Option<Vec<usize>>,
) -> PyResult<String> {
    let (_, g, a, starts, swaps) = parse_plan_inputs(profile_json, actions, segment_starts, swap_parameters, swap_optimizer_state)?;
    let eval = EvalOptions { prefetch_lookahead, ..Default::default() };
    let seq =
        crate::alloc_sequence::allocation_sequence_with_swaps(&g, &a, &starts, &swaps, budget, &eval).map_err(to_py)?;
    Ok(json!({
        "constant_bytes": seq.constant,
        "peak_bytes": seq.outcome.peak_bytes,
        "end_bytes": seq.outcome.end_bytes,
        "events": seq.events,
        "what": seq.what.iter().map(|w| w.label()).collect::<Vec<_>>(),
        "times": seq.times,
    })
    .to_string())
}

/// (lower bound in bytes, stage label); with `state_swaps`, of plans that may also keep
/// parameters and optimizer state on the host between steps.
#[pyfunction]
#[pyo3(signature = (profile_json, state_swaps=false))]
fn lower_bound(profile_json: &str, state_swaps: bool) -> PyResult<(u64, String)> {
    let g = parse_profile(profile_json)?.graph().map_err(to_py)?;
    let (b, s) = if state_swaps { peak::lower_bound_with_state_swaps(&g) } else { peak::lower_bound(&g) };
    Ok((b, s.label()))
}

/// The predicted peak of the all-retain plan.
#[pyfunction]
fn unplanned_peak(profile_json: &str) -> PyResult<u64> {
    let g = parse_profile(profile_json)?.graph().map_err(to_py)?;
    Ok(peak::unplanned_peak(&g))
}

/// The smallest budget all-swap or all-recompute meets, and that plan's actions; with
/// `state_swaps`, those plans may also keep every parameter and optimizer state on the host
/// between steps.
#[pyfunction]
#[pyo3(signature = (profile_json, prefetch_lookahead=2, state_swaps=false))]
fn smallest_known_budget(profile_json: &str, prefetch_lookahead: usize, state_swaps: bool) -> PyResult<(u64, Vec<String>)> {
    let g = parse_profile(profile_json)?.graph().map_err(to_py)?;
    let eval = EvalOptions { prefetch_lookahead, ..Default::default() };
    let (b, a) = if state_swaps {
        let (b, a, _) = peak::smallest_known_budget_with_swaps(&g, &eval);
        (b, a)
    } else {
        peak::smallest_known_budget(&g, &eval)
    };
    Ok((b, a.iter().map(|x| x.name().to_string()).collect()))
}

/// Search a plan; returns the plan as JSON text. Releases the GIL while searching.
#[pyfunction]
#[pyo3(signature = (profile_json, budget, method="pso", particles=500, iterations=500, seed=0, threads=0,
                    seed_extremes=true, mutation=0.0, patience=None, prefetch_lookahead=2, seed_heuristics=true,
                    seed_plans=None, budget_kind="allocated", alloc_conf=None, reserved_rounds=crate::reserved::DEFAULT_ROUNDS,
                    restarts=3, relinks=6, block_wise=None, swaps=true))]
#[allow(clippy::too_many_arguments)]
fn make_plan(
    py: Python<'_>,
    profile_json: &str,
    budget: u64,
    method: &str,
    particles: usize,
    iterations: usize,
    seed: u64,
    threads: usize,
    seed_extremes: bool,
    mutation: f64,
    patience: Option<usize>,
    prefetch_lookahead: usize,
    seed_heuristics: bool,
    seed_plans: Option<Vec<Vec<String>>>,
    budget_kind: &str,
    alloc_conf: Option<String>,
    reserved_rounds: usize,
    restarts: usize,
    relinks: usize,
    block_wise: Option<bool>,
    swaps: bool,
) -> PyResult<String> {
    let kind = BudgetKind::from_name(budget_kind).map_err(to_py)?;
    let p = parse_profile(profile_json)?;
    let seeds = seed_plans
        .unwrap_or_default()
        .into_iter()
        .map(|a| parse_actions(a, p.units.len()))
        .collect::<PyResult<Vec<_>>>()?;
    let settings = PlanSettings {
        eval: EvalOptions { prefetch_lookahead, ..Default::default() },
        pso: PsoSettings {
            particles,
            iterations,
            seed,
            threads,
            seed_extremes,
            mutation,
            patience,
            skip_fixed_points: true,
            seeds,
            seed_heuristics,
            restarts,
            relinks,
            block_wise,
            swaps,
            ..PsoSettings::default()
        },
        alloc_conf,
    };
    let method = method.to_string();
    let plan = py.allow_threads(move || match kind {
        BudgetKind::Allocated => run_make_plan(&p, budget, &method, &settings, |_, _| {}),
        BudgetKind::Reserved => crate::reserved::make_plan_reserved(&p, budget, &method, &settings, reserved_rounds),
    });
    Ok(plan.map_err(to_py)?.to_json())
}

/// Validate a plan (and, given a profile, that it was made for it); returns it normalised.
#[pyfunction]
#[pyo3(signature = (plan_json, profile_json=None))]
fn validate_plan(plan_json: &str, profile_json: Option<&str>) -> PyResult<String> {
    let plan = Plan::from_json(plan_json).map_err(to_py)?;
    if let Some(pj) = profile_json {
        plan.check_matches(&parse_profile(pj)?).map_err(to_py)?;
    }
    Ok(plan.to_json())
}

/// Refuse a budget below the lower bound of any plan (BudgetError naming the smallest budget known
/// to work); returns the lower bound. What every method checks before it searches.
#[pyfunction]
#[pyo3(signature = (profile_json, budget, prefetch_lookahead=2))]
fn check_budget(profile_json: &str, budget: u64, prefetch_lookahead: usize) -> PyResult<u64> {
    let p = parse_profile(profile_json)?;
    run_check_budget(&p, budget, &EvalOptions { prefetch_lookahead, ..Default::default() }).map_err(to_py)
}

/// A plan from actions chosen outside the core (the MILP methods): evaluated and refused like a
/// searched plan (BudgetError if it does not fit). `settings_json` is stored in the plan.
#[pyfunction]
#[pyo3(signature = (profile_json, budget, actions, method, settings_json="{}", prefetch_lookahead=2, segment_starts=None,
                    swap_parameters=None, swap_optimizer_state=None))]
#[allow(clippy::too_many_arguments)]
fn plan_from_actions(
    profile_json: &str,
    budget: u64,
    actions: Vec<String>,
    method: &str,
    settings_json: &str,
    prefetch_lookahead: usize,
    segment_starts: Option<Vec<usize>>,
    swap_parameters: Option<Vec<usize>>,
    swap_optimizer_state: Option<Vec<usize>>,
) -> PyResult<String> {
    let (p, _, a, starts, swaps) =
        parse_plan_inputs(profile_json, actions, segment_starts, swap_parameters, swap_optimizer_state)?;
    let settings: serde_json::Value = serde_json::from_str(settings_json)
        .map_err(|e| PlannerError::new_err(format!("settings_json is not JSON: {e}")))?;
    let eval = EvalOptions { prefetch_lookahead, ..Default::default() };
    let plan = run_plan_from_actions(&p, budget, method, settings, a, &starts, &swaps, &eval).map_err(to_py)?;
    Ok(plan.to_json())
}

/// Replay a `cuda-caching-allocator-trace` (JSON text); `options_json`: allocator Options
/// (rust_core/src/allocator/mod.rs). Returns the replay as JSON text. Releases the GIL.
#[pyfunction]
#[pyo3(signature = (trace_json, options_json="{}"))]
fn allocator_replay(py: Python<'_>, trace_json: String, options_json: &str) -> PyResult<String> {
    let options = alloc::Options::from_json(options_json).map_err(to_py)?;
    let run = move || -> crate::error::Result<String> {
        let trace = alloc::trace::Trace::from_json(&trace_json)?;
        let base = if options.trace_layout.unwrap_or(true) { trace.conf()? } else { trace.plain_conf()? };
        let conf = options.conf(Some(base))?;
        let r = alloc::trace::replay_with(&trace, conf)?;
        Ok(serde_json::to_string(&r).expect("replay serialises"))
    };
    py.allow_threads(run).map_err(to_py)
}

/// Simulate allocator events (JSON list of {"op": "alloc", "id", "size", "stream"} /
/// {"op": "free", "id"}) under Options; returns the stats as JSON text. Releases the GIL.
#[pyfunction]
#[pyo3(signature = (events_json, options_json="{}"))]
fn allocator_simulate(py: Python<'_>, events_json: String, options_json: &str) -> PyResult<String> {
    let options = alloc::Options::from_json(options_json).map_err(to_py)?;
    let run = move || -> crate::error::Result<String> {
        let events: Vec<alloc::AllocEvent> = serde_json::from_str(&events_json)
            .map_err(|e| CoreError::InvalidTrace(format!("allocator events: {e}")))?;
        let stats = alloc::simulate(&events, &options.conf(None)?)?;
        Ok(serde_json::to_string(&stats).expect("stats serialise"))
    };
    py.allow_threads(run).map_err(to_py)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PlannerError", m.py().get_type::<PlannerError>())?;
    m.add("BudgetError", m.py().get_type::<BudgetError>())?;
    m.add("PROFILE_VERSION", crate::profile::PROFILE_VERSION)?;
    m.add("PLAN_VERSION", crate::plan::PLAN_VERSION)?;
    m.add("NON_SEARCHING_METHODS", crate::planner::NON_SEARCHING.to_vec())?;
    m.add_function(wrap_pyfunction!(validate_profile, m)?)?;
    m.add_function(wrap_pyfunction!(profile_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(profile_graph, m)?)?;
    m.add_function(wrap_pyfunction!(evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(allocation_sequence, m)?)?;
    m.add_function(wrap_pyfunction!(lower_bound, m)?)?;
    m.add_function(wrap_pyfunction!(unplanned_peak, m)?)?;
    m.add_function(wrap_pyfunction!(smallest_known_budget, m)?)?;
    m.add_function(wrap_pyfunction!(make_plan, m)?)?;
    m.add_function(wrap_pyfunction!(validate_plan, m)?)?;
    m.add_function(wrap_pyfunction!(check_budget, m)?)?;
    m.add_function(wrap_pyfunction!(plan_from_actions, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_replay, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_simulate, m)?)?;
    Ok(())
}
