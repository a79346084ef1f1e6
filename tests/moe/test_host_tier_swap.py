"""A full host tier serving a device miss swaps: the wanted expert leaves its host slot, the device
victim takes it, and no expert drops back to NVMe-only (review, 2026-12-02)."""

import torch

from lazytrain.moe import ExpertCache, ExpertStore, generate, load_streamed
from lazytrain.moe.policies import LRU
from lazytrain.moe.stats import MoeCounters


def _record(st: ExpertStore, layer: int, expert: int) -> bytes:
    lr = st.layers[layer]
    with open(st.dir / lr.file, "rb") as f:
        f.seek(expert * lr.record_bytes)
        return f.read(lr.record_bytes)


def test_full_host_tier_swaps_instead_of_dropping(mixtral_store):
    _, d = mixtral_store
    st = ExpertStore(d / "store")
    cache = ExpertCache(st, 8, LRU(), host_slots=2)
    try:
        c = MoeCounters()
        for step, e in enumerate(range(8)):                   # device: layer 0's experts 0..7
            cache.wait(cache.acquire(0, [e], step, c), c)
            cache.unpin()
        for step, e in enumerate([0, 1], start=8):            # (0, 0), (0, 1) spill: host full
            cache.wait(cache.acquire(1, [e], step, c), c)
            cache.unpin()
        assert set(cache.host.slot_of) == {(0, 0), (0, 1)} and not cache.host.free
        reads = cache.counters.reads
        assert cache.acquire(0, [0], 10, c) == []              # host hit; device victim (0, 2)
        cache.unpin()
        assert cache.counters.reads == reads and c.host_hits == 1
        assert cache.host.dropped == 0                         # (0, 1) kept: it was 1 before
        assert set(cache.host.slot_of) == {(0, 1), (0, 2)} and (0, 0) not in cache.host
        for k in [(0, 1), (0, 2)]:
            assert cache.host.pool[cache.host.slot_of[k]].numpy().tobytes() == _record(st, *k)
        assert cache.pool[cache.slot_of[(0, 0)]].numpy().tobytes() == _record(st, 0, 0)
        # and through the prefetch path: (0, 1) from the full host tier, victim (0, 3)
        cache.prefetch(0, [1], deadline=20, now=11, c=c)
        assert c.host_prefetches == 1 and cache.host.dropped == 0
        assert set(cache.host.slot_of) == {(0, 2), (0, 3)}
        assert cache.pool[cache.slot_of[(0, 1)]].numpy().tobytes() == _record(st, 0, 1)
        assert cache.host.pool[cache.host.slot_of[(0, 3)]].numpy().tobytes() == _record(st, 0, 3)
    finally:
        cache.close()
        st.close()


def test_device_plus_host_slots_holding_every_expert_read_each_once(mixtral_store):
    model, d = mixtral_store
    prompt = [int(x) for x in torch.randint(3, 120, (120,), generator=torch.Generator().manual_seed(0))]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    eng = load_streamed(d / "store", cache_slots=8, host_cache_slots=eng_rest(d), prefetch="none")
    try:
        res = generate(d / "store", prompt_ids=prompt, max_new_tokens=24, engine=eng)
        assert res.token_ids == ref
        # once read, every expert stays in a device or a host slot: none is read twice
        read = res.prefill_stats.extra["bytes_read"] + res.stats.extra["bytes_read"]
        assert eng.cache.host.dropped == 0 and read <= eng_rest(d, 0) * eng.cache.slot_bytes
    finally:
        eng.close()


def eng_rest(d, device_slots: int = 8) -> int:
    st = ExpertStore(d / "store")
    try:
        return sum(lr.num_experts for lr in st.layers) - device_slots
    finally:
        st.close()
