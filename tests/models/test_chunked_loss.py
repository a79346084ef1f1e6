"""The chunked causal-LM loss against the model's own (HF's ForCausalLMLoss)."""

import pytest
import torch

from lazytrain.models.chunked_loss import chunked_causal_lm_loss
from lazytrain.runtime.testing import rel_err as _rel
from lazytrain.runtime.testing import tiny_model


@pytest.mark.parametrize("chunk", [1, 7, 48, 1000])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_loss_equals_the_models_own(dtype, chunk):
    vocab = 1000
    m = tiny_model("llama", vocab_size=vocab, dtype=dtype)
    torch.manual_seed(0)
    h = torch.randn(2, 24, 32, dtype=getattr(torch, dtype), requires_grad=True)
    labels = torch.randint(0, vocab, (2, 24))
    labels[0, :3] = -100                                   # ignored, as the model's loss does
    ref = m.loss_function(logits=m.lm_head(h), labels=labels, vocab_size=vocab)
    gh_ref, gw_ref = torch.autograd.grad(ref, [h, m.lm_head.weight])
    out = chunked_causal_lm_loss(h, m.lm_head, labels, chunk)
    gh, gw = torch.autograd.grad(out, [h, m.lm_head.weight])
    assert _rel(out, ref) < 1e-6
    if dtype == "float32":
        assert _rel(gh, gh_ref) < 1e-5 and _rel(gw, gw_ref) < 1e-5
    else:   # bf16: the same per-element arithmetic; sums in another order flip a last bit at most
        assert _rel(gh, gh_ref) < 8e-3 and _rel(gw, gw_ref) < 8e-3


def test_bias_gradient_and_all_ignored_rows():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    h = torch.randn(1, 10, 16, requires_grad=True)
    labels = torch.randint(0, 50, (1, 10))
    labels[0, 4:7] = -100
    logits = head(h).float()
    ref = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
    g_ref = torch.autograd.grad(ref, [h, head.weight, head.bias])
    out = chunked_causal_lm_loss(h, head, labels, 3)
    g = torch.autograd.grad(out, [h, head.weight, head.bias])
    assert _rel(out, ref) < 1e-6
    for a, b in zip(g, g_ref):
        assert _rel(a, b) < 1e-5
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_causal_lm_loss(h, head, labels, 0)


def test_no_target_at_all_gives_nan_loss_and_zero_gradients_as_hf():
    # (a review finding: the gradients were NaN, which turned every weight NaN in a step whose
    # other micro-batches had targets)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.full((2, 5), -100)
    out = chunked_causal_lm_loss(h, head, labels, 3)
    gh, gw = torch.autograd.grad(out, [h, head.weight])
    assert torch.isnan(out)
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))
