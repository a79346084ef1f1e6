from contextlib import contextmanager

import pytest
import torch

from lazytrain.moe import CacheTooSmallError, ExpertCache, ExpertStore, load_streamed
from lazytrain.moe.policies import LFU, LRU, Belady, Forecast, make_policy
from lazytrain.moe.stats import MoeCounters


@contextmanager
def lru_cache_on(store_dir, slots):
    """An LRU ExpertCache with `slots` device slots over the store in `store_dir`, closed after."""
    st = ExpertStore(store_dir)
    cache = ExpertCache(st, slots, LRU())
    try:
        yield cache
    finally:
        cache.close()
        st.close()


def test_lru_evicts_least_recent():
    p = LRU()
    for t, k in enumerate([(0, 1), (0, 2), (0, 3), (0, 1)]):
        p.touch(k, t)
    assert p.victim([(0, 1), (0, 2), (0, 3)], 4) == (0, 2)


def test_lfu_evicts_least_frequent():
    p = LFU()
    for t, k in enumerate([(0, 1), (0, 1), (0, 2), (0, 3), (0, 3)]):
        p.touch(k, t)
    assert p.victim([(0, 1), (0, 2), (0, 3)], 5) == (0, 2)


def test_belady_evicts_furthest_next_use():
    future = [(0, (1, 2)), (1, (0,)), (0, (2,)), (1, (5,)), (0, (1,))]
    p = Belady(future)
    # at step 2: (0,2) used at 2, (1,5) at 3, (0,1) at 4, (1,0) never again
    assert p.victim([(0, 2), (1, 5), (0, 1), (1, 0)], 2) == (1, 0)
    assert p.victim([(0, 2), (1, 5), (0, 1)], 2) == (0, 1)


def test_forecast_prefers_predicted_and_popular():
    p = Forecast(num_layers=4)
    for _ in range(50):
        p.observe_layer(2, [3], num_experts=8)      # expert 3 of layer 2: always used
    p.predict((1, 6), 5)                            # predicted for the very next step
    cands = [(2, 3), (2, 4), (1, 6)]
    assert p.victim(cands, 4) == (2, 4)
    assert p._distance((1, 6), 4) < p._distance((2, 3), 4) < p._distance((2, 4), 4)


def test_unknown_policy():
    with pytest.raises(ValueError, match="valid: lru, lfu, forecast"):
        make_policy("fifo", 4)


def test_cache_too_small_says_minimum(mixtral_store):
    _, d = mixtral_store
    st = ExpertStore(d / "store")
    try:
        with pytest.raises(CacheTooSmallError, match="minimum is 8 slots"):
            ExpertCache(st, 5, LRU())
    finally:
        st.close()
    with pytest.raises(CacheTooSmallError, match="moe.cache_slots>=8"):
        load_streamed(d / "store", cache_slots=5)


def test_small_cache_fraction_is_raised_to_the_minimum(mixtral_store, caplog):
    """A share is approximate: below one layer's experts (0.1 of 32 = 3 slots; a model with one or
    two MoE layers at the default 0.45) it becomes the minimum, said once, instead of an error."""
    _, d = mixtral_store
    with caplog.at_level("WARNING", logger="lazytrain.moe.engine"):
        m = load_streamed(d / "store", cache_fraction=0.1, prefetch="none")
    try:
        assert m.cache.num_slots == 8
        assert "moe.cache_fraction=0.1 gives 3 of 32 experts" in caplog.text
        m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    finally:
        m.close()


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, float("nan"), "lots"])
def test_bad_cache_fraction_names_the_setting(mixtral_store, fraction):
    _, d = mixtral_store
    with pytest.raises(ValueError, match="moe.cache_fraction must be"):
        load_streamed(d / "store", cache_fraction=fraction)


