//! Allocator simulation: what a sequence of tensor allocations and frees costs in *reserved*
//! device memory, not only in allocated bytes.
//!
//! - [`caching`]: PyTorch's CUDA caching allocator (block rounding, small and large pools,
//!   best fit, splitting and merging, `max_split_size`, per-stream pools, expandable segments,
//!   release of cached blocks on a miss when a device capacity is set).
//! - [`offset_pool`]: moDNN's offset pool (one growing pool, exact fit, then first fit).
//! - [`trace`]: the `cuda-caching-allocator-trace` JSON recorded with
//!   `torch.cuda.memory._record_memory_history`, and [`trace::replay`].
//!
//! The general entry point is [`simulate`]: a plain sequence of [`AllocEvent`]s (an allocation
//! has an id, a size and a stream; a free names the id) under an [`AllocConf`].

pub mod caching;
pub mod offset_pool;
pub mod trace;

use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};

pub const MIB: u64 = 1 << 20;

/// One allocator call. Ids are the caller's names for blocks; an id may be reused after its
/// block is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AllocEvent {
    /// Allocate `size` bytes on `stream` under the name `id`.
    Alloc { id: u64, size: u64, stream: u64 },
    /// Free the block `id` (its bytes leave `allocated` and the block returns to the cache).
    Free { id: u64 },
    /// The first half of a free whose block is still in use by another stream: its bytes leave
    /// `allocated` now, but the block returns to the cache only at [`AllocEvent::FreeCompleted`].
    FreeRequested { id: u64 },
    /// The block freed earlier by [`AllocEvent::FreeRequested`] returns to the cache.
    FreeCompleted { id: u64 },
}

/// Which allocator to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Model {
    Caching,
    OffsetPool,
}

