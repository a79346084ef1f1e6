"""Issue 3 exactness: the plan never changes the math. Tiny random fp32 Llama/Qwen2/Mixtral, and
Llama/Qwen2 with tied input/output embeddings; for every plan family, loss and every gradient equal
plain PyTorch autograd (rel err <= 1e-5), and after 20 AdamW steps the weights equal a plain
PyTorch run."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import (GradCapture, hand_plan, plan_families, random_batches, reference_training, rel_err,
                                      tiny_model)

FAMILIES = ("llama", "qwen2", "mixtral", "llama-tied", "qwen2-tied")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
PLANS = tuple(plan_families(3))
REL = 1e-5


batches = random_batches


def reference_grads(model, mbs, device="cpu"):
    m = copy.deepcopy(model).to(device)
    losses = []
    for ids, labels in mbs:
        ids, labels = ids.to(device), labels.to(device)
        loss = m(input_ids=ids, labels=labels).loss
        losses.append(loss.item())
        (loss / len(mbs)).backward()
    return sum(losses) / len(losses), {n: p.grad.cpu() for n, p in m.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("plan_name", PLANS)
def test_loss_and_grads_match_autograd(family, plan_name, device, tmp_path):
    need(device)
    model = tiny_model(family)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) \
        == family.endswith("-tied")
    mbs = batches(2, seed=1)
    ref_loss, ref_grads = reference_grads(model, mbs, device)
    plan = hand_plan(model.config.num_hidden_layers, **plan_families(3)[plan_name])
    # max_grad_norm=inf: the norm is computed and reported, nothing is clipped
    ex = StreamingExecutor(copy.deepcopy(model), plan, device=device, nvme_dir=tmp_path, lr=0.0,
                           max_grad_norm=float("inf"))
    cap = GradCapture(ex)
    res = ex.train_step(mbs)
    ex.wait()
    assert abs(res.loss - ref_loss) <= REL * abs(ref_loss)
    assert set(cap.grads) == set(ref_grads)
    worst = max(rel_err(cap.grads[n], ref_grads[n]) for n in ref_grads)
    assert worst <= REL, f"{family}/{plan_name}: max rel grad err {worst:.2e}"
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    assert abs(res.grad_norm - float(ref_norm)) <= 1e-4 * float(ref_norm)
    ex.close()


@pytest.mark.parametrize("family,plan_name,max_norm,fused", [
    ("llama", "all_resident", None, False), ("llama", "params_host", 0.5, True), ("llama", "params_nvme", None, True),
    ("qwen2", "mixed_segments", 0.5, True), ("qwen2", "acts_nvme", None, True),
    ("mixtral", "recompute_all", 0.5, True), ("mixtral", "acts_host", None, True), ("mixtral", "params_nvme", 0.5, True),
    # tied embeddings: the shared weight sums the head's and the embedding's gradients and is
    # updated once, in every plan family (streamed embed: the head fetches it again)
    *((f"{fam}-tied", p, 0.5 if (k + (fam == "qwen2")) % 2 else None, True)
      for fam in ("llama", "qwen2") for k, p in enumerate(PLANS)),
])
@pytest.mark.parametrize("device", DEVICES)
def test_twenty_steps_match_torch_adamw(family, plan_name, max_norm, fused, device, tmp_path):
    need(device)
    model = tiny_model(family)
    steps, lr, wd = 20, 3e-3, 0.01
    ref, ref_losses = reference_training(model, steps, lr, wd, max_norm, seed=100, fused=fused,
                                         device=device)
    plan = hand_plan(model.config.num_hidden_layers, **plan_families(3)[plan_name])
    ex = StreamingExecutor(copy.deepcopy(model), plan, device=device, nvme_dir=tmp_path, lr=lr,
                           betas=(0.9, 0.95), weight_decay=wd, max_grad_norm=max_norm, fused=fused)
    losses = [ex.train_step(batches(2, seed=100)).loss for s in range(steps)]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    got = ex.trainable_state()
    ref_sd = dict(ref.named_parameters())
    tol = dict.fromkeys(ref_sd, REL)
    if device == "cuda":
        # The executor updates on the host (CPU AdamW) while this reference updates on the GPU, so
        # the two differ in the last bits, and 20 Adam steps amplify that where a gradient is tiny
        # and changes sign: Qwen2's k_proj.bias moves 1.3e-4 (rel) from a 1e-7 perturbation, every
        # weight matrix < 1.3e-6 (measured on CPU). There, per parameter, the bound is 8x the
        # spread the reference itself shows under such a perturbation (its noise floor).
        noisy, _ = reference_training(model, steps, lr, wd, max_norm, seed=100, fused=fused,
                                      device=device, grad_noise=2.0**-23)
        noisy_sd = dict(noisy.named_parameters())
        tol = {n: max(REL, 8 * rel_err(noisy_sd[n].detach().cpu(), ref_sd[n].detach().cpu())) for n in ref_sd}
    errs = {n: rel_err(got[n], ref_sd[n].detach().cpu()) for n in ref_sd}
    bad = {n: f"{e:.2e} > {tol[n]:.2e}" for n, e in errs.items() if not e <= tol[n]}   # NaN fails too
    assert not bad, f"{family}/{plan_name}: weights after {steps} steps differ: {bad}"
    assert ref_losses[-1] < ref_losses[0]   # the run actually trained
    ex.close()


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("plan_name", list(plan_families(3)))
def test_pure_bf16_training_equals_plain_bf16_adamw(family, plan_name, tmp_path):
    """master_dtype=bf16 (pure-bf16 full fine-tuning: weights, moments and gradient accumulator
    in bf16) gives the same weights, bit for bit, as plain PyTorch training the bf16 model with
    fused AdamW and clip_grad_norm_, over steps of two micro-batches, in every plan family."""
    base = tiny_model(family, dtype="bfloat16")
    plain = copy.deepcopy(base)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ex = StreamingExecutor(copy.deepcopy(base), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                           lr=1e-2, weight_decay=0.1, max_grad_norm=0.05, master_dtype=torch.bfloat16,
                           nvme_dir=tmp_path)
    for k in range(3):
        mbs = random_batches(2, seed=k)
        for ids, labels in mbs:
            (plain(input_ids=ids, labels=labels).loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ex.train_step(mbs)
    model = ex.sync_model()
    ex.close()
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b), name


@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "mixtral"])
@pytest.mark.parametrize("plan_name", ["all_resident", "params_host", "recompute_all"])
def test_chunked_loss_twenty_steps_match_torch_adamw(family, plan_name, tmp_path):
    """job.loss_chunk_tokens: the loss over chunks of 5 tokens (logits recomputed in backward)
    trains like plain PyTorch with the model's own loss: the same losses (1e-5) over 20 steps and
    weights within 1e-4. Not 1e-5: one step's gradients already differ by up to 6e-7 of their
    largest element (the chunks' small matmuls and sums round differently from one big one,
    measured on qwen2-tied), i.e. by far more than that relative to a small element, and 20 Adam
    steps amplify it there (measured: up to 7.4e-5, on Mixtral's expert weights)."""
    from lazytrain.spec import JobSpec

    model = tiny_model(family)
    steps, lr, wd = 20, 3e-3, 0.01
    ref, ref_losses = reference_training(model, steps, lr, wd, 0.5, seed=100)
    job = JobSpec(batch_size=2, seq_len=12, compute_dtype="fp32", loss_chunk_tokens=5)
    plan = hand_plan(model.config.num_hidden_layers, job=job, **plan_families(3)[plan_name])
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path, lr=lr,
                           betas=(0.9, 0.95), weight_decay=wd, max_grad_norm=0.5)
    losses = [ex.train_step(batches(2, seed=100)).loss for s in range(steps)]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    got, ref_sd = ex.trainable_state(), dict(ref.named_parameters())
    bad = {n: f"{e:.2e}" for n in ref_sd if not (e := rel_err(got[n], ref_sd[n].detach())) <= 1e-4}
    assert not bad, f"{family}/{plan_name}: weights after {steps} steps differ: {bad}"
    assert ref_losses[-1] < ref_losses[0]
    ex.close()


