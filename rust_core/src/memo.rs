//! What the search already knows of plans' scores under one budget: the swarm, polish, restarts
//! and path relinking evaluate many plans again (particles that converge try the same plans in
//! later iterations; the polish of the best start rescans the moves its first polish made; a walk
//! of path relinking starts with the moves the polish of its end made; polishes from different
//! plans end at the same optimum), about a quarter of the polish's evaluations on a GPT of 125
//! units, 40% of the swarm's on mobilenet_v2 at 0.75.
//!
//! A plan's score is a function of the plan (profile, budget, options and segments fixed), so a
//! score found once is the score. An evaluation stopped by a bound (crate::incremental) only says
//! that the plan is strictly worse than that bound, so that is what is kept, and it answers any
//! later question with a bound at least as good. The answer is the one an evaluation gives once
//! [`normalized`]: None when the plan is strictly worse than the bound, else its score. So a
//! search asking the memo makes the same choices as one that evaluates every plan.
//!
//! Plans are kept whole (two bits per unit), the latest [`GENERATION`] plans and the ones before
//! them: a memo holds at most twice that many, and a plan found in the older half moves to the
//! newer.

use crate::action::Action;
use crate::evaluator::Score;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Plans per generation of a memo.
pub const GENERATION: usize = 1 << 17;

/// What is known of a plan's score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Known {
    Exact(Score),
    /// Strictly worse than this score.
    WorseThan(Score),
}

/// The answer of an evaluation with `bound`: None when the plan is strictly worse than it, else
/// its score. (A bounded evaluation may also run to the end and return the score of a plan
/// worse than its bound; a search treats both alike.)
pub fn normalized(s: Option<Score>, bound: Option<Score>) -> Option<Score> {
    match (s, bound) {
        (Some(s), Some(b)) if b.better_than(&s) => None,
        _ => s,
    }
}

/// What `known` answers an evaluation with `bound`, if anything.
fn answer(known: Known, bound: Option<Score>) -> Option<Option<Score>> {
    match known {
        Known::Exact(s) => Some(normalized(Some(s), bound)),
        // strictly worse than w, and w is no better than the bound: strictly worse than it
        Known::WorseThan(w) => match bound {
            Some(b) if !w.better_than(&b) => Some(None),
            _ => None,
        },
    }
}

/// Multiply-rotate hashing of the packed plans (their bits are already spread over the words).
#[derive(Default)]
struct KeyHasher(u64);

impl KeyHasher {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(23) ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let mut last = 0u64;
        for (i, &b) in chunks.remainder().iter().enumerate() {
            last |= (b as u64) << (8 * i);
        }
        self.add(last);
    }

    fn write_u64(&mut self, w: u64) {
        self.add(w);
    }

    fn write_usize(&mut self, w: usize) {
        self.add(w as u64);
    }

    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }
}

type Table = HashMap<Box<[u64]>, Known, BuildHasherDefault<KeyHasher>>;

/// The known scores of plans of `n` units under one budget (empty and never filled when
/// disabled).
#[derive(Debug, Default)]
pub struct ScoreMemo {
    enabled: bool,
    newer: Table,
    older: Table,
    /// A plan packed (`load`), and the key being built from it (`start`, `set`).
    base: Vec<u64>,
    key: Vec<u64>,
    /// Questions answered without an evaluation.
    pub hits: u64,
}

fn code(a: Action) -> u64 {
    match a {
        Action::Retain => 0,
        Action::Swap => 1,
        Action::Recompute => 2,
    }
}

/// `plan` packed into `key` (two bits per unit): the key of [`ScoreMemo::get_key`] and
/// [`ScoreMemo::put_key`], for callers that build keys apart from the memo (threads sharing one).
pub fn pack(plan: &[Action], key: &mut Vec<u64>) {
    key.clear();
    key.resize(plan.len().div_ceil(32).max(1), 0);
    for (u, &a) in plan.iter().enumerate() {
        key[u / 32] |= code(a) << (2 * (u % 32));
    }
}

