mod common;
use common::*;
use tensorplace_core::evaluator::{score, EvalOptions, Scratch};
use tensorplace_core::Action;
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::pso::{search, PsoSettings};
use tensorplace_core::{exhaustive, CoreError};

fn settings(particles: usize, iterations: usize, seed: u64, threads: usize) -> PsoSettings {
    PsoSettings { particles, iterations, seed, threads, ..Default::default() }
}

#[test]
fn pso_matches_exhaustive_on_tiny_chains() {
    let f = [1.0, 0.5, 2.0, 0.3, 1.5, 0.8, 1.1, 0.4];
    let a = [40, 10, 35, 25, 5, 30, 20, 15];
    let p = chain(&f, &a, 10, 30.0);
    let g = p.graph().unwrap();
    let opts = EvalOptions::default();
    let unplanned = tensorplace_core::peak::unplanned_peak(&g);
    for budget in [unplanned, unplanned * 3 / 4, unplanned / 2] {
        let (ex, exs) = exhaustive::search(&g, budget, &opts).unwrap();
        let r = search(&g, budget, &opts, &settings(100, 30, 1, 1), |_, _| {}).unwrap();
        assert_eq!(r.score.feasible, exs.feasible);
        assert!((r.score.time - exs.time).abs() < 1e-12, "budget {budget}: pso {:?} vs exhaustive {:?} ({ex:?})", r.score, exs);
    }
}

#[test]
fn same_seed_same_plan_whatever_the_thread_count() {
    let f: Vec<f64> = (0..40).map(|i| 0.1 + (i % 7) as f64 * 0.05).collect();
    let a: Vec<i64> = (0..40).map(|i| 100 + (i * 37 % 11) as i64 * 50).collect();
    let p = chain(&f, &a, 1000, 2000.0);
    let g = p.graph().unwrap();
    let budget = tensorplace_core::peak::unplanned_peak(&g) * 6 / 10;
    let opts = EvalOptions::default();
    let one = search(&g, budget, &opts, &settings(40, 20, 7, 1), |_, _| {}).unwrap();
    let two = search(&g, budget, &opts, &settings(40, 20, 7, 2), |_, _| {}).unwrap();
    assert_eq!(one.actions, two.actions);
    assert_eq!(one.trace.best, two.trace.best);
    assert_eq!(one.trace.evaluations, two.trace.evaluations);
    // The best never gets worse and an infeasible particle never wins over a feasible one.
    let best: Vec<f64> = one.trace.best.iter().flatten().cloned().collect();
    assert!(best.windows(2).all(|w| w[1] <= w[0]));
    assert!(one.score.feasible);
}

#[test]
fn budgets_below_the_lower_bound_name_it() {
    let p = chain(&[1.0, 1.0], &[10, 10], 5, 1.0);
    let g = p.graph().unwrap();
    let (lb, _) = tensorplace_core::peak::lower_bound(&g);
    match make_plan(&p, lb - 1, "pso", &PlanSettings::default(), |_, _| {}) {
        Err(e @ CoreError::BudgetBelowLowerBound { smallest_known, .. }) => {
            assert!(e.to_string().contains(&lb.to_string()));
            assert!(smallest_known >= lb && e.to_string().contains(&smallest_known.to_string()));
        }
        other => panic!("{other:?}"),
    }
    match make_plan(&p, 1, "nope", &PlanSettings::default(), |_, _| {}) {
        Err(e) => assert!(e.to_string().contains("lower bound") || e.to_string().contains("unknown method")),
        Ok(_) => panic!(),
    }
}

