"""Fixes from the session-21 reviews of `lazytrain train`."""

import json

import pytest

from lazytrain.cli import train as cli


def _losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_model_path_checkpoint_trains_with_its_dropout_on_both_engines(base_overrides, tmp_path, capsys):
    """from_pretrained gives an eval-mode model: engine=lazytrain trained it so, its dropout off,
    while engine=torch and DeepSpeed switch to train mode (review: first loss 5.8058, the eval-mode
    loss, vs 5.7917). The executor replays dropout's RNG exactly, so both engines log the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                               max_position_embeddings=256, attention_dropout=0.5)
    d = tmp_path / "m"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    assert not AutoModelForCausalLM.from_pretrained(d).training
    common = [*[o for o in base_overrides if not o.startswith("engine=")], f"model.path={d}", "job.max_steps=3"]
    runs = {}
    for engine, extra in (("torch", []), ("lazytrain", ["hardware.device_memory_gib=0.002",
                                                        "hardware.workspace_gib=0.0001"])):
        out = tmp_path / engine
        assert cli.main([*common, f"engine={engine}", *extra, f"output_dir={out}"]) == 0, capsys.readouterr().err
        runs[engine] = _losses(out)
    # (later steps: each engine's AdamW rounds its own way)
    assert runs["lazytrain"][0] == runs["torch"][0], runs
    assert runs["lazytrain"] == pytest.approx(runs["torch"], rel=1e-5), runs
