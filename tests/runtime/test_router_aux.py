"""MoE router load-balancing loss (`config.output_router_logits`): the executor adds HF's own aux
loss, and loss, aux loss, every gradient and the weights after a few AdamW steps equal plain
PyTorch (`model(ids, labels=labels).loss.backward()`), in every plan family: each block's router
logits keep their graph (or are re-produced by recompute) and their gradient from the head joins
the hidden-state gradient in that block's backward."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from lazytrain.models import apply_lora
from lazytrain.models.adapter import find_parts, router_aux
from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import (GradCapture, reference_training, hand_plan, plan_families, random_batches, rel_err,
                                      tiny_model)

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.02)
PLANS = tuple(plan_families(3))
REL = 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Mixtral and Qwen3-MoE (whose block 1 is dense) in every plan family; Qwen2-MoE (shared expert)
# and OLMoE in a few.
CASES = [(f, p) for f in ("mixtral", "qwen3_moe") for p in PLANS] + [
    ("qwen2_moe", "recompute_all"), ("qwen2_moe", "acts_host"), ("olmoe", "mixed_segments"),
    ("olmoe", "params_nvme")]


def reference(model, mbs, device="cpu"):
    """Plain PyTorch: mean loss, per-micro-batch aux losses, gradients."""
    m = copy.deepcopy(model).to(device)
    losses, auxes = [], []
    for ids, labels in mbs:
        out = m(input_ids=ids.to(device), labels=labels.to(device))
        losses.append(out.loss.item())
        auxes.append(out.aux_loss.item() if out.aux_loss is not None else None)
        (out.loss / len(mbs)).backward()
    return sum(losses) / len(mbs), auxes, {n: p.grad if p.grad is None else p.grad.cpu()
                                           for n, p in m.named_parameters()}


def test_routers_and_loss_function_are_hf_own():
    ra = router_aux(find_parts(tiny_model("mixtral", **AUX)))
    assert [len(r) for r in ra.routers] == [1, 1, 1]
    assert (ra.num_experts, ra.top_k, ra.coef) == (4, 2, 0.02)
    assert ra.loss_fn is sys.modules["transformers.models.mixtral.modeling_mixtral"].load_balancing_loss_func
    m = tiny_model("qwen3_moe", **AUX)
    ra = router_aux(find_parts(m))
    assert [len(r) for r in ra.routers] == [1, 0, 1]   # block 1 is in mlp_only_layers
    assert ra.routers[0][0][0] is m.model.layers[0].mlp.gate
    assert router_aux(find_parts(tiny_model("llama"))) is None   # dense: nothing to add


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,plan_name", CASES)
def test_loss_aux_and_grads_match_autograd(family, plan_name, device, tmp_path):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_model(family, **AUX)
    mbs = random_batches(2, seed=1)
    ref_loss, ref_aux, ref_grads = reference(model, mbs, device)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device=device,
                           nvme_dir=tmp_path, lr=0.0)
    cap = GradCapture(ex)
    res = ex.train_step(mbs)
    ex.wait()
    assert abs(res.loss - ref_loss) <= REL * abs(ref_loss)
    assert abs(res.aux_loss - sum(ref_aux) / len(ref_aux)) <= REL * abs(ref_aux[0])
    assert set(cap.grads) == set(ref_grads)
    worst = max(rel_err(cap.grads[n], ref_grads[n]) for n in ref_grads)
    assert worst <= REL, f"{family}/{plan_name}: max rel grad err {worst:.2e}"
    assert ex.acct.by_kind["router_logits"] == 0   # all of it released after the backward
    ex.close()


def test_aux_loss_changes_the_gradients():
    """The suite above would not notice a missing aux term if it did not move the gradients."""
    mbs = random_batches(1, seed=1)
    _, aux, with_aux = reference(tiny_model("mixtral", **AUX), mbs)
    _, none, without = reference(tiny_model("mixtral"), mbs)
    assert aux[0] > 0 and none == [None]
    assert rel_err(with_aux["model.layers.0.mlp.gate.weight"], without["model.layers.0.mlp.gate.weight"]) > 1e-2


@pytest.mark.parametrize("family,plan_name,max_norm", [
    ("mixtral", "recompute_all", 0.5), ("mixtral", "acts_nvme", None),
    ("qwen3_moe", "mixed_segments", 0.5), ("qwen3_moe", "params_nvme", None),
])
def test_steps_match_torch_adamw(family, plan_name, max_norm, tmp_path):
    model = tiny_model(family, **AUX)
    steps, lr, wd = 5, 3e-3, 0.01
    mbs = random_batches(2, seed=100)
    ref, ref_losses = reference_training(model, steps, lr, wd, max_norm, seed=100)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                           nvme_dir=tmp_path, lr=lr, betas=(0.9, 0.95), weight_decay=wd, max_grad_norm=max_norm)
    for want in ref_losses:
        got = ex.train_step(mbs).loss
        assert abs(got - want) <= REL * abs(got)
    state = ex.trainable_state()
    worst = max(rel_err(state[n], p.detach()) for n, p in ref.named_parameters())
    assert worst <= REL, f"{family}/{plan_name}: weights after {steps} steps differ, rel {worst:.2e}"
    ex.close()


def test_flag_is_read_per_micro_batch(tmp_path):
    """Like the model's own forward, the executor reads config.output_router_logits each step."""
    model = tiny_model("mixtral")
    mbs = random_batches(1, seed=3)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, segments=[(1, 2)]), device="cpu", lr=0.0)
    plain = ex.train_step(mbs)
    assert plain.aux_loss is None and abs(plain.loss - reference(model, mbs)[0]) <= REL * plain.loss
    ex.model.config.output_router_logits = True
    model.config.output_router_logits = True
    with_aux = ex.train_step(mbs)
    ref_loss, ref_aux, _ = reference(model, mbs)
    assert abs(with_aux.loss - ref_loss) <= REL * ref_loss and abs(with_aux.aux_loss - ref_aux[0]) <= REL * ref_aux[0]
    ex.close()


