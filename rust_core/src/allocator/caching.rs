//! PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), as its source
//! describes it, for one device without CUDA graphs:
//!
//! - Sizes round up to 512 bytes (or to `roundup_power2_divisions` steps).
//! - Requests up to 1 MiB use the small pool, whose segments are 2 MiB; larger ones use the
//!   large pool, whose segments are 20 MiB for requests below 10 MiB and the request rounded up
//!   to 2 MiB otherwise.
//! - Each pool keeps its free blocks per stream; a request takes the smallest free block of its
//!   stream that fits (best fit; ties by lowest address) or allocates a new segment.
//! - A block larger than the request is split when the rest is at least 512 bytes (small pool,
//!   or any pool with expandable segments) or more than 1 MiB (large pool), and never when the
//!   request is at least `max_split_size`. A request below `max_split_size` never takes a free
//!   block of at least `max_split_size`; a request of at least `max_split_size` takes one only
//!   if it is less than `max_non_split_rounding` larger.
//! - A freed block merges with its free neighbours in the same segment.
//! - Expandable segments: one growing segment per stream and pool; a request that no free block
//!   fits maps pages (2 MiB small, 20 MiB large) at the lowest address where the free and
//!   unmapped space reaches its size; best fit counts a block followed by unmapped space as
//!   large as it can grow.
//! - On a miss that would exceed `capacity`: release oversize cached blocks (with
//!   `max_split_size`), then every whole cached segment (or the free pages of expandable
//!   segments), retrying after each; no free-memory callbacks, no garbage collection.

use super::{event_error, AllocConf, AllocEvent, AllocStats, Simulator, MIB};
use crate::error::{CoreError, Result};
use std::collections::{BTreeSet, HashMap, VecDeque};

pub const MIN_BLOCK_SIZE: u64 = 512;
pub const SMALL_SIZE: u64 = MIB;
pub const SMALL_BUFFER: u64 = 2 * MIB;
pub const LARGE_BUFFER: u64 = 20 * MIB;
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
pub const ROUND_LARGE: u64 = 2 * MIB;

const NIL: usize = usize::MAX;
/// Virtual address space of one expandable segment when no capacity is given.
const DEFAULT_ADDRESS_SPACE: u64 = 1 << 40;

/// `round_size`: the block size of a request.
pub fn round_size(size: u64, divisions: u64) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
        if size.is_power_of_two() {
            return size;
        }
        let floor = 1u64 << (63 - size.leading_zeros());
        let step = floor >> divisions.trailing_zeros();
        if step == 0 {
            return floor << 1;
        }
        let rounded = size & !(step - 1);
        return if rounded == size { size } else { rounded + step };
    }
    size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
}

/// `get_allocation_size`: the segment allocated for a block size that no cached block fits.
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[derive(Debug, Clone)]
struct Block {
    addr: u64,
    size: u64,
    requested: u64,
    stream: u64,
    small: bool,
    /// Handed out (or freed but not yet completed): not in any free set.
    active: bool,
    mapped: bool,
    prev: usize,
    next: usize,
    /// Index into `segments`.
    segment: usize,
}

impl Block {
    /// A free block with no neighbours yet (`prev` / `next` are set when it is linked).
    fn new(addr: u64, size: u64, stream: u64, small: bool, mapped: bool, segment: usize) -> Block {
        Block { addr, size, requested: 0, stream, small, active: false, mapped, prev: NIL, next: NIL, segment }
    }
}

#[derive(Debug, Clone)]
struct Segment {
    expandable: bool,
    alive: bool,
    /// Holds memory allocated before the first event: never released.
    pinned: bool,
}

#[derive(Debug, Default)]
struct Pool {
    /// Free mapped blocks by (stream, size, address).
    free: BTreeSet<(u64, u64, u64, usize)>,
    /// Unmapped ranges of expandable segments by (stream, address).
    unmapped: BTreeSet<(u64, u64, usize)>,
}

