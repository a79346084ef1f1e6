"""An attention that is given an explicit mask (packed rows, a sliding window the sequence reaches)
or runs eagerly computes the whole [seq, seq] square, not SDPA's causal half: the cost model's
compute times count it (a Llama block with 4 packed rows measured 1.8% slower at 512 tokens and
26% at 2048 on the CPU; the cost model said 0% before, 3.9% and 14% now)."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain.costmodel import job_costs
from lazytrain.runtime.testing import hardware_for_tests
from lazytrain.spec import JobSpec, ModelSpec

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096)


def _block(spec, **job):
    hw = hardware_for_tests()
    return job_costs(spec, hw, JobSpec(**job)).layers[1], hw.achieved_flops_per_s


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_packed_rows_add_the_other_half_of_the_square(mode):
    spec = ModelSpec.from_hf_config({"model_type": "llama", **BASE}, name="x")
    job = dict(batch_size=2, seq_len=512, mode=mode)
    causal, flops = _block(spec, **job)
    packed, _ = _block(spec, **job, packed_rows=True)
    half = 2 * 512 * 512 * spec.layers[1].attn_flops_fwd_per_token_per_seq / flops
    assert packed.fwd_s - causal.fwd_s == pytest.approx(half, rel=1e-9)
    assert packed.bwd_s - causal.bwd_s == pytest.approx(2 * half, rel=1e-9)


def test_a_sliding_window_adds_it_once_the_sequence_reaches_the_window():
    spec = ModelSpec.from_hf_config({"model_type": "mistral", **BASE, "sliding_window": 256}, name="x")
    plain = ModelSpec.from_hf_config({"model_type": "mistral", **BASE, "sliding_window": None}, name="y")
    for seq, extra in ((128, False), (512, True)):
        a, _ = _block(spec, batch_size=1, seq_len=seq)
        b, _ = _block(plain, batch_size=1, seq_len=seq)
        assert (a.fwd_s > b.fwd_s) is extra and (a.bwd_s > b.bwd_s) is extra


def test_an_eager_attention_computes_the_square_at_every_length():
    spec = ModelSpec.from_hf_config({"model_type": "llama", **BASE, "attn_implementation": "eager"}, name="x")
    block = spec.layers[1]
    assert block.saved_bytes_per_token_per_seq > 0   # (measured: its probabilities)
    causal = dataclasses.replace(spec, layers=(spec.layers[0], dataclasses.replace(block, saved_bytes_per_token_per_seq=0),
                                               *spec.layers[2:]))
    eager, flops = _block(spec, batch_size=1, seq_len=256)
    sdpa, _ = _block(causal, batch_size=1, seq_len=256)
    assert eager.fwd_s - sdpa.fwd_s == pytest.approx(256 * 256 * block.attn_flops_fwd_per_token_per_seq / flops, rel=1e-9)


def test_flash_attention_gets_no_mask_and_no_square():
    """Flash attention takes packed rows' position ids and a window itself (varlen, windowed
    kernels): transformers builds it no mask, and it computes no square (review)."""
    spec = ModelSpec.from_hf_config({"model_type": "mistral", **BASE, "sliding_window": 256,
                                     "attn_implementation": "flash_attention_2"}, name="x")
    hw = hardware_for_tests()
    plain, packed = (job_costs(spec, hw, JobSpec(batch_size=1, seq_len=512, packed_rows=p)) for p in (False, True))
    assert packed.layers[1].fwd_s == plain.layers[1].fwd_s and packed.layers[1].act_bytes == plain.layers[1].act_bytes
    assert packed.device_static_bytes == plain.device_static_bytes
    sdpa = ModelSpec.from_hf_config({"model_type": "mistral", **BASE, "sliding_window": 256}, name="y")
    assert job_costs(sdpa, hw, JobSpec(batch_size=1, seq_len=512)).layers[1].fwd_s > plain.layers[1].fwd_s
