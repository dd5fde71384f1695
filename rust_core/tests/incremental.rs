//! Incremental evaluation (rust_core/src/incremental.rs) against the full evaluation: random
//! moves (one to three units changed from some unit on) over random profiles and the bundled
//! ones, resumed from saved states, rebased, and stopped by bounds.

mod common;
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tensorplace_core::evaluator::{evaluate_segments, replay_time, score, EvalOptions, Score, Scratch};
use tensorplace_core::incremental::{Context, Worker};
use tensorplace_core::peak::{lower_bound, unplanned_peak};
use tensorplace_core::profile::ExecutorCosts;
use tensorplace_core::{Action, Graph, Profile};

fn random_plan(rng: &mut ChaCha8Rng, n: usize) -> Vec<Action> {
    // Biased towards one action so that long runs of recomputed units occur.
    let w: [f64; 3] = [rng.gen(), rng.gen(), rng.gen()];
    (0..n)
        .map(|_| {
            let x = rng.gen::<f64>() * (w[0] + w[1] + w[2]);
            if x < w[0] {
                Action::Retain
            } else if x < w[0] + w[1] {
                Action::Swap
            } else {
                Action::Recompute
            }
        })
        .collect()
}

/// `plan` with unit j and up to two later units set to other actions; returns j.
fn random_move(rng: &mut ChaCha8Rng, plan: &[Action]) -> (Vec<Action>, usize) {
    let n = plan.len();
    let j = rng.gen_range(0..n);
    let mut p = plan.to_vec();
    let other = |a: Action, rng: &mut ChaCha8Rng| loop {
        let b = Action::ALL[rng.gen_range(0..3)];
        if b != a {
            return b;
        }
    };
    p[j] = other(p[j], rng);
    for _ in 0..rng.gen_range(0..=2) {
        let k = rng.gen_range(j..n);
        p[k] = other(p[k], rng);
    }
    (p, j)
}

fn random_budget(rng: &mut ChaCha8Rng, g: &Graph) -> u64 {
    let (lb, up) = (lower_bound(g).0, unplanned_peak(g));
    // Mostly between the lower bound and the unplanned peak, sometimes outside.
    let lo = lb.saturating_sub(lb / 4);
    let hi = up + up / 4;
    rng.gen_range(lo..=hi.max(lo))
}

fn random_opts(rng: &mut ChaCha8Rng) -> EvalOptions {
    EvalOptions { prefetch_lookahead: rng.gen_range(0..=4), sync_swap_out: rng.gen_bool(0.2) }
}

/// Check `moves` random moves from random plans of `g` against the full evaluation; returns how
/// many evaluations stopped at their bound.
fn check(g: &Graph, rng: &mut ChaCha8Rng, opts: &EvalOptions, plans: usize, moves: usize) -> usize {
    let budget = random_budget(rng, g);
    let ctx = Context::new(g, budget, opts);
    let mut scratch = Worker::new(g.n);
    let mut s2 = Scratch::new(g.n);
    let full = |p: &[Action], s: &mut Scratch| score(g, p, budget, opts, s);
    let mut stopped = 0;
    let mut seen: Vec<Score> = Vec::new();
    for _ in 0..plans {
        let plan = random_plan(rng, g.n);
        let mut base = ctx.base(&plan, &mut scratch);
        assert_eq!(base.score, full(&plan, &mut s2), "the base's score is the full evaluation's");
        for m in 0..moves {
            let (p, j) = random_move(rng, &base.plan);
            let want = full(&p, &mut s2);
            seen.push(want);
            let got = ctx.score(&base, &p, j, None, &mut scratch).expect("no bound");
            assert_eq!(got, want, "move from unit {j}: resumed {got:?}, full {want:?}\nbase {:?}\nplan {:?}", base.plan, p);
            // Bounds: the base's score, the move's own, a random plan's, and slightly off ones.
            let other = full(&random_plan(rng, g.n), &mut s2);
            let nudged = Score { time: want.time * (1.0 + 1e-6), ..want };
            for bound in [base.score, want, other, nudged, Score::WORST] {
                match ctx.score(&base, &p, j, Some(bound), &mut scratch) {
                    Some(s) => assert_eq!(s, want, "a finished bounded evaluation is exact"),
                    None => {
                        stopped += 1;
                        assert!(bound.better_than(&want), "stopped at bound {bound:?}, but the plan scores {want:?}");
                    }
                }
            }
            // Bounded full evaluations too.
            if let None = ctx.score_full(&p, Some(base.score), &mut scratch) {
                assert!(base.score.better_than(&want));
            }
            // Now and then the move becomes the base (resumed from where it changed).
            if m % 3 == 2 {
                ctx.rebase(&mut base, &p, &mut scratch);
                assert_eq!(base.plan, p);
                assert_eq!(base.score, want, "a rebased plan's score is the full evaluation's");
            }
        }
    }
    // A score the context calls optimal (it fits, with no stall and no replay) is beaten by none.
    for a in seen.iter().filter(|a| ctx.is_optimal(a)) {
        assert!(!seen.iter().any(|b| b.better_than(a)), "{a:?} is called optimal");
    }
    stopped
}