pub struct Caching {
    expandable: bool,
    max_split_size: u64,
    max_non_split_rounding: u64,
    divisions: u64,
    capacity: Option<u64>,
    address_space: u64,
    blocks: Vec<Block>,
    spare: Vec<usize>,
    segments: Vec<Segment>,
    pools: [Pool; 2], // [large, small]
    /// Addresses cudaMalloc gives new segments, by segment size, in order.
    driver_addresses: HashMap<u64, VecDeque<u64>>,
    live: HashMap<u64, usize>,
    pending: HashMap<u64, usize>,
    allocated: u64,
    reserved: u64,
    next_addr: u64,
    live_segments: u64,
    max_segments: u64,
    device_allocs: u64,
    device_frees: u64,
    alloc_retries: u64,
    ooms: u64,
}

fn pool_index(small: bool) -> usize {
    small as usize
}

impl Caching {
    pub fn new(conf: &AllocConf) -> Result<Caching> {
        let init = &conf.initial;
        let listed: u64 = init.free_blocks.iter().map(|f| f.size).sum();
        if init.allocated + listed > init.reserved {
            return Err(CoreError::InvalidTrace(format!(
                "initial allocated bytes ({}) and initial free blocks ({listed} bytes) exceed initial reserved bytes ({})",
                init.allocated, init.reserved
            )));
        }
        if init.allocated > init.reserved {
            return Err(CoreError::InvalidTrace(format!(
                "initial allocated bytes ({}) exceed initial reserved bytes ({}); allocated memory is part of reserved memory",
                init.allocated, init.reserved
            )));
        }
        let mut c = Caching {
            expandable: conf.expandable_segments,
            max_split_size: conf.max_split_size,
            max_non_split_rounding: conf.max_non_split_rounding,
            divisions: conf.roundup_power2_divisions,
            capacity: conf.capacity,
            address_space: conf
                .capacity
                .map(|c| (c + c / 8).div_ceil(LARGE_BUFFER) * LARGE_BUFFER)
                .unwrap_or(DEFAULT_ADDRESS_SPACE),
            blocks: Vec::new(),
            spare: Vec::new(),
            segments: Vec::new(),
            pools: [Pool::default(), Pool::default()],
            driver_addresses: {
                let mut m: HashMap<u64, VecDeque<u64>> = HashMap::new();
                for &(size, addr) in &conf.segment_addresses {
                    m.entry(size).or_default().push_back(addr);
                }
                m
            },
            live: HashMap::new(),
            pending: HashMap::new(),
            allocated: 0,
            reserved: 0,
            next_addr: 1 << 62,
            live_segments: 0,
            max_segments: 0,
            device_allocs: 0,
            device_frees: 0,
            alloc_retries: 0,
            ooms: 0,
        };
        if !init.free_blocks.is_empty() {
            c.place_initial_blocks(init);
        } else if init.reserved > 0 {
            c.place_initial(init.allocated, init.reserved);
        }
        Ok(c)
    }

    /// The listed free blocks, each in a pinned segment of its own, and the rest of the initial
    /// memory held by one live block in a pinned segment.
    fn place_initial_blocks(&mut self, init: &super::Initial) {
        let listed: u64 = init.free_blocks.iter().map(|f| f.size).sum();
        for f in &init.free_blocks {
            if f.grows && self.expandable {
                // the free end of an expandable segment: unmapped address space follows it
                let space = self.address_space.max(f.size + LARGE_BUFFER);
                let addr = self.take_address(space);
                let seg = self.new_segment(true);
                let b = self.new_block(Block::new(addr, f.size, f.stream, f.small, true, seg));
                let u = self.new_block(Block { prev: b, ..Block::new(addr + f.size, space - f.size, f.stream, f.small, false, seg) });
                self.blocks[b].next = u;
                self.insert_free(b);
                self.pools[pool_index(f.small)].unmapped.insert((f.stream, addr + f.size, u));
                continue;
            }
            let addr = f.addr.unwrap_or_else(|| self.take_address(f.size));
            let seg = self.new_segment(false);
            self.segments[seg].pinned = true;
            let b = self.new_block(Block::new(addr, f.size, f.stream, f.small, true, seg));
            self.insert_free(b);
        }
        let held = init.reserved - listed;
        if held > 0 {
            let addr = self.take_address(held);
            let seg = self.new_segment(false);
            self.segments[seg].pinned = true;
            self.new_block(Block { active: true, ..Block::new(addr, held, 0, false, true, seg) });
        }
        self.reserved = init.reserved;
        self.allocated = init.allocated;
    }

