//! The checkpointing recipes a PyTorch user reaches for first, as plans: per-block checkpoint
//! (`torch.utils.checkpoint` around every repeated block) and Chen et al.'s sqrt(n) segments.
//!
//! Under the cost model a run of consecutive recomputed units, split at segment starts, is one
//! checkpoint segment: its replay regenerates every value of the run, and it holds its inputs from
//! the forward (docs/cost-model.md). So a recipe is "recompute every unit of each segment, start a
//! segment at each first unit"; units outside the segments are retained.

use crate::action::Action;
use crate::profile::Profile;

/// A unit's module path without the call suffix (`layer1.0.relu#1` -> `layer1.0.relu`).
fn module_path(name: &str) -> &str {
    name.split('#').next().unwrap_or(name)
}

/// Consecutive unit ranges `[first, last]` that are repeated blocks: runs of units inside the same
/// module at one depth of the module tree (from the unit names), whose structure (relative names
/// and kinds) occurs at least twice. The depth that covers the most units wins (the coarsest on a
/// tie). Ranges of a single unit are left out. Empty when nothing repeats.
pub fn repeated_blocks(profile: &Profile) -> Vec<(usize, usize)> {
    let mut blocks: Vec<(usize, usize)> = repeated_block_classes(profile).into_iter().flatten().collect();
    blocks.sort_unstable();
    blocks
}

/// The repeated blocks (`repeated_blocks`) by class: blocks of the same structure (relative
/// names and kinds) in one class, in unit order; classes in the order of their first block.
pub fn repeated_block_classes(profile: &Profile) -> Vec<Vec<(usize, usize)>> {
    let units = &profile.units;
    let max_depth = units.iter().map(|u| module_path(&u.name).split('.').count()).max().unwrap_or(0);
    let mut best: (usize, Vec<Vec<(usize, usize)>>) = (0, Vec::new());
    for depth in 1..max_depth {
        // Runs of consecutive units strictly inside the same module at this depth.
        let key = |i: usize| -> Option<String> {
            let parts: Vec<&str> = module_path(&units[i].name).split('.').collect();
            (parts.len() > depth).then(|| parts[..depth].join("."))
        };
        let mut groups: Vec<(usize, usize, String)> = Vec::new();
        let mut i = 0;
        while i < units.len() {
            match key(i) {
                Some(k) => {
                    let mut j = i;
                    while j + 1 < units.len() && key(j + 1).as_deref() == Some(k.as_str()) {
                        j += 1;
                    }
                    groups.push((i, j, k));
                    i = j + 1;
                }
                None => i += 1,
            }
        }
        let signature = |&(a, b, ref k): &(usize, usize, String)| -> Vec<(String, String)> {
            (a..=b).map(|u| (units[u].name[k.len()..].to_string(), units[u].kind.clone())).collect()
        };
        let sigs: Vec<Vec<(String, String)>> = groups.iter().map(signature).collect();
        let mut classes: Vec<(&Vec<(String, String)>, Vec<(usize, usize)>)> = Vec::new();
        for ((a, b, _), sig) in groups.iter().zip(&sigs) {
            if b > a && sigs.iter().filter(|s| *s == sig).count() >= 2 {
                match classes.iter_mut().find(|(s, _)| *s == sig) {
                    Some((_, blocks)) => blocks.push((*a, *b)),
                    None => classes.push((sig, vec![(*a, *b)])),
                }
            }
        }
        let covered: usize = classes.iter().flat_map(|(_, b)| b).map(|(a, b)| b - a + 1).sum();
        if covered > best.0 {
            best = (covered, classes.into_iter().map(|(_, b)| b).collect());
        }
    }
    best.1
}

/// Checkpoint every range: (actions, segment starts). Each unit of a range is recomputed and each
/// range starts a segment; units outside the ranges are retained.
pub fn checkpoint_ranges(n: usize, ranges: &[(usize, usize)]) -> (Vec<Action>, Vec<bool>) {
    let mut actions = vec![Action::Retain; n];
    let mut starts = vec![false; n];
    for &(a, b) in ranges {
        starts[a] = true;
        for act in actions.iter_mut().take(b + 1).skip(a) {
            *act = Action::Recompute;
        }
    }
    (actions, starts)
}

/// Per-block checkpoint at the repeated blocks of the profile (None when nothing repeats). The
/// segment starts are the profile graph's default ones.
pub fn checkpoint_blocks(profile: &Profile) -> Option<Vec<Action>> {
    let blocks = repeated_blocks(profile);
    (!blocks.is_empty()).then(|| checkpoint_ranges(profile.units.len(), &blocks).0)
}

/// Chen et al.'s sqrt(n) checkpointing (torch's checkpoint_sequential): ceil(sqrt(n)) segments of
/// equal length, each recomputed from its input, the last one retained (torch runs the last
/// segment without checkpoint). Returns (actions, segment starts).
pub fn sqrt_segments(n: usize) -> (Vec<Action>, Vec<bool>) {
    let k = (n as f64).sqrt().ceil().max(1.0) as usize;
    let len = n.div_ceil(k).max(1);
    let ranges: Vec<(usize, usize)> = (0..n).step_by(len).map(|a| (a, (a + len - 1).min(n - 1))).collect();
    let kept = ranges.len().saturating_sub(1);
    checkpoint_ranges(n, &ranges[..kept])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_recompute_their_units_and_start_segments() {
        use Action::*;
        let (a, s) = checkpoint_ranges(6, &[(1, 2), (3, 4)]);
        assert_eq!(a, vec![Retain, Recompute, Recompute, Recompute, Recompute, Retain]);
        assert_eq!(s, vec![false, true, false, true, false, false]);
    }

    #[test]
    fn sqrt_segments_recompute_all_but_the_last_segment() {
        for n in [1usize, 2, 5, 16, 17, 100] {
            let (a, s) = sqrt_segments(n);
            assert_eq!(a.len(), n);
            let k = (n as f64).sqrt().ceil() as usize;
            let segments = s.iter().filter(|&&x| x).count();
            assert!(segments < k.max(1), "n={n}: {segments} checkpointed segments, sqrt gives {k}");
            assert_eq!(a[n - 1], Action::Retain, "n={n}: the last segment is not checkpointed");
            if n >= 4 {
                assert!(a[0] == Action::Recompute && s[0], "n={n}: the first segment is checkpointed");
            }
        }
    }
}
