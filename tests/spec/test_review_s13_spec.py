"""Config validation found in review (session 13): HF configs and hardware values that crashed
far from their cause, or planned a model or machine that cannot exist."""

import json
import re

import pytest

from lazytrain.spec import HardwareSpec, ModelConfigError, ModelSpec

BASE = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


@pytest.mark.parametrize("cfg,says", [
    # was: KeyError 'moe_intermediate_size' (a traceback). Left out, it is transformers' default
    # since 2026-12-01 (tests/spec/test_family_defaults.py); null is refused
    (dict(BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=None),
     "moe_intermediate_size must be a whole number >= 1, got None"),
    (dict(BASE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=None),
     "moe_intermediate_size must be a whole number >= 1, got None"),
    (dict(BASE, num_attention_heads=0), "num_attention_heads must be a whole number >= 1, got 0"),  # was: ZeroDivisionError
    (dict(BASE, num_hidden_layers=0), "num_hidden_layers must be a whole number >= 1, got 0"),   # was: planned, "0.00B params"
    (dict(BASE, num_hidden_layers=-3), "num_hidden_layers must be a whole number >= 1, got -3"),  # was: IndexError
    (dict(BASE, hidden_size=None), "hidden_size must be a whole number >= 1, got None"),        # was: TypeError
    (dict(BASE, hidden_size=64.9), "hidden_size must be a whole number >= 1, got 64.9"),         # was: planned as 64
    (dict(BASE, vocab_size=0), "vocab_size must be a whole number >= 1, got 0"),                # was: planned
    (dict(BASE, num_key_value_heads=3), "num_key_value_heads=3 does not divide num_attention_heads=4"),  # was: planned
    (dict(BASE, model_type="mixtral", num_local_experts=2, num_experts_per_tok=4),
     "num_experts_per_tok=4 exceeds the number of experts (2)"),                                # was: planned
    (dict(BASE, hidden_size=2, num_attention_heads=4, num_key_value_heads=4), "head_dim must be a whole number >= 1, got 0"),
])
def test_bad_hf_configs_name_the_field(cfg, says):
    with pytest.raises(ModelConfigError, match=re.escape(says)):
        ModelSpec.from_hf_config(cfg)


def test_a_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ModelConfigError, match="config is a JSON list"):
        ModelSpec.from_pretrained_dir(tmp_path)


def test_valid_moe_configs_still_build():
    # qwen MoE without experts is dense (no moe_intermediate_size needed); 64.0 is a whole number
    dense = ModelSpec.from_hf_config(dict(BASE, model_type="qwen3_moe", num_experts=0, hidden_size=64.0))
    assert not dense.is_moe and dense.hidden_size == 64
    moe = ModelSpec.from_hf_config(dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=4))
    assert moe.is_moe


def _hw(**kw):
    d = dict(name="t", device_type="cuda", device_memory_gib=1.0, host_memory_gib=8.0, nvme_capacity_gib=16.0,
             h2d_gbps=12.0, d2h_gbps=12.0, nvme_read_gbps=2.8, nvme_write_gbps=3.3, device_tflops=20.0)
    d.update(kw)
    return HardwareSpec(**d)


@pytest.mark.parametrize("field,value", [("device_memory_gib", "4G"), ("h2d_gbps", "fast"),
                                         ("workspace_gib", None), ("efficiency", True)])
def test_non_numeric_hardware_values_are_refused(field, value):
    # was: accepted, and "4G" * GiB made a 4-GiB string (a 12 GB process before it failed)
    with pytest.raises(ValueError, match=re.escape(f"hardware.{field} must be a plain number") + ".*"
                       + re.escape(f"got {value!r}")):
        _hw(**{field: value})
    assert _hw(device_memory_gib=4).device_memory_bytes == 4 * 2**30   # ints are numbers