def test_demand_hits_and_reads(mixtral_store):
    _, d = mixtral_store
    with lru_cache_on(d / "store", 10) as cache:
        c = MoeCounters()
        cache.wait(cache.acquire(0, [1, 2], 0, c), c)
        cache.unpin()
        cache.wait(cache.acquire(0, [2, 3], 1, c), c)
        cache.unpin()
        assert (c.demand, c.hits, c.misses) == (4, 1, 3)
        assert cache.counters.reads == 3 and cache.counters.bytes_read == 3 * cache.store.record_bytes
        # the slot holds exactly the record on disk
        st = cache.store
        lr = st.layers[0]
        with open(st.dir / lr.file, "rb") as f:
            f.seek(3 * lr.record_bytes)
            want = f.read(lr.record_bytes)
        assert bytes(cache.pool[cache.slot_of[(0, 3)]].numpy().tobytes()) == want
        # prefetch then demand: counted as used prefetch (hit or late), precision bookkeeping
        cache.prefetch(1, [4, 5], deadline=3, now=2, c=c)
        assert c.prefetch_issued == 2
        cache.wait(cache.acquire(1, [4], 3, c), c)
        cache.unpin()
        assert c.prefetch_used == 1 and c.misses == 3
        views = cache.layer_views(1)
        assert views["gate_up_proj"].shape[0] == 10


def test_lru_fills_then_evicts_in_order(mixtral_store):
    _, d = mixtral_store
    with lru_cache_on(d / "store", 8) as cache:
        c = MoeCounters()
        for step, e in enumerate(range(8)):
            cache.wait(cache.acquire(0, [e], step, c), c)
            cache.unpin()
        cache.wait(cache.acquire(1, [0], 8, c), c)       # evicts the LRU: (0, 0)
        cache.unpin()
        assert (0, 0) not in cache.slot_of and (0, 1) in cache.slot_of and (1, 0) in cache.slot_of


def test_reads_are_served_in_deadline_order_with_a_bounded_queue(mixtral_store):
    import threading

    _, d = mixtral_store
    st = ExpertStore(d / "store")
    order, gate = [], threading.Event()
    real = st.read_into

    def slow_read(layer, expert, buf):
        if not order:
            gate.wait(5)                 # hold the only I/O thread so the queue fills up
        order.append((layer, expert))
        return real(layer, expert, buf)

    st.read_into = slow_read
    cache = ExpertCache(st, 16, LRU(), io_workers=1, queue_depth=4)
    try:
        c = MoeCounters()
        cache.prefetch(0, [0], deadline=1, now=0, c=c)        # taken by the worker, blocked
        import time
        while not order and cache.pending[(0, 0)].state != "reading":
            time.sleep(0.001)
        cache.prefetch(3, [1], deadline=9, now=0, c=c)
        cache.prefetch(1, [2], deadline=5, now=0, c=c)
        cache.prefetch(2, [3], deadline=7, now=0, c=c)
        cache.prefetch(2, [4], deadline=8, now=0, c=c)        # over queue_depth=4: dropped
        assert c.prefetch_issued == 4 and c.prefetch_dropped == 1
        reqs = list(cache.pending.values())
        gate.set()
        for r in reqs:
            assert r.event.wait(5)
        assert order == [(0, 0), (1, 2), (2, 3), (3, 1)]      # earliest deadline first
        # a demand for a queued prefetch promotes it ahead of earlier-deadline prefetches
        order.clear()
        gate.clear()
        cache.prefetch(0, [5], deadline=20, now=10, c=c)      # blocks the worker again
        while not order and cache.pending[(0, 5)].state != "reading":
            time.sleep(0.001)
        cache.prefetch(1, [6], deadline=21, now=10, c=c)
        cache.prefetch(3, [7], deadline=23, now=10, c=c)
        waits = cache.acquire(3, [7], 11, c)
        gate.set()
        cache.wait(waits, c)
        assert order[:2] == [(0, 5), (3, 7)] and c.late == 1
    finally:
        gate.set()
        cache.close()
        st.close()


