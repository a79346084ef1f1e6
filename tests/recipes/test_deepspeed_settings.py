"""engine=deepspeed takes the user's DeepSpeed settings (a JSON file, then +deepspeed.* keys) over
the config derived from the plan; what would make it another job, or what DeepSpeed would reject,
is a one-line error before anything is written."""

import json

import pytest

from lazytrain.cli.config import ConfigError, load_config
from lazytrain.recipes.train import deepspeed_overrides, preflight, run


def _cfg(*ov):
    return load_config(list(ov), config_name="train")


def test_file_then_dotted_keys_merge(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"sub_group_size": 1000, "stage3_param_persistence_threshold": 0},
                             "communication_data_type": "fp32"}))
    over = deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}",
                                    "+deepspeed.zero_optimization.sub_group_size=2000"))
    assert over == {"zero_optimization": {"sub_group_size": 2000, "stage3_param_persistence_threshold": 0},
                    "communication_data_type": "fp32"}
    assert deepspeed_overrides(_cfg("engine=deepspeed")) == {}


@pytest.mark.parametrize("ov, match", [
    (["engine=lazytrain", "+deepspeed.zero_optimization.sub_group_size=2000"], "are for engine=deepspeed"),
    (["engine=deepspeed", "+deepspeed.train_micro_batch_size_per_gpu=4"], "job.batch_size"),
    (["engine=deepspeed", "+deepspeed.gradient_clipping=0.5"], "optim.max_grad_norm"),
    (["engine=deepspeed", "+deepspeed.bf16.enabled=false"], "job.compute_dtype"),
    (["engine=deepspeed", "+deepspeed.bfloat16.enabled=true"], "bfloat16 .job.compute_dtype"),
    (["engine=deepspeed", "+deepspeed.torch_autocast.enabled=true"], "torch_autocast"),
    (["engine=deepspeed", "+deepspeed.fp16.enabled=true"], "fp16.enabled"),
    (["engine=deepspeed", "+deepspeed.zero_optimization.stage=2"], "ZeRO stage 3"),
])
def test_settings_that_change_the_job_are_refused(ov, match):
    with pytest.raises(ConfigError, match=match):
        deepspeed_overrides(_cfg(*ov))


def test_every_refused_setting_is_named_in_one_error():
    """Batch size, clipping and a ZeRO stage together: one error names all three (the stage used
    to come only on the next try)."""
    with pytest.raises(ConfigError) as e:
        deepspeed_overrides(_cfg("engine=deepspeed", "+deepspeed.train_micro_batch_size_per_gpu=4",
                                 "+deepspeed.gradient_clipping=0.5", "+deepspeed.zero_optimization.stage=2"))
    assert all(s in str(e.value) for s in ("job.batch_size", "optim.max_grad_norm", "ZeRO stage 3"))


def test_hf_trainer_style_file_keeps_the_plans_values(tmp_path):
    """A Hugging Face Trainer DeepSpeed file: "auto" means "from the trainer", here the plan's or
    the job's value (dropped, not passed on for DeepSpeed to replace with its defaults); what it
    sets that defines the job is listed in one error; fp16 loss-scale settings are the user's."""
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "fp16": {"enabled": "auto", "initial_scale_power": 12},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "sub_group_size": 1e9,
                                "stage3_prefetch_bucket_size": "auto"}}
    f = tmp_path / "hf.json"
    f.write_text(json.dumps(hf))
    over = deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}", "+deepspeed.aio.block_size=1e6"))
    assert over == {"fp16": {"initial_scale_power": 12},
                    "zero_optimization": {"stage": 3, "sub_group_size": 1_000_000_000},
                    "aio": {"block_size": 1_000_000}}
    assert isinstance(over["aio"]["block_size"], int)   # DeepSpeed's aio handle takes ints only
    hf.update(optimizer={"type": "AdamW", "params": {"lr": "auto"}}, train_batch_size=8, bfloat16={"enabled": True})
    f.write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as e:
        deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}"))
    assert all(k in str(e.value) for k in ("train_batch_size (", "optimizer (", "bfloat16 ("))


