//! A plan's memory over its step: after every event of its allocation sequence
//! ([`crate::alloc_sequence`]), when the event happens, the bytes allocated (the evaluator's
//! memory count, constant memory included) and the bytes the simulated allocator has reserved.
//! `tensorplace-bench timeline` draws it.
//!
//! Reserved is at least allocated at every point (the simulator rounds blocks up), the largest
//! reserved is the simulation's `max_reserved` and the largest allocated the evaluation's
//! `peak_bytes`.

use crate::alloc_sequence::Sequence;
use crate::allocator::{AllocConf, AllocStats};
use crate::error::Result;
use serde::Serialize;

/// The memory after one event (or, for the first point, at the step's start).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryPoint {
    /// Seconds from the step's start.
    pub time: f64,
    pub allocated: u64,
    pub reserved: u64,
}

/// The curve of `seq` simulated under `conf`: a point at time 0 (the constant memory, all of it
/// reserved) and one per event, with the simulation's stats (without their `timeline`).
pub fn memory_curve(seq: &Sequence, conf: &AllocConf) -> Result<(AllocStats, Vec<MemoryPoint>)> {
    let mut stats = seq.simulate(&AllocConf { record_timeline: true, ..conf.clone() })?;
    let timeline = std::mem::take(&mut stats.timeline);
    let start = MemoryPoint { time: 0.0, allocated: seq.constant, reserved: seq.constant };
    let after = seq
        .times
        .iter()
        .zip(seq.requested())
        .zip(timeline)
        .map(|((&time, allocated), (_, reserved))| MemoryPoint { time, allocated, reserved });
    Ok((stats, std::iter::once(start).chain(after).collect()))
}
