"""Post-solve simplification. The MILP stops within `planner.mip_gap` of the optimum, and its
tie-breakers (prefer less traffic) sit below that tolerance, so an equally fast plan may stream
parameters from NVMe while the host has room. This pass moves kept activations, parameters and
optimizer/gradient state to faster tiers one at a time, keeping a move only if the simulated step
time does not grow, host and NVMe capacities hold, and the device peak stays at or below the solved
plan's. It never makes a plan slower or its device peak higher."""

from __future__ import annotations

import time
from dataclasses import replace

from ..costmodel import JobCosts
from ..spec import HardwareSpec
from .assignment import Assignment
from .ops import micro_batch_kinds
from .simulate import _lane, _rate, _window_items, memory_peaks

ORDER = {"device": 0, "host": 1, "nvme": 2}


def step_time_s(costs: JobCosts, a: Assignment, hw: HardwareSpec, depth: int = 2) -> float:
    """`simulate(...).step_time_s` without building events: the same kinds of micro-batch (each
    with the `after_held` the simulator gives it, ops.micro_batch_kinds: one whose embedding the
    micro-batch before fetched early finds its first block still held), the same windows and
    lanes (sum over windows of the busiest lane: a resource, or the queue it shares,
    simulate._lane); equal up to float rounding (the simulator adds window by window). This used
    to price every micro-batch as if nothing were held, and on some jobs took a move that the
    simulator, and so the plan, then predicted 1.7% slower."""
    total = 0.0
    for final, after_held, times in micro_batch_kinds(costs.grad_accum, costs.trains_base):
        for items in _window_items(costs, a, hw, final, depth, after_held):
            busy: dict[str, float] = {}
            for res, _, _, _, amount in items:
                rate = _rate(hw, res)
                lane = _lane(hw, res)
                busy[lane] = busy.get(lane, 0.0) + (amount / rate if rate else amount)
            total += times * max(busy.values(), default=0.0)
    return total


def _fits(costs: JobCosts, a: Assignment, depth: int, device_cap: int) -> bool:
    peaks, _ = memory_peaks(costs, a, depth)
    return (peaks["device"] <= device_cap and peaks["host"] <= costs.host_capacity_bytes
            and peaks["nvme"] <= costs.nvme_capacity_bytes)


def simplify(costs: JobCosts, a: Assignment, hw: HardwareSpec, depth: int = 2,
             budget_s: float = 2.0) -> Assignment:
    t_end = time.perf_counter() + budget_s
    best = step_time_s(costs, a, hw, depth)
    # Never raise the device peak above the solved plan's: the planner's memory model is an
    # estimate, and headroom the solver left is kept.
    device_cap = min(costs.device_capacity_bytes, memory_peaks(costs, a, depth)[0]["device"])
    tol = 1e-9 * max(best, 1e-12)

    def try_move(cand: Assignment) -> bool:
        nonlocal a, best
        if not _fits(costs, cand, depth, device_cap):
            return False
        t = step_time_s(costs, cand, hw, depth)
        if t <= best + tol:
            a, best = cand, min(best, t)
            return True
        return False

    # kept activations, then parameters, then optimizer and gradient state: fastest tier first
    for i, seg in enumerate(a.segments):
        for tier in ("device", "host"):
            if time.perf_counter() > t_end or ORDER[tier] >= ORDER[seg.tier]:
                break
            segs = list(a.segments)
            segs[i] = replace(seg, tier=tier)
            if try_move(replace(a, segments=tuple(segs))):
                break
    for field in ("param_tier", "optimizer_tier", "grad_tier"):
        for j in range(len(getattr(a, field))):
            for tier in ("device", "host"):
                cur = getattr(a, field)[j]
                if time.perf_counter() > t_end or cur not in ORDER or ORDER[tier] >= ORDER[cur]:
                    break
                if tier == "device" and field != "param_tier":
                    continue  # grads and optimizer state live on the host or NVMe
                tiers = list(getattr(a, field))
                tiers[j] = tier
                if try_move(replace(a, **{field: tuple(tiers)})):
                    break
    return a
