//! The allocator simulators: PyTorch's caching allocator rules one by one, moDNN's offset pool,
//! trace reading and errors.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tensorplace_core::allocator::caching::{allocation_size, round_size};
use tensorplace_core::allocator::trace::{replay, Trace};
use tensorplace_core::allocator::{simulate, AllocConf, AllocEvent, AllocStats, Initial, InitialFree, Model};
use tensorplace_core::CoreError;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn alloc(id: u64, size: u64) -> AllocEvent {
    AllocEvent::Alloc { id, size, stream: 0 }
}
fn alloc_on(id: u64, size: u64, stream: u64) -> AllocEvent {
    AllocEvent::Alloc { id, size, stream }
}
fn free(id: u64) -> AllocEvent {
    AllocEvent::Free { id }
}

fn run(events: &[AllocEvent]) -> AllocStats {
    run_with(events, "")
}

fn run_with(events: &[AllocEvent], alloc_conf: &str) -> AllocStats {
    let mut conf = AllocConf::from_alloc_conf(alloc_conf).unwrap();
    conf.check_merged = true;
    conf.record_timeline = true;
    simulate(events, &conf).unwrap()
}

#[test]
fn sizes_round_to_512_bytes_or_power_of_two_divisions() {
    assert_eq!(round_size(1, 0), 512);
    assert_eq!(round_size(512, 0), 512);
    assert_eq!(round_size(513, 0), 1024);
    assert_eq!(round_size(3 * MIB + 1, 0), 3 * MIB + 512);
    // 4 divisions between 4096 and 8192: 4096, 5120, 6144, 7168
    assert_eq!(round_size(5000, 4), 5120);
    assert_eq!(round_size(4096, 4), 4096);
    // at most 512 * divisions bytes: plain rounding
    assert_eq!(round_size(1500, 4), 1536);
}

#[test]
fn segment_sizes_follow_the_pools() {
    assert_eq!(allocation_size(512), 2 * MIB);
    assert_eq!(allocation_size(MIB), 2 * MIB);
    assert_eq!(allocation_size(MIB + 512), 20 * MIB);
    assert_eq!(allocation_size(10 * MIB - 512), 20 * MIB);
    assert_eq!(allocation_size(10 * MIB), 10 * MIB);
    assert_eq!(allocation_size(11 * MIB + 512), 12 * MIB);
}

#[test]
fn small_requests_share_a_2_mib_segment() {
    let s = run(&[alloc(1, 1000), alloc(2, 100 * KIB), alloc(3, MIB)]);
    assert_eq!(s.max_reserved, 2 * MIB);
    assert_eq!(s.device_allocs, 1);
    assert_eq!(s.max_allocated, 1024 + 100 * KIB + MIB);
    // a fourth that no longer fits takes a second small segment
    let s = run(&[alloc(1, MIB), alloc(2, MIB), alloc(3, 512)]);
    assert_eq!(s.max_reserved, 4 * MIB);
}

#[test]
fn mid_size_requests_share_a_20_mib_segment_and_large_ones_get_their_own() {
    let s = run(&[alloc(1, 5 * MIB), alloc(2, 5 * MIB), alloc(3, 9 * MIB)]);
    assert_eq!(s.max_reserved, 20 * MIB);
    assert_eq!(s.segments, 1);
    let s = run(&[alloc(1, 5 * MIB), alloc(2, 30 * MIB + 1)]);
    assert_eq!(s.max_reserved, 20 * MIB + 32 * MIB);
    assert_eq!(s.segments, 2);
}

#[test]
fn large_pool_splits_only_remainders_above_1_mib() {
    // a 12 MiB cached block; 11 MiB leaves 1 MiB: not split, the whole block is allocated
    let s = run(&[alloc(1, 12 * MIB), free(1), alloc(2, 11 * MIB)]);
    assert_eq!(s.allocated, 12 * MIB);
    // 10.5 MiB leaves 1.5 MiB: split
    let s = run(&[alloc(1, 12 * MIB), free(1), alloc(2, 10 * MIB + 512 * KIB)]);
    assert_eq!(s.allocated, 10 * MIB + 512 * KIB);
    assert_eq!(s.max_reserved, 12 * MIB);
}

#[test]
fn small_pool_splits_remainders_of_512_bytes() {
    let s = run(&[alloc(1, 2 * KIB), free(1), alloc(2, 1536)]);
    assert_eq!(s.allocated, 1536);
    assert_eq!(s.max_reserved, 2 * MIB);
}

#[test]
fn best_fit_takes_the_smallest_block_that_fits() {
    // cached: 30 MiB and 24 MiB blocks; 23.5 MiB fits both. Best fit takes 24 MiB and does not
    // split it (0.5 MiB left), so all 24 MiB count as allocated.
    let s = run(&[alloc(1, 30 * MIB), alloc(2, 24 * MIB), free(1), free(2), alloc(3, 23 * MIB + 512 * KIB)]);
    assert_eq!(s.allocated, 24 * MIB);
    assert_eq!(s.max_reserved, 54 * MIB);
}

