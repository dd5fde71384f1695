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
        held_from: None,
        saved_from: None,
        param_bytes: None,
        optimizer_state_bytes: None,
        optimizer_time: None,
        optimizer_transient_bytes: None,
        random: false,
        packs: None,
        act_storages: None,
        glue_ops: None,
        glue_scope: None,
        fwd_host_time: None,
        bwd_host_time: None,
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
