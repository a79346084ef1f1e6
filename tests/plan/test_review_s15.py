"""Fixes from the session-15 review of the plan and profile commands: true/false settings that
took any string, unparsable or infinite hardware values, max-batch's search cap shown as the
answer, the chunked loss's logits recompute left out of the step, a CPU step whose summary did not
add up, and a trace compared with no metrics.jsonl."""

import json
from dataclasses import replace

import pytest

from lazytrain.cli.config import ConfigError, check_bool_settings, declared_bools, load_config
from lazytrain.cli.main import main as cli_main
from lazytrain.plan import plan_job
from lazytrain.plan.render import summary_lines


@pytest.mark.parametrize("setting", ["hardware.nvme_full_duplex=no", "job.clip_grad=no", "planner.cache=no",
                                     "hardware.optimizer_overlaps_compute='false'", "planner.allow_nvme=yes"])
def test_true_false_settings_refuse_strings(setting, capsys):
    """Hydra reads `=no` as a string, which Python takes as true: nvme_full_duplex=no planned full
    duplex, planner.cache=no wrote the cache."""
    assert cli_main(["plan", "model=tiny-llama", setting]) == 2
    key, _, value = setting.partition("=")
    assert f"{key} must be true or false, got '{value.strip(chr(39))}'" in capsys.readouterr().err


def test_every_declared_bool_is_checked_and_true_false_pass():
    keys = declared_bools()
    assert {"hardware.nvme_full_duplex", "job.clip_grad", "planner.cache", "resume", "moe.direct_io"} <= keys
    cfg = load_config(["hardware.nvme_full_duplex=true", "job.clip_grad=false"])
    check_bool_settings(cfg)
    cfg.job.clip_grad = "off"
    with pytest.raises(ConfigError, match="job.clip_grad must be true or false, got 'off'"):
        check_bool_settings(cfg)


@pytest.mark.parametrize("setting,msg", [("hardware.device_memory_gib=inf", "must be a finite number, got inf"),
                                         ("hardware.efficiency=5", "at most 1, got 5")])
def test_infinite_or_impossible_hardware_values_are_refused(setting, msg, capsys):
    assert cli_main(["plan", "model=tiny-llama", setting]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_a_config_file_that_is_not_yaml_is_one_line(tmp_path, monkeypatch, capsys):
    import shutil

    from lazytrain.cli.config import config_dir

    cfgs = tmp_path / "configs"
    shutil.copytree(config_dir(), cfgs)
    (cfgs / "hardware" / "measured.yaml").write_text("name: measured\ndevice_type: cpu\n  bad: [\n")
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(cfgs))
    assert cli_main(["plan", "model=tiny-llama", "hardware=measured"]) == 2
    err = capsys.readouterr().err
    assert "measured.yaml, line 3 is not valid YAML" in err and "lazytrain profile" in err


def test_max_batch_at_the_search_cap_says_it_is_a_lower_bound(monkeypatch, capsys):
    import lazytrain.cli.plan as plan_cli

    monkeypatch.setattr(plan_cli, "MAX_BATCH_CAP", 8)
    assert cli_main(["plan", "max-batch", "model=tiny-llama", "hardware=h200", "planner.cache=false"]) == 0
    out = capsys.readouterr().out
    assert ">= 8 (search cap)" in out


def test_chunked_loss_pays_for_recomputing_the_logits():
    cfg_over = ["model=llama3-8b", "hardware=h200", "job.mode=lora", "job.seq_len=2048", "planner.cache=false"]
    from lazytrain.cli.config import hardware_spec, job_spec, model_spec, planner_options

    cfg = load_config(cfg_over)
    model, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
    plain = plan_job(model, hw, job, opts, cache_dir=None)
    chunked = plan_job(model, hw, replace(job, loss_chunk_tokens=1024), opts, cache_dir=None)
    head_fwd = 2 * job.batch_size * job.seq_len * model.hidden_size * model.vocab_size / hw.achieved_flops_per_s
    # the head's forward matmul once more (within the norm's and rounding's share)
    assert chunked.predicted.compute_s - plain.predicted.compute_s == pytest.approx(head_fwd, rel=0.02)


