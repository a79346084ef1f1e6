"""A LoRA run on a model built from its config saves the frozen base it trained on (final/base, an
HF dir) and names it in the adapter's config: the adapter loads without rebuilding the random base
by hand (until 2026-12-02 a known gap). A run with model.path writes no copy of its base."""

import json

import pytest
import torch

from lazytrain.cli.config import load_config
from lazytrain.recipes.train import run


def _seed_base():
    """The random base the recipe builds from the config (seed 0), as the run did."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazytrain.cli.config import model_spec
    hf = dict(model_spec(load_config(["model=tiny-llama", "model.hf_config.vocab_size=320"])).hf_config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))


def _train(ov, out):
    run(load_config([*ov, f"output_dir={out}"], config_name="train"), out, echo=lambda *_: None)


def _check_saved(out, dtype):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    final = out / "final"
    base, info = AutoModelForCausalLM.from_pretrained(final / "base", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = _seed_base()
    got = base.state_dict()
    assert got.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():   # the base the adapters were trained with (compute dtype)
        assert torch.equal(got[k], v.to(dtype).float()), k
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str((final / "base").resolve())
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        auto = AutoPeftModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()(ids).logits
        ref_base = _seed_base()
        if dtype != torch.float32:
            for p in ref_base.parameters():
                p.data = p.data.to(dtype).float()
        by_hand = PeftModel.from_pretrained(ref_base, final).eval()(ids).logits
    torch.testing.assert_close(auto, by_hand, rtol=0, atol=0)
    return final


@pytest.mark.parametrize("engine,dtype", [("torch", "fp32"), ("lazytrain", "bf16")])
def test_lora_on_a_config_built_model_saves_its_base(base_overrides, tmp_path, engine, dtype):
    ov = [*base_overrides, f"engine={engine}", "job.mode=lora", "job.lora_rank=4", "job.max_steps=2",
          "save_every=0", f"job.compute_dtype={dtype}"]
    if engine == "lazytrain":
        ov += ["hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001"]
    out = tmp_path / "a"
    _train(ov, out)
    final = _check_saved(out, torch.float32 if engine == "torch" else torch.bfloat16)
    # a LoRA run on a model dir (here the saved base) writes no copy of it
    out2 = tmp_path / "b"
    _train([*[o for o in ov if not o.startswith("model.hf_config")], f"model.path={final / 'base'}"], out2)
    assert (out2 / "final" / "adapter_config.json").is_file()
    assert not (out2 / "final" / "base").exists()


def test_full_fine_tuning_saves_no_base_dir(base_overrides, tmp_path):
    out = tmp_path / "f"
    _train([*base_overrides, "job.mode=full", "job.max_steps=1", "save_every=0"], out)
    assert (out / "final" / "config.json").is_file() and not (out / "final" / "base").exists()


@pytest.mark.slow  # DeepSpeed's CPUAdam JIT build and gloo start-up take tens of seconds
def test_deepspeed_lora_on_a_config_built_model_saves_its_base(base_overrides, tmp_path):
    from lazytrain.integrations.deepspeed import check_available
    msg = check_available()
    if msg:
        pytest.skip(msg)
    out = tmp_path / "d"
    _train([*base_overrides, "engine=deepspeed", "job.mode=lora", "job.lora_rank=4", "job.max_steps=2",
            "save_every=0"], out)
    _check_saved(out, torch.float32)
