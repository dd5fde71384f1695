#![allow(dead_code)]
use tensorplace_core::profile::{ConstantMemory, Measured, Profile, Unit, PROFILE_FORMAT, PROFILE_VERSION};

/// A unit reading `inputs`, whose activation is its output (saved by itself and its consumers).
pub fn unit(name: &str, inputs: &[i64], fwd: f64, bwd: f64, act: i64) -> Unit {
    Unit {
        name: name.into(),
        kind: "other".into(),
        inputs: inputs.to_vec(),
        model_inputs: vec![],
        fwd_time: fwd,
        bwd_time: bwd,
        act_bytes: act,
        output_bytes: act,
        output_saved: true,
        read_by: vec![],
        held_input_bytes: 0,
        saved_inputs: None,
        fwd_transient_bytes: 0,
        bwd_transient_bytes: 0,
        grad_bytes: 0,
        replay_transient_bytes: None,
        lingering_bytes: None,
        lingering_until: None,
        lingering_values: None,
        forward_held_until: None,
        held_from: None,
        saved_from: None,
        param_bytes: None,
        optimizer_state_bytes: None,
        optimizer_time: None,
        optimizer_transient_bytes: None,
        random: false,
        recomputable: None,
        packs: None,
        act_storages: None,
        glue_ops: None,
        glue_scope: None,
        fwd_host_time: None,
        bwd_host_time: None,
        fwd_large_allocs: None,
        bwd_large_allocs: None,
        replay_large_allocs: None,
        loss_transient_bytes: None,
        bwd_replay_bytes: None,
        replay_slack_bytes: None,
        held_values: None,
        saved_values: None,
    }
}

/// Fill read_by: a unit's activations are read by its own backward and its consumers'.
pub fn wire(mut units: Vec<Unit>) -> Vec<Unit> {
    let n = units.len();
    for i in 0..n {
        units[i].read_by = vec![i as i64];
    }
    for i in 0..n {
        let ins = units[i].inputs.clone();
        for p in ins {
            units[p as usize].read_by.push(i as i64);
        }
    }
    units
}

pub fn profile(units: Vec<Unit>, constant: u64, bw: f64) -> Profile {
    Profile {
        format: PROFILE_FORMAT.into(),
        version: PROFILE_VERSION,
        model: "test".into(),
        device: "test".into(),
        batch_size: None,
        memory: ConstantMemory { parameters: constant, ..Default::default() },
        d2h_bandwidth: bw,
        h2d_bandwidth: bw,
        measured: Measured::default(),
        copy_engines: None,
        environment: None,
        optimizer: None,
        rng_state_bytes: None,
        executor: None,
        units,
    }
}

/// A chain of `n` units, unit i with forward time f[i], backward 2 f[i], activation a[i].
pub fn chain(f: &[f64], a: &[i64], constant: u64, bw: f64) -> Profile {
    let units: Vec<Unit> = (0..f.len())
        .map(|i| {
            let ins: Vec<i64> = if i == 0 { vec![] } else { vec![i as i64 - 1] };
            unit(&format!("u{i}"), &ins, f[i], 2.0 * f[i], a[i])
        })
        .collect();
    profile(wire(units), constant, bw)
}

