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
