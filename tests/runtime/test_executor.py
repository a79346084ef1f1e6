"""Executor behaviour beyond exactness: memory accountant, trace, errors, checkpoint state."""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from lazytrain.runtime import DeviceBudgetExceeded, PlanMismatchError, StreamingExecutor
from lazytrain.runtime.streamer import use_sequence
from lazytrain.runtime.testing import hand_plan, plan_families, random_batches, hardware_for_tests, tiny_model
from lazytrain.runtime.trace import EVENT_KINDS


def peak(plan_kw: dict, tmp_path, layers: int = 6, seq: int = 48) -> int:
    model = tiny_model("llama", num_hidden_layers=layers)
    ex = StreamingExecutor(model, hand_plan(layers, **plan_kw), device="cpu", nvme_dir=tmp_path)
    res = ex.train_step(random_batches(1, seed=0, seq=seq))
    ex.close()
    assert res.accounted_peak_bytes == res.device_peak_bytes > 0
    return res.device_peak_bytes


def test_use_sequence_expands_recompute_segments():
    # embed, b0, b1, b2, head with b0..b1 recomputed
    assert use_sequence(5, [(1, 2)], embed_backward=True) == [0, 1, 2, 3, 4, 3, 1, 2, 1, 0]
    assert use_sequence(3, [], embed_backward=True) == [0, 1, 2, 1, 0]
    assert use_sequence(3, [(0, 2)], embed_backward=True) == [0, 1, 2, 0, 1, 2, 1, 0]
    # an embedding's backward reads no weights: its use is left out (its recompute stays)
    assert use_sequence(5, [(1, 2)]) == [0, 1, 2, 3, 4, 3, 1, 2, 1]
    assert use_sequence(3, [(0, 2)]) == [0, 1, 2, 0, 1, 2, 1]
    assert use_sequence(5, [(0, 0)]) == [0, 1, 2, 3, 4, 3, 2, 1, 0]


def test_a_recomputed_embedding_trains_within_the_streaming_cap(tmp_path):
    """A hand plan that recomputes the embedding (the planner never does) re-runs it right after
    the head: it runs, and the streamer's cache cap is then depth of the largest slot."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=2048)
    for segments in ([(0, 0)], [(0, 5)]):
        ex = StreamingExecutor(copy.deepcopy(model), hand_plan(4, param_tier="host", segments=segments),
                               device="cpu", nvme_dir=tmp_path)
        sizes = [lay.layout.padded_nbytes for lay in ex.streamer.layers]
        for k in range(2):
            ex.train_step(random_batches(1, seed=k))
        assert ex.acct.peak_by_kind["params_streamed"] <= 2 * max(sizes)
        ex.close()


def test_embedding_backward_reads_no_weights_unless_it_may():
    """An nn.Embedding's backward reads no weights; wrappers and user subclasses count as reading
    them (a probe cannot see everything); a transformers subclass is probed: one that multiplies
    by a weight of its own is caught."""
    from peft import LoraConfig, get_peft_model

    from lazytrain.models.adapter import embedding_backward_reads_weights, find_parts

    model = tiny_model("llama")
    parts = find_parts(model)
    assert not embedding_backward_reads_weights(parts)
    lora = find_parts(get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["embed_tokens"])))
    assert embedding_backward_reads_weights(lora)   # a wrapper: not trusted

    class Gated(torch.nn.Embedding):   # output * a learnt per-channel gate: the gate is saved
        def __init__(self, n, d):
            super().__init__(n, d)
            self.gate = torch.nn.Parameter(torch.ones(d))

        def forward(self, ids):
            return super().forward(ids) * self.gate

    class Scaled(torch.nn.Embedding):  # like transformers' scaled embeddings: reads no weights
        def forward(self, ids):
            return super().forward(ids) * 2.0

    n, d = parts.embed.num_embeddings, parts.embed.embedding_dim
    for cls, reads in ((Gated, True), (Scaled, False)):
        parts.embed = cls(n, d)
        assert embedding_backward_reads_weights(parts)   # user code: not trusted
        cls.__module__ = "transformers.models.test"     # as if transformers shipped it: probed
        assert embedding_backward_reads_weights(parts) == reads, cls.__name__


def test_streaming_and_recompute_lower_the_device_peak(tmp_path):
    resident = peak({}, tmp_path)
    streamed = peak({"param_tier": "host", "prefetch_depth": 1}, tmp_path)
    recompute = peak({"segments": [(1, 6)]}, tmp_path)
    offloaded = peak({"activation_tier": "host"}, tmp_path)
    assert streamed < resident
    assert recompute < resident
    assert offloaded < resident


def test_budget_is_enforced_on_cpu(tmp_path):
    model = tiny_model("llama")
    plan = hand_plan(3, hardware=hardware_for_tests(device_memory_gib=50e3 / 2**30))
    with pytest.raises(DeviceBudgetExceeded, match="device budget exceeded"):
        ex = StreamingExecutor(model, plan, device="cpu")
        ex.train_step(random_batches(1, seed=0))


def test_plan_for_another_model_is_refused():
    with pytest.raises(PlanMismatchError, match="do not match"):
        StreamingExecutor(tiny_model("llama"), hand_plan(2), device="cpu")


def test_missing_nvme_dir_said_before_training(tmp_path):
    with pytest.raises(ValueError, match="nvme_dir"):
        StreamingExecutor(tiny_model("llama"), hand_plan(3, param_tier="nvme"), device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        StreamingExecutor(tiny_model("llama"), hand_plan(3, param_tier="nvme"), device="cpu",
                          nvme_dir=tmp_path / "nope")


def test_tied_embeddings_share_one_buffer_and_one_update():
    model = tiny_model("qwen2-tied")
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3), device="cpu", lr=1e-2)
    head, embed_w = ex.layers[-1], ex.parts.embed.weight
    assert head.borrows == (0,) and all(p is not embed_w for p in head.params)
    assert ex.parts.head.weight is embed_w
    # the shared matrix is counted once (the head stores no params of its own, as planned)
    assert ex.acct.by_kind["params_resident"] == sum(p.nbytes for p in model.parameters())
    for s in range(3):
        ex.train_step(random_batches(2, seed=s))
    ex.wait()
    assert float(ex.states[0].step) == 3   # one AdamW update per step, after both contributions
    synced = ex.sync_model()
    assert synced.get_output_embeddings().weight is synced.get_input_embeddings().weight
    ex.close()


def test_tied_head_fetches_the_streamed_embedding(tmp_path):
    """A streamed embedding comes back for the head (end of forward / its backward), not for the
    embedding's own backward (which reads no weights), and once more for the next step's forward
    after the update; both of the head's weights are bound while it computes."""
    model = tiny_model("llama-tied")
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, param_tier="host", prefetch_depth=1),
                           device="cpu")
    fetched, orig_fetch, orig_use = [], ex.streamer._fetch, ex.streamer.use

    def fetch(lay):
        if lay.held is None and lay.fetch is None:
            fetched.append(lay.name)
        orig_fetch(lay)

    def use(i):
        orig_use(i)
        if i == ex.n_layers - 1:
            emb = ex.streamer.device_buffer(0)
            assert emb is not None and ex.parts.head.weight.data_ptr() == emb.data_ptr()
    ex.streamer._fetch, ex.streamer.use = fetch, use
    ex.train_step(random_batches(1, seed=0))
    assert fetched == ["embed", "block.0", "block.1", "block.2", "head", "embed",
                       "block.2", "block.1", "block.0", "embed"]   # last: next step's
    ex.close()


