"""Quantized checkpoints (FP8 blocks with weight_scale_inv, the layout of Qwen3-30B-A3B-FP8 and
DeepSeek-V3) are refused by `moe convert` and `generate` in one line: their stored tensors are not
the weights (until 2026-12-02 they converted silently, scales dropped, and generate served
nonsense; a review). Their bf16 copy, as transformers dequantizes it, converts and serves exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lazytrain.cli import generate as gen_cli
from lazytrain.cli import moe as moe_cli
from lazytrain.moe import StoreError, convert_checkpoint, generate

B = 16


def _fp8_dir(make_model, tmp_path, with_config: bool = True):
    m = make_model("qwen3_moe", dtype="bfloat16")
    d = tmp_path / "fp8"
    m.save_pretrained(d)
    sd = load_file(d / "model.safetensors")
    q = {}
    for k, w in sd.items():
        if (k.endswith(".weight") and w.dim() == 2 and "norm" not in k and "embed" not in k
                and "lm_head" not in k and not k.endswith("mlp.gate.weight")):
            wf = w.float()
            o, i = wf.shape
            scale = wf.reshape(o // B, B, i // B, B).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q[k] = (wf / scale.repeat_interleave(B, 0).repeat_interleave(B, 1)).to(torch.float8_e4m3fn)
            q[k[:-len(".weight")] + ".weight_scale_inv"] = scale
        else:
            q[k] = w
    save_file(q, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    if with_config:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [B, B]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_fp8_checkpoint_is_refused_by_convert_and_generate(tiny_moe, tmp_path, err_line):
    d = _fp8_dir(tiny_moe, tmp_path)
    assert moe_cli.main(["convert", f"model.path={d}", f"out={tmp_path / 's'}"]) == 2
    line = err_line()
    assert "quantized checkpoint" in line and "quant_method=fp8" in line and "bf16" in line
    assert not (tmp_path / "s").exists()
    # a store of other weights named with the fp8 dir as model.path: refused the same way
    ok = tiny_moe("qwen3_moe", dtype="bfloat16")
    from lazytrain.moe import convert_model
    convert_model(ok, tmp_path / "other")
    assert gen_cli.main([f"model.path={d}", f"moe.store={tmp_path / 'other'}", "prompt_ids=[1,2]",
                         "max_new_tokens=2"]) == 2
    assert "quantized checkpoint" in err_line()


def test_fp8_tensors_without_a_quantization_config_are_refused(tiny_moe, tmp_path):
    d = _fp8_dir(tiny_moe, tmp_path, with_config=False)
    with pytest.raises(StoreError, match=r"stored as F8_E4M3.*quantized"):
        convert_checkpoint(d, tmp_path / "s")


def test_the_dequantized_copy_converts_and_serves_what_hf_serves(tiny_moe, tmp_path):
    from transformers import AutoModelForCausalLM

    d = _fp8_dir(tiny_moe, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(d).eval()      # no GPU: transformers dequantizes to bf16
    hf.save_pretrained(tmp_path / "bf16")
    convert_checkpoint(tmp_path / "bf16", tmp_path / "s")
    ids = [5, 17, 3, 99, 42, 7, 120, 101]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    assert generate(tmp_path / "s", prompt_ids=ids, max_new_tokens=10).token_ids == ref