@pytest.mark.parametrize("content, match", [
    (None, "does not exist"), ("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object")])
def test_bad_config_file_is_one_line(tmp_path, content, match):
    f = tmp_path / "ds.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError, match=match):
        deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}"))


def test_undeclared_key_without_plus_says_how(tmp_path):
    with pytest.raises(ConfigError, match=r"use \+deepspeed.zero_optimization.sub_group_size=2000"):
        _cfg("engine=deepspeed", "deepspeed.zero_optimization.sub_group_size=2000")


def test_deepspeed_rejects_a_misspelt_key_in_preflight(base_overrides, tmp_path):
    pytest.importorskip("deepspeed.runtime.config")
    out = tmp_path / "run"
    cfg = _cfg(*base_overrides, "engine=deepspeed", f"output_dir={out}",
               "+deepspeed.zero_optimization.sub_groop_size=2000")
    with pytest.raises(ConfigError, match="DeepSpeed rejects the config.*sub_groop_size"):
        preflight(cfg)
    assert not out.exists()


@pytest.mark.parametrize("key", ["offload_optimizer.buffer_count=0", "offload_param.buffer_size=0"])
def test_a_zero_buffer_count_is_refused_in_preflight(key, base_overrides, tmp_path):
    """buffer_count=0 passed DeepSpeed's parser and failed in deepspeed.initialize with an
    IndexError traceback, after plan.json and nvme/ were written (review)."""
    pytest.importorskip("deepspeed.runtime.config")
    out = tmp_path / "run"
    section = key.split(".")[0]
    cfg = _cfg(*base_overrides, "engine=deepspeed", f"output_dir={out}",
               f"+deepspeed.zero_optimization.{section}.device=cpu", f"+deepspeed.zero_optimization.{key}")
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}: a buffer count and size must be at least 1"):
        preflight(cfg)
    assert not out.exists()


def test_keys_deepspeed_never_reads_are_noted(base_overrides, tmp_path):
    """Outside the sections DeepSpeed validates, a misspelt key would be ignored silently: the
    preflight notes it (a key DeepSpeed reads is not noted)."""
    pytest.importorskip("deepspeed.runtime.config")
    pre = preflight(_cfg(*base_overrides, "engine=deepspeed", f"output_dir={tmp_path / 'run'}",
                         "+deepspeed.communication_data_typ=fp32", "+deepspeed.flops_profiler.enabeld=true",
                         "+deepspeed.steps_per_print=5", "+deepspeed.zero_optimization.overlap_comm=false",
                         "+deepspeed.zero_optimization.reduce_bucket_size=1e7",
                         "+deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save=true",
                         "+deepspeed.zero_optimization.offload_param.device=cpu"))
    text = "\n".join(pre.notes)
    assert "does not read communication_data_typ" in text and "flops_profiler.enabeld" in text
    for read in ("steps_per_print", "overlap_comm", "reduce_bucket_size", "stage3_gather", "offload_param"):
        assert read not in text, read   # (pydantic reads zero_optimization through **)


def test_nvme_offload_from_the_settings_gets_its_path(base_overrides, tmp_path):
    """Moving an offload to NVMe in the settings gets what the plan would give it: the path under
    storage.nvme_dir, the parameter swap buffers, the reuse distance (DeepSpeed asserts without a
    path); what the user set stays."""
    from lazytrain.integrations.ds_config import NVME_MAX_REUSE_DISTANCE, ds_config_from_plan
    pre = preflight(_cfg(*base_overrides, "engine=deepspeed"))
    over = {"zero_optimization": {"offload_param": {"device": "nvme", "buffer_count": 8},
                                  "offload_optimizer": {"device": "nvme"}}}
    cfg, _ = ds_config_from_plan(pre.plan, overrides=over, nvme_dir=str(tmp_path / "ds"))
    z = cfg["zero_optimization"]
    assert z["offload_param"]["nvme_path"] == z["offload_optimizer"]["nvme_path"] == str(tmp_path / "ds")
    assert z["offload_param"]["buffer_count"] == 8 and z["offload_param"]["buffer_size"] > 0
    assert z["stage3_max_reuse_distance"] == NVME_MAX_REUSE_DISTANCE
    pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig({k: v for k, v in cfg.items() if k != "lazytrain"})