class _CountingCopies:
    """Stands in for fastcopy's extension: counts the streaming-store copies it forwards."""

    def __init__(self, ext) -> None:
        self.ext, self.calls = ext, 0

    def load(self):
        mod = self.ext.load()
        if mod is None:
            return None
        outer = self

        class _Mod:
            @staticmethod
            def stream_copy(dst, src):
                outer.calls += 1
                mod.stream_copy(dst, src)
        return _Mod


@pytest.mark.parametrize("plan_name", ["all_resident", "params_host", "params_nvme"])
def test_streaming_store_copies_keep_training_exact(plan_name, tmp_path, monkeypatch):
    """The weight fetches and write-backs that use streaming stores on a big model
    (storage/fastcopy) leave training exact: with the size floor lowered so the tiny model's
    copies take the kernel, the pure-bf16 run still equals plain PyTorch bit for bit, and fp32
    training from the host tier (its write-back into the host store) still matches torch's AdamW."""
    from lazytrain.storage import fastcopy

    if not fastcopy.available():
        pytest.skip(f"streaming-copy kernel unavailable: {fastcopy._EXT.unavailable_reason()}")
    counting = _CountingCopies(fastcopy._EXT)
    monkeypatch.setattr(fastcopy, "_EXT", counting)
    monkeypatch.setattr(fastcopy, "MIN_BYTES", 0)
    (tmp_path / "bf16").mkdir()
    (tmp_path / "fp32").mkdir()
    test_pure_bf16_training_equals_plain_bf16_adamw("llama", plan_name, tmp_path / "bf16")
    assert counting.calls > 0
    if plan_name == "params_host":   # fp32: the host store is not the master, the write-back copies
        calls = counting.calls
        test_twenty_steps_match_torch_adamw("llama", plan_name, None, True, "cpu", tmp_path / "fp32")
        assert counting.calls > calls