    /// One large-pool segment on stream 0 holding the initial memory: the live bytes first, the
    /// cached free bytes after them (see [`super::Initial`]).
    fn place_initial(&mut self, allocated: u64, reserved: u64) {
        let addr = self.take_address(if self.expandable { self.address_space.max(reserved) } else { reserved });
        let seg = self.new_segment(self.expandable);
        // exactly the reserved bytes, even where they are not whole pages: the recorded
        // reserved figure includes small-pool pages this model does not separate
        let mapped = reserved;
        let head = self.new_block(Block::new(addr, mapped, 0, false, true, seg));
        self.reserved += reserved;
        if self.expandable {
            // the rest of the segment's address space stays unmapped
            let rest = self.address_space.max(reserved) - mapped;
            if rest > 0 {
                let u = self.new_block(Block { prev: head, ..Block::new(addr + mapped, rest, 0, false, false, seg) });
                self.blocks[head].next = u;
                self.pools[0].unmapped.insert((0, addr + mapped, u));
            }
        }
        if allocated > 0 {
            let size = allocated.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE;
            let size = size.min(self.blocks[head].size);
            if self.blocks[head].size - size >= MIN_BLOCK_SIZE {
                self.split(head, size);
            }
            self.blocks[head].active = true;
            self.allocated += allocated;
        }
        if !self.blocks[head].active {
            self.insert_free(head);
        }
    }

    fn take_address(&mut self, size: u64) -> u64 {
        // Without `segment_addresses`, new segments take decreasing addresses, as cudaMalloc
        // mostly gave them in the recorded traces (the address decides best-fit ties between
        // equal free blocks), with a gap so that no two segments are contiguous.
        let span = size.div_ceil(LARGE_BUFFER) * LARGE_BUFFER + LARGE_BUFFER;
        self.next_addr -= span;
        self.next_addr
    }

    fn new_segment(&mut self, expandable: bool) -> usize {
        self.segments.push(Segment { expandable, alive: true, pinned: false });
        self.live_segments += 1;
        self.max_segments = self.max_segments.max(self.live_segments);
        self.segments.len() - 1
    }

    fn new_block(&mut self, b: Block) -> usize {
        if let Some(i) = self.spare.pop() {
            self.blocks[i] = b;
            i
        } else {
            self.blocks.push(b);
            self.blocks.len() - 1
        }
    }

    fn free_key(&self, i: usize) -> (u64, u64, u64, usize) {
        let b = &self.blocks[i];
        (b.stream, b.size, b.addr, i)
    }

    fn insert_free(&mut self, i: usize) {
        let key = self.free_key(i);
        self.pools[pool_index(self.blocks[i].small)].free.insert(key);
    }

    fn remove_free(&mut self, i: usize) {
        let key = self.free_key(i);
        let removed = self.pools[pool_index(self.blocks[i].small)].free.remove(&key);
        debug_assert!(removed);
    }

    fn is_expandable(&self, i: usize) -> bool {
        self.segments[self.blocks[i].segment].expandable
    }

    /// `expandable_size`: a block followed by unmapped space can grow into it.
    fn expandable_size(&self, i: usize) -> u64 {
        let b = &self.blocks[i];
        b.size + if b.next != NIL && !self.blocks[b.next].mapped { self.blocks[b.next].size } else { 0 }
    }

