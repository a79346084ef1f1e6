"""Checkpoint conversion of saved HF dirs (review, 2026-12-01): a config.json with transformers'
markers for infinite floats, and a key rename that would turn a model key into a non-key."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lazytrain.moe import convert_checkpoint, generate
from lazytrain.moe.convert import _renamer

PROMPT = [5, 17, 3, 99, 45, 12]


def _greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_a_config_with_an_infinite_float_converts_and_serves(tmp_path):
    """Mamba-2 layers' time_step_limit is (0, inf), which save_pretrained writes as
    {"__float__": "Infinity"}: it was a StrictDataclassFieldValidationError traceback."""
    cfg = AutoConfig.for_model("granitemoehybrid", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_local_experts=8,
                               num_experts_per_tok=2, shared_intermediate_size=64, mamba_d_state=8, mamba_n_heads=4,
                               mamba_d_head=32, mamba_n_groups=1, layer_types=["mamba", "attention"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    assert '"__float__"' in (tmp_path / "hf" / "config.json").read_text()
    convert_checkpoint(tmp_path / "hf", tmp_path / "store")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    want = _greedy(ref, PROMPT, 6)
    for model_path in (None, tmp_path / "hf"):
        assert generate(tmp_path / "store", prompt_ids=PROMPT, max_new_tokens=6, model_path=model_path,
                        cache_fraction=1.0).token_ids == want


def test_a_rename_that_breaks_a_model_key_is_undone(tmp_path):
    """DeepSeek-V4's rename `.norm.` -> `.kv_norm.` also caught the final `model.norm.weight`, and a
    checkpoint transformers saves and reloads exactly was refused ("lacks ... model.norm.weight")."""
    base = AutoConfig.for_model("deepseek_v4")
    over = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, n_routed_experts=8,
                num_experts_per_tok=2, max_position_embeddings=256, n_shared_experts=1)
    cfg = AutoConfig.for_model("deepseek_v4", **{k: v for k, v in over.items() if hasattr(base, k)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert _renamer(model)("model.norm.weight") == "model.kv_norm.weight"   # (the premise)
    model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "store")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert generate(tmp_path / "store", prompt_ids=PROMPT, max_new_tokens=6, cache_fraction=1.0).token_ids \
        == _greedy(ref, PROMPT, 6)


def test_experts_of_another_layout_are_named_in_the_refusal():
    """JetMoE's experts are its own modules, not transformers' fused layout: the refusal names them
    (review: "has no MoE experts layers" read as if the model had none)."""
    import pytest

    from lazytrain.moe.arch import NotMoeModelError, find_moe_layers

    cfg = AutoConfig.for_model("jetmoe", hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
                               intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=128)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(NotMoeModelError, match=r"JetMoeForCausalLM has no MoE experts layers lazytrain can stream: "
                                               r"model\.layers\.0\.\w+\.experts \(JetMoe\w+\) is not transformers' fused"):
        find_moe_layers(model)
