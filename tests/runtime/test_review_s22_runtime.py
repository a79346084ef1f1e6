"""Session 22: the session-21 memory-accounting review's open findings, and a review of their fixes."""

import copy
import weakref

import pytest
import torch

from lazytrain.runtime.executor import StreamingExecutor
from lazytrain.runtime.testing import hand_plan, random_batches, tiny_model
from lazytrain.spec import JobSpec

L, B, S, H = 3, 2, 32, 128


@pytest.mark.parametrize("segments", [[(1, L)], [(1, 1), (2, 2), (3, 3)], [(2, 3)]])
def test_recompute_leaves_no_uncounted_boundary_alive_in_backward(segments):
    """Two hidden states stayed alive through backward and nothing counted them: the last block's
    forward output (held by the head's graph through a local that outlived the forward loop) in
    every layer's backward after the head's, and each segment's last recomputed output during its
    own backward. Both are freed now, as the forward frees a stored layer's output."""
    model = tiny_model("llama", hidden_size=H, intermediate_size=256, vocab_size=256, num_hidden_layers=L,
                       dtype="bfloat16")
    plan = hand_plan(L, job=JobSpec(batch_size=B, seq_len=S), segments=segments)
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu")
    seen: dict = {}
    rows: list[tuple[int, int, int]] = []
    fwd0, bwd0 = ex._fwd, ex._bwd

    def fwd(i, x, mb):
        out = fwd0(i, x, mb)
        if i == L and not mb["recomputing"]:
            seen["last"] = weakref.ref(out.untyped_storage())
        return out

    def bwd(i, x, out, g, first, last, mb):
        st = seen["last"]()
        rows.append((i, 0 if st is None else st.nbytes(), out.untyped_storage().nbytes() if 0 < i <= L else 0))
        return bwd0(i, x, out, g, first, last, mb)

    ex._fwd, ex._bwd = fwd, bwd
    losses = ex.train_step(random_batches(1, seed=0, batch=B, seq=S, vocab=256)).loss
    ex.close()
    assert [r[0] for r in rows] == list(range(L + 1, -1, -1))
    # after the head's backward (the head's input is the last block's output): freed
    assert [r[1] for r in rows[1:]] == [0] * (L + 1), rows
    # no block's own output is alive during its backward
    assert [r[2] for r in rows] == [0] * (L + 2), rows
    assert torch.isfinite(torch.tensor(losses))


def test_gradients_read_in_place_stay_counted_until_their_update_ran():
    """Pure bf16 on a CPU device with one micro-batch: the update reads a layer's gradients where
    they are. They were uncounted as soon as accumulate() returned; with the optimizer on its own
    thread the update runs later, while the next layer's backward places more (8.5-14% of the
    peak alive uncounted, a review). Updates are slowed down here: the gradients still read in place
    must be counted at every point, and (since 2026-12-02, as the plan counts one layer's gradients
    on a CPU device) each update has run before the next layer's backward begins."""
    import time

    model = tiny_model("llama", hidden_size=H, intermediate_size=256, vocab_size=256, num_hidden_layers=L,
                       dtype="bfloat16")
    plan = hand_plan(L, job=JobSpec(batch_size=B, seq_len=S))
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", master_dtype=torch.bfloat16,
                           overlap_optimizer=True)
    upd0, bwd0 = ex._update, ex._bwd
    seen: list[tuple[int, int, int]] = []   # (layer, grads counted, bytes of grads pending in place)

    def pending() -> int:
        return sum(t.nbytes for st in ex.states if st is not None and (d := st._direct) is not None for t in d)

    starts: list[int] = []   # gradients pending in place when a layer's backward begins

    def update(i, *a):
        seen.append((i, ex.acct.by_kind["grads"], pending()))
        time.sleep(0.05)
        seen.append((i, ex.acct.by_kind["grads"], pending()))
        return upd0(i, *a)

    def bwd(i, x, out, g, first, last, mb):
        starts.append(pending())
        seen.append((i, ex.acct.by_kind["grads"], pending()))
        r = bwd0(i, x, out, g, first, last, mb)
        seen.append((i, ex.acct.by_kind["grads"], pending()))
        return r

    ex._update, ex._bwd = update, bwd
    ex.train_step(random_batches(1, seed=0, batch=B, seq=S, vocab=256))
    assert sum(1 for _, _, p in seen if p > 0) >= 2, seen   # updates read gradients in place
    for i, counted, alive in seen:
        assert counted >= alive, (i, counted, alive)
    assert len(starts) == L + 2 and not any(starts), starts   # (embedding, blocks, head)
    for lay in ex.layers:   # (the step returns before its last updates ran: the next forward waits)
        if lay.ready is not None:
            lay.ready.result()
    assert ex.acct.by_kind["grads"] == 0 and pending() == 0
    ex.close()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_close_leaves_nothing_counted_and_no_device_buffer_referenced(mode):
    """close() left the device-tier weight buffers counted and referenced by the executor (on CUDA:
    device memory held as long as a closed executor object lives), and LoRA's adapters and their
    AdamW state counted (review). The synced model keeps its weights."""
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, vocab_size=256, num_hidden_layers=2,
                       dtype="bfloat16")
    job = JobSpec(batch_size=2, seq_len=16, mode=mode, **({"lora_rank": 4} if mode == "lora" else {}))
    if mode == "lora":
        from lazytrain.models.lora import apply_lora
        model = apply_lora(model, 4, 8.0, job.lora_targets)
    ex = StreamingExecutor(model, hand_plan(2, job=job), device="cpu")
    ex.train_step(random_batches(1, seed=0, batch=2, seq=16, vocab=256))
    assert ex.acct.by_kind["params_resident"] > 0
    if mode == "lora":
        assert ex.acct.by_kind["adapters"] > 0 and ex.acct.by_kind["adapter_optimizer"] > 0
    trained = {n: p.detach().clone() for n, p in ex.sync_model().named_parameters()}
    ex.close()
    assert ex.acct.live_bytes == 0, {k: v for k, v in ex.acct.by_kind.items() if v}
    assert all(lay.resident is None for lay in ex.layers)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n
    ex.close()   # (twice: nothing more to release)
    assert ex.acct.live_bytes == 0


