"""The optional host-RAM tier of the expert cache: exact output, fewer NVMe bytes, off means off,
bad settings give one line."""

import json

import pytest
import torch

from lazytrain.moe import ExpertCache, ExpertStore, generate, load_streamed
from lazytrain.moe.host_tier import HostTier, host_policy_for
from lazytrain.moe.policies import LFU, LRU, Forecast
from lazytrain.moe.stats import MoeCounters

PROMPT = [[7, 3, 88, 21, 5, 64, 100, 2, 9, 45, 17]]


def _record(st: ExpertStore, layer: int, expert: int) -> bytes:
    lr = st.layers[layer]
    with open(st.dir / lr.file, "rb") as f:
        f.seek(expert * lr.record_bytes)
        return f.read(lr.record_bytes)


def test_evicted_expert_comes_back_from_host_without_a_read(mixtral_store):
    _, d = mixtral_store
    st = ExpertStore(d / "store")
    cache = ExpertCache(st, 8, LRU(), host_slots=2)
    try:
        assert cache.host is not None and not cache.host.pinned_memory     # cpu: plain aligned RAM
        c = MoeCounters()
        for step, e in enumerate(range(8)):
            cache.wait(cache.acquire(0, [e], step, c), c)
            cache.unpin()
        cache.wait(cache.acquire(1, [0], 8, c), c)          # evicts (0, 0) from the device -> host
        cache.unpin()
        assert (0, 0) not in cache.slot_of and (0, 0) in cache.host
        reads = cache.counters.reads
        assert cache.acquire(0, [0], 9, c) == []             # host hit: nothing to wait on
        cache.unpin()
        assert cache.counters.reads == reads and c.host_hits == 1 and c.host_bytes == st.record_bytes
        assert (0, 0) not in cache.host and (0, 1) in cache.host   # exclusive; (0, 1) spilled for it
        assert bytes(cache.pool[cache.slot_of[(0, 0)]].numpy().tobytes()) == _record(st, 0, 0)
        # host full (2 slots): the next spill evicts the host tier's LRU entry, (0, 1)
        for step, e in enumerate([2, 3], start=10):
            cache.wait(cache.acquire(2, [e], step, c), c)
            cache.unpin()
        assert (0, 1) not in cache.host and len(cache.host) == 2 and cache.host.dropped >= 1
        # a prefetch of a host-resident expert is served at once, not queued for the disk
        k = next(iter(cache.host.slot_of))
        cache.prefetch(k[0], [k[1]], deadline=20, now=13, c=c)
        assert c.host_prefetches == 1 and c.prefetch_issued == 1 and k in cache.slot_of
        assert k not in cache.pending and bytes(cache.pool[cache.slot_of[k]].numpy().tobytes()) \
            == _record(st, *k)
    finally:
        cache.close()
        st.close()


def test_host_policy_same_kind_as_device():
    assert isinstance(host_policy_for(LRU()), LRU)
    assert isinstance(host_policy_for(LFU()), LFU)
    f = Forecast(4)
    assert host_policy_for(f) is f          # ranks any key from shared state
    t = HostTier(2, 16, LRU())
    for now, k in enumerate([(0, 1), (0, 2), (0, 3)]):
        t.put(k, torch.full((16,), now, dtype=torch.uint8), now)
    assert (0, 1) not in t and (0, 2) in t and (0, 3) in t
    out = torch.empty(16, dtype=torch.uint8)
    assert t.take((0, 3), out) and out.tolist() == [2] * 16 and (0, 3) not in t
    t.put((0, 4), torch.zeros(16, dtype=torch.uint8), 5, keep=(0, 2))
    assert (0, 2) in t and (0, 4) in t


@pytest.mark.parametrize("opts", [dict(prefetch="none", eviction="lru"),
                                  dict(prefetch="gate", eviction="lru"),
                                  dict(prefetch="gate", eviction="forecast", lookahead=2)])
