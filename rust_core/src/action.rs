//! The three things a plan can do with a unit's activations.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Keep the activations on the device from forward to backward.
    Retain,
    /// Copy them to host memory after forward, prefetch them back before backward.
    Swap,
    /// Drop them after forward, replay the unit's forward before its backward.
    Recompute,
}

impl Action {
    pub const ALL: [Action; 3] = [Action::Retain, Action::Swap, Action::Recompute];

    pub fn name(self) -> &'static str {
        match self {
            Action::Retain => "retain",
            Action::Swap => "swap",
            Action::Recompute => "recompute",
        }
    }

    pub fn from_name(s: &str) -> Option<Action> {
        match s {
            "retain" => Some(Action::Retain),
            "swap" => Some(Action::Swap),
            "recompute" => Some(Action::Recompute),
            _ => None,
        }
    }
}