#[test]
fn freed_neighbours_merge_into_one_block() {
    let events = [alloc(1, 5 * MIB), alloc(2, 5 * MIB), alloc(3, 5 * MIB), free(1), free(3), free(2)];
    let s = run(&events);
    assert_eq!(s.unmerged_free_pairs, 0);
    assert_eq!(s.free_blocks, 1);
    assert_eq!(s.allocated, 0);
    assert_eq!(s.reserved_after_release, 0);
    // the merged 20 MiB block serves a 19 MiB request without a new segment
    let mut more = events.to_vec();
    more.push(alloc(4, 19 * MIB));
    assert_eq!(run(&more).max_reserved, 20 * MIB);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let conf = "max_split_size_mb:64";
    // a cached 100 MiB block is not handed to a 30 MiB request
    let s = run_with(&[alloc(1, 100 * MIB), free(1), alloc(2, 30 * MIB)], conf);
    assert_eq!(s.max_reserved, 130 * MIB);
    // a 90 MiB request takes it whole (less than 20 MiB larger) without splitting
    let s = run_with(&[alloc(1, 100 * MIB), free(1), alloc(2, 90 * MIB)], conf);
    assert_eq!(s.max_reserved, 100 * MIB);
    assert_eq!(s.allocated, 100 * MIB);
    // but not one of 70 MiB (30 MiB larger than the request)
    let s = run_with(&[alloc(1, 100 * MIB), free(1), alloc(2, 70 * MIB)], conf);
    assert_eq!(s.max_reserved, 170 * MIB);
    // without the limit the 30 MiB request splits the cached block
    let s = run(&[alloc(1, 100 * MIB), free(1), alloc(2, 30 * MIB)]);
    assert_eq!(s.max_reserved, 100 * MIB);
}

#[test]
fn streams_have_their_own_free_blocks() {
    let s = run(&[alloc_on(1, 40 * MIB, 7), free(1), alloc_on(2, 40 * MIB, 8)]);
    assert_eq!(s.max_reserved, 80 * MIB);
    let s = run(&[alloc_on(1, 40 * MIB, 7), free(1), alloc_on(2, 40 * MIB, 7)]);
    assert_eq!(s.max_reserved, 40 * MIB);
}

#[test]
fn expandable_segments_grow_by_pages() {
    let conf = "expandable_segments:True";
    // 30 MiB maps two 20 MiB pages; the next 30 MiB uses the 10 MiB left and one more page
    let s = run_with(&[alloc(1, 30 * MIB), alloc(2, 30 * MIB)], conf);
    assert_eq!(s.max_reserved, 60 * MIB);
    assert_eq!(s.segments, 1);
    assert_eq!(s.device_allocs, 2);
    assert_eq!(s.timeline[0], (30 * MIB, 40 * MIB));
    // small requests map 2 MiB pages of their own segment
    let s = run_with(&[alloc(1, 30 * MIB), alloc(2, 4 * KIB)], conf);
    assert_eq!(s.max_reserved, 42 * MIB);
    assert_eq!(s.segments, 2);
    // any remainder of at least 512 bytes is split, also in the large pool
    let s = run_with(&[alloc(1, 12 * MIB), free(1), alloc(2, 11 * MIB + 512 * KIB)], conf);
    assert_eq!(s.allocated, 11 * MIB + 512 * KIB);
    // freeing everything merges the segment back into one block; releasing unmaps it all
    let s = run_with(&[alloc(1, 30 * MIB), alloc(2, 30 * MIB), free(1), free(2)], conf);
    assert_eq!(s.unmerged_free_pairs, 0);
    assert_eq!(s.reserved_after_release, 0);
}

#[test]
fn capacity_releases_cached_segments_and_counts_what_still_does_not_fit() {
    let mut conf = AllocConf { capacity: Some(250 * MIB), check_merged: true, ..Default::default() };
    let s = simulate(&[alloc(1, 100 * MIB), free(1), alloc(2, 200 * MIB)], &conf).unwrap();
    assert_eq!(s.alloc_retries, 1);
    assert_eq!(s.ooms, 0);
    assert_eq!(s.device_frees, 1);
    assert_eq!(s.max_reserved, 200 * MIB);
    conf.capacity = Some(150 * MIB);
    let s = simulate(&[alloc(1, 100 * MIB), alloc(2, 100 * MIB)], &conf).unwrap();
    assert_eq!(s.ooms, 1);
    assert_eq!(s.max_reserved, 200 * MIB);
}

