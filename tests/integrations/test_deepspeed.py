"""DeepSpeed ZeRO-3 (CPU offload, one gloo process) runs lazytrain's jobs: losses, parity with plain
PyTorch, checkpoint/resume, LoRA, weights out, the missing-DeepSpeed message."""

import copy
import math
import sys

import pytest
import torch

from ds_plan_factory import TINY_LLAMA, make_plan

from lazytrain.integrations import deepspeed as lds
from lazytrain.integrations.deepspeed import (DeepSpeedTrainer, DeepSpeedUnavailable, apply_recompute,
                                              check_available, ds_config_from_plan)

needs_ds = pytest.mark.skipif(check_available() is not None, reason=str(check_available()))


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    return LlamaForCausalLM(cfg)


def batches(n: int, seed: int = 1, b: int = 2, s: int = 32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, TINY_LLAMA["vocab_size"], (b, s), generator=g)
        out.append((x, x.clone()))
    return out


def trainer(model, plan=None, **kw):
    cfg, _ = ds_config_from_plan(plan or make_plan())
    return DeepSpeedTrainer(model, ds_config=cfg, lr=kw.pop("lr", 1e-2), max_grad_norm=kw.pop("max_grad_norm", 1.0), **kw)


@needs_ds
def test_three_steps_finite_and_step0_matches_plain_pytorch():
    model = tiny_model()
    ref = copy.deepcopy(model)
    data = batches(1) * 3            # the same batch three times: the loss must fall
    tr = trainer(model, lr=3e-3)
    results = [tr.train_step([mb]) for mb in data]
    losses = [r.loss for r in results]
    assert all(math.isfinite(x) for x in losses)
    assert all(r.grad_norm is not None and math.isfinite(r.grad_norm) and not r.skipped for r in results)
    assert all(r.tokens == 64 for r in results) and float(results[0]) == losses[0]
    # DeepSpeed casts the model to bf16: compare with the same weights in bf16 and in fp32
    x, y = data[0]
    with torch.no_grad():
        bf16_loss = float(copy.deepcopy(ref).to(torch.bfloat16)(input_ids=x, labels=y).loss)
        fp32_loss = float(ref(input_ids=x, labels=y).loss)
    assert losses[0] == pytest.approx(bf16_loss, rel=1e-3)
    assert losses[0] == pytest.approx(fp32_loss, rel=2e-2)
    assert losses[2] < losses[1] < losses[0]
    tr.close()


@needs_ds
def test_step0_matches_lazytrain_engine():
    try:
        from lazytrain.runtime import StreamingExecutor
    except ImportError as e:
        pytest.skip(f"lazytrain.runtime.StreamingExecutor not available yet: {e}")
    model = tiny_model()
    ref = copy.deepcopy(model)
    plan = make_plan()
    x, y = batches(1)[0]
    ex = StreamingExecutor(ref, plan, lr=1e-2)
    lt_loss = ex.train_step([(x, y)]).loss
    ex.close()
    tr = trainer(model, plan)
    ds_loss = tr.train_step([(x, y)]).loss
    tr.close()
    assert ds_loss == pytest.approx(lt_loss, rel=2e-2)


@needs_ds
def test_grad_accumulation_and_clipping_and_lr():
    from lazytrain.spec import JobSpec
    plan = make_plan(job=JobSpec(batch_size=2, seq_len=32, grad_accum=2))
    tr = trainer(tiny_model(), plan, max_grad_norm=1e-3)
    data = batches(2)
    with pytest.raises(ValueError, match="accumulates 2"):
        tr.train_step(data[:1])
    r = tr.train_step(data)
    assert r.tokens == 128 and math.isfinite(r.loss)
    tr.set_lr(0.0)
    before = tr.trainable_state()
    tr.train_step(data)
    after = tr.trainable_state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # lr 0: no change
    tr.set_lr(1e-2)
    tr.train_step(data)
    moved = tr.trainable_state()
    # clipped to 1e-3 but Adam normalises, so every weight still moves by ~lr
    assert any(not torch.equal(after[k], moved[k]) for k in after)
    tr.close()


@needs_ds
def test_checkpoint_resume_continues_like_an_uninterrupted_run(tmp_path):
    data = batches(4)
    tr = trainer(tiny_model())
    full = [tr.train_step([mb]).loss for mb in data]
    tr.close()

    tr = trainer(tiny_model())
    first = [tr.train_step([mb]).loss for mb in data[:2]]
    tr.save_checkpoint(tmp_path / "ckpt", {"step": 2, "data_pos": 17})
    tr.close()
    assert first == full[:2]

    tr = trainer(tiny_model(seed=123))   # different init: everything must come from the checkpoint
    state = tr.load_checkpoint(tmp_path / "ckpt")
    assert state["step"] == 2 and state["data_pos"] == 17
    rest = [tr.train_step([mb]).loss for mb in data[2:]]
    tr.close()
    assert rest == full[2:]   # bit-identical (see _resync_cpu_adam)


@needs_ds
def test_load_checkpoint_missing_dir_is_one_line(tmp_path):
    tr = trainer(tiny_model())
    with pytest.raises(FileNotFoundError, match="no DeepSpeed checkpoint"):
        tr.load_checkpoint(tmp_path / "nothing")
    tr.close()


