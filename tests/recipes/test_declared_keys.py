"""A setting no config file declares is refused in one line, with or without `+`: Hydra's own hint
for a mistyped key ("To append to your config use +optim.learning_rate=0.1") led to a run at the
default lr, exit 0 (review, 2026-12-02). DeepSpeed's section and a from-config model's hf_config
stay open to `+` keys; model.hf_config next to model.path (ignored then) is refused."""

import pytest

from lazytrain.cli import train as train_cli
from lazytrain.cli.config import ConfigError, load_config


@pytest.mark.parametrize("ov, says", [
    ("+optim.learning_rate=0.1", "optim.learning_rate: no such setting (optim settings: betas, eps"),
    ("optim.learning_rate=0.1", "optim.learning_rate: no such setting"),
    ("+job.max_step=5", "job.max_step: no such setting; did you mean job.max_steps?"),
    ("+data.text_column=body", "data.text_column: no such setting"),
    ("+planner.timelimit=1", "planner.timelimit: no such setting; did you mean planner.time_limit_s?"),
    ("+storage.nvme_path=/x", "storage.nvme_path: no such setting (storage settings: nvme_dir)"),
    ("++save_evry=1", "save_evry: no such setting; did you mean save_every?"),
    ("+optimm.lr=1", "optimm: no such setting; did you mean optim?"),
])
def test_undeclared_settings_are_refused(ov, says):
    with pytest.raises(ConfigError) as e:
        load_config(["model=tiny-llama", ov], config_name="train")
    head, _, hint = says.partition("; ")
    assert str(e.value).startswith(head) and hint in str(e.value), str(e.value)


def test_open_sections_still_take_new_keys():
    cfg = load_config(["model=tiny-llama", "+model.hf_config.rope_theta=5e5", "engine=deepspeed",
                       "+deepspeed.zero_optimization.sub_group_size=2e8"], config_name="train")
    assert cfg.model.hf_config.rope_theta == 5e5
    from lazytrain.cli.config import check_declared_keys

    check_declared_keys(cfg, "train")


def test_hf_config_next_to_model_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.hf_config.num_hidden_layers does not apply with model.path"):
        load_config([f"model.path={tmp_path}", "model.hf_config.num_hidden_layers=1"], config_name="train")


def test_a_sweep_job_is_checked_too(base_overrides, tmp_path, capsys):
    rc = train_cli.main(["--multirun", *base_overrides, "seed=1,2", "+optim.learning_rate=0.1",
                         f"output_dir={tmp_path / 'sw'}"])
    assert rc == 2
    assert "optim.learning_rate: no such setting" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists() or not any((tmp_path / "sw").rglob("metrics.jsonl"))


def test_a_key_of_another_command_is_named_as_such_and_not_accepted_with_plus():
    """Review: the declared set was the union of every command's files: `plan optim.max_grad_norm=null`
    said "did you mean optim.max_grad_norm?", and `plan +optim.max_grad_norm=null` planned clipping."""
    for ov in ("optim.max_grad_norm=null", "+optim.max_grad_norm=null", "+prompt=hi"):
        with pytest.raises(ConfigError, match=r"not a setting of this command"):
            load_config(["model=tiny-llama", ov])             # (lazytrain plan's config)
    with pytest.raises(ConfigError, match=r"^moe: not a setting of this command"):
        load_config(["model=tiny-llama", "+moe.cache_fraction=0.1"], config_name="train")


def test_legitimate_hydra_forms_still_work(tmp_path):
    """Review: a helper key an interpolation reads, a deletion next to model.path, a group@package."""
    cfg = load_config(["model=tiny-llama", "+optim.base_lr=1e-4", "optim.lr=${optim.base_lr}",
                       "+vars.bs=4", "job.batch_size=${vars.bs}"], config_name="train")
    assert cfg.optim.lr == 1e-4 and cfg.job.batch_size == 4
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config([f"model.path={tmp_path}", "~model.hf_config"], config_name="train")
    assert "hf_config" not in cfg.model
    with pytest.raises(ConfigError) as e:
        load_config(["model@model=tiny-llama"], config_name="train")
    assert "no such setting" not in str(e.value)


