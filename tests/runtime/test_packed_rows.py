"""Packed rows (SFT / chat sequences holding several rows) attend each only to itself: the
micro-batch carries position ids restarting at 0 with each row, and the executor gives the blocks
the mask and rotary tables the model's own forward makes of them. Before, the executor took no
position ids and every row attended to the rows before it in its sequence."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import GradCapture, hand_plan, plan_families, random_batches, rel_err, tiny_model

FAMILIES = ["llama", "qwen2", "mixtral"]


def packed_batches(n_micro: int, seed: int, batch: int = 2, seq: int = 12, vocab: int = 128):
    """`random_batches` with position ids: each sequence 2-4 rows of random lengths."""
    g = torch.Generator().manual_seed(seed + 1000)
    out = []
    for ids, labels in random_batches(n_micro, seed, batch=batch, seq=seq, vocab=vocab):
        pos = torch.empty(batch, seq, dtype=torch.long)
        for b in range(batch):
            cuts = sorted(torch.randperm(seq - 2, generator=g)[:int(torch.randint(1, 4, (1,), generator=g))] + 1)
            starts = [0, *[int(c) for c in cuts]]
            for a, e in zip(starts, [*starts[1:], seq]):
                pos[b, a:e] = torch.arange(e - a)
        out.append((ids, labels, pos))
    return out


def reference(model, mbs):
    """Plain PyTorch: the model's own forward with the same position ids (no KV cache)."""
    losses = []
    for ids, labels, pos in mbs:
        loss = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
        losses.append(loss.item())
        (loss / len(mbs)).backward()
    return sum(losses) / len(losses)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("plan_name", ["all_resident", "recompute_all", "acts_host", "params_nvme"])
def test_packed_rows_are_exact(family, plan_name, tmp_path):
    model = tiny_model(family)
    mbs = packed_batches(2, seed=1)
    ref = copy.deepcopy(model)
    ref_loss = reference(ref, mbs)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                           nvme_dir=tmp_path, lr=0.0, max_grad_norm=float("inf"))
    cap = GradCapture(ex)
    res = ex.train_step(mbs)
    ex.wait()
    ev = ex.eval_loss(*mbs[0])
    ex.close()
    assert abs(res.loss - ref_loss) <= 1e-5 * abs(ref_loss)
    worst = max(rel_err(cap.grads[n], p.grad) for n, p in ref.named_parameters())
    assert worst <= 1e-5, f"max rel grad err {worst:.2e}"
    ref.eval()
    with torch.no_grad():
        ids, labels, pos = mbs[0]
        want = ref(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss.item()
    assert abs(ev - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_packed_row_sees_only_itself(family, tmp_path):
    """The loss the executor trains on two rows packed into one sequence is the loss of each row
    run alone (token-weighted), and changing the first row changes nothing the second learns."""
    model = tiny_model(family)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 128, (1, 5), generator=g), torch.randint(0, 128, (1, 7), generator=g)
    ids = torch.cat([a, b], 1)
    labels = ids.clone()
    labels[0, 5] = -100   # the second row's first token is no target of the first row's last
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3), device="cpu", nvme_dir=tmp_path, lr=0.0)
    try:
        packed = ex.eval_loss(ids, labels, pos)
        alone = [ex.eval_loss(x, x.clone()) for x in (a, b)]
        want = (alone[0] * 4 + alone[1] * 6) / 10
        assert abs(packed - want) <= 1e-5 * abs(want), (packed, want)
        # another first row: the second row's loss alone is what changes the packed loss only by
        # the first row's part
        a2 = (a + 17) % 128
        packed2 = ex.eval_loss(torch.cat([a2, b], 1), torch.cat([a2, b], 1).index_fill(1, torch.tensor([5]), -100),
                               pos)
        alone2 = ex.eval_loss(a2, a2.clone())
        assert abs(packed2 - (alone2 * 4 + alone[1] * 6) / 10) <= 1e-5 * abs(packed2)
        # without the position ids the second row attends to the first: another loss
        assert abs(ex.eval_loss(ids, labels) - want) > 1e-4 * abs(want)
    finally:
        ex.close()


