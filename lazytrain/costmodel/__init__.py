"""Seconds and bytes per layer and per link, from the specs. Pure Python, no torch."""

from .layers import (NVME_ACT_STAGING_LAYERS, NVME_STATE_SETS, JobCosts, LayerCost, job_costs,
                     optimizer_traffic_per_param)

__all__ = ["NVME_ACT_STAGING_LAYERS", "NVME_STATE_SETS", "JobCosts", "LayerCost", "job_costs",
           "optimizer_traffic_per_param"]
