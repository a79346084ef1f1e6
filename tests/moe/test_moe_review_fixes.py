"""Review fixes of the streamed MoE engine: the checkpoint's generation config, a skipped prefetch
never counted as a hit, no leaked I/O threads, use after close, tied embeddings, predictor hidden
size, one-line CLI errors (exit 2) on bad input, a store of other weights than model.path refused, and
prefetch precision at most 100% in every phase."""

import json
import re
import shutil
import threading

import pytest
import torch

from lazytrain.cli import generate as gen_cli
from lazytrain.cli import moe as moe_cli
from lazytrain.moe import (ExpertCache, ExpertStore, StoreMismatchError, convert_checkpoint, convert_model,
                           generate, load_streamed)
from lazytrain.moe.policies import LRU
from lazytrain.moe.predictor import PredictorHeads
from lazytrain.moe.stats import MoeCounters

PROMPT = [5, 17, 3, 99, 45, 12]


def _io_threads() -> int:
    return sum(t.name.startswith("lazytrain-moe-io") for t in threading.enumerate())


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


# ---- 1. generation_config.json --------------------------------------------------------------------
def test_checkpoint_generation_config_is_used(tiny_moe, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = tiny_moe("mixtral")
    first = _greedy(model, PROMPT, 1)[0]
    # An eos list (Qwen3-MoE's [151645, 151643]) and a repetition penalty, only in generation_config.json.
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, first], repetition_penalty=1.3)
    model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "store")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert _greedy(ref, PROMPT, 8) == [first]                 # stops at the second eos id
    for model_path in (None, tmp_path / "hf"):
        got = generate(tmp_path / "store", prompt_ids=PROMPT, max_new_tokens=8, model_path=model_path)
        assert got.token_ids == [first]

    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, repetition_penalty=1.3)
    convert_model(model, tmp_path / "store2")                 # the in-memory model's own config
    want = _greedy(model, PROMPT, 24)
    assert want != _greedy(tiny_moe("mixtral"), PROMPT, 24)   # the penalty changes the output
    assert generate(tmp_path / "store2", prompt_ids=PROMPT, max_new_tokens=24).token_ids == want


# ---- 2. a prefetch skipped between acquire's checks is not a hit -----------------------------------
def test_prefetch_skipped_during_acquire_is_not_a_hit(mixtral_store):
    """The worker skips a cancelled prefetch just after acquire un-cancels it and before its hit check
    (a GIL switch there, forced with a blocking `cancelled` read in the worker and an Event whose
    is_set yields to the worker): the forward must wait for a re-read, not compute on the empty slot."""
    import lazytrain.moe.cache as cache_mod

    _, d = mixtral_store
    st = ExpertStore(d / "store")
    gate, at_check, go = threading.Event(), threading.Event(), threading.Event()
    real = st.read_into
    main = threading.current_thread()

    def read_into(layer, expert, buf):
        if (layer, expert) == (0, 0):
            gate.wait(10)                    # hold the only worker so (1, 5) stays queued
        return real(layer, expert, buf)

    class Req(cache_mod.ReadRequest):       # the worker pauses right after reading cancelled=True
        @property
        def cancelled(self):
            v = self.__dict__["_c"]
            if threading.current_thread() is not main and v:
                at_check.set()
                go.wait(10)
            return v

        @cancelled.setter
        def cancelled(self, v):
            self.__dict__["_c"] = v
            if threading.current_thread() is main and not v:
                self.event.armed = True

    class Ev(threading.Event):              # main's first is_set after the un-cancel: the worker runs
        armed = False

        def is_set(self):
            r = super().is_set()
            if threading.current_thread() is main and self.armed:
                self.armed = False
                go.set()
                super().wait(10)
            return r

    st.read_into = read_into
    cache = ExpertCache(st, 16, LRU(), io_workers=1)
    try:
        c = MoeCounters()
        cache.prefetch(0, [0], deadline=1, now=0, c=c)
        cache.prefetch(1, [5], deadline=5, now=0, c=c)
        req = cache.pending[(1, 5)]
        req.__dict__["_c"] = req.__dict__.pop("cancelled")
        req.__class__, req.event = Req, Ev()
        w = cache.acquire(1, [2], now=1, c=c)   # routing picked expert 2: the (1, 5) prefetch is cancelled
        gate.set()
        cache.wait(w, c)
        cache.unpin()
        assert at_check.wait(10)                # the worker has read cancelled=True for (1, 5)
        hits0 = c.hits
        w2 = cache.acquire(1, [5], now=2, c=c)
        cache.wait(w2, c)
        assert req.state == "skipped" and c.hits == hits0 and len(w2) == 1
        lr = st.layers[1]
        with open(st.dir / lr.file, "rb") as f:
            f.seek(5 * lr.record_bytes)
            want = f.read(lr.record_bytes)
        assert cache.pool[cache.slot_of[(1, 5)]].numpy().tobytes()[:lr.record_bytes] == want
    finally:
        go.set()
        gate.set()
        cache.unpin()
        cache.close()
        st.close()


