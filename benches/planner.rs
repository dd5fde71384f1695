//! Planner speed on the builtin example profiles (python/tensorplace/examples/*.json):
//! the evaluator per call and per stage, and the HOME search (500 particles x 500 iterations).
//!
//! `cargo bench --bench planner` runs everything; `cargo bench --bench planner -- evaluator`
//! only the evaluator. The full search is also timed once per profile, with the iteration at
//! which it got within 1% of its final best, and printed as a table.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tensorplace_core::evaluator::{score, EvalOptions, Scratch};
use tensorplace_core::peak::{lower_bound, unplanned_peak};
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

criterion_group!(benches, evaluator, reserved, full_search);
criterion_main!(benches);
