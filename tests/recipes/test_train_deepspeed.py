"""engine=deepspeed through the same recipe: metrics, checkpoints (DeepSpeed's format inside ours),
exact resume, a final HF dir."""

import json

import pytest

from lazytrain.cli.config import load_config
from lazytrain.recipes.train import run


@pytest.mark.slow  # DeepSpeed's CPUAdam JIT build and gloo start-up take tens of seconds
def test_deepspeed_engine_resume_and_final(base_overrides, tmp_path):
    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    ov = [*base_overrides, "engine=deepspeed", "job.max_steps=4", "save_every=0"]
    a, b = tmp_path / "a", tmp_path / "b"
    for out, extra in ((a, []), (b, ["stop_at_step=2"]), (b, ["resume=true"])):
        run(load_config([*ov, f"output_dir={out}", *extra], config_name="train"), out, echo=lambda *_: None)
    la, lb = ([json.loads(l)["loss"] for l in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b))
    assert len(la) == 4 and la == lb
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(a / "final")


@pytest.mark.slow  # two DeepSpeed processes (gloo) start, build and train: about a minute
def test_two_ranks_train_the_single_process_job_and_resume(base_overrides, tmp_path):
    """`torchrun --nproc_per_node 2 ... engine=deepspeed`: each rank trains half of every step's batch
    (the same sequences as one process with twice the batch), rank 0 alone writes metrics and
    checkpoints, and a stopped 2-rank run resumes exactly."""
    import os
    import subprocess
    import sys

    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    common = [a for a in base_overrides if not a.startswith("job.batch_size")] + [
        "engine=deepspeed", "job.max_steps=3", "save_every=0"]
    one = tmp_path / "one"
    run(load_config([*common, "job.batch_size=4", f"output_dir={one}"], config_name="train"), one,
        echo=lambda *_: None)
    two = tmp_path / "two"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    for extra in (["stop_at_step=2"], ["resume=true"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "lazytrain.cli.main", "train", *common, "job.batch_size=2", f"output_dir={two}", *extra]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(l) for l in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]          # one writer, resumed once
    ref = [json.loads(l) for l in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_position"] for r in recs] == [r["data_position"] for r in ref]
    assert [r["tokens"] for r in recs] == [r["tokens"] for r in ref]
    assert recs[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-5)   # same sequences, same weights
    assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=1e-3)
    last = two / "checkpoints" / "step_000003"
    assert json.loads((last / "state.json").read_text())["world_size"] == 2
    assert (last / "rng-rank1.safetensors").is_file()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(two / "final")


@pytest.mark.slow  # DeepSpeed's CPUAdam JIT build and gloo start-up take tens of seconds
def test_deepspeed_bf16_tied_model_saves_tied(base_overrides, tmp_path):
    """With bf16 compute and tied embeddings, the saved lm_head is the embedding's fp32 master too
    (it was the bf16 copy: from_pretrained in fp32 then untied them, values differing)."""
    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = tmp_path / "ds"
    run(load_config([*base_overrides, "engine=deepspeed", "job.max_steps=2", "job.compute_dtype=bf16",
                     "model.hf_config.tie_word_embeddings=true", f"output_dir={out}"], config_name="train"),
        out, echo=lambda *_: None)
    sd = {}
    for f in (out / "final").glob("*.safetensors"):
        sd.update(load_file(f))
    emb = sd["model.embed_tokens.weight"]
    assert emb.dtype == torch.float32
    assert "lm_head.weight" not in sd or torch.equal(sd["lm_head.weight"], emb)
    m = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow  # DeepSpeed's start-up
def test_deepspeed_resume_refuses_changed_optimizer_settings(base_overrides, tmp_path):
    """DeepSpeed restores weight decay, betas and eps from its checkpoint: changed on resume they
    were silently not applied (review). They are refused; the same settings resume."""
    from lazytrain.cli.config import ConfigError
    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    out = tmp_path / "r"
    ov = [*base_overrides, "engine=deepspeed", "job.max_steps=3", "save_every=0", f"output_dir={out}"]
    run(load_config([*ov, "stop_at_step=1"], config_name="train"), out, echo=lambda *_: None)
    with pytest.raises(ConfigError, match="optimizer_settings"):
        run(load_config([*ov, "resume=true", "optim.weight_decay=0.5"], config_name="train"), out,
            echo=lambda *_: None)
    run(load_config([*ov, "resume=true"], config_name="train"), out, echo=lambda *_: None)


def test_only_deepspeed_checkpoints_record_the_optimizer_settings(base_overrides):
    from lazytrain.recipes.train import job_identity, preflight

    for engine, has in (("torch", False), ("deepspeed", True)):
        cfg = load_config([*base_overrides, f"engine={engine}"], config_name="train")
        pre = preflight(cfg) if engine == "torch" else pre
        ident = job_identity(cfg, pre.dataset, pre)
        assert ("optimizer_settings" in ident) == has
    assert ident["optimizer_settings"] == {"weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}


@pytest.mark.slow  # DeepSpeed's CPUAdam JIT build and gloo start-up take tens of seconds
def test_deepspeed_engine_evaluates_as_plain_pytorch(base_overrides, tmp_path):
    """data.eval_fraction on engine=deepspeed: the held-out losses at steps 2 and 4 are engine=torch's."""
    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    ov = [*base_overrides, "job.max_steps=4", "save_every=0", "data.eval_fraction=0.25", "eval_every=2"]
    evals = {}
    for eng in ("deepspeed", "torch"):
        out = tmp_path / eng
        run(load_config([*ov, f"engine={eng}", f"output_dir={out}"], config_name="train"), out, echo=lambda *_: None)
        evals[eng] = [(r["step"], r["eval_loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                      if "eval_loss" in r]
    assert [s for s, _ in evals["deepspeed"]] == [2, 4] == [s for s, _ in evals["torch"]]
    assert [x for _, x in evals["deepspeed"]] == pytest.approx([x for _, x in evals["torch"]], rel=1e-5)


@pytest.mark.slow  # DeepSpeed's CPUAdam JIT build and gloo start-up take tens of seconds
def test_deepspeed_trains_packed_rows_as_plain_pytorch(base_overrides, tmp_path):
    """Prompt/completion rows packed several to a sequence, each attending only to itself (position
    ids handed to the model): DeepSpeed's per-step and held-out losses are plain PyTorch's."""
    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    from recipe_helpers import packed_sft_losses

    losses = packed_sft_losses(base_overrides, tmp_path, {"torch": [], "deepspeed": []})
    assert len(losses["torch"]) == 4
    assert losses["deepspeed"] == pytest.approx(losses["torch"], rel=1e-4)
