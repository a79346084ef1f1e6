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
