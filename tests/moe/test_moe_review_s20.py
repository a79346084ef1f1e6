"""MoE serving review (2026-12-01, second): checkpoints whose tensors are not all in the model's
dtype (from_pretrained casts them; generate crashed, convert failed mid-write), an index.json that
is not an object or was edited, max_new_tokens=2.7 and a prefill byte count one short."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lazytrain.cli import generate as gen_cli
from lazytrain.cli import moe as moe_cli
from lazytrain.moe import StoreError, StoreMismatchError, load_streamed

PROMPT = [5, 17, 3, 99, 42, 7]


def _plain_tokens(hf, n=8):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf).eval()
    return ref, ref.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT):].tolist()


def _generate(capsys, *args) -> list[int]:
    capsys.readouterr()   # (convert's output)
    rc = gen_cli.main([*args, f"prompt_ids={PROMPT}", "max_new_tokens=8", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)["token_ids"]


def _restore(hf, pick, to):
    f = hf / "model.safetensors"
    sd = load_file(str(f))
    n = 0
    for k in sd:
        if pick(k):
            sd[k], n = sd[k].to(to), n + 1
    save_file(sd, str(f), metadata={"format": "pt"})
    assert n


@pytest.mark.parametrize("which", ["gate.weight", "norm.weight", "lm_head.weight"])
def test_non_expert_weights_stored_fp32_in_a_bf16_checkpoint_are_cast_as_from_pretrained_does(tiny_moe, tmp_path, capsys, which):
    hf = tmp_path / "hf"
    tiny_moe("mixtral").to(torch.bfloat16).save_pretrained(hf)
    _restore(hf, lambda k: k.endswith(which) and "experts" not in k, torch.float32)
    ref, want = _plain_tokens(hf)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={tmp_path / 'st'}"]) == 0
    assert _generate(capsys, f"model.path={hf}", f"moe.store={tmp_path / 'st'}") == want


def test_experts_stored_in_another_dtype_are_converted_to_the_models(tiny_moe, tmp_path, capsys):
    hf, st = tmp_path / "hf", tmp_path / "st"
    tiny_moe("mixtral").to(torch.bfloat16).save_pretrained(hf)
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={st}"]) == 0
    _restore(hf, lambda k: "layers.3." in k and "experts" in k, torch.float32)
    _, want = _plain_tokens(hf)
    # (was: an error after the old store's files were deleted)
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={st}"]) == 0
    assert json.loads((st / "index.json").read_text())["layers"][3]["tensors"][0]["dtype"] == "bfloat16"
    assert _generate(capsys, f"model.path={hf}", f"moe.store={st}") == want


def test_an_fp32_checkpoint_whose_config_says_bf16_runs_in_bf16_as_from_pretrained(tiny_moe, tmp_path):
    hf, st = tmp_path / "hf", tmp_path / "st"
    tiny_moe("mixtral").save_pretrained(hf)   # fp32 tensors
    cfg = json.loads((hf / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (hf / "config.json").write_text(json.dumps(cfg))
    ref, _ = _plain_tokens(hf)
    assert ref.dtype == torch.bfloat16
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={st}"]) == 0
    eng = load_streamed(st, model_path=hf, cache_slots=32, prefetch="none")
    try:
        with torch.no_grad():
            got, exp = eng.model(torch.tensor([PROMPT])).logits, ref(torch.tensor([PROMPT])).logits
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, exp)
    finally:
        eng.close()


def test_a_misshapen_expert_is_refused_before_the_old_store_is_touched(tiny_moe, tmp_path, capsys):
    hf, st = tmp_path / "hf", tmp_path / "st"
    tiny_moe("mixtral").save_pretrained(hf)
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={st}"]) == 0
    before = {p.name: p.read_bytes() for p in st.iterdir()}
    f = hf / "model.safetensors"
    sd = load_file(str(f))
    key = next(k for k in sd if "layers.2." in k and "experts" in k and sd[k].dim() >= 2)
    sd[key] = sd[key][..., :-1].contiguous()
    save_file(sd, str(f), metadata={"format": "pt"})
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={st}"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.2.mlp.experts" in err and "expert" in err and "the model's" in err, err
    assert {p.name: p.read_bytes() for p in st.iterdir()} == before


@pytest.mark.parametrize("payload", ["[]", '"a string"', "3"])
def test_an_index_that_is_not_a_json_object_is_a_store_error(mixtral_store, tmp_path, payload):
    _, d = mixtral_store
    bad = tmp_path / "bad"
    shutil.copytree(d / "store", bad)
    (bad / "index.json").write_text(payload)
    with pytest.raises(StoreError, match="malformed .*not an object.*reconvert"):
        load_streamed(bad, cache_slots=16, prefetch="none")


@pytest.mark.parametrize("edit", ["swap_files", "dtype"])
def test_edited_layer_records_are_refused(tiny_moe, tmp_path, edit):
    hf, bad = tmp_path / "hf", tmp_path / "bad"
    tiny_moe("mixtral").to(torch.bfloat16).save_pretrained(hf)
    assert moe_cli.main(["convert", f"model.path={hf}", f"out={bad}"]) == 0
    load_streamed(bad, cache_slots=16, prefetch="none").close()   # as written: accepted
    idx = json.loads((bad / "index.json").read_text())
    if edit == "swap_files":
        a, b = idx["layers"][0], idx["layers"][1]
        (a["file"], a["crc32"]), (b["file"], b["crc32"]) = (b["file"], b["crc32"]), (a["file"], a["crc32"])
    else:   # the same size: every structural check passes (other tokens, rc 0, before)
        for lay in idx["layers"]:
            for t in lay["tensors"]:
                t["dtype"] = "float16"
    (bad / "index.json").write_text(json.dumps(idx))
    with pytest.raises(StoreMismatchError, match="layer records are not the ones written"):
        load_streamed(bad, cache_slots=16, prefetch="none")


@pytest.mark.parametrize("arg, msg", [("max_new_tokens=2.7", "max_new_tokens must be a whole number >= 1"),
                                      ("moe.io_workers=0", "moe.io_workers must be a whole number >= 1"),
                                      ("moe.io_workers=1.5", "moe.io_workers must be a whole number >= 1")])
def test_fractional_counts_are_refused_not_truncated(mixtral_store, capsys, arg, msg):
    _, d = mixtral_store
    assert gen_cli.main([f"moe.store={d / 'store'}", "prompt_ids=[1,2]", arg]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err


def test_prefill_bytes_is_the_bytes_read(mixtral_store, capsys):
    _, d = mixtral_store
    store = d / "store"
    rec = json.loads((store / "index.json").read_text())["layers"][0]["record_bytes"]
    assert gen_cli.main([f"moe.store={store}", f"prompt_ids={list(range(1, 50))}", "max_new_tokens=1",
                         "moe.cache_slots=8", "moe.prefetch=none", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["prefill_bytes"] % rec == 0 and stats["prefill_bytes"] > 0, stats


@pytest.mark.parametrize("tokens, nbytes", [(49, 3 * 36864), (98, 3 * 36864), (9, 1511424)])
def test_prefill_bytes_is_the_count_not_a_product_of_floats(tokens, nbytes):
    from lazytrain.moe.api import GenerateResult
    from lazytrain.moe.stats import MoeCounters, MoeStats

    s = MoeStats.from_counters(MoeCounters(tokens=tokens, bytes_read=nbytes, demand=1, hits=1, wall_s=1.0),
                               8, 32, 36864, "O_DIRECT")
    assert GenerateResult([1], None, s, s).to_json()["stats"]["prefill_bytes"] == nbytes   # (110591 for 49)


def test_a_transient_read_error_is_read_again_on_the_next_call(mixtral_store):
    """Two demand reads fail at once (a transient I/O error): the first is raised, and the second
    stayed pending with its slot and raised its old error on the next call instead of reading."""
    model, d = mixtral_store
    eng = load_streamed(d / "store", cache_slots=16, prefetch="none")
    try:
        store = eng.cache.store
        real, failed = store.read_into, []

        def flaky(layer, expert, buf):
            if layer == 0 and len(failed) < 2:
                failed.append(expert)
                raise OSError(5, "simulated: Input/output error")
            return real(layer, expert, buf)
        store.read_into = flaky
        ids = torch.tensor([PROMPT])
        with pytest.raises(OSError, match="simulated"):
            with torch.no_grad():
                eng.model(ids)
        assert len(failed) == 2
        with torch.no_grad():
            got = eng.model(ids).logits
            want = model(ids).logits
        assert torch.equal(got, want)
    finally:
        eng.close()
