"""Models that compute something outside embed -> blocks -> final norm -> head -> loss are refused
when the executor is made (a probe runs the model's own forward on 8 tokens with its blocks stood in
for); what the executor can run exactly, it runs: positional block arguments, blocks returning
lists, a base model reading its blocks' attributes, a final norm without weights, parameters HF
freezes itself. Each of these gave wrong gradients silently, crashed mid-step or was refused before
(a review ran the executor against plain autograd on ~75 HF architectures)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

from lazytrain.models.adapter import (POSITIONAL, ModelStructureError, _Recorder, block_kwargs, find_parts,
                                      head_loss, probe_forward, run_block)
from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import (GradCapture, hand_plan, plan_families, random_batches, reference_training,
                                       rel_err, tiny_model)

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(model_type: str, common: bool = True, **overrides):
    cfg = transformers.AutoConfig.for_model(model_type, **{**(COMMON if common else {}), **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def make(model, tmp_path, plan_name="all_resident", **kw):
    L = model.config.get_text_config().num_hidden_layers
    return StreamingExecutor(copy.deepcopy(model), hand_plan(L, **plan_families(L)[plan_name]), device="cpu",
                             nvme_dir=tmp_path, **kw)


def assert_exact(model, tmp_path, plan_name="all_resident"):
    """One step's loss and every gradient equal plain autograd's (same RNG seed both sides)."""
    mbs = random_batches(2, seed=1)
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)
    losses = []
    for ids, labels in mbs:
        loss = ref(input_ids=ids, labels=labels).loss
        losses.append(loss.item())
        (loss / len(mbs)).backward()
    ex = make(model, tmp_path, plan_name, lr=0.0, max_grad_norm=float("inf"))
    cap = GradCapture(ex)
    torch.manual_seed(1234)
    r = ex.train_step(mbs)
    ex.close()
    assert abs(r.loss - sum(losses) / len(losses)) <= 1e-5 * abs(r.loss)
    want = {n: p.grad if p.grad is not None else torch.zeros_like(p)
            for n, p in ref.named_parameters() if p.requires_grad}
    assert set(want) == set(cap.grads)
    assert max(rel_err(cap.grads[n], g) for n, g in want.items()) <= 1e-5


# ---- 1. what the causal LM's forward does to the logits ------------------------------------------
@pytest.mark.parametrize("model_type,overrides", [
    ("gemma2", dict(head_dim=8, final_logit_softcapping=0.5)),
    ("gemma2", dict(head_dim=8)),   # the default cap (30): 5.5e-5 off in the gradients
    ("cohere", {}),                 # logit_scale 0.0625
])
def test_logit_transforms_are_refused(model_type, overrides, tmp_path):
    with pytest.raises(ModelStructureError, match="after the last block.*loss and gradients would differ"):
        make(build(model_type, **overrides), tmp_path)


def test_logit_softcap_off_is_accepted_and_exact(tmp_path):
    assert_exact(build("gemma2", head_dim=8, final_logit_softcapping=None), tmp_path)


# ---- 2. what the base model does between the embedding and block 0 -------------------------------
def test_embedding_multiplier_is_refused(tmp_path):
    model = build("granite", embedding_multiplier=2.0, logits_scaling=1.0)
    with pytest.raises(ModelStructureError, match="transforms the embedding output before block 0"):
        make(model, tmp_path)


def test_embedding_dropout_is_refused_in_training(tmp_path):
    with pytest.raises(ModelStructureError, match="dropout .*between the embedding and block 0 in training"):
        make(build("phi", embd_pdrop=0.2, resid_pdrop=0.0, attention_dropout=0.0), tmp_path)
    # dropout inside the blocks is reproduced (same RNG stream): exact
    assert_exact(build("phi", embd_pdrop=0.0, resid_pdrop=0.2, attention_dropout=0.0), tmp_path)


def test_embedding_dropout_in_an_eval_mode_model_is_accepted(tmp_path):
    """The executor runs the model in the mode it is given: in eval mode an embedding dropout is
    off, the loss is the model's own, and the error's advice ("train in eval mode") must hold."""
    model = build("phi", embd_pdrop=0.2, resid_pdrop=0.0, attention_dropout=0.0).eval()
    ref = copy.deepcopy(model)
    ex = make(model, tmp_path, lr=0.0)
    try:
        mbs = random_batches(1, seed=1)
        with torch.no_grad():
            want = ref(input_ids=mbs[0][0], labels=mbs[0][1]).loss.item()
        assert ex.train_step(mbs).loss == want
    finally:
        ex.close()


# ---- 3. positional block arguments ----------------------------------------------------------------
def test_positional_block_arguments_are_passed():
    """XGLM passes its causal mask positionally: block_kwargs kept keywords only, so attention was
    not causal. Composed from the model's own block-0 input (XGLM scales and adds positions before
    block 0, which the probe refuses), the blocks now give the model's loss bit for bit."""
    model = build("xglm", **SPECIAL).eval()
    parts = find_parts(model)
    ids, labels = random_batches(1, seed=0)[0]
    got = {}
    hook = parts.blocks[0].register_forward_pre_hook(lambda m, a, k: got.update(h=a[0]), with_kwargs=True)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
        hook.remove()
        kw = block_kwargs(parts, *ids.shape, torch.float32, torch.device("cpu"))
        assert isinstance(kw[0][POSITIONAL][0], torch.Tensor) and kw[0][POSITIONAL][0].dim() == 4   # the mask
        h = got["h"]
        for b, k in zip(parts.blocks, kw, strict=True):
            h = run_block(b, h, k)
        assert torch.equal(head_loss(parts, h, labels), want)


