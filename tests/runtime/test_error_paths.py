"""A train_step that raises leaves nothing behind: the next steps run, count and train exactly as
if the failed one had never been tried (a failed gradient accumulation, a malformed micro-batch,
an exception inside a micro-batch's forward)."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.models import apply_lora
from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import (hand_plan, plan_families, random_batches, reference_training, rel_err,
                                      tiny_model)

REL = 1e-5
LR, WD, CLIP = 3e-3, 0.01, 0.5


def executor(model, tmp_path, plan_name="all_resident", **kw):
    kw.setdefault("lr", LR)
    kw.setdefault("weight_decay", WD)
    return StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)[plan_name]), device="cpu",
                             nvme_dir=tmp_path, betas=(0.9, 0.95), **kw)


def fail_accumulation_once(st, at: int = 1):
    """Make `st.accumulate` raise OSError on its `at`-th call (a transient NVMe write error)."""
    orig, calls = st.accumulate, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == at:
            raise OSError(28, "simulated: No space left on device")
        return orig(*a, **k)
    st.accumulate = flaky


def bad_labels(mbs):
    """The same micro-batches, the last one with a label id outside the vocabulary: the head's
    cross-entropy raises, after the earlier micro-batches ran whole."""
    ids, labels = mbs[-1]
    labels = labels.clone()
    labels[0, 5] = 10_000
    return [*mbs[:-1], (ids, labels)]


def counted(ex) -> dict[str, int]:
    """The accountant's live bytes by kind, less the streamer's weight buffers (a cache, whose
    size depends on where the last micro-batch stopped)."""
    return {k: v for k, v in ex.acct.by_kind.items() if v and k != "params_streamed"}


def assert_trains_like_reference(ex, model, steps, losses, max_norm):
    ref, ref_losses = reference_training(model, steps, LR, WD, max_norm, seed=100)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= REL
    got = ex.trainable_state()
    assert max(rel_err(got[n], p.detach()) for n, p in ref.named_parameters()) <= REL


def test_failed_accumulation_does_not_fail_later_steps(tmp_path):
    """Bug 1: the failed future stayed in the pending list and every later step re-raised it."""
    model = tiny_model("llama")
    ex = executor(model, tmp_path, max_grad_norm=CLIP)
    fail_accumulation_once(ex.states[2])
    good = random_batches(2, seed=100)
    with pytest.raises(OSError):
        ex.train_step(good)
    assert not ex._pending and not ex._grads_inflight
    assert all(int(st.step) == 0 for st in ex.states if st is not None)   # (clipping: nothing updated)
    losses = [ex.train_step(good).loss for _ in range(3)]
    assert ex.step_count == 3
    assert_trains_like_reference(ex, model, 3, losses, CLIP)
    ex.close()


@pytest.mark.parametrize("fail_at", [1, 3])   # first step's only accumulation / a later step's
def test_no_update_from_a_failed_accumulation(fail_at, tmp_path):
    """Bug 2: without clipping the layer's update ran behind its failed accumulation."""
    model = tiny_model("llama")
    ex = executor(model, tmp_path, lr=1e-3)
    st = ex.states[2]   # block.1
    fail_accumulation_once(st, at=fail_at)
    for k in range(fail_at - 1):
        ex.train_step(random_batches(1, seed=k))
    before = {n: v.clone() for n, v in ex.trainable_state().items() if "layers.1." in n}
    step_before = int(st.step)
    with pytest.raises(OSError):
        ex.train_step(random_batches(1, seed=9))
    after = ex.trainable_state()
    assert int(st.step) == step_before
    assert all(torch.equal(after[n], v) for n, v in before.items())
    ex.train_step(random_batches(1, seed=10))   # and the next step runs, updating it
    assert int(st.step) == step_before + 1
    ex.close()


