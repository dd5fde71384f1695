//! The `cuda-caching-allocator-trace` JSON (docs/formats.md): one training step's allocator
//! events recorded with `torch.cuda.memory._record_memory_history`, with the allocator settings
//! and the memory held at the start, and its replay through a model.

use super::caching::{round_size, ROUND_LARGE, SMALL_SIZE};
use super::{simulate, AllocConf, AllocEvent, AllocStats, Initial, InitialFree, Model};
use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};

pub const TRACE_FORMAT: &str = "cuda-caching-allocator-trace";
pub const TRACE_VERSION: u64 = 1;

#[derive(Debug, Clone, Deserialize)]
pub struct TraceEvent {
    pub action: String,
    pub addr: u64,
    pub size: u64,
    #[serde(default)]
    pub stream: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Trace {
    #[serde(default)]
    pub alloc_conf: String,
    #[serde(default)]
    pub at_start: Initial,
    pub max_allocated: Option<u64>,
    pub max_reserved: Option<u64>,
    pub events: Vec<TraceEvent>,
}

/// What the recording says about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Recorded {
    pub max_allocated: Option<u64>,
    pub max_reserved: Option<u64>,
    /// segment_alloc and segment_map events (cudaMalloc calls or page mappings).
    pub device_allocs: u64,
    /// segment_free and segment_unmap events.
    pub device_frees: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Replay {
    pub alloc_conf: String,
    #[serde(flatten)]
    pub stats: AllocStats,
    pub recorded: Recorded,
    /// (simulated - recorded) / recorded, in percent (None without a recorded figure).
    pub reserved_error_pct: Option<f64>,
    pub allocated_error_pct: Option<f64>,
}

impl Trace {
    pub fn from_json(text: &str) -> Result<Trace> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| CoreError::Format(format!("allocator trace is not JSON: {e}")))?;
        let found = value.get("format").and_then(|v| v.as_str()).unwrap_or("");
        if found != TRACE_FORMAT {
            return Err(CoreError::Format(format!(
                "expected \"format\": \"{TRACE_FORMAT}\", found {found:?}; an allocator trace is written by \
                 recording torch.cuda.memory._record_memory_history (docs/formats.md)"
            )));
        }
        let version = value.get("version").map(|v| v.as_u64().unwrap_or(0)).unwrap_or(TRACE_VERSION);
        if version != TRACE_VERSION {
            return Err(CoreError::Format(format!(
                "allocator trace version {version} is not supported (this tensorplace reads version {TRACE_VERSION}, \
                 or a trace without a version); record it again or upgrade tensorplace"
            )));
        }
        serde_json::from_value(value).map_err(|e| CoreError::Format(format!("allocator trace: {e}")))
    }

    /// The allocation calls, and what the recording counts. The real allocator's own decisions
    /// (segment events) are not replayed; a block's recorded address is only its name.
    pub fn events(&self) -> Result<(Vec<AllocEvent>, Recorded)> {
        let mut out = Vec::with_capacity(self.events.len());
        let mut rec = Recorded { max_allocated: self.max_allocated, max_reserved: self.max_reserved, ..Default::default() };
        let mut i = 0;
        while i < self.events.len() {
            let e = &self.events[i];
            match e.action.as_str() {
                "alloc" => out.push(AllocEvent::Alloc { id: e.addr, size: e.size, stream: e.stream }),
                "free_requested" => {
                    let next = self.events.get(i + 1);
                    if next.is_some_and(|n| n.action == "free_completed" && n.addr == e.addr) {
                        out.push(AllocEvent::Free { id: e.addr });
                        i += 1;
                    } else {
                        out.push(AllocEvent::FreeRequested { id: e.addr });
                    }
                }
                "free_completed" => out.push(AllocEvent::FreeCompleted { id: e.addr }),
                "segment_alloc" | "segment_map" => rec.device_allocs += 1,
                "segment_free" | "segment_unmap" => rec.device_frees += 1,
                "oom" | "snapshot" | "user_defined" => {}
                other => {
                    return Err(CoreError::InvalidTrace(format!(
                        "trace event {i} has action {other:?}; known actions are alloc, free_requested, free_completed, \
                         segment_alloc, segment_free, segment_map, segment_unmap, oom, snapshot, user_defined"
                    )))
                }
            }
            i += 1;
        }
        Ok((out, rec))
    }

    /// The settings the trace was recorded under, with its starting memory (for a trace
    /// without expandable segments, with the free blocks inferred by [`Trace::initial_free_blocks`]).
    pub fn conf(&self) -> Result<AllocConf> {
        let mut conf = self.plain_conf()?;
        if conf.initial.free_blocks.is_empty() {
            let free = self.initial_free_blocks(conf.roundup_power2_divisions);
            let listed: u64 = free.iter().map(|f| f.size).sum();
            if listed + conf.initial.allocated <= conf.initial.reserved {
                conf.initial.free_blocks = free;
            }
            conf.segment_addresses = self
                .events
                .iter()
                .filter(|e| e.action == "segment_alloc")
                .map(|e| (e.size, e.addr))
                .collect();
        }
        Ok(conf)
    }

    /// The settings the trace was recorded under and its starting memory as `at_start` gives
    /// it, without anything inferred from recorded addresses.
    pub fn plain_conf(&self) -> Result<AllocConf> {
        let mut conf = AllocConf::from_alloc_conf(&self.alloc_conf)?;
        conf.initial = self.at_start.clone();
        Ok(conf)
    }

    /// The cached blocks held at the start that the recorded step used: the address ranges its
    /// allocations (rounded to block sizes) took outside every segment the recording allocated
    /// (or pages it mapped), merged where they touch, per pool and stream. A range that runs
    /// into pages mapped later is cut there and `grows` (the free end of an expandable
    /// segment); a large-pool range ending at most 1 MiB before a 2 MiB boundary is taken to
    /// reach it. The recording does not list the segments held at its start; this and
    /// `segment_addresses` are the only uses of recorded addresses beyond naming blocks.
    pub fn initial_free_blocks(&self, divisions: u64) -> Vec<InitialFree> {
        let mut segments: Vec<(u64, u64)> = self
            .events
            .iter()
            .filter(|e| e.action == "segment_alloc" || e.action == "segment_map")
            .map(|e| (e.addr, e.addr + e.size))
            .collect();
        segments.sort_unstable();
        let inside = |a: u64| {
            let k = segments.partition_point(|s| s.0 <= a);
            k > 0 && a < segments[k - 1].1
        };
        // (stream, start, end, small, grows)
        let mut ranges: Vec<(u64, u64, u64, bool, bool)> = self
            .events
            .iter()
            .filter(|e| e.action == "alloc" && !inside(e.addr))
            .map(|e| {
                let size = round_size(e.size, divisions);
                let mut end = e.addr + size;
                let k = segments.partition_point(|s| s.0 < end);
                let grows = k > 0 && segments[k - 1].0 > e.addr;
                if grows {
                    end = segments[segments.partition_point(|s| s.0 <= e.addr)].0;
                } else if size > SMALL_SIZE {
                    // Large-pool segments are whole 2 MiB at 2 MiB-aligned addresses; a tail up
                    // to the next 2 MiB boundary of at most 1 MiB cannot serve any large request
                    // and is not split off, so the allocation that leaves it counts it.
                    let aligned = end.div_ceil(ROUND_LARGE) * ROUND_LARGE;
                    if aligned - end <= SMALL_SIZE {
                        end = aligned;
                    }
                }
                (e.stream, e.addr, end, size <= SMALL_SIZE, grows)
            })
            .collect();
        ranges.sort_unstable_by_key(|r| (r.3, r.0, r.1));
        let mut merged: Vec<(u64, u64, u64, bool, bool)> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                Some(m) if m.3 == r.3 && m.0 == r.0 && r.1 <= m.2 => {
                    m.2 = m.2.max(r.2);
                    m.4 |= r.4;
                }
                _ => merged.push(r),
            }
        }
        merged
            .into_iter()
            .filter(|r| r.2 > r.1)
            .map(|(stream, a, b, small, grows)| InitialFree { size: b - a, small, stream, addr: Some(a), grows })
            .collect()
    }
}

