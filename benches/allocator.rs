//! Allocator simulator speed in events per second: every recorded trace in ../shared/gpu-traces
//! (replayed through the caching model under its own settings, and through the offset pool),
//! and a synthetic 100,000-event sequence.
//!
//! `cargo bench --bench allocator`; criterion reports the throughput as elements (events) per
//! second. Traces are parsed once, outside the timed loop.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;
use tensorplace_core::allocator::trace::Trace;
use tensorplace_core::allocator::{simulate, AllocConf, AllocEvent, Model};

const MIB: u64 = 1 << 20;

fn traces() -> Vec<(String, Vec<AllocEvent>, AllocConf)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/gpu-traces");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("no traces in {}: only the synthetic sequence is timed", dir.display());
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "json")).collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let t = Trace::from_json(&std::fs::read_to_string(p).unwrap()).unwrap();
            let (events, _) = t.events().unwrap();
            let name = p.file_stem().unwrap().to_string_lossy().trim_start_matches("alloc-").to_string();
            (name, events, t.conf().unwrap())
        })
        .collect()
}

fn synthetic(n: usize) -> Vec<AllocEvent> {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let (mut live, mut events) = (Vec::new(), Vec::with_capacity(n));
    let mut id = 0u64;
    while events.len() < n {
        if !live.is_empty() && rng.gen_bool(0.5) {
            let k = rng.gen_range(0..live.len());
            events.push(AllocEvent::Free { id: live.swap_remove(k) });
        } else {
            let size = match rng.gen_range(0..3) {
                0 => rng.gen_range(1..=MIB),
                1 => rng.gen_range(MIB..10 * MIB),
                _ => rng.gen_range(10 * MIB..200 * MIB),
            };
            events.push(AllocEvent::Alloc { id, size, stream: 0 });
            live.push(id);
            id += 1;
        }
    }
    events
}

fn replay_traces(c: &mut Criterion) {
    let mut group = c.benchmark_group("allocator");
    for (name, events, conf) in traces() {
        group.throughput(Throughput::Elements(events.len() as u64));
        group.bench_with_input(BenchmarkId::new("caching", &name), &events, |b, ev| {
            b.iter(|| simulate(black_box(ev), &conf).unwrap().max_reserved)
        });
        let pool = AllocConf { model: Model::OffsetPool, ..conf.clone() };
        group.bench_with_input(BenchmarkId::new("offset-pool", &name), &events, |b, ev| {
            b.iter(|| simulate(black_box(ev), &pool).unwrap().max_reserved)
        });
    }
    let events = synthetic(100_000);
    group.throughput(Throughput::Elements(events.len() as u64));
    for (label, conf) in [
        ("caching", AllocConf::default()),
        ("caching-expandable", AllocConf::from_alloc_conf("expandable_segments:True").unwrap()),
        ("offset-pool", AllocConf { model: Model::OffsetPool, ..Default::default() }),
    ] {
        group.bench_with_input(BenchmarkId::new(label, "synthetic-100k"), &events, |b, ev| {
            b.iter(|| simulate(black_box(ev), &conf).unwrap().max_reserved)
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = replay_traces
}
criterion_main!(benches);
