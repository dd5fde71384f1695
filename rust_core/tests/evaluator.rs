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

fn stage_point(o: &tensorplace_core::Outcome, stage: Stage) -> tensorplace_core::evaluator::CurvePoint {
    *o.curve.iter().find(|c| c.stage == stage).expect("stage in the curve")
}

/// Unit 0 owns a saved glue value (softmax output, say) that unit 1's segment reads, while its
/// module output (not saved) is held by unit 1: replaying unit 1 needs unit 0 replayed first.
fn glue_pair(saved_inputs: Option<Vec<i64>>) -> tensorplace_core::Profile {
    let mut u0 = unit("qkv", &[], 1.0, 1.0, 20);
    u0.output_bytes = 10;
    u0.output_saved = false;
    u0.read_by = vec![0];
    let mut u1 = unit("drop", &[0], 2.0, 1.0, 5);
    u1.read_by = vec![1];
    u1.held_input_bytes = 10;
    u1.saved_inputs = saved_inputs;
    profile(vec![u0, u1], 0, 1.0)
}

#[test]
fn a_replay_chains_through_a_saved_value_of_an_input_whose_output_is_not_saved() {
    let with = eval(&glue_pair(Some(vec![0])), &[Recompute, Recompute], u64::MAX);
    // B1 replays unit 0 (20 bytes kept until B0, its unsaved output of 10 while it runs) next to
    // unit 1's held input (10), then unit 1 (5).
    assert_eq!(stage_point(&with, Stage::Bwd(1)).peak, 10 + 20 + 10);
    assert_eq!(stage_point(&with, Stage::Bwd(0)).mem_start, 20);
    assert!((with.recompute - 3.0).abs() < 1e-9, "recompute {}", with.recompute);
    // A profile without saved_inputs chains only through saved outputs. Without held_from, unit
    // 1's held bytes are taken to be unit 0's unsaved output: in one checkpoint segment the replay
    // regenerates it (B1 replays unit 0: 20 kept, its output 10 alive, then unit 1: 5) ...
    let without = eval(&glue_pair(None), &[Recompute, Recompute], u64::MAX);
    assert_eq!(stage_point(&without, Stage::Bwd(1)).peak, 20 + 10 + 5);
    assert!((without.recompute - 3.0).abs() < 1e-9);
    // ... in separate segments it is held, and B1 replays unit 1 alone.
    let split = eval_starts(&glue_pair(None), &[Recompute, Recompute], &[false, true]);
    assert_eq!(stage_point(&split, Stage::Bwd(1)).peak, 10 + 5);
    assert!((split.recompute - 3.0).abs() < 1e-9);
}

#[test]
fn held_inputs_leave_right_after_the_replay() {
    // u0's output (10, not saved) is held by u1 (recomputed); u1's activations (4) are first needed
    // by B2, so u1 is replayed there and its held input leaves then, not after B1.
    let mut u0 = unit("a", &[], 1.0, 1.0, 0);
    u0.output_bytes = 10;
    u0.output_saved = false;
    let mut u1 = unit("b", &[0], 1.0, 1.0, 4);
    u1.held_input_bytes = 10;
    u1.read_by = vec![2, 1];
    let mut u2 = unit("c", &[1], 1.0, 1.0, 0);
    u2.output_bytes = 1;
    u2.output_saved = false;
    let p = profile(vec![u0, u1, u2], 0, 1.0);
    let o = eval(&p, &[Retain, Recompute, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Bwd(2)).mem_start, 10);
    assert_eq!(stage_point(&o, Stage::Bwd(2)).peak, 10 + 4);
    assert_eq!(stage_point(&o, Stage::Bwd(1)).mem_start, 4);
    // A recomputed unit without activations is never replayed: its held input leaves when the
    // forward ends.
    let mut q = p.clone();
    q.units[1].act_bytes = 0;
    q.units[1].read_by = vec![];
    let o = eval(&q, &[Retain, Recompute, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(2)).peak, 10 + 1);
    assert_eq!(stage_point(&o, Stage::Bwd(2)).mem_start, 0);
}

