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


def test_with_no_nvme_the_advice_sizes_the_host_memory_that_plans():
    """Planner review: with hardware.nvme_capacity_gib=0 the advice's floor was a layout needing
    hundreds of GiB of NVMe, so llama3-70b on a 3090 with 1100 GiB of RAM was told to get a ~100 GiB
    device, and mixtral-8x7b on an A100 only to add 608 GiB of NVMe; more host memory plans both."""
    cases = [
        (["model=llama3-70b", "hardware=rtx3090", "hardware.host_memory_gib=1100"],
         r"or hardware.host_memory_gib=([0-9.]+) plans it at this device budget"),
        (["model=mixtral-8x7b", "hardware=a100-80g", "hardware.host_memory_gib=128"],
         r"with no NVMe capacity .*add host memory \(hardware.host_memory_gib=([0-9.]+)\)"),
    ]
    for overrides, pattern in cases:
        cfg = load_config([*overrides, "hardware.nvme_capacity_gib=0", "planner.time_limit_s=10"])
        m, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
        p = plan_job(m, hw, job, opts, cache_dir=None)
        text = " ".join(p.explanation)
        assert not p.fits and "nvme_capacity_gib=6" not in text
        got = re.search(pattern, text)
        assert got, text
        more = replace(hw, host_memory_gib=float(got.group(1)))
        assert plan_job(m, more, job, opts, cache_dir=None, explain=False).fits, overrides


def test_an_infeasible_answer_without_its_explanation_is_not_cached(tmp_path):
    """plan_job(explain=False) cached its infeasible plan with no explanation under the key the
    CLI reads: a later `lazytrain plan` printed 'infeasible: ' and no advice (planner review)."""
    cfg = load_config(["hardware.device_memory_gib=0.1"])
    m, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
    quiet = plan_job(m, hw, job, opts, cache_dir=tmp_path, explain=False)
    assert not quiet.fits and quiet.explanation == ()
    again = plan_job(m, hw, job, opts, cache_dir=tmp_path)
    assert not again.fits and "needs at least" in " ".join(again.explanation)
    assert plan_job(m, hw, job, opts, cache_dir=tmp_path).explanation == again.explanation   # (cached now)


def test_a_cpu_device_budget_is_bounded_by_the_usable_host_ram(caplog):
    """Planner review: on the cpu profile (23.5 GiB, 4 reserved) a 30 GiB device budget planned a
    21.12 GiB peak as fitting, and with host_memory_gib=0 a job still planned. A CPU device's memory
    is host RAM: plans stay within the usable RAM (with a warning), and a budget no RAM backs is
    explained as such."""
    import logging

    def specs(*overrides):
        cfg = load_config(["hardware=cpu", "model=small-llama", "job.mode=lora", *overrides])
        return model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)

    m, hw, job, opts = specs("hardware.device_memory_gib=30", "job.batch_size=128", "job.seq_len=1024")
    with caplog.at_level(logging.WARNING):
        p = plan_job(m, hw, job, opts, cache_dir=None)
    assert p.fits and p.predicted.peak_bytes["device"] <= hw.host_usable_bytes
    assert "exceeds the 19.50 GiB of usable host RAM" in caplog.text
    m, hw, job, opts = specs("hardware.host_memory_gib=0")
    p = plan_job(m, hw, job, opts, cache_dir=None)
    text = " ".join(p.explanation)
    got = re.search(r"a CPU device's memory is host RAM.*raise hardware.host_memory_gib to ([0-9.]+) \(plans it\)", text)
    assert not p.fits and got, text
    assert plan_job(m, replace(hw, host_memory_gib=float(got.group(1))), job, opts, cache_dir=None, explain=False).fits


def test_a_suggestion_the_time_limit_cut_short_is_not_said_to_fail(tmp_path):
    """Planner review: at planner.time_limit_s=0.001, llama3.1-405b full on a 3090 said 'with ...
    job.mode=lora it would not plan either' (its check timed out; LoRA plans) and cached that."""
    cfg = load_config(["model=llama3.1-405b", "hardware=rtx3090", "hardware.host_memory_gib=64",
                       "planner.time_limit_s=0.001"])
    m, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
    text = " ".join(plan_job(m, hw, job, opts, cache_dir=tmp_path).explanation)
    end = text.find("it would not plan either")
    assert end < 0 or "job.mode=lora" not in text[text.rfind("(with", 0, end):end], text
    cut = "planner.time_limit_s" in text
    assert cut == (not list(tmp_path.glob("*.json"))), text   # a cut-short answer is not cached
