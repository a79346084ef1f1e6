"""Seconds and bytes per layer and per link, from the specs. Pure Python, no torch."""

from .layers import JobCosts, LayerCost, job_costs

__all__ = ["JobCosts", "LayerCost", "job_costs"]
