"""Session 25: HF gradient checkpointing left on a model handed to the executor."""

import copy

import pytest
import torch

from lazytrain.runtime.executor import StreamingExecutor
from lazytrain.runtime.testing import hand_plan, random_batches, tiny_model


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_is_turned_off_with_a_warning_and_the_step_is_exact(reentrant):
    """use_reentrant=True passed the constructor and died in the first step with torch's raw
    RuntimeError; False recomputed inside the plan's recompute, unsaid (review)."""
    m = tiny_model("llama")
    m.train()
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    ref = copy.deepcopy(m)
    ref.activation_checkpointing_disable()
    batch = random_batches(1, seed=1)
    ids, labels = batch[0]
    loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    with pytest.warns(UserWarning, match="had Hugging Face gradient checkpointing on: turned off"):
        ex = StreamingExecutor(m, hand_plan(3), device="cpu", lr=1e-3)
    try:
        assert not m.is_activation_checkpointing
        res = ex.train_step(batch)
        assert res.loss == pytest.approx(loss.item(), rel=1e-6)
    finally:
        ex.close()


def test_nvme_activation_staging_is_bounded_to_two_layers(tmp_path, monkeypatch):
    """Each saved tensor bound for NVMe was copied into a host buffer and its write queued with
    nothing waiting for it until backward: on a drive slower than compute a whole step's NVMe
    activations could sit on the host, uncounted (review: 45-110% over the planned host peak).
    Now layer i's staging waits for the writes of layers up to i - 2 (NVME_ACT_STAGING_LAYERS)."""
    import sys
    import threading
    import time
    import weakref
    from collections import defaultdict

    import lazytrain.runtime.activations as acts
    from lazytrain.costmodel import NVME_ACT_STAGING_LAYERS
    from lazytrain.storage.aligned_io import DirectFile

    live, peak, per_layer = [0], [0], defaultdict(int)
    lock = threading.Lock()
    orig = acts.aligned_empty

    def tracked(nb, *a, **k):
        t = orig(nb, *a, **k)
        frame = sys._getframe(1)
        if frame.f_code.co_name == "_copy_off":   # the write side's staging (host memory)
            with lock:
                live[0] += t.nbytes
                peak[0] = max(peak[0], live[0])
                per_layer[frame.f_locals["layer"]] += t.nbytes

            def gone(n=t.nbytes):
                with lock:
                    live[0] -= n
            weakref.finalize(t, gone)
        return t

    slow_write = DirectFile.write_from

    def slow(self, *a, **k):   # a drive much slower than this toy model's compute
        time.sleep(0.02)
        return slow_write(self, *a, **k)

    monkeypatch.setattr(acts, "aligned_empty", tracked)
    monkeypatch.setattr(DirectFile, "write_from", slow)
    m = tiny_model("llama", num_hidden_layers=4)
    m.train()
    ref = copy.deepcopy(m)
    ids, labels = random_batches(1, seed=2)[0]
    ref(input_ids=ids, labels=labels).loss.backward()
    ex = StreamingExecutor(m, hand_plan(4, activation_tier="nvme"), device="cpu", nvme_dir=str(tmp_path), lr=1e-3)
    try:
        ex.train_step([(ids, labels)])
    finally:
        ex.close()
    largest = max(per_layer.values())
    assert len(per_layer) >= 4 and peak[0] <= NVME_ACT_STAGING_LAYERS * largest, (peak[0], dict(per_layer))
    # (unbounded, the slow writes let every layer's staging pile up)
    assert sum(per_layer.values()) > NVME_ACT_STAGING_LAYERS * largest


def test_the_planned_host_peak_counts_the_nvme_activation_staging():
    from lazytrain.costmodel import NVME_ACT_STAGING_LAYERS, job_costs
    from lazytrain.plan.assignment import Assignment, Segment
    from lazytrain.plan.simulate import memory_peaks
    from lazytrain.spec import JobSpec, ModelSpec

    model = ModelSpec.from_hf_config(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          vocab_size=256))
    from lazytrain.runtime.testing import hardware_for_tests

    costs = job_costs(model, hardware_for_tests(), JobSpec(batch_size=2, seq_len=64))
    n = 5

    def host(tier):
        segs = tuple(Segment(j, j + 1, "store", tier) for j in range(3))
        a = Assignment(segments=segs, param_tier=("device",) * n, grad_tier=("host",) * n,
                       optimizer_tier=("host",) * n)
        return memory_peaks(costs, a, 2)[0]["host"]

    largest = max(Segment(j, j + 1, "store", "nvme").kept_bytes(costs) for j in range(3))
    assert host("nvme") - host("device") == NVME_ACT_STAGING_LAYERS * largest > 0
