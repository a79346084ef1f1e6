"""MoE serving review (2026-12-01): a changed byte in non_expert.safetensors generated other tokens
silently, a damaged crc list was an IndexError, a failed convert left layers behind, and inputs that
ended in tracebacks (prompt_ids=5, a negative prefetch_extra, out= a directory after training)."""

import json
import shutil

import pytest

from lazytrain.cli import generate as gen_cli
from lazytrain.moe import StoreError, StoreMismatchError, convert_checkpoint, load_streamed

ARGS = ["prompt_ids=[1,2]", "max_new_tokens=2"]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_changed_byte_in_the_non_expert_weights_is_refused(mixtral_store, tmp_path, capsys):
    _, d = mixtral_store
    bad = tmp_path / "bad"
    shutil.copytree(d / "store", bad)
    p = bad / "non_expert.safetensors"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x40          # inside a tensor's data: the file still parses
    p.write_bytes(bytes(raw))
    with pytest.raises(StoreMismatchError, match="checksum mismatch: .*non_expert.safetensors"):
        load_streamed(bad, cache_slots=16, prefetch="none")
    assert gen_cli.main([f"moe.store={bad}", *ARGS]) == 2
    assert "the store is corrupt, reconvert" in _err_line(capsys)
    eng = load_streamed(bad, cache_slots=16, prefetch="none", verify="never")   # the user's choice
    eng.close()


def test_an_index_with_a_short_crc_list_is_a_store_error(mixtral_store, tmp_path):
    _, d = mixtral_store
    bad = tmp_path / "bad"
    shutil.copytree(d / "store", bad)
    idx = json.loads((bad / "index.json").read_text())
    idx["layers"][0]["crc32"] = idx["layers"][0]["crc32"][:3]
    (bad / "index.json").write_text(json.dumps(idx))
    with pytest.raises(StoreError, match="malformed .*3 checksums for 8 experts.*reconvert"):
        load_streamed(bad, cache_slots=16, prefetch="none")


@pytest.mark.parametrize("args, msg", [
    (["prompt_ids=5"], "prompt_ids must be a list of token ids"),
    (["prompt_ids=[a,b]"], "prompt_ids must be a list of token ids"),
    (["moe.prefetch_extra=-3"], "moe.prefetch_extra must be a whole number >= 0"),
    (["moe.lookahead=1.7"], "moe.lookahead must be a whole number >= 1"),
    (["moe.verify=bogus"], "moe.verify must be first|always|never"),
])
def test_generate_inputs_that_were_tracebacks(mixtral_store, args, msg, capsys):
    _, d = mixtral_store
    assert gen_cli.main([f"moe.store={d / 'store'}", *ARGS, *args]) == 2
    assert msg in _err_line(capsys)


def test_a_convert_missing_an_expert_writes_nothing(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_moe("mixtral")
    model.save_pretrained(tmp_path / "hf")
    (f,) = (tmp_path / "hf").glob("*.safetensors")
    sd = load_file(str(f))
    key = next(k for k in sd if "layers.2." in k and "experts" in k)
    del sd[key]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(StoreError, match="no weights for model.layers.2"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_train_predictor_out_and_max_tokens_are_checked_before_training(mixtral_store, tmp_path):
    from lazytrain.moe.api import train_predictor

    _, d = mixtral_store
    eng = load_streamed(d / "store", cache_slots=16, prefetch="none")
    try:
        with pytest.raises(ValueError, match="is a directory"):
            train_predictor(eng, list(range(400)), tmp_path, seq_len=32)
        with pytest.raises(ValueError, match="max_tokens=100 is less than one sequence of seq_len=128"):
            train_predictor(eng, list(range(439)), tmp_path / "p.safetensors", seq_len=128, max_tokens=100)
    finally:
        eng.close()


def test_convert_into_a_file_is_one_line(tiny_moe, tmp_path):
    from lazytrain.moe import convert_model

    f = tmp_path / "afile"
    f.write_text("mine")
    with pytest.raises(StoreError, match="is a file; convert into a new or empty directory"):
        convert_model(tiny_moe("mixtral"), f)
    assert f.read_text() == "mine"


# ---- a review of the fixes above ----------------------------------------------------------------
def test_api_checks_prefetch_extra_and_verify_before_loading_the_model(mixtral_store, monkeypatch):
    import lazytrain.moe.engine as E

    _, d = mixtral_store
    with pytest.raises(ValueError, match="moe.prefetch_extra must be a whole number >= 0, got -3"):
        load_streamed(d / "store", cache_slots=16, prefetch="gate", prefetch_extra=-3)

    def never(*a, **k):
        raise AssertionError("the model was built before the settings were checked")
    monkeypatch.setattr(E, "build_meta_model", never)
    with pytest.raises(ValueError, match="moe.verify must be first|always|never"):
        load_streamed(d / "store", cache_slots=16, prefetch="none", verify="bogus")


def test_quoted_whole_numbers_are_taken():
    from lazytrain.moe.cliutil import whole_setting
    assert whole_setting("moe.lookahead", "3", 1) == 3 and whole_setting("moe.prefetch_extra", 2.0, 0) == 2


def test_predictor_and_store_paths_expand_home_and_new_dirs(mixtral_store, tiny_moe, tmp_path, monkeypatch):
    """out=~/p.safetensors was written to ./~/; a new sub-directory was refused (save makes it)."""
    from lazytrain.moe import convert_model
    from lazytrain.moe.api import train_predictor

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    convert_model(tiny_moe("mixtral"), "~/st")
    assert (tmp_path / "st" / "index.json").is_file() and not (tmp_path / "~").exists()
    _, d = mixtral_store
    eng = load_streamed(d / "store", cache_slots=16, prefetch="none")
    try:
        train_predictor(eng, [i % 128 for i in range(300)], "~/new/p.safetensors", seq_len=32, max_tokens=200, steps=2,
                        log=lambda *_: None)
    finally:
        eng.close()
    assert (tmp_path / "new" / "p.safetensors").is_file()


def test_a_store_dir_with_another_safetensors_is_refused_as_holding_weights(mixtral_store, tiny_moe, tmp_path):
    from lazytrain.moe import convert_model

    _, d = mixtral_store
    st = tmp_path / "st"
    shutil.copytree(d / "store", st)
    (st / "predictor.safetensors").write_bytes(b"x")
    with pytest.raises(StoreError, match="than a store's: model weights"):
        convert_model(tiny_moe("mixtral"), st)
