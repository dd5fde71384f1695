//! Block-wise search for models of repeated blocks (Transformer layers, ResNet stages).
//!
//! A model of L equal blocks has L times the units of one block, and the search over every unit
//! costs about L^2.5 as much (docs/benchmarks.md). But the blocks' internal plans are mostly the
//! same, and what differs between blocks is how much of the budget each gets (the two-level
//! decomposition of torch's SAC ILP and torchtitan's per-layer memory policy). So:
//!
//! 1. **One plan per class of equal blocks.** Units at the same place of every block of a class
//!    (crate::recipes::repeated_block_classes) are tied into one dimension (crate::space); units
//!    outside the blocks keep their own. The swarm, its polish, restarts and path relinking
//!    (crate::pso) run in that space: a few dozen dimensions whatever the depth.
//! 2. **The budget split across blocks.** The blocks of each class are then untied in halves:
//!    each half of the blocks (in model order) gets its own plan, then each quarter, and so on to
//!    single blocks, every level polished from the best plan so far (crate::polish: single and
//!    pair changes, ejection chains, which trade memory between the halves). Early blocks can so
//!    swap what late ones, whose copies have no time to hide, retain or recompute.
//! 3. **Globally.** The last level, every block on its own, is the space of all units: the polish
//!    there is the global one.
//!
//! Each level only keeps a plan better than the one it started from, so the result is never
//! worse than the best plan with one plan per class. In the larger spaces an ejection chain
//! repairs near its first change only ([`LOCAL_CHAINS_DIMS`], [`CHAIN_WINDOW`]); trades between
//! far blocks are made at the coarser levels.
//!
//! By default (`PsoSettings::block_wise` None) profiles with repeated blocks of more than
//! [`FULL_SEARCH_UNITS`] units are searched this way, smaller ones over every unit: on the
//! profiles of docs/methods.md's table (all smaller) the search over every unit finds plans as fast
//! or faster, at a cost that grows about as units^2.5 (docs/benchmarks.md has both measured).

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{EvalOptions, Score};
use crate::polish::{Memos, Polisher};
use crate::profile::Graph;
use crate::pso::{pipeline, Phase, PsoSettings, Trace};
use crate::space::Space;
use crate::threads::Threads;
use std::time::Instant;

/// By default, profiles of more units than this with repeated blocks are searched block-wise;
/// smaller ones (every profile of docs/methods.md's table) by the search over every unit, whose
/// cost grows about as units^2.5 (docs/benchmarks.md).
pub const FULL_SEARCH_UNITS: usize = 400;

/// In spaces of more dimensions than this, an ejection chain repairs only within
/// [`CHAIN_WINDOW`] dimensions of its first change (a repair otherwise tries every dimension:
/// the polish's cost would grow as dimensions^2).
pub const LOCAL_CHAINS_DIMS: usize = 200;

/// How far (in dimensions: places of blocks, in model order) a repair may be from its chain's
/// first change in the large spaces: about six TinyGPT layers.
pub const CHAIN_WINDOW: usize = 64;

/// Check block classes against a profile of `n` units: ranges inside it, not overlapping, each
/// class's blocks of one length.
pub fn check_blocks(n: usize, classes: &[Vec<(usize, usize)>]) -> Result<()> {
    let mut used = vec![false; n];
    for class in classes {
        let Some(&(a0, b0)) = class.first() else { continue };
        for &(a, b) in class {
            if a > b || b >= n {
                return Err(CoreError::InvalidSetting(format!(
                    "block ({a}, {b}) is not a range of units of this {n}-unit profile"
                )));
            }
            if b - a != b0 - a0 {
                return Err(CoreError::InvalidSetting(format!(
                    "blocks ({a0}, {b0}) and ({a}, {b}) of one class differ in length; a class's blocks have the same units"
                )));
            }
            for u in a..=b {
                if std::mem::replace(&mut used[u], true) {
                    return Err(CoreError::InvalidSetting(format!("unit {u} is in two blocks")));
                }
            }
        }
    }
    Ok(())
}

/// Whether the search is block-wise: the profile has repeated blocks, and `block_wise` says so
/// or (None) it has more than [`FULL_SEARCH_UNITS`] units.
pub fn block_wise(n: usize, settings: &PsoSettings) -> bool {
    settings.blocks.iter().any(|c| c.len() >= 2) && settings.block_wise.unwrap_or(n > FULL_SEARCH_UNITS)
}