def test_a_prefetch_never_evicts_one_needed_sooner(mixtral_store):
    """Host-tier prefetches are instant and not bounded by queue_depth: with a tiny cache, later
    layers' prefetches evicted earlier layers' (hit rate 0.51 -> 0.23 with 8 device + 8 host slots,
    lookahead 3). A prefetch may only take the slot of one due later (or not prefetched at all);
    a demand may take any unpinned slot."""
    _, d = mixtral_store
    st = ExpertStore(d / "store")
    cache = ExpertCache(st, 8, LRU(), io_workers=1, host_slots=8)
    c = MoeCounters()
    try:
        cache.wait(cache.acquire(0, list(range(8)), 0, c), c)       # fills the 8 slots
        cache.unpin()
        cache.prefetch(2, list(range(8)), deadline=2, now=0, c=c)   # evicts layer 0 (not prefetched)
        cache.wait([r for r in cache.pending.values()], c)
        assert {k[0] for k in cache.slot_of} == {2} and len(cache.prefetched) == 8
        cache.wait(cache.acquire(1, [0, 1], 1, c), c)               # a demand takes two of them
        cache.unpin()
        # due 3: it may take layer 1's two used slots, not the six prefetched for layer 2 (due 2)
        cache.prefetch(3, [0, 1, 2], deadline=3, now=1, c=c)
        cache.wait([r for r in cache.pending.values()], c)
        layers = [k[0] for k in cache.slot_of]
        assert layers.count(3) == 2 and layers.count(2) == 6 and c.prefetch_dropped == 1
        cache.prefetch(1, [2], deadline=1, now=1, c=c)             # due sooner: may take one
        layers = [k[0] for k in cache.slot_of]
        assert (1, 2) in cache.slot_of and layers.count(2) + layers.count(3) == 7
    finally:
        cache.close()
        st.close()


def test_a_mispredicted_prefetch_is_evictable_once_its_deadline_passed(mixtral_store):
    _, d = mixtral_store
    st = ExpertStore(d / "store")
    cache = ExpertCache(st, 8, LRU(), io_workers=1)
    c = MoeCounters()
    try:
        cache.prefetch(1, [0, 1, 2, 3], deadline=1, now=0, c=c)
        cache.wait([r for r in cache.pending.values()], c)
        cache.prefetch(2, [0, 1, 2, 3], deadline=2, now=0, c=c)      # fills the other 4
        cache.wait([r for r in cache.pending.values()], c)
        cache.prefetch(3, list(range(8)), deadline=100, now=99, c=c)  # both sets are long past
        assert c.prefetch_dropped == 0 and all(k[0] == 3 for k in cache.slot_of)
    finally:
        cache.close()
        st.close()


def test_a_miss_does_not_evict_an_expert_the_same_call_routes_to(mixtral_store):
    """acquire(0, [0, 1]) with (0, 1) resident and least recent, (0, 0) not: the miss for (0, 0)
    took (0, 1)'s slot (not yet pinned), which was then read from disk again: 0 hits, 2 reads
    (review). Resident routed experts are pinned first: 1 hit, 1 read."""
    _, d = mixtral_store
    st = ExpertStore(d / "store")
    cache = ExpertCache(st, 8, LRU())
    c = MoeCounters()
    try:
        for step, (layer, ids) in enumerate([(0, list(range(8))), (1, [0])]):   # (0,0) evicted, (0,1) oldest
            cache.wait(cache.acquire(layer, ids, step, c), c)
            cache.unpin()
        assert (0, 1) in cache.slot_of and (0, 0) not in cache.slot_of
        reads, hits = cache.counters.reads, c.hits
        cache.wait(cache.acquire(0, [0, 1], 2, c), c)
        assert (c.hits - hits, cache.counters.reads - reads) == (1, 1)
        cache.unpin()
    finally:
        cache.close()
        st.close()