#[test]
fn lingering_activations_leave_when_the_forward_lets_go_of_them() {
    // u0's last forward reader is u1, but the forward keeps 6 of its 10 bytes until F3 ends.
    let mut p = chain(&[1.0; 5], &[10, 1, 1, 1, 1], 0, 1e9);
    p.units[0].lingering_bytes = Some(6);
    p.units[0].lingering_until = Some(3);
    let o = eval(&p, &[Recompute, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(2)).mem_start, 6 + 1);
    assert_eq!(stage_point(&o, Stage::Fwd(3)).mem_start, 6 + 2);
    assert_eq!(stage_point(&o, Stage::Fwd(4)).mem_start, 3);
    // A swap-out that completes while the forward still holds those bytes frees only the rest
    // (its copy, issued after F1, has completed by the start of F3).
    let o = eval(&p, &[Swap, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(2)).mem_start, 10 + 1);
    assert_eq!(stage_point(&o, Stage::Fwd(3)).mem_start, 6 + 2);
    assert_eq!(stage_point(&o, Stage::Fwd(4)).mem_start, 3);
    // Without lingering bytes the dropped activations leave after F1.
    p.units[0].lingering_bytes = None;
    p.units[0].lingering_until = None;
    let o = eval(&p, &[Recompute, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(2)).mem_start, 1);
}

/// Five units in a chain, unit 0 (10 bytes, the others 1) read again by unit 3.
fn read_again_by_unit_3() -> Vec<tensorplace_core::profile::Unit> {
    let units: Vec<_> = (0..5)
        .map(|i| {
            let ins: Vec<i64> = match i {
                0 => vec![],
                3 => vec![0, 2],
                _ => vec![i as i64 - 1],
            };
            unit(&format!("u{i}"), &ins, 1.0, 2.0, if i == 0 { 10 } else { 1 })
        })
        .collect();
    wire(units)
}

#[test]
fn a_swap_out_is_queued_after_the_first_forward_reader_and_leaves_after_the_last() {
    // Unit 0's output is read by unit 1 (which saves it: the executor queues its copy at the end
    // of F1) and again by unit 3 (a residual add, say: the forward holds it until F3 ends). Its
    // 1 s copy runs 2 s .. 3 s, so its bytes leave when F3 is done, at the start of F4, not when
    // the copy completes (the forward still reads them in F3), nor only after a copy queued
    // behind F3 (4 s .. 5 s, the start of the backward). Found on swin_t's all-swap plan
    // (issue 18): the block's residual stream, saved by norm2 and added after the MLP.
    let p = profile(read_again_by_unit_3(), 0, 10.0);
    let o = eval(&p, &[Swap, Retain, Retain, Retain, Retain], u64::MAX);
    let copy = o.copies.iter().find(|c| c.unit == 0 && c.to_host).expect("unit 0's swap-out");
    assert_eq!((copy.start, copy.end), (2.0, 3.0), "{:?}", o.copies);
    assert_eq!(stage_point(&o, Stage::Fwd(3)).mem_start, 10 + 1 + 1);
    assert_eq!(stage_point(&o, Stage::Fwd(4)).mem_start, 1 + 1 + 1);
    assert!(o.swap_deadlines.contains(&(Stage::Fwd(4), 0)), "{:?}", o.swap_deadlines);
    // Under a budget that needs the room in F3, waiting for the copy frees nothing: the plan is
    // over the budget there rather than counting bytes the forward still holds as gone.
    let o = eval(&p, &[Swap, Retain, Retain, Retain, Retain], 12);
    assert!(!o.feasible);
    assert_eq!(stage_point(&o, Stage::Fwd(3)).peak, 10 + 1 + 1 + 1);
}

