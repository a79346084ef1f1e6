"""What the plan CLI and planner say and do on edge cases and bad input (found in review)."""

import json
import logging
from dataclasses import replace

import pytest

from lazytrain.cli.main import main as cli_main
from lazytrain.plan import PlannerOptions, plan_job
from lazytrain.plan.render import render, summary_lines
from lazytrain.spec import JobSpec


@pytest.mark.parametrize("field", ["h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps", "device_tflops",
                                   "efficiency", "host_memory_gbps"])
def test_zero_rates_are_refused(make_hw, field):
    with pytest.raises(ValueError, match=f"hardware.{field} must be > 0, got 0"):
        make_hw(**{field: 0})
    make_hw(nvme_capacity_gib=0.0)   # a capacity may be 0 (no NVMe)


def test_profile_refuses_empty_measurements(capsys):
    from lazytrain.cli.profile import main as profile_main
    assert profile_main(["hardware=cpu", "--size-mib", "0"]) == 2
    assert "--size-mib must be >= 1, got 0" in capsys.readouterr().err
    assert profile_main(["hardware=cpu", "--repeats", "0"]) == 2


def test_unwritable_cache_warns_and_plans(small, tmp_path, caplog):
    model, h, job = small
    (tmp_path / "afile").write_text("")
    with caplog.at_level(logging.WARNING):
        plan = plan_job(model, h, job, cache_dir=tmp_path / "afile" / "sub")
    assert plan.fits and "planner cache" in caplog.text and "not written" in caplog.text


def test_cache_hit_carries_the_asked_models_name(small, tmp_path):
    model, h, job = small
    first = plan_job(model, h, job, cache_dir=tmp_path)
    other = replace(model, name="my-finetune")
    hit = plan_job(other, h, job, cache_dir=tmp_path)
    assert hit.input_hash == first.input_hash and hit.model_name == "my-finetune"
    assert first.model_name == model.name


def test_cached_explanation_names_the_asked_model(small, tmp_path):
    """An infeasible plan's explanation names the model; served from the cache under another name
    (same config, same hash), it names the one asked for."""
    model, h, job = small
    tiny_host = replace(h, host_memory_gib=0.001, nvme_capacity_gib=0.0)
    first = plan_job(model, tiny_host, job, cache_dir=tmp_path)
    assert not first.fits and any(f" of {model.name} (" in x for x in first.explanation)
    hit = plan_job(replace(model, name="my-finetune"), tiny_host, job, cache_dir=tmp_path)
    assert hit.input_hash == first.input_hash
    text = " ".join(hit.explanation)
    assert " of my-finetune (" in text and f" of {model.name} (" not in text


def test_fallback_plan_says_so_and_is_not_cached(make_llama, make_hw, tmp_path):
    """The MILP's timeout fallback (a heuristic's plan) is named in the summary, and not cached:
    the next run tries the MILP again."""
    model = make_llama(layers=48, hidden=2048, inter=5632, vocab=32000)
    h = make_hw(device_memory_gib=6.0, host_memory_gib=24.0, nvme_capacity_gib=200.0)
    plan = plan_job(model, h, JobSpec(batch_size=2, seq_len=1024, mode="full"),
                    PlannerOptions(time_limit_s=0.01), cache_dir=tmp_path)
    if not plan.solver.fell_back:
        pytest.skip("the MILP finished within 0.01 s here")
    assert any(line.startswith("note") and plan.solver.status_detail in line for line in summary_lines(plan))
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("mode,bits,master,label", [
    ("full", 32, "fp32", "fp32 master + moments"),
    ("full", 8, "fp32", "fp32 master + 8-bit moments"),
    ("full", 32, "bf16", "bf16 moments, no master: pure bf16"),
    # adapters take fp32 AdamW whatever the bits say (the header claimed 8-bit moments)
    ("lora", 8, "fp32", "LoRA adapters: fp32 AdamW (optimizer_state_bits=8 applies to full fine-tuning only)")])
def test_optimizer_state_is_named_as_the_job_keeps_it(small, mode, bits, master, label):
    model, h, job = small
    job = replace(job, mode=mode, optimizer_state_bits=bits, master_dtype=master)
    plan = plan_job(model, h, job, cache_dir=None)
    assert f"optimizer state {label}" in summary_lines(plan)[1]
    assert not any(line.startswith("note") for line in summary_lines(plan))   # (solved, no fallback)
    # (the explanation's per-tier line is for trained base weights: full fine-tuning)
    assert any(line.startswith(f"optimizer state ({label})") for line in plan.explanation) == (mode == "full")


def test_a_bf16_master_under_fp32_compute_is_not_called_pure_bf16(small):
    from lazytrain.plan.render import optimizer_state_label
    _, _, job = small
    label = optimizer_state_label(replace(job, mode="full", master_dtype="bf16", compute_dtype="fp32"))
    assert "pure bf16" not in label and "fp32 compute" in label, label


def test_segments_are_named_like_the_rows(small):
    model, h, job = small
    plan = plan_job(model, h, job, cache_dir=None)
    layers = list(plan.layers)
    # blocks 0-1 (layers 1-2) one recompute segment, the rest kept
    for i in (1, 2):
        layers[i] = replace(layers[i], recompute=True, segment_start=1,
                            activation_tier="device" if i == 1 else "none")
    text = render(replace(plan, layers=tuple(layers)))
    row = next(line for line in text.splitlines() if "block.0" in line and "yes" in line)
    assert "block.0..block.1" in row