fn error_pct(sim: u64, rec: Option<u64>) -> Option<f64> {
    rec.filter(|&r| r > 0).map(|r| (sim as f64 - r as f64) / r as f64 * 100.0)
}

/// Replay a trace. `model`: None takes the caching allocator (the trace's `alloc_conf` selects
/// its settings). `edit` may change the settings before the run (timeline, checks, capacity).
pub fn replay(trace: &Trace, model: Option<Model>, edit: impl FnOnce(&mut AllocConf)) -> Result<Replay> {
    let mut conf = trace.conf()?;
    conf.model = model.unwrap_or(Model::Caching);
    edit(&mut conf);
    replay_with(trace, conf)
}

/// Replay a trace under `conf` (which should carry the trace's `at_start` as `initial`).
pub fn replay_with(trace: &Trace, conf: AllocConf) -> Result<Replay> {
    let (events, recorded) = trace.events()?;
    let stats = simulate(&events, &conf).map_err(|e| match e {
        CoreError::InvalidTrace(m) => CoreError::InvalidTrace(format!(
            "{m} (in the trace's replayed allocation events; a free of a block allocated before the recording \
             started cannot be replayed: record from before the step's first allocation)"
        )),
        other => other,
    })?;
    Ok(Replay {
        alloc_conf: trace.alloc_conf.clone(),
        reserved_error_pct: error_pct(stats.max_reserved, recorded.max_reserved),
        allocated_error_pct: error_pct(stats.max_allocated, recorded.max_allocated),
        stats,
        recorded,
    })
}
