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
    common = [*[o for o in base_overrides if not o.startswith(("engine=", "model.hf_config"))], f"model.path={d}",
              "job.max_steps=3"]
    runs = {}
    for engine, extra in (("torch", []), ("lazytrain", ["hardware.device_memory_gib=0.002",
                                                        "hardware.workspace_gib=0.0001"])):
        out = tmp_path / engine
        assert cli.main([*common, f"engine={engine}", *extra, f"output_dir={out}"]) == 0, capsys.readouterr().err
        runs[engine] = _losses(out)
    # (later steps: each engine's AdamW rounds its own way)
    assert runs["lazytrain"][0] == runs["torch"][0], runs
    assert runs["lazytrain"] == pytest.approx(runs["torch"], rel=1e-5), runs


def test_a_resume_says_which_schedule_and_step_size_settings_changed(base_overrides, tmp_path, capsys):
    """Only a changed job.max_steps was said; optim.warmup_steps=6 given when resuming at step 3
    warmed the lr up again from 0.002 without a word, and a new batch size went unsaid (review)."""
    out = tmp_path / "r"
    assert cli.main([*base_overrides, f"output_dir={out}", "stop_at_step=3"]) == 0
    capsys.readouterr()
    assert cli.main([f"output_dir={out}", "resume=true", "optim.warmup_steps=6", "job.batch_size=1"]) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    assert "optim.warmup_steps 2 -> 6 since the checkpoint's run: the lr schedule changes from step 4 on" in text, text
    assert "job.batch_size 2 -> 1 since the checkpoint's run: each step from step 4 on takes 1 sequences" in text, text
    lrs = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs[3] == pytest.approx(3e-3 * 4 / 6)   # (what was said is what ran)
    capsys.readouterr()
    assert cli.main([f"output_dir={out}", "resume=true", "optim.warmup_steps=6", "job.batch_size=1",
                     "job.max_steps=8"]) == 0
    text = "".join(capsys.readouterr())
    assert "warmup_steps" not in text and "batch_size" not in text and "job.max_steps 6 -> 8" in text, text


def test_lora_on_the_head_with_a_chunked_loss_is_one_line_before_anything_is_written(base_overrides, tmp_path, capsys):
    """It passed the checks, wrote plan.json, .hydra/ and nvme/, then the executor's ValueError came
    out as Hydra's traceback, exit 1 (review)."""
    out = tmp_path / "r"
    rc = cli.main([*base_overrides, "engine=lazytrain", "job.mode=lora", "job.lora_targets=[q_proj,lm_head]",
                   "job.loss_chunk_tokens=16", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2 and "job.loss_chunk_tokens computes the head itself and needs a plain linear lm_head" in err, err
    assert "Traceback" not in err and not out.exists()


def test_engine_torch_says_it_runs_the_unchunked_loss(base_overrides, tmp_path, capsys):
    """engine=deepspeed said so; engine=torch ignored job.loss_chunk_tokens silently (review)."""
    assert cli.main([*base_overrides, "job.loss_chunk_tokens=16", "job.max_steps=1", f"output_dir={tmp_path / 'r'}"]) == 0
    assert "torch: job.loss_chunk_tokens=16 is not followed" in capsys.readouterr().out
