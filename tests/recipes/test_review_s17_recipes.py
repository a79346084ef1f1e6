"""Fixes from the session-17 review of the training flows and the planner: `train` resolving
planner.cache_dir as `plan` does, ..."""

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
