"""Session-26 review: a measured-spec family with eager attention (Gemma 2) measured 1.15-1.30x its
plan's device peak (its softmax backward's gradients were not counted); now within it."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from lazytrain.runtime.testing import hand_plan, hardware_for_tests, planned_device_peak, steps_counting_op_temporaries
from lazytrain.spec import JobSpec


@pytest.mark.parametrize("seq", [256, 512])
def test_an_eager_attention_family_stays_within_its_plan(seq):
    cfg = transformers.AutoConfig.for_model(
        "gemma2", hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, head_dim=32, sliding_window=64,
        final_logit_softcapping=None, attn_logit_softcapping=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    assert model.config._attn_implementation == "eager"
    job = JobSpec(batch_size=1, seq_len=seq, compute_dtype="bf16")
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), activation_tier="host")
    planned = planned_device_peak(model, plan)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, seq), generator=g)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(copy.deepcopy(model), plan, [(ids, ids)]))
    assert 0.88 * planned <= measured <= planned, (measured, planned, measured / planned)


def test_packed_rows_of_a_sliding_and_full_family_stay_within_the_plan():
    """Gemma 3 (sliding + full layers, measured spec) with packed rows measured 1.0-1.2% over its
    plan with activations on the host: the additive mask SDPA makes in each masked block's backward
    sits on the device whatever tier the saved copy went to (review)."""
    cfg = transformers.AutoConfig.for_model(
        "gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, head_dim=32, sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    job = JobSpec(batch_size=2, seq_len=256, compute_dtype="bf16", packed_rows=True)
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), activation_tier="host")
    planned = planned_device_peak(model, plan)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 256), generator=g)
    pos = torch.cat([torch.arange(64)] * 4)[None].expand(2, 256).clone()
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(copy.deepcopy(model), plan,
                                                                               [(ids, ids, pos)]))
    assert 0.88 * planned <= measured <= planned, (measured, planned, measured / planned)
