//! The dimensions a search moves in: groups of units that share one action.
//!
//! The full space has one dimension per unit. The block-wise search (crate::blockwise) ties the
//! units at the same place of every block of a class of equal blocks into one dimension, then
//! unties the blocks step by step. A plan of a space is a full plan (one action per unit) whose
//! units of each group share an action; the swarm, the polish and path relinking change one
//! dimension (a whole group) at a time.
//!
//! A space also says which actions a dimension may take: all three, or retain and recompute
//! only (plans for an engine that cannot swap, such as torch's compiled selective checkpointing).

use crate::action::Action;

/// The actions of a space without swaps.
const NO_SWAP: [Action; 2] = [Action::Retain, Action::Recompute];

#[derive(Debug, Clone, PartialEq)]
pub struct Space {
    n: usize,
    /// The units of dimension k: `units[offsets[k]..offsets[k + 1]]`, ascending.
    units: Vec<usize>,
    offsets: Vec<usize>,
    /// The actions a dimension may take.
    actions: &'static [Action],
}

impl Space {
    /// One dimension per unit.
    pub fn full(n: usize) -> Space {
        Space { n, units: (0..n).collect(), offsets: (0..=n).collect(), actions: &Action::ALL }
    }

    /// A space from groups that cover every unit of `n` once; dimensions are ordered by their
    /// first unit.
    pub fn from_groups(n: usize, mut groups: Vec<Vec<usize>>) -> Space {
        for g in &mut groups {
            g.sort_unstable();
        }
        groups.retain(|g| !g.is_empty());
        groups.sort_by_key(|g| g[0]);
        let mut seen = vec![false; n];
        for &u in groups.iter().flatten() {
            assert!(u < n && !seen[u], "unit {u} is in two groups or out of range");
            seen[u] = true;
        }
        assert!(seen.iter().all(|&s| s), "every unit is in a group");
        let mut offsets = vec![0];
        let mut units = Vec::with_capacity(n);
        for g in groups {
            units.extend(g);
            offsets.push(units.len());
        }
        Space { n, units, offsets, actions: &Action::ALL }
    }

    /// The same dimensions, with retain and recompute only.
    pub fn without_swaps(mut self) -> Space {
        self.actions = &NO_SWAP;
        self
    }

    /// The actions a dimension may take (in `Action::ALL` order).
    pub fn actions(&self) -> &'static [Action] {
        self.actions
    }

    pub fn allows(&self, a: Action) -> bool {
        self.actions.contains(&a)
    }

    pub fn units(&self) -> usize {
        self.n
    }

    pub fn dims(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_full(&self) -> bool {
        self.dims() == self.n
    }

    /// The units of dimension `k`, ascending.
    pub fn group(&self, k: usize) -> &[usize] {
        &self.units[self.offsets[k]..self.offsets[k + 1]]
    }

    /// The first unit of dimension `k`.
    pub fn first(&self, k: usize) -> usize {
        self.units[self.offsets[k]]
    }

    /// The action of dimension `k` in a plan of this space.
    pub fn action(&self, plan: &[Action], k: usize) -> Action {
        plan[self.first(k)]
    }

    /// Set dimension `k` of `plan` to `a`.
    pub fn set(&self, plan: &mut [Action], k: usize, a: Action) {
        for &u in self.group(k) {
            plan[u] = a;
        }
    }

    /// Put dimension `k` of `plan` back to what it is in `from`.
    pub fn reset(&self, plan: &mut [Action], k: usize, from: &[Action]) {
        for &u in self.group(k) {
            plan[u] = from[u];
        }
    }

    /// A plan of this space from one action per dimension.
    pub fn expand(&self, per_dim: &[Action]) -> Vec<Action> {
        let mut plan = vec![Action::Retain; self.n];
        for (k, &a) in per_dim.iter().enumerate() {
            self.set(&mut plan, k, a);
        }
        plan
    }

    /// The nearest plan of this space to any plan: each group takes its most frequent action
    /// (the first in `Action::ALL` order on a tie).
    pub fn project(&self, plan: &[Action]) -> Vec<Action> {
        if self.is_full() {
            return plan.to_vec();
        }
        let mut out = plan.to_vec();
        for k in 0..self.dims() {
            let mut count = [0usize; 3];
            for &u in self.group(k) {
                count[Action::ALL.iter().position(|&a| a == plan[u]).expect("an action")] += 1;
            }
            let best = (0..3).fold(0, |b, i| if count[i] > count[b] { i } else { b });
            self.set(&mut out, k, Action::ALL[best]);
        }
        out
    }

    /// Whether `plan` is a plan of this space.
    pub fn contains(&self, plan: &[Action]) -> bool {
        (0..self.dims()).all(|k| self.group(k).iter().all(|&u| plan[u] == self.action(plan, k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    #[test]
    fn groups_share_an_action() {
        let s = Space::from_groups(5, vec![vec![3, 1], vec![0], vec![4, 2]]);
        assert_eq!(s.dims(), 3);
        assert_eq!(s.group(1), &[1, 3]);
        let p = s.expand(&[Swap, Recompute, Retain]);
        assert_eq!(p, vec![Swap, Recompute, Retain, Recompute, Retain]);
        assert!(s.contains(&p));
        assert!(!s.contains(&[Swap, Recompute, Retain, Retain, Retain]));
        assert_eq!(s.project(&[Swap, Recompute, Swap, Retain, Swap]), vec![Swap, Retain, Swap, Retain, Swap]);
        assert_eq!(Space::full(3).project(&[Swap, Retain, Swap]), vec![Swap, Retain, Swap]);
    }

    #[test]
    #[should_panic(expected = "every unit")]
    fn a_space_covers_every_unit() {
        Space::from_groups(3, vec![vec![0], vec![2]]);
    }
}