# ---- 3. a failed load_streamed leaves no I/O threads ----------------------------------------------
def test_failed_load_streamed_leaks_no_io_threads(mixtral_store, tmp_path, monkeypatch):
    import lazytrain.moe.engine as engine_mod

    _, d = mixtral_store
    before = _io_threads()
    with pytest.raises(FileNotFoundError):
        load_streamed(d / "store", prefetch="predictor", predictor_path=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="unknown moe.prefetch"):
        load_streamed(d / "store", prefetch="bogus")

    def boom(*a, **k):
        raise RuntimeError("attach failed")

    monkeypatch.setattr(engine_mod.StreamedMoE, "__init__", boom)   # a failure after the cache exists
    with pytest.raises(RuntimeError, match="attach failed"):
        load_streamed(d / "store")
    assert _io_threads() == before


# ---- 4. use after close raises -------------------------------------------------------------------
def test_engine_used_after_close_raises(mixtral_store):
    _, d = mixtral_store
    eng = load_streamed(d / "store", cache_slots=8, prefetch="none")
    eng.close()
    box = {}

    def use():
        try:
            eng.generate(torch.tensor([[1, 2, 3]]), 2)
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            box["err"] = e

    t = threading.Thread(target=use, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "generate after close() hangs"
    assert isinstance(box.get("err"), RuntimeError) and "closed" in str(box["err"])
    with pytest.raises(RuntimeError, match="closed"):
        eng.cache.prefetch(0, [1], deadline=1, now=0, c=MoeCounters())


# ---- 5. convert_model on tied embeddings ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_convert_model_tied_embeddings(kind, tiny_moe, tmp_path):
    model = tiny_moe(kind, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    convert_model(model, tmp_path / "s")
    p = torch.tensor([[3, 4, 5]])
    eng = load_streamed(tmp_path / "s", cache_slots=10)
    try:
        assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight
        assert eng.generate(p, 8).tolist() == model.generate(p, max_new_tokens=8, do_sample=False).tolist()
    finally:
        eng.close()


# ---- 6. a predictor of another hidden size is refused --------------------------------------------
def test_predictor_of_other_hidden_size_refused(mixtral_store, tmp_path):
    _, d = mixtral_store
    path = PredictorHeads(32, [8] * 4).save(tmp_path / "p32.safetensors")   # the model's hidden size is 64
    before = _io_threads()
    with pytest.raises(ValueError, match="hidden size 32.*64.*retrain"):
        load_streamed(d / "store", prefetch="predictor", predictor_path=path)
    assert _io_threads() == before


# ---- 7. CLI: one error line, exit 2 ---------------------------------------------------------------
def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [l for l in err if l.startswith("lazytrain ")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err)
    return lines[0]


def test_moe_inspect_without_store(capsys):
    assert moe_cli.main(["inspect"]) == 2
    assert "moe.store=STORE_DIR" in _err_line(capsys)


@pytest.mark.parametrize("args, msg", [
    (["moe.cache_slots=abc"], "moe.cache_slots must be a positive integer"),
    (["moe.cache_slots=9.5"], "moe.cache_slots must be a positive integer"),
    (["moe.queue_depth=abc"], "moe.queue_depth must be a positive integer"),
    (["moe.queue_depth=0"], "moe.queue_depth must be a positive integer"),
    (["prompt_ids=[1,500]"], "prompt id 500 is outside the vocabulary [0, 128)"),
    (["prompt_ids=[-3]"], "prompt id -3 is outside the vocabulary [0, 128)"),
    (["moe.device=gpu"], "moe.device must be cpu or cuda"),
    (["prompt_ids=[]"], "prompt_ids=[] is empty"),
])
def test_generate_bad_input_one_line(mixtral_store, args, msg, capsys):
    _, d = mixtral_store
    before = _io_threads()
    argv = [f"moe.store={d / 'store'}", "prompt_ids=[1,2]", "max_new_tokens=2", *args]
    assert gen_cli.main(argv) == 2
    assert msg in _err_line(capsys)
    assert _io_threads() == before


def test_cuda_without_cuda_one_line(mixtral_store, monkeypatch, capsys):
    _, d = mixtral_store
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gen_cli.main([f"moe.store={d / 'store'}", "prompt_ids=[1,2]", "max_new_tokens=2",
                         "moe.device=cuda"]) == 2
    assert "CUDA is not available" in _err_line(capsys)


def test_corrupt_files_named_one_line(mixtral_store, tmp_path, capsys):
    _, d = mixtral_store
    bad = tmp_path / "bad"
    shutil.copytree(d / "store", bad)
    (bad / "non_expert.safetensors").write_bytes(b"\x00" * 64)
    assert gen_cli.main([f"moe.store={bad}", "prompt_ids=[1,2]", "max_new_tokens=2"]) == 2
    assert str(bad / "non_expert.safetensors") in _err_line(capsys)

    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a safetensors file\n")
    assert gen_cli.main([f"moe.store={d / 'store'}", "prompt_ids=[1,2]", "max_new_tokens=2",
                         "moe.prefetch=predictor", f"moe.predictor={junk}"]) == 2
    assert str(junk) in _err_line(capsys)


def test_train_predictor_says_what_to_do(mixtral_store, tiny_moe, tmp_path):
    """Too little text, or a model with one MoE layer, used to fail inside torch (an empty cat, an
    empty parameter list) with nothing to act on."""
    from lazytrain.moe.api import train_predictor

    def refused(store, n_tokens, seq_len, match):
        eng = load_streamed(store, cache_slots=16, prefetch="none")
        try:
            with pytest.raises(ValueError, match=match):
                train_predictor(eng, list(range(n_tokens)), tmp_path / "p.safetensors", seq_len=seq_len)
        finally:
            eng.close()

    _, d = mixtral_store
    refused(d / "store", 50, 128, "less than one sequence of seq_len=128; give more text")
    convert_model(tiny_moe("mixtral", num_hidden_layers=1), tmp_path / "one")
    refused(tmp_path / "one", 300, 32, "1 MoE layer.*needs at least 2")


# ---- review of 2026-11-30 (evening) -----------------------------------------------------------------
def test_reconverting_into_a_store_leaves_nothing_of_the_old_one(tiny_moe, tmp_path):
    """A's generation config (repetition penalty) and its extra layer's experts file must not
    outlive it when B, with fewer layers and no generation_config.json, is converted into the
    same dir: streamed B equals plain B. A dir holding other files is refused, untouched."""
    import os

    from transformers import AutoModelForCausalLM, GenerationConfig

    a = tiny_moe("mixtral", seed=1)
    a.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, repetition_penalty=1.5)
    a.save_pretrained(tmp_path / "A")
    b = tiny_moe("mixtral", seed=0, num_hidden_layers=3)
    b.save_pretrained(tmp_path / "B")
    os.remove(tmp_path / "B" / "generation_config.json")
    store = tmp_path / "store"
    convert_checkpoint(tmp_path / "A", store)
    assert (store / "generation_config.json").is_file() and (store / "experts-L003.bin").is_file()
    convert_checkpoint(tmp_path / "B", store)
    assert not (store / "generation_config.json").exists() and not (store / "experts-L003.bin").exists()
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "B").eval()
    assert generate(store, prompt_ids=PROMPT, max_new_tokens=16).token_ids == _greedy(ref, PROMPT, 16)

    other = tmp_path / "mine"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(Exception, match="holds other files and no expert store"):
        convert_checkpoint(tmp_path / "B", other)
    with pytest.raises(Exception, match="model.path itself"):
        convert_checkpoint(tmp_path / "B", tmp_path / "B")       # out= the model's own dir
    assert (other / "config.json").read_text() == "{}" and (tmp_path / "B" / "config.json").is_file()


