"""Fixes from the session-21 reviews of the planner's explanations."""

import re
from dataclasses import replace

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import plan_job


def test_the_chunked_loss_need_is_said_to_the_precision_of_the_need_before_it():
    """'needs at least 0.485 GiB' then 'brings the need down to 0.49 GiB (...=0.484 and
    host_memory_gib=4.69)': the clause rounded to 0.01 GiB, the rest to 3 significant digits (README
    walkthrough review). Every figure is the setting it names, and it plans."""
    def explain(*overrides):
        cfg = load_config(["hardware=cpu", "job.seq_len=1024", "job.batch_size=8", *overrides])
        m, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
        return m, hw, job, opts, " ".join(plan_job(m, hw, job, opts, cache_dir=None).explanation)

    # the review's case: the chunked loss saves 0.16%, not worth a suggestion
    *_, text = explain("model=small-llama", "hardware.device_memory_gib=0.3", "hardware.host_memory_gib=4.5")
    assert "needs at least 0.485 GiB" in text and "loss_chunk_tokens" not in text, text
    m, hw, job, opts, text = explain("model=demo-llama", "hardware.device_memory_gib=0.05", "hardware.host_memory_gib=4.2")
    got = re.search(r"brings the need down to ([0-9.]+) GiB \(hardware.device_memory_gib=([0-9.]+) and "
                    r"hardware.host_memory_gib=([0-9.]+):", text)
    assert got, text
    assert got.group(1) == got.group(2) and len(got.group(1).partition(".")[2]) == 3, text
    assert len(got.group(3).partition(".")[2]) == 3, text
    dev, host = float(got.group(2)), float(got.group(3))
    assert plan_job(m, replace(hw, device_memory_gib=dev, host_memory_gib=host), replace(job, loss_chunk_tokens=1024),
                    opts, cache_dir=None, explain=False).fits
