"""OpTemporaries: a CPU device's allocator view of what ops make inside a layer's compute."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.runtime import DeviceBudgetExceeded, StreamingExecutor
from lazytrain.runtime.accountant import OP_TEMPORARIES, MemoryAccountant
from lazytrain.runtime.testing import (hand_plan, hardware_for_tests, planned_device_peak, random_batches,
                                       steps_counting_op_temporaries, tiny_model)

CPU = torch.device("cpu")
MB = 2**20


def test_window_counts_new_storages_until_freed_or_closed():
    acct = MemoryAccountant(1 << 40, enforce=True)
    keep = torch.ones(MB // 4)                    # made before the window: not counted
    with acct.op_window(CPU):
        x = torch.ones(MB // 4)                   # 1 MiB
        assert acct.live_bytes == MB
        y = x * 2                                 # a new storage
        assert acct.live_bytes == 2 * MB
        y.add_(1)                                 # in place: no new memory
        v = y.view(-1)[: 10]                      # a view: no new memory
        keep.mul_(3)
        z = keep + 0                              # new, although its input predates the window
        assert acct.live_bytes == 3 * MB
        del x                                     # freed: uncounted before the next count
        u = torch.ones(MB // 4)
        assert acct.live_bytes == 3 * MB and acct.by_kind[OP_TEMPORARIES] == 3 * MB
        assert acct.peak_bytes == 3 * MB
    # what survives the window is the caller's to count; the peak stays
    assert acct.live_bytes == 0 and acct.by_kind[OP_TEMPORARIES] == 0
    assert acct.peak_bytes == 3 * MB and acct.peak_by_kind[OP_TEMPORARIES] == 3 * MB
    del y, v, z, u                                # after the window: no effect on the count
    acct.alloc(0, "nothing")
    assert acct.live_bytes == 0


def test_out_and_resize_growth_is_counted():
    acct = MemoryAccountant(1 << 40, enforce=True)
    a, b = torch.ones(MB // 4), torch.ones(MB // 4)
    with acct.op_window(CPU):
        o = torch.empty(0)
        torch.add(a, b, out=o)                    # out= into an empty tensor: 1 MiB appears
        assert acct.live_bytes == MB
        c = a * 1                                 # tracked (1 MiB), then grown in place to 2 MiB
        c.resize_(MB // 2)
        assert acct.live_bytes == MB + 2 * MB
        del c
        acct.alloc(0, "nothing")                  # (frees are settled before anything is counted)
        assert acct.live_bytes == MB


def test_held_storage_is_uncounted_when_freed_or_released():
    acct = MemoryAccountant(1 << 40, enforce=True)
    t = torch.ones(MB // 4)
    h = acct.hold(t, "activations")
    assert acct.by_kind["activations"] == MB
    del t                                         # autograd dropped it: memory is back
    acct.alloc(0, "nothing")
    assert acct.by_kind["activations"] == 0 and acct.live_bytes == 0
    acct.release(h)                               # the owner's release after that: once only
    assert acct.live_bytes == 0
    t = torch.ones(MB // 4)
    h = acct.hold(t, "activations")
    acct.release(h)
    del t
    acct.alloc(0, "nothing")
    assert acct.live_bytes == 0


def test_freeing_during_garbage_collection_does_not_deadlock():
    # A weakref callback runs inside a collection, which may start while a lock is held (the
    # accountant's, or the window's bookkeeping): the callbacks must take none (a review's repro,
    # which hung before the fix: storages freed by the collector, collections forced often).
    import gc
    import random

    class Box:
        pass

    acct = MemoryAccountant(1 << 40, enforce=True)
    rng = random.Random(0)
    old = gc.get_threshold()
    try:
        with acct.op_window(CPU):
            for _ in range(3000):
                b = Box()
                b.self, b.t = b, torch.ones(8)    # a cycle: freed by the collector, not refcounts
                gc.collect(0)
                del b
                gc.set_threshold(rng.randint(1, 12), rng.randint(1, 12), 1000)
                torch.ones(8) * 2
                gc.set_threshold(*old)
            gc.collect()
            acct.alloc(0, "nothing")
            assert acct.by_kind[OP_TEMPORARIES] == 0
    finally:
        gc.set_threshold(*old)


def test_saved_storage_at_a_freed_ones_address_is_counted_anew():
    # A kept saved tensor freed within the layer's forward, then another saved at the same
    # address: the second is counted too (a review finding: it was taken for the first)
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.trace import Trace

    acct = MemoryAccountant(1 << 40, enforce=True)
    acts = ActivationStore(CPU, acct, Trace(None), None, None, ["l0"])
    pack = acts.hooks(0, "device", lambda j: None).pack_hook
    freed: set[int] = set()
    for _ in range(50):    # until malloc hands a freed address out again (small sizes: soon)
        t = torch.ones(4096)
        packed = pack(t)
        sp = t.untyped_storage().data_ptr()
        acct.alloc(0, "nothing")
        assert acct.by_kind["activations"] == t.nbytes, sp in freed   # the live one, once
        del t, packed
        acct.alloc(0, "nothing")
        assert acct.by_kind["activations"] == 0                        # freed: uncounted
        if sp in freed:
            break
        freed.add(sp)
    else:
        pytest.skip("the allocator never reused an address")
    acts.release(0)
    assert acct.live_bytes == 0


def test_adopted_and_host_side_storages_are_not_temporaries():
    acct = MemoryAccountant(1 << 40, enforce=True)
    with acct.op_window(CPU):
        saved = torch.ones(MB // 4)
        acct.alloc(saved.nbytes, "activations")   # the executor counts it by hand from now on
        acct.adopt(saved)
        assert acct.by_kind[OP_TEMPORARIES] == 0 and acct.live_bytes == MB
        with acct.host_side():
            host = torch.ones(MB // 4)            # a host-tier copy's destination
        assert acct.live_bytes == MB
        del saved, host                           # freeing them changes nothing here either
        assert acct.live_bytes == MB
    assert acct.by_kind["activations"] == MB


def test_autograd_temporaries_are_counted_and_over_budget_raises():
    torch.manual_seed(0)
    w = torch.randn(64, 2048, requires_grad=True)
    h = torch.randn(256, 64, requires_grad=True)
    logits_grad = 256 * 2048 * 4                  # the fp32 gradient of the logits, 2 MiB

    def loss():
        return (h @ w).log_softmax(-1).mean()

    acct = MemoryAccountant(1 << 40, enforce=True)
    out = loss()
    with acct.op_window(CPU):
        gw, gh = torch.autograd.grad(out, [w, h])
    assert acct.peak_bytes >= logits_grad + gw.nbytes   # live at once inside the matmul's backward
    assert acct.peak_bytes < 4 * logits_grad
    # a budget below what the backward needs fails inside it, like a device allocator would
    tight = MemoryAccountant(logits_grad // 2, enforce=True)
    out = loss()
    with pytest.raises(DeviceBudgetExceeded, match=OP_TEMPORARIES):
        with tight.op_window(CPU):
            torch.autograd.grad(out, [w, h])
    assert tight.live_bytes == 0


def test_windows_do_not_nest():
    acct = MemoryAccountant(1 << 40, enforce=True)
    with acct.op_window(CPU):
        with pytest.raises(RuntimeError, match="nest"):
            with acct.op_window(CPU):
                pass


PLANS = {
    "resident": {},
    "streamed": {"param_tier": "host", "prefetch_depth": 1},
    "acts-host": {"activation_tier": "host"},
    "acts-nvme": {"activation_tier": "nvme"},
    "recompute": {"segments": [(1, 3)]},
}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("plan_kw", list(PLANS.values()), ids=list(PLANS))
def test_executor_counts_op_temporaries_without_changing_the_math(family, plan_kw, tmp_path):
    # a wide vocabulary: the head's fp32 logits gradient (B*S*V*4 bytes) is the largest temporary
    vocab = 2048
    model = tiny_model(family, vocab_size=vocab)
    batches = [random_batches(1, seed=s, batch=2, seq=32, vocab=vocab) for s in range(3)]
    runs = {}
    for count in (False, True):
        (tmp_path / str(count)).mkdir()
        ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_kw), device="cpu",
                               nvme_dir=tmp_path / str(count), lr=1e-2, count_op_temporaries=count)
        runs[count] = ([ex.train_step(b) for b in batches], dict(ex.acct.peak_by_kind), ex.acct.live_bytes)
        ex.close()
    (off, _, live_off), (on, kinds_on, live_on) = runs[False], runs[True]
    assert [r.loss for r in on] == [r.loss for r in off]
    assert live_on == live_off                     # nothing left counted between steps
    for a, b in zip(on, off):
        assert a.device_peak_bytes >= b.device_peak_bytes
    logits_grad = 2 * 32 * vocab * 4
    assert kinds_on.get(OP_TEMPORARIES, 0) >= logits_grad
    assert on[-1].device_peak_bytes >= off[-1].device_peak_bytes + logits_grad // 2


def test_router_logits_are_counted_once_also_when_recomputed():
    # MoE router logits are counted by hand (router_logits): not also as op temporaries, in the
    # forward and in a recompute segment's re-run (a review finding)
    vocab = 2048
    model = tiny_model("mixtral", vocab_size=vocab, output_router_logits=True, router_aux_loss_coef=0.02)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, segments=[(1, 3)]), device="cpu",
                           lr=1e-2, count_op_temporaries=True)
    seen = []
    fwd = ex._fwd

    def checked(i, x, mb):
        out = fwd(i, x, mb)
        if i in mb["rl"]:
            live = ex.acct._window.live
            seen.append((mb["recomputing"], sum(id(t.untyped_storage()) in live for t in mb["rl"][i])))
        return out

    ex._fwd = checked
    ex.train_step(random_batches(1, seed=0, batch=2, seq=32, vocab=vocab))
    ex.close()
    assert {r for r, _ in seen} == {False, True}
    assert all(n == 0 for _, n in seen), seen


def test_budget_with_op_temporaries_is_enforced(tmp_path):
    vocab = 2048
    model = tiny_model("llama", vocab_size=vocab)
    batch = random_batches(1, seed=0, batch=2, seq=32, vocab=vocab)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3), device="cpu", count_op_temporaries=False)
    hand_counted = ex.train_step(batch).device_peak_bytes
    ex.close()
    # room for everything the executor places, not for the head's logits gradient
    plan = hand_plan(3, hardware=hardware_for_tests(device_memory_gib=(hand_counted + 4096) / 2**30))
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", count_op_temporaries=False)
    ex.train_step(batch)
    ex.close()
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", count_op_temporaries=True)
    with pytest.raises(DeviceBudgetExceeded, match=OP_TEMPORARIES):
        ex.train_step(batch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("vocab", [2048, 8192])
def test_measured_peak_matches_the_planners_head_model(vocab, dtype):
    # Every layer resident: the peak is the head's (its log-softmax backward's two fp32 gradients
    # next to what it saved). The planner's prediction for the plan and the peak the executor
    # measures with op temporaries agree within 3% in bf16 (the model before this one, logits
    # gradients + the weight gradient at once, was 5-7% off here); in fp32 within 5% (the
    # blocks' activation bytes are scaled from bf16 wholesale: -3.5% at vocab 2048; the head's
    # fp32 log-softmax, once scaled too, made it -19%).
    from lazytrain.spec import JobSpec

    model = tiny_model("llama", vocab_size=vocab, dtype=dtype)
    job = JobSpec(batch_size=2, seq_len=32, compute_dtype={"bfloat16": "bf16", "float32": "fp32"}[dtype])
    hw = hardware_for_tests()
    plan = hand_plan(3, job=job, hardware=hw)
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=2, seq=32, vocab=vocab)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(model, plan, batch))
    tol = 0.03 if dtype == "bfloat16" else 0.05
    assert abs(measured - predicted) <= tol * predicted, (measured, predicted)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "thread"])
@pytest.mark.parametrize("hidden,seq", [(256, 8), (512, 4)])
def test_measured_peak_matches_when_a_block_backward_is_the_peak(hidden, seq, overlap):
    # Wide layers, few tokens, a small vocabulary: the peak is a block's backward, with its weight
    # gradients. On a CPU device the previous layer's have left before it begins, so one layer's
    # gradients are in flight, not two (`JobCosts.grads_inline`; counting two was 17-20% over the
    # measured peak here); also with the accumulation on a thread (overlap_optimizer=True), where
    # the backward waits for them (+4.8% over the prediction before it did, a review finding).
    from lazytrain.spec import JobSpec

    model = tiny_model("llama", hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=128,
                       dtype="bfloat16")
    job = JobSpec(batch_size=1, seq_len=seq, compute_dtype="bf16")
    hw = hardware_for_tests()
    plan = hand_plan(3, job=job, hardware=hw)
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=1, seq=seq, vocab=128)
    measured = max(r.device_peak_bytes for r in
                   steps_counting_op_temporaries(model, plan, batch, overlap_optimizer=overlap))
    assert abs(measured - predicted) <= 0.03 * predicted, (measured, predicted)


def test_a_failed_gradient_accumulation_leaves_nothing_counted():
    # (a review finding: the gradients' count was freed only after a successful accumulation)
    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3), device="cpu")
    st = ex.states[2]

    def boom(*a, **k):
        raise OSError("simulated NVMe write failure")

    st.accumulate = boom
    with pytest.raises(OSError, match="simulated"):
        ex.train_step(random_batches(1, seed=0))
    assert ex.acct.by_kind["grads"] == 0


@pytest.mark.parametrize("family,chunk", [("llama", 16), ("llama", 64), ("qwen2-tied", 16)])
def test_chunked_loss_peak_is_predicted_and_far_below_the_models_own(family, chunk):
    # job.loss_chunk_tokens: the head keeps one chunk's logits at a time. The planner's head term
    # for it matches the measured peak within 3%, and the peak is well below the unchunked one.
    from lazytrain.spec import JobSpec

    vocab = 8192
    model = tiny_model(family, vocab_size=vocab, dtype="bfloat16")
    hw = hardware_for_tests()
    batch = random_batches(1, seed=0, batch=2, seq=32, vocab=vocab)
    peaks, losses = {}, {}
    for c in (0, chunk):
        job = JobSpec(batch_size=2, seq_len=32, compute_dtype="bf16", loss_chunk_tokens=c)
        plan = hand_plan(3, job=job, hardware=hw)
        predicted = planned_device_peak(model, plan)
        res = steps_counting_op_temporaries(copy.deepcopy(model), plan, batch)
        peaks[c], losses[c] = res[-1].device_peak_bytes, [r.loss for r in res]
        assert abs(peaks[c] - predicted) <= 0.03 * predicted, (c, peaks[c], predicted)
    assert peaks[chunk] < 0.8 * peaks[0]
    assert losses[chunk][0] == pytest.approx(losses[0][0], rel=1e-6)
    # after a bf16 update the weights may differ in a last bit (the weight gradient's sums run
    # per chunk), so the next loss only nearly
    assert losses[chunk][1] == pytest.approx(losses[0][1], rel=1e-4)


def test_chunked_loss_needs_a_linear_head():
    from lazytrain.spec import JobSpec

    class SoftCapped(torch.nn.Linear):   # a head that does more than its matrix product
        def forward(self, x):
            return 30.0 * torch.tanh(super().forward(x) / 30.0)

    model = tiny_model("llama")
    head = SoftCapped(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    plan = hand_plan(3, job=JobSpec(batch_size=2, seq_len=12, compute_dtype="fp32", loss_chunk_tokens=8))
    with pytest.raises(ValueError, match="loss_chunk_tokens needs a plain nn.Linear lm_head"):
        StreamingExecutor(model, plan, device="cpu")
    with pytest.raises(ValueError, match="loss_chunk_tokens must be >= 0"):
        JobSpec(loss_chunk_tokens=-1)


@pytest.mark.parametrize("family,over", [
    ("qwen3_moe", dict(moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4, mlp_only_layers=[],
                       head_dim=64)),
    ("mixtral", dict(intermediate_size=128, num_local_experts=32, num_experts_per_tok=4)),
], ids=["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("plan_kw", [{}, {"activation_tier": "host"}], ids=["resident", "acts_host"])
def test_measured_peak_of_a_fine_grained_moe_is_within_the_plan(family, over, plan_kw):
    # Fine-grained MoE blocks (32 experts, 4 per token; hidden 256): the planner's device peak
    # must not be below what the executor measures with op temporaries. Before the MoE blocks'
    # per-expert outputs and index vectors and Qwen3's q/k norms were in the model's saved bytes,
    # the measured peak was 0.9% (Mixtral) and 3.9% (Qwen3-MoE) above the prediction here. It is
    # now 5.6% (Mixtral) and 9.0% (Qwen3-MoE) below it (a block's backward is over-predicted; see
    # the test above). With activations offloaded to the host, the fused gate_up output of the
    # experts was copied (and fetched back) once per half: the peak was 4.9% above the plan's
    # (both); each storage now crosses once (ActivationStore): 0.7-1.0% below it.
    from lazytrain.spec import JobSpec

    model = tiny_model(family, hidden_size=256, vocab_size=128, dtype="bfloat16", **over)
    job = JobSpec(batch_size=2, seq_len=256, compute_dtype="bf16")
    hw = hardware_for_tests()
    plan = hand_plan(model.config.num_hidden_layers, job=job, hardware=hw, **plan_kw)
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=2, seq=256, vocab=128)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(model, plan, batch))
    # (lower bound 0.8: a routed block's backward temporaries are modelled on Mixtral's, 14 x k x
    # hidden bytes per token measured; Qwen3-MoE's measure ~9.5 KB per token at top 4, hidden 256,
    # against the 16 KB its blocks are now given: 0.825 of the plan here)
    assert 0.8 * predicted <= measured <= predicted, (measured, predicted)


@pytest.mark.parametrize("plan_name", ["acts_host", "acts_nvme"])
@pytest.mark.parametrize("depth", [2, 3, 4])
def test_offloaded_activations_stay_within_the_plan_at_any_prefetch_depth(plan_name, depth, tmp_path):
    """The executor brings offloaded activations back one layer ahead (the one in use + the next,
    as the planner times and reserves them), whatever the weights' prefetch_depth. It used to
    bring back `prefetch_depth` layers' worth: at depth 3 a plan with activations on the host
    measured 26.2 MiB against 24.2 MiB planned (+8%), at depth 4 +19%."""
    from lazytrain.runtime.testing import plan_families
    from lazytrain.spec import JobSpec

    model = tiny_model("llama", hidden_size=128, intermediate_size=352, vocab_size=512, dtype="bfloat16")
    job = JobSpec(batch_size=2, seq_len=128, compute_dtype="bf16")
    kw = dict(plan_families(3)[plan_name], prefetch_depth=depth)
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), **kw)
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=2, seq=128, vocab=512)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(model, plan, batch, nvme_dir=tmp_path))
    assert measured <= predicted, (measured, predicted)
    # and not far above it: the planner reserves the item in use and one more in backward (its own
    # and one ahead), not two of the largest everywhere (then 1.17x and 1.38x here, now 1.05x and
    # 1.15x; a recompute segment's own item is just its input boundary)
    assert predicted <= {"acts_host": 1.08, "acts_nvme": 1.2}[plan_name] * measured, (measured, predicted)


def test_routed_expert_plan_with_offloaded_activations_stays_within_the_plan_at_1024_tokens(tmp_path):
    """Mixtral-shaped blocks (32 experts, top 4) at 1024 tokens, activations on the host: with the
    tight offload reserve (the item in use + one ahead) and the routed backward's temporaries at
    half their measured size, the measured peak was 2.1% above the plan's (62.42 vs 61.14 MiB; a
    review finding). The cost model now gives a routed block's backward what was measured."""
    from lazytrain.runtime.testing import plan_families
    from lazytrain.spec import JobSpec

    model = tiny_model("mixtral", hidden_size=256, intermediate_size=128, num_local_experts=32,
                       num_experts_per_tok=4, vocab_size=1024, dtype="bfloat16")
    job = JobSpec(batch_size=2, seq_len=512, compute_dtype="bf16")
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), **plan_families(3)["acts_host"])
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=2, seq=512, vocab=1024)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(model, plan, batch, nvme_dir=tmp_path))
    assert measured <= predicted, (measured, predicted)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_recompute_segment_input_is_brought_back_one_item_ahead(tier, tmp_path, monkeypatch):
    """A recompute segment's offloaded input is one backward item, like a stored layer's
    activations: it starts coming back while the item before it (here the head) runs backward,
    as the planner times it, not on demand when the segment's recompute begins. The measured
    peak stays within the plan."""
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.spec import JobSpec

    model = tiny_model("llama", hidden_size=64, intermediate_size=128, vocab_size=128, dtype="bfloat16")
    job = JobSpec(batch_size=2, seq_len=64, compute_dtype="bf16")
    # layers: embed 0, blocks 1-3, head 4; blocks 2-3 recomputed, their input saved on `tier`
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), activation_tier=tier, segments=[(2, 3)])
    order: list[tuple[str, int]] = []
    prefetch, bwd = ActivationStore.prefetch, StreamingExecutor._bwd

    def spy_prefetch(self, layer):
        if any(r.dev is None and r.read is None and r.tier != "device"
               for r in getattr(self.layers.get(layer), "recs", [])):
            order.append(("fetch", layer))
        return prefetch(self, layer)

    def spy_bwd(self, i, *a, **k):
        order.append(("bwd", i))
        return bwd(self, i, *a, **k)

    monkeypatch.setattr(ActivationStore, "prefetch", spy_prefetch)
    monkeypatch.setattr(StreamingExecutor, "_bwd", spy_bwd)
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=2, seq=64, vocab=128)
    res = steps_counting_op_temporaries(model, plan, batch, steps=1, nvme_dir=tmp_path)
    assert order.index(("fetch", 2)) < order.index(("bwd", 4)), order
    assert res[0].device_peak_bytes <= predicted, (res[0].device_peak_bytes, predicted)