def test_a_failed_expert_read_leaves_no_slot_pinned(tiny_moe, tmp_path, monkeypatch):
    """A transient read error fails that call only: the next one (with the minimum cache, one
    layer's experts) runs and is exact, instead of 'no free expert slot ... raise moe.cache_slots'."""
    model = tiny_moe("mixtral")
    convert_model(model, tmp_path / "s")
    real = ExpertStore.read_into
    fail = {"n": 1}

    def flaky(self, layer, expert, buf):
        if layer == 1 and fail["n"] > 0:
            fail["n"] -= 1
            raise OSError(5, "Input/output error (simulated)")
        return real(self, layer, expert, buf)

    monkeypatch.setattr(ExpertStore, "read_into", flaky)
    eng = load_streamed(tmp_path / "s", cache_slots=8, prefetch="none")
    try:
        p = torch.tensor([PROMPT])
        with pytest.raises(OSError, match="simulated"):
            eng.generate(p, 4)
        assert not eng.cache.pinned
        want = model.generate(p, max_new_tokens=4, do_sample=False).tolist()
        assert eng.generate(p, 4).tolist() == want
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["glm4_moe", "ernie4_5_moe"])
def test_bf16_checkpoint_with_fp32_router_streams_exactly(family, tmp_path):
    """bf16 checkpoints of models HF keeps routers of in fp32 (_keep_in_fp32_modules_strict) hold
    F32 tensors before BF16 ones: the store is bf16 and the router stays fp32, as from_pretrained."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.for_model(family)
    over = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_k=2,
                max_position_embeddings=256, first_k_dense_replace=1, n_group=1, topk_group=1,
                n_shared_experts=1, moe_layer_start_index=1)
    cfg = AutoConfig.for_model(family, **{k: v for k, v in over.items() if hasattr(base, k)})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16", "F32"}
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    convert_checkpoint(tmp_path / "hf", tmp_path / "s")
    eng = load_streamed(tmp_path / "s", cache_fraction=0.5)
    try:
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            assert torch.equal(eng.model(ids).logits, ref(ids).logits)
    finally:
        eng.close()


def test_gpt_oss_streams_exactly(tmp_path):
    """Experts modules without an act_fn (gpt_oss computes its own activation) stream too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    convert_model(model, tmp_path / "s")
    eng = load_streamed(tmp_path / "s", cache_fraction=0.5)
    try:
        ids = torch.tensor([PROMPT])
        assert eng.generate(ids, 6).tolist() == model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    finally:
        eng.close()


