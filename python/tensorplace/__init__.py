"""tensorplace: fit PyTorch training into a memory budget.

Profile one training step, search per-unit actions (retain, swap to host, recompute) that
minimise step time under a budget, and train under that plan::

    import tensorplace as tp
    plan = tp.plan(model, example_inputs, budget="6GiB")
    fast = tp.run(model, plan)

The planner works on profiles too: ``tp.plan_profile(tp.examples.profile("vgg16"), "4GiB")``.
``tp.allocator`` simulates what an allocation sequence costs in reserved memory under PyTorch's
CUDA caching allocator, and replays recorded allocator traces. ``tp.plan_jobs`` splits one
budget across several jobs; ``tp.accumulate`` trains a moDNN plan's sub-batches. A planned step
that cannot follow its plan raises ``tp.PlanMismatchError`` (the model ran otherwise than in the
executor's first step) or ``tp.ReplayError`` (a recomputed unit cannot be replayed), with its
hooks released.
"""

from . import allocator, examples
from .accumulate import accumulate
from .compiled_engine import CompiledPathError, CompiledPlan, compiled
from .compiled_cost import CompiledCostModel, plan_compiled
from .api import plan, run
from .unplanned_memory import UnplannedMemoryWarning
from .runtime import DeltaRuntime, delta
from ._core import BudgetError, PlannerError
from cuda_exec.errors import PlanMismatchError, ReplayError, StepAbortedError
from .budget import format_bytes, parse_budget
from .jobs import JobPlans, plan_jobs
from .planning import (
    Plan,
    allocation_sequence,
    evaluate,
    load_profile,
    lower_bound,
    plan_profile,
    save_profile,
    unplanned_peak,
)

# BudgetError is raised with (message, smallest budget known to work): print the message alone,
# and name the budget
BudgetError.__str__ = lambda self: str(self.args[0]) if self.args else ""  # type: ignore[method-assign]
BudgetError.smallest_budget = property(  # type: ignore[attr-defined]
    lambda self: int(self.args[1]) if len(self.args) > 1 and self.args[1] is not None else None,
    doc="The smallest budget (bytes) a known plan meets, or None.",
)


__all__ = [
    "accumulate",
    "compiled",
    "CompiledCostModel",
    "plan_compiled",
    "CompiledPathError",
    "CompiledPlan",
    "allocation_sequence",
    "delta",
    "allocator",
    "plan",
    "run",
    "BudgetError",
    "DeltaRuntime",
    "JobPlans",
    "Plan",
    "PlannerError",
    "PlanMismatchError",
    "ReplayError",
    "StepAbortedError",
    "UnplannedMemoryWarning",
    "evaluate",
    "examples",
    "format_bytes",
    "load_profile",
    "lower_bound",
    "parse_budget",
    "plan_jobs",
    "plan_profile",
    "save_profile",
    "unplanned_peak",
]
__version__ = "0.1.0"
