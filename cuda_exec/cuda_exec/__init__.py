"""tensorplace's plan executor.

- :mod:`cuda_exec.units`: units (module invocations) and saved-tensor ownership, shared with the
  profiler.
- :mod:`cuda_exec.executor`: :class:`PlannedModule` trains a model under a plan of retain / swap /
  recompute per unit.
- :mod:`cuda_exec.delta_policy`: :class:`DeltaModule` trains a model under DELTA's runtime policy
  (no plan: releases decided during the step from a live memory counter, :mod:`cuda_exec.live_memory`).
- :mod:`cuda_exec.cpu_backend`: the CPU host tier (numpy or mmap memory, one copy thread, an
  optional bandwidth cap); :mod:`cuda_exec.cuda_backend`: pinned memory and a copy stream on CUDA.
- :mod:`cuda_exec.state_swap`: :class:`StateSwapper` keeps parameters and optimizer state in the
  host tier between optimizer steps (a plan's ``state_swaps``).
- :mod:`cuda_exec.memory`: the peak of torch's own allocation records for one step.
- :mod:`cuda_exec.verify`: checksums for verify mode (``TENSORPLACE_VERIFY=1``).
"""

from .cpu_backend import CpuBackend
from .delta_policy import DeltaBudgetWarning, DeltaModule, DeltaStats
from .executor import (
    ACTIONS,
    Executor,
    PlanMismatchError,
    PlannedModule,
    ReplayError,
    StepAbortedError,
    StepStats,
    execute,
    read_plan,
)
from .memory import MemoryTrace, measure_peak, memory_trace, resident_state_bytes
from .state_swap import StateSwapError, StateSwapper
from .units import UnitRecord, UnitTracker, discover_units, is_replaying, sequence_mismatch, unit_kind
from .verify import VerificationError

__all__ = [
    "ACTIONS",
    "CpuBackend",
    "DeltaBudgetWarning",
    "DeltaModule",
    "DeltaStats",
    "Executor",
    "MemoryTrace",
    "PlanMismatchError",
    "PlannedModule",
    "ReplayError",
    "StepAbortedError",
    "StateSwapError",
    "StateSwapper",
    "StepStats",
    "UnitRecord",
    "UnitTracker",
    "VerificationError",
    "discover_units",
    "execute",
    "is_replaying",
    "measure_peak",
    "memory_trace",
    "read_plan",
    "resident_state_bytes",
    "sequence_mismatch",
    "unit_kind",
]
