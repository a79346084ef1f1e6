"""A new user's walkthrough (2026-12-01): a LoRA run on a loaded model that differed at every
launch, resume=true that resumed nothing, settings that silently did otherwise, an output_dir that
is a file, `plan compare` exiting 0 with nothing fitting and cutting its reasons, an infeasible
budget's advice 1.5x too high for a toy job, and `plan trace` on an interrupted run."""

import json
import re
from dataclasses import replace

import pytest
import torch

from lazytrain.cli import plan as plan_cli
from recipe_helpers import tiny_model_dir
from lazytrain.cli import train as cli

STREAMED = ["engine=lazytrain", "hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001"]


def _main(args, capsys):
    rc = cli.main(list(args))
    return rc, capsys.readouterr()


def test_lora_on_a_loaded_model_is_the_same_run_every_time(base_overrides, text_data, tmp_path, capsys):
    """PEFT draws lora_A from torch's global RNG, which was seeded only for models built from a
    config: two launches of the same LoRA job on model.path differed from step 2 on."""
    mdir, _ = tiny_model_dir(tmp_path, text_data[1])
    ov = [o for o in base_overrides if not o.startswith(("model=", "model.hf_config", "data.tokenizer"))]
    rows = []
    for name in ("a", "b"):
        torch.manual_seed(1000 + len(rows))   # whatever the process drew before
        rc, io = _main([*ov, f"model.path={mdir}", "job.mode=lora", "job.lora_rank=2", "job.max_steps=3",
                        f"output_dir={tmp_path / name}"], capsys)
        assert rc == 0, io.err
        rows.append([(r["loss"], r["grad_norm"]) for r in
                     map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())])
    assert rows[0] == rows[1]


def test_resume_without_output_dir_is_refused(base_overrides, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # (Hydra's default run dir would be ./outputs/DATE/TIME)
    rc, io = _main([*base_overrides, "resume=true"], capsys)
    assert rc == 2 and "resume=true needs output_dir=DIR" in io.err and "Traceback" not in io.err
    assert not (tmp_path / "outputs").exists()
    # a fixed Hydra run dir is an output dir too: resuming there is not refused
    assert not cli._resume_without_output_dir(["resume=true", f"hydra.run.dir={tmp_path / 'r'}"])


@pytest.mark.parametrize("setting,match", [
    ("save_every=-1", "save_every must be a whole number >= 0"),
    ("stop_at_step=0", "stop_at_step must be a step >= 1"),
    ("keep_checkpoints=0", "keep_checkpoints must be a whole number >= 1"),
    ("log_every=0", "log_every must be a whole number >= 1"),
    ("save_every=2.5", "save_every must be a whole number"),
])
def test_run_settings_that_would_do_otherwise_are_refused(base_overrides, tmp_path, capsys, setting, match):
    out = tmp_path / "never"
    rc, io = _main([*base_overrides, setting, f"output_dir={out}"], capsys)
    assert rc == 2 and match in io.err and len(io.err.strip().splitlines()) == 1
    assert not out.exists()


def test_output_dir_that_is_a_file_is_one_line(base_overrides, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("mine")
    rc, io = _main([*base_overrides, f"output_dir={f}"], capsys)
    assert rc == 2 and f"output_dir {f} is a file" in io.err and "Traceback" not in io.err
    assert f.read_text() == "mine"


def test_plan_compare_exits_2_when_nothing_fits_and_gives_each_reason_whole(capsys, tmp_path):
    args = ["compare", "hardware.device_memory_gib=0.001", "hardware.workspace_gib=0.0002",
            f"planner.cache_dir={tmp_path / 'c'}"]
    rc = plan_cli.main(args)
    out = capsys.readouterr().out
    assert rc == 2
    milp = next(line for line in out.splitlines() if line.startswith("milp: "))
    assert re.search(r"needs at least [0-9.]+ GiB of device memory \(hardware\.device_memory_gib=[0-9.]+\)", milp)
    rc = plan_cli.main(["compare", f"planner.cache_dir={tmp_path / 'c'}"])   # the default fits
    assert rc == 0


def test_infeasible_advice_for_a_toy_job_is_not_rounded_up_to_0_01_gib():
    """demo-llama LoRA: the minimum is ~14 MiB; rounded up to 0.01 GiB the advice said 0.02 GiB."""
    from lazytrain.cli.config import hardware_spec, job_spec, load_config, model_spec, planner_options
    from lazytrain.plan import min_device_bytes, plan_job
    from lazytrain.spec import GiB
    cfg = load_config(["model=demo-llama", "job.mode=lora", "hardware=cpu", "hardware.device_memory_gib=0.005",
                       "hardware.workspace_gib=0.002"])
    model, hw, job, opts = model_spec(cfg), hardware_spec(cfg), job_spec(cfg), planner_options(cfg)
    plan = plan_job(model, hw, job, opts, cache_dir=None)
    assert not plan.fits
    text = plan.explanation[0]
    shown = float(re.search(r"needs at least ([0-9.]+) GiB", text).group(1))
    setting = float(re.search(r"\(hardware\.device_memory_gib=([0-9.]+)", text).group(1))
    need = min_device_bytes(model, hw, job, opts) / GiB
    assert shown == setting and need <= setting <= need * 1.01 + 1e-9
    assert plan_job(model, replace(hw, device_memory_gib=setting), job, opts, cache_dir=None).fits


def test_plan_trace_leaves_out_a_step_cut_short(base_overrides, tmp_path, capsys):
    """A Ctrl-C'd run's trace has events of the step it was in but metrics.jsonl no row: that
    step (25 events against 171) was in the medians, and the measured step time was dropped."""
    from lazytrain.plan.tracecmp import compare_run
    out = tmp_path / "run"
    rc, io = _main([*base_overrides, *STREAMED, "job.max_steps=4", "save_final_model=false",
                    f"output_dir={out}"], capsys)
    assert rc == 0, io.err
    whole = compare_run(out)
    events = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    last = [e for e in events if e["step"] == 3]
    with open(out / "trace.jsonl", "a") as f:   # step 5 began: a few of its events, then Ctrl-C
        for e in last[:3]:
            f.write(json.dumps({**e, "step": 4}) + "\n")
    cut = compare_run(out)
    assert cut.steps == whole.steps == (1, 2, 3)
    assert cut.measured_step_s == whole.measured_step_s is not None
    assert [r.measured_s for r in cut.rows] == [r.measured_s for r in whole.rows]
    assert any("never completed" in n and n.endswith(": 5") for n in cut.notes)


def test_plan_flag_given_twice_says_so(capsys, tmp_path):
    rc = plan_cli.main(["--json", str(tmp_path / "a.json"), "--json", str(tmp_path / "b.json")])
    assert rc == 2 and "--json given more than once" in capsys.readouterr().err


def test_resume_with_output_dir_null_is_the_same_refusal(base_overrides, tmp_path, capsys, monkeypatch):
    """output_dir=null became hydra.run.dir=null, which Hydra refused with its own error."""
    monkeypatch.chdir(tmp_path)
    rc, io = _main([*base_overrides, "resume=true", "output_dir=null"], capsys)
    assert rc == 2 and "resume=true needs output_dir=DIR" in io.err and "Traceback" not in io.err


def test_resume_does_not_stop_hydra_from_printing_the_config(base_overrides, capsys):
    rc, io = _main([*base_overrides, "resume=true", "--cfg", "job"], capsys)
    assert rc == 0 and "resume: true" in io.out