def lora_model():
    model = apply_lora(tiny_model("llama"), rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("failure", ["shape", "midstep"])
def test_failed_lora_step_leaves_no_adapter_grads(failure, tmp_path):
    """Bug 3: micro-batch 0's adapter gradients survived a step whose micro-batch 1 was malformed
    (shapes were checked only when it came up) or raised, and were added into the next step's."""
    model = lora_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0, fused=True)
    ex = StreamingExecutor(copy.deepcopy(model), hand_plan(3, param_tier="host"), device="cpu", lr=1e-2)
    good = random_batches(2, seed=0)
    if failure == "shape":
        bad, err = [good[0], (good[1][0], good[1][1][:, :-1])], ValueError
    else:
        bad, err = bad_labels(good), IndexError
    live0 = counted(ex)
    with pytest.raises(err):
        ex.train_step(bad)
    assert not ex.adapter_grads and all(p.grad is None for p in ex.adapter_params)
    assert counted(ex) == live0
    for _ in range(2):
        ex.train_step(good)
        for ids, labels in good:
            (ref(input_ids=ids, labels=labels).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    got = ex.trainable_state()
    want = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert max(rel_err(got[n], want[n]) for n in want) <= REL
    ex.close()


@pytest.mark.parametrize("plan_name", ["acts_host", "acts_nvme", "mixed_segments", "params_nvme"])
def test_exception_inside_a_micro_batch_leaks_nothing(plan_name, tmp_path):
    """Bug 4: a micro-batch raising in the head left step_context/live_boundary counted and the
    activation records of the layers before it, which the next step's backward fetched too."""
    model = tiny_model("llama")
    good = random_batches(2, seed=100)
    control = executor(model, tmp_path, plan_name, max_grad_norm=CLIP)
    control.train_step(good)
    control_peak = control.train_step(good).accounted_peak_bytes
    control.close()

    ex = executor(model, tmp_path, plan_name, max_grad_norm=CLIP)
    losses = [ex.train_step(good).loss]
    live = counted(ex)
    for _ in range(3):
        with pytest.raises(IndexError):
            ex.train_step(bad_labels(good))
        assert counted(ex) == live
        assert not ex.acts.layers and not ex.acts.protected()
    r = ex.train_step(good)
    assert r.accounted_peak_bytes == control_peak
    losses += [r.loss, ex.train_step(good).loss]
    assert counted(ex) == live
    assert_trains_like_reference(ex, model, 3, losses, CLIP)
    ex.close()


def test_partly_frozen_layer_is_refused(tmp_path):
    """Bug 6: a layer with only some parameters frozen crashed mid-step (autograd.grad of a tensor
    that does not require grad); it is refused when the executor is made. Whole frozen layers run."""
    model = tiny_model("llama")
    for n, p in model.named_parameters():
        if "layers.1.self_attn.q_proj" in n:
            p.requires_grad_(False)
    with pytest.raises(ValueError, match="only some of its parameters are frozen"):
        executor(model, tmp_path)
    model = tiny_model("llama")
    for n, p in model.named_parameters():
        if "layers.1." in n:
            p.requires_grad_(False)
    ex = executor(model, tmp_path)
    before = {n: v.clone() for n, v in ex.trainable_state().items() if "layers.1." in n}
    ex.train_step(random_batches(1, seed=0))
    after = ex.trainable_state()
    assert all(torch.equal(after[n], v) for n, v in before.items())
    ex.close()


def test_a_constructor_that_fails_leaves_no_scratch_or_threads(tmp_path):
    """The 8-bit + NVMe-optimizer refusal came after the weights were written to NVMe, and a budget
    refusal while placing weights left the scratch dir, its files, lock and I/O threads until the
    process exited (three tries: three dirs, 2.4 MB)."""
    import threading

    from lazytrain.runtime import DeviceBudgetExceeded
    from lazytrain.runtime.testing import hand_plan, hardware_for_tests, plan_families, tiny_model

    model = tiny_model("llama")
    threads = threading.active_count()
    for _ in range(2):
        with pytest.raises(ValueError, match="adamw8bit keeps its 8-bit states on the host"):
            StreamingExecutor(copy.deepcopy(model), hand_plan(3, **plan_families(3)["params_nvme"]),
                              device="cpu", nvme_dir=tmp_path / "a", optimizer="adamw8bit")
    (tmp_path / "b").mkdir()
    with pytest.raises(DeviceBudgetExceeded):
        StreamingExecutor(copy.deepcopy(model), hand_plan(3, activation_tier="nvme",
                          hardware=hardware_for_tests(device_memory_gib=1e-4)), device="cpu", nvme_dir=tmp_path / "b")
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").iterdir())
    assert not list((tmp_path / "b").iterdir())
    assert threading.active_count() == threads


@pytest.mark.parametrize("tier,dtype,fail_at", [("nvme", torch.float32, "block.1.exp_avg"),
                                                 ("host", torch.float32, "block.1.exp_avg"),
                                                 ("nvme", torch.bfloat16, "block.1.exp_avg"),
                                                 ("mixed", torch.float32, "embed.param"),
                                                 ("mixed", torch.float32, "block.1.exp_avg")])
def test_a_failed_constructor_gives_the_model_back_and_a_closed_ones_model_is_named(tmp_path, monkeypatch,
                                                                                   tier, dtype, fail_at):
    """Review: a full disk while the constructor wrote the initial optimizer state left 10 of 30
    parameters as 0-element tensors (released as each layer was set up); a second executor on the
    model blamed the architecture ("'weight' must be 2-D"). The model now gets its values back, and
    an emptied model (an executor closed without sync_model) is refused saying so."""
    import errno
    import os

    from lazytrain.runtime.testing import hand_plan, tiny_model

    model = tiny_model("llama").to(dtype)
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    real = os.pwritev

    def full_disk(fd, bufs, off, *a):
        if fail_at in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, off, *a)
    monkeypatch.setattr(os, "pwritev", full_disk)
    # (mixed: block.2 on the device, bound to the executor's device buffer from the start: review
    # of the fix, which left it on that buffer, unfilled when the failure came before it)
    plan = hand_plan(3, param_tier="nvme" if tier == "mixed" else tier, grad_tier="nvme", optimizer_tier="nvme",
                     overrides={"block.2": {"param_tier": "device"}} if tier == "mixed" else None)
    with pytest.raises(OSError, match="No space left"):
        StreamingExecutor(model, plan, device="cpu", nvme_dir=tmp_path)
    monkeypatch.setattr(os, "pwritev", real)
    for n, p in model.named_parameters():
        assert p.dtype == dtype and torch.equal(p, orig[n]), n
    ex = StreamingExecutor(model, plan, device="cpu", nvme_dir=tmp_path)   # the retry works
    ex.close()
    if tier != "mixed":   # (every layer released: the model's parameters are empty now)
        with pytest.raises(ValueError, match="closed without sync_model"):
            StreamingExecutor(model, plan, device="cpu", nvme_dir=tmp_path)


