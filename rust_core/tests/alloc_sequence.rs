//! The evaluator's allocation sequence (rust_core/src/alloc_sequence.rs), the memory curve over
//! the step (rust_core/src/memory_curve.rs) and reserved budgets (rust_core/src/reserved.rs) on
//! the builtin example profiles, under random plans.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;
use tensorplace_core::alloc_sequence::{allocation_sequence, reserved_peak, What};
use tensorplace_core::allocator::{simulate, AllocConf, AllocEvent, Model, MIB};
use tensorplace_core::error::CoreError;
use tensorplace_core::evaluator::{evaluate_segments, EvalOptions, Scratch};
use tensorplace_core::memory_curve::memory_curve;
use tensorplace_core::peak::{lower_bound, unplanned_peak};
use tensorplace_core::plan::BudgetKind;
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::pso::PsoSettings;
use tensorplace_core::reserved::{make_plan_reserved, reserved_bytes};
use tensorplace_core::{Action, Profile};

const MODELS: [&str; 7] = ["plain20", "vgg16", "squeezenet", "mobilenet_v1", "mobilenet_v2", "resnet50", "inception_v3"];

fn load(name: &str) -> Profile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../python/tensorplace/examples/{name}.json"));
    Profile::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Every byte count of the profile in whole multiples of 2 MiB: `v / 65536 * 2 MiB` (x32, floored
/// to 64 KiB first; flooring keeps every "part <= whole" rule of a profile).
fn quantized(p: &Profile) -> Profile {
    let q = |v: i64| v / 65536 * (2 * MIB as i64);
    let qu = |v: u64| v / 65536 * (2 * MIB);
    let mut p = p.clone();
    let m = &mut p.memory;
    for v in [&mut m.parameters, &mut m.optimizer_state, &mut m.inputs, &mut m.workspace] {
        *v = qu(*v);
    }
    for u in &mut p.units {
        for v in [
            &mut u.act_bytes,
            &mut u.output_bytes,
            &mut u.held_input_bytes,
            &mut u.fwd_transient_bytes,
            &mut u.bwd_transient_bytes,
            &mut u.grad_bytes,
        ] {
            *v = q(*v);
        }
        for v in [&mut u.replay_transient_bytes, &mut u.lingering_bytes].into_iter().flatten() {
            *v = q(*v);
        }
        for list in [&mut u.held_from, &mut u.saved_from].into_iter().flatten() {
            for pair in list.iter_mut() {
                pair[1] = q(pair[1]);
            }
        }
    }
    p
}

fn random_plan(rng: &mut ChaCha8Rng, n: usize) -> (Vec<Action>, Vec<bool>) {
    let bias: f64 = rng.gen();
    let actions = (0..n)
        .map(|_| {
            let x: f64 = rng.gen();
            if x < bias * 0.5 {
                Action::Retain
            } else if x < bias * 0.5 + (1.0 - bias * 0.5) / 2.0 {
                Action::Swap
            } else {
                Action::Recompute
            }
        })
        .collect();
    let starts = (0..n).map(|_| rng.gen_bool(0.2)).collect();
    (actions, starts)
}

#[test]
fn the_sequence_follows_the_evaluators_memory_count_exactly() {
    for (k, name) in MODELS.iter().enumerate() {
        let p = load(name);
        let g = p.graph().unwrap();
        let (lb, up) = (lower_bound(&g).0, unplanned_peak(&g));
        let mut rng = ChaCha8Rng::seed_from_u64(k as u64);
        for _ in 0..20 {
            let (actions, starts) = random_plan(&mut rng, g.n);
            let budget = lb + ((up - lb) as f64 * rng.gen::<f64>()) as u64;
            let eval = EvalOptions::default();
            let seq = allocation_sequence(&g, &actions, &starts, budget, &eval).unwrap();
            // The sequence does not change the evaluation.
            let plain = evaluate_segments(&g, &actions, &starts, budget, &eval, &mut Scratch::new(g.n), true);
            assert_eq!(seq.outcome, plain, "{name}");
            assert_eq!(seq.requested_peak(), plain.peak_bytes, "{name}: peak of constant + live blocks");
            // What is live at the end is the memory at the end.
            let mut live = std::collections::HashMap::new();
            for e in &seq.events {
                match *e {
                    AllocEvent::Alloc { id, size, .. } => assert!(live.insert(id, size).is_none()),
                    AllocEvent::Free { id } => assert!(live.remove(&id).is_some(), "{name}: free of a dead block"),
                    _ => unreachable!("the evaluator frees in one event"),
                }
            }
            assert_eq!(seq.constant + live.values().sum::<u64>(), plain.end_bytes, "{name}");
            assert_eq!(seq.events.len(), seq.what.len());
            // No allocation is larger than the largest unit output (blocks go in pieces).
            let largest = g.out.iter().copied().max().unwrap();
            assert!(seq.events.iter().all(|e| !matches!(*e, AllocEvent::Alloc { size, .. } if size > largest)));
        }
    }
}

#[test]
fn the_memory_curve_follows_the_step_in_time() {
    let mut checked = 0;
    for (k, name) in MODELS.iter().enumerate() {
        let p = load(name);
        let g = p.graph().unwrap();
        let (lb, up) = (lower_bound(&g).0, unplanned_peak(&g));
        let mut rng = ChaCha8Rng::seed_from_u64(200 + k as u64);
        for round in 0..6 {
            let (actions, starts) = random_plan(&mut rng, g.n);
            let budget = lb + ((up - lb) as f64 * rng.gen::<f64>()) as u64;
            let seq = allocation_sequence(&g, &actions, &starts, budget, &EvalOptions::default()).unwrap();
            let conf = AllocConf::from_alloc_conf(["", "expandable_segments:True"][round % 2]).unwrap();
            let (stats, curve) = memory_curve(&seq, &conf).unwrap();
            let o = &seq.outcome;
            assert_eq!(stats, seq.simulate(&conf).unwrap(), "{name}: the curve's simulation is the plain one");
            assert_eq!((seq.times.len(), curve.len()), (seq.events.len(), seq.events.len() + 1));
            // In time order, from the step's start to its end.
            assert_eq!((curve[0].time, curve[0].allocated, curve[0].reserved), (0.0, g.constant, g.constant));
            assert!(curve.windows(2).all(|w| w[0].time <= w[1].time), "{name}");
            assert!(curve.last().unwrap().time <= o.step_time);
            // Reserved covers allocated at every point; the peaks are the simulation's and the
            // evaluation's; the step ends with the evaluation's end memory.
            assert!(curve.iter().all(|m| m.reserved >= m.allocated), "{name} round {round}");
            assert_eq!(curve.iter().map(|m| m.reserved).max(), Some(stats.max_reserved));
            assert_eq!(curve.iter().map(|m| m.allocated).max(), Some(o.peak_bytes));
            assert_eq!(curve.last().unwrap().allocated, o.end_bytes);
            // A forward's scratch lives through its compute, a replay's through the replay.
            let mut born = std::collections::HashMap::new();
            for (e, (&what, &t)) in seq.events.iter().zip(seq.what.iter().zip(&seq.times)) {
                match *e {
                    AllocEvent::Alloc { id, .. } => {
                        born.insert(id, t);
                    }
                    AllocEvent::Free { id } => {
                        let lasted = match what {
                            What::FwdWork(u) | What::ReplayWork(u) => g.fwd_time[u],
                            _ => continue,
                        };
                        assert_eq!(t, born[&id] + lasted, "{name}: {}", what.label());
                        checked += 1;
                    }
                    _ => unreachable!(),
                }
            }
        }
    }
    assert!(checked > 100, "too few transients to check ({checked})");
}

#[test]
fn the_simulated_allocated_peak_is_the_evaluators_peak_for_whole_2mib_sizes() {
    // With every size a multiple of 2 MiB, every block the caching allocator hands out is split
    // to the byte (rests are 0 or at least 2 MiB), and the offset pool's alignment is met: the
    // allocated peak of the simulation is the evaluator's peak, constant memory included.
    for (k, name) in ["plain20", "resnet50", "inception_v3", "mobilenet_v2"].iter().enumerate() {
        let p = quantized(&load(name));
        let g = p.graph().unwrap();
        let (lb, up) = (lower_bound(&g).0, unplanned_peak(&g));
        let mut rng = ChaCha8Rng::seed_from_u64(100 + k as u64);
        for round in 0..8 {
            let (actions, starts) = random_plan(&mut rng, g.n);
            let budget = lb + ((up - lb) as f64 * rng.gen::<f64>()) as u64;
            let conf = match round % 3 {
                0 => AllocConf::default(),
                1 => AllocConf::from_alloc_conf("expandable_segments:True").unwrap(),
                _ => AllocConf { model: Model::OffsetPool, ..AllocConf::default() },
            };
            let (seq, stats) = reserved_peak(&g, &actions, &starts, budget, &EvalOptions::default(), &conf).unwrap();
            assert_eq!(stats.max_allocated, seq.outcome.peak_bytes, "{name} round {round}");
            assert!(stats.max_reserved >= stats.max_allocated);
            assert_eq!(stats.allocated, seq.outcome.end_bytes, "{name} round {round}");
        }
    }
}

#[test]
fn any_size_simulates_at_least_the_evaluators_peak() {
    let p = load("squeezenet");
    let g = p.graph().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for _ in 0..10 {
        let (actions, starts) = random_plan(&mut rng, g.n);
        let (seq, stats) =
            reserved_peak(&g, &actions, &starts, u64::MAX, &EvalOptions::default(), &AllocConf::default()).unwrap();
        assert!(stats.max_allocated >= seq.outcome.peak_bytes);
        // Rounding costs less than 2 MiB per live block (the large pool's unsplit tails).
        assert!(stats.max_allocated - seq.outcome.peak_bytes < 2 * MIB * seq.events.len() as u64);
    }
}

#[test]
fn a_search_without_the_sequence_is_unchanged() {
    // The reserved peak is extra: the planner's actions and predictions are those of the
    // evaluation alone.
    let p = load("plain20");
    let g = p.graph().unwrap();
    let budget = (lower_bound(&g).0 + unplanned_peak(&g)) / 2;
    let s = small_search();
    let plan = make_plan(&p, budget, "pso", &s, |_, _| {}).unwrap();
    let starts: Vec<bool> = (0..g.n).map(|u| plan.segment_starts.contains(&u)).collect();
    let o = evaluate_segments(&g, &plan.actions, &starts, budget, &s.eval, &mut Scratch::new(g.n), true);
    assert_eq!(plan.predicted.peak_bytes, o.peak_bytes);
    let r = reserved_bytes(&g, &plan.actions, &starts, budget, &s.eval, &AllocConf::default()).unwrap();
    assert_eq!(plan.predicted.reserved_bytes, Some(r));
    assert_eq!(plan.predicted.alloc_conf.as_deref(), Some(""));
    assert!(r >= o.peak_bytes);
}

fn small_search() -> PlanSettings {
    PlanSettings {
        pso: PsoSettings { particles: 24, iterations: 12, threads: 1, polish: false, ..PsoSettings::default() },
        ..PlanSettings::default()
    }
}

#[test]
fn a_reserved_budget_is_met_in_simulated_reserved_memory_or_refused_with_what_works() {
    for name in ["resnet50", "inception_v3"] {
        let p = load(name);
        let g = p.graph().unwrap();
        let s = small_search();
        let budget = (lower_bound(&g).0 + unplanned_peak(&g)) / 2;
        let allocated = make_plan(&p, budget, "pso", &s, |_, _| {}).unwrap();
        let r0 = allocated.predicted.reserved_bytes.unwrap();
        assert!(r0 > budget, "{name}: the allocated plan's reserved peak is over its budget, {r0} <= {budget}");
        match make_plan_reserved(&p, budget, "pso", &s, 4) {
            Ok(plan) => {
                assert_eq!(plan.budget_kind, BudgetKind::Reserved);
                assert_eq!(plan.reserved_budget_bytes, Some(budget));
                assert!(plan.budget_bytes < budget, "{name}: the allocated budget was tightened");
                let starts: Vec<bool> = (0..g.n).map(|u| plan.segment_starts.contains(&u)).collect();
                let r = reserved_bytes(&g, &plan.actions, &starts, plan.budget_bytes, &s.eval, &AllocConf::default())
                    .unwrap();
                assert!(r <= budget, "{name}: reserved {r} over the budget {budget}");
                assert_eq!(plan.predicted.reserved_bytes, Some(r));
                assert!(plan.predicted.feasible && plan.predicted.peak_bytes <= plan.budget_bytes);
                // The fastest of the searched plans that fit, and the rounds say which.
                let search = &plan.settings["reserved_search"];
                let rounds = search["rounds"].as_array().unwrap();
                assert!(rounds.len() <= 4 && rounds[0]["allocated_budget"] == budget, "{name}: {search}");
                let chosen = &rounds[search["chosen"].as_u64().unwrap() as usize];
                assert_eq!(chosen["allocated_budget"], plan.budget_bytes);
                assert_eq!(chosen["reserved_bytes"], r);
                for round in rounds.iter().filter(|x| x["fits"] == true) {
                    assert!(round["reserved_bytes"].as_u64().unwrap() <= budget);
                    assert!(plan.predicted.step_time <= round["step_time"].as_f64().unwrap(), "{name}: {search}");
                }
                assert_eq!(search["fallback"], false);
            }
            Err(CoreError::NoReservedPlan { smallest_known, .. }) => assert!(smallest_known > budget),
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

#[test]
fn a_reserved_budget_below_every_plan_names_the_smallest_that_works() {
    let p = load("plain20");
    let g = p.graph().unwrap();
    let lb = lower_bound(&g).0;
    match make_plan_reserved(&p, lb / 2, "pso", &small_search(), 3) {
        Err(e @ CoreError::NoReservedPlan { .. }) => {
            let CoreError::NoReservedPlan { smallest_known, .. } = e else { unreachable!() };
            assert!(smallest_known >= lb);
            assert!(e.to_string().contains(&smallest_known.to_string()), "{e}");
            assert!(e.to_string().contains("expandable_segments:True"), "{e}");
        }
        other => panic!("expected NoReservedPlan, got {other:?}"),
    }
    // The profile's allocator settings are checked first, with what to do.
    let mut bad = p.clone();
    bad.environment = Some(serde_json::json!({"variables": {"PYTORCH_CUDA_ALLOC_CONF": "nonsense:1"}}));
    let e = make_plan_reserved(&bad, lb * 2, "pso", &small_search(), 3).unwrap_err();
    assert!(e.to_string().contains("pass alloc_conf"), "{e}");
    let ok = PlanSettings { alloc_conf: Some("expandable_segments:True".into()), ..small_search() };
    assert!(make_plan_reserved(&bad, unplanned_peak(&g) * 3, "pso", &ok, 1).is_ok());
}

#[test]
fn the_profiles_allocator_settings_are_read_from_its_environment() {
    let mut p = load("plain20");
    assert_eq!(p.alloc_conf(), "");
    p.environment = Some(serde_json::json!({"variables": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}));
    assert_eq!(p.alloc_conf(), "expandable_segments:True");
    p.environment = Some(serde_json::json!({"variables": {"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2"}}));
    assert_eq!(p.alloc_conf(), "b:2");
}

#[test]
fn expandable_segments_reserve_less_than_fixed_segments_on_a_checkpointed_plan() {
    let p = load("resnet50");
    let g = p.graph().unwrap();
    let plan = make_plan(&p, u64::MAX / 4, "checkpoint-blocks", &PlanSettings::default(), |_, _| {}).unwrap();
    let starts: Vec<bool> = (0..g.n).map(|u| plan.segment_starts.contains(&u)).collect();
    let eval = EvalOptions::default();
    let fixed = reserved_bytes(&g, &plan.actions, &starts, u64::MAX / 4, &eval, &AllocConf::default()).unwrap();
    let exp = AllocConf::from_alloc_conf("expandable_segments:True").unwrap();
    let grown = reserved_bytes(&g, &plan.actions, &starts, u64::MAX / 4, &eval, &exp).unwrap();
    assert!(grown <= fixed, "expandable {grown} > fixed {fixed}");
    let seq = allocation_sequence(&g, &plan.actions, &starts, u64::MAX / 4, &eval).unwrap();
    let stats = simulate(&seq.events, &AllocConf { initial: seq.initial(), ..AllocConf::default() }).unwrap();
    assert_eq!(stats.max_reserved, fixed);
}

#[test]
fn a_reserved_budget_search_is_deterministic_for_a_seed_whatever_the_thread_count() {
    let p = load("resnet50");
    let g = p.graph().unwrap();
    let budget = (lower_bound(&g).0 + unplanned_peak(&g)) / 2;
    let with_threads = |threads| {
        let mut s = small_search();
        s.pso.threads = threads;
        make_plan_reserved(&p, budget, "pso", &s, 6).unwrap()
    };
    let (one, two) = (with_threads(1), with_threads(2));
    assert_eq!(one.actions, two.actions);
    assert_eq!(one.budget_bytes, two.budget_bytes);
    assert_eq!(one.settings["reserved_search"], two.settings["reserved_search"]);
    assert!(one.settings["reserved_search"]["rounds"].as_array().unwrap().len() > 1, "the search searched");
}

#[test]
fn a_stages_large_requests_get_their_own_blocks_and_the_count_is_unchanged() {
    // cuDNN asks for workspaces larger than any tensor of the model; a profile lists them per
    // stage and the sequence allocates them whole, in order, each but the last freed before the
    // next, while the evaluator's memory count (and so its peak) stays what it was.
    for (k, name) in ["resnet50", "inception_v3"].iter().enumerate() {
        let mut base = load(name);
        let largest = base.units.iter().map(|u| u.output_bytes as u64).max().unwrap();
        // two backward stages with a transient large enough for three such requests
        for i in [base.units.len() / 3, base.units.len() / 2] {
            base.units[i].bwd_transient_bytes = (3 * largest + 10) as i64;
        }
        let mut p = base.clone();
        let mut listed = Vec::new();
        for (i, u) in p.units.iter_mut().enumerate() {
            let b = u.bwd_transient_bytes as u64;
            if b > 2 * largest + 2 {
                let sizes = vec![largest + 1, b / 2 + 1, largest + 2];
                u.bwd_large_allocs = Some(sizes.clone());
                listed.push((i, sizes));
            }
            if u.fwd_transient_bytes as u64 > largest {
                u.fwd_large_allocs = Some(vec![u.fwd_transient_bytes as u64, largest / 2]); // the second is no large request
            }
        }
        assert!(listed.len() >= 2, "{name}");
        let plain_g = base.graph().unwrap();
        let g = p.graph().unwrap();
        let (lb, up) = (lower_bound(&g).0, unplanned_peak(&g));
        let mut rng = ChaCha8Rng::seed_from_u64(300 + k as u64);
        for round in 0..12 {
            let (actions, starts) = if round == 0 { (vec![Action::Retain; g.n], vec![false; g.n]) } else { random_plan(&mut rng, g.n) };
            let budget = lb + ((up - lb) as f64 * rng.gen::<f64>()) as u64;
            let eval = EvalOptions::default();
            let seq = allocation_sequence(&g, &actions, &starts, budget, &eval).unwrap();
            let before = allocation_sequence(&plain_g, &actions, &starts, budget, &eval).unwrap();
            assert_eq!(seq.outcome, before.outcome, "{name}: the lists change no evaluation");
            assert_eq!(seq.requested_peak(), seq.outcome.peak_bytes, "{name} round {round}");
            let mut live = std::collections::HashMap::new();
            for e in &seq.events {
                match *e {
                    AllocEvent::Alloc { id, size, .. } => assert!(live.insert(id, size).is_none()),
                    AllocEvent::Free { id } => assert!(live.remove(&id).is_some(), "{name}: free of a dead block"),
                    _ => unreachable!(),
                }
            }
            assert_eq!(seq.constant + live.values().sum::<u64>(), seq.outcome.end_bytes, "{name}");
            // Each backward stage listed allocates its three requests whole and in order.
            for (i, sizes) in &listed {
                let got: Vec<u64> = seq
                    .events
                    .iter()
                    .zip(&seq.what)
                    .filter_map(|(e, w)| match *e {
                        AllocEvent::Alloc { size, .. } if *w == What::BwdWork(*i) && size > largest => Some(size),
                        _ => None,
                    })
                    .collect();
                assert!(!got.is_empty() && got.len() % 3 == 0, "{name} stage {i}: {got:?}");
                assert_eq!(&got[..3], &sizes[..], "{name} stage {i}");
            }
            // A forward transient listed whole is one block of its size; the small entry is ignored.
            assert!(seq.events.iter().all(|e| !matches!(*e, AllocEvent::Alloc { size, .. } if size > largest
                && !listed.iter().any(|(_, s)| s.contains(&size)) && !g.fwd_transient.contains(&size))));
        }
    }
}