def test_trace_records_every_kind_of_event(tmp_path):
    trace = tmp_path / "trace.jsonl"
    plan = hand_plan(3, param_tier="nvme", activation_tier="host", grad_tier="nvme", segments=[(1, 2)])
    ex = StreamingExecutor(tiny_model("llama"), plan, device="cpu", nvme_dir=tmp_path, trace_path=trace)
    ex.train_step(random_batches(2, seed=0))
    ex.train_step(random_batches(2, seed=1))
    ex.close()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert kinds <= set(EVENT_KINDS)
    assert {"compute_fwd", "compute_bwd", "recompute", "nvme_read", "nvme_write", "d2h", "h2d",
            "optimizer"} <= kinds
    for e in events:
        assert e["end_s"] >= e["start_s"] >= 0 and e["bytes"] >= 0 and e["tier"] in ("device", "host", "nvme")
    # every block's weights were read from NVMe in both steps
    reads = {(e["step"], e["layer"]) for e in events if e["kind"] == "nvme_read" and e["tier"] == "nvme"}
    assert {(s, f"block.{i}") for s in (0, 1) for i in range(3)} <= reads


@pytest.mark.parametrize("plan_name", ["params_host", "params_nvme"])
def test_state_dict_resume_gives_the_same_losses(plan_name, tmp_path):
    model = tiny_model("qwen2")
    plan = hand_plan(3, **plan_families(3)[plan_name])
    kw = dict(device="cpu", lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    (tmp_path / "a").mkdir()
    a = StreamingExecutor(copy.deepcopy(model), plan, nvme_dir=tmp_path / "a", **kw)
    for s in range(3):
        a.train_step(random_batches(2, seed=s))
    save_file(a.state_dict(), tmp_path / "state.safetensors")
    cont = [a.train_step(random_batches(2, seed=s)).loss for s in range(3, 6)]
    (tmp_path / "b").mkdir()
    b = StreamingExecutor(copy.deepcopy(model), plan, nvme_dir=tmp_path / "b", **kw)
    b.load_state_dict(load_file(tmp_path / "state.safetensors"))
    assert b.step_count == 3
    resumed = [b.train_step(random_batches(2, seed=s)).loss for s in range(3, 6)]
    assert resumed == cont
    a.close()
    b.close()


def test_adamw8bit_state_dict_resume_gives_the_same_losses(tmp_path):
    pytest.importorskip("lazytrain.optim.adamw8bit")
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="host")
    kw = dict(device="cpu", optimizer="adamw8bit", lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    a = StreamingExecutor(copy.deepcopy(model), plan, **kw)
    for s in range(3):
        a.train_step(random_batches(2, seed=s))
    save_file(a.state_dict(), tmp_path / "state.safetensors")
    cont = [a.train_step(random_batches(2, seed=s)).loss for s in range(3, 6)]
    b = StreamingExecutor(copy.deepcopy(model), plan, **kw)
    b.load_state_dict(load_file(tmp_path / "state.safetensors"))
    resumed = [b.train_step(random_batches(2, seed=s)).loss for s in range(3, 6)]
    assert resumed == cont
    a.close()
    b.close()


def test_sync_model_then_keep_training(tmp_path):
    model = tiny_model("llama")
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, param_tier="host"), device="cpu", lr=1e-2)
    ex.train_step(random_batches(1, seed=0))
    synced = ex.sync_model()
    ids, labels = random_batches(1, seed=5)[0]
    with torch.no_grad():
        loss_synced = synced(input_ids=ids, labels=labels).loss.item()
    res = ex.train_step([(ids, labels)])
    assert abs(res.loss - loss_synced) < 1e-6
    ex.close()