@pytest.mark.parametrize("family,plan_name", [("llama", "acts_host"), ("llama", "recompute_all"),
                                              ("mixtral", "mixed_segments")])
def test_a_failed_step_never_leaves_a_kind_below_zero(family, plan_name):
    """Since a refused placement is not counted (session 21), what its callers had recorded as held
    before placing it (the step context, the live boundary, an activation brought back, router
    logits) was freed on the abort path all the same: those kinds went negative, for every later
    step's budget check and peak and after close() (review). Budgets are scanned so that steps fail
    at placements of every kind."""
    from lazytrain.runtime.accountant import DeviceBudgetExceeded
    from lazytrain.runtime.testing import plan_families

    model = tiny_model(family)
    with __import__("tempfile").TemporaryDirectory() as d:
        ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                               nvme_dir=d)
        ex.train_step(random_batches(1, seed=0))
        ex.wait()
        full, failed_at = ex.acct.budget_bytes, set()
        for extra in range(0, 1 << 22, 1536):
            before = {k: v for k, v in ex.acct.by_kind.items() if v}
            ex.acct.budget_bytes = ex.acct.live_bytes + extra
            try:
                ex.train_step(random_batches(1, seed=1))
                ex.wait()
                break
            except DeviceBudgetExceeded as e:
                failed_at.add(str(e).split("while placing ")[1].split(";")[0])
                after = {k: v for k, v in ex.acct.by_kind.items() if v}
                assert after == before, (extra, str(e)[:80], before, after)
        ex.acct.budget_bytes = full
        assert len(failed_at) >= 3, failed_at
        ex.close()
        assert ex.acct.live_bytes == 0 and min(ex.acct.by_kind.values(), default=0) == 0


def test_after_close_calls_say_the_executor_is_closed():
    """After close() the device-tier buffers and the pools are released: sync_model() crashed on a
    released buffer (AttributeError) and eval_loss() on a shut-down pool (review). Every public call
    now says the executor is closed and what to do; closing again does nothing."""
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, vocab_size=256, num_hidden_layers=2)
    ex = StreamingExecutor(model, hand_plan(2), device="cpu")
    (ids, labels), = random_batches(1, seed=0, batch=1, seq=8, vocab=256)
    ex.train_step([(ids, labels)])
    ex.close()
    ex.close()
    for call in (lambda: ex.sync_model(), lambda: ex.eval_loss(ids, labels), lambda: ex.state_dict(),
                 lambda: ex.train_step([(ids, labels)]), lambda: ex.trainable_state()):
        with pytest.raises(RuntimeError, match=r"closed.*sync_model\(\) or state_dict\(\) before close"):
            call()


@pytest.mark.parametrize("family", ["qwen2-tied", "llama-tied"])
@pytest.mark.parametrize("plan_name", ["all_resident", "recompute_all"])
def test_trainable_tokens_on_a_tied_embedding_get_the_heads_gradient_too(family, plan_name):
    """PEFT's trainable_token_indices on a tied embedding wraps the head with the same delta
    parameter. The executor gave the adapter to the embedding only: the head's part of its gradient
    was never taken (relative error 1.0; zero where a batch has none of the tokens), silently
    (review). Now the gradient equals plain PEFT autograd's."""
    from peft import LoraConfig, get_peft_model

    from lazytrain.runtime.testing import plan_families, rel_err

    model = get_peft_model(tiny_model(family), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                          trainable_token_indices={"embed_tokens": [1, 2, 3]}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "trainable_tokens_delta" in n:
                p.normal_(0, 0.02)
    mbs = random_batches(1, seed=7)
    ref = copy.deepcopy(model)
    loss = ref(input_ids=mbs[0][0], labels=mbs[0][1]).loss
    loss.backward()
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu", lr=0.0)
    seen = {}
    step0 = ex._step_adapters

    def capture(scale, skip=False):
        seen.update({ex.param_names[id(p)]: ex.adapter_grads[id(p)].clone() for p in ex.adapter_params
                     if id(p) in ex.adapter_grads})
        return step0(scale, skip)

    ex._step_adapters = capture
    r = ex.train_step(mbs)
    ex.close()
    assert abs(r.loss - loss.item()) <= 1e-6 * abs(loss.item())
    deltas = [n for n, p in ref.named_parameters() if "trainable_tokens_delta" in n]
    assert deltas
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert rel_err(seen[n], p.grad) <= 1e-5, (n, rel_err(seen[n], p.grad))
