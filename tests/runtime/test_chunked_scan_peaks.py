"""Blocks with a chunked scan (Falcon-H1's Mamba-2 mixer, Qwen3-Next's Gated DeltaNet) pad each
sequence to whole chunks. The planner measured them at 16-64 tokens as if each were a whole chunk:
their plans held several times the memory their device peaks reached (Falcon-H1 0.11-0.14 of
plan, Qwen3-Next 0.30). They are measured at two to four whole chunks now (the chunk found on the
mixer or as the default of the kernel its forward calls), and the cost model pads the length;
the executor's device peak (op temporaries counted) stays within the plan, and close to it.
MiniMax's lightning attention loops over `block_size` blocks the same way (0.37-0.54 of plan
before its block was taken for a chunk, 0.82-0.99 since: session 29)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from lazytrain.runtime.testing import hand_plan, hardware_for_tests, planned_device_peak, steps_counting_op_temporaries
from lazytrain.spec import JobSpec, ModelSpec

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=2048)
FAMILIES = {
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=1,
                      mamba_chunk_size=64),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # lightning attention: a loop over `block_size` blocks (256 tokens by default; not padded, the
    # plan pads: a partial block is planned whole). Taken per token at 16-64 tokens, 0.37-0.54.
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, block_size=256,
                    layer_types=["linear_attention", "full_attention", "linear_attention"]),
}


def _model(family: str):
    cfg = transformers.AutoConfig.for_model(family, **BASE, **FAMILIES[family])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def test_the_chunk_is_found_and_recorded():
    falcon = ModelSpec.from_hf_config({"model_type": "falcon_h1", **BASE, **FAMILIES["falcon_h1"]})
    assert [b.scan_chunk for b in falcon.blocks] == [64, 64, 64]
    # (Qwen3-Next: its Gated DeltaNet calls torch_chunk_gated_delta_rule, chunk_size=64 by default;
    # its full-attention block has none)
    qwen = ModelSpec.from_hf_config({"model_type": "qwen3_next", **BASE, **FAMILIES["qwen3_next"]})
    assert [b.scan_chunk for b in qwen.blocks] == [64, 0, 64]
    minimax = ModelSpec.from_hf_config({"model_type": "minimax", **BASE, **FAMILIES["minimax"]})
    assert [b.scan_chunk for b in minimax.blocks] == [256, 0, 256]


@pytest.mark.parametrize("family,batch,seq,kind", [
    ("falcon_h1", 1, 500, "device"),     # (not whole chunks: padded to 512)
    ("falcon_h1", 2, 256, "recompute"),
    ("qwen3_next", 1, 512, "device"),
    ("minimax", 1, 512, "device"),
    ("minimax", 2, 256, "recompute")])
def test_chunked_scan_blocks_stay_within_their_plans_and_near_them(family, batch, seq, kind):
    model = _model(family)
    job = JobSpec(batch_size=batch, seq_len=seq, compute_dtype="bf16")
    plans = {"device": {}, "recompute": dict(segments=[(1, 3)])}
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), **plans[kind])
    planned = planned_device_peak(model, plan)
    ids = torch.randint(3, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(copy.deepcopy(model), plan, [(ids, ids)]))
    assert 0.85 * planned <= measured <= planned, (measured, planned, measured / planned)