def test_nonfinite_gradients_skip_the_step_when_clipping(tmp_path):
    model = tiny_model("llama")
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, param_tier="host"), device="cpu",
                           lr=1e-2, max_grad_norm=1.0)
    before = ex.trainable_state()
    ids, labels = random_batches(1, seed=0)[0]
    st = ex.states[1]
    orig = st.accumulate

    def poisoned(grads, first, last, shared=None):
        grads = [g * float("inf") if g is not None else g for g in grads]
        return orig(grads, first, last, shared=shared)
    st.accumulate = poisoned
    res = ex.train_step([(ids, labels)])
    assert res.skipped and not (res.grad_norm < float("inf"))
    after = ex.trainable_state()
    assert all(torch.equal(before[n], after[n]) for n in before)
    ex.close()


@pytest.mark.parametrize("n_micro", [1, 2])
def test_adamw8bit_plugs_in_and_trains(tmp_path, n_micro):
    pytest.importorskip("lazytrain.optim.adamw8bit")
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="host")
    ex8 = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", optimizer="adamw8bit", lr=3e-3,
                            max_grad_norm=1.0)
    ex32 = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", optimizer="adamw", lr=3e-3,
                             max_grad_norm=1.0)
    mbs = random_batches(n_micro, seed=3)
    l8 = [ex8.train_step(mbs).loss for _ in range(15)]
    l32 = [ex32.train_step(mbs).loss for _ in range(15)]
    assert l8[-1] < l8[0] - 0.1                       # it trains
    assert abs(l8[-1] - l32[-1]) < 0.05 * l32[-1]     # and stays close to fp32 AdamW
    ex8.close()
    ex32.close()


def test_adamw8bit_folds_the_clip_scale_into_its_pass(monkeypatch):
    """Issue 5: with clipping, the 8-bit update applies the clip factor inside its one fused pass;
    no pass rescales the accumulated gradients first (fp32 AdamW still does, as clip_grad_norm_)."""
    model = tiny_model("llama")
    sizes = set()
    real_mul = torch.Tensor.mul_

    def spy(self, *a, **k):
        sizes.add(self.numel())
        return real_mul(self, *a, **k)

    for opt, expect_pass in (("adamw8bit", False), ("adamw", True)):
        ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, param_tier="host"), device="cpu",
                               optimizer=opt, lr=3e-3, max_grad_norm=1e-3)   # clips every step
        ex.train_step(random_batches(1, seed=0))
        sizes.clear()
        monkeypatch.setattr(torch.Tensor, "mul_", spy)
        res = ex.train_step(random_batches(1, seed=1))
        ex.wait()
        monkeypatch.setattr(torch.Tensor, "mul_", real_mul)
        assert res.grad_norm > 1e-3                                  # it did clip
        layer_numels = {lay.layout.numel for lay in ex.layers if lay.layout.numel}
        assert bool(sizes & layer_numels) == expect_pass, (opt, sorted(sizes & layer_numels))
        ex.close()


