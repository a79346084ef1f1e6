"""fp16 compute with dynamic loss scaling: the executor trains an fp16 model (fp32 master weights)
exactly as plain PyTorch does with torch's loss-scale rule (torch._amp_update_scale_, GradScaler's
kernel) and fp32 gradient accumulation, in every plan family: the same losses, skipped steps,
scales and weights, bit for bit."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from lazytrain.optim import AdamW8bit
from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.loss_scale import DynamicLossScale
from lazytrain.runtime.testing import hand_plan, plan_families, random_batches, tiny_model

INIT_SCALE = 2.0 ** 24    # overflows the tiny models' fp16 gradients: the first steps are skipped
GROWTH = 3                # grows back within the run


def reference_fp16(model, steps: int, lr: float, wd: float, max_norm: float | None, *, optimizer: str = "adamw",
                   init_scale: float = INIT_SCALE, growth_interval: int = GROWTH):
    """Plain PyTorch fp16 training: backward of loss / n * scale on the fp16 model, each micro-batch's
    gradients added up in fp32, unscaled (GradScaler.unscale_'s multiply by 1/scale), clipped by
    clip_grad_norm_ (a non-finite norm skips the step), AdamW on fp32 masters copied back into the
    fp16 weights; the scale updated by torch's own kernel. Returns (model, losses, skipped, scales)."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    # A tied head gets a leaf of its own here: its gradient and the embedding's go to fp32 each and
    # are summed there, as the executor sums a shared weight's two contributions (autograd would
    # sum them in fp16 first)
    emb, head = m.get_input_embeddings(), m.get_output_embeddings()
    tied = head.weight is emb.weight
    if tied:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    k_emb = next(k for k, p in enumerate(params) if p is emb.weight)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(masters, lr=lr, weight_decay=wd, fused=True)
    else:
        opt = AdamW8bit(masters, lr=lr, weight_decay=wd)
    scale = torch.full((), init_scale, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    losses, skipped, scales = [], [], []
    for s in range(steps):
        mbs = random_batches(2, seed=s)
        acc = None
        tot = 0.0
        scales.append(float(scale))
        for ids, labels in mbs:
            loss = m(input_ids=ids, labels=labels).loss
            tot += loss.item()
            (loss * 1.0 / len(mbs) * scale).backward()
            g32 = [p.grad.float() for p in params]
            if tied:
                g32[k_emb] = g32[k_emb] + head.weight.grad.float()
            acc = g32 if acc is None else [a.add_(g) for a, g in zip(acc, g32)]
            m.zero_grad(set_to_none=True)
        inv = scale.double().reciprocal().float()
        for mp, a in zip(masters, acc):
            mp.grad = a * inv
        total = torch.nn.utils.clip_grad_norm_(masters, max_norm if max_norm is not None else math.inf)
        found_inf = not math.isfinite(float(total))
        if not found_inf:
            if optimizer == "adamw":
                opt.step()
            else:
                opt.step_params(masters, clip_scale=1.0)   # (already clipped)
            with torch.no_grad():
                for p, mp in zip(params, masters):
                    p.copy_(mp)
                if tied:
                    head.weight.copy_(emb.weight)
        opt.zero_grad(set_to_none=True)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found_inf)), 2.0, 0.5, growth_interval)
        losses.append(tot / len(mbs))
        skipped.append(found_inf)
    return m, losses, skipped, scales