/// A builtin profile (python/tensorplace/examples, batch 32).
pub fn bundled(name: &str) -> Profile {
    let path = format!("{}/../python/tensorplace/examples/{name}.json", env!("CARGO_MANIFEST_DIR"));
    Profile::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The budget `frac` of the way from the lower bound to the unplanned peak.
pub fn budget_at(p: &Profile, frac: f64) -> u64 {
    let g = p.graph().unwrap();
    let (lb, _) = tensorplace_core::peak::lower_bound(&g);
    let up = tensorplace_core::peak::unplanned_peak(&g);
    lb + ((up - lb) as f64 * frac) as u64
}

/// A random DAG profile of 1 to `max_units` units (as tests/profiles.py's `dag_profiles`, in
/// Rust): inputs among earlier units, saved or unsaved outputs, readers in the backward, held
/// inputs split by producer (`held_from`), saved values of inputs (`saved_from`), lingering
/// bytes, transients, one or two copy engines, sometimes an optimizer step, and units named as
/// repeated blocks (default segment starts) half the time.
pub fn random_profile(rng: &mut rand_chacha::ChaCha8Rng, max_units: usize) -> Profile {
    use rand::Rng;
    let n = rng.gen_range(1..=max_units);
    let block = [0usize, 2, 3][rng.gen_range(0..3)];
    let mut units: Vec<Unit> = Vec::with_capacity(n);
    for i in 0..n {
        let mut inputs: Vec<i64> = Vec::new();
        if i > 0 {
            if rng.gen_bool(0.7) {
                inputs.push(i as i64 - 1);
            }
            for _ in 0..rng.gen_range(0..=2) {
                inputs.push(rng.gen_range(0..i) as i64);
            }
            inputs.sort();
            inputs.dedup();
        }
        let out: i64 = rng.gen_range(0..=1000);
        let saved = rng.gen_bool(0.6);
        let act = if saved { out } else { 0 } + rng.gen_range(0..=300);
        let name = if block > 0 { format!("b{}.u{}", i / block, i % block) } else { format!("u{i}") };
        let mut u = unit(&name, &inputs, rng.gen_range(0.0..2.0), rng.gen_range(0.0..4.0), act);
        u.kind = if block > 0 { format!("k{}", i % block) } else { "other".into() };
        u.model_inputs = if inputs.is_empty() { vec![0] } else { vec![] };
        u.output_bytes = out;
        u.output_saved = saved;
        u.held_input_bytes = rng.gen_range(0..=200);
        u.fwd_transient_bytes = rng.gen_range(0..=300);
        u.bwd_transient_bytes = rng.gen_range(0..=300);
        u.grad_bytes = rng.gen_range(0..=100);
        if rng.gen_bool(0.3) {
            u.replay_transient_bytes = Some(rng.gen_range(0..=300));
        }
        if act > 0 && rng.gen_bool(0.2) {
            u.lingering_bytes = Some(rng.gen_range(0..=act));
            u.lingering_until = Some(rng.gen_range(i..=n) as i64);
        }
        units.push(u);
    }
    // Readers: itself (usually) and consumers (sometimes); a unit with activations has one.
    for i in 0..n {
        let mut readers: Vec<i64> = Vec::new();
        if rng.gen_bool(0.5) || units[i].inputs.is_empty() {
            readers.push(i as i64);
        }
        for c in i + 1..n {
            if units[c].inputs.contains(&(i as i64)) && rng.gen_bool(0.5) {
                readers.push(c as i64);
            }
        }
        if units[i].act_bytes > 0 && readers.is_empty() {
            readers.push(i as i64);
        }
        units[i].read_by = readers;
    }
    for i in 0..n {
        let mut left = units[i].held_input_bytes;
        let mut held_from = Vec::new();
        for &p in &units[i].inputs.clone() {
            let pu = &units[p as usize];
            if !pu.output_saved && left > 0 && rng.gen_bool(0.5) {
                let b = rng.gen_range(0..=left);
                held_from.push([p, b]);
                left -= b;
            }
        }
        units[i].held_from = Some(held_from);
        let saved_from: Vec<[i64; 2]> = units[i]
            .inputs
            .iter()
            .filter(|&&p| units[p as usize].read_by.contains(&(i as i64)))
            .map(|&p| {
                let pu = &units[p as usize];
                [p, if pu.output_saved { pu.output_bytes.min(pu.act_bytes) } else { pu.act_bytes }]
            })
            .collect();
        units[i].saved_from = Some(saved_from);
    }
    // Where a replay runs in its stage (every third unit), and values named by id (every other
    // profile: one id per producer's unsaved output and one per its saved values), without
    // drawing from the generator.
    for (i, u) in units.iter_mut().enumerate() {
        if i % 3 == 1 {
            u.bwd_replay_bytes = Some(u.bwd_transient_bytes / 2);
        }
        if n % 2 == 0 {
            u.held_values = u.held_from.as_ref().map(|hf| hf.iter().map(|&[p, b]| [p, 2 * p, b]).collect());
            u.saved_values = u.saved_from.as_ref().map(|sf| sf.iter().map(|&[p, b]| [p, 2 * p + 1, b]).collect());
        }
    }
    let bw = rng.gen_range(10.0..10000.0);
    let mut p = profile(units, rng.gen_range(0..=1000), bw);
    p.h2d_bandwidth = bw * rng.gen_range(0.5..2.0);
    p.copy_engines = Some(rng.gen_range(1..=2));
    if rng.gen_bool(0.3) {
        p.optimizer = Some(tensorplace_core::profile::OptimizerStep {
            name: "sgd".into(),
            step_time: rng.gen_range(0.0..2.0),
            transient_bytes: rng.gen_range(0..=500),
            ..Default::default()
        });
    }
    p
}
