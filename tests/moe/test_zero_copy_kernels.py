"""The experts kernels read the cache pool in place where their arithmetic allows (grouped_mm,
batched_mm: no gathered copy of the routed experts, which doubled the expert memory of a prefill
that routes to every cached expert) and stay token- and bit-identical to the all-resident model
with every kernel, including top-k > 2, where the order of a token's sum over its experts matters."""

import json

import pytest
import torch

from lazytrain.moe import convert_model, load_streamed


@pytest.mark.parametrize("impl,in_place", [("grouped_mm", True), ("grouped_mm", False), ("batched_mm", True),
                                           ("eager", False)])
def test_each_kernel_exact_and_in_place(impl, in_place, tiny_moe, tmp_path):
    model = tiny_moe("qwen3_moe", num_experts_per_tok=4)
    convert_model(model, tmp_path / "store")
    model.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["experts_implementation"] = impl
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    model.set_experts_implementation(impl)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    prompt = ids[:1, :6]
    with torch.no_grad():
        want = model(ids).logits
    want_gen = model.generate(prompt, max_new_tokens=12, do_sample=False)

    eng = load_streamed(tmp_path / "store", model_path=tmp_path / "hf", cache_fraction=0.5)
    try:
        assert eng.base_name == impl and eng.zero_copy == (impl != "eager")
        seen = []
        base = eng._base

        def spy(proxy, *args):
            seen.append(proxy)
            return base(proxy, *args)

        eng._base = spy
        # which way grouped_mm goes is set here (the rule is test_grouped_mm_gathers_...'s): in place,
        # or the gathered copies (also exact)
        eng.slot_overhead_bytes = 0
        eng.zero_copy = eng.zero_copy and in_place
        with torch.no_grad():
            got = eng.model(ids).logits
        assert torch.equal(got, want)
        assert eng.generate(prompt, 12).tolist() == want_gen.tolist()
        pool = eng.cache.pool.untyped_storage().data_ptr()
        assert seen
        for proxy in seen:
            in_pool = proxy.down_proj.untyped_storage().data_ptr() == pool
            assert in_pool == in_place
            assert proxy.num_experts == proxy.down_proj.shape[0]
    finally:
        eng.close()


def test_grouped_mm_gathers_a_span_of_mostly_other_slots(mixtral_store):
    """grouped_mm visits every slot of the views it gets: two routed experts far apart in a big
    cache are gathered, adjacent ones (or a span they mostly fill) are read in place."""
    _, d = mixtral_store
    eng = load_streamed(d / "store", cache_fraction=1.0)
    try:
        assert eng.base_name == "grouped_mm"
        experts = eng.layers[0].experts
        pool = eng.cache.pool.untyped_storage().data_ptr()
        n = eng.cache.num_slots
        eng.slot_overhead_bytes = eng.cache.slot_bytes // 4      # one routed slot's copy pays for 4 others
        for slots, in_place in (([3, 4], True), ([0, 11], False), ([0, 9], True), ([0, n - 1], False)):
            proxy, ids = eng._proxy(experts, 0, slots)
            assert (proxy.down_proj.untyped_storage().data_ptr() == pool) == in_place, slots
            assert proxy.num_experts == proxy.down_proj.shape[0]
            # the remapped ids address the same bytes (slots never filled hold garbage, NaNs too)
            for s, i in zip(slots, ids):
                assert torch.equal(proxy.down_proj[i].view(torch.int32),
                                   eng.cache.layer_views(0)["down_proj"][s].view(torch.int32))
    finally:
        eng.close()
