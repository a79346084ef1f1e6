"""Session 26: measured specs of MoE models hold one zero expert per stack (stride 0), not every
expert: DeepSeek-V3's config took minutes and ~22 GB to plan. The measure is the same as with
every expert made, and the same from run to run."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.spec import generic

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)
CASES = {
    "deepseek_v3": dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                        n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
}


def _full_copy(block):
    """What `_real_copy` made before: every parameter in full, zeroed."""
    real = copy.deepcopy(block).to_empty(device="cpu")
    with torch.no_grad():
        for t in (*real.parameters(), *real.buffers()):
            if t.is_floating_point():
                t.zero_()
    return real


@pytest.mark.parametrize("family", sorted(CASES))
def test_stride0_experts_measure_as_full_ones(family, monkeypatch):
    cfg = dict(model_type=family, **BASE, **CASES[family])
    made = []
    real_copy = generic._real_copy

    def spy(block):
        made.append(real_copy(block))
        return made[-1]

    monkeypatch.setattr(generic, "_real_copy", spy)
    light = generic._measure(dict(cfg), None)
    assert any(p.stride(0) == 0 for m in made for p in m.parameters() if p.dim() == 3)   # experts: one copy
    again = generic._measure(dict(cfg), None)
    monkeypatch.setattr(generic, "_real_copy", _full_copy)
    full = generic._measure(dict(cfg), None)
    assert light.layers == again.layers == full.layers


def test_families_a_review_found_unplannable_plan():
    """PhiMoE's rotary init takes the config alone (a traceback from `plan`); ERNIE-4.5-MoE names
    its top-k moe_k (refused: no top-k)."""
    from lazytrain.spec import ModelSpec

    base = dict(BASE, max_position_embeddings=512)
    phimoe = ModelSpec.from_hf_config(dict(base, model_type="phimoe", num_local_experts=4, num_experts_per_tok=2,
                                           bos_token_id=1, eos_token_id=2))
    assert [b.experts_per_token for b in phimoe.layers if b.kind == "block"] == [2, 2]
    ernie = ModelSpec.from_hf_config(dict(base, model_type="ernie4_5_moe", moe_num_experts=8, moe_k=2,
                                          moe_intermediate_size=32))
    assert [b.experts_per_token for b in ernie.layers if b.kind == "block"][-1] == 2


def test_a_formula_family_configured_eager_is_measured():
    """attn_implementation=eager on a Llama: the formulas (SDPA's) planned it 3.5x under its
    measured peak (review); it is measured instead, with its probabilities per token x sequence."""
    from lazytrain.spec import ModelSpec

    cfg = dict(BASE, model_type="llama", max_position_embeddings=512)
    sdpa = ModelSpec.from_hf_config(cfg)
    eager = ModelSpec.from_hf_config(dict(cfg, attn_implementation="eager"))
    assert all(b.saved_bytes_per_token_per_seq == 0 for b in sdpa.layers)
    assert all(b.saved_bytes_per_token_per_seq > 0 for b in eager.layers if b.kind == "block")
