"""Session 25: the advice for a job the host cannot hold is sized by the MILP with the NVMe the
machine has (it was sized from hand-built layouts that put everything on one tier)."""

import re
from dataclasses import replace

from lazytrain.plan import plan_job
from lazytrain.plan.solve import PlannerOptions, min_tier_bytes
from lazytrain.spec import GiB


def _said(text, pattern):
    m = re.search(pattern, text)
    assert m, text
    return float(m.group(1))


def test_host_floor_with_some_nvme_is_the_least_any_plan_needs(small):
    """A review: llama3-8b full with 50 GiB of NVMe was told 127.67 GiB of host 'even with
    everything that may live on NVMe there'; 86.23 plans (its bisection's minimum)."""
    model, h, job = small
    job = replace(job, mode="full")
    # NVMe for half of what a plan with little host puts there: neither tier alone is enough
    nvme_most = plan_job(model, replace(h, host_memory_gib=h.host_reserve_gib + 0.05, nvme_capacity_gib=100.0),
                         job, cache_dir=None)
    assert nvme_most.fits
    some = 0.5 * nvme_most.predicted.peak_bytes["nvme"] / GiB
    short = replace(h, host_memory_gib=h.host_reserve_gib + 0.001, nvme_capacity_gib=some)
    text = " ".join(plan_job(model, short, job, cache_dir=None).explanation)
    said_floor = _said(text, rf"the host needs about ([0-9.]+) GiB with the {some:.2f} GiB of NVMe there is "
                             r"\(the least any plan needs")
    floor = min_tier_bytes(model, short, job, PlannerOptions(), "milp", "host") / GiB
    assert floor <= said_floor < floor + 0.011
    said = _said(text, r"add host memory \(hardware.host_memory_gib=([0-9.]+)\)")
    assert plan_job(model, replace(short, host_memory_gib=said), job, cache_dir=None).fits
    # a little below the floor does not plan: it is the least, not a layout's guess
    below = replace(short, host_memory_gib=h.host_reserve_gib + floor * 0.98)
    assert not plan_job(model, below, job, cache_dir=None).fits


def test_more_nvme_is_offered_where_it_plans_with_the_host_there_is(small):
    model, h, job = small
    job = replace(job, mode="full")
    full = plan_job(model, replace(h, host_memory_gib=h.host_reserve_gib + 100.0), job, cache_dir=None)
    host = 0.6 * full.predicted.peak_bytes["host"] / GiB
    short = replace(h, host_memory_gib=h.host_reserve_gib + host, nvme_capacity_gib=0.01)
    plan = plan_job(model, short, job, cache_dir=None)
    text = " ".join(plan.explanation)
    assert not plan.fits
    nvme = _said(text, r"or add NVMe instead \(hardware.nvme_capacity_gib=([0-9.]+)\)")
    assert plan_job(model, replace(short, nvme_capacity_gib=nvme), job, cache_dir=None).fits
