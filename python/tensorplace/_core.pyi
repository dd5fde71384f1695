"""Type stubs of the compiled planner core (rust_core, built by maturin)."""

from typing import List, Optional, Tuple

PROFILE_VERSION: int
PLAN_VERSION: int
# the methods that plan without a search (a refusal names the smallest budget their plan fits)
NON_SEARCHING_METHODS: List[str]

class PlannerError(ValueError):
    """A profile, plan or setting the planner refuses."""

class BudgetError(PlannerError):
    """The budget cannot be met; args[1] is the smallest budget (bytes) known to work."""

def validate_profile(profile_json: str) -> None: ...
def profile_fingerprint(profile_json: str) -> str: ...
def profile_graph(profile_json: str) -> str: ...
def evaluate(
    profile_json: str,
    actions: List[str],
    budget: int,
    prefetch_lookahead: int = 2,
    segment_starts: Optional[List[int]] = None,
    reserved: bool = False,
    alloc_conf: Optional[str] = None,
    memory_curve: bool = False,
    swap_parameters: Optional[List[int]] = None,
    swap_optimizer_state: Optional[List[int]] = None,
) -> str: ...
def allocation_sequence(
    profile_json: str,
    actions: List[str],
    budget: int,
    prefetch_lookahead: int = 2,
    segment_starts: Optional[List[int]] = None,
    swap_parameters: Optional[List[int]] = None,
    swap_optimizer_state: Optional[List[int]] = None,
) -> str: ...
def lower_bound(profile_json: str, state_swaps: bool = False) -> Tuple[int, str]: ...
def unplanned_peak(profile_json: str) -> int: ...
def smallest_known_budget(
    profile_json: str, prefetch_lookahead: int = 2, state_swaps: bool = False
) -> Tuple[int, List[str]]: ...
def make_plan(
    profile_json: str,
    budget: int,
    method: str = "pso",
    particles: int = 500,
    iterations: int = 500,
    seed: int = 0,
    threads: int = 0,
    seed_extremes: bool = True,
    mutation: float = 0.0,
    patience: Optional[int] = None,
    prefetch_lookahead: int = 2,
    seed_heuristics: bool = True,
    seed_plans: Optional[List[List[str]]] = None,
    budget_kind: str = "allocated",
    alloc_conf: Optional[str] = None,
    reserved_rounds: int = 8,
    restarts: int = 3,
    relinks: int = 6,
    block_wise: Optional[bool] = None,
    swaps: bool = True,
) -> str: ...
def validate_plan(plan_json: str, profile_json: Optional[str] = None) -> str: ...
def check_budget(profile_json: str, budget: int, prefetch_lookahead: int = 2) -> int: ...
def plan_from_actions(
    profile_json: str,
    budget: int,
    actions: List[str],
    method: str,
    settings_json: str = "{}",
    prefetch_lookahead: int = 2,
    segment_starts: Optional[List[int]] = None,
    swap_parameters: Optional[List[int]] = None,
    swap_optimizer_state: Optional[List[int]] = None,
) -> str: ...
def allocator_replay(trace_json: str, options_json: str = "{}") -> str: ...
def allocator_simulate(events_json: str, options_json: str = "{}") -> str: ...
