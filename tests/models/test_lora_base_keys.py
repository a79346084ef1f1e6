"""save_base_model writes the frozen base under any PEFT layout the executor supports: LoRA (also on
lm_head and embeddings), DoRA, modules_to_save, trainable tokens (whose wrapper holds the embedding
itself: it was left out, and from_pretrained filled it at random with a log line; review); a layout it
cannot map is refused, not saved with a weight missing."""

import pytest
import torch

from lazytrain.models.lora import save_base_model


def _cfg(tied: bool):
    from transformers import AutoConfig
    return AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                tie_word_embeddings=tied)


LAYOUTS = {
    "lora_lm_head": dict(target_modules=["q_proj", "v_proj", "lm_head"]),
    "lora_embedding": dict(target_modules=["q_proj", "embed_tokens"]),
    "dora": dict(target_modules=["q_proj", "down_proj"], use_dora=True),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["norm"]),
    "trainable_tokens": dict(target_modules=["q_proj"], trainable_token_indices=[1, 2]),
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_saved_base_is_the_model_the_adapters_wrap(tmp_path, layout, tied):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_cfg(tied))
    torch.manual_seed(0)
    m = get_peft_model(AutoModelForCausalLM.from_config(_cfg(tied)), LoraConfig(r=4, **LAYOUTS[layout]))
    with torch.no_grad():   # trained adapters: nothing of them may reach the base
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.add_(1.0)
    save_base_model(m, tmp_path / "base")
    base, info = AutoModelForCausalLM.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = base.state_dict()
    assert got.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k


def test_a_layout_it_cannot_map_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = get_peft_model(AutoModelForCausalLM.from_config(_cfg(False)), LoraConfig(r=4, target_modules=["q_proj"]))
    sd = {k.replace("embed_tokens.weight", "embed_tokens.some_wrapper.weight"): v for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*base not saved"):
        save_base_model(m, tmp_path / "base", peft_state=sd)
    assert not (tmp_path / "base").exists()