#[test]
fn skipping_fixed_points_changes_nothing_but_the_work() {
    let f: Vec<f64> = (0..30).map(|i| 0.1 + (i % 5) as f64 * 0.07).collect();
    let a: Vec<i64> = (0..30).map(|i| 100 + (i * 29 % 13) as i64 * 40).collect();
    // A slow link: no plan hides every copy, so the swarm runs all its iterations.
    let p = chain(&f, &a, 500, 150.0);
    let g = p.graph().unwrap();
    let budget = tensorplace_core::peak::unplanned_peak(&g) * 55 / 100;
    let opts = EvalOptions::default();
    let fast = search(&g, budget, &opts, &settings(30, 60, 3, 2), |_, _| {}).unwrap();
    assert_eq!(fast.trace.best.len(), 60, "the swarm ran every iteration");
    let slow_settings = PsoSettings { skip_fixed_points: false, ..settings(30, 60, 3, 2) };
    let slow = search(&g, budget, &opts, &slow_settings, |_, _| {}).unwrap();
    assert_eq!(fast.actions, slow.actions);
    assert_eq!(fast.trace.best, slow.trace.best);
    assert_eq!(fast.trace.mean, slow.trace.mean);
    assert_eq!(fast.trace.worst, slow.trace.worst);
    assert!(fast.trace.evaluations < slow.trace.evaluations);
}

#[test]
fn the_polish_retains_a_unit_whose_memory_takes_several_recomputations() {
    // An expensive unit (u1) recomputed, cheap ones (u2..u5) retained: retaining u1 needs two of
    // the cheap ones recomputed, which no single or pair change does (one cheap unit frees too
    // little). Swaps are useless (the link is slow). The polish's ejection chains find it.
    let f = [1.0, 10.0, 0.1, 0.1, 0.1, 0.1, 1.0, 1.0];
    let a = [10, 30, 10, 10, 10, 10, 10, 10];
    let p = chain(&f, &a, 0, 1e-3);
    let g = p.graph().unwrap();
    let opts = EvalOptions::default();
    let budget = 80;
    let mut start = vec![Action::Retain; g.n];
    start[1] = Action::Recompute;
    let mut scratch = Scratch::new(g.n);
    let s0 = score(&g, &start, budget, &opts, &mut scratch);
    assert!(s0.feasible);
    // No single or pair change improves the start (the polish before ejection chains stopped here).
    for i in 0..g.n {
        for j in i..g.n {
            for ai in Action::ALL {
                for aj in Action::ALL {
                    let mut plan = start.clone();
                    plan[i] = ai;
                    plan[j] = aj;
                    let s = score(&g, &plan, budget, &opts, &mut scratch);
                    assert!(!s.better_than(&s0), "{plan:?} improves the start: {s:?} vs {s0:?}");
                }
            }
        }
    }
    let (best, best_score) = exhaustive::search(&g, budget, &opts).unwrap();
    assert!(best_score.time < 0.9 * s0.time, "the optimum {best:?} is much faster than the start");
    let settings = PsoSettings {
        particles: 1,
        iterations: 0,
        seed_extremes: false,
        seeds: vec![start.clone()],
        ..Default::default()
    };
    let r = search(&g, budget, &opts, &settings, |_, _| {}).unwrap();
    assert!(r.score.feasible);
    assert!((r.score.time - best_score.time).abs() < 1e-9, "polished {:?} {:?}, optimum {best:?} {best_score:?}", r.actions, r.score);
}

#[test]
fn exhaustive_over_segment_starts_is_never_worse_and_returns_only_splits_of_runs() {
    // A chain whose units save more than their output: a segment split at unit u holds only
    // u's input's output until u's backward, instead of replaying the run in one go (its whole
    // activations at once), so at tight budgets the best starts are not the defaults (none here).
    let f = [1.0, 0.5, 2.0, 0.3, 1.5, 0.8];
    let a = [40, 10, 35, 25, 5, 30];
    let mut p = chain(&f, &a, 10, 0.5);
    for u in p.units.iter_mut() {
        u.output_bytes = u.act_bytes / 4;
        u.replay_transient_bytes = Some(15);
    }
    let g = p.graph().unwrap();
    let opts = EvalOptions::default();
    let unplanned = tensorplace_core::peak::unplanned_peak(&g);
    let (lb, _) = tensorplace_core::peak::lower_bound(&g);
    let mut strictly_better = 0;
    for budget in (0..=10).map(|k| lb + (unplanned - lb) * k / 10) {
        let (plain, plain_score) = exhaustive::search(&g, budget, &opts).unwrap();
        let (best, starts, s) = exhaustive::search_segments(&g, budget, &opts).unwrap();
        assert!(!plain_score.better_than(&s), "budget {budget}: {plain:?} {plain_score:?} beats {best:?} {starts:?} {s:?}");
        for u in 0..g.n {
            if starts[u] {
                assert!(u > 0 && best[u] == Action::Recompute && best[u - 1] == Action::Recompute, "{best:?} {starts:?}");
            }
        }
        let again = tensorplace_core::evaluator::evaluate_segments(&g, &best, &starts, budget, &opts, &mut Scratch::new(g.n), false);
        assert_eq!(again.score(), s);
        strictly_better += s.better_than(&plain_score) as usize;
    }
    assert!(strictly_better > 0, "some budget needs a split the default starts do not have");
    let big = chain(&[1.0; 13], &[1; 13], 1, 1.0).graph().unwrap();
    assert!(matches!(exhaustive::search_segments(&big, 100, &opts), Err(CoreError::InvalidSetting(_))));
}