def test_position_ids_of_another_shape_are_refused(tmp_path):
    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3), device="cpu", nvme_dir=tmp_path, lr=0.0)
    ids = torch.zeros(2, 12, dtype=torch.long)
    try:
        with pytest.raises(ValueError, match=r"micro-batch 0: input_ids, labels and position_ids must all be "
                                             r"\[B, S\], got \(2, 12\) and \(2, 12\) and \(1, 12\)"):
            ex.train_step([(ids, ids, torch.zeros(1, 12, dtype=torch.long))])
        with pytest.raises(ValueError, match="expected \\(input_ids, labels\\[, position_ids\\]\\), got 1 items"):
            ex.train_step([(ids,)])
    finally:
        ex.close()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_rows_stay_within_the_plan_that_counts_their_mask(family):
    """With packed rows transformers gives every block an explicit [batch, 1, seq, seq] mask, which
    SDPA keeps as an additive one per block (and k/v repeated to every head): measured within the
    plan of a job with job.packed_rows, and over the plan of the same job without it."""
    from lazytrain.runtime.testing import hardware_for_tests, planned_device_peak, steps_counting_op_temporaries
    from lazytrain.spec import JobSpec

    model = tiny_model(family, hidden_size=128, intermediate_size=256, vocab_size=256, dtype="bfloat16",
                       max_position_embeddings=512)
    planned = {}
    for rows in (True, False):
        job = JobSpec(batch_size=2, seq_len=256, compute_dtype="bf16", packed_rows=rows)
        planned[rows] = planned_device_peak(model, hand_plan(3, job=job, hardware=hardware_for_tests(),
                                                             **plan_families(3)["acts_host"]))
    job = JobSpec(batch_size=2, seq_len=256, compute_dtype="bf16", packed_rows=True)
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), **plan_families(3)["acts_host"])
    batch = packed_batches(1, seed=0, batch=2, seq=256, vocab=256)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(copy.deepcopy(model), plan, batch))
    assert 0.88 * planned[True] <= measured <= planned[True], (measured, planned)
    assert measured > planned[False], (measured, planned)


def _cfg(model_type, **over):
    return dict(dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256, pad_token_id=None,
                     bos_token_id=None, eos_token_id=None), **over)


@pytest.mark.parametrize("cfg,problem", [
    (_cfg("llama"), None),                                                   # a family with formulas
    (_cfg("granite"), None), (_cfg("gemma2"), None), (_cfg("olmo2"), None),  # masks from position ids
    # a rotary table as wide as the probe is long (review: taken for the mask at 8 tokens)
    (_cfg("glm4_moe", moe_intermediate_size=32, head_dim=16, partial_rotary_factor=0.5, n_routed_experts=4,
          num_experts_per_tok=2, first_k_dense_replace=1), None),
    (_cfg("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16),
     "block 0's mask lets the second row's tokens see the first row"),        # mask built without them
    (_cfg("qwen3_next", num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
     "block 0 is a linear_attention layer"),
    (_cfg("lfm2", num_hidden_layers=2, layer_types=["conv", "full_attention"]), "block 0 is a conv layer"),
    (_cfg("falcon_h1"), "block 0 holds a convolution over the sequence"),      # attention + mamba in a block
])
def test_which_models_keep_packed_rows_apart(cfg, problem):
    """Checked on the model built on the meta device (its blocks' arguments for two packed rows);
    each verdict agrees with the HF forward: a row packed after another equals the row alone exactly
    where it says None (review: GPT-OSS 0.42 off, Qwen3-Next, LFM2, Falcon-H1 1e-4 to 1e-1)."""
    from lazytrain.spec.generic import packed_rows_problem
    import transformers

    why = packed_rows_problem(cfg)
    assert (why is None) if problem is None else (problem in (why or "")), why
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(cfg["model_type"], **kw))
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 12), generator=g)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None],
                       use_cache=False).logits[0, 5:]
        alone = model(input_ids=ids[:, 5:], use_cache=False).logits[0]
    assert ((packed - alone).abs().max() < 1e-4) == (problem is None)