impl Model {
    pub fn from_name(name: &str) -> Result<Model> {
        match name {
            "caching" => Ok(Model::Caching),
            "offset-pool" => Ok(Model::OffsetPool),
            other => Err(CoreError::InvalidSetting(format!(
                "unknown allocator model {other:?}; use \"caching\" (PyTorch's CUDA caching allocator) or \
                 \"offset-pool\" (moDNN's offset pool)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Model::Caching => "caching",
            Model::OffsetPool => "offset-pool",
        }
    }
}

/// Memory the allocator already holds before the first event.
///
/// `allocated` bytes are live and never freed by the events; `reserved - allocated` bytes are
/// cached. Where the cached bytes lie matters (a request fits only into one free block):
/// `free_blocks`, when given, are the cached blocks the events may use, each in a segment of
/// its own that also holds live memory (so it never merges with another block and is never
/// released), or, marked `grows` under expandable segments, at the end of a segment's mapped
/// pages; the rest of `reserved` is held by the live bytes and unusable. Without
/// `free_blocks`, the caching model places all of it in one large-pool segment on stream 0
/// (expandable with expandable segments): the live bytes at its start, one free block of
/// `reserved - allocated` bytes after them. docs/formats.md says how a trace's are inferred.
/// The offset pool uses only the totals: the live bytes at the bottom of the pool, the cached
/// ones above them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Initial {
    pub allocated: u64,
    pub reserved: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub free_blocks: Vec<InitialFree>,
}

/// A cached free block held before the first event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitialFree {
    pub size: u64,
    /// In the small pool (blocks of at most 1 MiB) rather than the large one.
    #[serde(default)]
    pub small: bool,
    #[serde(default)]
    pub stream: u64,
    /// Its address, where known (it decides best-fit ties between blocks of equal size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    /// With expandable segments: the block ends where its segment's unmapped address space
    /// begins, so new pages extend it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grows: bool,
}

/// Allocator settings (`PYTORCH_CUDA_ALLOC_CONF`) and simulation options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AllocConf {
    pub model: Model,
    /// `expandable_segments:True`: one segment per stream and pool that grows by pages
    /// (2 MiB in the small pool, 20 MiB in the large pool).
    pub expandable_segments: bool,
    /// `max_split_size_mb`: blocks of at least this size are never split (u64::MAX: no limit).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb`: a request of at least `max_split_size` may take a cached
    /// block up to this much larger (default 20 MiB).
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions:N`: round sizes up to one of N steps between powers of two
    /// (0 or 1: off; a single value for all sizes).
    pub roundup_power2_divisions: u64,
    /// Device memory the allocator may reserve; `None`: unlimited. When a new segment would
    /// exceed it, cached blocks are released and the allocation retried, as PyTorch does; if it
    /// still does not fit, the event counts as an out-of-memory error and the simulation goes on
    /// past the capacity (so a caller sees by how much).
    pub capacity: Option<u64>,
    /// Memory held before the first event.
    pub initial: Initial,
    /// `(size, address)` of the segments cudaMalloc returns, in order: the k-th new segment of
    /// a size takes the k-th address listed for that size (the device driver's choice, which
    /// decides best-fit ties between free blocks of equal size). Sizes not listed, or listed
    /// too few times, take decreasing addresses.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub segment_addresses: Vec<(u64, u64)>,
    /// Alignment of the offset pool's blocks (bytes).
    pub offset_alignment: u64,
    /// Record allocated and reserved bytes after every event in [`AllocStats::timeline`].
    pub record_timeline: bool,
    /// After every event, count pairs of adjacent free blocks left unmerged
    /// ([`AllocStats::unmerged_free_pairs`]). Costs a walk of all blocks per event.
    pub check_merged: bool,
}

impl Default for AllocConf {
    fn default() -> Self {
        AllocConf {
            model: Model::Caching,
            expandable_segments: false,
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: 0,
            capacity: None,
            initial: Initial::default(),
            segment_addresses: Vec::new(),
            offset_alignment: 512,
            record_timeline: false,
            check_merged: false,
        }
    }
}

impl AllocConf {
    /// Settings from a `PYTORCH_CUDA_ALLOC_CONF` string such as
    /// `"expandable_segments:True,max_split_size_mb:128"` (empty: the defaults).
    /// Options that do not change where blocks go (`garbage_collection_threshold`, which acts
    /// only with a memory fraction, `release_lock_on_cudamalloc`, `pinned_*`, `backend`) are
    /// accepted and ignored; unknown options are refused.
    pub fn from_alloc_conf(text: &str) -> Result<AllocConf> {
        let mut conf = AllocConf::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once(':').ok_or_else(|| {
                CoreError::InvalidSetting(format!(
                    "alloc_conf item {item:?} is not \"key:value\" (e.g. \"expandable_segments:True\")"
                ))
            })?;
            let (key, value) = (key.trim(), value.trim());
            let bad = |what: &str| {
                CoreError::InvalidSetting(format!("alloc_conf {key}:{value}: {what}"))
            };
            let mb = || -> Result<u64> {
                value.parse::<u64>().map_err(|_| bad("expected a whole number of MiB"))
            };
            match key {
                "expandable_segments" => {
                    conf.expandable_segments = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        _ => return Err(bad("expected True or False")),
                    }
                }
                "max_split_size_mb" => {
                    let v = mb()?;
                    if v * MIB <= 20 * MIB {
                        return Err(bad("PyTorch requires more than 20 MiB"));
                    }
                    conf.max_split_size = v * MIB;
                }
                "max_non_split_rounding_mb" => conf.max_non_split_rounding = mb()? * MIB,
                "roundup_power2_divisions" => {
                    let v = value.parse::<u64>().map_err(|_| {
                        bad("only the single-number form is modelled (e.g. roundup_power2_divisions:4)")
                    })?;
                    if v > 1 && !v.is_power_of_two() {
                        return Err(bad("the number of divisions must be a power of two"));
                    }
                    conf.roundup_power2_divisions = v;
                }
                "garbage_collection_threshold" | "release_lock_on_cudamalloc" | "backend"
                | "pinned_use_cuda_host_register" | "pinned_num_register_threads"
                | "pinned_use_background_threads" => {}
                _ => {
                    return Err(CoreError::InvalidSetting(format!(
                        "alloc_conf option {key:?} is not modelled; the simulator knows expandable_segments, \
                         max_split_size_mb, max_non_split_rounding_mb and roundup_power2_divisions"
                    )))
                }
            }
        }
        Ok(conf)
    }
}

/// What a simulation found. Bytes are device bytes as PyTorch's allocator stats count them:
/// `allocated` is the sum of the sizes of allocated blocks (rounded, and whole when a block is
/// not split), `reserved` is the memory obtained from the device (segments or mapped pages).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocStats {
    pub model: String,
    pub events: u64,
    pub max_allocated: u64,
    pub max_reserved: u64,
    /// Index of the event after which `max_reserved` was first reached (None: before any).
    pub max_reserved_event: Option<u64>,
    /// At the end.
    pub allocated: u64,
    pub reserved: u64,
    /// Sum of the requested (unrounded) sizes of live blocks at the end.
    pub requested: u64,
    /// Segments held at the end (caching: cudaMalloc'd segments, or expandable segments;
    /// offset pool: 1) and at most at once.
    pub segments: u64,
    pub max_segments: u64,
    /// cudaMalloc calls (or page mappings with expandable segments) and their inverse.
    pub device_allocs: u64,
    pub device_frees: u64,
    /// Allocations that had to release cached blocks to fit `capacity`, and those that did
    /// not fit even then.
    pub alloc_retries: u64,
    pub ooms: u64,
    /// Live blocks at the end (not counting the initial block).
    pub live_blocks: u64,
    /// Free blocks cached at the end.
    pub free_blocks: u64,
    /// Reserved bytes after releasing every cached block at the end (`torch.cuda.empty_cache()`);
    /// what stays is held by live blocks.
    pub reserved_after_release: u64,
    /// Pairs of adjacent free blocks left unmerged, summed over all events (with `check_merged`).
    pub unmerged_free_pairs: u64,
    /// `(allocated, reserved)` after every event (with `record_timeline`).
    pub timeline: Vec<(u64, u64)>,
}

/// An allocator model.
pub(crate) trait Simulator {
    fn apply(&mut self, event: &AllocEvent, index: usize) -> Result<()>;
    fn allocated(&self) -> u64;
    fn reserved(&self) -> u64;
    fn unmerged_free_pairs(&self) -> u64;
    fn finish(self: Box<Self>, stats: &mut AllocStats);
}

/// Simulate `events` under `conf`. Errors: a free of an id that is not allocated, an
/// allocation under an id that is live, a size of zero bytes... each says which event.
pub fn simulate(events: &[AllocEvent], conf: &AllocConf) -> Result<AllocStats> {
    let mut sim: Box<dyn Simulator> = match conf.model {
        Model::Caching => Box::new(caching::Caching::new(conf)?),
        Model::OffsetPool => Box::new(offset_pool::OffsetPool::new(conf)?),
    };
    let mut stats = AllocStats { model: conf.model.name().to_string(), ..Default::default() };
    stats.max_allocated = sim.allocated();
    stats.max_reserved = sim.reserved();
    if conf.record_timeline {
        stats.timeline.reserve(events.len());
    }
    for (i, e) in events.iter().enumerate() {
        sim.apply(e, i)?;
        let (a, r) = (sim.allocated(), sim.reserved());
        stats.max_allocated = stats.max_allocated.max(a);
        if r > stats.max_reserved {
            stats.max_reserved = r;
            stats.max_reserved_event = Some(i as u64);
        }
        if conf.record_timeline {
            stats.timeline.push((a, r));
        }
        if conf.check_merged {
            stats.unmerged_free_pairs += sim.unmerged_free_pairs();
        }
    }
    stats.events = events.len() as u64;
    sim.finish(&mut stats);
    Ok(stats)
}

/// Options of a simulation or replay as the Python layer passes them (JSON): each present field
/// overrides the settings (for a replay, those the trace was recorded under).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    /// "caching" or "offset-pool".
    pub model: Option<String>,
    /// A `PYTORCH_CUDA_ALLOC_CONF` string.
    pub alloc_conf: Option<String>,
    pub initial: Option<Initial>,
    pub capacity: Option<u64>,
    pub timeline: bool,
    pub check_merged: bool,
    /// Replays only: infer the initial free blocks and cudaMalloc's segment addresses from the
    /// trace's recorded addresses (default true; see `trace::Trace::conf`).
    pub trace_layout: Option<bool>,
}

impl Options {
    pub fn from_json(text: &str) -> Result<Options> {
        serde_json::from_str(text).map_err(|e| CoreError::InvalidSetting(format!("allocator options: {e}")))
    }

    /// The settings: `base` (or the defaults) with these options applied.
    pub fn conf(&self, base: Option<AllocConf>) -> Result<AllocConf> {
        let mut conf = match (&self.alloc_conf, base) {
            (Some(text), b) => {
                let (initial, segment_addresses) = b.map(|b| (b.initial, b.segment_addresses)).unwrap_or_default();
                AllocConf { initial, segment_addresses, ..AllocConf::from_alloc_conf(text)? }
            }
            (None, Some(b)) => b,
            (None, None) => AllocConf::default(),
        };
        if let Some(m) = &self.model {
            conf.model = Model::from_name(m)?;
        }
        if let Some(i) = &self.initial {
            conf.initial = i.clone();
        }
        if self.capacity.is_some() {
            conf.capacity = self.capacity;
        }
        conf.record_timeline = self.timeline;
        conf.check_merged = self.check_merged;
        Ok(conf)
    }
}

pub(crate) fn event_error(index: usize, event: &AllocEvent, what: &str) -> CoreError {
    CoreError::InvalidTrace(format!("event {index} ({event:?}): {what}"))
}