def test_generous_and_tight_plans_log_the_same_losses(tmp_path):
    """Issue 3: the same job at a generous budget and at one forcing NVMe offload and recompute."""
    model = tiny_model("mixtral")
    generous = hand_plan(3)
    tight = hand_plan(3, param_tier="nvme", activation_tier="nvme", grad_tier="nvme",
                      optimizer_tier="nvme", segments=[(1, 2), (3, 4)], prefetch_depth=1)
    runs = []
    for plan in (generous, tight):
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path, lr=3e-3,
                               max_grad_norm=1.0)
        runs.append(([ex.train_step(random_batches(2, seed=s)).loss for s in range(5)],
                     ex.train_step(random_batches(1, seed=9)).device_peak_bytes))
        ex.close()
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] < runs[0][1]


def test_planner_plans_run(tmp_path):
    plan_mod = pytest.importorskip("lazytrain.plan")
    if not hasattr(plan_mod, "plan_job"):
        pytest.skip("planner not available")
    from lazytrain.plan import PlannerOptions, plan_job
    from lazytrain.spec import JobSpec, ModelSpec

    model = tiny_model("llama")
    spec = ModelSpec.from_hf_config(model.config.to_dict(), name="tiny")
    job = JobSpec(batch_size=2, seq_len=12, compute_dtype="fp32")
    losses = []
    for gib in (8.0, 0.00025):   # the tight budget makes the planner recompute and stream
        plan = plan_job(spec, hardware_for_tests(device_memory_gib=gib), job, PlannerOptions(time_limit_s=10),
                        cache_dir=str(tmp_path / "cache"))
        if not plan.fits:
            pytest.skip(f"planner finds no plan at {gib} GiB: {plan.explanation}")
        if gib < 1:
            assert any(d.recompute or d.param_tier != "device" for d in plan.layers)
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path, lr=3e-3)
        losses.append([ex.train_step(random_batches(1, seed=s)).loss for s in range(3)])
        ex.close()
    assert losses[0] == losses[1]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_streamed_weights_use_at_most_depth_buffers(depth, tmp_path):
    model = tiny_model("llama", num_hidden_layers=6)
    ex = StreamingExecutor(model, hand_plan(6, param_tier="host", prefetch_depth=depth,
                                            overrides={"embed": {"param_tier": "device"},
                                                       "head": {"param_tier": "device"}}),
                           device="cpu")
    block_bytes = ex.layers[1].layout.padded_nbytes
    ex.train_step(random_batches(1, seed=0))
    ex.acct.reset_peak()
    ex.train_step(random_batches(1, seed=1))
    assert ex.acct.peak_by_kind.get("params_streamed", 0) <= depth * block_bytes
    ex.close()


