"""The planner: MILP over checkpointing, tiers and transfers. Imports no torch."""

from .plan import LayerDecision, Plan, PlannerOptions, Predicted, SolverInfo

__all__ = ["LayerDecision", "Plan", "PlannerOptions", "Predicted", "SolverInfo"]
