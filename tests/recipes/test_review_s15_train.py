"""Session-15 review of training outputs: a refused run must not touch the run it was refused for."""

from lazytrain.cli import train as cli
from lazytrain.recipes.train import RUN_LOCK
from lazytrain.storage.filemode import hold_flock


def test_a_refused_run_leaves_the_earlier_runs_hydra_record_alone(base_overrides, tmp_path, capsys):
    """Hydra writes .hydra/ into the run dir before the task runs: the output-dir refusals (an
    earlier run's checkpoints, a checkpoint this job cannot resume, another run writing) came after
    it, and the finished run's config.yaml then said lr 0.5."""
    out = tmp_path / "run"
    args = [*base_overrides, "job.max_steps=2", "save_final_model=false", f"output_dir={out}"]
    assert cli.main(args) == 0
    record = {f.name: f.read_bytes() for f in (out / ".hydra").iterdir()}
    capsys.readouterr()
    for extra, msg in ((["optim.lr=0.5"], "holds checkpoints of an earlier run"),
                       (["optim.lr=0.5", "resume=true", "seed=7"], "cannot resume")):
        assert cli.main([*args, *extra]) == 2
        assert msg in capsys.readouterr().err
        assert {f.name: f.read_bytes() for f in (out / ".hydra").iterdir()} == record
    fd = hold_flock(out / RUN_LOCK)   # another run writing there
    try:
        assert cli.main([*args, "resume=true", "job.max_steps=3"]) == 2
        assert "is in use by another lazytrain run" in capsys.readouterr().err
        assert {f.name: f.read_bytes() for f in (out / ".hydra").iterdir()} == record
    finally:
        import os
        os.close(fd)


def test_a_config_built_model_saves_its_tokenizers_special_ids(base_overrides, tmp_path):
    """model=NAME saved Llama's defaults (bos 1, eos 2) next to a tokenizer whose end-of-text is 0
    and whose id 2 is an ordinary token: generate() on final/ stopped at that token."""
    import json

    from transformers import AutoTokenizer

    out = tmp_path / "run"
    assert cli.main([*base_overrides, "job.max_steps=2", f"output_dir={out}"]) == 0
    tok = AutoTokenizer.from_pretrained(str(out / "final"))
    cfg = json.loads((out / "final" / "config.json").read_text())
    gen = json.loads((out / "final" / "generation_config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg.get(name) == getattr(tok, name), name
        assert gen.get(name) == getattr(tok, name), name
    assert tok.eos_token_id is not None


def test_a_sweep_rerun_with_its_keys_in_another_order_resumes_each_job(base_overrides, tmp_path, capsys,
                                                                       monkeypatch):
    """Subdirs were named in the command line's key order: the same sweep re-run with its keys the
    other way round started every job afresh in new dirs. Keys are sorted now; a dir named the old
    way is still found."""
    import json

    monkeypatch.chdir(tmp_path)
    base = ["--multirun", *base_overrides, f"output_dir={tmp_path / 'sw'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "save_final_model=false"]
    assert cli.main([*base, "seed=choice(0)", "optim.lr=1e-3,2e-3", "job.max_steps=2"]) == 0
    dirs = sorted(p.name for p in (tmp_path / "sw").iterdir())
    assert dirs == ["optim.lr=0.001,seed=0", "optim.lr=0.002,seed=0"]
    (tmp_path / "sw" / dirs[1]).rename(tmp_path / "sw" / "seed=0,optim.lr=0.002")   # as named before
    assert cli.main([*base, "optim.lr=1e-3,2e-3", "seed=choice(0)", "job.max_steps=3", "resume=true"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "sw").iterdir()) == ["optim.lr=0.001,seed=0", "seed=0,optim.lr=0.002"]
    for d in (tmp_path / "sw").iterdir():
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]


def test_lora_targets_given_as_one_string_are_names_not_letters():
    from lazytrain.spec import JobSpec

    assert JobSpec.from_dict({"mode": "lora", "lora_targets": "q_proj"}).lora_targets == ("q_proj",)
    assert JobSpec(mode="lora", lora_targets="q_proj, v_proj").lora_targets == ("q_proj", "v_proj")
    assert JobSpec.from_dict({"mode": "lora", "lora_targets": ["q_proj"]}).lora_targets == ("q_proj",)


def test_each_sweep_job_keeps_its_hydra_record_in_its_output_dir(base_overrides, tmp_path, capsys, monkeypatch):
    """With --multirun output_dir=DIR, .hydra/ stayed under Hydra's sweep dir: DIR/<values> had no
    record of the config it ran."""
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    assert cli.main(["--multirun", *base_overrides, "optim.lr=1e-3,2e-3", "job.max_steps=1", "save_final_model=false",
                     f"output_dir={tmp_path / 'sw'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]) == 0
    capsys.readouterr()
    for name, lr in (("optim.lr=0.001", 1e-3), ("optim.lr=0.002", 2e-3)):
        rec = OmegaConf.load(tmp_path / "sw" / name / ".hydra" / "config.yaml")
        assert rec.optim.lr == lr


def test_only_rank_0_probes_the_output_dir_lock(base_overrides, tmp_path, monkeypatch):
    """Every rank probed the lock rank 0 holds while it trains: rank 1 refused its own launch."""
    import os

    import pytest
    from omegaconf import OmegaConf

    from lazytrain.cli.config import ConfigError, load_config
    from lazytrain.recipes.train import check_output_dir, preflight

    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config([*base_overrides, "engine=deepspeed", f"output_dir={out}"], config_name="train")
    OmegaConf.set_struct(cfg, False)
    pre = preflight(load_config(base_overrides, config_name="train"))
    fd = hold_flock(out / RUN_LOCK)   # rank 0, training
    try:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        check_output_dir(cfg, out, pre)
        monkeypatch.setenv("RANK", "0")   # (another process holding it: rank 0 is told)
        with pytest.raises(ConfigError, match="in use by another lazytrain run"):
            check_output_dir(cfg, out, pre)
    finally:
        os.close(fd)


def test_a_hashed_sweep_dir_named_in_the_given_order_is_found(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"optim": {"lr": 1e-4, "betas": [0.9, 0.95]}})
    keys = ["optim.lr", "optim.betas"]
    old = cli._sweep_subdir(cfg, keys, 0, ordered=False)
    new = cli._sweep_subdir(cfg, keys, 0)
    assert old != new and "-" in old.rsplit(",", 1)[-1]   # a hashed name, as named before
    assert cli._sweep_subdir(cfg, list(reversed(keys)), 0) == new
