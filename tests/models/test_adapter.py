"""The model adapter finds embed / blocks / norm / head by structure and reproduces the HF forward."""

from __future__ import annotations

import pytest
import torch

from lazytrain.models import ModelStructureError, apply_lora, block_kwargs, find_parts, head_loss, run_block
from lazytrain.runtime.testing import random_batches, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("lora", [False, True])
def test_layer_by_layer_forward_equals_the_model(family, lora):
    model = tiny_model(family)
    if lora:
        model = apply_lora(model, rank=2, alpha=4, targets=("q_proj", "v_proj"))
    parts = find_parts(model)
    assert parts.num_layers == 3 and not parts.tied
    assert parts.layer_names() == ["embed", "block.0", "block.1", "block.2", "head"]
    ids, labels = random_batches(1, seed=0)[0]
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        kw = block_kwargs(parts, *ids.shape, torch.float32, torch.device("cpu"))
        h = parts.embed(ids)
        for b, k in zip(parts.blocks, kw, strict=True):
            h = run_block(b, h, k)
        got = head_loss(parts, h, labels)
    assert torch.equal(got, want)
    # every parameter belongs to exactly one execution-order layer
    seen = [id(p) for mods in parts.layer_modules() for m in mods for p in m.parameters()]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))


def test_not_a_causal_lm_is_refused():
    with pytest.raises(ModelStructureError):
        find_parts(torch.nn.Linear(2, 2))


def test_lora_bad_target_is_one_clear_line():
    with pytest.raises(ValueError, match="match no linear layer"):
        apply_lora(tiny_model("llama"), rank=2, alpha=4, targets=("qq_proj",))
