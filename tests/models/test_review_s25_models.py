"""Session 25: a block list shorter than num_hidden_layers is named as such."""

import pytest
import torch
import transformers

from lazytrain.models.adapter import ModelStructureError, find_parts


def test_a_list_inside_a_block_is_not_taken_for_the_blocks():
    """LongCat-Flash counts two sub-layers per block in num_hidden_layers: its 2-entry self_attn
    list was taken for the blocks, and the block's own MLP blamed as weights next to them (review)."""
    if "longcat_flash" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no LongCat-Flash")
    cls = transformers.CONFIG_MAPPING["longcat_flash"]
    base = cls().to_dict()
    small = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, ffn_hidden_size=64,
                 expert_ffn_hidden_size=16, n_routed_experts=4, moe_topk=2, kv_lora_rank=8, q_lora_rank=8,
                 qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_layers=1, num_hidden_layers=2,
                 head_dim=8, max_position_embeddings=64)
    cfg = transformers.AutoConfig.for_model("longcat_flash", **{k: v for k, v in small.items() if k in base})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert len(model.model.layers) * 2 == cfg.num_hidden_layers
    with pytest.raises(ModelStructureError, match=rf"no ModuleList of {cfg.num_hidden_layers} decoder blocks "
                                                  r"\(the config's num_hidden_layers\) found; the outermost list "
                                                  r"of blocks, model.layers, holds 1"):
        find_parts(model)