#[test]
fn initial_memory_counts_and_its_free_part_is_used() {
    let conf = AllocConf { initial: Initial { allocated: 30 * MIB, reserved: 100 * MIB, free_blocks: vec![] }, ..Default::default() };
    let s = simulate(&[alloc(1, 60 * MIB), free(1)], &conf).unwrap();
    assert_eq!(s.max_reserved, 100 * MIB);
    assert_eq!(s.max_allocated, 90 * MIB);
    assert_eq!(s.allocated, 30 * MIB);
    // listed free blocks: only they are usable, and the held rest is not released
    let conf = AllocConf {
        initial: Initial {
            allocated: 30 * MIB,
            reserved: 100 * MIB,
            free_blocks: vec![InitialFree { size: 40 * MIB, small: false, stream: 0, addr: None, grows: false }],
        },
        ..Default::default()
    };
    let s = simulate(&[alloc(1, 40 * MIB)], &conf).unwrap();
    assert_eq!(s.max_reserved, 100 * MIB);
    let s = simulate(&[alloc(1, 50 * MIB), free(1)], &conf).unwrap();
    assert_eq!(s.max_reserved, 150 * MIB);
    assert_eq!(s.reserved_after_release, 100 * MIB);
}

#[test]
fn offset_pool_prefers_an_exact_fit() {
    let conf = AllocConf { model: Model::OffsetPool, check_merged: true, ..Default::default() };
    // [X 3][Y 1][Z 2][W 1]; free X and Z; 2 MiB takes Z exactly, then 3 MiB takes X: no growth
    let base = [alloc(1, 3 * MIB), alloc(2, MIB), alloc(3, 2 * MIB), alloc(4, MIB), free(1), free(3)];
    let mut ev = base.to_vec();
    ev.extend([alloc(5, 2 * MIB), alloc(6, 3 * MIB)]);
    let s = simulate(&ev, &conf).unwrap();
    assert_eq!(s.max_reserved, 7 * MIB);
    assert_eq!(s.device_allocs, 4);
}

#[test]
fn offset_pool_falls_back_to_first_fit_and_grows_at_the_top() {
    let conf = AllocConf { model: Model::OffsetPool, check_merged: true, ..Default::default() };
    // [A 4][L 1][B 3][L 1], A and B free; 2.5 MiB goes to A (first fit), so 4 MiB must grow the pool
    let ev = [
        alloc(1, 4 * MIB), alloc(2, MIB), alloc(3, 3 * MIB), alloc(4, MIB), free(1), free(3),
        alloc(5, 2 * MIB + 512 * KIB), alloc(6, 4 * MIB),
    ];
    let s = simulate(&ev, &conf).unwrap();
    assert_eq!(s.max_reserved, 13 * MIB);
    // a free block at the top is extended rather than left behind
    let ev = [alloc(1, MIB), alloc(2, 2 * MIB), free(2), alloc(3, 5 * MIB)];
    let s = simulate(&ev, &conf).unwrap();
    assert_eq!(s.max_reserved, 6 * MIB);
    assert_eq!(s.unmerged_free_pairs, 0);
}

#[test]
fn random_sequences_keep_the_invariants_in_both_models() {
    for model in [Model::Caching, Model::OffsetPool] {
        for alloc_conf in ["", "expandable_segments:True", "max_split_size_mb:32"] {
            for seed in 0..20u64 {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut live: Vec<u64> = Vec::new();
                let mut events = Vec::new();
                for id in 0..300u64 {
                    if !live.is_empty() && rng.gen_bool(0.45) {
                        let k = rng.gen_range(0..live.len());
                        events.push(free(live.swap_remove(k)));
                    }
                    let size = match rng.gen_range(0..3) {
                        0 => rng.gen_range(1..=MIB),
                        1 => rng.gen_range(MIB..10 * MIB),
                        _ => rng.gen_range(10 * MIB..80 * MIB),
                    };
                    events.push(alloc_on(id, size, rng.gen_range(0..2)));
                    live.push(id);
                }
                events.extend(live.iter().map(|&id| free(id)));
                let mut conf = AllocConf::from_alloc_conf(alloc_conf).unwrap();
                conf.model = model;
                conf.check_merged = true;
                conf.record_timeline = true;
                let s = simulate(&events, &conf).unwrap();
                assert!(s.timeline.iter().all(|&(a, r)| r >= a), "{model:?} {alloc_conf} seed {seed}");
                assert_eq!(s.unmerged_free_pairs, 0, "{model:?} {alloc_conf} seed {seed}");
                assert_eq!((s.allocated, s.live_blocks, s.reserved_after_release), (0, 0, 0));
                assert_eq!(simulate(&events, &conf).unwrap(), s, "replay is deterministic");
            }
        }
    }
}

