"""The advice of an infeasible plan whose parameters, gradients and optimizer state do not fit
off the device (host and NVMe): it names only settings not already in effect, each of which,
applied, makes the job plan; otherwise the host memory or NVMe that would (found in review:
llama3-8b full fine-tuning on a 32 GiB host was told to use job.optimizer_state_bits=8, which
keeps the states on the host and raises the floor from 49 to 77 GiB, and told so again once set,
while job.master_dtype=bf16, which fits, went unmentioned)."""

import re
from dataclasses import replace

import pytest

from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
from lazytrain.plan import plan_job
from lazytrain.spec import GiB

SETTINGS = ("mode", "optimizer_state_bits", "master_dtype")


def _text(plan) -> str:
    assert not plan.fits
    text = " ".join(plan.explanation)
    assert "do not fit off the device" in text, text
    return text


def _suggestions(text: str) -> list[dict[str, object]]:
    """Each suggested change ("job.k=v [job.k=v] (planned host peak X)"), as JobSpec fields."""
    out = []
    for group in re.findall(r"((?:job\.\w+=\w+ )+)\(planned host peak [0-9.]+ (?:GiB|MiB)\)", text):
        kw = {}
        for k, v in re.findall(r"job\.(\w+)=(\w+)", group):
            kw[k] = int(v) if v.isdigit() else v
        out.append(kw)
    return out


def _check_advice(model, h, job, options=None, method="milp"):
    """Plans the job (infeasible off the device), checks every suggestion, returns the text."""
    kw = {"method": method} if options is None else {"options": options, "method": method}
    text = _text(plan_job(model, h, job, cache_dir=None, **kw))
    for k in SETTINGS:   # never a setting already in effect
        assert not any(s.get(k) == getattr(job, k) for s in _suggestions(text)), text
    for s in _suggestions(text):
        assert s and set(s) <= set(SETTINGS), text
        other = replace(job, **s)
        assert plan_job(model, h, other, cache_dir=None, explain=False, **kw).fits, (s, text)
    if not _suggestions(text):   # then the host memory / NVMe that would do
        m = re.search(r"hardware\.host_memory_gib=([0-9.]+)", text)
        n = re.search(r"hardware\.nvme_capacity_gib=([0-9.]+)", text)
        assert m or n, text
        more = replace(h, **({"host_memory_gib": float(m.group(1))} if m else {}),
                       **({"nvme_capacity_gib": float(n.group(1))} if n else {}))
        assert plan_job(model, more, job, cache_dir=None, explain=False, **kw).fits, text
    return text


def _cli_specs(*overrides):
    cfg = load_config(["model=llama3-8b", "hardware=rtx3090", "job.seq_len=2048",
                       "hardware.host_memory_gib=32", *overrides])
    return model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)


def test_llama3_8b_on_a_32_gib_host_is_told_bf16_master_not_8bit_states():
    model, h, job, opts = _cli_specs()
    text = _check_advice(model, h, job, opts)
    assert "job.master_dtype=bf16 (planned host peak" in text, text
    assert "optimizer_state_bits=8" not in text, text
    # the floor: fp32 gradient accumulators of every layer (30 GiB: one micro-batch) and three
    # host staging sets of the largest layer's NVMe-tier state (the 128256 x 4096 embedding's and
    # head's fp32 master + moments, 5.9 GiB each); the bf16 parameters (15 GiB) stay on the device
    floor = float(re.search(r"the host needs about ([0-9.]+) GiB", text).group(1))
    assert 47 < floor < 48.5, text
    bf16 = plan_job(model, h, replace(job, master_dtype="bf16"), opts, cache_dir=None)
    assert bf16.fits
    shown = float(re.search(r"job\.master_dtype=bf16 \(planned host peak ([0-9.]+) GiB\)", text).group(1))
    assert bf16.predicted.peak_bytes["host"] <= shown * GiB   # the floor shown is what it needs
    # with the host memory it names the job plans, at that floor
    need = float(re.search(r"hardware\.host_memory_gib=([0-9.]+)", text).group(1))
    plan = plan_job(model, replace(h, host_memory_gib=need), job, opts, cache_dir=None)
    assert plan.fits and plan.predicted.peak_bytes["host"] <= floor * GiB


