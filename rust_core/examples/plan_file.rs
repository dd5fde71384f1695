//! Plan profile files with PSO and print one JSON line per (file, budget fraction): the predicted
//! step, planning time, evaluations, simulated stages and phases (a development tool).
//!
//! cargo run --release --example plan_file -- [--fractions 0.25,0.5,0.75] [--particles P]
//!     [--iterations I] [--seed S] [--polish-starts N] [--restarts N] [--relinks N]
//!     [--patience N (0: none)] [--block-wise on|off|auto] [--threads T] FILE...
//! FILE: a profile, or a plan file (its "profile"), or a builtin name (python/tensorplace/examples).
use std::time::Instant;
use tensorplace_core::planner::{make_plan, PlanSettings};
use tensorplace_core::Profile;

fn load(path: &str) -> Profile {
    let p = if std::path::Path::new(path).exists() {
        path.to_string()
    } else {
        format!("{}/../python/tensorplace/examples/{path}.json", env!("CARGO_MANIFEST_DIR"))
    };
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prof = if v.get("profile").is_some() { v["profile"].to_string() } else { text };
    Profile::from_json(&prof).unwrap()
}

/// User and system CPU seconds of this process so far (Linux: /proc/self/stat, 100 ticks/s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut fractions = vec![0.3];
    let mut s = PlanSettings::default();
    let mut files = Vec::new();
    let mut copy_ratio: Option<f64> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--fractions" => fractions = args.next().unwrap().split(',').map(|x| x.parse().unwrap()).collect(),
            "--particles" => s.pso.particles = args.next().unwrap().parse().unwrap(),
            "--iterations" => s.pso.iterations = args.next().unwrap().parse().unwrap(),
            "--threads" => s.pso.threads = args.next().unwrap().parse().unwrap(),
            "--polish-starts" => s.pso.polish_starts = args.next().unwrap().parse().unwrap(),
            "--restarts" => s.pso.restarts = args.next().unwrap().parse().unwrap(),
            "--relinks" => s.pso.relinks = args.next().unwrap().parse().unwrap(),
            "--seed" => s.pso.seed = args.next().unwrap().parse().unwrap(),
            "--patience" => s.pso.patience = args.next().unwrap().parse().ok().filter(|&p: &usize| p > 0),
            "--copy-ratio" => copy_ratio = Some(args.next().unwrap().parse().unwrap()),
            "--block-wise" => {
                s.pso.block_wise = match args.next().unwrap().as_str() {
                    "on" => Some(true),
                    "off" => Some(false),
                    _ => None,
                }
            }
            _ => files.push(a),
        }
    }
    for f in &files {
        let mut p = load(f);
        if let Some(r) = copy_ratio {
            // A slower link: copying every activation one way takes r x the compute time.
            let bytes: i64 = p.units.iter().map(|u| u.act_bytes).sum();
            let compute: f64 = p.units.iter().map(|u| u.fwd_time + u.bwd_time).sum();
            p.d2h_bandwidth = bytes as f64 / (r * compute);
            p.h2d_bandwidth = p.d2h_bandwidth;
        }
        let g = p.graph().unwrap();
        let lb = tensorplace_core::peak::lower_bound(&g).0;
        let up = tensorplace_core::peak::unplanned_peak(&g);
        for &frac in &fractions {
            let budget = lb + ((up - lb) as f64 * frac) as u64;
            let (t, c) = (Instant::now(), cpu_seconds());
            let plan = make_plan(&p, budget, "pso", &s, |_, _| {}).unwrap();
            let (secs, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - c);
            let conv = plan.convergence.as_ref().unwrap();
            let line = serde_json::json!({
                "file": f, "units": g.n, "copy_ratio": copy_ratio, "fraction": frac, "budget": budget, "seconds": secs, "cpu_seconds": cpu,
                "step_time": plan.predicted.step_time, "peak": plan.predicted.peak_bytes,
                "evaluations": conv["evaluations"], "stages": conv.get("stages"),
                "actions": plan.actions.iter().map(|a| match a { tensorplace_core::Action::Retain => '.', tensorplace_core::Action::Swap => 's', tensorplace_core::Action::Recompute => 'r' }).collect::<String>(),
                "phases": conv.get("phases"),
            });
            println!("{line}");
        }
    }
}
