//! moDNN's offset pool: one contiguous pool of device memory, blocks placed at offsets in it.
//!
//! A request (rounded up to `offset_alignment`) takes the free block of exactly its size at the
//! lowest offset; failing that, the first free block (lowest offset) that is large enough, cut
//! at its front; failing that, the pool grows at its top (extending a free block that ends
//! there). Freed blocks merge with free neighbours. Streams share the pool. `reserved` is the
//! pool's high-water mark (the pool never shrinks while the simulation runs).

use super::{event_error, AllocConf, AllocEvent, AllocStats, Simulator};
use crate::error::{CoreError, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap};

#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    free: bool,
}

pub struct OffsetPool {
    alignment: u64,
    capacity: Option<u64>,
    /// Every block by offset; they tile `[0, top)`.
    blocks: BTreeMap<u64, Block>,
    /// Free blocks by (size, offset) for the exact fit, and by offset for the first fit.
    by_size: BTreeSet<(u64, u64)>,
    by_offset: BTreeSet<u64>,
    live: HashMap<u64, u64>,
    pending: HashMap<u64, u64>,
    top: u64,
    high_water: u64,
    allocated: u64,
    grows: u64,
    ooms: u64,
}

impl OffsetPool {
    pub fn new(conf: &AllocConf) -> Result<OffsetPool> {
        if conf.offset_alignment == 0 {
            return Err(CoreError::InvalidSetting("offset_alignment must be at least 1 byte".into()));
        }
        let init = &conf.initial;
        if init.allocated > init.reserved {
            return Err(CoreError::InvalidTrace(format!(
                "initial allocated bytes ({}) exceed initial reserved bytes ({}); allocated memory is part of reserved memory",
                init.allocated, init.reserved
            )));
        }
        let mut p = OffsetPool {
            alignment: conf.offset_alignment,
            capacity: conf.capacity,
            blocks: BTreeMap::new(),
            by_size: BTreeSet::new(),
            by_offset: BTreeSet::new(),
            live: HashMap::new(),
            pending: HashMap::new(),
            top: 0,
            high_water: 0,
            allocated: 0,
            grows: 0,
            ooms: 0,
        };
        // the initial live bytes at the bottom, the cached rest above them
        if init.allocated > 0 {
            p.blocks.insert(0, Block { size: init.allocated, free: false });
        }
        if init.reserved > init.allocated {
            p.blocks.insert(init.allocated, Block { size: init.reserved - init.allocated, free: false });
            p.set_free(init.allocated);
        }
        p.top = init.reserved;
        p.high_water = init.reserved;
        p.allocated = init.allocated;
        Ok(p)
    }

    fn set_free(&mut self, off: u64) {
        let b = self.blocks.get_mut(&off).expect("block");
        b.free = true;
        let size = b.size;
        self.by_size.insert((size, off));
        self.by_offset.insert(off);
    }

    fn take(&mut self, off: u64) {
        let b = self.blocks.get_mut(&off).expect("block");
        b.free = false;
        let size = b.size;
        self.by_size.remove(&(size, off));
        self.by_offset.remove(&off);
    }

    fn malloc(&mut self, size: u64) -> (u64, u64) {
        let size = size.div_ceil(self.alignment) * self.alignment;
        // exact fit
        if let Some(&(_, off)) = self.by_size.range((size, 0)..(size, u64::MAX)).next() {
            self.take(off);
            return (off, size);
        }
        // first fit
        let first = self.by_offset.iter().copied().find(|o| self.blocks[o].size >= size);
        if let Some(off) = first {
            self.take(off);
            let rest = self.blocks[&off].size - size;
            self.blocks.get_mut(&off).expect("block").size = size;
            if rest > 0 {
                self.blocks.insert(off + size, Block { size: rest, free: false });
                self.set_free(off + size);
            }
            return (off, size);
        }
        // grow at the top, taking a free block that ends there
        let off = match self.blocks.iter().next_back() {
            Some((&o, b)) if b.free => {
                self.take(o);
                o
            }
            _ => self.top,
        };
        self.blocks.insert(off, Block { size, free: false });
        self.top = off + size;
        self.grows += 1;
        if self.capacity.is_some_and(|c| self.top > c) {
            self.ooms += 1;
        }
        self.high_water = self.high_water.max(self.top);
        (off, size)
    }

    fn free(&mut self, off: u64) {
        let mut off = off;
        let mut size = self.blocks[&off].size;
        if let Some((&n, nb)) = self.blocks.range(off + 1..).next() {
            if nb.free && n == off + size {
                let nsize = nb.size;
                self.take(n);
                self.blocks.remove(&n);
                size += nsize;
            }
        }
        if let Some((&p, pb)) = self.blocks.range(..off).next_back() {
            if pb.free && p + pb.size == off {
                let psize = pb.size;
                self.take(p);
                self.blocks.remove(&off);
                off = p;
                size += psize;
            }
        }
        self.blocks.insert(off, Block { size, free: false });
        self.set_free(off);
    }
}

impl Simulator for OffsetPool {
    fn apply(&mut self, event: &AllocEvent, index: usize) -> Result<()> {
        match *event {
            AllocEvent::Alloc { id, size, .. } => {
                if size == 0 {
                    return Err(event_error(index, event, "an allocation of 0 bytes; leave it out"));
                }
                if self.live.contains_key(&id) || self.pending.contains_key(&id) {
                    return Err(event_error(index, event, "this id is already allocated; free it first or use another id"));
                }
                let (off, size) = self.malloc(size);
                self.allocated += size;
                self.live.insert(id, off);
            }
            AllocEvent::Free { id } | AllocEvent::FreeRequested { id } => {
                let off = self.live.remove(&id).ok_or_else(|| {
                    event_error(index, event, "frees an id that is not allocated (never allocated, or freed already); every free must follow the allocation of its id")
                })?;
                self.allocated -= self.blocks[&off].size;
                if matches!(event, AllocEvent::Free { .. }) {
                    self.free(off);
                } else {
                    self.pending.insert(id, off);
                }
            }
            AllocEvent::FreeCompleted { id } => {
                let off = self.pending.remove(&id).ok_or_else(|| {
                    event_error(index, event, "completes a free that was not requested; a free_completed must follow the free_requested of its id")
                })?;
                self.free(off);
            }
        }
        Ok(())
    }

    fn allocated(&self) -> u64 {
        self.allocated
    }

    fn reserved(&self) -> u64 {
        self.high_water
    }

    fn unmerged_free_pairs(&self) -> u64 {
        let mut n = 0;
        let mut prev: Option<(u64, Block)> = None;
        for (&o, &b) in &self.blocks {
            if let Some((po, pb)) = prev {
                if pb.free && b.free && po + pb.size == o {
                    n += 1;
                }
            }
            prev = Some((o, b));
        }
        n
    }

    fn finish(self: Box<Self>, stats: &mut AllocStats) {
        stats.allocated = self.allocated;
        stats.reserved = self.high_water;
        stats.requested = 0;
        stats.live_blocks = (self.live.len() + self.pending.len()) as u64;
        stats.free_blocks = self.by_offset.len() as u64;
        stats.segments = 1;
        stats.max_segments = 1;
        stats.device_allocs = self.grows;
        stats.ooms = self.ooms;
        // releasing the pool keeps what reaches its highest live block
        stats.reserved_after_release =
            self.blocks.iter().filter(|(_, b)| !b.free).map(|(&o, b)| o + b.size).max().unwrap_or(0);
    }
}
