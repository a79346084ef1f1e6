"""Greedy generation with streamed experts is token-identical to the all-resident HF model,
whatever the cache size, eviction policy or prefetcher (prediction only decides what to load)."""

import pytest
import torch

from lazytrain.moe import convert_model, load_streamed
from lazytrain.moe.predictor import PredictorHeads


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, n), generator=g) for n in (5, 11)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def model_and_store(request, tiny_moe, tmp_path_factory):
    model = tiny_moe(request.param)
    d = tmp_path_factory.mktemp(request.param)
    convert_model(model, d / "store")
    refs = [model.generate(p, max_new_tokens=24, do_sample=False) for p in _prompts()]
    return model, d / "store", refs


@pytest.mark.parametrize("opts", [
    dict(cache_slots=8, prefetch="none", eviction="lru"),             # the minimum: one layer
    dict(cache_fraction=0.45, prefetch="gate", eviction="lru", lookahead="auto"),
    dict(cache_fraction=0.25, prefetch="gate", eviction="forecast", lookahead=2),
    dict(cache_fraction=0.45, prefetch="predictor", eviction="lfu"),
    dict(cache_fraction=1.0, prefetch="gate", eviction="lru"),
    dict(cache_fraction=0.25, prefetch="gate", eviction="lru", host_cache_fraction=0.4),   # host tier
])
def test_greedy_token_identical(model_and_store, opts, tmp_path):
    model, store, refs = model_and_store
    if opts["prefetch"] == "predictor":
        from lazytrain.moe.arch import find_moe_layers

        heads = PredictorHeads(model.config.hidden_size, [ml.num_experts for ml in find_moe_layers(model)])
        torch.manual_seed(3)
        for h in heads.heads:            # a random (bad) predictor must not change the output
            torch.nn.init.normal_(h[2].weight, std=1.0)
        opts = dict(opts, predictor_path=heads.save(tmp_path / "p.safetensors"))
    eng = load_streamed(store, **opts)
    try:
        for p, ref in zip(_prompts(), refs):
            out = eng.generate(p, 24)
            assert out.tolist() == ref.tolist()
        s = eng.stats()
        assert s.tokens == 2 * 23 and 0.0 <= s.hit_rate <= 1.0
        if opts.get("cache_fraction") == 1.0:
            # every expert is read at most once when all fit: nothing is ever evicted
            assert eng.cache.counters.reads <= eng.total_experts and s.extra["late"] + s.extra["misses"] \
                <= eng.total_experts
        if opts["prefetch"] != "none" and opts.get("cache_fraction", 0) < 1.0:
            assert s.extra["prefetch_issued"] > 0
        if opts.get("host_cache_fraction"):
            assert s.host_cache_slots == round(0.4 * eng.total_experts)
            assert s.extra["host_hits"] + s.extra["host_prefetches"] > 0
    finally:
        eng.close()


def test_logits_match_all_resident(model_and_store):
    model, store, _ = model_and_store
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    eng = load_streamed(store, cache_fraction=0.3)
    try:
        with torch.no_grad():
            got = eng.model(ids).logits
            want = model(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_other_moe_families(kind, tiny_moe, tmp_path):
    model = tiny_moe(kind)
    convert_model(model, tmp_path / "s")
    p = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    ref = model.generate(p, max_new_tokens=12, do_sample=False)
    eng = load_streamed(tmp_path / "s", cache_fraction=0.4, prefetch="gate")
    try:
        assert eng.generate(p, 12).tolist() == ref.tolist()
    finally:
        eng.close()


def test_no_expert_weights_in_memory(mixtral_store):
    _, d = mixtral_store
    eng = load_streamed(d / "store", cache_fraction=0.25)
    try:
        for ml in eng.layers:
            assert all(p.numel() == 0 for p in ml.experts.parameters())
        assert eng.cache.pool.numel() == eng.cache.num_slots * eng.cache.slot_bytes
        assert eng.cache.num_slots == 8          # 25% of 32 experts
    finally:
        eng.close()