@pytest.mark.parametrize("family,over", [("mistral", {}),
                                         ("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                                        max_window_layers=1, max_position_embeddings=512))])
@pytest.mark.parametrize("plan_kind", ["all_resident", "acts_host"])
def test_a_sliding_window_longer_sequence_stays_within_the_plan(family, over, plan_kind):
    """Past the window, torch's SDPA saves an additive [batch, 1, seq, seq] mask in every layer and
    transformers repeats k/v to every head: the planner left both out and the measured peak went
    up to 11% over the plan (review, a Mistral at seq 1024, window 64). Now within the plan."""
    from lazytrain.runtime.testing import plan_families
    from lazytrain.spec import JobSpec

    model = tiny_model(family, hidden_size=128, intermediate_size=256, vocab_size=256, dtype="bfloat16", **over)
    job = JobSpec(batch_size=2, seq_len=256, compute_dtype="bf16")
    plan = hand_plan(3, job=job, hardware=hardware_for_tests(), **plan_families(3)[plan_kind])
    predicted = planned_device_peak(model, plan)
    batch = random_batches(1, seed=0, batch=2, seq=256, vocab=256)
    measured = max(r.device_peak_bytes for r in steps_counting_op_temporaries(model, plan, batch))
    assert 0.88 * predicted <= measured <= predicted, (measured, predicted)


def test_which_models_slide():
    from lazytrain.spec import ModelSpec

    def window(mt, **cfg):
        base = dict(model_type=mt, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        return ModelSpec.from_hf_config(dict(base, **cfg)).sliding_window

    assert window("mistral") == 4096 and window("mistral", sliding_window=None) is None   # HF's default
    assert window("llama") is None and window("mixtral") is None and window("mixtral", sliding_window=64) == 64
    assert window("qwen2", sliding_window=64) is None                                       # use_sliding_window off
    assert window("qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=2) == 64
    assert window("qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=4) is None
    # layer_types name the sliding layers, use_sliding_window switches the window on (transformers
    # sets sliding_window to None without it: until 2026-12-01 this was planned as sliding)
    assert window("qwen3", sliding_window=64, use_sliding_window=True,
                  layer_types=["full_attention"] * 3 + ["sliding_attention"]) == 64
    assert window("qwen3", sliding_window=64, layer_types=["full_attention"] * 3 + ["sliding_attention"]) is None


def test_sliding_costs_only_the_sliding_blocks_and_from_the_window_on():
    """transformers builds the mask once kv_length reaches the window (seq == window included:
    it was left out), and only layers of type sliding_attention use it."""
    from lazytrain.costmodel import job_costs
    from lazytrain.spec import JobSpec, ModelSpec

    base = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=128, sliding_window=16,
                use_sliding_window=True, max_window_layers=2)
    model = ModelSpec.from_hf_config(base)
    assert model.sliding_blocks == (2, 3)
    hw = hardware_for_tests()
    at = {seq: [c.act_bytes for c in job_costs(model, hw, JobSpec(batch_size=1, seq_len=seq)).blocks]
          for seq in (15, 16)}
    plain = ModelSpec.from_hf_config(dict(base, use_sliding_window=False))
    flat = {seq: [c.act_bytes for c in job_costs(plain, hw, JobSpec(batch_size=1, seq_len=seq)).blocks]
            for seq in (15, 16)}
    assert at[15] == flat[15]                                   # below the window: no mask
    assert at[16][:2] == flat[16][:2] and all(a > b for a, b in zip(at[16][2:], flat[16][2:]))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_activations_on_nvme_measure_as_on_the_host(family, tmp_path):
    """Review: each saved tensor read back from NVMe was counted at its 4 KiB-rounded O_DIRECT
    buffer, which the plan does not model: a tiny Mixtral (27 saved tensors a block) measured 1%
    above its plan. Counted at the tensor's bytes, as the CUDA path's device copy is, NVMe and host
    activation tiers measure the same peak, within the plan."""
    from lazytrain.spec import JobSpec

    model = tiny_model(family, vocab_size=2048, dtype="bfloat16", hidden_size=64, intermediate_size=128)
    job = JobSpec(batch_size=2, seq_len=32, compute_dtype="bf16", clip_grad=True)
    peaks = {}
    for tier in ("host", "nvme"):
        plan = hand_plan(3, job=job, hardware=hardware_for_tests(), activation_tier=tier)
        (tmp_path / tier).mkdir()
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path / tier, lr=1e-3,
                               count_op_temporaries=True, max_grad_norm=1.0)
        peaks[tier] = max(ex.train_step(random_batches(1, seed=s, batch=2, seq=32, vocab=2048)).device_peak_bytes
                          for s in range(2))
        ex.close()
        assert peaks[tier] <= planned_device_peak(model, plan), tier
    assert peaks["nvme"] == peaks["host"]


@pytest.mark.parametrize("depth", [2, 3])
def test_streamed_buffers_the_streamer_drops_are_really_freed(depth, monkeypatch):
    """The streamer drops a cached weight buffer (and uncounts it) to stay within its cap. Until
    2026-12-01 the saved-tensor hooks kept every streamed layer's buffer alive through its pack
    closure until that layer's backward, so a dropped buffer was still memory, over the budget and
    counted nowhere (a review measured +22% over the accountant's peak; with the planner's own plans
    for the demo job, 0.3-1.3 MiB over the budget). Here the streaming buffers alive at every count
    of the accountant must be at most what it counts for them."""
    import gc
    import weakref

    from lazytrain.runtime import streamer as streamer_mod

    vocab = 2048
    model = tiny_model("llama", hidden_size=256, intermediate_size=688, num_attention_heads=4,
                       num_key_value_heads=4, num_hidden_layers=4, vocab_size=vocab, dtype="bfloat16")
    plan = hand_plan(4, param_tier="host", prefetch_depth=depth)
    ex = StreamingExecutor(model, plan, device="cpu", count_op_temporaries=True, max_grad_norm=1.0)
    made: list[tuple[weakref.ref, int]] = []   # the streaming buffers (their storages) and sizes
    over: list[int] = []
    empty0, alloc0 = streamer_mod.aligned_empty, MemoryAccountant.alloc

    def aligned_empty(nbytes, *args, **kw):
        t = empty0(nbytes, *args, **kw)
        if not args and not kw.get("pin"):   # (the pinned staging buffers are host memory)
            made.append((weakref.ref(t.untyped_storage()), t.numel()))
        return t

    def alloc(self, nbytes, kind):
        alive = sum(n for r, n in made if r() is not None)
        # (a new streaming buffer is made just before it is counted: this count)
        counted = self.by_kind["params_streamed"] + (nbytes if kind == "params_streamed" else 0)
        over.append(alive - counted)
        return alloc0(self, nbytes, kind)

    monkeypatch.setattr(streamer_mod, "aligned_empty", aligned_empty)
    monkeypatch.setattr(MemoryAccountant, "alloc", alloc)
    gc.disable()   # reference counting alone must free them, as it does on the budget's timeline
    try:
        for _ in range(2):
            ex.train_step(random_batches(1, seed=0, batch=2, seq=64, vocab=vocab))
        drops = ex.streamer._pool_bytes < sum(n for _, n in made)
    finally:
        gc.enable()
        ex.close()
    assert drops, "the plan no longer makes the streamer drop buffers: the test checks nothing"
    assert max(over) <= 0, f"streaming buffers alive {max(over) / MB:.2f} MiB above what is counted"
