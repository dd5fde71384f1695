//! The block-wise search (rust_core/src/blockwise.rs) and the search's stop at a plan as fast as
//! its stage times, on the TinyGPT profiles of tests/data and the bundled ones.

mod common;
use common::*;
use tensorplace_core::evaluator::{score, EvalOptions, Scratch};
use tensorplace_core::incremental::Context;
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::pso::{search, PsoSettings};
use tensorplace_core::recipes::{repeated_block_classes, repeated_blocks};
use tensorplace_core::Profile;

fn data(name: &str) -> Profile {
    let path = format!("{}/tests/data/{name}.json", env!("CARGO_MANIFEST_DIR"));
    Profile::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `p` on a link so slow that copying every activation one way takes `ratio` x the compute
/// time (so that no plan hides every copy).
fn slow_link(mut p: Profile, ratio: f64) -> Profile {
    let bytes: i64 = p.units.iter().map(|u| u.act_bytes).sum();
    let compute: f64 = p.units.iter().map(|u| u.fwd_time + u.bwd_time).sum();
    p.d2h_bandwidth = bytes as f64 / (ratio * compute);
    p.h2d_bandwidth = p.d2h_bandwidth;
    p
}

fn small(block_wise: Option<bool>, threads: usize, p: &Profile) -> PsoSettings {
    PsoSettings {
        particles: 40,
        iterations: 20,
        threads,
        block_wise,
        blocks: repeated_block_classes(p),
        seeds: tensorplace_core::recipes::checkpoint_blocks(p).into_iter().collect(),
        ..Default::default()
    }
}

#[test]
fn block_classes_are_blocks_of_one_structure() {
    // ResNet-50: the first block of each stage has a downsample branch, the others not.
    let p = bundled("resnet50");
    let classes = repeated_block_classes(&p);
    assert_eq!(classes.len(), 2, "{classes:?}");
    assert_eq!(classes[0].len(), 4);
    assert_eq!(classes[1].len(), 12);
    for c in &classes {
        assert!(c.iter().all(|&(a, b)| b - a == c[0].1 - c[0].0), "a class's blocks have one length");
    }
    let mut all: Vec<(usize, usize)> = classes.into_iter().flatten().collect();
    all.sort();
    assert_eq!(all, repeated_blocks(&p));
    // TinyGPT: one class of equal layers, 10 units each.
    let t = data("tinygpt-255");
    let classes = repeated_block_classes(&t);
    assert_eq!(classes.len(), 1);
    assert_eq!(classes[0].len(), 25);
    assert!(classes[0].iter().all(|&(a, b)| b - a + 1 == 10));
}

#[test]
fn block_wise_search_does_not_depend_on_the_thread_count() {
    let p = slow_link(data("tinygpt-255"), 1.0);
    let g = p.graph().unwrap();
    let budget = budget_at(&p, 0.3);
    let opts = EvalOptions::default();
    let one = search(&g, budget, &opts, &small(Some(true), 1, &p), |_, _| {}).unwrap();
    let two = search(&g, budget, &opts, &small(Some(true), 2, &p), |_, _| {}).unwrap();
    assert_eq!(one.actions, two.actions);
    assert_eq!(one.score, two.score);
    assert_eq!(one.trace.evaluations, two.trace.evaluations);
    assert_eq!(one.trace.stages, two.trace.stages);
    assert_eq!(one.trace.best, two.trace.best);
}

#[test]
fn untying_the_blocks_improves_on_one_plan_per_class_and_each_level_only_improves() {
    let p = slow_link(data("tinygpt-255"), 1.0);
    let g = p.graph().unwrap();
    let budget = budget_at(&p, 0.3);
    let opts = EvalOptions::default();
    let r = search(&g, budget, &opts, &small(Some(true), 0, &p), |_, _| {}).unwrap();
    let phases = &r.trace.phases;
    // The tied space first (swarm, polish, restarts, relinking), then one polish per level to
    // the space of all units.
    assert!(phases.iter().all(|ph| ph.name.starts_with("blocks:")));
    let levels: Vec<&str> = phases.iter().map(|ph| ph.name.as_str()).filter(|n| n.contains(" dims")).collect();
    assert_eq!(levels.last().copied(), Some("blocks:polish 255 dims"), "{levels:?}");
    let bests: Vec<f64> = phases.iter().map(|ph| ph.best.expect("feasible")).collect();
    assert!(bests.windows(2).all(|w| w[1] <= w[0]), "{bests:?}");
    let tied = phases.iter().filter(|ph| !ph.name.contains(" dims")).last().unwrap().best.unwrap();
    assert!(r.score.time < tied * 0.99, "one plan per class {tied}, untied {}", r.score.time);
    // The result is what the evaluator says, within the budget.
    let full = score(&g, &r.actions, budget, &opts, &mut Scratch::new(g.n));
    assert_eq!(full, r.score);
    assert!(full.feasible);
}

#[test]
fn block_wise_is_never_worse_than_its_seeds() {
    // The seed is a plan over every unit (a search's), not a plan of the tied space; a search too
    // small to find anything as good from its tied projection returns the seed.
    let p = slow_link(data("tinygpt-255"), 1.0);
    let g = p.graph().unwrap();
    let budget = budget_at(&p, 0.3);
    let opts = EvalOptions::default();
    let seed = search(&g, budget, &opts, &small(Some(false), 0, &p), |_, _| {}).unwrap();
    let tied = &tensorplace_core::blockwise::levels(g.n, &repeated_block_classes(&p))[0];
    assert!(!tied.contains(&seed.actions), "the seed is not a plan of one plan per class");
    let tiny = PsoSettings { particles: 2, iterations: 1, polish: false, seed_extremes: false, ..small(Some(true), 0, &p) };
    let without = search(&g, budget, &opts, &PsoSettings { seeds: vec![], ..tiny.clone() }, |_, _| {}).unwrap();
    assert!(seed.score.better_than(&without.score), "seed {:?}, tiny search {:?}", seed.score, without.score);
    let with = search(&g, budget, &opts, &PsoSettings { seeds: vec![seed.actions.clone()], ..tiny }, |_, _| {}).unwrap();
    assert_eq!(with.score, seed.score);
    assert_eq!(with.actions, seed.actions);
}

#[test]
fn the_default_searches_block_wise_above_400_units_with_repeated_blocks() {
    let fast = PlanSettings { pso: PsoSettings { particles: 20, iterations: 5, ..Default::default() }, ..Default::default() };
    for (p, expect) in [(data("tinygpt-505"), true), (data("tinygpt-255"), false), (bundled("vgg16"), false)] {
        let budget = budget_at(&p, 0.3);
        let plan = make_plan(&p, budget, "pso", &fast, |_, _| {}).unwrap();
        assert_eq!(plan.settings["block_wise_searched"], expect, "{} units", p.units.len());
        let names: Vec<String> = plan.convergence.as_ref().unwrap()["phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ph| ph["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names.iter().all(|n| n.starts_with("blocks:")), expect, "{names:?}");
    }
}

#[test]
fn the_search_stops_at_a_plan_as_fast_as_its_stage_times() {
    // TinyGPT at 30%: swapping hides every copy, so a plan with no stall and no replay fits, and
    // no plan is faster; the swarm stops there and nothing after it is run.
    for name in ["tinygpt-255", "tinygpt-1005"] {
        let p = data(name);
        let g = p.graph().unwrap();
        let budget = budget_at(&p, 0.3);
        let opts = EvalOptions::default();
        let settings = PsoSettings { blocks: repeated_block_classes(&p), block_wise: Some(true), ..Default::default() };
        let r = search(&g, budget, &opts, &settings, |_, _| {}).unwrap();
        let ctx = Context::new(&g, budget, &opts);
        assert!(ctx.is_optimal(&r.score), "{name}: {:?}", r.score);
        let compute: f64 = g.fwd_time.iter().sum::<f64>() + g.bwd_time.iter().sum::<f64>();
        assert!((r.score.time - compute).abs() <= 1e-9 * compute);
        // After the first phase that reached it, only tidies (swaps undone at no cost).
        let phases = &r.trace.phases;
        let k = phases.iter().position(|ph| ph.best.is_some_and(|b| b <= r.score.time)).unwrap();
        assert!(phases[k + 1..].iter().all(|ph| ph.name.contains("tidy")), "{name}: {phases:?}");
        if k == 0 {
            assert!(r.trace.best.len() < settings.iterations, "{name}: the swarm stopped early");
        }
    }
    // On a slow link it does not stop: the swarm runs every iteration.
    let p = slow_link(data("tinygpt-255"), 1.0);
    let g = p.graph().unwrap();
    let settings = PsoSettings { iterations: 15, ..small(Some(true), 0, &p) };
    let r = search(&g, budget_at(&p, 0.3), &EvalOptions::default(), &settings, |_, _| {}).unwrap();
    assert_eq!(r.trace.best.len(), 15);
}