def test_a_cpu_step_summary_adds_up():
    cfg = load_config(["model=demo-llama", "hardware=cpu", "job.seq_len=512", "job.batch_size=3"])
    from lazytrain.cli.config import hardware_spec, job_spec, model_spec, planner_options

    plan = plan_job(model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg), cache_dir=None)
    p = plan.predicted
    assert p.serial_optimizer_s > 0
    assert p.compute_s + p.recompute_s + p.serial_optimizer_s + p.exposed_transfer_s == pytest.approx(p.step_time_s)
    text = "\n".join(summary_lines(plan))
    assert "optimizer (not overlapped)" in text and "overlapping the next forward" not in text


def test_trace_without_metrics_says_what_it_cannot_tell(small, tmp_path, capsys):
    model, h, job = small
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan_job(model, h, job, cache_dir=None).to_json())
    (run / "trace.jsonl").write_text(json.dumps({"kind": "compute_fwd", "what": "", "step": 0, "start_s": 0.0,
                                                 "end_s": 0.01, "bytes": 0, "tier": "device"}) + "\n")
    assert cli_main(["plan", "trace", str(run)]) == 0
    assert "no metrics.jsonl: which steps completed is unknown" in capsys.readouterr().out


@pytest.mark.parametrize("edit", ["step", "tiers"])
def test_a_cache_entry_whose_numbers_its_decisions_do_not_give_is_re_solved(small, tmp_path, caplog, edit):
    """Valid-looking hand edits were served as they read: every layer's weights set on the device
    (far above the card) with the old peak, or a 0.001 s step."""
    import logging

    model, h, job = small
    plan = plan_job(model, h, job, cache_dir=tmp_path)
    f = tmp_path / f"{plan.input_hash}.json"
    d = json.loads(f.read_text())
    if edit == "step":
        d["predicted"]["step_time_s"] = 0.001
    else:
        for lay in d["layers"]:
            lay["param_tier"] = "host" if lay["param_tier"] == "device" else "device"
    f.write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING):
        again = plan_job(model, h, job, cache_dir=tmp_path)
    assert "ignoring damaged plan cache entry" in caplog.text and "its decisions give" in caplog.text
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert [x.param_tier for x in again.layers] == [x.param_tier for x in plan.layers]


def _explain(over):
    from lazytrain.cli.config import hardware_spec, job_spec, model_spec, planner_options

    cfg = load_config([*over, "planner.cache=false"])
    plan = plan_job(model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg), cache_dir=None)
    assert not plan.fits
    return " ".join(plan.explanation)


def test_infeasible_advice_names_what_would_help():
    """Review: 'shorten job.seq_len' where no length fits; the device blamed where more host memory
    plans the job at this device budget; neither accumulation (gradients may then wait on NVMe)
    nor the chunked loss suggested. Each suggestion is one the planner plans."""
    text = _explain(["model=llama3-8b", "hardware=rtx3090", "hardware.device_memory_gib=0.5", "job.seq_len=16"])
    assert "nor would batch 1 at job.seq_len=16 (it needs 4.28 GiB" in text and "shorten" not in text
    text = _explain(["model=llama3-8b", "hardware=rtx3090", "hardware.host_memory_gib=48"])
    assert "job.grad_accum=2 (twice the tokens per step) (planned host peak" in text
    text = _explain(["model=llama3-8b", "hardware=rtx3090", "hardware.device_memory_gib=0.5", "job.mode=lora",
                     "job.batch_size=4", "job.seq_len=2048"])
    assert "job.loss_chunk_tokens=1024 (the loss over chunks of tokens, never all logits at once) brings the " \
           "need down to 5.84 GiB" in text
    text = _explain(["model=qwen2.5-32b", "hardware=rtx3090", "job.mode=full", "job.seq_len=2048",
                     "hardware.host_memory_gib=157.9"])
    # (157.98 until 2026-12-02; since, the host also stages activations bound for NVMe:
    # costmodel.NVME_ACT_STAGING_LAYERS; the figure is checked to plan before it is said)
    import re
    m = re.search(r"hardware.host_memory_gib=([0-9.]+) plans it at this device budget", text)
    assert m and 157.9 < float(m.group(1)) < 159, text


def test_a_cache_hit_does_not_repeat_the_lora_target_warning(small, tmp_path, caplog):
    """The cache check replays an entry with a model spec of its own: the once-per-spec warning
    about an unmatched LoRA target came back on every hit."""
    import logging

    model, h, job = small
    job = replace(job, mode="lora", lora_targets=("q_proj", "foo"))
    plan_job(model, h, job, cache_dir=tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            plan_job(model, h, job, cache_dir=tmp_path)
    assert "match no linear layer" not in caplog.text