def test_set_lr_schedule_matches_torch(tmp_path):
    """Updates of step k may still be landing when set_lr for step k+1 runs: each uses its own lr."""
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1.0, weight_decay=0.0, fused=True)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, param_tier="host"), device="cpu", lr=1.0)
    for step in range(6):
        lr = 1e-3 * (step + 1)
        for g in opt.param_groups:
            g["lr"] = lr
        ex.set_lr(lr)
        mbs = random_batches(1, seed=step)
        for ids, labels in mbs:
            ref(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        ex.train_step(mbs)
    got = ex.trainable_state()
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n
    ex.close()


def test_close_removes_its_nvme_scratch(tmp_path):
    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3, **plan_families(3)["params_nvme"]),
                           device="cpu", nvme_dir=tmp_path)
    ex.train_step(random_batches(1, seed=0))
    assert any(tmp_path.iterdir())
    ex.close()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("vocab", [128, 2048], ids=["small-embedding", "large-embedding"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_streaming_buffers_stay_within_the_planned_reserve(tmp_path, depth, vocab):
    """Buffers held at once (in use + cached for reuse) never exceed what the planner reserves for
    streaming (plan.ops.streaming_reserve): with the embedding and head smaller than a block,
    `depth` of a block's; larger, one of theirs and depth (in use + one cached) of a block's, less
    than `depth` of theirs (cached buffers are released to make room)."""
    from lazytrain.plan.ops import streaming_reserve

    model = tiny_model("llama", num_hidden_layers=4, vocab_size=vocab)
    ex = StreamingExecutor(model, hand_plan(4, param_tier="host", prefetch_depth=depth), device="cpu",
                           nvme_dir=tmp_path)
    sizes = [lay.layout.padded_nbytes for lay in ex.streamer.layers]
    reserve = streaming_reserve(sizes, 4, depth, cached=True)
    if vocab > 128:
        assert sizes[0] > sizes[1] and (depth == 1 or reserve < depth * max(sizes))
    else:
        assert sizes[0] < sizes[1] and reserve == depth * max(sizes)
    peaks = []
    for k in range(3):
        ex.train_step(random_batches(1, seed=k))
        peaks.append(ex.acct.peak_by_kind.get("params_streamed", 0))
    ex.close()
    assert max(peaks) <= reserve
    assert max(peaks) >= min(depth, 2) * min(sizes)   # streaming did happen


@pytest.mark.parametrize("depth", [2, 3])
def test_streaming_buffers_are_reused_across_steps(tmp_path, depth, monkeypatch):
    """On a CPU device a fresh buffer page-faults in at ~9 GB/s: after the first step, fetches of
    every size (blocks, and embedding and head larger than a block) reuse cached buffers."""
    import lazytrain.runtime.streamer as streamer
    allocs = []
    real = streamer.aligned_empty
    monkeypatch.setattr(streamer, "aligned_empty", lambda nb, *a, **k: allocs.append(nb) or real(nb, *a, **k))
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=2048)
    ex = StreamingExecutor(model, hand_plan(4, param_tier="host", prefetch_depth=depth), device="cpu",
                           nvme_dir=tmp_path)
    sizes = {lay.name: lay.layout.padded_nbytes for lay in ex.streamer.layers}
    assert sizes["embed"] > sizes["block.0"] and sizes["head"] > sizes["block.0"]
    ex.train_step(random_batches(1, seed=0))
    assert set(allocs) == {sizes["embed"], sizes["block.0"], sizes["head"]}
    allocs.clear()
    for k in range(1, 3):
        ex.train_step(random_batches(1, seed=k))
    ex.close()
    assert allocs == []


def test_a_failed_in_place_fetch_is_raised_at_use_and_frees_its_buffer(tmp_path):
    """On a CPU device host-tier fetches run in place: a failure (here the layer's pending update)
    surfaces where the layer is used, and its buffer is still released and uncounted."""
    from concurrent.futures import Future
    ex = StreamingExecutor(tiny_model("llama", num_hidden_layers=4), hand_plan(4, param_tier="host"),
                           device="cpu", nvme_dir=tmp_path)
    ex.train_step(random_batches(1, seed=0))
    s = ex.streamer
    s.invalidate()
    bad: Future = Future()
    bad.set_exception(RuntimeError("update failed"))
    s.layers[0].ready = bad
    s.prefetch_first(ex.use_seq)   # no raise here: the fetch holds the error
    with pytest.raises(RuntimeError, match="update failed"):
        s.use(0)
    s.layers[0].ready = None
    s.invalidate()   # dropping the failed buffer raises nothing more
    ex.close()
    assert ex.acct.by_kind["params_streamed"] == 0 and s._pool_bytes == 0


def test_staging_sets_bound_and_reuse_buffers():
    import threading

    from lazytrain.storage.tiers import StagingSets

    pool = StagingSets(2)
    a, b = pool.acquire(5000), pool.acquire(3000)
    assert len(a) == 3 and all(t.numel() >= 5000 for t in a) and all(t.numel() >= 3000 for t in b)
    got = []
    th = threading.Thread(target=lambda: got.append(pool.acquire(4000)))
    th.start()
    th.join(0.2)
    assert th.is_alive() and not got            # both sets out: the third acquire waits
    pool.release(a)
    th.join(5)
    assert got and got[0] is a                  # ...and gets the released set, not a new one
    pool.release(b)
    big = pool.acquire(10_000)                  # only a too-small set is free: replaced
    assert all(t.numel() >= 10_000 for t in big)


def test_nvme_state_write_back_failure_is_raised_with_the_file(tmp_path):
    """Optimizer state on NVMe is written back asynchronously; a failed write must not pass silently."""
    from concurrent.futures import Future

    from lazytrain.storage.aligned_io import DiskIOError

    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="nvme", optimizer_tier="nvme")
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path, lr=1e-3)
    ex.train_step(random_batches(1, seed=0))
    real_write = ex.state_io.write   # optimizer state has its own I/O workers

    def failing_write(f, buf, offset):
        if "exp_avg_sq" not in f.path.name:
            return real_write(f, buf, offset)
        fut = Future()
        fut.set_exception(DiskIOError(28, f"write {f.path}: No space left on device"))
        return fut

    ex.state_io.write = failing_write
    ex.train_step(random_batches(1, seed=1))      # the failing write-backs are in flight here
    with pytest.raises(DiskIOError, match=r"exp_avg_sq.*No space left"):
        ex.train_step(random_batches(1, seed=2))  # reading that state again surfaces the error
    ex.state_io.write = real_write
    with pytest.raises(DiskIOError):
        ex.close()                                # and so does close, for the other layers


