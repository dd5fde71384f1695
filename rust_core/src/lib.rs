//! tensorplace's planner core: plain Rust, no Python (the PyO3 layer is `python.rs`, behind the
//! `python` feature).
//!
//! - [`profile`]: the Profile format and its validated graph.
//! - [`evaluator`]: the time-cost model (HOME Algorithm 2), docs/cost-model.md.
//! - [`state_swap`]: parameters and optimizer state swapped across iterations (TENSILE).
//! - [`peak`]: peak analysis and the lower bound of any plan.
//! - [`pso`]: HOME's particle swarm search (Algorithms 1 and 3); [`polish`]: the local search
//!   after it; [`relink`]: path relinking between polished plans, last; [`blockwise`]: the
//!   search of models of repeated blocks, one plan per class of blocks first; [`space`]: the
//!   dimensions these searches move in; [`threads`]: the threads they evaluate on.
//! - [`incremental`]: the search's moves evaluated from saved states, stopped by a bound;
//!   [`memo`]: the scores the search already knows.
//! - [`exhaustive`]: every plan of a tiny profile.
//! - [`methods`]: the heuristic planners of the papers (Capuchin, SuperNeurons, vDNN, TENSILE).
//! - [`recipes`]: per-block and sqrt(n) checkpointing as plans.
//! - [`planner`]: budget checks and method dispatch; [`plan`]: the Plan format.
//! - [`alloc_sequence`]: the evaluator's allocation sequence; [`reserved`]: reserved-memory budgets;
//!   [`memory_curve`]: allocated and reserved memory over the step.
//! - [`allocator`]: reserved memory of an allocation sequence under PyTorch's caching allocator
//!   or moDNN's offset pool; replay of recorded allocator traces.

pub mod action;
pub mod alloc_sequence;
pub mod allocator;
pub mod blockwise;
pub mod error;
pub mod evaluator;
pub mod exhaustive;
pub mod incremental;
pub mod memo;
pub mod memory_curve;
pub mod methods;
pub mod peak;
pub mod plan;
pub mod planner;
pub mod polish;
pub mod profile;
pub mod relink;
pub mod pso;
pub mod recipes;
pub mod reserved;
pub mod space;
pub mod state_swap;
pub mod threads;
pub mod versioned;

#[cfg(feature = "python")]
mod python;

pub use action::Action;
pub use error::{CoreError, Result};
pub use evaluator::{evaluate, evaluate_segments, evaluate_with_swaps, CopyEvent, EvalOptions, Moved, Outcome, Score, Scratch, Stage};
pub use state_swap::StateSwaps;
pub use plan::Plan;
pub use profile::{Graph, Profile};