#[test]
fn a_unit_the_forward_lets_go_of_early_leaves_then_swapped_when_its_copy_ends() {
    // The profile of the test above, but the replay step found unit 0's bytes (a pooling's
    // indices, say, and the value its saver reads) no longer referenced by the forward after F1
    // (`forward_held_until`), although unit 3 reads its output (densenet's list of features):
    // they leave when the copy ends (3 s, the start of F3), not after F3.
    let mut units = read_again_by_unit_3();
    units[0].forward_held_until = Some(1);
    let p = profile(units, 0, 10.0);
    let o = eval(&p, &[Swap, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(3)).mem_start, 1 + 1);
    assert!(o.swap_deadlines.contains(&(Stage::Fwd(3), 0)), "{:?}", o.swap_deadlines);
    // Held until F2: the copy ends before F3, so the same.
    let mut q = p.clone();
    q.units[0].forward_held_until = Some(2);
    let o2 = eval(&q, &[Swap, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o2, Stage::Fwd(3)).mem_start, 1 + 1);
    // A stage past the last forward reader is the last reader (lingering_bytes say the rest),
    // and one before the unit itself is refused.
    q.units[0].forward_held_until = Some(4);
    let o3 = eval(&q, &[Swap, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o3, Stage::Fwd(3)).mem_start, 10 + 1 + 1);
    // Recomputed, its tensors were dropped at pack time: they leave after F1 too, not after F3.
    let o = eval(&p, &[Recompute, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(2)).mem_start, 1);
    let o = eval(&profile(read_again_by_unit_3(), 0, 10.0), &[Recompute, Retain, Retain, Retain, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Fwd(2)).mem_start, 10 + 1);
    q.units[1].forward_held_until = Some(0);
    let err = q.graph().unwrap_err().to_string();
    assert!(err.contains("forward_held_until 0") && err.contains("from 1 to 5"), "{err}");
}

#[test]
fn a_replay_is_charged_its_measured_transient_inside_the_stage_that_needs_it() {
    let mut p = chain(&[1.0, 1.0], &[10, 10], 0, 1.0);
    p.units[0].fwd_transient_bytes = 100;
    p.units[1].bwd_transient_bytes = 7;
    p.units[1].grad_bytes = 2;
    // Unit 0 is first needed by B1: its replay runs with B1's transient and gradients on top.
    let o = eval(&p, &[Recompute, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Bwd(1)).peak, 10 + 10 + 100 + 7 + 2);
    p.units[0].replay_transient_bytes = Some(3);
    let o = eval(&p, &[Recompute, Retain], u64::MAX);
    assert_eq!(stage_point(&o, Stage::Bwd(1)).peak, 10 + 10 + 3 + 7 + 2);
}

fn eval_starts(p: &tensorplace_core::Profile, a: &[Action], starts: &[bool]) -> tensorplace_core::Outcome {
    let g = p.graph().unwrap();
    tensorplace_core::evaluate_segments(&g, a, starts, u64::MAX, &EvalOptions::default(), &mut Scratch::new(g.n), true)
}

#[test]
fn two_copy_engines_run_a_prefetch_beside_a_swap_out() {
    // Units 0 and 2 are swapped (1 B/s). Unit 2's swap-out runs 13..43 s; unit 0's prefetch, issued
    // at B3 (13 s), waits behind it on one engine (43..53 s: B1 at 35 s stalls 18 s) and runs
    // beside it on two (13..23 s: no stall).
    let mut p = chain(&[1.0, 1.0, 10.0, 1.0], &[10, 1, 30, 1], 0, 1.0);
    let one = eval(&p, &[Swap, Retain, Swap, Retain], u64::MAX);
    p.copy_engines = Some(2);
    let two = eval(&p, &[Swap, Retain, Swap, Retain], u64::MAX);
    assert!(two.step_time <= one.step_time, "two engines {} > one {}", two.step_time, one.step_time);
    assert!((one.swap_stall - 18.0).abs() < 1e-9, "stall with one engine {}", one.swap_stall);
    assert_eq!(two.swap_stall, 0.0);
    assert_eq!(one.peak_bytes, two.peak_bytes);
    p.copy_engines = Some(3);
    assert!(p.graph().is_err(), "3 copy engines are refused");
}

/// u0 -> u1 -> u2 -> u3: u1's output (8 bytes) is not saved; u2 reads it and holds it for a replay.
fn held_chain() -> tensorplace_core::Profile {
    let mut units = wire(vec![
        unit("a", &[], 1.0, 1.0, 4),
        unit("b", &[0], 1.0, 1.0, 2),
        unit("c", &[1], 1.0, 1.0, 4),
        unit("d", &[2], 1.0, 1.0, 4),
    ]);
    units[1].output_bytes = 8;
    units[1].output_saved = false;
    units[2].held_input_bytes = 8;
    units[2].held_from = Some(vec![[1, 8]]);
    units[2].saved_inputs = Some(vec![]);
    profile(units, 0, 1.0)
}