# ---- 4. blocks returning a list -------------------------------------------------------------------
def test_block_returning_a_list_is_unwrapped():
    class ListBlock(torch.nn.Module):
        def forward(self, h, mask=None):
            return [h * 2, None]

    h = torch.ones(1, 2, 4)
    out = run_block(ListBlock(), h, {"mask": None})
    assert isinstance(out, torch.Tensor) and torch.equal(out, h * 2)


def test_blocks_returning_several_values_stay_exact(tmp_path):
    """RWKV's loop unpacks `hidden, state, attentions = block(...)`: the probe's stand-ins return
    what block 0 does ((hidden, None, None) without a cache), so the model is not refused (the
    executor was exact on it before the probe; no false refusal)."""
    model = build("rwkv", common=False, hidden_size=32, num_hidden_layers=3, vocab_size=128,
                  context_length=64, attention_hidden_size=32, intermediate_size=64)
    parts = find_parts(model)
    probe_forward(parts)
    assert parts.block_returns == (tuple, 3)
    assert_exact(model, tmp_path)


# ---- 5. the base model reading attributes of the blocks -------------------------------------------
def test_recorder_reads_the_blocks_attributes():
    block = torch.nn.Linear(2, 2)
    block.block_type = "mamba"
    rec = _Recorder(block)
    assert rec.block_type == "mamba" and not list(rec.parameters())


def test_nemotron_h_block_types_are_exact(tmp_path):
    """Nemotron-H picks each block's mask by `layer.block_type`, which its forward read on the
    recorders standing in for the blocks: AttributeError mid-step."""
    assert_exact(build("nemotron_h", **SPECIAL), tmp_path)


def test_blocks_given_different_arguments_are_captured_per_block(tmp_path, monkeypatch):
    """A family whose blocks get different masks without config.layer_types saying so (as if
    Qwen2's sliding-window layers were not listed there): the probe finds the blocks' arguments
    differ and has them captured per block (block 0's mask went to every block: wrong gradients)."""
    import lazytrain.models.adapter as adapter

    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    monkeypatch.setattr(adapter, "mixed_layer_types", lambda parts: False)
    assert_exact(model, tmp_path)
    parts = find_parts(model)
    probe_forward(parts)
    assert parts.per_block_args


# ---- 6. the final norm ----------------------------------------------------------------------------
def test_position_embedding_is_not_taken_for_the_final_norm():
    with pytest.raises(ModelStructureError, match="positions_embed .*not a final norm"):
        find_parts(build("openai-gpt", **SPECIAL))


def test_final_norm_without_weights_is_exact(tmp_path):
    """OLMo's final LayerNorm has no parameters ("found 0 other modules" before)."""
    model = build("olmo")
    parts = find_parts(model)
    assert parts.norm is model.model.norm and not list(parts.norm.parameters())
    assert_exact(model, tmp_path, "recompute_all")


# ---- 7. parameters HF freezes itself --------------------------------------------------------------
def test_parameters_frozen_by_hf_are_constants(tmp_path):
    """Ernie 4.5 MoE's e_score_correction_bias is an nn.Parameter HF makes with requires_grad=False
    ("only some of its parameters are frozen" before): kept on the device as a constant, exact over
    AdamW steps with weight decay, and unchanged."""
    model = build("ernie4_5_moe", moe_intermediate_size=24, moe_num_experts=4, moe_k=2, head_dim=8)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all("e_score_correction_bias" in n for n in frozen)
    assert_exact(model, tmp_path)
    ex = make(model, tmp_path, "params_host", lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95), max_grad_norm=0.5)
    torch.manual_seed(99)
    for _ in range(3):
        ex.train_step(random_batches(2, seed=100))
    got = ex.trainable_state()
    ex.close()
    torch.manual_seed(99)
    ref, _ = reference_training(model, 3, 3e-3, 0.01, 0.5, seed=100)
    assert max(rel_err(got[n], p.detach()) for n, p in ref.named_parameters()) <= 1e-5
    before = dict(model.named_parameters())
    assert all(torch.equal(got[n], before[n].detach()) for n in frozen)


def test_frozen_matrix_names_the_parameter(tmp_path):
    model = tiny_model("llama")
    model.model.layers[1].self_attn.q_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"only some of its parameters are frozen \(\['model.layers.1.self_attn"
                                         r".q_proj.weight'\]\); a frozen weight matrix"):
        make(model, tmp_path)


# ---- the probe itself -----------------------------------------------------------------------------
def test_probe_leaves_no_trace():
    model = tiny_model("mixtral", output_router_logits=True)
    model.train()
    model.model.layers[1].eval()
    modes = [m.training for m in model.modules()]
    blocks = list(model.model.layers)
    rng = torch.get_rng_state()
    assert probe_forward(find_parts(model)) is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert list(model.model.layers) == blocks and model.config.output_router_logits
    assert not getattr(model, "_output_capturing_hooks_installed", False)


def test_probe_skips_meta_weights_with_a_note(caplog):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("llama", **COMMON))
    with caplog.at_level(logging.WARNING, logger="lazytrain.models.adapter"):
        note = probe_forward(find_parts(model))
    assert note and "meta device" in note and "meta device" in caplog.text


def test_probe_checks_the_chunked_loss(tmp_path):
    """With job.loss_chunk_tokens the probe also runs the chunked head; a plain model passes."""
    from lazytrain.spec import JobSpec

    plan = hand_plan(3, job=JobSpec(loss_chunk_tokens=4))
    StreamingExecutor(tiny_model("llama"), plan, device="cpu", nvme_dir=tmp_path).close()
    parts = find_parts(tiny_model("llama"))
    assert probe_forward(parts, chunk_tokens=4) is None