#[test]
fn resumed_and_bounded_moves_score_as_full_evaluations_on_random_profiles() {
    let mut stopped = 0;
    for seed in 0..400u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let p = random_profile(&mut rng, if seed % 4 == 0 { 80 } else { 20 });
        let g = p.graph().unwrap();
        let opts = random_opts(&mut rng);
        stopped += check(&g, &mut rng, &opts, 3, 12);
    }
    // The bound did stop evaluations (so the test checked that case too).
    assert!(stopped > 1000, "only {stopped} bounded evaluations stopped early");
}

#[test]
fn resumed_and_bounded_moves_score_as_full_evaluations_with_forward_held_until() {
    // Units whose activations the forward lets go of before their last forward reader: a
    // swapped one's bytes may leave earlier, a recomputed one's leave earlier.
    let mut stopped = 0;
    for seed in 0..200u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(7000 + seed);
        let mut p = random_profile(&mut rng, 20);
        let n = p.units.len();
        for u in 0..n {
            if p.units[u].act_bytes > 0 && rng.gen_bool(0.5) {
                p.units[u].forward_held_until = Some(rng.gen_range(u..=n) as i64);
            }
        }
        let g = p.graph().unwrap();
        let opts = random_opts(&mut rng);
        stopped += check(&g, &mut rng, &opts, 3, 12);
    }
    assert!(stopped > 100, "only {stopped} bounded evaluations stopped early");
}

/// A plan changed one unit at a time, as the swarm's sweep does (`Context::score_changed`, the
/// plan's states saved as it goes), scores as the full evaluation: units in order and in any
/// order (a block-wise dimension's first unit comes before earlier dimensions' later units),
/// with and without bounds, kept or not.
fn check_changes(g: &Graph, rng: &mut ChaCha8Rng, opts: &EvalOptions, sweeps: usize) -> usize {
    let budget = random_budget(rng, g);
    let ctx = Context::new(g, budget, opts);
    let mut w = Worker::new(g.n);
    let mut s2 = Scratch::new(g.n);
    let full = |p: &[Action], s: &mut Scratch| score(g, p, budget, opts, s);
    let mut stopped = 0;
    for sweep in 0..sweeps {
        let mut plan = random_plan(rng, g.n);
        let mut order: Vec<usize> = (0..g.n).collect();
        if sweep % 2 == 1 {
            for i in (1..order.len()).rev() {
                order.swap(i, rng.gen_range(0..=i));
            }
        }
        ctx.start_changes(&mut w);
        let mut cur = full(&plan, &mut s2);
        for &j in &order {
            let orig = plan[j];
            let a = Action::ALL[rng.gen_range(0..3)];
            if a == orig {
                continue;
            }
            plan[j] = a;
            let want = full(&plan, &mut s2);
            let bound = if rng.gen_bool(0.5) { Some(cur) } else { None };
            match ctx.score_changed(&plan, j, bound, &mut w) {
                Some(s) => assert_eq!(s, want, "change at unit {j}: resumed {s:?}, full {want:?}\nplan {plan:?}"),
                None => {
                    stopped += 1;
                    assert!(bound.expect("a bound").better_than(&want), "stopped, but the plan scores {want:?}");
                }
            }
            if rng.gen_bool(0.5) {
                // kept: the plan changed from unit j on
                ctx.changed(&plan, j, &mut w);
                cur = want;
            } else {
                plan[j] = orig;
            }
        }
        assert_eq!(ctx.score_changed(&plan, g.n - 1, None, &mut w), Some(cur), "the plan at the sweep's end");
    }
    stopped
}

#[test]
fn changes_one_unit_at_a_time_score_as_full_evaluations() {
    let mut stopped = 0;
    for seed in 0..300u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(20_000 + seed);
        let p = random_profile(&mut rng, if seed % 4 == 0 { 60 } else { 16 });
        let g = p.graph().unwrap();
        let opts = random_opts(&mut rng);
        stopped += check_changes(&g, &mut rng, &opts, 3);
    }
    for (k, m) in ["resnet50", "mobilenet_v2"].iter().enumerate() {
        let g = bundled(m).graph().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(30_000 + k as u64);
        stopped += check_changes(&g, &mut rng, &EvalOptions::default(), 2);
    }
    assert!(stopped > 100, "only {stopped} bounded evaluations stopped early");
}

fn data(name: &str) -> Profile {
    let path = format!("{}/tests/data/{name}.json", env!("CARGO_MANIFEST_DIR"));
    Profile::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn resumed_and_bounded_moves_score_as_full_evaluations_on_bundled_profiles() {
    let profiles: Vec<Profile> = ["resnet50", "inception_v3", "mobilenet_v2"]
        .iter()
        .map(|m| bundled(m))
        .chain(std::iter::once(data("tinygpt-255")))
        .collect();
    for (k, p) in profiles.iter().enumerate() {
        let g = p.graph().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1000 + k as u64);
        check(&g, &mut rng, &EvalOptions::default(), 2, 15);
    }
}