@pytest.mark.parametrize("clip", [1.0, None])
def test_nvme_weight_writes_in_flight_are_bounded(tmp_path, clip):
    """Weights written behind their updates hold a host buffer each until the drive has them: with
    a slow drive at most PUBLISH_IN_FLIGHT are queued, not every layer's (the planner's host
    reserve), and the weights that land are the ones the next step reads (same losses)."""
    from lazytrain.runtime.executor import PUBLISH_IN_FLIGHT
    losses = []
    for slow in (False, True):
        ex = StreamingExecutor(tiny_model("llama", num_hidden_layers=6), hand_plan(6, param_tier="nvme"),
                               device="cpu", nvme_dir=tmp_path, lr=1e-3, max_grad_norm=clip)
        real = ex.nvme.write_sync
        pending = []

        def write(key, buf, real=real, slow=slow, ex=ex):
            pending.append(sum(1 for lay in ex.layers if lay.publish is not None and not lay.publish.done()))
            if slow:
                time.sleep(0.05)
            real(key, buf)
        ex.nvme.write_sync = write
        losses.append([ex.train_step(random_batches(1, seed=k)).loss for k in range(3)])
        ex.close()
        assert max(pending) <= PUBLISH_IN_FLIGHT
    assert losses[0] == losses[1]


def test_nvme_weight_write_failure_is_raised_with_the_file(tmp_path):
    """NVMe-tier weights are written behind their update: a failed write surfaces, naming the
    file, within the step after it at the latest, and wait() raises it too."""
    from lazytrain.storage.aligned_io import DiskIOError
    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3, param_tier="nvme"), device="cpu",
                           nvme_dir=tmp_path, lr=1e-3)
    ex.train_step(random_batches(1, seed=0))
    real = ex.nvme.write_sync

    def failing(key, buf):
        if key == "block.1.param":
            raise DiskIOError(28, f"write {key}.bin: No space left on device")
        real(key, buf)
    ex.nvme.write_sync = failing
    with pytest.raises(DiskIOError, match=r"block.1.param.*No space left"):
        # block.1's new weights fail to land: raised once later writes queue behind it, or at
        # block.1's next fetch
        ex.train_step(random_batches(1, seed=1))
        ex.nvme.write_sync = real
        ex.train_step(random_batches(1, seed=2))
    ex.nvme.write_sync = real
    with pytest.raises(DiskIOError, match=r"block.1.param"):
        ex.wait()
    with pytest.raises(DiskIOError, match=r"block.1.param"):
        ex.close()   # (and it still cleans up)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("clip", [1.0, None])
def test_nvme_state_read_ahead_on_an_optimizer_thread(tmp_path, clip):
    """With updates on their own thread (as on CUDA) the read-ahead, updates and write-backs of
    NVMe-tier state stay ordered: the same losses as inline updates, step after step."""
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="nvme", optimizer_tier="nvme", grad_tier="nvme")
    runs = []
    for overlap in (False, True):
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path, lr=3e-3,
                               max_grad_norm=clip, overlap_optimizer=overlap)
        runs.append([ex.train_step(random_batches(2, seed=s)).loss for s in range(5)])
        ex.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("clip,optimizer,tier", [(1.0, "adamw", "host"), (None, "adamw", "host"),
                                                 (1.0, "adamw8bit", "host"), (None, "adamw", "nvme")])
def test_queued_updates_keep_their_steps_lr(clip, optimizer, tier, tmp_path):
    """Updates on their own thread (as on CUDA) may still be queued when the next step's lr is
    set; each uses its own step's lr: the same losses and weights as inline updates, with the lr
    changed before every step and no wait in between (what `lazytrain train` does)."""
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="host", optimizer_tier=tier)
    runs = []
    for overlap in (False, True):
        (tmp_path / str(overlap)).mkdir()
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", lr=1e-3, max_grad_norm=clip,
                               overlap_optimizer=overlap, optimizer=optimizer, nvme_dir=tmp_path / str(overlap))
        if overlap:   # slow updates: still queued when the next lr is set
            real = ex._update
            ex._update = lambda *a, real=real: (time.sleep(0.02), real(*a))[1]
        losses = []
        for s in range(6):
            ex.set_lr(1e-3 * (1 + 3 * (s % 2)))   # alternates 1e-3 / 4e-3: a late read shows
            losses.append(ex.train_step(random_batches(2, seed=s)).loss)
        runs.append((losses, ex.trainable_state()))
        ex.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


@pytest.mark.parametrize("family", ["llama", "llama-tied", "llama-lora"])
@pytest.mark.parametrize("segments", [[], [(1, 3)], [(1, 2), (3, 3)], [(2, 3)], [(1, 1)]],
                         ids=["none", "all-blocks", "two", "last-two", "first"])