def test_a_real_zero_element_parameter_is_not_taken_for_an_emptied_one():
    """Review of the above: the emptied-model refusal looked at the element count alone and refused
    a model with a genuine 0-element parameter, which trained before."""
    from lazytrain.runtime.testing import hand_plan, tiny_model

    model = tiny_model("llama")
    model.model.layers[0].mlp.register_parameter("placeholder", torch.nn.Parameter(torch.empty(0)))
    plan = hand_plan(3, param_tier="host")
    ex = StreamingExecutor(model, plan, device="cpu")
    ex.train_step(random_batches(1, 0))
    ex.sync_model()   # (review: the executor's mark outlived sync_model, and the next one refused it)
    ex.close()
    StreamingExecutor(model, plan, device="cpu").close()


def test_a_state_write_that_fails_while_loading_is_marked_incomplete(tmp_path, monkeypatch):
    """Review: a write that failed inside load_state_dict (store_tensor) left the state file half
    written and unmarked; the next steps trained on it."""
    import errno
    import os

    from lazytrain.runtime.testing import hand_plan, tiny_model

    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3, optimizer_tier="nvme"), device="cpu",
                           nvme_dir=tmp_path)
    mbs = random_batches(1, 0)
    ex.train_step(mbs)
    saved = ex.state_dict()
    real = os.pwritev

    def full_disk(fd, bufs, off, *a):
        if "block.1.exp_avg_sq" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, off, *a)
    monkeypatch.setattr(os, "pwritev", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ex.load_state_dict(saved)
    monkeypatch.setattr(os, "pwritev", real)
    with pytest.raises(OSError, match="block.1.exp_avg_sq on NVMe is incomplete"):
        for _ in range(3):   # (an update's error surfaces at that layer's next use)
            ex.train_step(mbs)
    ex.load_state_dict(saved)   # whole again
    ex.train_step(mbs)
    ex.close()


@pytest.mark.parametrize("key,clip", [("embed.master", 1.0), ("head.exp_avg_sq", None), ("block.1.master", 1.0),
                                      ("embed.param", None), ("block.2.param", 1.0)])
def test_a_failed_nvme_state_write_back_is_not_read_until_restored(tmp_path, monkeypatch, key, clip):
    """Review: an NVMe-tier optimizer state write-back that hit a full disk (half the file new, half
    old) was raised once, and the next step trained on from the half-written master (rel. error
    0.12 against the same updates without the failure). Every read of it raises now until the state
    is stored whole again (a resume), after which training goes on exactly."""
    import errno
    import os

    from lazytrain.runtime.testing import hand_plan, tiny_model

    real, full = os.pwritev, [False]

    def disk(fd, bufs, off, *a):
        if full[0] and key in os.readlink(f"/proc/self/fd/{fd}"):
            mv = bufs[0]
            if len(mv) > 4096:   # a short write of half, then ENOSPC (what a full disk does)
                return real(fd, [mv[: len(mv) // 2]], off, *a)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, off, *a)
    monkeypatch.setattr(os, "pwritev", disk)
    model = tiny_model("llama")
    plan = hand_plan(3, param_tier="nvme", grad_tier="host", optimizer_tier="nvme")
    mbs = random_batches(1, 0)

    def make(d):
        (tmp_path / d).mkdir()
        return StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path / d, lr=1e-2,
                                 max_grad_norm=clip)
    ref = make("ref")
    ex = make("ex")
    ref.train_step(mbs), ex.train_step(mbs)
    saved = ex.state_dict()
    full[0] = True                # the write-back fails (asynchronous: reported at a later step)
    for _ in range(5):
        try:
            ex.train_step(mbs)
        except OSError:
            break
    else:
        pytest.fail("the full disk was never reported")
    full[0] = False               # space freed: the file is still half written
    for _ in range(3):            # every step raises, naming the file (the failed update kept by
        with pytest.raises(OSError, match=key):   # its layer, or the state's incomplete file)
            ex.train_step(mbs)
    ex.load_state_dict(saved)     # a resume from the state after step 1 (review: it raised the
    #                               failed update again, except for embed with clipping)
    for _ in range(2):
        ref.train_step(mbs), ex.train_step(mbs)
    w, r = ex.trainable_state(), ref.trainable_state()
    assert all(torch.equal(w[n], r[n]) for n in w)
    ex.close(), ref.close()
