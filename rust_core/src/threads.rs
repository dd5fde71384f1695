//! The threads a search evaluates on: a rayon pool, or the calling thread alone.
//!
//! With one thread a pool only adds work: every batch is handed to the pool's thread and back
//! (two context switches) and its idle thread spins between batches, about an eighth of a
//! one-thread search's CPU time (measured: mobilenet_v1 at 0.75, 0.84 s with a pool of one
//! thread, 0.73 s on the calling thread). So one thread evaluates on the caller, in the same
//! order; results never depend on the thread count either way (each item's result depends only
//! on the item).

use crate::error::{CoreError, Result};
use rayon::prelude::*;

pub enum Threads {
    /// The calling thread, in order.
    Caller,
    Pool(rayon::ThreadPool),
}

impl Threads {
    /// `threads` workers; 0: one per core.
    pub fn new(threads: usize) -> Result<Threads> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            t => t,
        };
        if threads == 1 {
            return Ok(Threads::Caller);
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map(Threads::Pool)
            .map_err(|e| CoreError::InvalidSetting(format!("cannot start {threads} threads: {e}")))
    }

    /// How many threads evaluate.
    pub fn count(&self) -> usize {
        match self {
            Threads::Caller => 1,
            Threads::Pool(pool) => pool.current_num_threads(),
        }
    }

    /// `f` of every item, in order; each worker makes its own state with `init` once or more.
    pub fn map<T, S, R>(&self, items: &[T], init: impl Fn() -> S + Sync + Send, f: impl Fn(&mut S, &T) -> R + Sync + Send) -> Vec<R>
    where
        T: Sync,
        R: Send,
    {
        match self {
            Threads::Caller => {
                let mut state = init();
                items.iter().map(|x| f(&mut state, x)).collect()
            }
            Threads::Pool(pool) => pool.install(|| items.par_iter().map_init(&init, |s, x| f(s, x)).collect()),
        }
    }

    /// `a()` and `b()`, at once on a pool (each may use the pool), one after the other on the
    /// caller.
    pub fn join<A: Send, B: Send>(&self, a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B + Send) -> (A, B) {
        match self {
            Threads::Caller => (a(), b()),
            Threads::Pool(pool) => pool.install(|| rayon::join(a, b)),
        }
    }

    /// `f` of every item (with its index), which it may change, in order.
    pub fn map_mut<T, S, R>(
        &self,
        items: &mut [T],
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize, &mut T) -> R + Sync + Send,
    ) -> Vec<R>
    where
        T: Send,
        R: Send,
    {
        match self {
            Threads::Caller => {
                let mut state = init();
                items.iter_mut().enumerate().map(|(i, x)| f(&mut state, i, x)).collect()
            }
            Threads::Pool(pool) => {
                pool.install(|| items.par_iter_mut().enumerate().map_init(&init, |s, (i, x)| f(s, i, x)).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caller_and_a_pool_map_alike() {
        let items: Vec<u64> = (0..1000).collect();
        for threads in [1, 2, 3] {
            let w = Threads::new(threads).unwrap();
            assert_eq!(matches!(w, Threads::Caller), threads == 1);
            assert_eq!(w.count(), threads);
            assert_eq!(w.map(&items, || 0u64, |_, &x| x * x), items.iter().map(|x| x * x).collect::<Vec<_>>());
            let mut v = items.clone();
            let r = w.map_mut(&mut v, || (), |_, i, x| {
                *x += 1;
                i as u64
            });
            assert_eq!(r, items);
            assert_eq!(w.join(|| items.len(), || items[1]), (1000, 1));
            assert_eq!(v, items.iter().map(|x| x + 1).collect::<Vec<_>>());
        }
    }
}