def test_host_tier_exact_and_reads_less(mixtral_store, opts):
    model, d = mixtral_store
    p = torch.tensor(PROMPT)
    ref = model.generate(p, max_new_tokens=24, do_sample=False)
    runs = {}
    for host in (0.0, 0.5):
        eng = load_streamed(d / "store", cache_slots=8, host_cache_fraction=host, **opts)
        try:
            out = eng.generate(p, 24)
            assert out.tolist() == ref.tolist()                      # token-identical
            runs[host] = (eng.cache.counters.bytes_read, eng.stats(), eng.cache.host)
        finally:
            eng.close()
    (b0, s0, h0), (b1, s1, h1) = runs[0.0], runs[0.5]
    assert h0 is None and s0.host_cache_slots == 0
    assert h1 is not None and s1.host_cache_slots == 16               # 50% of 32 experts
    assert s1.extra["host_hits"] + s1.extra["host_prefetches"] > 0 and s1.host_hit_rate > 0
    assert b1 < b0 and s1.bytes_per_token < s0.bytes_per_token
    assert "host 16 slots" in s1.line() and "host" not in s0.line()


def test_host_tier_zero_is_unchanged(mixtral_store):
    """host_cache_fraction=0 (and host_cache_slots=0) is the original cache: same reads, same stats."""
    _, d = mixtral_store
    p = torch.tensor(PROMPT)
    seen = []
    for extra in ({}, dict(host_cache_fraction=0.0), dict(host_cache_slots=0, host_cache_fraction=0.7)):
        eng = load_streamed(d / "store", cache_slots=8, prefetch="none", **extra)
        try:
            out = eng.generate(p, 16).tolist()
            s = eng.stats()
            assert eng.cache.host is None
            seen.append((out, eng.cache.counters.reads, eng.cache.counters.bytes_read, s.hit_rate,
                         s.extra["misses"], s.line().split("| ")[-1]))
            j = s.to_json()
            assert j["host_cache_slots"] == 0 and j["host_hit_rate"] == 0.0 and j["host_hits"] == 0
        finally:
            eng.close()
    assert seen[0] == seen[1] == seen[2]


def test_host_slots_capped_at_the_rest(mixtral_store):
    _, d = mixtral_store
    eng = load_streamed(d / "store", cache_slots=8, host_cache_slots=100, prefetch="none")
    try:
        assert eng.cache.host.num_slots == 32 - 8
    finally:
        eng.close()


@pytest.mark.parametrize("bad, msg", [(dict(host_cache_fraction=-0.1), "must be in \\[0, 1\\]"),
                                      (dict(host_cache_fraction=1.5), "must be in \\[0, 1\\]"),
                                      (dict(host_cache_fraction="lots"), "must be a number"),
                                      (dict(host_cache_slots=-3), "non-negative integer")])
def test_bad_host_config(mixtral_store, bad, msg):
    _, d = mixtral_store
    with pytest.raises(ValueError, match=msg):
        load_streamed(d / "store", **bad)


def test_cli_host_tier_json_and_one_line_error(mixtral_store, capsys):
    from lazytrain.cli import generate as gen_cli

    model, d = mixtral_store
    assert gen_cli.main([f"moe.store={d / 'store'}", "moe.cache_slots=8", "moe.host_cache_fraction=0.5",
                         "prompt_ids=[5,17,3,99]", "max_new_tokens=12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref = model.generate(torch.tensor([[5, 17, 3, 99]]), max_new_tokens=12, do_sample=False)
    assert out["token_ids"] == ref[0, 4:].tolist()
    st = out["stats"]
    assert {"hit_rate", "bytes_per_token", "cache_slots", "host_hit_rate", "host_cache_slots"} <= set(st)
    assert st["host_cache_slots"] == 16 and st["cache_slots"] == 8
    assert gen_cli.main([f"moe.store={d / 'store'}", "moe.host_cache_fraction=-0.2", "prompt_ids=[1]"]) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("lazytrain ")]
    assert len(lines) == 1 and "moe.host_cache_fraction must be in [0, 1]" in lines[0]
    assert "Traceback" not in err


# A full host tier serving a device miss swaps: the wanted expert leaves its host slot, the device
# victim takes it, and no expert drops back to NVMe-only (review, 2026-12-02).
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