def test_loss_scale_rule_is_gradscalers():
    """DynamicLossScale.update == torch._amp_update_scale_ over a random overflow pattern, including
    growth capped at float32's range."""
    rnd = random.Random(0)
    ours = DynamicLossScale(scale=2.0 ** 120, growth_interval=2)
    scale = torch.full((), 2.0 ** 120, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for k in range(300):
        found = rnd.random() < 0.2 if k > 40 else False   # first 40: grows into float32's limit
        ours.update(found)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found)), 2.0, 0.5, 2)
        assert (ours.scale, ours.growth_tracker) == (float(scale), int(tracker)), k
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScale(backoff_factor=1.0)
    # outside float32's normal range: inf skipped every step, a subnormal scale NaN-ed the weights
    for bad in (2.0 ** 128, 2.0 ** -130, float("inf"), 0.0):
        with pytest.raises(ValueError, match="normal float32"):
            DynamicLossScale(scale=bad)
    # a resume with a smaller growth interval than the saved count grows at the next good step
    # (with ==, never again)
    ls = DynamicLossScale(growth_interval=3)
    ls.load_state_dict({"scale": 1024.0, "growth_tracker": 6})
    ls.update(False)
    assert ls.scale == 2048.0 and ls.growth_tracker == 0
    # backing off stops at float32's smallest normal number (below it 1/scale overflows), so a run
    # that overflows at every scale keeps a state it can resume from
    ls = DynamicLossScale(scale=2.0 ** -125)
    for _ in range(3):
        ls.update(True)
    assert ls.scale == 2.0 ** -126
    DynamicLossScale().load_state_dict(ls.state_dict())
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScale(growth_interval=0)


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("plan_name", list(plan_families(3)))
def test_fp16_training_equals_plain_loss_scaled_training(family, plan_name, tmp_path):
    base = tiny_model(family, dtype="float16")
    steps, lr, wd, max_norm = 10, 1e-2, 0.1, 0.5
    ref, ref_losses, ref_skipped, ref_scales = reference_fp16(base, steps, lr, wd, max_norm)
    assert any(ref_skipped) and not all(ref_skipped)   # the run overflowed, backed off and trained
    assert max(ref_scales[ref_skipped.index(False) + 1:]) > min(ref_scales)   # and the scale grew back
    ex = StreamingExecutor(copy.deepcopy(base), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                           nvme_dir=tmp_path, lr=lr, weight_decay=wd, max_grad_norm=max_norm,
                           loss_scale=DynamicLossScale(scale=INIT_SCALE, growth_interval=GROWTH))
    res = [ex.train_step(random_batches(2, seed=s)) for s in range(steps)]
    assert [r.loss for r in res] == ref_losses
    assert [r.skipped for r in res] == ref_skipped
    assert [r.loss_scale for r in res] == ref_scales
    assert ex.step_count == steps - sum(ref_skipped)
    model = ex.sync_model()
    ex.close()
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert b.dtype == torch.float16 and torch.equal(a, b), name


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_fp16_8bit_optimizer_and_no_clipping(max_norm, tmp_path):
    """The 8-bit AdamW folds 1/scale (and the clip coefficient) into its one pass; without
    clipping the norm is still taken, for the overflow check."""
    base = tiny_model("llama", dtype="float16")
    steps, lr, wd = 8, 1e-2, 0.1
    ref, ref_losses, ref_skipped, _ = reference_fp16(base, steps, lr, wd, max_norm, optimizer="adamw8bit")
    base_sd = dict(base.named_parameters())
    assert any(ref_skipped)
    ex = StreamingExecutor(copy.deepcopy(base), hand_plan(3, param_tier="host"), device="cpu", lr=lr,
                           weight_decay=wd, max_grad_norm=max_norm, optimizer="adamw8bit",
                           loss_scale=DynamicLossScale(scale=INIT_SCALE, growth_interval=GROWTH))
    res = [ex.train_step(random_batches(2, seed=s)) for s in range(steps)]
    assert [r.skipped for r in res] == ref_skipped
    assert all(r.grad_norm is not None for r in res)
    model = ex.sync_model()
    ex.close()
    # Not bit for bit (the executor quantises each layer's flat master in 256-element blocks that
    # cross its tensors' boundaries, and its 8-bit states cover the norm weights, which the
    # reference keeps fp32 as too small; the folding itself is exact: the test below): within 10%
    # of how far training moved them.
    ref_sd = {n: p.detach() for n, p in ref.named_parameters()}
    got = {n: p.detach() for n, p in model.named_parameters()}
    for name, a in ref_sd.items():
        moved = float((a.float() - base_sd[name].detach().float()).abs().max())
        assert moved > 0 and float((a.float() - got[name].float()).abs().max()) <= 0.1 * moved, name


def test_fp16_defaults_and_refusals(tmp_path):
    base = tiny_model("llama", dtype="float16")
    ex = StreamingExecutor(copy.deepcopy(base), hand_plan(3), device="cpu")
    assert ex.loss_scale == DynamicLossScale()   # fp16 without a scale gets GradScaler's default
    r = ex.train_step(random_batches(1, seed=0))
    assert r.loss_scale == 2.0 ** 16 and not r.skipped and r.grad_norm is not None
    ex.close()
    with pytest.raises(ValueError, match="fp32 master"):
        StreamingExecutor(copy.deepcopy(base), hand_plan(3), device="cpu", master_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="loss_scale is for fp16"):
        StreamingExecutor(tiny_model("llama"), hand_plan(3), device="cpu", loss_scale=DynamicLossScale())
    # compute_dtype=fp16 on an fp32 model: the streamed weights are fp16, so it scales too
    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3), device="cpu", compute_dtype=torch.float16)
    assert ex.loss_scale is not None
    ex.close()


def test_fp16_state_dict_resumes_the_scale(tmp_path):
    """A resumed fp16 run continues with the saved scale and growth count: the same losses, skips
    and scales as the uninterrupted run."""
    base = tiny_model("llama", dtype="float16")
    kw = dict(device="cpu", lr=1e-2, max_grad_norm=1.0)

    def make():
        return StreamingExecutor(copy.deepcopy(base), hand_plan(3, param_tier="host"),
                                 loss_scale=DynamicLossScale(scale=INIT_SCALE, growth_interval=GROWTH), **kw)

    full = make()
    whole = [full.train_step(random_batches(2, seed=s)) for s in range(9)]
    full.close()
    a = make()
    first = [a.train_step(random_batches(2, seed=s)) for s in range(5)]
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    a.close()
    assert "meta.loss_scale" in sd
    b = make()
    b.load_state_dict(sd)
    rest = [b.train_step(random_batches(2, seed=s)) for s in range(5, 9)]
    b.close()
    got = [(r.loss, r.skipped, r.loss_scale) for r in first + rest]
    assert got == [(r.loss, r.skipped, r.loss_scale) for r in whole]


