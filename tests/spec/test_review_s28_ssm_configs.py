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
