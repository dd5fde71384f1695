//! Parameters and optimizer state swapped across iterations (docs/cost-model.md, "Optimizer
//! step"): the evaluator's optimizer stages, the swaps' memory and time, the bounds, TENSILE.
mod common;
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tensorplace_core::evaluator::{evaluate, evaluate_with_swaps, EvalOptions, Moved, Scratch, Stage, StateSwaps};
use tensorplace_core::peak::{lower_bound, lower_bound_with_state_swaps, smallest_known_budget_with_swaps};
use tensorplace_core::plan::Plan;
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::profile::{OptimizerStep, Profile};
use tensorplace_core::{Action, CoreError};

/// `p` with an optimizer step: unit i owns parameters `params[i]`, optimizer state twice that
/// (Adam), an optimizer part of `opt_time` seconds and `opt_transient` bytes.
fn with_optimizer(mut p: Profile, params: &[i64], opt_time: f64, opt_transient: i64) -> Profile {
    let total: i64 = params.iter().sum();
    p.memory.parameters += total as u64;
    p.memory.optimizer_state += 2 * total as u64;
    for (u, &b) in p.units.iter_mut().zip(params) {
        u.param_bytes = Some(b);
        u.optimizer_state_bytes = Some(2 * b);
        u.optimizer_time = Some(opt_time);
        u.optimizer_transient_bytes = Some(opt_transient);
    }
    // the whole step in one call: every part's time, and the largest part's transient
    let step_time = opt_time * params.len() as f64;
    p.optimizer = Some(OptimizerStep {
        name: "Adam".into(),
        other_time: 0.0,
        other_transient_bytes: 0,
        step_time,
        transient_bytes: opt_transient,
    });
    p
}

fn run(p: &Profile, a: &[Action], swaps: &StateSwaps, budget: u64) -> tensorplace_core::Outcome {
    let g = p.graph().unwrap();
    evaluate_with_swaps(&g, a, &g.block_start, swaps, budget, &EvalOptions::default(), &mut Scratch::new(g.n), true)
}

fn point(o: &tensorplace_core::Outcome, stage: Stage) -> tensorplace_core::evaluator::CurvePoint {
    *o.curve.iter().find(|c| c.stage == stage).unwrap()
}

#[test]
fn a_profile_without_an_optimizer_step_evaluates_as_before() {
    let p = chain(&[1.0, 2.0, 3.0], &[10, 20, 30], 100, 1.0);
    let g = p.graph().unwrap();
    assert!(!g.has_optimizer && g.opt_order.is_empty());
    // nothing of the new fields is written into an old profile
    let text = p.to_json();
    for key in ["\"optimizer\"", "param_bytes", "optimizer_state_bytes", "optimizer_time"] {
        assert!(!text.contains(key), "{key} written into an old profile");
    }
    assert_eq!(Profile::from_json(&text).unwrap().fingerprint(), p.fingerprint());
    let plain = evaluate(&g, &[Action::Swap, Action::Retain, Action::Recompute], 150, &EvalOptions::default(), &mut Scratch::new(3), true);
    // swaps listed for a profile without an optimizer step move nothing
    let swaps = StateSwaps { params: vec![true; 3], states: vec![true; 3] };
    let with = run(&p, &[Action::Swap, Action::Retain, Action::Recompute], &swaps, 150);
    assert_eq!(plain, with);
    assert_eq!(plain.curve.len(), 6);
    assert_eq!(lower_bound(&g), lower_bound_with_state_swaps(&g));
}

#[test]
fn the_optimizer_step_follows_the_backward_with_its_time_and_transient() {
    let mut p = with_optimizer(chain(&[1.0, 2.0], &[10, 20], 5, 1.0), &[3, 4], 0.5, 7);
    p.optimizer.as_mut().unwrap().step_time = 0.8;
    p.optimizer.as_mut().unwrap().transient_bytes = 9;
    let g = p.graph().unwrap();
    assert_eq!(g.opt_order, vec![1, 0, 2]);
    // nothing swapped: the whole step in one call (stage "opt")
    let o = run(&p, &[Action::Retain; 2], &StateSwaps::none(), u64::MAX);
    let constant = 5 + 7 + 14; // constant 5 + params 7 + state 14; grads 0
    assert!((o.step_time - (3.0 + 6.0 + 0.8)).abs() < 1e-12);
    assert!((o.compute_time - o.step_time).abs() < 1e-12);
    assert_eq!(o.curve.len(), 4 + 1);
    assert_eq!(point(&o, Stage::OptStep).peak, constant + 9);
    assert_eq!(Stage::OptStep.label(), "opt");
    assert_eq!(o.end_bytes, constant);
    // something swapped: one stage per unit, the last unit first, then the parameters of no unit
    let sw = StateSwaps { params: vec![false, true], states: vec![false; 2] };
    let o = run(&p, &[Action::Retain; 2], &sw, u64::MAX);
    let stages: Vec<Stage> = o.curve.iter().skip(4).map(|c| c.stage).collect();
    assert_eq!(stages, vec![Stage::Opt(1), Stage::Opt(0), Stage::Opt(2)]);
    assert!((o.compute_time - (3.0 + 6.0 + 1.0)).abs() < 1e-12);
    assert_eq!(point(&o, Stage::Opt(1)).peak, constant + 7);
    assert_eq!(g.stage_index(Stage::Opt(0)), 5);
}