/// PSO's plan for a builtin profile at `frac` of the way from the lower bound to the unplanned
/// peak (default settings, seed 0, but `restarts`, `relinks` and `threads`).
fn pso_on(name: &str, frac: f64, restarts: usize, relinks: usize, threads: usize) -> tensorplace_core::Plan {
    let p = bundled(name);
    let pso = PsoSettings { restarts, relinks, threads, ..Default::default() };
    make_plan(&p, budget_at(&p, frac), "pso", &PlanSettings { pso, ..Default::default() }, |_, _| {}).unwrap()
}

fn evaluations(plan: &tensorplace_core::Plan) -> u64 {
    plan.convergence.as_ref().unwrap()["evaluations"].as_u64().unwrap()
}

/// Each phase of the search's trace, with its evaluations.
fn phases(plan: &tensorplace_core::Plan) -> Vec<(String, u64)> {
    plan.convergence.as_ref().unwrap()["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ph| (ph["name"].as_str().unwrap().to_string(), ph["evaluations"].as_u64().unwrap()))
        .collect()
}

#[test]
fn restarts_escape_the_local_optimum_of_the_swarm_and_its_polish() {
    // plain20 at 0.25: the swarm's plans polish to local optima of 3.09-3.14 ms (checkpoints of
    // the first blocks retained at other units than in the better optima); the polish of a
    // smaller swarm's best, from random plans, reaches a 3% faster one.
    let old = pso_on("plain20", 0.25, 0, 0, 0).predicted.step_time;
    let new = pso_on("plain20", 0.25, 3, 0, 0).predicted.step_time;
    assert!(new < 0.99 * old, "restarts: {new} s, without: {old} s");
}

#[test]
fn relinking_escapes_the_local_optima_it_starts_between() {
    // mobilenet_v1 at 0.25: plans between two polished plans lead the polish past both (43.09
    // ms against 43.18 ms since a swap-out cancelled before its copy starts gives its copy time
    // back; 43.16 against 43.36 before; 43.15 against 43.68 before a prefetch ahead of its need
    // was retried later where it overflowed a stage, which made the swarm's own plan better).
    let old = pso_on("mobilenet_v1", 0.25, 0, 0, 0).predicted.step_time;
    let new = pso_on("mobilenet_v1", 0.25, 0, 6, 0).predicted.step_time;
    assert!(new < 0.999 * old, "relinking: {new} s, without: {old} s");
}

#[test]
fn restarts_and_relinking_do_not_depend_on_the_thread_count() {
    // (On more than two threads the polish and relinking score more moves at once: the same
    // plans and evaluation counts, phase by phase.)
    let one = pso_on("plain20", 0.25, 3, 6, 1);
    for threads in [3, 4, 8] {
        let more = pso_on("plain20", 0.25, 3, 6, threads);
        assert_eq!(one.actions, more.actions, "{threads} threads");
        assert_eq!(phases(&one), phases(&more), "{threads} threads");
    }
    // The relinking ran (it evaluated plans), and never made the plan worse.
    let restarts_only = pso_on("plain20", 0.25, 3, 0, 1);
    assert!(evaluations(&one) > evaluations(&restarts_only));
    assert!(one.predicted.step_time <= restarts_only.predicted.step_time);
}

#[test]
fn the_memo_of_scores_changes_nothing_but_the_work() {
    // The swarm, polish, restarts and relinking evaluate plans again (crate::memo): answered from
    // the memo, the search makes the same choices (same plans, same evaluation counts, phase by
    // phase) and simulates fewer stages, the swarm too (its particles converge on the same plans;
    // two threads share its memo).
    for (name, frac) in [("plain20", 0.25), ("mobilenet_v1", 0.5)] {
        let p = bundled(name);
        let run = |memo: bool| {
            let pso = PsoSettings { threads: 2, memo, ..Default::default() };
            make_plan(&p, budget_at(&p, frac), "pso", &PlanSettings { pso, ..Default::default() }, |_, _| {}).unwrap()
        };
        let (with, without) = (run(true), run(false));
        assert_eq!(with.actions, without.actions, "{name}");
        assert_eq!(with.predicted.step_time, without.predicted.step_time);
        assert_eq!(phases(&with), phases(&without));
        assert!(phases(&with).iter().any(|(n, _)| n == "relink"), "{name}: relinking ran");
        let stages = |plan: &tensorplace_core::Plan| plan.convergence.as_ref().unwrap()["stages"].as_u64().unwrap();
        assert!(stages(&with) < stages(&without), "{name}: {} stages with the memo, {} without", stages(&with), stages(&without));
        let swarm_stages = |plan: &tensorplace_core::Plan| plan.convergence.as_ref().unwrap()["phases"][0]["stages"].as_u64().unwrap();
        assert!(
            swarm_stages(&with) < swarm_stages(&without),
            "{name}: the swarm simulated {} stages with the memo, {} without",
            swarm_stages(&with),
            swarm_stages(&without)
        );
    }
}

#[test]
fn a_search_without_swaps_never_swaps_and_names_the_smallest_budget_of_such_plans() {
    // resnet50 at 0.3: the default search swaps (its plan is faster with swaps); without swaps
    // neither the swarm, its seeds (the heuristics' plans swap), the polish, restarts nor
    // relinking may, on the full space and block-wise.
    let p = bundled("resnet50");
    let budget = budget_at(&p, 0.3);
    let small = |swaps: bool, block_wise: Option<bool>| PlanSettings {
        pso: PsoSettings { particles: 30, iterations: 10, swaps, block_wise, ..Default::default() },
        ..Default::default()
    };
    let with = make_plan(&p, budget, "pso", &small(true, None), |_, _| {}).unwrap();
    assert!(with.actions.contains(&Action::Swap), "the default search swaps here");
    for block_wise in [Some(false), Some(true)] {
        let without = make_plan(&p, budget, "pso", &small(false, block_wise), |_, _| {}).unwrap();
        assert!(!without.actions.contains(&Action::Swap), "block_wise {block_wise:?}");
        assert!(without.actions.contains(&Action::Recompute));
        assert!(without.predicted.step_time >= with.predicted.step_time * (1.0 - 1e-9));
        assert_eq!(without.settings["swaps"], false);
    }
    // A budget only swaps meet: the error names the smallest budget of a known plan without
    // swaps, which that plan meets, and which is above what swapping needs.
    let (swap_smallest, _) = tensorplace_core::peak::smallest_known_budget(&p.graph().unwrap(), &EvalOptions::default());
    match make_plan(&p, swap_smallest, "pso", &small(false, None), |_, _| {}) {
        Err(CoreError::NoFeasiblePlan { smallest_known, .. }) => {
            assert!(smallest_known > swap_smallest);
            let fits = make_plan(&p, smallest_known, "pso", &small(false, None), |_, _| {}).unwrap();
            assert!(!fits.actions.contains(&Action::Swap) && fits.predicted.peak_bytes <= smallest_known);
        }
        other => panic!("{:?}", other.map(|p| p.actions)),
    }
    // Seeds that swap are refused rather than searched from.
    let g = p.graph().unwrap();
    let seeded = PsoSettings { swaps: false, seeds: vec![vec![Action::Swap; g.n]], ..settings(4, 2, 0, 1) };
    assert!(matches!(search(&g, budget, &EvalOptions::default(), &seeded, |_, _| {}), Err(CoreError::InvalidSetting(_))));
}
