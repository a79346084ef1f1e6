"""ModelSpec for model types without formulas (spec/generic.py): measured from the model
transformers builds. Cross-checked on families that do have formulas: the same parameters, linear
layers and FLOPs, and saved bytes within a few % of the formulas (which were fitted to
saved-tensor-hook measurements too)."""
import json

import pytest

from lazytrain.spec.generic import _measure
from lazytrain.spec.model import ModelConfigError, ModelSpec

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=1000),
    "mixtral": dict(model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                      vocab_size=1000, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_measured_spec_agrees_with_the_family_formulas(family):
    cfg = CONFIGS[family]
    got, want = _measure(cfg, None), ModelSpec.from_hf_config(cfg)
    assert [l.name for l in got.layers] == [l.name for l in want.layers]
    for a, b in zip(got.layers, want.layers):
        assert a.param_count == b.param_count and a.active_param_count == b.active_param_count, a.name
        assert a.num_experts == b.num_experts and a.experts_per_token == b.experts_per_token
        assert abs(a.matmul_flops_fwd_per_token - b.matmul_flops_fwd_per_token) <= 1e-3 * b.matmul_flops_fwd_per_token
        sa, sb = sum(a.saved_bytes_per_token.values()), sum(b.saved_bytes_per_token.values())
        assert abs(sa - sb) <= 0.06 * sb, (a.name, sa, sb)
        assert a.saved_bytes_per_token_per_seq == 0   # SDPA: nothing grows with seq x tokens
    dense = {l.name for l in want.blocks[0].linears if l.count == 1}
    assert dense <= {l.name for l in got.blocks[0].linears}   # LoRA targets and routers by name
    assert got.tie_word_embeddings == want.tie_word_embeddings and got.hidden_size == want.hidden_size


def test_other_model_types_are_measured_and_planned():
    cfg = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
               final_logit_softcapping=None, sliding_window=32,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.family == "gemma3_text" and spec.num_layers == 3 and spec.tie_word_embeddings
    assert spec.sliding_window == 32 and spec.sliding_blocks == (0, 1)
    assert all(sum(b.saved_bytes_per_token.values()) > 0 for b in spec.blocks)
    assert ModelSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["family"] == "gemma3_text"


def test_hybrid_linear_blocks_have_no_attention_flops():
    """Qwen3-Next's Gated DeltaNet blocks (layer_types linear_attention) have no seq x seq term:
    only its full-attention blocks are charged attention FLOPs (before: every block was)."""
    cfg = dict(model_type="qwen3_next", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    spec = ModelSpec.from_hf_config(cfg)
    assert [b.attn_flops_fwd_per_token_per_seq for b in spec.blocks] == [0, 0, 0, 2 * 4 * 16]
    assert all(b.matmul_flops_fwd_per_token > 0 for b in spec.blocks)
    # so a long sequence costs the linear blocks only their linears: per-token FLOPs flat in seq_len
    lin = spec.blocks[0]
    assert lin.flops_fwd(1, 8192) == lin.flops_fwd(1, 64)
    assert spec.blocks[3].flops_fwd(1, 8192) > spec.blocks[3].flops_fwd(1, 64)


def test_eager_attention_saves_per_token_and_sequence():
    """An eager attention keeps its [heads, seq, seq] probabilities: the measured spec carries that
    as bytes per token x sequence, which the cost model multiplies by seq_len."""
    cfg = dict(CONFIGS["llama"], model_type="olmo2", _attn_implementation="eager")
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.blocks[0].saved_bytes_per_token_per_seq >= 8 * 2   # heads x bf16 probabilities at least
    sdpa = ModelSpec.from_hf_config(dict(CONFIGS["llama"], model_type="olmo2"))
    assert sdpa.blocks[0].saved_bytes_per_token_per_seq == 0


def test_unknown_and_unsupported_model_types_say_why():
    with pytest.raises(ModelConfigError, match=r"model_type 'nosuchmodel': transformers does not know it"):
        ModelSpec.from_hf_config(dict(CONFIGS["llama"], model_type="nosuchmodel"))
    with pytest.raises(ModelConfigError, match=r"model_type 'bloom': BloomModel: expected exactly one final norm"):
        ModelSpec.from_hf_config(dict(model_type="bloom", hidden_size=32, n_layer=2, n_head=4, vocab_size=64))
    moe = dict(model_type="olmoe", hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
               vocab_size=64, num_experts=4, num_experts_per_tok=2)
    assert ModelSpec.from_hf_config(moe).blocks[0].experts_per_token == 2


def test_family_key_names_are_read_through_the_config():
    """GPT-J names its heads n_head, MPT n_heads (review: "missing required key
    num_attention_heads"); DeepSeek's latent attention has 24-wide query/key heads (rope + no-rope)."""
    gptj = ModelSpec.from_hf_config(dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, vocab_size=128,
                                         rotary_dim=8, n_positions=128, eos_token_id=0, bos_token_id=0))
    mpt = ModelSpec.from_hf_config(dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, vocab_size=128))
    assert (gptj.num_heads, gptj.head_dim, gptj.num_layers) == (4, 16, 2) == (mpt.num_heads, mpt.head_dim, mpt.num_layers)
    ds = ModelSpec.from_hf_config(dict(
        model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=128, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_group=1, topk_group=1))
    assert ds.head_dim == 24 and [b.num_experts for b in ds.blocks] == [0, 8]


def test_measured_types_check_their_config_as_the_families_do():
    """Review: a config without num_hidden_layers planned transformers' default (44 blocks for
    GPT-NeoX); 0 heads and heads that do not divide the width were tracebacks."""
    base = dict(model_type="gpt_neox", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    with pytest.raises(ModelConfigError, match="config is missing required keys: num_hidden_layers"):
        ModelSpec.from_hf_config({k: v for k, v in base.items() if k != "num_hidden_layers"})
    with pytest.raises(ModelConfigError, match="config: num_attention_heads must be a whole number >= 1, got 0"):
        ModelSpec.from_hf_config(dict(base, num_attention_heads=0))
    with pytest.raises(ModelConfigError, match=r"config \(gpt_neox\): The hidden size is not divisible"):
        ModelSpec.from_hf_config(dict(base, num_attention_heads=3))
    # the family's own key names count (GPT-J's n_layer)
    with pytest.raises(ModelConfigError, match="missing required keys: num_hidden_layers"):
        ModelSpec.from_hf_config(dict(model_type="gptj", n_embd=64, n_head=4, vocab_size=128))
