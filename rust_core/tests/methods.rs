//! The heuristic methods, PSO's seeds and polish, and vDNN's synchronous offload.

use tensorplace_core::evaluator::{evaluate, EvalOptions, Scratch};
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::pso::{search, PsoSettings};
use tensorplace_core::{Action, CoreError, Profile};

fn bundled(name: &str) -> Profile {
    let path = format!("{}/../python/tensorplace/examples/{name}.json", env!("CARGO_MANIFEST_DIR"));
    Profile::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn budget_at(p: &Profile, frac: f64) -> u64 {
    let g = p.graph().unwrap();
    let (lb, _) = tensorplace_core::peak::lower_bound(&g);
    let up = tensorplace_core::peak::unplanned_peak(&g);
    lb + ((up - lb) as f64 * frac) as u64
}

const HEURISTICS: [&str; 5] = ["capuchin", "superneurons", "vdnn", "vdnn-sync", "tensile"];

#[test]
fn heuristic_plans_fit_or_are_refused() {
    let p = bundled("resnet50");
    let s = PlanSettings::default();
    for h in HEURISTICS {
        for frac in [0.25, 0.5, 0.75] {
            let budget = budget_at(&p, frac);
            match make_plan(&p, budget, h, &s, |_, _| {}) {
                Ok(plan) => {
                    assert!(plan.predicted.feasible && plan.predicted.peak_bytes <= budget, "{h} {frac}");
                    assert!(plan.actions.iter().any(|&a| a != Action::Retain));
                }
                Err(CoreError::NoFeasiblePlan { .. }) => {}
                Err(e) => panic!("{h}: {e}"),
            }
        }
    }
}

#[test]
fn pso_with_heuristic_seeds_is_never_worse_than_the_best_heuristic() {
    let p = bundled("mobilenet_v2");
    let budget = budget_at(&p, 0.5);
    let mut s = PlanSettings::default();
    s.pso.particles = 8;
    s.pso.iterations = 1;
    s.pso.polish = false;
    let pso = make_plan(&p, budget, "pso", &s, |_, _| {}).unwrap();
    for h in HEURISTICS {
        if let Ok(plan) = make_plan(&p, budget, h, &PlanSettings::default(), |_, _| {}) {
            if h != "vdnn-sync" {
                assert!(pso.predicted.step_time <= plan.predicted.step_time, "{h}");
            }
        }
    }
}

#[test]
fn seeds_of_the_wrong_length_are_refused_and_polish_never_hurts() {
    let p = bundled("plain20");
    let g = p.graph().unwrap();
    let budget = budget_at(&p, 0.5);
    let opts = EvalOptions::default();
    let bad = PsoSettings { particles: 4, iterations: 1, seeds: vec![vec![Action::Retain; 3]], ..Default::default() };
    match search(&g, budget, &opts, &bad, |_, _| {}) {
        Err(CoreError::InvalidSetting(m)) => assert!(m.contains("actions but the profile has"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let base = PsoSettings { particles: 6, iterations: 2, polish: false, ..Default::default() };
    let raw = search(&g, budget, &opts, &base, |_, _| {}).unwrap();
    let polished = search(&g, budget, &opts, &PsoSettings { polish: true, ..base.clone() }, |_, _| {}).unwrap();
    assert!(!polished.score.time.is_nan() && polished.score.time <= raw.score.time);
    assert!(polished.trace.evaluations > raw.trace.evaluations);
    // a seed is where the swarm starts: the result is at least as good as the seed
    let seeded = search(&g, budget, &opts, &PsoSettings { seeds: vec![polished.actions.clone()], ..base }, |_, _| {}).unwrap();
    assert!(seeded.score.time <= polished.score.time);
}

#[test]
fn synchronous_offload_only_adds_stalls() {
    let p = bundled("vgg16");
    let g = p.graph().unwrap();
    let actions = vec![Action::Swap; g.n];
    let budget = u64::MAX;
    let asyn = evaluate(&g, &actions, budget, &EvalOptions::default(), &mut Scratch::new(g.n), false);
    let sync = evaluate(&g, &actions, budget, &EvalOptions { sync_swap_out: true, ..Default::default() }, &mut Scratch::new(g.n), false);
    assert!(sync.swap_stall > asyn.swap_stall);
    assert!(sync.step_time > asyn.step_time);
    assert!((sync.step_time - (sync.compute_time + sync.swap_stall + sync.recompute)).abs() < 1e-9);
}