#[test]
fn bad_events_say_what_is_wrong() {
    let conf = AllocConf::default();
    let e = simulate(&[free(9)], &conf).unwrap_err();
    assert!(matches!(&e, CoreError::InvalidTrace(m) if m.contains("event 0") && m.contains("not allocated")), "{e}");
    let e = simulate(&[alloc(1, 10), alloc(1, 10)], &conf).unwrap_err();
    assert!(e.to_string().contains("already allocated"), "{e}");
    let e = simulate(&[alloc(1, 0)], &conf).unwrap_err();
    assert!(e.to_string().contains("0 bytes"), "{e}");
    let e = simulate(&[AllocEvent::FreeCompleted { id: 3 }], &conf).unwrap_err();
    assert!(e.to_string().contains("free_requested"), "{e}");
    let e = AllocConf::from_alloc_conf("expandable_segments:Maybe").unwrap_err();
    assert!(e.to_string().contains("True or False"), "{e}");
    let e = AllocConf::from_alloc_conf("pinned_memory_magic:1").unwrap_err();
    assert!(e.to_string().contains("not modelled"), "{e}");
}

fn trace_json(events: &str, extra: &str) -> String {
    format!(
        r#"{{"format": "cuda-caching-allocator-trace", {extra} "alloc_conf": "", "at_start": {{"allocated": 0, "reserved": 0}},
           "max_allocated": 2097152, "max_reserved": 20971520, "events": [{events}]}}"#
    )
}

#[test]
fn traces_are_read_and_replayed() {
    let ev = r#"{"action": "segment_alloc", "addr": 4096000000, "size": 20971520, "stream": 0},
                {"action": "alloc", "addr": 4096000000, "size": 2097152, "stream": 0},
                {"action": "free_requested", "addr": 4096000000, "size": 2097152, "stream": 0},
                {"action": "free_completed", "addr": 4096000000, "size": 2097152, "stream": 0}"#;
    let t = Trace::from_json(&trace_json(ev, "")).unwrap();
    let r = replay(&t, None, |_| {}).unwrap();
    assert_eq!(r.stats.max_reserved, 20 * MIB);
    assert_eq!(r.stats.max_allocated, 2 * MIB);
    assert_eq!(r.recorded.device_allocs, 1);
    assert_eq!(r.reserved_error_pct, Some(0.0));
    // a free split in two halves with another event between them
    let ev2 = r#"{"action": "alloc", "addr": 1, "size": 12582912, "stream": 0},
                 {"action": "free_requested", "addr": 1, "size": 12582912, "stream": 0},
                 {"action": "alloc", "addr": 2, "size": 12582912, "stream": 0},
                 {"action": "free_completed", "addr": 1, "size": 12582912, "stream": 0}"#;
    let r = replay(&Trace::from_json(&trace_json(ev2, "")).unwrap(), None, |_| {}).unwrap();
    // the first block is still in use by another stream when the second is allocated, but its
    // bytes already left `allocated`
    assert_eq!(r.stats.max_reserved, 24 * MIB);
    assert_eq!(r.stats.max_allocated, 12 * MIB);
    assert_eq!(r.stats.free_blocks, 1);
}

#[test]
fn bad_traces_say_what_is_wrong() {
    let e = Trace::from_json(r#"{"format": "tensorplace.plan", "version": 1}"#).unwrap_err();
    assert!(e.to_string().contains("cuda-caching-allocator-trace"), "{e}");
    let e = Trace::from_json(&trace_json("", r#""version": 7,"#)).unwrap_err();
    assert!(e.to_string().contains("version 7"), "{e}");
    let t = Trace::from_json(&trace_json(r#"{"action": "teleport", "addr": 1, "size": 2}"#, "")).unwrap();
    let e = replay(&t, None, |_| {}).unwrap_err();
    assert!(e.to_string().contains("teleport"), "{e}");
    let t = Trace::from_json(&trace_json(r#"{"action": "free_requested", "addr": 5, "size": 2}"#, "")).unwrap();
    let e = replay(&t, None, |_| {}).unwrap_err();
    assert!(e.to_string().contains("not allocated") && e.to_string().contains("before the recording"), "{e}");
}

#[test]
fn recorded_traces_replay_to_their_peaks() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/gpu-traces");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("skipped: no recorded traces in {}", dir.display());
        return;
    };
    let mut n = 0;
    for path in entries.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "json")) {
        let t = Trace::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let r = replay(&t, None, |c| c.check_merged = true).unwrap();
        let (rec_res, rec_alloc) = (r.recorded.max_reserved.unwrap(), r.recorded.max_allocated.unwrap());
        assert!(r.stats.max_reserved.abs_diff(rec_res) * 100 <= rec_res, "{}: {:?}", path.display(), r);
        assert_eq!(r.stats.max_allocated, rec_alloc, "{}", path.display());
        assert_eq!(r.stats.unmerged_free_pairs, 0);
        n += 1;
    }
    assert!(n > 0, "no traces in {}", dir.display());
}