#[test]
fn swapped_state_is_off_the_device_between_its_uses() {
    // Two units; infinitely fast copies: the memory of each stage is exact.
    let p = with_optimizer(chain(&[1.0, 1.0], &[10, 10], 0, 1e18), &[100, 1000], 0.5, 0);
    let a = [Action::Retain; 2];
    let none = run(&p, &a, &StateSwaps::none(), u64::MAX);
    let all = StateSwaps { params: vec![true; 2], states: vec![true; 2] };
    let o = run(&p, &a, &all, u64::MAX);
    let constant = 1100 + 2200;
    assert_eq!(none.peak_bytes, constant + 20);
    // F0: unit 0's parameters only; F1: both; backward: parameters; opt:1 adds unit 1's state
    assert_eq!(point(&o, Stage::Fwd(0)).peak, 100 + 10);
    assert_eq!(point(&o, Stage::Fwd(1)).peak, 1100 + 20);
    assert_eq!(point(&o, Stage::Bwd(1)).peak, 1100 + 20);
    assert_eq!(point(&o, Stage::Opt(1)).peak, 1100 + 2000);
    // unit 1's parameters and state leave when their copies complete, an instant after opt:0
    // starts: opt:0 still counts them, plus unit 0's state
    assert_eq!(point(&o, Stage::Opt(0)).peak, 1100 + 2000 + 200);
    assert_eq!(o.end_bytes, 0);
    assert_eq!(o.peak_bytes, 1100 + 2000 + 200);
    assert!(o.swap_stall < 1e-9);
    // the schedule: parameters before their forward, state before its optimizer stage
    let kinds: Vec<(Moved, usize)> = o.state_prefetch.iter().map(|&(w, u, _)| (w, u)).collect();
    assert!(kinds.contains(&(Moved::Parameters, 0)) && kinds.contains(&(Moved::OptimizerState, 1)));
    for &(w, u, s) in &o.state_prefetch {
        match w {
            Moved::Parameters => assert!(matches!(s, Stage::Fwd(i) if i <= u)),
            _ => assert!(matches!(s, Stage::Bwd(_) | Stage::Opt(_))),
        }
    }
}

#[test]
fn a_late_prefetch_stalls_and_the_step_waits_for_its_swap_outs() {
    // 100 bytes at 100 B/s: 1 s per copy. Unit 0's parameters are needed at the step's start.
    let p = with_optimizer(chain(&[1.0, 1.0], &[10, 10], 0, 100.0), &[100, 0], 0.25, 0);
    let a = [Action::Retain; 2];
    let o = run(&p, &a, &StateSwaps { params: vec![true, false], states: vec![false; 2] }, u64::MAX);
    // 1 s stall before F0 (prefetch) and the 1 s swap-out after opt:0 (the step waits for it)
    assert!((o.swap_stall - 2.0).abs() < 1e-9, "stall {}", o.swap_stall);
    assert!((o.step_time - (o.compute_time + o.swap_stall + o.recompute)).abs() < 1e-9);
    assert_eq!(o.copies.iter().filter(|c| c.what == Moved::Parameters).count(), 2);
    // Unit 1's optimizer state (200 bytes, 2 s) is prefetched in the backward (3 s long) in time
    let o = run(&p, &a, &StateSwaps { params: vec![false; 2], states: vec![false, false] }, u64::MAX);
    assert_eq!(o.swap_stall, 0.0);
}

