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
    (["engine=deepspeed", "+deepspeed.zero_optimization.stage=2"], "ZeRO stage 3"),
])
def test_settings_that_change_the_job_are_refused(ov, match):
    with pytest.raises(ConfigError, match=match):
        deepspeed_overrides(_cfg(*ov))


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


def test_settings_reach_deepspeed_and_are_recorded(base_overrides, tmp_path):
    from lazytrain.integrations.deepspeed import check_available
    if check_available():
        pytest.skip(check_available())
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"sub_group_size": 1000, "stage3_param_persistence_threshold": 0}}))
    out = tmp_path / "run"
    run(_cfg(*base_overrides, "engine=deepspeed", "job.max_steps=2", "save_every=0", "save_final_model=false",
             f"output_dir={out}", f"deepspeed_config={f}", "+deepspeed.zero_optimization.sub_group_size=2000"),
        out, echo=lambda *_: None)
    ran = json.loads((out / "ds_config.json").read_text())
    z = ran["zero_optimization"]
    assert z["sub_group_size"] == 2000 and z["stage3_param_persistence_threshold"] == 0   # dotted > file
    assert z["offload_optimizer"]["device"] == "cpu" and z["stage"] == 3                  # the plan's stay
    assert ran["optimizer"]["params"]["lr"] == pytest.approx(float(_cfg(*base_overrides).optim.lr))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
