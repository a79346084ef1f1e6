"""The experts kernels read the cache pool in place where their arithmetic allows (grouped_mm,
batched_mm: no gathered copy of the routed experts, which doubled the expert memory of a prefill
that routes to every cached expert) and stay token- and bit-identical to the all-resident model
with every kernel, including top-k > 2, where the order of a token's sum over its experts matters."""

import json

import pytest
import torch

from lazytrain.moe import convert_model, load_streamed


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_each_kernel_exact_and_in_place(impl, tiny_moe, tmp_path):
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
        with torch.no_grad():
            got = eng.model(ids).logits
        assert torch.equal(got, want)
        assert eng.generate(prompt, 12).tolist() == want_gen.tolist()
        pool = eng.cache.pool.untyped_storage().data_ptr()
        assert seen
        for proxy in seen:
            in_pool = proxy.down_proj.untyped_storage().data_ptr() == pool
            assert in_pool == (impl != "eager")
            assert proxy.num_experts == (eng.cache.num_slots if impl != "eager" else proxy.down_proj.shape[0])
    finally:
        eng.close()