@pytest.mark.parametrize("n_micro", [1, 2, 3])
@pytest.mark.parametrize("layout", ["streamed", "some-resident", "depth-3"])
def test_parameter_fetches_are_the_simulators(family, segments, n_micro, layout, tmp_path):
    """Every layer streamed from host at prefetch depth 2: the bytes of weights the executor
    fetches in a step are the simulator's h2d params for the plan, to the byte (which layers the
    streamer still holds when they are used again: ops.py), with recompute segments, tied
    embeddings, gradient accumulation (the first micro-batch of a step fetches what later ones
    find held) and LoRA (frozen weights: held across steps too). With resident layers in between
    or a deeper prefetch the streamer holds layers longer: the simulator's count is then an upper
    bound."""
    from lazytrain.costmodel import job_costs
    from lazytrain.models import apply_lora
    from lazytrain.plan.simulate import simulate
    from lazytrain.plan.solve import assignment_of
    from lazytrain.spec import JobSpec, ModelSpec

    lora = family.endswith("-lora")
    family = family.removesuffix("-lora")
    model = tiny_model(family)
    job = JobSpec(batch_size=2, seq_len=16, grad_accum=n_micro, compute_dtype="fp32",
                  mode="lora" if lora else "full")
    resident = {"embed": {"param_tier": "device"}, "block.1": {"param_tier": "device"}}
    plan = hand_plan(3, param_tier="host", segments=segments, job=job,
                     prefetch_depth=3 if layout == "depth-3" else 2,
                     overrides=resident if layout == "some-resident" else None)
    trace = tmp_path / "trace.jsonl"
    run = apply_lora(copy.deepcopy(model), 4, 8.0, ("q_proj", "v_proj")) if lora else copy.deepcopy(model)
    ex = StreamingExecutor(run, plan, device="cpu", lr=1e-3, trace_path=trace)
    for s in range(2):
        ex.train_step(random_batches(n_micro, seed=s))
    ex.close()
    got = sum(e["bytes"] for e in map(json.loads, trace.read_text().splitlines())
              if e["step"] == 1 and e["kind"] == "h2d" and e["what"] == "params")
    spec = ModelSpec.from_hf_config(model.config.to_dict(), name=family)
    tl = simulate(job_costs(spec, plan.hardware, job), assignment_of(plan), plan.hardware,
                  depth=plan.options.prefetch_depth)
    # (resident layers' new weights are published to the device too: counted on both sides)
    want = sum(e.bytes for e in tl.events if e.kind == "h2d" and e.what == "params")
    assert (got == want if layout == "streamed" else 0 < got <= want), (got, want)


def test_io_between_steps_is_traced_outside_them(tmp_path):
    """Checkpoint reads and a model sync between steps are traced under step -1, so per-step
    figures (lazytrain plan trace) see only the steps: with NVMe-tier state every step moves the
    same bytes, the last one too."""
    from lazytrain.plan.tracecmp import measured_busy

    trace = tmp_path / "trace.jsonl"
    plan = hand_plan(3, param_tier="nvme", optimizer_tier="nvme", grad_tier="nvme")
    ex = StreamingExecutor(copy.deepcopy(tiny_model("llama")), plan, device="cpu", nvme_dir=tmp_path, lr=1e-3,
                           max_grad_norm=1.0, trace_path=trace)
    for s in range(3):
        ex.train_step(random_batches(1, seed=s))
    ex.state_dict()
    ex.sync_model()
    ex.close()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {e["step"] for e in events} == {-1, 0, 1, 2}
    assert any(e["step"] == -1 and e["kind"] == "nvme_read" for e in events)   # the checkpoint's reads
    per_step = [measured_busy([e for e in events if e["step"] == s], skip_first=False)[1] for s in (1, 2)]
    assert per_step[0] == per_step[1]


