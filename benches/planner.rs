//! Planner speed on the builtin example profiles (python/tensorplace/examples/*.json):
//! the evaluator per call and per stage, and the HOME search (500 particles x 500 iterations);
//! and the search's time per unit count on the TinyGPT profiles of 255 to 2,005 units
//! (rust_core/tests/data, made by benches/tinygpt_profiles.py).
//!
//! `cargo bench --bench planner` runs everything; `cargo bench --bench planner -- evaluator`
//! only the evaluator, `-- search_units` only the search per unit count. The full search is also
//! timed once per profile, with the iteration at which it got within 1% of its final best, and
//! printed as a table; so is the search per unit count, with the growth exponent of its time.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tensorplace_core::evaluator::{score, EvalOptions, Scratch};
use tensorplace_core::peak::{lower_bound, unplanned_peak};
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::pso::{search, PsoSettings};
use tensorplace_core::{Action, Graph, Profile};

const MODELS: [&str; 7] = ["plain20", "vgg16", "squeezenet", "mobilenet_v1", "mobilenet_v2", "resnet50", "inception_v3"];

fn load(name: &str) -> Graph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../python/tensorplace/examples/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Profile::from_json(&text).unwrap().graph().unwrap()
}

/// The budget the benches plan for: halfway between the lower bound and the unplanned peak.
fn budget(g: &Graph) -> u64 {
    (lower_bound(g).0 + unplanned_peak(g)) / 2
}

/// A fixed mixed plan: unit i gets action i mod 3.
fn mixed(n: usize) -> Vec<Action> {
    (0..n).map(|i| Action::ALL[i % 3]).collect()
}

fn evaluator(c: &mut Criterion) {
    let mut group = c.benchmark_group("evaluator");
    for name in MODELS {
        let g = load(name);
        let plan = mixed(g.n);
        let b = budget(&g);
        let opts = EvalOptions::default();
        let mut scratch = Scratch::new(g.n);
        group.bench_with_input(BenchmarkId::new(name, g.n), &g, |bench, g| {
            bench.iter(|| score(black_box(g), black_box(&plan), b, &opts, &mut scratch))
        });
    }
    group.finish();
}

/// The reserved peak of the same plans: the allocation sequence (a recorded evaluation) simulated
/// under the default caching allocator, what one evaluation would cost a search on reserved bytes.
fn reserved(c: &mut Criterion) {
    let mut group = c.benchmark_group("reserved_peak");
    for name in MODELS {
        let g = load(name);
        let plan = mixed(g.n);
        let b = budget(&g);
        let opts = EvalOptions::default();
        let conf = tensorplace_core::allocator::AllocConf::default();
        group.bench_with_input(BenchmarkId::new(name, g.n), &g, |bench, g| {
            bench.iter(|| {
                tensorplace_core::alloc_sequence::reserved_peak(black_box(g), black_box(&plan), &g.block_start, b, &opts, &conf)
                    .unwrap()
                    .1
                    .max_reserved
            })
        });
    }
    group.finish();
}

fn full_search(c: &mut Criterion) {
    let mut group = c.benchmark_group("search_500x500");
    group.sample_size(10).measurement_time(Duration::from_secs(60)).warm_up_time(Duration::from_secs(1));
    println!("\nfull search, 500 particles x 500 iterations, all cores, seed 0:");
    println!("{:<14} {:>6} {:>10} {:>12} {:>14} {:>12}", "model", "units", "search_s", "evaluations", "within_1%_iter", "within_1%_s");
    for name in MODELS {
        let g = load(name);
        let b = budget(&g);
        let opts = EvalOptions::default();
        let settings = PsoSettings::default();
        let t = Instant::now();
        let r = search(&g, b, &opts, &settings, |_, _| {}).unwrap();
        let total = t.elapsed().as_secs_f64();
        let fin = r.score.time;
        let k = r.trace.best.iter().position(|x| x.map_or(false, |v| v <= fin * 1.01)).unwrap_or(0);
        println!(
            "{:<14} {:>6} {:>10.2} {:>12} {:>14} {:>12.2}",
            name, g.n, total, r.trace.evaluations, k, r.trace.elapsed[k]
        );
        if name == "inception_v3" || name == "resnet50" {
            group.bench_function(BenchmarkId::new(name, g.n), |bench| {
                bench.iter(|| search(black_box(&g), b, &opts, &settings, |_, _| {}).unwrap())
            });
        }
    }
    group.finish();
}

/// The TinyGPT profiles of rust_core/tests/data (width 16, 1 x 16 tokens; 10 units per layer
/// plus 5).
const TINYGPT_UNITS: [usize; 4] = [255, 505, 1005, 2005];

fn tinygpt(units: usize) -> Profile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/tinygpt-{units}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Profile::from_json(&text).unwrap()
}

/// The budget of issue 21's measurements: 30% of the way from the lower bound to the unplanned
/// peak.
fn budget_30(g: &Graph) -> u64 {
    let (lb, up) = (lower_bound(g).0, unplanned_peak(g));
    lb + (up - lb) * 3 / 10
}

/// `tp.plan_profile(profile, budget, "pso")` with the default settings, per unit count: printed
/// once per profile (time, evaluations, simulated stages, predicted step) with the growth exponent
/// of the time (least squares of log time on log units), then measured by criterion (up to 1,005
/// units; 2,005 only in the table).
fn search_units(c: &mut Criterion) {
    println!("\nsearch per unit count, TinyGPT, budget 30% from the lower bound to the unplanned peak, default settings, all cores:");
    println!("{:>6} {:>10} {:>12} {:>14} {:>14}", "units", "search_s", "evaluations", "stages", "step_s");
    let settings = PlanSettings::default();
    let mut points = Vec::new();
    for units in TINYGPT_UNITS {
        let p = tinygpt(units);
        let b = budget_30(&p.graph().unwrap());
        let t = Instant::now();
        let plan = make_plan(&p, b, "pso", &settings, |_, _| {}).unwrap();
        let secs = t.elapsed().as_secs_f64();
        let conv = plan.convergence.as_ref().unwrap();
        println!("{units:>6} {secs:>10.2} {:>12} {:>14} {:>14.6}", conv["evaluations"], conv["stages"], plan.predicted.step_time);
        points.push(((units as f64).ln(), secs.ln()));
    }
    let k = points.len() as f64;
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / k, points.iter().map(|p| p.1).sum::<f64>() / k);
    let slope = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / points.iter().map(|p| (p.0 - mx).powi(2)).sum::<f64>();
    println!("search time ~ units^{slope:.2}");
    let mut group = c.benchmark_group("search_units");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(20));
    for units in TINYGPT_UNITS.into_iter().filter(|&u| u <= 1005) {
        let p = tinygpt(units);
        let b = budget_30(&p.graph().unwrap());
        group.bench_function(BenchmarkId::new("tinygpt", units), |bench| {
            bench.iter(|| make_plan(black_box(&p), b, "pso", &settings, |_, _| {}).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, evaluator, reserved, full_search, search_units);
criterion_main!(benches);