/// Moves over the profiles whose plans overflow once with a prefetch issued ahead of its need and
/// fit when it is issued later (the evaluator simulates the step again: the hooked evaluation
/// must too), at their faster link, and random profiles with the executor's host costs (a host
/// clock in the saved state).
#[test]
fn resumed_and_bounded_moves_score_as_full_evaluations_with_retried_prefetches_and_host_costs() {
    let mut stopped = 0;
    for (k, name) in ["faster-link-infeasible", "faster-link-infeasible-replay", "faster-link-infeasible-swaps"]
        .iter()
        .enumerate()
    {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/data/{name}.json"));
        let case: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut p = Profile::from_json(&case["profile"].to_string()).unwrap();
        let factor = case["factor"].as_f64().unwrap();
        p.d2h_bandwidth *= factor;
        p.h2d_bandwidth *= factor;
        let g = p.graph().unwrap();
        let actions: Vec<Action> =
            case["actions"].as_array().unwrap().iter().map(|a| Action::from_name(a.as_str().unwrap()).unwrap()).collect();
        let budget = ((unplanned_peak(&g) as f64) * case["frac"].as_f64().unwrap()) as u64;
        let opts = EvalOptions::default();
        let ctx = Context::new(&g, budget, &opts);
        let mut w = Worker::new(g.n);
        let mut s = Scratch::new(g.n);
        let want = score(&g, &actions, budget, &opts, &mut s);
        assert!(want.feasible, "{name}: the retried step fits");
        // from every unit: the plan as a move of a plan that differs there
        for j in 0..g.n {
            let mut other = actions.clone();
            other[j] = if other[j] == Action::Retain { Action::Recompute } else { Action::Retain };
            let base = ctx.base(&other, &mut w);
            assert_eq!(ctx.score(&base, &actions, j, None, &mut w), Some(want), "{name}, move at {j}");
            let mut rng = ChaCha8Rng::seed_from_u64(k as u64 * 100 + j as u64);
            stopped += check(&g, &mut rng, &opts, 1, 6);
        }
        // The run that is simulated again stops at the end of its first overflow's stage: more
        // than one full run's stages, fewer than two.
        let before = w.stages;
        assert_eq!(ctx.score_full(&actions, None, &mut w), Some(want), "{name}");
        let stages = w.stages - before;
        assert!(stages > 2 * g.n as u64 && stages < 4 * g.n as u64, "{name}: {stages} stages for {} units", g.n);
    }
    for seed in 0..200u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(5000 + seed);
        let mut p = random_profile(&mut rng, 20);
        p.executor = Some(ExecutorCosts {
            segment: rng.gen_range(0.0..0.5),
            drop: rng.gen_range(0.0..0.2),
            swap: rng.gen_range(0.0..1.0),
            swap_async: Some(rng.gen_range(0.0..2.0)),
            inline_bytes: rng.gen_range(0.0..64.0),
            tracked_op: rng.gen_range(0.0..0.3),
            stage: rng.gen_range(0.0..0.1),
            step: rng.gen_range(0.0..0.2),
        });
        let g = p.graph().unwrap();
        let opts = random_opts(&mut rng);
        stopped += check(&g, &mut rng, &opts, 2, 8);
    }
    assert!(stopped > 100, "only {stopped} bounded evaluations stopped early");
}

#[test]
fn the_replays_a_plan_makes_follow_from_the_plan() {
    // The bound counts the forward time of the units the backward replays before it runs
    // (evaluator::replay_time): it is the simulated step's recompute time, whatever the budget,
    // options and segments, on random profiles and plans (a few bundled ones too).
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let mut profiles: Vec<Profile> = (0..150).map(|_| random_profile(&mut rng, 40)).collect();
    profiles.extend(["plain20", "squeezenet", "mobilenet_v2"].iter().map(|n| bundled(n)));
    let mut replayed = 0;
    for p in &profiles {
        let g = p.graph().unwrap();
        let mut scratch = Scratch::new(g.n);
        for _ in 0..20 {
            let plan = random_plan(&mut rng, g.n);
            let starts: Vec<bool> = if rng.gen_bool(0.5) { g.block_start.clone() } else { (0..g.n).map(|_| rng.gen_bool(0.2)).collect() };
            let (budget, opts) = (random_budget(&mut rng, &g), random_opts(&mut rng));
            let out = evaluate_segments(&g, &plan, &starts, budget, &opts, &mut scratch, false);
            let want = replay_time(&g, &plan, &starts);
            assert!((out.recompute - want).abs() <= 1e-12 * want.max(1e-300), "recompute {} but replay_time {want}\nplan {plan:?}", out.recompute);
            replayed += (want > 0.0) as usize;
        }
    }
    assert!(replayed > 1000, "only {replayed} plans replay anything");
}
