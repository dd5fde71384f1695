//! Errors of the planner core: each says what is wrong and what would fix it.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum CoreError {
    /// The profile or plan JSON could not be read.
    Format(String),
    /// The profile is structurally invalid (cycle, unknown input, negative size, ...).
    InvalidProfile(String),
    /// A plan does not fit the profile it is applied to.
    InvalidPlan(String),
    /// The budget is below what any plan can reach.
    BudgetBelowLowerBound { budget: u64, lower_bound: u64, smallest_known: u64 },
    /// The search found no plan within the budget.
    NoFeasiblePlan { budget: u64, smallest_known: u64, lower_bound: u64 },
    /// A method that does not search (a heuristic, a recipe) made no plan within the budget;
    /// it meets `method_smallest` (None: not even at the unplanned peak), a simple plan
    /// `smallest_known`.
    MethodNeedsMore { method: String, budget: u64, method_smallest: Option<u64>, smallest_known: u64 },
    /// No plan was found whose simulated reserved memory fits a reserved budget.
    NoReservedPlan { budget: u64, smallest_known: u64, alloc_conf: String, rounds: usize },
    /// A search setting is out of range.
    InvalidSetting(String),
    /// An allocator trace or event sequence that cannot be replayed.
    InvalidTrace(String),
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::Format(m) => write!(f, "cannot read file: {m}"),
            CoreError::InvalidProfile(m) => write!(f, "invalid profile: {m}"),
            CoreError::InvalidPlan(m) => write!(f, "invalid plan: {m}"),
            CoreError::BudgetBelowLowerBound { budget, lower_bound, smallest_known } => write!(
                f,
                "budget {budget} bytes ({}) is below the lower bound of any plan for this profile, \
                 {lower_bound} bytes ({}); the smallest budget a known plan meets is {smallest_known} bytes ({}): \
                 give at least that, or use a smaller batch",
                mib(*budget),
                mib(*lower_bound),
                mib(*smallest_known)
            ),
            CoreError::NoFeasiblePlan { budget, smallest_known, lower_bound } if smallest_known <= budget => write!(
                f,
                "this method found no plan within the budget of {budget} bytes ({}), but a simple plan \
                 (all swap or all recompute) meets {smallest_known} bytes ({}) (lower bound {lower_bound} bytes): \
                 use method=\"pso\", which searches every plan, or raise the budget",
                mib(*budget),
                mib(*smallest_known)
            ),
            CoreError::MethodNeedsMore { method, budget, method_smallest: Some(own), smallest_known } => write!(
                f,
                "method {method:?} found no plan within the budget of {budget} bytes ({}); its plans fit from \
                 {own} bytes ({}), and a simple plan (all swap or all recompute) meets {smallest_known} bytes ({}): \
                 give {method:?} at least {own} bytes, or use method=\"pso\", which searches every plan",
                mib(*budget),
                mib(*own),
                mib(*smallest_known)
            ),
            CoreError::MethodNeedsMore { method, budget, method_smallest: None, smallest_known } => write!(
                f,
                "method {method:?} found no plan within the budget of {budget} bytes ({}), nor at the unplanned \
                 peak; a simple plan (all swap or all recompute) meets {smallest_known} bytes ({}): use \
                 method=\"pso\", which searches every plan",
                mib(*budget),
                mib(*smallest_known)
            ),
            CoreError::NoFeasiblePlan { budget, smallest_known, lower_bound } => write!(
                f,
                "no plan found within the budget of {budget} bytes ({}); the smallest budget a known plan \
                 meets is {smallest_known} bytes ({}) (lower bound {lower_bound} bytes): raise the budget \
                 to at least {smallest_known} bytes, or search longer",
                mib(*budget),
                mib(*smallest_known)
            ),
            CoreError::NoReservedPlan { budget, smallest_known, alloc_conf, rounds } => write!(
                f,
                "no plan found whose reserved memory fits the reserved budget of {budget} bytes ({}) under \
                 PYTORCH_CUDA_ALLOC_CONF={alloc_conf:?} ({rounds} searches on allocated budgets between the lower bound \
                 and the budget, and the all-swap and all-recompute plans); the smallest reserved budget a plan found \
                 meets is {smallest_known} bytes ({}): give at least that, or turn on expandable segments \
                 (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts, and in the profile)",
                mib(*budget),
                mib(*smallest_known)
            ),
            CoreError::InvalidSetting(m) => write!(f, "invalid setting: {m}"),
            CoreError::InvalidTrace(m) => write!(f, "invalid allocator events: {m}"),
        }
    }
}

impl std::error::Error for CoreError {}

pub type Result<T> = std::result::Result<T, CoreError>;
