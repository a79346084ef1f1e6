"""Review (session 13): a resume on other data (same sequence count) is refused; DeepSpeed settings
for activation checkpointing are refused like the other keys the job decides; a ZeRO stage given
as the string "3" is stage 3."""
import json
import random

import pytest

from lazytrain.cli.config import ConfigError, load_config
from lazytrain.recipes import checkpoint as ckpt
from lazytrain.recipes.train import deepspeed_overrides, run
from recipe_helpers import TEXT


def _run(overrides, out, *extra):
    cfg = load_config([*overrides, f"output_dir={out}", *extra], config_name="train")
    return run(cfg, out, echo=lambda *_: None)


def _rows(path, order_seed=None):
    rows = [json.dumps({"text": TEXT.replace("sequence", f"sequence {i}")}) for i in range(20)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(rows)
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture
def two_data_sets(base_overrides, tmp_path):
    """Overrides without data.files, and two JSONL files of the same rows in another order (the
    same number of tokens and sequences: the count and seq_len the checkpoint recorded agree)."""
    ov = [o for o in base_overrides if not o.startswith("data.files=")]
    ov += ["job.max_steps=3", "save_every=1"]
    return ov, _rows(tmp_path / "a.jsonl"), _rows(tmp_path / "b.jsonl", order_seed=1)


def test_resume_on_other_data_is_refused(two_data_sets, tmp_path):
    ov, a, b = two_data_sets
    out = tmp_path / "r"
    _run([*ov, f"data.files=[{a}]"], out, "stop_at_step=1")
    with pytest.raises(ConfigError, match=r"^cannot resume: the checkpoint was trained on other data "
                                          r"\(token fingerprint [0-9a-f]{16}, this run's [0-9a-f]{16}.*"
                                          r"use the same data or a new output_dir$"):
        _run([*ov, f"data.files=[{b}]"], out, "resume=true")
    state = ckpt.read_state(ckpt.latest_checkpoint(out / "checkpoints"))
    assert set(state["dataset"]) == {"sequences", "seq_len", "fingerprint"}
    # the same data under another name resumes
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(a.read_bytes())
    s = _run([*ov, f"data.files=[{moved}]"], out, "resume=true")
    assert s["start_step"] == 1 and s["end_step"] == 3


def test_a_checkpoint_without_a_fingerprint_still_resumes(two_data_sets, tmp_path):
    """Checkpoints written before the fingerprint was recorded: compared as before (count, seq_len)."""
    ov, a, _ = two_data_sets
    out = tmp_path / "r"
    _run([*ov, f"data.files=[{a}]"], out, "stop_at_step=1")
    last = ckpt.latest_checkpoint(out / "checkpoints")
    state = json.loads((last / "state.json").read_text())
    del state["dataset"]["fingerprint"]
    state[ckpt.STATE_SUM] = ckpt._state_crc(state)   # (as such a checkpoint was written)
    (last / "state.json").write_text(json.dumps(state))
    s = _run([*ov, f"data.files=[{a}]"], out, "resume=true")
    assert s["start_step"] == 1 and s["end_step"] == 3


def _cfg(*ov):
    return load_config(list(ov), config_name="train")


def test_deepspeed_activation_checkpointing_is_refused_as_the_plans():
    """The blocks recompute through Hugging Face checkpointing as the plan says; DeepSpeed's section
    configures only deepspeed.checkpointing, which nothing calls: it was accepted and never used."""
    with pytest.raises(ConfigError, match=r"activation_checkpointing \(the plan's recompute decisions.*"
                                          r"come\(s\) from lazytrain's own settings"):
        deepspeed_overrides(_cfg("engine=deepspeed", "+deepspeed.activation_checkpointing.cpu_checkpointing=true"))
    with pytest.raises(ConfigError) as e:   # named with the others, in one error
        deepspeed_overrides(_cfg("engine=deepspeed", "+deepspeed.gradient_clipping=0.5",
                                 "+deepspeed.activation_checkpointing.partition_activations=true"))
    assert "optim.max_grad_norm" in str(e.value) and "activation_checkpointing (" in str(e.value)


def test_hf_trainer_auto_activation_checkpointing_is_dropped(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"activation_checkpointing": {"partition_activations": "auto"},
                             "zero_optimization": {"stage": 3}}))
    assert deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}")) == \
        {"zero_optimization": {"stage": 3}}


def test_deepspeed_activation_checkpointing_left_at_its_defaults_is_dropped(tmp_path):
    """The all-defaults block many published DeepSpeed configs carry asks for nothing: it was
    refused as the plan's once the section became a job key."""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False},
        "zero_optimization": {"stage": 3}}))
    assert deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}")) == \
        {"zero_optimization": {"stage": 3}}


def test_zero_stage_given_as_a_string(tmp_path):
    """DeepSpeed takes "stage": "3"; it was refused with "zero_optimization.stage=3: lazytrain runs
    DeepSpeed with ZeRO stage 3"."""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": "3", "sub_group_size": 1000}}))
    over = deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}"))
    assert over == {"zero_optimization": {"stage": 3, "sub_group_size": 1000}}
    assert deepspeed_overrides(_cfg("engine=deepspeed", "+deepspeed.zero_optimization.stage='3'")) == \
        {"zero_optimization": {"stage": 3}}
    f.write_text(json.dumps({"zero_optimization": {"stage": "2"}}))
    with pytest.raises(ConfigError, match="zero_optimization.stage=2: lazytrain runs DeepSpeed with ZeRO stage 3"):
        deepspeed_overrides(_cfg("engine=deepspeed", f"deepspeed_config={f}"))