def test_a_relative_config_dir_is_pinned_for_jobs_that_change_dir(tmp_path, monkeypatch):
    """Review: a relative LAZYTRAIN_CONFIG_DIR named nothing once Hydra changed into a job's dir
    (hydra.job.chdir=true): every sweep job was refused. The CLI pins it absolute first."""
    import os
    import shutil

    from lazytrain.cli import main as cli_main
    from lazytrain.cli.config import config_dir

    shutil.copytree(config_dir(), tmp_path / "cfgs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", "cfgs")
    cli_main.main(["no-such-command"])
    assert os.environ["LAZYTRAIN_CONFIG_DIR"] == str(tmp_path / "cfgs")


def test_an_interpolation_exempts_only_what_it_reads():
    """Review: one `${optim.base_lr}` exempted all of optim (a typo next to it got through)."""
    base = ["model=tiny-llama", "+optim.base_lr=1e-4", "optim.lr=${optim.base_lr}"]
    with pytest.raises(ConfigError, match=r"^optim.learning_rate: no such setting"):
        load_config([*base, "+optim.learning_rate=0.1"], config_name="train")
    with pytest.raises(ConfigError, match=r"^model.pth: no such setting.*did you mean model.path\?"):
        load_config(["model=tiny-llama", "job.seq_len=${model.hf_config.max_position_embeddings}", "+model.pth=/x"])
    # what interpolations read, in lists, relatively and through a resolver, passes
    cfg = load_config(["model=tiny-llama", "+data_root=/tmp/corpus", "data=text",
                       "data.files=[${data_root}/a.jsonl]"], config_name="train")
    assert list(cfg.data.files) == ["/tmp/corpus/a.jsonl"]
    for lr in ("${.base_lr}", "${oc.select:optim.base_lr,3e-4}"):
        assert load_config(["model=tiny-llama", "+optim.base_lr=1e-4", f"optim.lr={lr}"],
                           config_name="train").optim.lr == 1e-4


def test_a_mistyped_section_hints_a_real_key():
    """Review: `optimm.learning_rate` was told "did you mean optim.learning_rate?" (no such key)."""
    with pytest.raises(ConfigError) as e:
        load_config(["model=tiny-llama", "jb.lora_rnk=8"])
    assert "did you mean job.lora_rank?" in str(e.value) and "no section 'jb'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(["model=tiny-llama", "optimm.learning_rate=0.1"], config_name="train")
    assert "optim.learning_rate?" not in str(e.value)


@pytest.mark.parametrize("ov", ["+data=text", "+moe=default", "+deepspeed.zero_optimization.stage=3"])
def test_a_group_or_section_plan_does_not_have_is_refused(ov):
    """Review: `plan +data=text ...` and `plan +deepspeed.*` were accepted and read by nothing."""
    with pytest.raises(ConfigError, match=r"not a setting of this command"):
        load_config(["model=tiny-llama", ov])


def test_generate_refuses_settings_it_does_not_read(tmp_path, capsys):
    """Review: generate composes plan's config; job.*, planner.*, hardware=, model= changed nothing."""
    from lazytrain.cli import generate as gen_cli

    for ov in ("job.compute_dtype=fp32", "planner.time_limit_s=1", "hardware=h200", "model=llama3-8b"):
        assert gen_cli.main([f"moe.store={tmp_path}", "prompt_ids=[1]", ov]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a setting of `lazytrain generate`" in err[0], err


def test_user_config_dirs_with_absolute_defaults_and_nested_options(tmp_path, monkeypatch):
    """Review: Hydra's `- /config` default and a `model=team/tiny2` option in a subfolder."""
    import shutil

    from lazytrain.cli.config import config_dir

    d = tmp_path / "cfgs"
    shutil.copytree(config_dir(), d)
    (d / "train.yaml").write_text((d / "train.yaml").read_text().replace("  - config\n", "  - /config\n", 1))
    (d / "model" / "team").mkdir()
    shutil.copy(d / "model" / "tiny-llama.yaml", d / "model" / "team" / "tiny2.yaml")
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(d))
    cfg = load_config(["model=team/tiny2", "job.max_steps=2"], config_name="train")
    assert cfg.job.max_steps == 2 and cfg.model.name == "tiny-llama"
