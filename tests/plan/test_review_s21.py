"""Fixes from the session-21 reviews of the planner's explanations."""

import re
from dataclasses import replace

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import plan_job


def test_the_chunked_loss_need_is_said_to_the_precision_of_the_need_before_it():
    """'needs at least 0.485 GiB' then 'brings the need down to 0.49 GiB (...=0.484 and
    host_memory_gib=4.69)': the clause rounded to 0.01 GiB, the rest to 3 significant digits (README
    walkthrough review). Every figure is the setting it names, and it plans."""
    cfg = load_config(["model=small-llama", "hardware=cpu", "hardware.device_memory_gib=0.3",
                       "hardware.host_memory_gib=4.5", "job.seq_len=1024", "job.batch_size=8"])
    m, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
    text = " ".join(plan_job(m, hw, job, opts, cache_dir=None).explanation)
    got = re.search(r"brings the need down to ([0-9.]+) GiB \(hardware.device_memory_gib=([0-9.]+) and "
                    r"hardware.host_memory_gib=([0-9.]+):", text)
    assert got, text
    assert got.group(1) == got.group(2) and len(got.group(1).partition(".")[2]) == 3, text
    assert len(got.group(3).partition(".")[2]) == 3, text
    dev, host = float(got.group(2)), float(got.group(3))
    assert plan_job(m, replace(hw, device_memory_gib=dev, host_memory_gib=host), replace(job, loss_chunk_tokens=1024),
                    opts, cache_dir=None, explain=False).fits
