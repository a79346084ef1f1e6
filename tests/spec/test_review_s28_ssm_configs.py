"""Configs as the hub's state-space models ship them: a Mamba's names no attention heads (its blocks
have none), a Mamba-2's only its SSM heads (`num_heads`), and a Nemotron-H config saved by
transformers 5 has no `num_hidden_layers` (derived from `layers_block_type`). All three were
refused ("config is missing required keys"); they are planned now, their blocks without attention
FLOPs. A family that has a key as a setting of its own still must name it."""

from __future__ import annotations

import pytest
import transformers

from lazytrain.spec import ModelSpec
from lazytrain.spec.model import ModelConfigError

# state-spaces/mamba-130m-hf's config.json, smaller
MAMBA = {"architectures": ["MambaForCausalLM"], "bos_token_id": 0, "conv_kernel": 4, "eos_token_id": 0, "expand": 2,
         "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.1, "intermediate_size": 128,
         "layer_norm_epsilon": 1e-05, "model_type": "mamba", "n_layer": 3, "num_hidden_layers": 3, "pad_token_id": 0,
         "rescale_prenorm_residual": False, "residual_in_fp32": True, "state_size": 16, "time_step_rank": 8,
         "use_bias": False, "use_conv_bias": True, "vocab_size": 320}


def test_a_mamba_config_without_attention_heads_is_planned():
    assert "num_attention_heads" not in MAMBA
    spec = ModelSpec.from_hf_config(MAMBA)
    assert spec.num_layers == 3 and spec.num_heads == 0
    assert all(b.attn_flops_fwd_per_token_per_seq == 0 and b.matmul_flops_fwd_per_token > 0 for b in spec.blocks)
    assert spec.residual_bytes == 4


def test_a_mamba2_config_naming_only_its_ssm_heads_is_planned():
    cfg = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32,
           "vocab_size": 256, "state_size": 16, "n_groups": 1, "expand": 2, "conv_kernel": 4, "chunk_size": 16}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.num_layers == 2
    assert all(b.attn_flops_fwd_per_token_per_seq == 0 for b in spec.blocks)


def test_a_nemotron_h_config_saved_by_transformers_is_planned():
    cfg = transformers.AutoConfig.for_model(
        "nemotron_h", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=256, layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=1, chunk_size=16).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")}
    assert "num_hidden_layers" not in cfg
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.num_layers == 3
    assert [b.attn_flops_fwd_per_token_per_seq > 0 for b in spec.blocks] == [False, True, False]


@pytest.mark.parametrize("family,key", [("gpt_neox", "num_attention_heads"), ("mamba", "num_hidden_layers")])
def test_a_key_the_family_has_is_still_required(family, key):
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
            "intermediate_size": 128}
    if family == "mamba":
        base = {k: v for k, v in MAMBA.items() if k != "n_layer"}
    cfg = {k: v for k, v in {**base, "model_type": family}.items() if k != key}
    with pytest.raises(ModelConfigError, match=f"missing required keys: {key}"):
        ModelSpec.from_hf_config(cfg)


NEMOTRON = dict(model_type="nemotron_h", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=256, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                chunk_size=16)


@pytest.mark.parametrize("extra,match", [
    ({}, "missing required keys: layers_block_type or layer_types or hybrid_override_pattern"),
    ({"num_hidden_layers": 8}, "missing required keys: layers_block_type"),
    ({"hybrid_override_pattern": "M*M-M*", "num_hidden_layers": 8}, "num_hidden_layers=8 but nemotron_h's layout gives 6")])
def test_a_nemotron_h_config_without_its_layout_is_refused_not_planned_as_the_default(extra, match):
    """Review: with num_hidden_layers no longer required, a config naming no layout was planned as
    transformers' default 4-layer [mamba, moe, attention, mlp] model."""
    with pytest.raises(ModelConfigError, match=match):
        ModelSpec.from_hf_config({**NEMOTRON, **extra})
    assert ModelSpec.from_hf_config({**NEMOTRON, "hybrid_override_pattern": "M*M-M*"}).num_layers == 6


def test_a_multimodal_family_still_needs_its_sizes():
    """Review: its default config has no size key at the top level, so none was required, and
    `{"model_type": "gemma3"}` planned a 26-layer model of transformers' defaults."""
    with pytest.raises(ModelConfigError, match="missing required keys: hidden_size, num_hidden_layers"):
        ModelSpec.from_hf_config({"model_type": "gemma3"})


def test_rwkv_is_planned_its_mixing_vectors_not_taken_for_experts():
    """Review: past the key check, its [1, 1, hidden] time-mix parameters were counted as one
    expert and the config refused for naming no top-k."""
    spec = ModelSpec.from_hf_config({"model_type": "rwkv", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
                                     "attention_hidden_size": 64, "intermediate_size": 256, "context_length": 2048})
    assert all(b.num_experts == 0 and b.attn_flops_fwd_per_token_per_seq == 0 for b in spec.blocks)
