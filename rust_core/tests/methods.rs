//! The heuristic methods, PSO's seeds and polish, and vDNN's synchronous offload.

mod common;
use common::{budget_at, bundled};
use tensorplace_core::evaluator::{evaluate, EvalOptions, Scratch};
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::pso::{search, PsoSettings};
use tensorplace_core::{Action, CoreError};


const HEURISTICS: [&str; 6] = ["capuchin", "superneurons", "vdnn", "vdnn-sync", "tensile", "delta"];

#[test]
fn heuristic_plans_fit_or_are_refused_naming_a_budget_they_meet() {
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
                // a refusal names the budget this heuristic meets, and it does
                Err(CoreError::MethodNeedsMore { method_smallest: Some(own), .. }) => {
                    assert!(own > budget, "{h} {frac}");
                    let plan = make_plan(&p, own, h, &s, |_, _| {}).expect("the budget the refusal named");
                    assert!(plan.predicted.peak_bytes <= own, "{h} {frac}");
                }
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

#[test]
fn modnn_picks_the_largest_sub_batch_whose_windows_fit_and_its_plan_fits() {
    use tensorplace_core::methods::modnn::{candidates, scale_profile, window_peak};
    let p = bundled("resnet50");
    let batch = p.batch_size.unwrap();
    let g = p.graph().unwrap();
    let (lb, _) = tensorplace_core::peak::lower_bound(&g);
    let up = tensorplace_core::peak::unplanned_peak(&g);
    for budget in [lb / 8, lb / 2, lb, (lb + up) / 2, up] {
        let plan = match make_plan(&p, budget, "modnn", &PlanSettings::default(), |_, _| {}) {
            Ok(plan) => plan,
            Err(CoreError::NoFeasiblePlan { smallest_known, .. }) | Err(CoreError::BudgetBelowLowerBound { smallest_known, .. }) => {
                assert!(smallest_known > budget, "refused {budget} but names {smallest_known}");
                // ... and moDNN does meet the budget it names.
                let plan = make_plan(&p, smallest_known, "modnn", &PlanSettings::default(), |_, _| {}).unwrap();
                assert!(plan.predicted.peak_bytes <= smallest_known);
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        let s = &plan.settings;
        let (b, k) = (s["sub_batch"].as_u64().unwrap(), s["accumulation_steps"].as_u64().unwrap());
        assert_eq!(b * k, batch);
        assert!(plan.predicted.feasible && plan.predicted.peak_bytes <= budget);
        assert!(plan.actions.iter().all(|&a| a != Action::Recompute), "moDNN only offloads");
        // Every larger candidate's windows exceed the budget (so it was not chosen by the rule),
        // and the chosen one's fit unless no candidate's did.
        for c in candidates(batch).into_iter().filter(|&c| c > b) {
            let gc = scale_profile(&p, batch, c, batch / c > 1).graph().unwrap();
            let w = window_peak(&gc).min(tensorplace_core::peak::unplanned_peak(&gc));
            let fits_schedule = s["tried"].as_array().unwrap().iter().any(|t| t["sub_batch"] == c);
            assert!(w > budget || fits_schedule, "sub-batch {c} has windows within the budget");
        }
        // Per full step: the sum of the sub-batches' step times.
        let sub = &s["sub_steps"];
        let sum = sub["first"]["step_time"].as_f64().unwrap() + (k - 1) as f64 * sub["later"]["step_time"].as_f64().unwrap();
        assert!((plan.predicted.step_time - sum).abs() <= 1e-9 * sum);
        if budget >= up {
            assert_eq!(k, 1, "the whole batch fits at its unplanned peak");
        }
    }
}

#[test]
fn modnn_scaling_halves_activations_not_gradients() {
    use tensorplace_core::methods::modnn::scale_profile;
    let p = bundled("plain20");
    let q = scale_profile(&p, 32, 16, true);
    for (a, b) in p.units.iter().zip(&q.units) {
        assert_eq!(b.act_bytes, (a.act_bytes + 1) / 2);
        assert_eq!(b.grad_bytes, 0);
        assert_eq!(b.bwd_transient_bytes, (a.bwd_transient_bytes + 1) / 2 + a.grad_bytes);
        assert!((b.fwd_time - a.fwd_time / 2.0).abs() < 1e-15);
    }
    let grads: i64 = p.units.iter().map(|u| u.grad_bytes).sum();
    assert_eq!(q.memory.parameters, p.memory.parameters);
    assert_eq!(q.memory.workspace, p.memory.workspace + grads as u64);
}

#[test]
fn a_unit_the_executor_cannot_replay_is_never_recomputed() {
    let mut p = bundled("resnet50");
    let fixed = [3usize, 10, 11];
    for &u in &fixed {
        p.units[u].recomputable = Some(false);
    }
    let g = p.graph().unwrap();
    let opts = EvalOptions::default();
    // the cost model retains it where a plan says recompute
    let all = vec![Action::Recompute; g.n];
    let mut runnable = all.clone();
    for &u in &fixed {
        runnable[u] = Action::Retain;
    }
    let budget = budget_at(&p, 0.5);
    let (a, b) = (
        evaluate(&g, &all, budget, &opts, &mut Scratch::new(g.n), false),
        evaluate(&g, &runnable, budget, &opts, &mut Scratch::new(g.n), false),
    );
    assert_eq!((a.step_time, a.peak_bytes, a.feasible), (b.step_time, b.peak_bytes, b.feasible));
    // and no method's plan recomputes it
    let mut s = PlanSettings::default();
    s.pso.particles = 40;
    s.pso.iterations = 10;
    for m in ["pso", "recompute-all", "checkpoint-blocks", "sqrt", "capuchin", "superneurons", "tensile", "delta"] {
        for frac in [0.1, 0.5] {
            match make_plan(&p, budget_at(&p, frac), m, &s, |_, _| {}) {
                Ok(plan) => assert!(fixed.iter().all(|&u| plan.actions[u] != Action::Recompute), "{m} {frac}"),
                Err(CoreError::NoFeasiblePlan { .. }) | Err(CoreError::MethodNeedsMore { .. }) => {}
                Err(e) => panic!("{m}: {e}"),
            }
        }
    }
}
