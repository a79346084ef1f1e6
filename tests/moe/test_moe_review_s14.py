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