/// The spaces of the block-wise search, coarsest first: the blocks of each class tied, then in
/// 2, 4, ... groups of consecutive blocks, to one block per group (the space of all units).
pub fn levels(n: usize, classes: &[Vec<(usize, usize)>]) -> Vec<Space> {
    let most = classes.iter().map(|c| c.len()).max().unwrap_or(1);
    let mut spaces = Vec::new();
    let mut parts = 1usize;
    loop {
        let mut in_block = vec![false; n];
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for class in classes {
            let k = parts.min(class.len());
            let len = class[0].1 - class[0].0 + 1;
            for part in 0..k {
                // Blocks [part * L / k, (part + 1) * L / k) of the class.
                let blocks = &class[part * class.len() / k..(part + 1) * class.len() / k];
                for offset in 0..len {
                    groups.push(blocks.iter().map(|&(a, _)| a + offset).collect());
                }
            }
            for &(a, b) in class {
                in_block[a..=b].iter_mut().for_each(|x| *x = true);
            }
        }
        groups.extend((0..n).filter(|&u| !in_block[u]).map(|u| vec![u]));
        spaces.push(Space::from_groups(n, groups));
        if parts >= most {
            break;
        }
        parts *= 2;
    }
    spaces
}

/// The block-wise search (module documentation): the best plan found. Phases are recorded in
/// `trace`, whose convergence record is the first swarm's.
pub fn search(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    settings: &PsoSettings,
    pool: &Threads,
    trace: &mut Trace,
    on_iteration: &mut dyn FnMut(usize, &Score),
) -> (Vec<Action>, Score) {
    let classes: Vec<Vec<(usize, usize)>> = settings.blocks.iter().filter(|c| c.len() >= 2).cloned().collect();
    let mut spaces = levels(g.n, &classes);
    if !settings.swaps {
        spaces = spaces.into_iter().map(Space::without_swaps).collect();
    }
    let (mut best, _) = pipeline(g, budget, opts, settings, pool, &spaces[0], &settings.seeds, trace, "blocks:", on_iteration);
    // The swarm starts from the seeds (the heuristics' plans, the recipes) made plans of the tied
    // space; the seeds themselves are candidates too, so the result is never worse than any.
    let ctx = crate::incremental::Context::new(g, budget, opts);
    let mut w = crate::incremental::Worker::new(g.n);
    let mut best_seed: Option<(Vec<Action>, Score)> = None;
    for seed in &settings.seeds {
        let s = ctx.score_full(seed, None, &mut w).expect("no bound");
        if best_seed.as_ref().map_or(true, |(_, b)| s.better_than(b)) {
            best_seed = Some((seed.clone(), s));
        }
    }
    let keep_seed = |best: (Vec<Action>, Score)| match &best_seed {
        Some((p, s)) if s.better_than(&best.1) => (p.clone(), *s),
        _ => best,
    };
    if !settings.polish {
        return keep_seed(best);
    }
    let mut memos = Memos::new(g.n, settings.memo);
    for (k, space) in spaces.iter().enumerate().skip(1) {
        let clock = Instant::now();
        let mut polisher = Polisher::new(g, budget, opts, pool, space);
        polisher.memos = std::mem::take(&mut memos);
        let optimal = polisher.is_optimal(&best.1);
        if optimal && k + 1 < spaces.len() {
            // No plan is faster: only the last level's tidy is left.
            continue;
        }
        if space.dims() > LOCAL_CHAINS_DIMS {
            polisher.chain_window = Some(CHAIN_WINDOW);
        }
        let (p, s) = if optimal { polisher.tidied(best.0.clone(), best.1) } else { polisher.polish(best.0.clone(), best.1) };
        if s.better_than(&best.1) || optimal {
            best = (p, s);
        }
        memos = std::mem::take(&mut polisher.memos);
        trace.phases.push(Phase {
            name: format!("blocks:{} {} dims", if optimal { "tidy" } else { "polish" }, space.dims()),
            seconds: clock.elapsed().as_secs_f64(),
            evaluations: polisher.evaluations(),
            stages: polisher.stages(),
            best: best.1.feasible.then_some(best.1.time),
        });
    }
    keep_seed(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_untie_blocks_in_halves_down_to_single_units() {
        // Units 0 and 9 outside; a class of 4 blocks of 2 units (1-8).
        let classes = vec![vec![(1, 2), (3, 4), (5, 6), (7, 8)]];
        let spaces = levels(10, &classes);
        assert_eq!(spaces.len(), 3);
        assert_eq!(spaces[0].dims(), 2 + 2);
        assert_eq!(spaces[0].group(1), &[1, 3, 5, 7]);
        assert_eq!(spaces[1].dims(), 2 + 4);
        assert!(spaces[1].is_full() == false);
        assert!(spaces[2].is_full());
        // A plan of a coarser level is a plan of every finer one.
        let p = spaces[0].expand(&[Action::Swap, Action::Recompute, Action::Retain, Action::Swap]);
        assert!(spaces.iter().all(|s| s.contains(&p)));
    }

    #[test]
    fn bad_blocks_are_refused() {
        assert!(check_blocks(5, &[vec![(0, 1), (2, 4)]]).is_err());
        assert!(check_blocks(5, &[vec![(0, 1), (1, 2)]]).is_err());
        assert!(check_blocks(5, &[vec![(3, 5)]]).is_err());
        assert!(check_blocks(5, &[vec![(0, 1), (2, 3)]]).is_ok());
    }
}
