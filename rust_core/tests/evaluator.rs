mod common;
use common::*;
use tensorplace_core::evaluator::{evaluate, EvalOptions, Scratch, Stage};
use tensorplace_core::peak::{lower_bound, unplanned_peak};
use tensorplace_core::Action::{self, *};

fn eval(p: &tensorplace_core::Profile, a: &[Action], budget: u64) -> tensorplace_core::Outcome {
    let g = p.graph().unwrap();
    evaluate(&g, a, budget, &EvalOptions::default(), &mut Scratch::new(g.n), true)
}

#[test]
fn all_retain_time_is_compute_and_peak_is_all_activations() {
    let p = chain(&[1.0, 2.0, 3.0], &[10, 20, 30], 100, 1.0);
    let o = eval(&p, &[Retain; 3], u64::MAX);
    assert_eq!(o.step_time, 12.0 + 6.0);
    assert_eq!(o.swap_stall, 0.0);
    assert_eq!(o.peak_bytes, 160);
    assert!(o.feasible);
    assert_eq!(o.curve.len(), 6);
}

#[test]
fn swap_overlaps_with_compute_when_the_copy_is_short() {
    // Unit 0's 10 bytes at 10 B/s take 1 s, hidden behind unit 1's 2 s forward.
    let p = chain(&[1.0, 2.0, 3.0], &[10, 20, 30], 0, 10.0);
    let o = eval(&p, &[Swap, Retain, Retain], u64::MAX);
    assert_eq!(o.swap_stall, 0.0);
    assert!((o.step_time - 18.0).abs() < 1e-9);
    assert!((o.copy_time - 2.0).abs() < 1e-9);
    assert_eq!(o.prefetch.len(), 1);
}

#[test]
fn budget_pressure_makes_the_compute_stream_wait_for_the_swap_out() {
    // HOME section 3.4: OFFLOAD longer than the next forward -> the overlap rule charges the rest.
    let p = chain(&[1.0, 1.0, 1.0], &[10, 10, 10], 0, 2.5); // 4 s per copy
    let free = eval(&p, &[Swap, Retain, Retain], u64::MAX);
    assert_eq!(free.peak_bytes, 30);
    // Budget 20: unit 0's copy runs 2 s .. 6 s (issued after its reader, unit 1); forward of
    // unit 2 waits for it (4 s). In backward the prefetch does not fit at B2 and is issued at B1,
    // which waits for the whole 4 s copy.
    let tight = eval(&p, &[Swap, Retain, Retain], 20);
    assert!(tight.feasible, "{:?}", tight.reason);
    assert!(tight.peak_bytes <= 20);
    assert!((tight.swap_stall - 8.0).abs() < 1e-9, "stall {}", tight.swap_stall);
    assert!((tight.step_time - (free.step_time + 8.0)).abs() < 1e-9);
    assert_eq!(tight.prefetch, vec![(0, 1)]);
}

#[test]
fn recompute_chains_through_dropped_units() {
    let p = chain(&[1.0, 2.0, 4.0], &[10, 10, 10], 0, 1.0);
    let o = eval(&p, &[Retain, Recompute, Recompute], u64::MAX);
    // Unit 2's backward needs unit 2 (replay 4 s) which needs unit 1 (replay 2 s).
    assert!((o.recompute - 6.0).abs() < 1e-9, "recompute {}", o.recompute);
    assert!((o.step_time - (21.0 + 6.0)).abs() < 1e-9);
    assert!(o.peak_bytes <= 30);
}

#[test]
fn infeasible_budget_is_reported_with_the_stage() {
    let p = chain(&[1.0, 1.0], &[10, 10], 5, 1.0);
    let o = eval(&p, &[Retain, Retain], 15);
    assert!(!o.feasible);
    assert_eq!(o.excess, 10);
    assert!(o.reason.as_deref().unwrap().contains("fwd:1"), "{:?}", o.reason);
}

#[test]
fn lower_bound_is_below_every_plan_and_reached_by_a_stage() {
    let p = chain(&[1.0, 1.0, 1.0, 1.0], &[10, 40, 10, 20], 7, 1.0);
    let g = p.graph().unwrap();
    let (lb, stage) = lower_bound(&g);
    assert!(lb >= 7 + 40);
    assert!(matches!(stage, Stage::Fwd(_) | Stage::Bwd(_)));
    for code in 0..81 {
        let mut c = code;
        let a: Vec<Action> = (0..4).map(|_| { let x = Action::ALL[c % 3]; c /= 3; x }).collect();
        assert!(eval(&p, &a, u64::MAX).peak_bytes >= lb);
    }
    assert!(unplanned_peak(&g) >= lb);
}

#[test]
fn a_prefetch_is_issued_no_earlier_than_the_lookahead() {
    let p = chain(&[1.0; 6], &[10; 6], 0, 100.0);
    let o = eval(&p, &[Swap, Retain, Retain, Retain, Retain, Retain], u64::MAX);
    // Unit 0 is first needed by backward of unit 1; lookahead 2 -> issued at backward of 3.
    assert_eq!(o.prefetch, vec![(0, 3)]);
}
