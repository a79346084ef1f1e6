"""Fixes from the session-19 review of `lazytrain train`'s input checks and output dirs: seq_len 1,
a model dir whose weights are not its config's, engine=torch with 8-bit states, '~' in output_dir,
the built-in data's settings, an output_dir under a file, and a swept config group's dir names."""

import json
from pathlib import Path

import pytest

from lazytrain.cli import train as cli


def _main(args, capsys):
    rc = cli.main(list(args))
    return rc, capsys.readouterr()


def test_seq_len_1_is_refused(base_overrides, tmp_path, capsys):
    """It trained on nothing (no target after the shift): NaN losses, exit 0, a final model."""
    rc, io = _main([*base_overrides, "job.seq_len=1", f"output_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and "job.seq_len=1: a sequence needs at least 2 tokens" in io.err, io.err
    assert not (tmp_path / "r").exists()


def test_engine_torch_with_8bit_states_is_refused_before_anything_is_written(base_overrides, tmp_path, capsys):
    rc, io = _main([*base_overrides, "engine=torch", "job.optimizer_state_bits=8", f"output_dir={tmp_path / 'r'}"],
                   capsys)
    assert rc == 2 and "engine=torch runs 32-bit AdamW only" in io.err, io.err
    assert not (tmp_path / "r").exists()


def test_a_model_dir_whose_weights_are_not_its_config_is_one_line(base_overrides, tmp_path, capsys):
    """transformers raises RuntimeError for mismatched shapes: it was a traceback."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                               max_position_embeddings=256)
    d = tmp_path / "m"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "hidden_size": 128}))
    args = [a for a in base_overrides if not a.startswith("model")]
    rc, io = _main([*args, f"model.path={d}", "engine=torch", f"output_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and f"cannot load the model in {d}: its weights' shapes are not those of its config.json" in io.err, io.err
    assert "Traceback" not in io.err, io.err


def test_output_dir_with_a_tilde_is_one_dir_and_resumes(base_overrides, tmp_path, capsys, monkeypatch):
    """'~/runA' put .hydra/ and train.log in ./~/runA and the outputs in $HOME/runA; resume=true
    then found no record of the run's settings."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    rc, io = _main([*base_overrides, "job.max_steps=2", "output_dir='~/runA'"], capsys)
    assert rc == 0, io.err
    assert (home / "runA" / ".hydra" / "overrides.yaml").is_file() and (home / "runA" / "metrics.jsonl").is_file()
    assert not (cwd / "~").exists()
    rc, io = _main(["resume=true", "job.max_steps=3", "output_dir='~/runA'"], capsys)
    assert rc == 0, io.err
    assert len((home / "runA" / "metrics.jsonl").read_text().splitlines()) == 3


def test_output_dir_under_a_file_is_one_line(base_overrides, tmp_path, capsys):
    (tmp_path / "afile.txt").write_text("x")
    rc, io = _main([*base_overrides, f"output_dir={tmp_path / 'afile.txt' / 'sub'}"], capsys)
    assert rc == 2 and "afile.txt is a file, not a directory" in io.err, io.err


@pytest.mark.parametrize("setting,says", [("data.cache_dir=null", "data.cache_dir is empty"),
                                          ("data.vocab_size=abc", "data.vocab_size must be a whole number"),
                                          ("data.vocab_size=null", "data.vocab_size must be a whole number")])
def test_builtin_data_settings_are_checked(tmp_path, capsys, monkeypatch, setting, says):
    """data=demo with data.cache_dir=null built everything in ./None; a vocab size that is not a
    number was a TypeError/ValueError traceback."""
    monkeypatch.chdir(tmp_path)
    rc, io = _main(["model=tiny-llama", "data=demo", setting, f"output_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and says in io.err, io.err
    assert not (tmp_path / "None").exists()


def test_a_swept_config_group_names_its_dirs_by_option(base_overrides, tmp_path, capsys):
    """--multirun model=a,b output_dir=D named each job's dir after the whole config it selects."""
    out = tmp_path / "sweep"
    args = [a for a in base_overrides if not a.startswith("model=")]
    rc, io = _main(["--multirun", "model=tiny-llama,tiny-mixtral", *args, "job.max_steps=1", f"output_dir={out}"],
                   capsys)
    assert rc == 0, io.err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["model=tiny-llama", "model=tiny-mixtral"]
    assert all((Path(out) / n / "metrics.jsonl").is_file() for n in ("model=tiny-llama", "model=tiny-mixtral"))


def test_a_model_dir_missing_weights_is_refused(base_overrides, tmp_path, capsys):
    """A checkpoint without some tensors trained with them randomly initialised (transformers only
    prints a MISSING report); refused now, naming them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                               max_position_embeddings=256, tie_word_embeddings=True)
    d = tmp_path / "m"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    args = [a for a in base_overrides if not a.startswith("model")]
    rc, io = _main([*args, f"model.path={d}", "engine=torch", "job.max_steps=1", f"output_dir={tmp_path / 'ok'}"], capsys)
    assert rc == 0, io.err   # (complete, with its tied head: no weight missing)
    sd = load_file(d / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    rc, io = _main([*args, f"model.path={d}", "engine=torch", f"output_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and "lacks 1 of its weights (model.layers.1.mlp.up_proj.weight)" in io.err, io.err


def test_a_group_sweep_named_before_resumes_in_its_dirs(base_overrides, tmp_path, capsys):
    """Sweep dirs of a config group were named by the whole config it selects until 2026-12-01:
    re-running that sweep with resume=true started every job again in new dirs, silently."""
    from lazytrain.cli.config import load_config

    out = tmp_path / "sweep"
    args = [a for a in base_overrides if not a.startswith("model=")]
    sweep = ["--multirun", "model=tiny-llama,tiny-mixtral", *args, f"output_dir={out}"]
    rc, io = _main([*sweep, "job.max_steps=1"], capsys)
    assert rc == 0, io.err
    for name in ("tiny-llama", "tiny-mixtral"):   # as the earlier naming had them
        old = cli._sweep_subdir(load_config([*args, f"model={name}"], config_name="train"), ["model"], 0)
        assert old.startswith("model=") and old != f"model={name}"
        (out / f"model={name}").rename(out / old)
    rc, io = _main([*sweep, "job.max_steps=2", "resume=true"], capsys)
    assert rc == 0, io.err
    dirs = [p for p in out.iterdir() if p.is_dir()]
    assert len(dirs) == 2 and all(len((d / "metrics.jsonl").read_text().splitlines()) == 2 for d in dirs), dirs


def test_a_sweep_output_dir_with_a_tilde_is_one_dir(base_overrides, tmp_path, capsys, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    rc, io = _main(["--multirun", *base_overrides, "optim.lr=0.001,0.002", "job.max_steps=1",
                    "output_dir='~/sweep'"], capsys)
    assert rc == 0, io.err
    assert (home / "sweep" / "optim.lr=0.001" / ".hydra" / "overrides.yaml").is_file(), sorted(str(p) for p in tmp_path.rglob("*") if ".hydra" in str(p) or "metrics" in str(p))
    assert not (cwd / "~").exists()


def test_builtin_data_cache_dir_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f.txt").write_text("x")
    rc, io = _main(["model=tiny-llama", "data=demo", f"data.cache_dir={tmp_path / 'f.txt' / 'c'}",
                    f"output_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and "f.txt is a file, not a directory" in io.err, io.err


def test_resume_hint_names_a_text_files_bom(tmp_path):
    """Runs before 2026-12-01 trained a text file's BOM as tokens: their resume is refused as
    'other data'; the hint says why."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from lazytrain.recipes.train import _data_hints

    f = tmp_path / "a.txt"
    f.write_text("hello", encoding="utf-8-sig")
    cfg = OmegaConf.create({"data": {"files": [str(f)], "add_bos": "false"}})
    assert "begins with a UTF-8 BOM" in _data_hints(cfg, SimpleNamespace(tokenizer=None))
    f.write_text("hello", encoding="utf-8")
    assert "BOM" not in _data_hints(cfg, SimpleNamespace(tokenizer=None))