def test_export_deepspeed_given_a_directory(tmp_path, capsys):
    from lazytrain.cli.plan_export import main as export_main
    (tmp_path / "run").mkdir()
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "ds.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "Traceback" not in err


def test_plot_of_an_infeasible_plan_and_a_misshapen_trace(small, tmp_path, capsys):
    model, h, job = small
    bad = plan_job(model, replace(h, device_memory_gib=0.0001), job, cache_dir=None, explain=False)
    assert not bad.fits
    (tmp_path / "inf.json").write_text(bad.to_json())
    assert cli_main(["plan", "show", str(tmp_path / "inf.json"), "--plot", str(tmp_path / "x.png")]) == 2
    assert "has no layers to plot" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(plan_job(model, h, job, cache_dir=None).to_json())
    (run / "trace.jsonl").write_text(json.dumps({"kind": "h2d", "step": 1, "start_s": 0.0}) + "\n")
    assert cli_main(["plan", "trace", str(run)]) == 2
    err = capsys.readouterr().err
    assert "is not a streaming-executor trace" in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["peaks", "layers", "tier", "segment"])
def test_damaged_cache_entry_is_resolved_not_served(small, tmp_path, caplog, damage):
    """Valid JSON whose contents were broken (a bit flip, a hand edit) is not served as the plan."""
    model, h, job = small
    plan = plan_job(model, h, job, cache_dir=tmp_path)
    f = tmp_path / f"{plan.input_hash}.json"
    d = json.loads(f.read_text())
    if damage == "peaks":
        d["predicted"]["peak_bytes"] = {}
    elif damage == "layers":
        d["layers"] = d["layers"][:3]
    elif damage == "tier":
        d["layers"][2]["param_tier"] = "gpu9"
    else:   # a recompute segment starting after its own layer
        d["layers"][3].update(recompute=True, segment_start=5, activation_tier="none")
    f.write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING):
        again = plan_job(model, h, job, cache_dir=tmp_path)
    assert "damaged plan cache entry" in caplog.text or "corrupt plan cache entry" in caplog.text
    assert again.layers == plan.layers and again.predicted == plan.predicted


def test_off_device_infeasibility_names_what_is_short(small):
    """When host and NVMe cannot hold the job, the explanation says whether the host alone is
    short, by how much (a floor: with that much usable host memory and ample NVMe the job plans),
    or how much host and NVMe must hold together; not a bare "cannot hold"."""
    import re

    from lazytrain.spec import GiB
    model, h, job = small
    job = replace(job, mode="full")
    tiny_host = replace(h, host_memory_gib=h.host_reserve_gib + 0.0001, nvme_capacity_gib=100.0)
    plan = plan_job(model, tiny_host, job, cache_dir=None)
    text = " ".join(plan.explanation)
    m = re.search(r"the host needs about ([0-9.]+) (MiB|GiB) with the 100.00 GiB of NVMe there is", text)
    assert not plan.fits and m, text
    floor = float(m.group(1)) * (2**20 if m.group(2) == "MiB" else GiB)
    enough = replace(tiny_host, host_memory_gib=h.host_reserve_gib + floor * 1.02 / GiB)
    assert plan_job(model, enough, job, cache_dir=None).fits
    no_nvme = replace(h, nvme_capacity_gib=0.0, host_memory_gib=h.host_reserve_gib + floor * 1.02 / GiB)
    text = " ".join(plan_job(model, no_nvme, job, cache_dir=None).explanation)
    # (with no NVMe the floor is the host-only layouts': the host alone is short, by this much; until
    # 2026-12-01 the floor was an NVMe layout the machine cannot have: review)
    m = re.search(r"the host needs about ([0-9.]+) (MiB|GiB) with no NVMe capacity", text)
    assert m, text
    host_only = float(m.group(1)) * (2**20 if m.group(2) == "MiB" else GiB)
    assert plan_job(model, replace(no_nvme, host_memory_gib=h.host_reserve_gib + host_only * 1.02 / GiB), job,
                    cache_dir=None).fits


@pytest.mark.parametrize("setting,says", [
    ("planner.solver=gurobi", "solver='gurobi' (valid: auto, highs, cbc)"),   # fell back to CBC silently
    ("planner.max_segment_len=0", "max_segment_len=0"),
    ("planner.prefetch_depth=0", "prefetch_depth=0"),
    ("planner.mip_gap=-1", "mip_gap=-1"),
    ("planner.time_limit_s=-1", "time_limit_s=-1"),
    ("planner.allow_nvme=maybe", "planner.allow_nvme must be true or false, got 'maybe'"),
])
def test_bad_planner_settings_are_one_line_exit_2(setting, says, tmp_path, capsys):
    rc = cli_main(["plan", "model=tiny-llama", f"planner.cache_dir={tmp_path}", setting])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())   # nothing planned, nothing cached


@pytest.mark.parametrize("args,says", [
    (["job.seq_len=abc"], "job.seq_len must be an integer, got 'abc'"),   # was: '<' not supported ...
    (["job.batch_size=1.5"], "job.batch_size must be an integer, got 1.5"),   # was planned, 384.0 tokens
    (["--jsn", "p.json"], "unknown option '--jsn'"),                     # was: LexerNoViableAltException
    (["compare", "--jsn", "p.json"], "unknown option '--jsn'"),
])
def test_mistyped_values_and_options_are_one_line_exit_2(args, says, tmp_path, capsys):
    sub, rest = (args[:1], args[1:]) if args[0] == "compare" else ([], args)
    rc = cli_main(["plan", *sub, "model=tiny-llama", f"planner.cache_dir={tmp_path}", *rest])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err, err