def test_an_engine_dropped_without_close_frees_threads_pool_and_files(tiny_moe, tmp_path):
    import gc
    import os
    import weakref

    convert_model(tiny_moe("mixtral"), tmp_path / "s")
    threads0 = _io_threads()
    refs = []
    for _ in range(3):
        eng = load_streamed(tmp_path / "s", cache_fraction=1.0)
        eng.generate(torch.tensor([[1, 2, 3]]), 2)
        refs.append(weakref.ref(eng.cache))
        del eng
    gc.collect()
    assert all(r() is None for r in refs)
    for _ in range(100):   # the woken workers exit
        if _io_threads() == threads0:
            break
        threading.Event().wait(0.02)
    assert _io_threads() == threads0
    fds = [os.path.realpath(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")] \
        if os.path.isdir("/proc/self/fd") else []
    assert not [f for f in fds if f.startswith(str(tmp_path))]


def test_a_predictor_whose_metadata_disagrees_with_its_tensors_is_one_clear_error(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = PredictorHeads(64, [8] * 4).save(tmp_path / "p.safetensors")
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta["lazytrain_predictor"])
    save_file(tensors, str(path), metadata={"lazytrain_predictor": json.dumps(dict(info, width=64))})
    with pytest.raises(ValueError, match="is damaged .*retrain it"):
        PredictorHeads.load(path)
    save_file(tensors, str(path), metadata={"lazytrain_predictor": "{not json"})
    with pytest.raises(ValueError, match="is damaged"):
        PredictorHeads.load(path)


# ---- review of 2026-11-30 (night) -------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_prefetch_precision_is_at_most_one_in_every_phase(tiny_moe, tmp_path, n):
    """A prefetch issued in the prefill (a one-token prompt: the gate prefetches there too) and used in
    the decode was counted as used by the decode, issued by the prefill: decode precision up to
    150% (8 layers, prompt [35], 2 new tokens). A use now counts for the phase that issued the prefetch."""
    convert_model(tiny_moe("mixtral", num_hidden_layers=8), tmp_path / "s")
    eng = load_streamed(tmp_path / "s", prefetch="gate")
    try:
        for prompt in ([35], [70], [3, 35], PROMPT):
            res = generate(tmp_path / "s", prompt_ids=prompt, max_new_tokens=n, engine=eng)
            for s in (res.prefill_stats, res.stats):
                assert 0.0 <= s.prefetch_precision <= 1.0 and 0.0 <= s.prefetch_recall <= 1.0, s.line()
            cs = eng.counters.values()
            assert sum(c.prefetch_used for c in cs) <= sum(c.prefetch_issued for c in cs)
    finally:
        eng.close()


def test_store_of_other_weights_than_model_path_refused(tiny_moe, tmp_path, capsys):
    """model.path gives only config, tokenizer and generation config; the weights served are the
    store's. A store converted from checkpoint A, run with model.path=B (same config, other seed),
    answered with A's tokens: now a one-line StoreMismatchError that says how to reconvert."""
    from transformers import AutoModelForCausalLM

    tiny_moe("mixtral", seed=0).save_pretrained(tmp_path / "A")
    tiny_moe("mixtral", seed=1).save_pretrained(tmp_path / "B")
    store = tmp_path / "store"
    convert_checkpoint(tmp_path / "A", store)
    with pytest.raises(StoreMismatchError, match=r"converted from other weights than model\.path .*B.*"
                       r"`lazytrain moe convert model\.path=.*B out=.*store`"):
        generate(store, prompt_ids=PROMPT, max_new_tokens=4, model_path=tmp_path / "B")
    assert gen_cli.main([f"model.path={tmp_path / 'B'}", f"moe.store={store}", "prompt_ids=[1,2]",
                         "max_new_tokens=2"]) == 2
    assert re.search(r"\(\S+\.weight differs\); reconvert: `lazytrain moe convert", _err_line(capsys))

    want = _greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "A").eval(), PROMPT, 12)
    got = generate(store, prompt_ids=PROMPT, max_new_tokens=12, model_path=tmp_path / "A").token_ids
    assert got == want
    config_only = tmp_path / "config_only"                  # nothing to compare: not checked
    config_only.mkdir()
    shutil.copy2(tmp_path / "A" / "config.json", config_only)
    assert generate(store, prompt_ids=PROMPT, max_new_tokens=12, model_path=config_only).token_ids == want


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])     # per-expert keys, fused keys
@pytest.mark.parametrize("where", ["first", "last"])
def test_store_whose_experts_differ_from_model_path_refused(kind, where, tiny_moe, tmp_path):
    """Same non-expert weights, one row of expert 0 changed (the first or the last MoE layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind == "gpt_oss":
        cfg = AutoConfig.for_model("gpt_oss", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=128, num_local_experts=8, num_experts_per_tok=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
    else:
        model = tiny_moe(kind)
    model.save_pretrained(tmp_path / "A")
    convert_checkpoint(tmp_path / "A", tmp_path / "store")
    layer = 0 if where == "first" else model.config.num_hidden_layers - 1
    experts = model.model.layers[layer].mlp.experts
    with torch.no_grad():
        p = experts.gate_up_proj if where == "first" else experts.down_proj
        p[0, -1 if where == "first" else 0, 0] += 1.0
    model.save_pretrained(tmp_path / "B")
    name = f"model.layers.{layer}.mlp.experts.{'gate_up_proj' if where == 'first' else 'down_proj'}"
    with pytest.raises(StoreMismatchError, match=rf"{name} expert 0 differs"):
        load_streamed(tmp_path / "store", model_path=tmp_path / "B")
    load_streamed(tmp_path / "store", model_path=tmp_path / "A").close()


def test_store_whose_other_experts_differ_from_model_path_refused(tiny_moe, tmp_path):
    """An expert-only fine-tune of the store's checkpoint (every other tensor the same, expert 0
    too), in a middle MoE layer: the store's model answered for model.path's until every expert of
    every layer was compared (review, 2026-12-01)."""
    model = tiny_moe("mixtral")
    model.save_pretrained(tmp_path / "A")
    convert_checkpoint(tmp_path / "A", tmp_path / "store")
    layer = model.config.num_hidden_layers // 2
    with torch.no_grad():
        model.model.layers[layer].mlp.experts.down_proj[3:] *= -1.0
    model.save_pretrained(tmp_path / "B")
    with pytest.raises(StoreMismatchError, match=rf"model.layers.{layer}.mlp.experts.down_proj expert 3 differs"):
        load_streamed(tmp_path / "store", model_path=tmp_path / "B")


def test_review_fixes_in_place_convert_and_a_store_in_another_dtype(tiny_moe, tmp_path):
    """Converting into model.path itself (or a model dir with a store's files in it) is refused
    and deletes nothing; a store made from the same weights in bf16 serves an fp32 model.path."""
    from lazytrain.moe import StoreError

    model = tiny_moe("mixtral")
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    (hf / "tokenizer.json").write_text("{}")
    for out in (hf, tmp_path / "hf" / "."):
        with pytest.raises(StoreError, match="model.path itself|holds other files"):
            convert_checkpoint(hf, out)
    (hf / "index.json").write_text("{}")                       # a store's file left in it
    with pytest.raises(StoreError, match="holds other files"):
        convert_model(model, hf)
    assert (hf / "tokenizer.json").is_file() and (hf / "generation_config.json").is_file()

    def bf16(m):   # parameters only, as from_pretrained(dtype=bf16) (rotary inv_freq stays fp32)
        for p in m.parameters():
            p.data = p.data.to(torch.bfloat16)
        return m

    convert_model(bf16(tiny_moe("mixtral")), tmp_path / "s16")
    eng = load_streamed(tmp_path / "s16", model_path=hf)       # the same weights, rounded: served
    eng.close()
    with pytest.raises(Exception, match="other weights than model.path"):
        convert_model(bf16(tiny_moe("mixtral", seed=5)), tmp_path / "other")
        load_streamed(tmp_path / "other", model_path=hf)


def test_store_index_offsets_and_config_are_checked(tiny_moe, tmp_path):
    """What the records' checksums do not cover: a tensor offset in index.json (another tensor's
    bytes were served) and the store's config.json (an edited top-k changed the output), both
    accepted until 2026-12-01 (review), now refused at load."""
    from lazytrain.moe import StoreError, convert_model

    model = tiny_moe("mixtral")
    convert_model(model, tmp_path / "store")
    load_streamed(tmp_path / "store").close()
    idx = tmp_path / "store" / "index.json"
    good = idx.read_text()
    d = json.loads(good)
    d["layers"][1]["tensors"][-1]["offset"] = 0
    idx.write_text(json.dumps(d))
    with pytest.raises(StoreError, match=r"malformed .*tensor offsets \[0, 0\]"):
        load_streamed(tmp_path / "store")
    idx.write_text(good)
    cfg = tmp_path / "store" / "config.json"
    c = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**c, "num_experts_per_tok": c["num_experts_per_tok"] + 1}))
    with pytest.raises(StoreMismatchError, match="is not the config the store was converted with"):
        load_streamed(tmp_path / "store")


def test_convert_model_refuses_a_model_whose_rotary_buffer_was_cast(tiny_moe, tmp_path):
    """model.to(torch.bfloat16) rounds the rotary inv_freq (non-persistent: in no store; the
    streamed model rebuilds it in fp32), so the streamed logits were 0.015 off the model's (review):
    refused, saying how to convert instead; the same model loaded in bf16 converts and is exact."""
    from lazytrain.moe import StoreError, convert_model
    from transformers import AutoModelForCausalLM

    model = tiny_moe("mixtral")
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(StoreError, match=r"rotary_emb.inv_freq is bfloat16 where its module builds it float32"):
        convert_model(model.to(torch.bfloat16), tmp_path / "cast")
    assert not (tmp_path / "cast" / "index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    convert_model(loaded, tmp_path / "store")
    _assert_streamed_logits_equal(tmp_path / "store", loaded)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}])
def test_convert_model_after_a_long_forward_with_dynamic_rope(tiny_moe, tmp_path, rope):
    """Dynamic NTK RoPE rewrites its inv_freq in a forward longer than max_position_embeddings
    (transformers' dynamic_rope_update): a model that ran one was refused as if cast with
    model.to(dtype) until 2026-12-01. Its original_inv_freq is what the module builds from the
    config, so that is what is compared; a cast is still caught through it, and the streamed model
    (a fresh rotary module, as from_pretrained gives) matches the model reloaded from its weights."""
    from lazytrain.moe import StoreError, convert_model
    from transformers import AutoModelForCausalLM

    model = tiny_moe("mixtral", head_dim=16, max_position_embeddings=16, rope_parameters={**rope, "rope_theta": 10000.0})
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 40)))        # longer than max_position_embeddings
    convert_model(model, tmp_path / "store")
    model.save_pretrained(tmp_path / "hf")
    _assert_streamed_logits_equal(tmp_path / "store", AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval())
    with pytest.raises(StoreError, match=r"rotary_emb.(original_)?inv_freq is bfloat16 where its module builds it float32"):
        convert_model(model.to(torch.bfloat16), tmp_path / "cast")


def _assert_streamed_logits_equal(store, model):
    eng = load_streamed(store)
    try:
        ids = torch.tensor([PROMPT])
        assert torch.equal(eng.model(ids).logits, model(ids).logits)
    finally:
        eng.close()