#[test]
fn a_segment_regenerates_its_own_unsaved_values_instead_of_holding_them() {
    let p = held_chain();
    let plan = [Retain, Recompute, Recompute, Retain];
    // One segment {1, 2}: nothing is held from the forward, so after the forward only the retained
    // activations stay (4 + 4); the replay of unit 2 replays unit 1 first (2 s of recompute).
    let joined = eval_starts(&p, &plan, &[false; 4]);
    let end_fwd = joined.curve.iter().find(|c| c.stage == Stage::Bwd(3)).unwrap().mem_start;
    assert_eq!(end_fwd, 4 + 4);
    assert!((joined.recompute - 2.0).abs() < 1e-9, "recompute {}", joined.recompute);
    // Split into {1} and {2}: unit 2 holds unit 1's output (8) from its forward to its replay.
    let split = eval_starts(&p, &plan, &[false, false, true, false]);
    let end_fwd = split.curve.iter().find(|c| c.stage == Stage::Bwd(3)).unwrap().mem_start;
    assert_eq!(end_fwd, 4 + 4 + 8);
    for o in [&joined, &split] {
        assert_eq!(o.end_bytes, 0, "everything is let go by the end of the step");
    }
}

#[test]
fn a_segment_holds_what_it_saves_of_another_segments_units_and_replays_once() {
    // d (3) saves c's (2) output; c and d are recomputed in different segments: d holds c's output
    // (saved_from) and gets it back from its own replay, without replaying c at d's backward.
    let mut p = chain(&[1.0, 1.0, 1.0, 1.0], &[4, 4, 4, 4], 0, 1.0);
    p.units[3].saved_from = Some(vec![[2, 4]]);
    let plan = [Retain, Recompute, Recompute, Recompute];
    let split = eval_starts(&p, &plan, &[false, false, false, true]);
    // B3 replays d only (c's segment is replayed at B2): 1 s; B2 replays c (and b, its segment).
    assert!((split.recompute - 3.0).abs() < 1e-9, "recompute {}", split.recompute);
    assert_eq!(split.end_bytes, 0);
    let joined = eval_starts(&p, &plan, &[false; 4]);
    assert!((joined.recompute - 3.0).abs() < 1e-9, "each unit is replayed once: {}", joined.recompute);
    assert_eq!(joined.end_bytes, 0);
}

#[test]
fn a_faster_link_keeps_the_regression_plans_feasible() {
    // tests/data/faster-link-infeasible*.json: plans that a 7x-85x faster link made infeasible,
    // because a prefetch issued ahead of its need overflowed a stage before that need.
    for name in ["faster-link-infeasible", "faster-link-infeasible-replay", "faster-link-infeasible-swaps"] {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/data/{name}.json"));
        let case: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let slow = tensorplace_core::Profile::from_json(&case["profile"].to_string()).unwrap();
        let mut fast = slow.clone();
        let factor = case["factor"].as_f64().unwrap();
        fast.d2h_bandwidth *= factor;
        fast.h2d_bandwidth *= factor;
        let actions: Vec<Action> =
            case["actions"].as_array().unwrap().iter().map(|a| Action::from_name(a.as_str().unwrap()).unwrap()).collect();
        let budget = ((unplanned_peak(&slow.graph().unwrap()) as f64) * case["frac"].as_f64().unwrap()) as u64;
        let (s, f) = (eval(&slow, &actions, budget), eval(&fast, &actions, budget));
        assert!(s.feasible && f.feasible, "{name}: {:?}", f.reason);
        assert!(f.peak_bytes <= budget, "{name}");
        if s.cancelled_swaps == 0 {
            assert!(f.step_time <= s.step_time, "{name}: {} > {}", f.step_time, s.step_time);
        }
    }
}