@pytest.mark.parametrize("family,plan_name", [("llama", "params_host"), ("qwen2-tied", "recompute_all")])
def test_fp16_lora_equals_peft_with_torch_gradscaler(family, plan_name, tmp_path):
    """LoRA on an fp16 base (PEFT keeps the adapters fp32): the same adapters, bit for bit, as
    PyTorch's own recipe, torch.amp.GradScaler (scale, unscale_, clip_grad_norm_, step, update)."""
    from lazytrain.models import apply_lora

    model = apply_lora(tiny_model(family, dtype="float16"), rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    ref = copy.deepcopy(model)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                           nvme_dir=tmp_path, lr=1e-2, weight_decay=0.01, max_grad_norm=0.3,
                           loss_scale=DynamicLossScale(scale=INIT_SCALE, growth_interval=GROWTH))
    skipped = []
    for step in range(10):
        mbs = random_batches(2, seed=step)
        for ids, labels in mbs:
            scaler.scale(ref(input_ids=ids, labels=labels).loss * 1.0 / len(mbs)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(trainable, 0.3)
        before = float(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        res = ex.train_step(mbs)
        assert res.loss_scale == before
        skipped.append(res.skipped)
        assert res.skipped == (float(scaler.get_scale()) < before)
    assert any(skipped) and not all(skipped)
    got = ex.trainable_state()
    ex.close()
    want = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.gpu
def test_fp16_on_cuda_scales_and_skips_as_on_the_cpu(tmp_path):
    """The CUDA path (fp16 gradients leaving on the grad stream into pinned memory, fp32 master
    updated on the host): the same skipped steps and loss scales as the CPU device, losses within
    fp16 kernel differences."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = tiny_model("llama", dtype="float16")
    runs = {}
    for device in ("cpu", "cuda"):
        ex = StreamingExecutor(copy.deepcopy(base), hand_plan(3, **plan_families(3)["params_host"]), device=device,
                               nvme_dir=tmp_path / device, lr=1e-2, max_grad_norm=0.5,
                               loss_scale=DynamicLossScale(scale=INIT_SCALE, growth_interval=GROWTH))
        runs[device] = [ex.train_step(random_batches(2, seed=s)) for s in range(8)]
        ex.close()
    assert [r.skipped for r in runs["cuda"]] == [r.skipped for r in runs["cpu"]]
    assert [r.loss_scale for r in runs["cuda"]] == [r.loss_scale for r in runs["cpu"]]
    for a, b in zip(runs["cuda"], runs["cpu"]):
        assert abs(a.loss - b.loss) <= 1e-2 * abs(b.loss)


@pytest.mark.parametrize("loss_scale", [2.0 ** 16, 2.0 ** 30, 2.0 ** 44])
@pytest.mark.parametrize("coef", [1.0, 0.37])
def test_8bit_update_with_1_over_the_scale_folded_in_is_the_unscaled_update(loss_scale, coef):
    """What the executor's 8-bit path relies on: scaled gradients with clip_scale = coef / scale
    give the same weights and codes, bit for bit, as the unscaled gradients with clip_scale = coef
    (also where coef / scale is small enough for the kernel's prescaling, 2**44)."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(5000, generator=g)
    grads = [torch.randn(5000, generator=g) * 1e-3 for _ in range(3)]
    runs = []
    for scale in (1.0, loss_scale):
        p = torch.nn.Parameter(w0.clone())
        opt = AdamW8bit([p], lr=1e-2, weight_decay=0.1, min_8bit_numel=0)
        for gr in grads:
            p.grad = gr * scale          # (a power of two: exact)
            opt.step_params([p], clip_scale=torch.tensor(coef, dtype=torch.float32) / scale)
        runs.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}))
    assert torch.equal(runs[0][0], runs[1][0])
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k]), k


def test_at_the_scale_floor_an_overflowed_step_still_reports_skipped():
    """A model whose fp16 forward overflows at every scale: both engines stay at 2**-126 and report
    every step skipped (engine=torch's skip was read from a back-off the floor undoes)."""
    from lazytrain.recipes.engines import TorchEngine

    base = tiny_model("llama")
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "mlp" in n:
                p.mul_(1e4)
    eng = TorchEngine(copy.deepcopy(base), device=torch.device("cpu"), compute_dtype=torch.float16, lr=1e-3,
                      betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0,
                      loss_scale=(2.0 ** -125, 2000))
    ex = StreamingExecutor(base.half(), hand_plan(3), device="cpu", lr=1e-3, max_grad_norm=1.0,
                           loss_scale=DynamicLossScale(scale=2.0 ** -125))
    for s in range(3):
        mbs = random_batches(1, seed=s)
        a, b = eng.train_step(mbs), ex.train_step(mbs)
        assert a.skipped and b.skipped, s
    assert float(eng.scaler.get_scale()) == ex.loss_scale.scale == 2.0 ** -126
    ex.close()
