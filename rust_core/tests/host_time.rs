//! The cost model's host time (docs/cost-model.md, "Host time") and whole-segment replays.
mod common;
use common::*;
use tensorplace_core::evaluator::{evaluate, evaluate_segments, EvalOptions, Scratch};
use tensorplace_core::profile::ExecutorCosts;
use tensorplace_core::Action::{self, *};

fn eval(p: &tensorplace_core::Profile, a: &[Action]) -> tensorplace_core::Outcome {
    let g = p.graph().unwrap();
    evaluate(&g, a, u64::MAX, &EvalOptions::default(), &mut Scratch::new(g.n), true)
}

fn costs() -> ExecutorCosts {
    ExecutorCosts { segment: 0.5, drop: 0.25, swap: 1.0, swap_async: Some(2.0), inline_bytes: 15.0, tracked_op: 3.0, stage: 0.0, step: 0.0 }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn without_executor_costs_nothing_changes() {
    let p = chain(&[1.0, 2.0, 3.0], &[10, 20, 30], 0, 1e9);
    for a in [[Retain; 3], [Swap, Retain, Retain], [Recompute, Recompute, Retain]] {
        let o = eval(&p, &a);
        assert_eq!(o.host_time, 0.0);
        assert!(close(o.step_time, o.compute_time + o.swap_stall + o.recompute));
    }
}

#[test]
fn a_cpu_stage_pays_the_executor_work_of_its_actions() {
    let mut p = chain(&[1.0, 2.0, 3.0], &[10, 20, 30], 0, 1e9);
    p.executor = Some(costs());
    for (u, packs) in [(0, 2), (1, 3), (2, 1)] {
        p.units[u].packs = Some(packs);
        p.units[u].act_storages = Some(1);
    }
    let g = p.graph().unwrap();
    assert!(g.fwd_host.is_none(), "a chain built for tests is a CPU profile");
    // retain: nothing
    assert_eq!(eval(&p, &[Retain; 3]).host_time, 0.0);
    // swap unit 0 (10 bytes, at most inline_bytes: `swap`, and its copies out and back on the
    // caller's thread at 1e9 B/s each way), unit 2 (30 bytes: `swap_async`)
    let o = eval(&p, &[Swap, Retain, Swap]);
    assert!(close(o.host_time, 1.0 + 2.0 * 10.0 / 1e9 + 2.0), "host {}", o.host_time);
    assert!(close(o.step_time, o.compute_time + o.swap_stall + o.recompute + o.host_time));
    // recompute 0 and 1 (one segment: one replay setup; drop per saved tensor of each)
    let o = eval(&p, &[Recompute, Recompute, Retain]);
    assert!(close(o.host_time, 0.5 + 0.25 * (2.0 + 3.0)), "host {}", o.host_time);
    assert!(close(o.step_time, o.compute_time + o.swap_stall + o.recompute + o.host_time));
}

#[test]
fn every_stage_after_the_first_swap_pays_the_swap_work_at_its_boundary() {
    // `stage` per unit after the plan's first swapped unit, whatever that unit's action: the
    // executor's stage-boundary work of a swap plan (frees, deadlines, prefetch hooks).
    let mut p = chain(&[1.0; 5], &[10; 5], 0, 1e9);
    p.executor = Some(ExecutorCosts { swap: 1.0, stage: 0.125, ..Default::default() });
    for u in 0..5 {
        p.units[u].act_storages = Some(1);
    }
    assert_eq!(eval(&p, &[Retain; 5]).host_time, 0.0);
    assert_eq!(eval(&p, &[Recompute, Retain, Retain, Retain, Retain]).host_time, 0.0);
    let o = eval(&p, &[Retain, Swap, Retain, Retain, Retain]);
    assert!(close(o.host_time, 1.0 + 3.0 * 0.125), "host {}", o.host_time);
    let o = eval(&p, &[Retain, Swap, Retain, Swap, Retain]);
    assert!(close(o.host_time, 2.0 + 3.0 * 0.125), "host {}", o.host_time);
}

#[test]
fn every_step_pays_the_executors_own_work_once() {
    // `step`: the executor's work that no action causes (its inputs, its state), in every plan,
    // all-retain too, once per step and in the first forward stage.
    let mut p = chain(&[1.0, 2.0, 3.0], &[10, 20, 30], 0, 1e9);
    let plain = eval(&p, &[Retain; 3]);
    p.executor = Some(ExecutorCosts { step: 0.375, drop: 0.25, ..Default::default() });
    for u in 0..3 {
        p.units[u].packs = Some(2);
    }
    let o = eval(&p, &[Retain; 3]);
    assert!(close(o.host_time, 0.375), "host {}", o.host_time);
    assert!(close(o.step_time, plain.step_time + 0.375), "step {}", o.step_time);
    let o = eval(&p, &[Recompute, Retain, Retain]);
    assert!(close(o.host_time, 0.375 + 0.25 * 2.0), "host {}", o.host_time);
    // in the first forward stage: the second stage starts that much later
    let r = tensorplace_core::evaluator::evaluate(&p.graph().unwrap(), &[Retain; 3], u64::MAX, &EvalOptions::default(),
                                                  &mut Scratch::new(3), true);
    let starts: Vec<f64> = r.curve.iter().map(|c| c.start_time).collect();
    assert!(close(starts[1], 1.0 + 0.375), "stage starts {starts:?}");
}

#[test]
fn a_small_storage_is_copied_on_the_callers_thread() {
    // At most `inline_bytes` a storage: the CPU backend copies it out and back on the caller's
    // thread, so the copies (10 bytes at 5 B/s out, 10 B/s back) are host time of its stage;
    // a larger one is copied on the copy thread (`swap_async` alone).
    let mut p = chain(&[1.0, 1.0], &[10, 20], 0, 1e9);
    p.d2h_bandwidth = 5.0;
    p.h2d_bandwidth = 10.0;
    p.executor = Some(ExecutorCosts { swap: 0.5, swap_async: Some(0.75), inline_bytes: 15.0, ..Default::default() });
    assert!(close(eval(&p, &[Swap, Retain]).host_time, 0.5 + 2.0 + 1.0));
    assert!(close(eval(&p, &[Retain, Swap]).host_time, 0.75));
}

#[test]
fn a_segment_whose_glue_lies_outside_it_is_tracked() {
    let mut p = chain(&[1.0, 2.0, 3.0, 4.0], &[10, 20, 30, 40], 0, 1e9);
    p.executor = Some(ExecutorCosts { tracked_op: 3.0, ..Default::default() });
    p.units[1].glue_ops = Some(2);
    p.units[1].glue_scope = Some([1, 2]); // its glue lies in a module call of units 1 and 2
    let starts = vec![false; 4];
    let g = p.graph().unwrap();
    let run = |a: &[Action]| evaluate_segments(&g, a, &starts, u64::MAX, &EvalOptions::default(), &mut Scratch::new(4), false);
    // units 1 and 2 in one segment: aligned, no tracking cost
    assert_eq!(run(&[Retain, Recompute, Recompute, Retain]).host_time, 0.0);
    // unit 1 alone: its glue's module call is not inside the segment, so it is tracked
    assert!(close(run(&[Retain, Recompute, Retain, Retain]).host_time, 6.0));
    // no module call holds it (glue at the top level): always tracked
    p.units[1].glue_scope = Some([-1, -1]);
    let g = p.graph().unwrap();
    let o = evaluate_segments(&g, &[Retain, Recompute, Recompute, Retain], &starts, u64::MAX, &EvalOptions::default(),
                              &mut Scratch::new(4), false);
    assert!(close(o.host_time, 6.0));
}

#[test]
fn a_host_slower_than_the_device_sets_the_pace() {
    // A GPU profile: the device takes fwd/bwd time, the host issues each stage in host time.
    let mut p = chain(&[1.0, 1.0, 1.0], &[10, 10, 10], 0, 1e9);
    for u in &mut p.units {
        u.fwd_host_time = Some(3.0);
        u.bwd_host_time = Some(0.5);
    }
    let o = eval(&p, &[Retain; 3]);
    // forward: the host issues at 3, 6, 9, the device ends each stage when its work is issued;
    // backward: the host is ahead by then (0.5 each), the device's 2 s per stage set the pace
    assert!(close(o.step_time, 9.0 + 3.0 * 2.0), "step {}", o.step_time);
    assert!(close(o.host_time, 6.0), "host {}", o.host_time);
    assert!(close(o.step_time, o.compute_time + o.swap_stall + o.recompute + o.host_time));
    // a host faster than the device: the device's time
    for u in &mut p.units {
        u.fwd_host_time = Some(0.1);
    }
    let o = eval(&p, &[Retain; 3]);
    assert!(close(o.step_time, 9.0) && close(o.host_time, 0.0));
}

#[test]
fn a_segment_is_replayed_as_a_whole_at_its_first_need() {
    // units 1..3 recomputed in one segment; unit 3 has no reader of its own but unit 1's
    // activations are read by unit 1's backward only: the first need is B3 (unit 3's own
    // backward) and the whole segment replays there, each unit once
    let p = chain(&[1.0, 2.0, 4.0, 8.0], &[10, 10, 10, 10], 0, 1e9);
    let o = eval(&p, &[Retain, Recompute, Recompute, Recompute]);
    assert!(close(o.recompute, 2.0 + 4.0 + 8.0), "recompute {}", o.recompute);
    let stages: Vec<usize> = o.replays.iter().map(|r| r.1).collect();
    assert_eq!(stages, vec![3, 3, 3], "every unit of the segment replays at the first need");
    let units: Vec<usize> = o.replays.iter().map(|r| r.0).collect();
    assert_eq!(units, vec![1, 2, 3]);
}

#[test]
fn the_generators_state_is_kept_once_per_random_segment() {
    let mut p = chain(&[1.0, 1.0, 1.0, 1.0], &[10, 10, 10, 10], 0, 1e9);
    p.rng_state_bytes = Some(1000);
    let plan = [Retain, Recompute, Recompute, Retain];
    let g = p.graph().unwrap();
    let at_forward_end = |g: &tensorplace_core::profile::Graph, starts: &[bool]| {
        let o = evaluate_segments(g, &plan, starts, u64::MAX, &EvalOptions::default(), &mut Scratch::new(4), true);
        o.curve[3].peak // the last forward stage: every held state is still there
    };
    let one = vec![false; 4];
    let two = vec![false, false, true, false]; // unit 2 starts a segment of its own
    let (one_plain, two_plain) = (at_forward_end(&g, &one), at_forward_end(&g, &two));
    p.units[1].random = true;
    p.units[2].random = true;
    let g = p.graph().unwrap();
    assert_eq!(at_forward_end(&g, &one), one_plain + 1000, "one state for the segment, not one per random unit");
    assert_eq!(at_forward_end(&g, &two), two_plain + 2000, "one per segment");
    // a retained random unit keeps nothing
    let retain = evaluate(&g, &[Retain; 4], u64::MAX, &EvalOptions::default(), &mut Scratch::new(4), false);
    p.units[1].random = false;
    p.units[2].random = false;
    let g0 = p.graph().unwrap();
    let retain0 = evaluate(&g0, &[Retain; 4], u64::MAX, &EvalOptions::default(), &mut Scratch::new(4), false);
    assert_eq!(retain.peak_bytes, retain0.peak_bytes);
}