#[test]
fn a_swap_out_cancelled_before_its_copy_starts_never_runs() {
    // 10 s copies behind 1-3 s stages: the swap-outs of units 1 and 2 are still queued behind
    // unit 0's when the backward reaches them, so their device copies are used as they are and
    // their copies never run (the backends skip a cancelled queued copy); unit 0's copy had
    // started (2 s .. 12 s) and runs to its end.
    let p = chain(&[1.0, 1.0, 1.0, 1.0], &[10, 10, 10, 10], 0, 1.0);
    let o = eval(&p, &[Swap, Swap, Swap, Retain], u64::MAX);
    assert!(o.feasible);
    assert_eq!(o.cancelled_swaps, 3, "{:?}", o.copies);
    assert_eq!(o.copies.len(), 1, "{:?}", o.copies);
    // the plan tells the executor which swap-outs never start
    assert_eq!(o.unstarted_swaps, vec![1, 2]);
    assert_eq!(o.in_flight_swaps, vec![0]);
    assert!((o.copy_time - 10.0).abs() < 1e-9, "copy time {}", o.copy_time);
    assert!((o.step_time - 12.0).abs() < 1e-9, "step {}", o.step_time);
}

#[test]
fn the_copies_queued_behind_a_cancelled_swap_out_move_up() {
    // One copy engine, 4 s copies. Unit 0's swap-out runs 2 s .. 6 s, unit 2's 9 s .. 13 s, and
    // unit 3's is queued behind it (13 s .. 17 s) when the backward starts at 10 s and cancels
    // it. Unit 0's prefetch then starts when unit 2's copy ends, not after the cancelled one.
    let p = chain(&[1.0, 1.0, 6.0, 1.0, 1.0], &[10, 10, 10, 10, 10], 0, 2.5);
    let o = eval(&p, &[Swap, Retain, Swap, Swap, Retain], u64::MAX);
    let ran: Vec<(usize, bool, f64, f64)> = o.copies.iter().map(|c| (c.unit, c.to_host, c.start, c.end)).collect();
    assert_eq!(ran, vec![(0, true, 2.0, 6.0), (2, true, 9.0, 13.0), (0, false, 13.0, 17.0)], "{:?}", o.copies);
    assert_eq!(o.cancelled_swaps, 2); // unit 3's, queued, and unit 2's, whose copy had started
    assert_eq!(o.unstarted_swaps, vec![3]);
    assert_eq!(o.in_flight_swaps, vec![2]);
    assert!((o.copy_time - 12.0).abs() < 1e-9);
    assert_eq!(o.swap_stall, 0.0);
}

#[test]
fn the_loss_backward_comes_before_the_last_stages_replay() {
    // Chain of 10/20/30-byte activations, the last stage's transient 5 bytes and the loss's
    // backward 40 bytes: in all-retain the loss runs beside every activation (60 + 40); in
    // all-recompute, beside none (the replay of the last segment comes after it, with the
    // stage's own 5 bytes), so it does not add to the replay's peak.
    let mut p = chain(&[1.0, 1.0, 1.0], &[10, 20, 30], 100, 1.0);
    p.units[2].bwd_transient_bytes = 5;
    p.units[2].loss_transient_bytes = Some(40);
    let g = p.graph().unwrap();
    assert_eq!(eval(&p, &[Retain; 3], u64::MAX).peak_bytes, 100 + 60 + 40);
    assert_eq!(unplanned_peak(&g), 100 + 60 + 40);
    assert!(lower_bound(&g).0 >= 100 + 40);
    let recompute = eval(&p, &[Recompute; 3], u64::MAX);
    let mut merged = p.clone(); // the loss counted in the last stage's transient, as before
    merged.units[2].bwd_transient_bytes = 40;
    merged.units[2].loss_transient_bytes = None;
    let before = eval(&merged, &[Recompute; 3], u64::MAX);
    assert!(recompute.peak_bytes < before.peak_bytes, "{} {}", recompute.peak_bytes, before.peak_bytes);
    assert!(recompute.peak_bytes >= 100 + 40);
}

#[test]
fn the_loss_backward_comes_before_the_first_stages_prefetches() {
    // Unit 0 swapped out before the backward (a fast link, its copy issued after its last reader,
    // unit 1); the first backward stage prefetches it (needed by B1, within the lookahead), but
    // the loss's backward (40 bytes) runs before that: it lies on the constant memory and units
    // 1 and 2 only.
    let mut p = chain(&[1.0, 1.0, 1.0], &[10, 20, 30], 100, 1000.0);
    p.units[2].loss_transient_bytes = Some(40);
    let o = eval(&p, &[Swap, Retain, Retain], u64::MAX);
    assert_eq!(o.prefetch.len(), 1);
    assert_eq!(o.peak_bytes, 100 + 20 + 30 + 40);
}

