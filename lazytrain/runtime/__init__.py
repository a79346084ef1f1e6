"""Layer-streaming executor: runs a Plan (prefetch / compute / offload / recompute / evict, one trace)."""

from .accountant import DeviceBudgetExceeded, MemoryAccountant
from .executor import PlanMismatchError, StepResult, StreamingExecutor

__all__ = ["DeviceBudgetExceeded", "MemoryAccountant", "PlanMismatchError", "StepResult",
           "StreamingExecutor"]