def test_lora_gets_the_aux_gradient(tmp_path):
    model = apply_lora(tiny_model("qwen3_moe", **AUX), rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    mbs = random_batches(2, seed=7)
    ref_loss, _, ref_grads = reference(model, mbs)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)["mixed_segments"]),
                           device="cpu", nvme_dir=tmp_path, lr=1e-2)
    grads = {}
    orig = ex._step_adapters

    def capture(scale, skip=False):
        grads.update({ex.param_names[id(p)]: ex.adapter_grads[id(p)].clone() for p in ex.adapter_params})
        return orig(scale, skip)
    ex._step_adapters = capture
    res = ex.train_step(mbs)
    assert abs(res.loss - ref_loss) <= REL * ref_loss
    assert grads and set(grads) == {n for n, g in ref_grads.items() if g is not None}
    worst = max(rel_err(grads[n], ref_grads[n]) for n in grads)
    assert worst <= REL, f"max rel adapter grad err {worst:.2e}"
    ex.close()


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
OTHER_FAMILIES = {
    # its coefficient is config.aux_loss_coef (was refused: "no router_aux_loss_coef")
    "jetmoe": dict(head_dim=8, num_local_experts=4),
    # has output_router_logits, but its forward adds no aux loss (was refused: "no load_balancing_loss_func")
    "glm4_moe": dict(moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1),
}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_moe_families_with_other_aux_conventions_match_autograd(family, tmp_path):
    """Review findings: JetMoE names its coefficient aux_loss_coef, and GLM4-MoE (DeepSeek-V2/V3,
    dots1 alike) take output_router_logits but add no aux loss; both were refused."""
    import transformers
    cfg = transformers.AutoConfig.for_model(family, output_router_logits=True, **SMALL, **OTHER_FAMILIES[family])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    mbs = random_batches(2, seed=1)
    ref_loss, ref_aux, ref_grads = reference(model, mbs)
    assert (ref_aux[0] is None) == (family == "glm4_moe")
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)["mixed_segments"]), device="cpu",
                           nvme_dir=tmp_path, lr=0.0)
    cap = GradCapture(ex)
    res = ex.train_step(mbs)
    ex.wait()
    assert abs(res.loss - ref_loss) <= REL * abs(ref_loss)
    assert max(rel_err(cap.grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n] is not None) <= REL
    ex.close()