@needs_ds
def test_lora_trains_only_adapters_and_saves_a_peft_dir(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    base = tiny_model()
    base_ref = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    tr = trainer(model)
    data = batches(2)
    for mb in data:
        assert math.isfinite(tr.train_step([mb]).loss)
    st = tr.trainable_state()
    assert st and all("lora_" in k for k in st)
    assert all(v.dtype == torch.float32 for v in st.values())
    assert any(v.abs().sum() > 0 for k, v in st.items() if "lora_B" in k)  # B starts at 0 and moved
    full = tr.full_state_dict()
    for k, v in base_ref.items():       # frozen base weights: unchanged up to the bf16 cast
        key = next(n for n in full if n.endswith(k.replace(".weight", ".base_layer.weight")) or n.endswith(k))
        assert torch.equal(full[key].float(), v.to(torch.bfloat16).float())
    tr.save_pretrained(tmp_path / "adapter")
    tr.close()
    loaded = PeftModel.from_pretrained(tiny_model(), str(tmp_path / "adapter"))
    for k, v in st.items():
        got = dict(loaded.named_parameters())[k]
        assert torch.allclose(got.float(), v, atol=1e-6)


@needs_ds
def test_full_ft_weights_out_reload_with_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM
    tr = trainer(tiny_model())
    data = batches(3)
    for mb in data[:2]:
        tr.train_step([mb])
    st = tr.trainable_state()
    names = {n for n, _ in tiny_model().named_parameters()}
    assert set(st) == names
    tr.save_pretrained(tmp_path / "final")
    tr.engine.eval()
    x, y = data[2]
    with torch.no_grad():
        ds_eval = float(tr.engine(input_ids=x, labels=y).loss)
    tr.close()
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    with torch.no_grad():
        got = float(reloaded.to(torch.bfloat16)(input_ids=x, labels=y).loss)
    assert got == pytest.approx(ds_eval, rel=1e-3)


@needs_ds
def test_recompute_blocks_same_loss_and_grads_flow():
    plan = make_plan(recompute=frozenset({1, 2, 3, 4}))
    cfg, _ = ds_config_from_plan(plan)
    assert cfg["lazytrain"]["recompute_blocks"] == [0, 1, 2, 3]
    data = batches(2)
    a = trainer(tiny_model(), plan)
    with_rc = [a.train_step([mb]).loss for mb in data]
    assert sum(b.gradient_checkpointing for b in lds.decoder_blocks(a.model)) == 4
    a.close()
    b = trainer(tiny_model())
    without = [b.train_step([mb]).loss for mb in data]
    b.close()
    assert with_rc == pytest.approx(without, rel=1e-5)


def test_apply_recompute_rejects_out_of_range_blocks():
    with pytest.raises(ValueError, match="has 4 decoder blocks"):
        apply_recompute(tiny_model(), [0, 7])


def test_missing_deepspeed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)   # import deepspeed -> ImportError
    msg = check_available()
    assert msg is not None and "\n" not in msg and "pip install deepspeed==0.19.8" in msg
    with pytest.raises(DeepSpeedUnavailable, match="pip install deepspeed"):
        DeepSpeedTrainer(tiny_model(), ds_config={}, lr=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(check_available(nvme=True) is not None, reason=str(check_available(nvme=True)))
def test_nvme_export_is_accepted_and_trains(tmp_path):
    """NVMe offload (builds DeepSpeed's async_io op on first use, ~2 min): the exported config runs."""
    plan = make_plan(param_tier="nvme", optimizer_tier="nvme")
    cfg, dropped = ds_config_from_plan(plan, nvme_dir=str(tmp_path / "nvme"))
    assert dropped == []
    model = tiny_model()
    ref = copy.deepcopy(model)
    tr = DeepSpeedTrainer(model, ds_config=cfg, lr=3e-3, max_grad_norm=1.0)
    data = batches(1) * 3
    losses = [tr.train_step([mb]).loss for mb in data]
    # DeepSpeed swaps through NVMe (the tiny model fits its swap buffers, so files may stay empty;
    # scripts/bench_vs_deepspeed.py reports the bytes a real model puts there)
    assert tr.engine.optimizer.swap_optimizer and tr.engine.zero_offload_param().device == "nvme"
    assert (tmp_path / "nvme" / "zero_stage_3" / "optimizer").is_dir()
    # the pinned swap buffers lazytrain reports are the ones DeepSpeed allocated (up to its I/O
    # alignment of the optimizer's buffers)
    from lazytrain.integrations.ds_config import pinned_swap_buffers
    est = dict((sec, b) for sec, b, _ in pinned_swap_buffers(cfg, plan))
    swapper = next(model.parameters()).nvme_swapper
    assert est["offload_param"] == swapper.buffers.numel() * swapper.buffers.element_size()
    m = tr.engine.optimizer.optimizer_swapper.swap_buffer_manager
    got = m.count * m.num_elems * m.all_buffers[0].element_size()
    assert est["offload_optimizer"] <= got <= est["offload_optimizer"] + m.count * 1024
    tr.close()
    x, y = data[0]
    with torch.no_grad():
        bf16_loss = float(ref.to(torch.bfloat16)(input_ids=x, labels=y).loss)
    assert losses[0] == pytest.approx(bf16_loss, rel=1e-3)
    assert losses[2] < losses[1] < losses[0]
