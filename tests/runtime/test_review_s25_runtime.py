"""Session 25: HF gradient checkpointing left on a model handed to the executor."""

import copy

import pytest
import torch

from lazytrain.runtime.executor import StreamingExecutor
from lazytrain.runtime.testing import hand_plan, random_batches, tiny_model


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_is_turned_off_with_a_warning_and_the_step_is_exact(reentrant):
    """use_reentrant=True passed the constructor and died in the first step with torch's raw
    RuntimeError; False recomputed inside the plan's recompute, unsaid (review)."""
    m = tiny_model("llama")
    m.train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ref = copy.deepcopy(m)
    ref.gradient_checkpointing_disable()
    batch = random_batches(1, seed=1)
    ids, labels = batch[0]
    loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    with pytest.warns(UserWarning, match="had Hugging Face gradient checkpointing on: turned off"):
        ex = StreamingExecutor(m, hand_plan(3), device="cpu", lr=1e-3)
    try:
        assert not m.is_gradient_checkpointing
        res = ex.train_step(batch)
        assert res.loss == pytest.approx(loss.item(), rel=1e-6)
    finally:
        ex.close()
