"""Fixes from the session-21 review of the executor's memory accounting."""

import copy
import dataclasses

import pytest
import torch

from lazytrain.runtime import accountant as acc_mod
from lazytrain.runtime.accountant import DeviceBudgetExceeded
from lazytrain.runtime.executor import StreamingExecutor
from lazytrain.runtime.testing import hand_plan, random_batches, tiny_model
from lazytrain.spec import JobSpec


@pytest.mark.parametrize("name,kind,kw", [
    ("acts_host", "grads", {"activation_tier": "host"}),
    ("params_host", "params_streamed", {"param_tier": "host", "prefetch_depth": 3}),
    ("recompute", "boundary", {"segments": [(1, 4)]}),
])
def test_a_placement_over_the_budget_leaves_nothing_counted(name, kind, kw, monkeypatch):
    """The accountant counted a placement, then raised, and its callers never took it back: a
    whole layer's gradients (or a streamed buffer, or a boundary) stayed counted in every later
    step and after close(); a later batch-1 step reported a peak 131 KB above a fresh executor's
    (review). The budget is set 1 byte short of the last placement of `kind` that sets a new high."""
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, vocab_size=1024, num_hidden_layers=4,
                       dtype="bfloat16")
    mb2 = random_batches(1, seed=0, batch=2, seq=32, vocab=1024)
    mb1 = random_batches(1, seed=0, batch=1, seq=32, vocab=1024)
    plan = hand_plan(4, job=JobSpec(batch_size=2, seq_len=32), **kw)
    events = []
    orig = acc_mod.MemoryAccountant.alloc

    def alloc(self, nb, k):
        orig(self, nb, k)
        events.append((k, self.live_bytes))
    monkeypatch.setattr(acc_mod.MemoryAccountant, "alloc", alloc)
    ex = StreamingExecutor(copy.deepcopy(model), plan, device="cpu")
    n0 = len(events)
    ex.train_step(mb2)
    ex.close()
    monkeypatch.setattr(acc_mod.MemoryAccountant, "alloc", orig)
    high, budget = max(live for _, live in events[:n0]), None
    for k, live in events[n0:]:
        if k == kind and live > high:
            budget = live - 1
        high = max(high, live)
    assert budget is not None
    small = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, device_memory_gib=budget / 2**30))
    def batch1_peak(ex):
        try:
            return ex.train_step(mb1).device_peak_bytes
        except DeviceBudgetExceeded:   # (this budget is too small for batch 1 too)
            return None
    fresh = StreamingExecutor(copy.deepcopy(model), small, device="cpu")
    fresh_peak = batch1_peak(fresh)
    fresh.close()
    ex = StreamingExecutor(copy.deepcopy(model), small, device="cpu")
    for _ in range(2):
        with pytest.raises(DeviceBudgetExceeded):
            ex.train_step(mb2)
    assert ex.acct.by_kind["grads"] == 0 and ex.acct.by_kind["boundary"] == 0
    assert batch1_peak(ex) == fresh_peak
    assert (fresh_peak is None) == (name != "acts_host")
    ex.close()
    # (close() releases the device-tier weights counted at construction too, since session 22)
    assert ex.acct.live_bytes == 0 and min(ex.acct.by_kind.values(), default=0) >= 0