impl ScoreMemo {
    pub fn new(n: usize, enabled: bool) -> ScoreMemo {
        let words = n.div_ceil(32).max(1);
        ScoreMemo { enabled, base: vec![0; words], key: vec![0; words], ..ScoreMemo::default() }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Pack `plan` as the base of the next keys.
    pub fn load(&mut self, plan: &[Action]) {
        pack(plan, &mut self.base);
    }

    /// Start a key from the loaded plan.
    pub fn start(&mut self) {
        self.key.copy_from_slice(&self.base);
    }

    /// In the key being built, unit `u` takes action `a`.
    pub fn set(&mut self, u: usize, a: Action) {
        let shift = 2 * (u % 32);
        let w = &mut self.key[u / 32];
        *w = (*w & !(3u64 << shift)) | code(a) << shift;
    }

    /// The key's plan is loaded and started (`plan` itself).
    pub fn start_at(&mut self, plan: &[Action]) {
        self.load(plan);
        self.start();
    }

    /// What an evaluation of the key's plan with `bound` would answer ([`normalized`]), if it
    /// is known.
    pub fn get(&mut self, bound: Option<Score>) -> Option<Option<Score>> {
        let key = std::mem::take(&mut self.key);
        let answer = self.get_key(&key, bound);
        self.key = key;
        answer
    }

    /// [`ScoreMemo::get`] of the plan packed in `key` ([`pack`]).
    pub fn get_key(&mut self, key: &[u64], bound: Option<Score>) -> Option<Option<Score>> {
        if !self.enabled {
            return None;
        }
        let known = match self.newer.get(key) {
            Some(k) => *k,
            None => {
                let k = *self.older.get(key)?;
                self.keep(key, k);
                k
            }
        };
        let answer = answer(known, bound);
        if answer.is_some() {
            self.hits += 1;
        }
        answer
    }

    /// [`ScoreMemo::get_key`] that changes nothing (no hit counted, no plan moved to the newer
    /// generation): for threads that read one memo at once.
    pub fn peek_key(&self, key: &[u64], bound: Option<Score>) -> Option<Option<Score>> {
        if !self.enabled {
            return None;
        }
        answer(*self.newer.get(key).or_else(|| self.older.get(key))?, bound)
    }

    /// The key's plan was evaluated with `bound` and gave `s` (None: it stopped, the plan is
    /// strictly worse than the bound).
    pub fn put(&mut self, bound: Option<Score>, s: Option<Score>) {
        let key = std::mem::take(&mut self.key);
        self.put_key(&key, bound, s);
        self.key = key;
    }

    /// [`ScoreMemo::put`] of the plan packed in `key` ([`pack`]).
    pub fn put_key(&mut self, key: &[u64], bound: Option<Score>, s: Option<Score>) {
        if !self.enabled {
            return;
        }
        let known = match (s, bound) {
            (Some(s), _) => Known::Exact(s),
            (None, Some(b)) => {
                // a score, or a stronger lower limit, is kept
                match self.newer.get(key) {
                    Some(Known::Exact(_)) => return,
                    Some(Known::WorseThan(w)) if !w.better_than(&b) => return,
                    _ => {}
                }
                Known::WorseThan(b)
            }
            (None, None) => return,
        };
        self.keep(key, known);
    }

    fn keep(&mut self, key: &[u64], known: Known) {
        if let Some(k) = self.newer.get_mut(key) {
            *k = known;
            return;
        }
        if self.newer.len() >= GENERATION {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(key.into(), known);
    }

    /// Plans held.
    pub fn len(&self) -> usize {
        self.newer.len() + self.older.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    fn s(feasible: bool, excess: u64, time: f64) -> Score {
        Score { feasible, excess, time }
    }

    #[test]
    fn answers_as_a_normalized_evaluation() {
        let mut m = ScoreMemo::new(40, true);
        let plan = vec![Retain; 40];
        m.start_at(&plan);
        assert_eq!(m.get(None), None);
        m.put(None, Some(s(true, 0, 2.0)));
        assert_eq!(m.get(None), Some(Some(s(true, 0, 2.0))));
        assert_eq!(m.get(Some(s(true, 0, 3.0))), Some(Some(s(true, 0, 2.0))));
        assert_eq!(m.get(Some(s(true, 0, 2.0))), Some(Some(s(true, 0, 2.0))), "a tie is not worse");
        assert_eq!(m.get(Some(s(true, 0, 1.0))), Some(None));
        // another plan: one unit past the first word differs
        m.set(33, Recompute);
        assert_eq!(m.get(None), None);
        m.put(Some(s(true, 0, 1.5)), None);
        assert_eq!(m.get(None), None, "a stopped evaluation gives no score");
        assert_eq!(m.get(Some(s(true, 0, 1.5))), Some(None));
        assert_eq!(m.get(Some(s(true, 0, 1.0))), Some(None));
        assert_eq!(m.get(Some(s(false, 7, 0.0))), None, "a worse bound is not answered");
        // a weaker lower limit does not replace a stronger one
        m.put(Some(s(true, 0, 1.2)), None);
        assert_eq!(m.get(Some(s(true, 0, 1.5))), Some(None));
        m.put(Some(s(false, 7, 0.0)), None);
        assert_eq!(m.get(Some(s(false, 7, 0.0))), Some(None));
        assert_eq!(m.hits, 8);
        // the first plan is unchanged
        m.start();
        assert_eq!(m.get(None), Some(Some(s(true, 0, 2.0))));
    }

    #[test]
    fn every_action_of_every_unit_is_its_own_key() {
        let mut m = ScoreMemo::new(70, true);
        let plan: Vec<Action> = (0..70).map(|u| Action::ALL[u % 3]).collect();
        m.start_at(&plan);
        m.put(None, Some(s(true, 0, 0.0)));
        let mut t = 1.0;
        for u in 0..70 {
            for a in Action::ALL {
                if a != plan[u] {
                    let mut p = plan.clone();
                    p[u] = a;
                    m.start_at(&p);
                    assert_eq!(m.get(None), None, "unit {u} {a:?}");
                    m.put(None, Some(s(true, 0, t)));
                    // the same plan built from the base
                    m.start_at(&plan);
                    m.set(u, a);
                    assert_eq!(m.get(None), Some(Some(s(true, 0, t))));
                    t += 1.0;
                }
            }
        }
        assert_eq!(m.len(), 1 + 70 * 2);
    }

    #[test]
    fn keys_packed_apart_are_the_memos_own() {
        // A key packed by a caller (threads sharing a memo) names the same plan as the memo's own.
        let mut m = ScoreMemo::new(70, true);
        let plan: Vec<Action> = (0..70).map(|u| Action::ALL[(u * 7) % 3]).collect();
        let mut key = vec![123; 9];
        pack(&plan, &mut key);
        assert_eq!(key.len(), 3);
        m.put_key(&key, None, Some(s(true, 0, 4.0)));
        m.start_at(&plan);
        assert_eq!(m.get(None), Some(Some(s(true, 0, 4.0))));
        m.set(69, Swap);
        m.put(Some(s(true, 0, 1.0)), None);
        let mut other = plan.clone();
        other[69] = Swap;
        pack(&other, &mut key);
        assert_eq!(m.get_key(&key, Some(s(true, 0, 1.0))), Some(None));
        assert_eq!(m.get_key(&key, None), None);
        // peeking answers alike and counts nothing
        let hits = m.hits;
        assert_eq!(m.peek_key(&key, Some(s(true, 0, 1.0))), Some(None));
        assert_eq!(m.peek_key(&key, Some(s(false, 7, 0.0))), None);
        pack(&plan, &mut key);
        assert_eq!(m.peek_key(&key, Some(s(true, 0, 5.0))), Some(Some(s(true, 0, 4.0))));
        assert_eq!(m.hits, hits);
    }

    #[test]
    fn a_disabled_memo_knows_nothing() {
        let mut m = ScoreMemo::new(3, false);
        m.start_at(&[Retain, Swap, Recompute]);
        m.put(None, Some(s(true, 0, 1.0)));
        assert_eq!(m.get(None), None);
        assert!(m.is_empty());
    }

    #[test]
    fn the_older_generation_is_dropped_after_the_next() {
        let mut m = ScoreMemo::new(64, true);
        let plan = |i: usize| -> Vec<Action> { (0..64).map(|u| Action::ALL[(i >> (u % 20)) & 1]).collect() };
        for i in 0..2 * GENERATION + 1 {
            m.start_at(&plan(i));
            m.put(None, Some(s(true, 0, i as f64)));
        }
        assert!(m.len() <= 2 * GENERATION);
        m.start_at(&plan(0));
        assert_eq!(m.get(None), None, "the first plan was dropped");
        m.start_at(&plan(2 * GENERATION));
        assert_eq!(m.get(None), Some(Some(s(true, 0, (2 * GENERATION) as f64))));
    }
}