#[test]
fn optimizer_state_prefetched_as_late_as_the_timeline_allows() {
    let p = with_optimizer(chain(&[1.0; 4], &[10; 4], 0, 50.0), &[25, 25, 25, 25], 0.1, 0);
    // each state is 50 bytes: 1 s. The backward stages take 2 s each.
    let a = [Action::Retain; 4];
    let o = run(&p, &a, &StateSwaps { params: vec![false; 4], states: vec![true; 4] }, u64::MAX);
    // no prefetch is late: the optimizer stages start when the compute-only timeline says (the
    // stall is the end-of-step wait for the 4 swap-outs, 4 s less the 0.3 s of optimizer stages)
    assert!((point(&o, Stage::Opt(0)).start_time - 12.3).abs() < 1e-9);
    assert!((o.swap_stall - 3.7).abs() < 1e-9, "{}", o.swap_stall);
    // FIFO, as late as possible: the 4 copies (4 s) are issued in B1 and B0 (starting 4 s and 2 s
    // before the optimizer stages)
    for &(_, _, s) in &o.state_prefetch {
        assert!(matches!(s, Stage::Bwd(0) | Stage::Bwd(1)), "{:?}", o.state_prefetch);
    }
    // states off the device during the forward and most of the backward
    assert_eq!(point(&o, Stage::Fwd(3)).peak, 100 + 40);
}

#[test]
fn the_lower_bound_with_swaps_is_below_every_plan_and_swaps() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for case in 0..60 {
        let n = rng.gen_range(2..6);
        let f: Vec<f64> = (0..n).map(|_| rng.gen_range(0.1..2.0)).collect();
        let acts: Vec<i64> = (0..n).map(|_| rng.gen_range(0..50)).collect();
        let params: Vec<i64> = (0..n).map(|_| rng.gen_range(0..80)).collect();
        let bw = [1.0, 30.0, 1e18][case % 3];
        let p = with_optimizer(chain(&f, &acts, rng.gen_range(0..20), bw), &params, 0.2, rng.gen_range(0..10));
        let g = p.graph().unwrap();
        let (lb, _) = lower_bound_with_state_swaps(&g);
        assert!(lb <= lower_bound(&g).0);
        for _ in 0..20 {
            let a: Vec<Action> = (0..n).map(|_| Action::ALL[rng.gen_range(0..3)]).collect();
            let sw = StateSwaps {
                params: (0..n).map(|_| rng.gen_bool(0.5)).collect(),
                states: (0..n).map(|_| rng.gen_bool(0.5)).collect(),
            };
            let o = run(&p, &a, &sw, u64::MAX);
            assert!(o.peak_bytes >= lb, "case {case}: peak {} below the bound {lb}", o.peak_bytes);
            assert!((o.step_time - (o.compute_time + o.swap_stall + o.recompute)).abs() < 1e-9);
            // a budget at the peak is met
            let o2 = run(&p, &a, &sw, o.peak_bytes);
            assert!(o2.feasible && o2.peak_bytes <= o.peak_bytes, "case {case}");
        }
    }
}

#[test]
fn with_free_copies_swapping_more_never_raises_the_peak() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for case in 0..60 {
        let n = rng.gen_range(2..7);
        let f: Vec<f64> = (0..n).map(|_| rng.gen_range(0.1..2.0)).collect();
        let acts: Vec<i64> = (0..n).map(|_| rng.gen_range(0..50)).collect();
        let params: Vec<i64> = (0..n).map(|_| rng.gen_range(0..80)).collect();
        let p = with_optimizer(chain(&f, &acts, 5, 1e18), &params, 0.1, rng.gen_range(0..10));
        let a: Vec<Action> = (0..n).map(|_| Action::ALL[rng.gen_range(0..3)]).collect();
        let mut sw = StateSwaps { params: vec![false; n], states: vec![false; n] };
        let mut peak = run(&p, &a, &sw, u64::MAX).peak_bytes;
        // add swaps one at a time, in random order
        let mut order: Vec<(bool, usize)> = (0..n).flat_map(|u| [(true, u), (false, u)]).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.gen_range(0..=i));
        }
        for (param, u) in order {
            if param {
                sw.params[u] = true;
            } else {
                sw.states[u] = true;
            }
            let o = run(&p, &a, &sw, u64::MAX);
            assert!(o.peak_bytes <= peak, "case {case}: swapping {} of {u} raised the peak {peak} -> {}", if param { "parameters" } else { "state" }, o.peak_bytes);
            assert!(o.swap_stall < 1e-6);
            peak = o.peak_bytes;
        }
    }
}

fn small_profile() -> Profile {
    // activations small against parameters and state: only swapping those meets tight budgets
    with_optimizer(chain(&[1.0, 1.0, 1.0, 1.0], &[10, 10, 10, 10], 0, 1e4), &[200, 300, 300, 200], 0.05, 4)
}