@pytest.mark.parametrize("plan_name", ["all_resident", "mixed_segments", "acts_nvme"])
def test_token_weighted_micro_batches_match_autograd(plan_name, tmp_path):
    """weights (the train loop's token weights for masked labels) scale each micro-batch's loss
    exactly as in plain autograd, recomputed segments included (their loss is not recomputed)."""
    model = tiny_model("llama")
    mbs = batches(3, seed=2)
    mbs = [(ids, labels.masked_fill(torch.rand(labels.shape, generator=torch.Generator().manual_seed(k)) < 0.3 * k, -100))
           for k, (ids, labels) in enumerate(mbs)]
    weights = [0.5, 1.25, 1.25]
    m = copy.deepcopy(model)
    losses = []
    for (ids, labels), w in zip(mbs, weights):
        loss = m(input_ids=ids, labels=labels).loss
        losses.append(loss.item() * w)
        (loss * w / len(mbs)).backward()
    ref_loss, ref_grads = sum(losses) / len(mbs), {n: p.grad for n, p in m.named_parameters()}
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                           nvme_dir=tmp_path, lr=0.0, max_grad_norm=float("inf"))
    cap = GradCapture(ex)
    res = ex.train_step(mbs, weights)
    ex.wait()
    assert abs(res.loss - ref_loss) <= REL * abs(ref_loss)
    assert max(rel_err(cap.grads[n], ref_grads[n]) for n in ref_grads) <= REL
    with pytest.raises(ValueError, match="weights must be 3 finite numbers >= 0"):
        ex.train_step(mbs, [1.0, 1.0])
    ex.close()