def test_an_moe_model_running_another_experts_implementation_than_planned_warns():
    # The plan's memory model counts grouped_mm's saved bytes unless the plan's model config
    # names another implementation (eager saves 13-15% more per MoE block, batched_mm ~50x)
    import warnings

    import transformers

    from lazytrain.runtime.testing import TINY_CONFIGS

    cfg = transformers.AutoConfig.for_model("mixtral", **TINY_CONFIGS["mixtral"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    with pytest.warns(UserWarning, match="'eager' experts implementation.*counted 'grouped_mm'"):
        StreamingExecutor(copy.deepcopy(model), hand_plan(3), device="cpu").close()
    planned = dataclasses.replace(hand_plan(3), model_config={"_experts_implementation": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        StreamingExecutor(copy.deepcopy(model), planned, device="cpu").close()


def test_lora_on_expert_weights_warns():
    # PEFT wraps a Qwen3-MoE's expert parameters when MLP names are targets; what those blocks
    # save for backward is not in the plan's memory model (measured several times more)
    import warnings

    from lazytrain.models.lora import apply_lora

    model = tiny_model("qwen3_moe")
    with pytest.warns(UserWarning, match="LoRA adapters on expert weights"):
        lora = apply_lora(copy.deepcopy(model), 4, 8.0, ("q_proj", "gate_proj", "up_proj", "down_proj"))
        if not any(type(m).__name__ == "ParamWrapper" for m in lora.modules()):
            pytest.skip("this PEFT does not wrap expert parameters")
        StreamingExecutor(lora, hand_plan(3), device="cpu").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        StreamingExecutor(apply_lora(copy.deepcopy(model), 4, 8.0, ("q_proj", "v_proj")), hand_plan(3),
                          device="cpu").close()


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_released_layers_leave_no_fetched_activation_alive(tier, tmp_path, monkeypatch):
    """A recompute segment's input, brought back from host/NVMe, is freed when its layer is
    released, not only when the next segment starts: the accountant stops counting it there, and
    on CUDA the allocator's peak would see it (a review finding: the segment's last graph kept it
    alive through a stale local)."""
    import gc
    import weakref

    from lazytrain.runtime import activations as acts_mod
    from lazytrain.spec import JobSpec

    fetched, alive_after = [], []
    fetch_host, materialize, release = (acts_mod.ActivationStore._fetch_host,
                                        acts_mod.ActivationStore._materialize,
                                        acts_mod.ActivationStore.release)

    def track(rec):
        fetched.append((rec.layer, weakref.ref(rec.dev.untyped_storage())))

    def _fetch_host(self, rec):
        fetch_host(self, rec)
        track(rec)

    def _materialize(self, rec):
        out = materialize(self, rec)
        if rec.tier == "nvme" and rec.base is None and all(r() is not rec.dev.untyped_storage() for _, r in fetched):
            track(rec)
        return out

    def _release(self, layer):
        release(self, layer)
        gc.collect()
        alive_after.append((layer, [j for j, r in fetched if j >= layer and r() is not None]))

    monkeypatch.setattr(acts_mod.ActivationStore, "_fetch_host", _fetch_host)
    monkeypatch.setattr(acts_mod.ActivationStore, "_materialize", _materialize)
    monkeypatch.setattr(acts_mod.ActivationStore, "release", _release)
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=5, dtype="bfloat16")
    job = JobSpec(batch_size=2, seq_len=32, compute_dtype="bf16")
    plan = hand_plan(5, job=job, activation_tier=tier, segments=[(1, 2), (3, 4)],
                     overrides={"embed": {"activation_tier": "device"}, "head": {"activation_tier": "device"},
                                "block.4": {"activation_tier": "device"}})
    ex = StreamingExecutor(model, plan, device="cpu", nvme_dir=tmp_path)
    ex.train_step(random_batches(1, seed=0, batch=2, seq=32, vocab=model.config.vocab_size))
    ex.close()
    assert {j for j, _ in fetched} >= {1, 3}   # both segments' inputs came back
    assert all(not alive for _, alive in alive_after), alive_after


def test_adamw8bit_keeps_no_fp32_moments_on_the_host():
    """The layer states allocated (and zeroed) fp32 moments that the 8-bit path never used: 8 B per
    parameter of host memory no plan counted, more than the 8-bit states saved (review: 17.2 B per
    parameter of RSS for 8-bit against 16.4 for fp32 AdamW)."""
    pytest.importorskip("lazytrain.optim.adamw8bit")
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="host")
    host = {}
    for opt in ("adamw", "adamw8bit"):
        ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu", optimizer=opt, lr=1e-3)
        ex.train_step(random_batches(1, seed=0))
        moments = [k for k in ex.host.bufs if k.endswith((".exp_avg", ".exp_avg_sq"))]
        assert bool(moments) is (opt == "adamw"), moments
        host[opt] = sum(b.numel() for b in ex.host.bufs.values())
        if opt == "adamw8bit":
            host[opt] += sum(t.nbytes for o in ex.opt8.values() for s in o.state.values()
                             for t in s.values() if torch.is_tensor(t))
        ex.close()
    assert host["adamw8bit"] < host["adamw"] * 0.75, host


def test_adamw8bit_checkpoint_before_any_update_resumes(tmp_path):
    """A checkpoint written while every step so far was skipped (a non-finite norm, an fp16 overflow)
    holds no 8-bit state yet: it was refused as 'saved with optimizer=adamw?'."""
    pytest.importorskip("lazytrain.optim.adamw8bit")
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="host")
    kw = dict(device="cpu", optimizer="adamw8bit", lr=3e-3, max_grad_norm=1.0)
    a = StreamingExecutor(copy.deepcopy(model), plan, **kw)
    ids, labels = random_batches(1, seed=0)[0]
    st = a.states[1]
    orig = st.accumulate

    def poisoned(grads, *args, **kwargs):   # one non-finite gradient: the step is skipped
        grads = [g if g is None else torch.full_like(g, float("inf")) for g in grads]
        return orig(grads, *args, **kwargs)

    st.accumulate = poisoned
    assert a.train_step([(ids, labels)]).skipped
    st.accumulate = orig
    save_file(a.state_dict(), tmp_path / "state.safetensors")
    cont = [a.train_step(random_batches(2, seed=s)).loss for s in range(1, 4)]
    b = StreamingExecutor(copy.deepcopy(model), plan, **kw)
    b.load_state_dict(load_file(tmp_path / "state.safetensors"))
    assert [b.train_step(random_batches(2, seed=s)).loss for s in range(1, 4)] == cont
    a.close()
    b.close()