#[test]
fn tensile_swaps_parameters_and_state_when_activations_cannot_meet_the_budget() {
    let p = small_profile();
    let g = p.graph().unwrap();
    let lb = lower_bound(&g).0;
    let smallest = smallest_known_budget_with_swaps(&g, &EvalOptions::default()).0;
    assert!(smallest < lb, "{smallest} {lb}");
    let budget = (smallest + lb) / 2;
    let plan = make_plan(&p, budget, "tensile", &PlanSettings::default(), |_, _| {}).unwrap();
    let s = plan.state_swaps.as_ref().expect("state swaps");
    assert!(!s.optimizer_state.is_empty());
    assert_eq!(plan.version, 2);
    assert!(plan.predicted.feasible && plan.predicted.peak_bytes <= budget);
    // the plan file round-trips and re-evaluates to its prediction
    let back = Plan::from_json(&plan.to_json()).unwrap();
    assert_eq!(back, plan);
    let o = run(&p, &back.actions, &back.swaps().unwrap(), budget);
    assert_eq!(o.peak_bytes, plan.predicted.peak_bytes);
    // a budget activations alone meet: no swaps across iterations, a version-1 plan
    let up = run(&p, &[Action::Retain; 4], &StateSwaps::none(), u64::MAX).peak_bytes;
    let easy = make_plan(&p, up, "tensile", &PlanSettings::default(), |_, _| {}).unwrap();
    assert!(easy.state_swaps.is_none() && easy.version == 1);
    // other methods never swap them: below their bound they refuse
    assert!(matches!(
        make_plan(&p, budget, "capuchin", &PlanSettings::default(), |_, _| {}),
        Err(CoreError::BudgetBelowLowerBound { .. })
    ));
}

#[test]
fn a_budget_tensile_cannot_meet_is_refused_with_one_it_can() {
    let p = small_profile();
    let g = p.graph().unwrap();
    let lb_swap = lower_bound_with_state_swaps(&g).0;
    for budget in [lb_swap / 2, lb_swap - 1] {
        let err = make_plan(&p, budget, "tensile", &PlanSettings::default(), |_, _| {}).unwrap_err();
        let smallest = match err {
            CoreError::BudgetBelowLowerBound { smallest_known, .. } | CoreError::NoFeasiblePlan { smallest_known, .. } => smallest_known,
            other => panic!("{other}"),
        };
        assert_eq!(smallest, smallest_known_budget_with_swaps(&g, &EvalOptions::default()).0.max(lb_swap));
        let plan = make_plan(&p, smallest, "tensile", &PlanSettings::default(), |_, _| {}).unwrap();
        assert!(plan.predicted.peak_bytes <= smallest);
    }
}

#[test]
fn a_plan_with_state_swaps_is_version_2_and_older_versions_say_so() {
    let p = small_profile();
    let g = p.graph().unwrap();
    let budget = (smallest_known_budget_with_swaps(&g, &EvalOptions::default()).0 + lower_bound(&g).0) / 2;
    let plan = make_plan(&p, budget, "tensile", &PlanSettings::default(), |_, _| {}).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    v["version"] = 1.into();
    let err = Plan::from_json(&v.to_string()).unwrap_err().to_string();
    assert!(err.contains("version 2"), "{err}");
    v["version"] = 3.into();
    let err = Plan::from_json(&v.to_string()).unwrap_err().to_string();
    assert!(err.contains("version 3") && err.contains("versions 1 to 2"), "{err}");
}

#[test]
fn the_allocation_sequence_follows_the_memory_count_with_swaps() {
    use tensorplace_core::alloc_sequence::allocation_sequence_with_swaps;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for case in 0..40 {
        let n = rng.gen_range(2..6);
        let f: Vec<f64> = (0..n).map(|_| rng.gen_range(0.1..2.0)).collect();
        let acts: Vec<i64> = (0..n).map(|_| rng.gen_range(1..50)).collect();
        let params: Vec<i64> = (0..n).map(|_| rng.gen_range(0..80)).collect();
        let p = with_optimizer(chain(&f, &acts, 3, [2.0, 40.0][case % 2]), &params, 0.3, rng.gen_range(0..10));
        let g = p.graph().unwrap();
        let a: Vec<Action> = (0..n).map(|_| Action::ALL[rng.gen_range(0..3)]).collect();
        let sw = StateSwaps { params: (0..n).map(|_| rng.gen_bool(0.5)).collect(), states: (0..n).map(|_| rng.gen_bool(0.5)).collect() };
        for budget in [u64::MAX, run(&p, &a, &sw, u64::MAX).peak_bytes * 9 / 10] {
            let seq = allocation_sequence_with_swaps(&g, &a, &g.block_start, &sw, budget, &EvalOptions::default()).unwrap();
            assert_eq!(seq.constant, g.constant - sw.host_bytes(&g));
            assert_eq!(seq.requested_peak(), seq.outcome.peak_bytes, "case {case}");
            assert_eq!(*seq.requested().last().unwrap_or(&seq.constant), seq.outcome.end_bytes, "case {case}");
        }
    }
}