def test_settings_reach_deepspeed_and_are_recorded(base_overrides, tmp_path):
    from lazytrain.integrations.deepspeed import check_available
    if check_available():
        pytest.skip(check_available())
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"sub_group_size": 1000, "stage3_param_persistence_threshold": 0}}))
    out = tmp_path / "run"
    import torch
    linear = torch.nn.functional.linear
    run(_cfg(*base_overrides, "engine=deepspeed", "job.max_steps=2", "save_every=0", "save_final_model=false",
             f"output_dir={out}", f"deepspeed_config={f}", "+deepspeed.zero_optimization.sub_group_size=2000"),
        out, echo=lambda *_: None)
    ran = json.loads((out / "ds_config.json").read_text())
    z = ran["zero_optimization"]
    assert z["sub_group_size"] == 2000 and z["stage3_param_persistence_threshold"] == 0   # dotted > file
    assert z["offload_optimizer"]["device"] == "cpu" and z["stage"] == 3                  # the plan's stay
    assert ran["optimizer"]["params"]["lr"] == pytest.approx(float(_cfg(*base_overrides).optim.lr))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # ZeRO-3 swapped F.linear process-wide for its own; what runs next in the process must not inherit it
    assert torch.nn.functional.linear is linear


def test_swap_buffers_beyond_the_hosts_memory_are_refused_in_preflight(base_overrides, tmp_path):
    """NVMe swap buffers are pinned host memory DeepSpeed allocates at start: more than the host
    has to spare is an error before anything is written (what they pin is a note otherwise)."""
    pytest.importorskip("deepspeed.runtime.config")
    out = tmp_path / "run"
    nvme = ["+deepspeed.zero_optimization.offload_param.device=nvme"]
    with pytest.raises(ConfigError, match=r"swap buffers pin .* GiB of host memory.*more than this host's"
                                          r".*lower zero_optimization.offload_param.buffer_count"):
        preflight(_cfg(*base_overrides, "engine=deepspeed", f"output_dir={out}", *nvme,
                       "+deepspeed.zero_optimization.offload_param.buffer_count=1000000"))
    assert not out.exists()
    try:
        pre = preflight(_cfg(*base_overrides, "engine=deepspeed", f"output_dir={out}", *nvme))
    except Exception as e:   # (no async_io op here: the NVMe offload itself is refused after the check)
        assert "async_io" in str(e) or "libaio" in str(e), e
        return
    assert any("swap buffers pin" in n for n in pre.notes)