#[test]
fn a_replay_lies_on_what_its_stage_has_allocated_at_a_nodes_start() {
    // The last stage's backward peaks at 50 bytes (and 10 of gradients), but at the start of its
    // nodes, where an unpack replays its segment, it holds at most 5: the replay of its last
    // unit (30 bytes and 40 of scratch, on the 10 + 20 replayed before it) lies on those 5.
    // Without `bwd_replay_bytes` it lies on all 60, as before; a value above the stage's peak is
    // taken as the peak.
    let mut p = chain(&[1.0, 1.0, 1.0], &[10, 20, 30], 100, 1.0);
    p.units[2].bwd_transient_bytes = 50;
    p.units[2].grad_bytes = 10;
    p.units[2].replay_transient_bytes = Some(40);
    let whole = eval(&p, &[Recompute; 3], u64::MAX);
    assert_eq!(whole.peak_bytes, 100 + 30 + 70 + 60, "{:?}", whole.curve);
    p.units[2].bwd_replay_bytes = Some(5);
    let at_node = eval(&p, &[Recompute; 3], u64::MAX);
    assert_eq!(at_node.peak_bytes, 100 + 60 + 60, "the stage's own peak: {:?}", at_node.curve);
    p.units[2].bwd_transient_bytes = 0;
    assert_eq!(eval(&p, &[Recompute; 3], u64::MAX).peak_bytes, 100 + 30 + 70 + 5);
    p.units[2].bwd_replay_bytes = Some(500);
    assert_eq!(eval(&p, &[Recompute; 3], u64::MAX).peak_bytes, 100 + 30 + 70 + 10);
    // all-retain replays nothing: the field does not move it
    assert_eq!(eval(&p, &[Retain; 3], u64::MAX).peak_bytes, 100 + 60 + 10);
}

#[test]
fn a_stages_replay_slack_lies_under_its_replays_only() {
    // As above (the replay of the last unit lies on the 5 bytes its stage holds at a node's
    // start), and 3 bytes the profile's steady step measured above the model while a segment
    // replayed in that stage: under the replay, not in all-retain, which replays nothing.
    let mut p = chain(&[1.0, 1.0, 1.0], &[10, 20, 30], 100, 1.0);
    p.units[2].grad_bytes = 10;
    p.units[2].replay_transient_bytes = Some(40);
    p.units[2].bwd_replay_bytes = Some(5);
    let without = eval(&p, &[Recompute; 3], u64::MAX).peak_bytes;
    assert_eq!(without, 100 + 30 + 70 + 5);
    p.units[2].replay_slack_bytes = Some(3);
    assert_eq!(eval(&p, &[Recompute; 3], u64::MAX).peak_bytes, without + 3);
    assert_eq!(eval(&p, &[Retain; 3], u64::MAX).peak_bytes, 100 + 60 + 10);
}

#[test]
fn a_segment_holds_two_values_of_one_producer_twice_and_one_value_once() {
    // Unit 0 recomputed in a segment of its own; units 1 and 2 recomputed in the next one, each
    // saving a value of unit 0 (40 and 60 bytes): the second segment holds both from its forward
    // to its backward. Named by value, two ids are both charged; one id (one value read twice)
    // once; without value ids a segment holds each producer's values once (the first reader's).
    let mut p = chain(&[1.0, 1.0, 1.0], &[100, 0, 0], 1000, 1.0);
    p.units[1].saved_from = Some(vec![[0, 40]]);
    p.units[2].saved_from = Some(vec![[0, 60]]);
    p.units[2].inputs = vec![0, 1];
    p.units[0].read_by = vec![2, 1];
    let peak = |p: &tensorplace_core::Profile| {
        let g = p.graph().unwrap();
        let o = tensorplace_core::evaluator::evaluate_segments(
            &g, &[Recompute; 3], &[true, true, false], u64::MAX, &EvalOptions::default(), &mut Scratch::new(g.n), true,
        );
        o.curve.iter().find(|c| c.stage == Stage::Fwd(2)).unwrap().peak
    };
    let by_producer = peak(&p);
    let mut two = p.clone();
    for u in two.units.iter_mut() {
        u.held_values = Some(vec![]);
        u.saved_values = Some(vec![]);
    }
    two.units[1].saved_values = Some(vec![[0, 0, 40]]);
    two.units[2].saved_values = Some(vec![[0, 1, 60]]);
    let mut one = two.clone();
    one.units[2].saved_values = Some(vec![[0, 0, 60]]);
    assert_eq!(peak(&two), by_producer + 60);
    assert_eq!(peak(&one), by_producer);
}