def test_small_device_offers_nothing_that_does_not_plan():
    """On a 4 GiB device the off-device layouts' floor fits host and NVMe for bf16 master or LoRA,
    but neither plans (the device is short): nothing is offered, and the host memory the floor
    names is said not to be enough alone (a reviewer planned each earlier suggestion: all infeasible)."""
    model, h, job, opts = _cli_specs("hardware.device_memory_gib=4")
    text = _text(plan_job(model, h, job, opts, cache_dir=None))
    assert "or use" not in text and "alone it still does not plan: the device needs more memory too" in text, text
    need = float(re.search(r"hardware\.host_memory_gib=([0-9.]+)", text).group(1))
    assert not plan_job(model, replace(h, host_memory_gib=need), job, opts, cache_dir=None, explain=False).fits


def test_llama3_8b_with_8bit_states_is_not_told_8bit_again():
    """8-bit states stay on the host (pins_for): their floor is higher, and the advice neither
    repeats the setting nor suggests a bf16 master without 32-bit states (JobSpec refuses it)."""
    model, h, job, opts = _cli_specs("job.optimizer_state_bits=8")
    text = _check_advice(model, h, job, opts)
    assert "optimizer_state_bits=8" not in text, text
    assert "job.master_dtype=bf16 job.optimizer_state_bits=32 (planned host peak" in text, text
    eight = float(re.search(r"the host needs about ([0-9.]+) GiB", text).group(1))
    plain = float(re.search(r"the host needs about ([0-9.]+) GiB",
                            _text(plan_job(model, h, replace(job, optimizer_state_bits=32), opts,
                                           cache_dir=None))).group(1))
    assert eight > plain


FP32, BITS8, BF16 = dict(), dict(optimizer_state_bits=8), dict(master_dtype="bf16")


@pytest.mark.parametrize("setting,host_mib,nvme_gib", [
    (FP32, 30, 100.0), (BITS8, 30, 100.0), (FP32, 12, 100.0), (BITS8, 12, 100.0), (BF16, 12, 100.0),
    (FP32, 2, 100.0), (BITS8, 2, 100.0), (BF16, 2, 100.0), (FP32, 60, 0.0), (FP32, 40, 0.01),
    (BITS8, 40, 0.01)])
def test_advice_names_only_settings_not_in_effect_that_fit(small, setting, host_mib, nvme_gib):
    model, h, job = small
    job = replace(job, mode="full", **setting)
    h = replace(h, host_memory_gib=h.host_reserve_gib + host_mib / 1024, nvme_capacity_gib=nvme_gib)
    _check_advice(model, h, job)


def test_full_job_is_told_each_fitting_change(small):
    """A host between the bf16 floor and the fp32 one: bf16 master and LoRA both fit, 8-bit
    states (on the host) do not."""
    model, h, job = small
    job = replace(job, mode="full")
    h = replace(h, nvme_capacity_gib=100.0, host_memory_gib=h.host_reserve_gib + 30 / 1024)
    text = _check_advice(model, h, job)
    assert "job.master_dtype=bf16 (planned host peak" in text and "job.mode=lora (planned host peak" in text, text
    assert "optimizer_state_bits" not in text, text


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("nvme_gib", [100.0, 0.0])
def test_none_fits_names_what_host_and_nvme_would(small, mode, nvme_gib):
    """offload-all streams parameters from NVMe through the host and keeps activations there: on a
    0.1 MiB host no setting fits (LoRA, already in effect or not, included), and the host memory
    (and NVMe) named does."""
    model, h, job = small
    job = replace(job, mode=mode)
    h = replace(h, host_memory_gib=h.host_reserve_gib + 0.1 / 1024, nvme_capacity_gib=nvme_gib)
    text = _check_advice(model, h, job, method="heuristic:offload-all")
    assert "(planned host peak" not in text and "hardware.host_memory_gib=" in text, text
    assert ("job.mode=lora" in text) == (mode == "full"), text
    if mode == "full":
        assert "it would not plan either" in text, text
