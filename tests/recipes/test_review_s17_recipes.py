"""Fixes from the session-17 review of the training flows and the planner: `train` resolving
planner.cache_dir as `plan` does, eval_files given without brackets, whole-number settings of
another type, a damaged state.json on resume."""
import pytest

def test_train_is_served_the_plan_that_plan_cached(text_data, tmp_path, monkeypatch):
    from lazytrain.cli import train as train_cli
    from lazytrain.cli.main import main as cli_main

    from lazytrain.cli import config as c

    # run from a dir without the cache: `plan` uses the checkout's (here a stand-in), so must `train`
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("")
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(c.config_dir()))
    monkeypatch.setattr(c, "repo_root", lambda: checkout)
    monkeypatch.chdir(tmp_path)
    common = ["model=tiny-llama", "model.hf_config.vocab_size=320", "job.seq_len=32", "job.batch_size=2",
              "planner.cache_dir=relcache", "job.clip_grad=true"]
    assert cli_main(["plan", *common]) == 0
    cached = sorted((checkout / "relcache").glob("*.json"))
    assert len(cached) == 1
    f, tok = text_data
    common.remove("job.clip_grad=true")   # (train sets it from optim.max_grad_norm)
    assert train_cli.main([*common, "data=text", f"data.files=[{f}]", f"data.tokenizer={tok}", "job.max_steps=1",
                           "engine=torch", "progress=false", f"output_dir={tmp_path / 'run'}"]) == 0
    assert sorted((checkout / "relcache").glob("*.json")) == cached   # a hit, not a second entry
    assert not (tmp_path / "relcache").exists()                        # nor a second cache


def test_eval_files_without_brackets_is_one_file(base_overrides, tmp_path, capsys):
    """Review: `data.eval_files=val.txt` was split into one-character paths ('data file v does not
    exist'); an absolute path made '/' its first 'file' and walked the whole filesystem."""
    import json

    from lazytrain.cli import train as train_cli

    f = next(a.split("=", 1)[1].strip("[]") for a in base_overrides if a.startswith("data.files="))
    val = tmp_path / "val.txt"
    val.write_bytes(open(f, "rb").read())
    out = tmp_path / "run"
    assert train_cli.main([*base_overrides, "job.max_steps=2", f"data.eval_files={val}", f"output_dir={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval_loss" in rows[-1]


@pytest.mark.parametrize("setting,msg", [("job.max_steps=abc", "job.max_steps must be a whole number >= 1, got 'abc'"),
                                         ("job.max_steps=2.7", "job.max_steps must be a whole number >= 1, got 2.7"),
                                         ("seed=abc", "seed must be a whole number >= 0, got 'abc'"),
                                         ("seed=1.5", "seed must be a whole number >= 0, got 1.5"),
                                         ("optim.warmup_steps=1.5", "optim.warmup_steps must be a whole number >= 0")])
def test_whole_number_settings_of_another_type_are_one_line(base_overrides, tmp_path, capsys, setting, msg):
    """Review: max_steps=abc and seed=abc gave tracebacks; 2.7 steps trained 2, seed 1.5 ran seed 1
    and warmup 1.5 warmed up 1 step, without a word."""
    from lazytrain.cli import train as train_cli

    out = tmp_path / "never"
    assert train_cli.main([*base_overrides, setting, f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "Traceback" not in err and not out.exists()


def test_a_damaged_state_json_on_resume_is_one_line(base_overrides, tmp_path, capsys):
    """Review: a state.json whose checksum fails was detected before Hydra started, but reported
    with a traceback (a damaged engine file got the one line)."""
    from lazytrain.cli import train as train_cli

    out = tmp_path / "run"
    assert train_cli.main([*base_overrides, "job.max_steps=3", "stop_at_step=2", f"output_dir={out}"]) == 0
    state = next((out / "checkpoints").glob("step_*/state.json"))
    text = state.read_text()
    state.write_text(text.replace('"step": 2', '"step": 1', 1))
    capsys.readouterr()
    assert train_cli.main([f"output_dir={out}", "resume=true"]) == 1
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]   # (after the line naming the settings taken from the record)
    assert last.startswith("lazytrain train: disk error:") and "state.json" in last and "Traceback" not in err


def test_lora_pure_bf16_is_the_same_math_on_both_engines(base_overrides, tmp_path):
    """Review: with job.master_dtype=bf16 engine=torch cast the LoRA adapters (and so their moments)
    to bf16, where the streaming executor keeps them fp32: losses parted from step 2. Both keep the
    adapters fp32 now (only the frozen base is bf16), and the losses are equal bit for bit."""
    import json

    from lazytrain.cli import train as train_cli

    ov = [a for a in base_overrides if not a.startswith(("job.compute_dtype", "engine"))]
    runs = {}
    for engine in ("lazytrain", "torch"):
        out = tmp_path / engine
        assert train_cli.main([*ov, "job.mode=lora", "job.master_dtype=bf16", "job.compute_dtype=bf16",
                               "job.max_steps=4", f"engine={engine}", f"output_dir={out}"]) == 0
        runs[engine] = [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert runs["lazytrain"] == runs["torch"]