#[test]
fn a_lingering_value_a_segment_holds_counts_once() {
    // Unit 0 (100 bytes, recomputed) is let go after its reader, unit 1, but the forward's code
    // keeps its value (id 0) until stage 3. A later segment holds that same value for its replay:
    // unit 1 (case a, its forward before unit 0 leaves) or unit 3 (case b, after). Named as a
    // lingering value, the held and the lingering bytes are one storage, counted once;
    // unnamed, both are counted from the holder's forward to stage 3. The allocation sequence
    // follows the count exactly either way.
    for holder in [1usize, 3] {
        let mut p = chain(&[1.0; 4], &[100, 10, 10, 10], 1000, 1.0);
        for u in p.units.iter_mut() {
            u.held_values = Some(vec![]);
            u.saved_values = Some(vec![]);
        }
        p.units[holder].saved_values = Some(vec![[0, 0, 100]]);
        p.units[0].lingering_bytes = Some(100);
        p.units[0].lingering_until = Some(3);
        let peak_at = |p: &tensorplace_core::Profile, stage: usize| {
            let g = p.graph().unwrap();
            let starts = [true; 4];
            let o = tensorplace_core::evaluator::evaluate_segments(
                &g, &[Recompute; 4], &starts, u64::MAX, &EvalOptions::default(), &mut Scratch::new(g.n), true,
            );
            let seq = tensorplace_core::alloc_sequence::allocation_sequence(&g, &[Recompute; 4], &starts, u64::MAX, &EvalOptions::default())
                .unwrap();
            assert_eq!(seq.requested_peak(), o.peak_bytes, "holder {holder}: peak of constant + live blocks");
            o.curve.iter().find(|c| c.stage == Stage::Fwd(stage)).unwrap().peak
        };
        let twice = peak_at(&p, 3);
        p.units[0].lingering_values = Some(vec![[0, 100]]);
        assert_eq!(peak_at(&p, 3), twice - 100, "holder {holder}");
        // a value nobody holds stays lingering
        p.units[0].lingering_values = Some(vec![[1, 100]]);
        assert_eq!(peak_at(&p, 3), twice, "holder {holder}");
    }
}

#[test]
fn a_random_segments_replay_holds_two_generator_states() {
    // The same replay as above (the last unit's: 30 bytes and 40 of scratch on the 10 + 20
    // replayed before it, on 5 bytes of its stage): a segment that draws random numbers holds the
    // generators' state from its forward to its replay (rng_state_bytes), and during its replay
    // two more copies (the state it sets and the one it restores).
    let mut p = chain(&[1.0, 1.0, 1.0], &[10, 20, 30], 100, 1.0);
    p.units[2].replay_transient_bytes = Some(40);
    p.units[2].grad_bytes = 10;
    p.units[2].bwd_replay_bytes = Some(5);
    assert_eq!(eval(&p, &[Recompute; 3], u64::MAX).peak_bytes, 100 + 30 + 70 + 5);
    p.rng_state_bytes = Some(7);
    p.units[1].random = true;
    // the held state is released by the segment's first unit's replay, before the last one's
    assert_eq!(eval(&p, &[Recompute; 3], u64::MAX).peak_bytes, 100 + 30 + 70 + 5 + 2 * 7);
    // a segment that draws none replays without them
    p.units[1].random = false;
    assert_eq!(eval(&p, &[Recompute; 3], u64::MAX).peak_bytes, 100 + 30 + 70 + 5);
}