    /// `get_free_block`: best fit among the free blocks of the stream; removes it from the pool.
    fn get_free_block(&mut self, small: bool, stream: u64, size: u64) -> Option<usize> {
        let pool = &self.pools[pool_index(small)];
        let mut range = pool.free.range((stream, size, 0, 0)..);
        let &(s, _, _, mut it) = range.next()?;
        if s != stream {
            return None;
        }
        if self.is_expandable(it) {
            for &(s2, _, _, next) in range {
                if s2 == stream && self.is_expandable(it) && self.expandable_size(next) < self.expandable_size(it) {
                    it = next;
                } else {
                    break;
                }
            }
        }
        let found = self.blocks[it].size;
        if size < self.max_split_size && found >= self.max_split_size {
            return None;
        }
        if size >= self.max_split_size && found >= size.saturating_add(self.max_non_split_rounding) {
            return None;
        }
        self.remove_free(it);
        Some(it)
    }

    fn should_split(&self, i: usize, size: u64) -> bool {
        let remaining = self.blocks[i].size - size;
        if self.blocks[i].small || self.expandable {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Cut `i` into `[i: size][rest]`; the rest goes to the free set. `i` is not in a set.
    fn split(&mut self, i: usize, size: u64) {
        let b = self.blocks[i].clone();
        let rest = self.new_block(Block {
            addr: b.addr + size,
            size: b.size - size,
            requested: 0,
            active: false,
            prev: i,
            next: b.next,
            ..b
        });
        if b.next != NIL {
            self.blocks[b.next].prev = rest;
        }
        self.blocks[i].next = rest;
        self.blocks[i].size = size;
        self.insert_free(rest);
    }

    /// Merge `src` into `dst` if `src` is free and mapped alike; `dst` is in no set.
    fn try_merge(&mut self, dst: usize, src: usize) -> bool {
        if src == NIL || self.blocks[src].active || self.blocks[src].mapped != self.blocks[dst].mapped {
            return false;
        }
        let s = self.blocks[src].clone();
        let pool = &mut self.pools[pool_index(s.small)];
        if s.mapped {
            pool.free.remove(&(s.stream, s.size, s.addr, src));
        } else {
            pool.unmapped.remove(&(s.stream, s.addr, src));
        }
        if self.blocks[dst].prev == src {
            self.blocks[dst].addr = s.addr;
            self.blocks[dst].prev = s.prev;
            if s.prev != NIL {
                self.blocks[s.prev].next = dst;
            }
        } else {
            self.blocks[dst].next = s.next;
            if s.next != NIL {
                self.blocks[s.next].prev = dst;
            }
        }
        self.blocks[dst].size += s.size;
        self.spare.push(src);
        true
    }

    fn would_exceed(&self, bytes: u64) -> bool {
        self.capacity.is_some_and(|c| self.reserved + bytes > c)
    }

    /// `alloc_block`: a new segment (or newly mapped pages); `force` ignores the capacity.
    fn alloc_block(&mut self, small: bool, stream: u64, size: u64, force: bool) -> Option<usize> {
        if self.expandable {
            return self.alloc_expandable(small, stream, size, force);
        }
        let bytes = allocation_size(size);
        if !force && self.would_exceed(bytes) {
            return None;
        }
        let addr = match self.driver_addresses.get_mut(&bytes).and_then(|q| q.pop_front()) {
            Some(a) => a,
            None => self.take_address(bytes),
        };
        let seg = self.new_segment(false);
        self.reserved += bytes;
        self.device_allocs += 1;
        Some(self.new_block(Block::new(addr, bytes, stream, small, true, seg)))
    }

    fn page(small: bool) -> u64 {
        if small {
            SMALL_BUFFER
        } else {
            LARGE_BUFFER
        }
    }

    /// `find_expandable_block`: the lowest unmapped range of the stream (with the free block
    /// before it) whose free and unmapped space reaches `size`, or a new segment.
    fn find_expandable(&mut self, small: bool, stream: u64, size: u64) -> usize {
        let allocatable = |c: &Caching, i: usize| i != NIL && !c.blocks[i].active;
        let candidates: Vec<usize> = self.pools[pool_index(small)]
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .map(|k| k.2)
            .collect();
        for u in candidates {
            let mut c = u;
            if allocatable(self, self.blocks[u].prev) {
                c = self.blocks[u].prev;
            }
            let (mut bytes, mut b) = (0u64, c);
            while bytes < size && allocatable(self, b) {
                bytes += self.blocks[b].size;
                b = self.blocks[b].next;
            }
            if bytes >= size {
                return c;
            }
        }
        let space = self.address_space;
        let addr = self.take_address(space);
        let seg = self.new_segment(true);
        let i = self.new_block(Block::new(addr, space, stream, small, false, seg));
        self.pools[pool_index(small)].unmapped.insert((stream, addr, i));
        i
    }

    /// `map_block`: back the start of the unmapped block `u` with pages for `size` bytes and
    /// merge it with free neighbours; returns the merged free block (in the free set) or None
    /// if the capacity forbids it.
    fn map_block(&mut self, u: usize, size: u64, force: bool) -> Option<usize> {
        let b = self.blocks[u].clone();
        let page = Self::page(b.small);
        let mapped = (size.div_ceil(page) * page).min(b.size);
        if !force && self.would_exceed(mapped) {
            return None;
        }
        self.pools[pool_index(b.small)].unmapped.remove(&(b.stream, b.addr, u));
        self.blocks[u].mapped = true;
        if mapped < b.size {
            let rest = self.new_block(Block { addr: b.addr + mapped, size: b.size - mapped, prev: u, ..b.clone() });
            if b.next != NIL {
                self.blocks[b.next].prev = rest;
            }
            self.blocks[u].next = rest;
            self.blocks[u].size = mapped;
            self.pools[pool_index(b.small)].unmapped.insert((b.stream, b.addr + mapped, rest));
        }
        let (p, n) = (self.blocks[u].prev, self.blocks[u].next);
        self.try_merge(u, p);
        self.try_merge(u, n);
        self.insert_free(u);
        self.reserved += mapped;
        self.device_allocs += 1;
        Some(u)
    }

    /// `try_allocate_expandable_block`; the block returned is in no set.
    fn alloc_expandable(&mut self, small: bool, stream: u64, size: u64, force: bool) -> Option<usize> {
        let mut c = self.find_expandable(small, stream, size);
        if !self.blocks[c].mapped {
            let want = self.blocks[c].size.min(size);
            c = self.map_block(c, want, force)?;
        }
        while self.blocks[c].size < size {
            let remaining = size - self.blocks[c].size;
            let next = self.blocks[c].next;
            if next == NIL || self.blocks[next].mapped {
                return None; // the segment's address space is used up: an out-of-memory, not a panic
            }
            let want = remaining.min(self.blocks[next].size);
            // map_block merges c into the newly mapped pages
            c = self.map_block(next, want, force)?;
        }
        self.remove_free(c);
        Some(c)
    }

    /// `release_block`: cudaFree a whole cached segment.
    fn release_block(&mut self, i: usize) {
        self.remove_free(i);
        let b = &self.blocks[i];
        self.reserved -= b.size;
        self.segments[b.segment].alive = false;
        self.live_segments -= 1;
        self.device_frees += 1;
        self.spare.push(i);
    }

    /// `unmap_block`: return the whole free pages inside the free block `i`.
    fn unmap_block(&mut self, i: usize) {
        let b = self.blocks[i].clone();
        let page = Self::page(b.small);
        let seg_base = {
            let mut h = i;
            while self.blocks[h].prev != NIL {
                h = self.blocks[h].prev;
            }
            self.blocks[h].addr
        };
        let off = b.addr - seg_base;
        let begin = seg_base + off.div_ceil(page) * page;
        let end = seg_base + ((off + b.size) / page) * page;
        if begin >= end {
            return;
        }
        self.remove_free(i);
        if begin > b.addr {
            let before = self.new_block(Block { size: begin - b.addr, prev: b.prev, next: i, ..b.clone() });
            if b.prev != NIL {
                self.blocks[b.prev].next = before;
            }
            self.blocks[i].prev = before;
            self.insert_free(before);
        }
        let end_of_block = b.addr + b.size;
        if end_of_block > end {
            let after = self.new_block(Block { addr: end, size: end_of_block - end, prev: i, next: b.next, ..b.clone() });
            if b.next != NIL {
                self.blocks[b.next].prev = after;
            }
            self.blocks[i].next = after;
            self.insert_free(after);
        }
        self.blocks[i].addr = begin;
        self.blocks[i].size = end - begin;
        self.blocks[i].mapped = false;
        let (p, n) = (self.blocks[i].prev, self.blocks[i].next);
        self.try_merge(i, p);
        self.try_merge(i, n);
        let k = (b.stream, self.blocks[i].addr, i);
        self.pools[pool_index(b.small)].unmapped.insert(k);
        self.reserved -= end - begin;
        self.device_frees += 1;
        if self.blocks[i].prev == NIL && self.blocks[i].next == NIL {
            // the whole segment is unmapped: give back its address space
            self.pools[pool_index(b.small)].unmapped.remove(&k);
            self.segments[b.segment].alive = false;
            self.live_segments -= 1;
            self.spare.push(i);
        }
    }

    /// `release_available_cached_blocks`: with `max_split_size`, free oversize cached blocks of
    /// the stream, the smallest that covers `size`, or the largest ones until they do.
    fn release_available(&mut self, small: bool, stream: u64, size: u64) -> bool {
        if self.max_split_size == u64::MAX {
            return false;
        }
        let key = size.max(self.max_split_size);
        let pool = &self.pools[pool_index(small)].free;
        if let Some(&(_, _, _, i)) = pool.range((stream, key, 0, 0)..).next().filter(|k| k.0 == stream) {
            if self.is_expandable(i) || self.blocks[i].prev != NIL || self.blocks[i].next != NIL || self.segments[self.blocks[i].segment].pinned {
                return false;
            }
            self.release_block(i);
            return true;
        }
        let candidates: Vec<(u64, usize)> = pool
            .range(..(stream, key, 0, 0))
            .rev()
            .take_while(|k| k.0 == stream && k.1 >= self.max_split_size)
            .map(|k| (k.1, k.3))
            .collect();
        let mut released = 0;
        for (sz, i) in candidates {
            if released >= key || self.is_expandable(i) || self.segments[self.blocks[i].segment].pinned {
                break;
            }
            if self.blocks[i].prev != NIL || self.blocks[i].next != NIL {
                continue;
            }
            released += sz;
            self.release_block(i);
        }
        released >= key
    }

    /// `release_cached_blocks`: free every cached segment that is one free block, and unmap the
    /// free pages of expandable segments.
    fn release_cached(&mut self) {
        for p in 0..2 {
            let blocks: Vec<usize> = self.pools[p].free.iter().map(|k| k.3).collect();
            for i in blocks {
                if self.is_expandable(i) {
                    self.unmap_block(i);
                } else if self.blocks[i].prev == NIL
                    && self.blocks[i].next == NIL
                    && !self.segments[self.blocks[i].segment].pinned
                {
                    self.release_block(i);
                }
            }
        }
    }

    /// The block for an allocation, or None when even a forced allocation cannot be placed (an
    /// expandable segment's address space is used up).
    fn malloc(&mut self, size_requested: u64, stream: u64) -> Option<usize> {
        let size = round_size(size_requested, self.divisions);
        let small = size <= SMALL_SIZE;
        let block = match self.get_free_block(small, stream, size) {
            Some(b) => b,
            None => match self.alloc_block(small, stream, size, false) {
                Some(b) => b,
                None => {
                    self.alloc_retries += 1;
                    let mut got = None;
                    if self.release_available(small, stream, size) {
                        got = self.alloc_block(small, stream, size, false);
                    }
                    if got.is_none() {
                        self.release_cached();
                        got = self.alloc_block(small, stream, size, false);
                    }
                    match got {
                        Some(b) => b,
                        None => {
                            self.ooms += 1;
                            self.alloc_block(small, stream, size, true)?
                        }
                    }
                }
            },
        };
        if self.should_split(block, size) {
            self.split(block, size);
        }
        let b = &mut self.blocks[block];
        b.active = true;
        b.requested = size_requested;
        self.allocated += b.size;
        Some(block)
    }

    /// `free_block`: back to the cache, merged with free neighbours.
    fn free_block(&mut self, i: usize) {
        self.blocks[i].active = false;
        self.blocks[i].requested = 0;
        let (p, n) = (self.blocks[i].prev, self.blocks[i].next);
        self.try_merge(i, p);
        self.try_merge(i, n);
        self.insert_free(i);
    }

    /// Blocks of live segments, in address order per segment (for checks and stats).
    fn segment_heads(&self) -> Vec<usize> {
        let mut seen = vec![false; self.blocks.len()];
        for &i in &self.spare {
            seen[i] = true;
        }
        (0..self.blocks.len())
            .filter(|&i| !seen[i] && self.blocks[i].prev == NIL && self.segments[self.blocks[i].segment].alive)
            .collect()
    }
}

impl Simulator for Caching {
    fn apply(&mut self, event: &AllocEvent, index: usize) -> Result<()> {
        match *event {
            AllocEvent::Alloc { id, size, stream } => {
                if size == 0 {
                    return Err(event_error(index, event, "an allocation of 0 bytes; PyTorch does not call the allocator for empty tensors, leave it out"));
                }
                if self.live.contains_key(&id) || self.pending.contains_key(&id) {
                    return Err(event_error(index, event, "this id is already allocated; free it first or use another id"));
                }
                let b = self.malloc(size, stream).ok_or_else(|| {
                    event_error(index, event, "cannot be placed even past the device's capacity: the expandable segment's address space is used up; is the size right?")
                })?;
                self.live.insert(id, b);
            }
            AllocEvent::Free { id } | AllocEvent::FreeRequested { id } => {
                let b = self.live.remove(&id).ok_or_else(|| {
                    event_error(index, event, "frees an id that is not allocated (never allocated, or freed already); every free must follow the allocation of its id")
                })?;
                self.allocated -= self.blocks[b].size;
                if matches!(event, AllocEvent::Free { .. }) {
                    self.free_block(b);
                } else {
                    self.pending.insert(id, b);
                }
            }
            AllocEvent::FreeCompleted { id } => {
                let b = self.pending.remove(&id).ok_or_else(|| {
                    event_error(index, event, "completes a free that was not requested; a free_completed must follow the free_requested of its id")
                })?;
                self.free_block(b);
            }
        }
        Ok(())
    }

    fn allocated(&self) -> u64 {
        self.allocated
    }

    fn reserved(&self) -> u64 {
        self.reserved
    }

    fn unmerged_free_pairs(&self) -> u64 {
        let mut n = 0;
        for h in self.segment_heads() {
            let mut i = h;
            while self.blocks[i].next != NIL {
                let j = self.blocks[i].next;
                let (a, b) = (&self.blocks[i], &self.blocks[j]);
                if !a.active && !b.active && a.mapped == b.mapped {
                    n += 1;
                }
                i = j;
            }
        }
        n
    }

    fn finish(mut self: Box<Self>, stats: &mut AllocStats) {
        stats.allocated = self.allocated;
        stats.reserved = self.reserved;
        stats.requested = self.live.values().chain(self.pending.values()).map(|&b| self.blocks[b].requested).sum();
        stats.live_blocks = (self.live.len() + self.pending.len()) as u64;
        stats.free_blocks = (self.pools[0].free.len() + self.pools[1].free.len()) as u64;
        stats.segments = self.live_segments;
        stats.max_segments = self.max_segments;
        stats.device_allocs = self.device_allocs;
        stats.device_frees = self.device_frees;
        stats.alloc_retries = self.alloc_retries;
        stats.ooms = self.ooms;
        self.release_cached();
        stats.reserved_after_release = self.reserved;
    }
}
