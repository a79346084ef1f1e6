"""The planner: MILP over checkpointing, tiers and transfers. Imports no torch."""

from .heuristics import HEURISTICS
from .plan import LayerDecision, Plan, PlannerOptions, Predicted, SolverInfo
from .solve import (InfeasiblePlanError, best_split, max_batch, min_device_bytes, plan_job,
                    simulate_plan)


def heuristic_plan(name: str, model, hw, job, options: PlannerOptions = PlannerOptions(), **kw) -> Plan:
    """Score a hand-written checkpoint policy with the planner's cost model (see heuristics.py)."""
    return plan_job(model, hw, job, options, method=f"heuristic:{name}", **kw)


__all__ = ["HEURISTICS", "InfeasiblePlanError", "LayerDecision", "Plan", "PlannerOptions", "Predicted",
           "SolverInfo", "best_split", "heuristic_plan", "max_batch", "min_device_bytes", "plan_job",
           "simulate_plan"]