def test_fp16_loss_scale_reaches_deepspeed_under_the_users_keys():
    """engine=deepspeed with fp16: optim.loss_scale / loss_scale_growth_interval become DeepSpeed's
    initial_scale_power / loss_scale_window (hysteresis 1, as GradScaler), in a config DeepSpeed's
    own parser reads as such; a user's fp16.* key wins over them."""
    from lazytrain.integrations.ds_config import ds_config_from_plan
    from lazytrain.recipes.train import with_ds_loss_scale
    from lazytrain.runtime.testing import hand_plan
    from lazytrain.spec import JobSpec

    over = with_ds_loss_scale({"fp16": {"initial_scale_power": 12}, "aio": {"block_size": 1}}, (2.0 ** 20, 500))
    assert over == {"fp16": {"initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 1},
                    "aio": {"block_size": 1}}
    for spelling in ("fp16", "float16"):   # (float16 gave no fp16.enabled: DeepSpeed ran fp32)
        cfg, _ = ds_config_from_plan(hand_plan(2, job=JobSpec(compute_dtype=spelling)),
                                     overrides=with_ds_loss_scale(None, (2.0 ** 20, 500)))
        assert cfg["fp16"]["enabled"] is True and cfg["fp16"]["initial_scale_power"] == 20
    assert ds_config_from_plan(hand_plan(2, job=JobSpec(compute_dtype="bfloat16")))[0]["bf16"] == {"enabled": True}
    pc = pytest.importorskip("deepspeed.runtime.precision_config")
    f16 = pc.get_float16_config(cfg)   # DeepSpeed's own reading of it
    assert f16.enabled and f16.loss_scale == 0   # (0: dynamic)
    assert (f16.initial_dynamic_scale(), f16.loss_scale_window, f16.hysteresis) == (2 ** 20, 500, 1)


def test_a_deepspeed_run_resumes_only_in_the_precision_it_trained_in(tmp_path):
    """DeepSpeed's checkpoint files are per precision: a run recorded in fp32 resumed in bf16
    failed on a missing bf16_* file, with advice to remove a good checkpoint (review: runs started
    with job.compute_dtype=bfloat16 trained fp32 until the spelling reached DeepSpeed)."""
    from lazytrain.cli.config import ConfigError
    from lazytrain.recipes.train import check_deepspeed_precision

    check_deepspeed_precision(tmp_path, "bf16")   # no record: nothing to compare
    (tmp_path / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    check_deepspeed_precision(tmp_path, "fp32")
    with pytest.raises(ConfigError, match=r"trained in fp32 .* resume with job.compute_dtype=fp32 \(until 2026-12-01"):
        check_deepspeed_precision(tmp_path, "bf16")
    (tmp_path / "ds_config.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    check_deepspeed_precision(tmp_path, "bf16")
    with pytest.raises(ConfigError, match="trained in bf16"):
        check_deepspeed_precision(tmp_path, "fp32")


def test_a_deepspeed_value_that_is_not_a_mapping_is_one_line():
    """deepspeed=5 was a ValueError traceback from OmegaConf before the 'must map' check (review)."""
    with pytest.raises(ConfigError, match="deepspeed must map DeepSpeed config keys to values"):
        deepspeed_overrides(_cfg("engine=deepspeed", "deepspeed=5"))


def test_an_nvme_path_that_cannot_be_made_is_one_line(base_overrides, tmp_path):
    """A user nvme_path under a file was a FileNotFoundError/NotADirectoryError traceback (review)."""
    from lazytrain.integrations.deepspeed import check_available
    if check_available():
        pytest.skip(check_available())
    (tmp_path / "f").write_text("x")
    out = tmp_path / "run"
    # (a ConfigError from the preflight, before the async_io op is looked for: it was the engine's
    # line, and on a machine without libaio the libaio line came first)
    with pytest.raises(ConfigError, match=r"offload_param.nvme_path .*f/sub cannot be made: .*/f is a file"):
        run(_cfg(*base_overrides, "engine=deepspeed", "job.max_steps=1", f"output_dir={out}",
                 "+deepspeed.zero_optimization.offload_param.device=nvme",
                 f"+deepspeed.zero_optimization.offload_param.nvme_path={tmp_path / 'f' / 'sub'}"),
            out, echo=lambda *_: None)
    assert not out.exists()   # nothing written


def test_a_refused_resume_leaves_the_runs_ds_config_record(base_overrides, tmp_path):
    """ds_config.json was written before the resume was checked: a refused one left its own
    settings as the record of what the run's checkpoints were written with (review)."""
    from lazytrain.integrations.deepspeed import check_available
    if check_available():
        pytest.skip(check_available())
    out = tmp_path / "run"
    base = [*base_overrides, "engine=deepspeed", "save_final_model=false", f"output_dir={out}"]
    run(_cfg(*base, "job.max_steps=2", "stop_at_step=1"), out, echo=lambda *_: None)
    before = (out / "ds_config.json").read_text()
    with pytest.raises(ConfigError, match="cannot resume"):
        run(_cfg(*base, "job.max_steps=2", "resume=true", "+deepspeed.zero_optimization.sub_group_size=1000"),
            out, echo=lambda *_: None)
    assert (out / "ds_config.json").read_text() == before
