"""Session 29 review of the training walkthrough (each failed before its fix)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from lazytrain.cli import main as cli


def _model_dir(path, tok=None, vocab=320):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    if tok is not None:
        transformers.AutoTokenizer.from_pretrained(tok).save_pretrained(path)
    return path


def _demo_overrides(tmp_path, model_dir):
    # data=demo (train's default group): the built-in corpus, which needs no data.files
    return [f"model.path={model_dir}", "job.seq_len=32", "job.batch_size=2", "job.max_steps=1",
            "job.compute_dtype=fp32", "engine=torch", "progress=false",
            f"planner.cache_dir={tmp_path / 'solver_cache'}"]


def test_a_model_of_ones_own_learns_the_built_in_corpus_with_its_own_tokenizer(text_data, tmp_path):
    """`train model.path=DIR` without data=text tokenized with the built-in 2048-token BPE, trained
    the model on its ids and saved that tokenizer into final/ (review)."""
    _, tok = text_data
    m = _model_dir(tmp_path / "m", tok)
    out = tmp_path / "run"
    assert cli.main(["train", *_demo_overrides(tmp_path, m), f"output_dir={out}"]) == 0
    own = transformers.AutoTokenizer.from_pretrained(m)
    saved = transformers.AutoTokenizer.from_pretrained(out / "final")
    assert len(saved) == len(own) == 300 and saved("a docstring").input_ids == own("a docstring").input_ids


def test_a_model_dir_without_a_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys):
    m = _model_dir(tmp_path / "m", vocab=4096)
    out = tmp_path / "run"
    assert cli.main(["train", *_demo_overrides(tmp_path, m), f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert f"model.path={m} holds no tokenizer" in err and "give data.tokenizer=DIR" in err, err
    assert not out.exists()


@pytest.mark.parametrize("arg,where", [("~/runB", "home/runB"), ("runs/exp#2", "cwd/runs/exp#2"),
                                       ("runs/a&b", "cwd/runs/a&b")])
def test_an_output_dir_as_a_shell_passes_it_trains_and_resumes(base_overrides, tmp_path, monkeypatch, capsys,
                                                                arg, where):
    """The README's output_dir='~/run' reaches the program without its quotes: Hydra refused ~, #,
    & ... unquoted ('lazytrain train: LexerNoViableAltException: output_dir=~/run', exit 2)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    ov = [a for a in base_overrides if not a.startswith("job.max_steps")]
    assert cli.main(["train", *ov, "job.max_steps=2", f"output_dir={arg}"]) == 0, capsys.readouterr().err
    out = tmp_path / where
    assert (out / ".hydra" / "overrides.yaml").is_file() and (out / "metrics.jsonl").is_file()
    assert cli.main(["train", "resume=true", "job.max_steps=3", f"output_dir={arg}"]) == 0, capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_model_path_refused_for_its_weights_writes_no_plan_and_keeps_the_runs(text_data, tmp_path, capsys):
    """plan.json was written before the weights were found missing: a fresh run left plan.json, a
    lock and nvme/; a refused resume replaced the finished run's plan.json (review)."""
    from safetensors.torch import load_file, save_file

    f, tok = text_data
    m = _model_dir(tmp_path / "m", tok)
    ov = [f"model.path={m}", "data=text", f"data.files=[{f}]", "job.seq_len=32", "job.batch_size=2",
          "job.max_steps=2", "job.compute_dtype=fp32", "progress=false",
          f"planner.cache_dir={tmp_path / 'solver_cache'}"]
    out = tmp_path / "run"
    assert cli.main(["train", *ov, f"output_dir={out}"]) == 0
    plan = (out / "plan.json").read_bytes()
    broken = tmp_path / "broken"
    _model_dir(broken, tok)
    sd = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in sd.items() if "down_proj" not in k}, broken / "model.safetensors",
              metadata={"format": "pt"})
    capsys.readouterr()
    assert cli.main(["train", "resume=true", "job.max_steps=3", f"model.path={broken}", f"output_dir={out}"]) == 2
    assert "lacks 1 of its weights" in capsys.readouterr().err
    assert (out / "plan.json").read_bytes() == plan
    fresh = tmp_path / "run2"
    assert cli.main(["train", *ov, f"model.path={broken}", f"output_dir={fresh}"]) == 2
    assert not (fresh / "plan.json").exists()


def test_the_run_lock_covers_the_model_load(base_overrides, tmp_path, monkeypatch):
    """Building the model before the lock (to keep a refused model.path from writing plan.json) let
    a second run on the dir start and finish while the first loaded; the first then trained over it
    (review of d0194fe). While the model loads, the dir is locked and plan.json not yet written."""
    from lazytrain.cli.config import ConfigError
    from lazytrain.recipes import train as recipe

    out = tmp_path / "run"
    seen = {}
    build = recipe.build_model

    def loading(*a, **k):
        try:
            recipe.lock_output_dir(out)
            seen["locked"] = False
        except ConfigError as e:
            seen["locked"] = "in use by another lazytrain run" in str(e)
        seen["plan"] = (out / "plan.json").exists()
        return build(*a, **k)
    monkeypatch.setattr(recipe, "build_model", loading)
    assert cli.main(["train", *base_overrides, "job.max_steps=1", f"output_dir={out}"]) == 0
    assert seen == {"locked": True, "plan": False}
